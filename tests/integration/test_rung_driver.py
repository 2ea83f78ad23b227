"""results/cpu-study-rungs/reproduce.sh: what it would run (DRY=1) over synthetic run folders."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from bench.fidelity_rungs import RUNGS
from tests.unit.test_bench_fidelity_rungs import write_run

REPO = Path(__file__).resolve().parents[2]
RUNG = RUNGS["m"]  # LAMB 3e-3 1e-2 3e-2, AdamW 3e-4 1e-3 3e-3; fine-tunes at seeds 1-3


def dry_run(root: Path, stages: str, **env_vars: str) -> list[str]:
    """The driver, copied into `root` (its python: this interpreter's venv), listing what is pending."""
    script = root / "results" / "cpu-study-rungs" / "reproduce.sh"
    script.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(REPO / "results" / "cpu-study-rungs" / "reproduce.sh", script)
    if not (root / ".venv").exists():
        (root / ".venv").symlink_to(Path(sys.prefix))
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
    trajectory, nothing compressed) only where the workers are simulated, and the default and LAMB at 8
    simulated workers; a finished one is not listed."""
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
    assert pending == expected[1:]  # seed 1's ffnrows at 2 processes finished
