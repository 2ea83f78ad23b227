"""launch/supervise.py: which endings it relaunches on, and that it does (fast tier, no training)."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from pathlib import Path

from launch.supervise import Supervisor, decide

PEER_LINE = (
    "pretrain: error: step 9: a peer is gone: rank 1 died or stalled (no heartbeat for 2 s, last at step 9); "
    "exiting 76 to be requeued, the run resumes from its newest checkpoint step-00000008 [Connection closed]"
)


def test_decisions_follow_the_documented_exit_codes(tmp_path: Path):
    assert decide(0, "").kind == "done" and not decide(0, "").relaunch
    assert decide(75, "pretrain: SIGTERM: checkpoint written at step 7").kind == "preempted"
    assert decide(76, PEER_LINE).kind == "peer_lost"
    # torchrun names the SIGKILLed rank as the failure (exit 1); the survivor's line says what happened
    assert decide(1, PEER_LINE).kind == "peer_lost"
    assert decide(1, "  exitcode  : -9 (pid: 123)").kind == "killed"
    disk = (
        f"pretrain: error: {tmp_path}/run/checkpoints/step-00000007: checkpoint not saved: 22.1 MiB needed "
        f"(the size of step-00000006), 7.0 MiB free at {tmp_path}/run/checkpoints; step-00000006 is intact"
    )
    decision = decide(2, disk)
    assert decision.relaunch and decision.kind == "disk_full"
    assert decision.wait_for_space == (tmp_path / "run" / "checkpoints", int(22.1 * 2**20))
    shard = "pretrain: error: /d/seq128/shard-00000.arrow: changed on disk during training and no longer ..."
    assert decide(2, shard).kind == "shard_changed"
    for code, text in ((2, "pretrain: error: batch.phases[phase1].global_batch=33 is not a multiple"),
                       (1, "Traceback (most recent call last):"), (-11, ""), (137, "")):  # fmt: skip
        assert not decide(code, text).relaunch, (code, text)


def _script(tmp_path: Path, codes: list[int]) -> list[str]:
    """A job that exits with codes[n] on its n-th launch (a counter file), printing a line each time."""
    counter = tmp_path / "count"
    code = (
        "import pathlib, sys; p = pathlib.Path(sys.argv[1]); n = int(p.read_text()) if p.exists() else 0; "
        f"p.write_text(str(n + 1)); codes = {codes!r}; print('launch', n, flush=True); sys.exit(codes[n])"
    )
    return [sys.executable, "-c", code, str(counter)]


def test_it_relaunches_until_done_and_stops_on_anything_else(tmp_path: Path):
    said: list[str] = []
    output = io.StringIO()
    supervisor = Supervisor(_script(tmp_path, [75, 76, 0]), output=output, say=said.append, poll_s=0.01)
    assert supervisor.run() == 0
    assert [launch.decision.kind for launch in supervisor.launches] == ["preempted", "peer_lost", "done"]
    assert output.getvalue().splitlines() == ["launch 0", "launch 1", "launch 2"]
    assert said[0].startswith("supervise: exit 75: preempted, checkpoint written; relaunch 1")

    (tmp_path / "count").unlink()
    supervisor = Supervisor(_script(tmp_path, [76, 3, 0]), output=io.StringIO(), say=said.append, poll_s=0.01)
    assert supervisor.run() == 3  # an unexpected code stops it, with that code
    assert len(supervisor.launches) == 2

    (tmp_path / "count").unlink()
    supervisor = Supervisor(
        _script(tmp_path, [75, 75, 75]), max_restarts=1, output=io.StringIO(), say=said.append, poll_s=0.01
    )
    assert supervisor.run() == 1 and "--max-restarts 1 used up" in said[-1]


def test_the_command_line(tmp_path: Path):
    done = subprocess.run(
        [sys.executable, "-m", "launch.supervise", "--", *_script(tmp_path, [75, 0])],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["launch 0", "launch 1"]
    assert "supervise: exit 75" in done.stderr and "supervise: the job finished" in done.stderr


def test_a_failing_supervisor_takes_the_whole_job_down(tmp_path: Path):
    """torchrun's workers run in sessions of their own: killing the launcher's process group left them
    running (seen in the chaos soak); the supervisor kills the job's whole process tree."""
    import os
    import time

    pid_file = tmp_path / "worker.pid"
    code = (
        "import subprocess, sys, time; "
        "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], "
        "start_new_session=True); "
        f"open({str(pid_file)!r}, 'w').write(str(w.pid)); time.sleep(120)"
    )

    def poll(attempt, process):
        if pid_file.exists() and pid_file.read_text():
            raise RuntimeError("the harness failed")

    supervisor = Supervisor([sys.executable, "-c", code], output=io.StringIO(), on_poll=poll, poll_s=0.01)
    with contextlib.suppress(RuntimeError):
        supervisor.run()
    worker = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{worker}/stat") as stat:  # a zombie of the reaped tree counts as gone
            if stat.read().split()[2] == "Z":
                break
        time.sleep(0.05)
    else:
        raise AssertionError(f"worker {worker} outlived its supervisor")
