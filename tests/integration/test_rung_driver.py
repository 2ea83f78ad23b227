"""results/cpu-study-rungs/reproduce.sh: what it would run (DRY=1) over synthetic run folders."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from bench.fidelity_rungs import RUNGS
from tests.unit.test_bench_fidelity_rungs import write_finetune, write_run

REPO = Path(__file__).resolve().parents[2]
RUNG = RUNGS["m"]  # LAMB 3e-3 1e-2 3e-2, AdamW 3e-4 1e-3 3e-3; fine-tunes at seeds 1-3


def install_driver(root: Path) -> Path:
    """The driver, copied into `root` (its python: this interpreter's venv)."""
    script = root / "results" / "cpu-study-rungs" / "reproduce.sh"
    script.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(REPO / "results" / "cpu-study-rungs" / "reproduce.sh", script)
    if not (root / ".venv").exists():
        (root / ".venv").symlink_to(Path(sys.prefix))
    return script


def dry_run(root: Path, stages: str, **env_vars: str) -> list[str]:
    """The driver in `root`, listing what is pending."""
    script = install_driver(root)
    env = {**os.environ, "DRY": "1", "RUNGS": "m", "STAGES": stages, **env_vars}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def write_sweeps(root: Path) -> Path:
    """Both seed-1 sweeps, finished without checkpoints: best LRs LAMB 1e-2, AdamW 1e-3. The runs' folder."""
    runs = root / "results" / "runs"
    for lr, loss in (("3e-3", 4.6), ("1e-2", 3.9), ("3e-2", 7.0)):
        write_run(runs, "lamb", lr, "n2", 1, loss, rung=RUNG)
    for lr, loss in (("3e-4", 4.7), ("1e-3", 3.9), ("3e-3", 4.5)):
        write_run(runs, "adamw", lr, "n2", 1, loss, rung=RUNG)
    return runs


def test_a_finished_run_without_checkpoints_runs_again_before_its_fine_tunes(tmp_path: Path):
    runs = write_sweeps(tmp_path)
    # seed 2 kept its checkpoints: fine-tuned as it is
    (write_run(runs, "lamb", "1e-2", "n2", 2, 3.9, rung=RUNG) / "checkpoints").mkdir()
    lines = dry_run(tmp_path, "finetune")
    again = [line for line in lines if "again" in line]
    assert again == [
        "pending cpu-rung-m-lamb-lr1e-2-n2-s1 (again: its checkpoints are not here)",
        "pending cpu-rung-m-adamw-lr1e-3-n2-s1 (again: its checkpoints are not here)",
    ]
    # the best-LR runs' fine-tunes (3 seeds each); the sweeps' other LRs are not fine-tuned
    fine_tunes = [line.split("/")[2] for line in lines if line.startswith("pending fine-tune")]
    assert sorted(set(fine_tunes)) == [
        "cpu-rung-m-adamw-lr1e-3-n2-s1", "cpu-rung-m-lamb-lr1e-2-n2-s1", "cpu-rung-m-lamb-lr1e-2-n2-s2",
    ]  # fmt: skip
    assert len(fine_tunes) == 9
    assert lines[-1].startswith("2 pretraining runs pending")
    # ONLY=<regex> leaves the runs it does not name as they are
    only = [line for line in dry_run(tmp_path, "finetune", ONLY="adamw") if "again" in line]
    assert only == ["pending cpu-rung-m-adamw-lr1e-3-n2-s1 (again: its checkpoints are not here)"]
    # a DRY run moves nothing: the first runs' files stay where they were
    assert (runs / "cpu-rung-m-lamb-lr1e-2-n2-s1" / "summary.json").is_file()


def test_a_run_again_that_stopped_midway_stays_pending(tmp_path: Path):
    """After the move to first-run/ and a stop before the new summary, the run is still fine-tuned (pending).
    (A seed-1 sweep run in that state is resumed by its sweep stage, which sees no summary.)"""
    runs = write_sweeps(tmp_path)
    (runs / "cpu-rung-m-lamb-lr1e-2-n2-s1" / "checkpoints").mkdir()
    (runs / "cpu-rung-m-adamw-lr1e-3-n2-s1" / "checkpoints").mkdir()
    folder = write_run(runs, "lamb", "1e-2", "n2", 2, 3.9, rung=RUNG)
    (folder / "first-run").mkdir()
    for name in ("summary.json", "metrics.jsonl", "config.yaml"):
        (folder / name).rename(folder / "first-run" / name)
    (folder / "checkpoints").mkdir()  # the interrupted second run's
    lines = dry_run(tmp_path, "finetune")
    assert [line for line in lines if "again" in line] == [
        "pending cpu-rung-m-lamb-lr1e-2-n2-s2 (again: its checkpoints are not here)"
    ]
    assert sum(line.startswith(f"pending fine-tune {folder.relative_to(tmp_path)}/") for line in lines) == 3
    assert len([line for line in lines if line.startswith("pending fine-tune")]) == 9


def test_rung_m_ablations_run_lamb_itself_only_at_simulated_workers(tmp_path: Path):
    """Stage `ablation` of rung M: both ablations at both worker counts, LAMB itself (the peer's own
    trajectory, nothing compressed) only where the workers are simulated, the default and LAMB at 8
    simulated workers, then the fp32 server pass at 8 (seed 1); a finished one is not listed."""
    runs = write_sweeps(tmp_path)
    write_run(runs, "abl-ffnrows-onebit_lamb", "1e-2", "n2", 1, 3.9, rung=RUNG)
    pending = [
        line.removeprefix("pending ") for line in dry_run(tmp_path, "ablation") if line.startswith("pending")
    ]
    expected = []
    for seed in (1, 2, 3):
        for workers in ("n2", "sim32"):
            expected += [
                f"cpu-rung-m-abl-{arm}-onebit_lamb-lr1e-2-{workers}-s{seed}"
                for arm in ("ffnrows", "freeze1280")
            ]
            if workers == "sim32":
                expected.append(f"cpu-rung-m-abl-lamb-lr1e-2-sim32-s{seed}")
        expected.append(f"cpu-rung-m-onebit_lamb-lr1e-2-sim8-s{seed}")
        expected.append(f"cpu-rung-m-abl-lamb-lr1e-2-sim8-s{seed}")
    expected.append("cpu-rung-m-abl-fp32server-onebit_lamb-lr1e-2-sim8-s1")
    expected.append("cpu-rung-m-abl-fp32worker-onebit_lamb-lr1e-2-sim8-s1")
    expected += [f"cpu-rung-m-abl-2bitworker-onebit_lamb-lr1e-2-{w}-s1" for w in ("sim8", "sim32")]
    expected.append("cpu-rung-m-abl-fp32worker-onebit_lamb-lr1e-2-sim32-s1")
    assert pending == expected[1:]  # seed 1's ffnrows at 2 processes finished


FAKE_LAUNCHER = """#!/usr/bin/env bash
# the study's launcher, faked: the named run finishes at once from its template, with checkpoints
for arg; do case $arg in run_name=*) name=${arg#run_name=} ;; seed=*) seed=${arg#seed=} ;; esac; done
echo "pretrain $name seed=$seed" >> calls.log
mkdir -p "results/runs/$name/checkpoints"
cp "templates/$name"/* "results/runs/$name/"
"""

FAKE_FINETUNE = """import json, pathlib, sys
args = dict(arg.split("=", 1) for arg in sys.argv[1:])
out = pathlib.Path(args["output_dir"])
out.mkdir(parents=True, exist_ok=True)
seed = args["seeds"].strip("[]")
with open("calls.log", "a") as log:
    log.write(f"finetune {out} lr={args['task.lr']}\\n")
result = {"task": "sst2", "main_metric_key": "accuracy", "per_seed": {seed: {"accuracy": 0.8}}}
(out / "all_results.json").write_text(json.dumps(result))
"""


def test_a_best_lr_run_is_fine_tuned_before_the_next_run_starts(tmp_path: Path):
    """With stage finetune on and the SST-2 LR chosen, each run at its arm's best LR gets its fine-tunes as
    soon as it finishes (a machine's checkpoints may not outlive it); a run kept without checkpoints runs
    again, fine-tuned once; the loop's seed is the run's (not the fine-tunes')."""
    write_sweeps(tmp_path)
    templates = tmp_path / "templates"
    for optimizer, lr in (("lamb", "1e-2"), ("adamw", "1e-3")):
        for seed in (1, 2):
            write_run(templates, optimizer, lr, "n2", seed, 3.9, rung=RUNG)
    # the LR check on LAMB's seed-1 checkpoint: 1e-3 best, inside the planned LRs, so chosen
    for lr, accuracy in (("3e-4", 0.78), ("1e-3", 0.80), ("3e-3", 0.50)):
        check = tmp_path / "results" / "cpu-study-m" / f"finetune-lr{lr}" / "cpu-rung-m-lamb-lr1e-2-n2-s1"
        write_finetune(check, 1, accuracy)
    launcher = tmp_path / "launch" / "torchrun.sh"
    launcher.parent.mkdir()
    launcher.write_text(FAKE_LAUNCHER)
    launcher.chmod(0o755)
    (tmp_path / "finetune").mkdir()
    (tmp_path / "finetune" / "__main__.py").write_text(FAKE_FINETUNE)  # found before the project's
    script = install_driver(tmp_path)
    env = {**os.environ, "RUNGS": "m", "STAGES": "seeds finetune", "SEEDS": "2", "NICE": "0"}
    done = subprocess.run(
        ["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    calls = (tmp_path / "calls.log").read_text().splitlines()

    def block(name: str, seed: int) -> list[str]:
        run = f"results/runs/{name}"
        fine_tunes = [f"finetune {run}/finetune/final/sst2-len32-s{s} lr=1e-3" for s in (1, 2, 3)]
        return [f"pretrain {name} seed={seed}", *fine_tunes]

    assert calls == [
        *block("cpu-rung-m-lamb-lr1e-2-n2-s2", 2),  # stage seeds: each run fine-tuned as it finishes
        *block("cpu-rung-m-adamw-lr1e-3-n2-s2", 2),  # at the loop's seed 2
        *block("cpu-rung-m-lamb-lr1e-2-n2-s1", 1),  # stage finetune: kept without checkpoints, run again
        *block("cpu-rung-m-adamw-lr1e-3-n2-s1", 1),
    ]
    first = tmp_path / "results" / "runs" / "cpu-rung-m-lamb-lr1e-2-n2-s1" / "first-run"
    assert (first / "summary.json").is_file()  # the first run's files kept aside


STOPPING_LAUNCHER = """#!/usr/bin/env bash
# the study's launcher, faked: stopped by SIGTERM once (exit 75, no summary), then finished
for arg; do case $arg in run_name=*) name=${arg#run_name=} ;; esac; done
echo "pretrain $name" >> calls.log
if [[ -e stop-once ]]; then rm stop-once; exit 75; fi
mkdir -p "results/runs/$name/checkpoints"
cp "templates/$name"/* "results/runs/$name/"
"""


def test_a_stopped_run_leaves_its_part_in_the_times_and_stops_the_driver(tmp_path: Path):
    """A run stopped by SIGTERM (the launcher exits 75) gets a row in run-times with status 75, and the
    driver stops with that status before any other run; the next call finishes it (status 0)."""
    write_sweeps(tmp_path)
    for seed in (2, 3):
        write_run(tmp_path / "templates", "lamb", "1e-2", "n2", seed, 3.9, rung=RUNG)
    launcher = tmp_path / "launch" / "torchrun.sh"
    launcher.parent.mkdir()
    launcher.write_text(STOPPING_LAUNCHER)
    launcher.chmod(0o755)
    (tmp_path / "stop-once").touch()
    script = install_driver(tmp_path)
    env = {**os.environ, "RUNGS": "m", "STAGES": "seeds", "NICE": "0", "ONLY": "^cpu-rung-m-lamb-"}

    def drive() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )

    stopped = drive()
    assert stopped.returncode == 75, stopped.stderr
    assert (tmp_path / "calls.log").read_text().splitlines() == ["pretrain cpu-rung-m-lamb-lr1e-2-n2-s2"]
    finished = drive()
    assert finished.returncode == 0, finished.stderr
    times = (tmp_path / "results" / "runs" / "cpu-rung-times.tsv").read_text()
    rows = [line.split("\t") for line in times.splitlines()]
    assert [(row[0], row[5]) for row in rows] == [
        ("cpu-rung-m-lamb-lr1e-2-n2-s2", "75"),
        ("cpu-rung-m-lamb-lr1e-2-n2-s2", "0"),
        ("cpu-rung-m-lamb-lr1e-2-n2-s3", "0"),
    ]
    assert all(len(row) == 6 and int(row[1]) >= 0 and int(row[2]) >= 0 for row in rows)


ENV_LAUNCHER = """#!/usr/bin/env bash
# the study's launcher, faked: records the run and the patch its environment names, finishes at once
for arg; do case $arg in run_name=*) name=${arg#run_name=} ;; esac; done
printf '%s\\t%s\\t%s\\n' "$name" "${RUNG_ABLATION:-none}" "${PYTHONPATH:-none}" >> calls.log
mkdir -p "results/runs/$name/checkpoints"
cp "templates/$name"/* "results/runs/$name/"
"""


def test_a_patched_ablation_runs_with_its_patch_and_no_other_arm_does(tmp_path: Path):
    """`abl-fp32server` and `abl-fp32worker` run with RUNG_ABLATION naming their patch and the patches' folder
    first on PYTHONPATH (its sitecustomize applies it); the default at the same worker count runs without. The
    checkout's path has a space in it: the environment is not word-split."""
    tmp_path = tmp_path / "a checkout"
    write_sweeps(tmp_path)
    for arm in ("abl-fp32server-onebit_lamb", "abl-fp32worker-onebit_lamb", "onebit_lamb"):
        write_run(tmp_path / "templates", arm, "1e-2", "sim8", 1, 3.9, rung=RUNG)
    launcher = tmp_path / "launch" / "torchrun.sh"
    launcher.parent.mkdir()
    launcher.write_text(ENV_LAUNCHER)
    launcher.chmod(0o755)
    script = install_driver(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("RUNG_ABLATION", "PYTHONPATH")}
    only = "^cpu-rung-m-(abl-fp32(server|worker)-)?onebit_lamb-lr1e-2-sim8-s1$"
    env.update(RUNGS="m", STAGES="ablation", NICE="0", ONLY=only)
    done = subprocess.run(
        ["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    calls = [line.split("\t") for line in (tmp_path / "calls.log").read_text().splitlines()]
    patch = f"{tmp_path}/results/cpu-study-m/ablations:{tmp_path}"
    assert calls == [
        ["cpu-rung-m-onebit_lamb-lr1e-2-sim8-s1", "none", "none"],
        ["cpu-rung-m-abl-fp32server-onebit_lamb-lr1e-2-sim8-s1", "fp32_server", patch],
        ["cpu-rung-m-abl-fp32worker-onebit_lamb-lr1e-2-sim8-s1", "fp32_worker", patch],
    ]


FAKE_PYTHON = """#!/usr/bin/env bash
# the venv's python, but the report's comparison and records only logged (they write the project's results/)
case "$1 $2" in
  "-m results.compare" | "-m bench") echo "$*" >> calls.log ;;
  *) exec {python} "$@" ;;
esac
"""


def test_the_report_keeps_the_first_run_of_a_run_again(tmp_path: Path):
    """A run again for its checkpoints (first run's files in first-run/) is kept and reported by its first
    run's summary, metrics and config, not the run again's (a run again may differ in its last digits); a run
    without one is kept as it is."""
    runs = write_sweeps(tmp_path)
    folder = runs / "cpu-rung-m-lamb-lr1e-2-n2-s1"
    (folder / "first-run").mkdir()
    for name in ("summary.json", "metrics.jsonl", "config.yaml"):
        (folder / name).rename(folder / "first-run" / name)
        shutil.copy2(write_run(tmp_path / "again", "lamb", "1e-2", "n2", 1, 3.7, rung=RUNG) / name, folder)
        shutil.rmtree(tmp_path / "again")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON.format(python=sys.executable))
    python.chmod(0o755)
    script = install_driver(tmp_path)
    env = {**os.environ, "RUNGS": "m", "STAGES": "report", "NICE": "0"}
    done = subprocess.run(
        ["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    kept = tmp_path / "results" / "cpu-study" / "runs"
    for name in ("summary.json", "metrics.jsonl", "config.yaml"):
        assert (kept / folder.name / name).read_bytes() == (folder / "first-run" / name).read_bytes()
        other = "cpu-rung-m-adamw-lr1e-3-n2-s1"
        assert (kept / other / name).read_bytes() == (runs / other / name).read_bytes()
    assert (kept / folder.name / "metrics.jsonl").read_bytes() != (folder / "metrics.jsonl").read_bytes()
    compare, records = (tmp_path / "calls.log").read_text().splitlines()
    assert compare.startswith("-m results.compare study=cpu-study-m runs=[")  # the kept runs at their LRs
    assert f"results/cpu-study/runs/{folder.name}" in compare
    assert records == "-m bench fidelity"


def test_the_report_adds_this_machines_run_times_to_the_kept_ones(tmp_path: Path):
    """The report stage keeps the rung's rows of the machines before (results/runs does not outlive a
    machine) and adds this machine's once each, so that running it twice or on a new machine loses none."""
    runs = write_sweeps(tmp_path)
    # the driver's python: the real one, the report's tools faked
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(
        "#!/usr/bin/env bash\n"
        'case "$*" in "-m bench fidelity"*|"-m results.compare"*) echo "$*" >> tools.log; exit 0 ;; esac\n'
        f'exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    earlier = "cpu-rung-m-lamb-lr1e-2-n2-s1\t2256\t4140\t0.43\t1.94"
    kept = tmp_path / "results" / "cpu-study-m" / "run-times.tsv"
    kept.parent.mkdir(parents=True)
    kept.write_text(earlier + "\n")
    here = [
        "cpu-rung-m-lamb-lr3e-2-n2-s1\t2273\t4221\t0.00\t1.98\t0",
        "cpu-rung-b-lamb-lr1e-2-n2-s1\t1\t1\t0\t0\t0",
    ]
    (runs / "cpu-rung-times.tsv").write_text(f"{here[0]}\n{here[1]}\n")  # a new machine's
    script = install_driver(tmp_path)
    env = {**os.environ, "RUNGS": "m", "STAGES": "report", "NICE": "0"}
    for _ in range(2):
        done = subprocess.run(
            ["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr
        assert kept.read_text().splitlines() == [earlier, here[0]]
    assert "-m bench fidelity" in (tmp_path / "tools.log").read_text()
