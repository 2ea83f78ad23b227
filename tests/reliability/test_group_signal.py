"""SIGTERM to a whole 2-rank job, the way it arrives outside the trainer's own process: Slurm's cancel and
preemption signal every process of a job step (the agent, the trainers, their DataLoader workers); a
container runtime or `kill` signals torchrun's agent, which passes it to each worker's process group. Either
way every rank must write its checkpoint and the launcher exit 75, with DataLoader workers running
(`num_workers=2`: the trainer tests' other runs load data in-process)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from data.config import REPO_ROOT
from pretrain.checkpoint import latest_checkpoint
from tests.integration.pretrain_helpers import tiny_run_overrides
from tests.reliability.harness import job_env

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.parametrize("target", ["every_process", "agent"])
def test_sigterm_to_the_job_checkpoints_every_rank_and_exits_75(tiny_data: Path, tmp_path: Path, target: str):
    run_dir = tmp_path / "run"
    overrides = tiny_run_overrides(tiny_data, run_dir, "lamb", "num_workers=2")
    command = [sys.executable, "-m", "launch.elastic", "--standalone", "--nproc-per-node", "2"]
    command += ["--monitor-interval", "0.2", "-m", "pretrain", *overrides]
    env = job_env()
    log_path = tmp_path / "job.log"
    with open(log_path, "w") as log:
        job = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            deadline = time.monotonic() + 300
            metrics = run_dir / "metrics.jsonl"
            while job.poll() is None and time.monotonic() < deadline:
                if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
                    break
                time.sleep(0.1)
            agent = psutil.Process(job.pid)
            trainers = agent.children()
            data_workers = [worker for trainer in trainers for worker in trainer.children()]
            tree = [agent, *trainers, *data_workers]
            assert job.poll() is None and len(trainers) == 2, log_path.read_text()[-3000:]
            for process in tree if target == "every_process" else tree[:1]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.send_signal(signal.SIGTERM)
            job.wait(timeout=120)
        finally:
            if job.poll() is None:
                for process in psutil.Process(job.pid).children(recursive=True):
                    process.kill()
                job.kill()
    output = log_path.read_text()
    assert job.returncode == 75, output[-3000:]
    assert "DataLoader worker" not in output and "Traceback" not in output, output[-3000:]
    written = [line for line in output.splitlines() if line.startswith("pretrain: SIGTERM: checkpoint")]
    assert len(written) == 2 and written[0] == written[1], output[-3000:]
    step = int(written[0].rsplit(" ", 1)[1])
    newest = latest_checkpoint(run_dir / "checkpoints")
    assert newest is not None and newest.name == f"step-{step:08d}", output[-3000:]
    assert len(data_workers) >= 2, "the job ran no DataLoader workers: the test tests nothing"
