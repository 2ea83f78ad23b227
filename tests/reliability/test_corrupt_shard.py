"""A byte of a training shard flipped on disk mid-epoch (another job re-preparing into the same folder, a
partial copy, a shared file system replacing the file): a 2-rank job (torchrun, gloo, DataLoader workers)
must stop with one line naming the shard, before a step trains on anything read after the change, and
leave its newest checkpoint loadable.

What can be asserted, and how the test pins it down: every process re-reads a shard's stamp at most once
per `SHARD_CHECK_INTERVAL_S` (data/dataset.py), so samples read in the interval after a change cannot be
told apart from good ones. The test freezes the whole job (SIGSTOP to the agent, both ranks and their
DataLoader workers), flips the byte, waits out the interval and lets the job go on: every process's next
read of the shard then re-checks its stamp and raises. What a step can still train on after the flip are
the batches assembled before the freeze: the step under way and the micro-batches the DataLoader
prefetched (num_workers x prefetch_factor per rank). So the last step in metrics.jsonl is at most
`STEPS_AFTER_FLIP` past the last one logged before the freeze; without the check the job would train to
the end of the recipe on the changed shard.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from data.config import REPO_ROOT
from data.dataset import SHARD_CHECK_INTERVAL_S
from pretrain.checkpoint import STEP_DIR, latest_checkpoint, load_checkpoint
from tests.reliability.harness import job_env, kill_tree, pretrain_overrides, read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]

NUM_WORKERS = 2  # DataLoader workers per rank: the error must cross the worker boundary as one line
PREFETCH_FACTOR = 2  # torch's default; pretrain/train/phase_data.py does not set it
ACCUMULATION = 2  # phase 1 of batch=demo: global batch 32 = 2 ranks x micro batch 8 x 2
STEPS_AFTER_FLIP = 1 + NUM_WORKERS * PREFETCH_FACTOR // ACCUMULATION  # the step under way + prefetched
FLIP_AFTER_STEPS = 4  # phase 1 has 40 steps, one epoch of the tiny data: the flip is mid-epoch
TIMEOUT_S = 120


def test_flipped_shard_byte_stops_the_job_with_one_line(tiny_data: Path, tmp_path: Path, record):
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)  # the session's tiny data stays intact for the other tests
    shard = data / "seq128" / "shard-00000.arrow"  # phase 1's only shard: every rank reads from it
    run_dir = tmp_path / "run"
    log_path = tmp_path / "job.log"
    overrides = pretrain_overrides(data, run_dir, f"num_workers={NUM_WORKERS}")
    env = job_env()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["--max-restarts", "0", "--monitor-interval", "0.2", "-m", "pretrain", *overrides]
    started = time.monotonic()
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            while _steps_logged(run_dir) < FLIP_AFTER_STEPS:
                assert process.poll() is None, f"the job ended before step {FLIP_AFTER_STEPS}"
                assert time.monotonic() - started < TIMEOUT_S, "the job did not reach the flip"
                time.sleep(0.05)
            frozen = _signal_tree(process.pid, signal.SIGSTOP)
            steps_before_flip = _steps_logged(run_dir)
            _flip_byte(shard)
            flipped = time.monotonic()
            time.sleep(SHARD_CHECK_INTERVAL_S + 0.2)  # every process's next read re-checks the stamp
            for child in frozen:
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.send_signal(signal.SIGCONT)
            while process.poll() is None:
                assert time.monotonic() - started < TIMEOUT_S, "the job did not stop after the flip"
                time.sleep(0.05)
            seconds = time.monotonic() - flipped
        finally:
            if process.poll() is None:
                kill_tree(process.pid)
            process.wait()
    output = log_path.read_text()
    tail = output[-3000:]

    assert process.returncode != 0, f"the job finished on a corrupted shard\n{tail}"
    errors = [line for line in output.splitlines() if line.startswith("pretrain: error:")]
    assert errors, f"no one-line error\n{tail}"
    expected = f"pretrain: error: {shard}: changed on disk during training and no longer matches"
    assert any(line.startswith(expected) for line in errors), errors
    assert "Caught DataError" not in output and "Original Traceback" not in output, tail

    last_step = max(line["step"] for line in read_metrics(run_dir))
    assert last_step <= steps_before_flip + STEPS_AFTER_FLIP, (
        f"steps {steps_before_flip + 1}..{last_step} after the flip: more than the batches read before it"
    )
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    assert checkpoint is not None
    match = STEP_DIR.match(checkpoint.name)
    assert match is not None
    checkpoint_step = int(match.group(1))
    assert checkpoint_step <= last_step
    _assert_loadable(checkpoint, overrides)

    line = next(line for line in errors if line.startswith(expected))
    record(
        "fault",
        fault="flipped byte in a shard",
        injected=f"mid-epoch in phase 1, after step {steps_before_flip} (seq128/{shard.name}, middle byte)",
        outcome=line.replace(str(shard), f"seq128/{shard.name}").partition("; re-prepare")[0],
        seconds=round(seconds, 1),
        steps_lost=last_step - checkpoint_step,
    )


def _steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    lines = [line for line in path.read_text().splitlines() if line.endswith("}")]
    return len(lines)


def _signal_tree(pid: int, signum: int) -> list[psutil.Process]:
    """Send `signum` to a process and its descendants; twice over, for children started meanwhile."""
    reached: dict[int, psutil.Process] = {}
    for _ in range(2):
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(pid)
            for child in [root, *root.children(recursive=True)]:
                if child.pid not in reached:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        child.send_signal(signum)
                        reached[child.pid] = child
    return list(reached.values())


def _flip_byte(path: Path) -> None:
    """Flip the middle byte (token ids) in place: same size, same inode, what the memory maps show."""
    with open(path, "r+b") as handle:
        handle.seek(path.stat().st_size // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))


def _assert_loadable(checkpoint: Path, overrides: list[str]) -> None:
    from pretrain.model import build_model
    from tests.integration.pretrain_helpers import compose_train_config

    cfg = compose_train_config(overrides)
    for rank in (0, 1):
        model = build_model(cfg.model, 2000, torch.device("cpu"))
        rank_state, shared_state = load_checkpoint(checkpoint, rank, model)
        assert rank_state and shared_state
