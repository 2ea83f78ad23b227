"""Launch 2-rank pretraining jobs under torchrun, inject faults (pretrain/distributed/faults.py), kill them,
and
compare what they leave behind with an uninterrupted run, bit for bit."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
from safetensors.torch import load_file

from data.config import REPO_ROOT
from pretrain.checkpoint import latest_checkpoint
from tests.integration.pretrain_helpers import tiny_run_overrides

# Wall-clock and throughput fields differ between any two runs; everything else in a metrics line must
# be bitwise identical between an interrupted-and-resumed run and an uninterrupted one.
TIMING_KEYS = ("samples_per_s", "tokens_per_s", "step_seconds", "mfu")
# Diagnostics summed over DDP's gradient buckets in the communication hook: a fresh process's first step
# uses DDP's initial bucket layout, later steps the rebuilt one, so after a resume the float sum runs in
# another order (the gradients themselves are elementwise and stay bitwise equal). Compared to 1e-5.
DIAGNOSTIC_KEYS = ("gradient_noise_scale",)


def pretrain_overrides(data: Path, run_dir: Path, *extra: str) -> list[str]:
    """The demo recipe (1-bit LAMB, both phases, crossing freeze_step) on the tiny BERT, deterministic,
    a checkpoint after every step."""
    return tiny_run_overrides(
        data, run_dir, "onebit_lamb", "deterministic=true", "checkpoint.every_steps=1", *extra
    )


@dataclass
class Outcome:
    returncode: int
    log: str
    killed_job: bool = False  # the harness SIGKILLed every process of the job
    seconds: float = 0.0


@dataclass
class Segment:
    """One launch of the job: `fault` (BERT_LAMB_TEST_FAULT) and what the launch must end with."""

    name: str
    fault: str | None = None
    max_restarts: int = 0
    expect: str = "done"  # done | killed (one rank SIGKILLed itself) | job_killed | preempted (exit 75)
    extra: tuple[str, ...] = ()
    outcome: Outcome | None = field(default=None, repr=False)


def job_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """A job's environment: this one without an outer torchrun's or an earlier fault's variables, one thread
    per rank, unbuffered output, then `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "BERT_LAMB_TEST_"))}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(extra or {})}


def torchrun(
    overrides: list[str],
    log_path: Path,
    *,
    fault: str | None = None,
    fault_file: Path | None = None,
    max_restarts: int = 0,
    nproc: int = 2,
    timeout: float = 300,
    on_poll: Callable[[float], None] | None = None,
) -> Outcome:
    """Run `python -m pretrain <overrides>` on `nproc` gloo processes under torchrun in a new session.
    With a job-scope fault, SIGKILL every process of the job (agent and workers at once) as soon as
    the faulting rank reports it reached the fault point. `on_poll(seconds since start)` runs every
    50 ms while the job runs (watch its files, fill a disk)."""
    env = job_env()
    if fault:
        env["BERT_LAMB_TEST_FAULT"] = fault
    if fault_file is not None:
        fault_file.unlink(missing_ok=True)
        env["BERT_LAMB_TEST_FAULT_FILE"] = str(fault_file)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    command += ["--max-restarts", str(max_restarts), "--monitor-interval", "0.2", "-m", "pretrain"]
    started = time.monotonic()
    killed_job = False
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [*command, *overrides], cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            while process.poll() is None:
                if time.monotonic() - started > timeout:
                    kill_tree(process.pid)
                    raise AssertionError(f"job did not finish within {timeout:.0f} s (log: {log_path})")
                if fault_file is not None and fault_file.exists():
                    kill_tree(process.pid)
                    killed_job = True
                if on_poll is not None:
                    on_poll(time.monotonic() - started)
                time.sleep(0.05)
        finally:
            if process.poll() is None:
                kill_tree(process.pid)
            process.wait()
    return Outcome(process.returncode, log_path.read_text(), killed_job, time.monotonic() - started)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants at once (kill -9 of a whole job)."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signal.SIGKILL)
    psutil.wait_procs(processes, timeout=30)


def check_outcome(segment: Segment, outcome: Outcome) -> None:
    """The launch ended the way its fault says it must."""
    tail = outcome.log[-3000:]
    if segment.expect == "done":
        assert outcome.returncode == 0, f"{segment.name}: exit {outcome.returncode}\n{tail}"
    elif segment.expect == "job_killed":
        assert outcome.killed_job, f"{segment.name}: the fault point was never reached\n{tail}"
    elif segment.expect == "killed":
        assert outcome.returncode != 0, f"{segment.name}: finished although a rank was killed\n{tail}"
        assert "exitcode  : -9" in outcome.log, f"{segment.name}: no rank died of SIGKILL\n{tail}"
    elif segment.expect == "preempted":
        assert outcome.returncode != 0, f"{segment.name}: finished although preempted\n{tail}"
        # torchrun's failure report: every rank checkpointed and exited with the preemption code
        assert outcome.log.count("exitcode  : 75") == 2, f"{segment.name}: ranks did not exit 75\n{tail}"
    else:
        raise ValueError(segment.expect)


# -- what runs leave behind ----------------------------------------------------------------------------
def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def deterministic(record: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v for k, v in record.items() if k not in TIMING_KEYS and not k.startswith("time_")
    }  # fmt: skip


def compare_trajectories(reference: list[dict], resumed: list[dict]) -> tuple[int, int]:
    """Every step of `resumed` (a step replayed after a kill appears more than once) must equal the
    reference's record for that step, bit for bit, in every non-timing field (DIAGNOSTIC_KEYS to a relative
    1e-5). -> (steps, records)."""
    expected = {record["step"]: deterministic(record) for record in reference}
    seen: set[int] = set()
    for record in resumed:
        step = record["step"]
        assert step in expected, f"step {step} is not in the uninterrupted run"
        got = deterministic(record)
        differing = sorted(
            k for k in expected[step].keys() | got.keys() if not _same(got.get(k), expected[step].get(k), k)
        )
        if differing:
            raise AssertionError(
                f"step {step} differs from the uninterrupted run in {differing}: "
                + ", ".join(f"{k}: {got.get(k)!r} vs {expected[step].get(k)!r}" for k in differing[:4])
            )
        seen.add(step)
    assert seen == set(expected), f"steps missing after resume: {sorted(set(expected) - seen)}"
    return len(seen), len(resumed)


def _same(a: Any, b: Any, key: str = "") -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if key in DIAGNOSTIC_KEYS and isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-5)
    return a == b


def checkpoint_digests(folder: Path) -> dict[str, str]:
    """sha256 per file of a checkpoint, over its tensors and values (not the container bytes):
    model.safetensors, train_state.pt and every rank's optimizer state, RNG and 1-bit error buffers."""
    digests = {"model.safetensors": _digest(dict(sorted(load_file(folder / "model.safetensors").items())))}
    for path in sorted(folder.glob("*.pt")):
        digests[path.name] = _digest(torch.load(path, map_location="cpu", weights_only=True))
    return digests


def _digest(value: Any) -> str:
    digest = hashlib.sha256()
    _feed(digest, value)
    return digest.hexdigest()


def _feed(digest: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        digest.update(f"T{tensor.dtype}{tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, dict):
        digest.update(b"{")
        for key in sorted(value, key=str):
            digest.update(repr(key).encode())
            _feed(digest, value[key])
        digest.update(b"}")
    elif isinstance(value, list | tuple):
        digest.update(b"[")
        for item in value:
            _feed(digest, item)
        digest.update(b"]")
    else:
        digest.update(repr(value).encode())


def final_checkpoint(run_dir: Path) -> Path:
    folder = latest_checkpoint(run_dir / "checkpoints")
    assert folder is not None, f"{run_dir}: no complete checkpoint"
    return folder


def resumed_from(log: str) -> list[int]:
    """Steps the job's ranks resumed from, as the trainer logs them."""
    steps = []
    for line in log.splitlines():
        if "resumed from" in line and " at step " in line:
            steps.append(int(line.split(" at step ")[1].split()[0]))
    return steps


def hash_tree(root: Path, skip: Iterable[str] = ()) -> dict[str, str]:
    """sha256 of every file under `root` (relative path -> digest)."""
    skipped = tuple(skip)
    digests = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.relative_to(root).as_posix().startswith(skipped):
            digests[path.relative_to(root).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digests
