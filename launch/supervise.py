"""Relaunch a pretraining job on the exit codes that mean "resume me", as a scheduler's requeue would:
`python -m launch.supervise [options] -- <command>`.

    python -m launch.supervise -- launch/torchrun.sh --nproc 2 -- batch=demo optim=onebit_lamb resume=auto
    python -m launch.supervise --max-restarts 20 -- .venv/bin/python -m launch.elastic --standalone \\
        --nproc-per-node 2 -m pretrain batch=demo model=bert_tiny

The command must resume from its newest checkpoint when started again (`resume=auto`, the default). The
job's output passes through unchanged; the supervisor adds one line per decision (`supervise: ...`, on
stderr). What it does with each ending (docs/pretraining.md, "Faults and restarts"):

    exit 0                   done: exit 0
    exit 75                  preempted (SIGTERM/SIGUSR1), checkpoint written: relaunch
    exit 76                  a peer rank died or stalled (the survivor's one line): relaunch
    a rank printed its 76    line, but the launcher reports another code (torchrun names the rank killed by
                             SIGKILL as the failure, exit 1): relaunch, the same event seen from the survivor
    a rank killed by SIGKILL (torchrun's report `exitcode  : -9`; the OOM killer, a lost node): relaunch
    exit 2, disk full        the one line "checkpoint not saved: ... MiB needed ... free": wait until the
                             checkpoint folder's file system has that much free (--disk-wait seconds at
                             most), then relaunch; stop with 2 if it never has
    exit 2, shard changed    "changed on disk during training": relaunch once the file is back; the start of
                             the job checks every shard against its manifest and stops for good (exit 2,
                             another line) if it is still corrupted
    anything else            stop, with the job's exit code (a bad config, a crash, a corrupted shard)

It stops too after --max-restarts relaunches (default 100). SIGTERM or SIGINT to the supervisor goes to
the job (which checkpoints and exits 75) and the supervisor then exits with the job's code, without
relaunching: the scheduler that sent it decides.

Exit code: the last launch's (0 when the job finished); 1 when --max-restarts ran out.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

PREEMPTED, PEER_LOST, USER_ERROR = 75, 76, 2
# the one-line messages the decisions read (pretrain/distributed/liveness.py, pretrain/checkpoint.py,
# data/dataset.py, torchrun's failure report)
PEER_LOST_LINE = re.compile(r"exiting 76 to be requeued")
KILLED_LINE = re.compile(r"exitcode\s*:\s*-9\b")
DISK_LINE = re.compile(
    r"error: (?P<folder>\S+): checkpoint not saved: .*?(?P<needed>[\d.]+) MiB needed.*$", re.MULTILINE
)
SHARD_LINE = re.compile(r"error: \S+: changed on disk during training")
TAIL_LINES = 400  # the part of a launch's output the decisions read


@dataclass
class Decision:
    """What to do after one launch: relaunch or not, and the one line saying why."""

    relaunch: bool
    reason: str
    kind: str  # done | preempted | peer_lost | killed | disk_full | shard_changed | stop
    wait_for_space: tuple[Path, int] | None = None  # (folder, bytes) a relaunch has to wait for


def decide(returncode: int, output: str) -> Decision:
    """The supervisor's rule (module docstring) for a launch that ended with `returncode`, printing
    `output` (its last lines are enough)."""
    if returncode == 0:
        return Decision(False, "the job finished", "done")
    if returncode == PREEMPTED:
        return Decision(True, "exit 75: preempted, checkpoint written", "preempted")
    if returncode == PEER_LOST:
        return Decision(True, "exit 76: a peer rank died or stalled", "peer_lost")
    if returncode == USER_ERROR:
        disk = list(DISK_LINE.finditer(output))
        if disk:
            folder = Path(disk[-1].group("folder")).parent
            needed = int(float(disk[-1].group("needed")) * 2**20)
            return Decision(True, "exit 2: disk full at a checkpoint save", "disk_full", (folder, needed))
        if SHARD_LINE.search(output):
            return Decision(True, "exit 2: a shard changed on disk during training", "shard_changed")
        return Decision(False, f"exit {returncode}: a bad config, data or checkpoint", "stop")
    if PEER_LOST_LINE.search(output):
        return Decision(True, f"exit {returncode}: a rank reported a lost peer (exit 76)", "peer_lost")
    if KILLED_LINE.search(output):
        return Decision(True, f"exit {returncode}: a rank was killed by SIGKILL", "killed")
    return Decision(False, f"exit {returncode}: not a code to relaunch on", "stop")


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant (torchrun's workers run in sessions of their own)."""
    try:
        import psutil
    except ImportError:  # without psutil: the process group the job was started in
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        return
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(pid)
        for process in [*root.children(recursive=True), root]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()


def free_bytes(folder: Path) -> int:
    """Free space of the file system `folder` is on (its nearest existing parent)."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free


@dataclass
class Launch:
    """One launch of the job, as the supervisor saw it."""

    attempt: int
    returncode: int
    started: float  # time.monotonic()
    ended: float
    decision: Decision
    output_tail: str = field(repr=False, default="")


class Supervisor:
    """Runs `command` until it finishes or ends in a way not to relaunch on (`decide`).

    Python callers (tests/chaos/) can change each launch (`prepare(attempt) -> (command, extra env)`),
    watch it (`on_poll(attempt, process)` every `poll_s` while it runs) and see its ending
    (`on_end(launch)`, before the supervisor waits for space or relaunches)."""

    def __init__(
        self,
        command: Sequence[str],
        *,
        max_restarts: int = 100,
        disk_wait_s: float = 3600.0,
        output: IO[str] | None = None,
        say: Callable[[str], None] | None = None,
        prepare: Callable[[int], tuple[Sequence[str], dict[str, str]]] | None = None,
        on_poll: Callable[[int, subprocess.Popen], None] | None = None,
        on_end: Callable[[Launch], None] | None = None,
        poll_s: float = 0.05,
        cwd: str | Path | None = None,
    ):
        self.command, self.max_restarts, self.disk_wait_s = list(command), max_restarts, disk_wait_s
        self.output = output if output is not None else sys.stdout
        self.say = say if say is not None else (lambda line: print(line, file=sys.stderr, flush=True))
        self.prepare, self.on_poll, self.on_end = prepare, on_poll, on_end
        self.poll_s, self.cwd = poll_s, cwd
        self.launches: list[Launch] = []
        self.process: subprocess.Popen | None = None
        self.stopping = False  # a signal to the supervisor: no more relaunches

    def run(self) -> int:
        attempt = 0
        while True:
            launch = self._launch(attempt)
            self.launches.append(launch)
            decision = launch.decision
            if self.on_end is not None:
                self.on_end(launch)
            if not decision.relaunch:
                self.say(f"supervise: {decision.reason}; not relaunching (exit {launch.returncode})")
                return launch.returncode
            if self.stopping:
                self.say(f"supervise: {decision.reason}; stopped by a signal, not relaunching")
                return launch.returncode
            if attempt >= self.max_restarts:
                self.say(f"supervise: {decision.reason}; --max-restarts {self.max_restarts} used up")
                return 1
            if decision.wait_for_space is not None and not self._wait_for_space(*decision.wait_for_space):
                return launch.returncode
            attempt += 1
            self.say(f"supervise: {decision.reason}; relaunch {attempt} (of at most {self.max_restarts})")

    def _launch(self, attempt: int) -> Launch:
        command, extra_env = self.prepare(attempt) if self.prepare is not None else (self.command, {})
        env = {**os.environ, **extra_env}
        tail: deque[str] = deque(maxlen=TAIL_LINES)
        started = time.monotonic()
        self.process = subprocess.Popen(
            list(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
            env=env, cwd=self.cwd, start_new_session=True, bufsize=1,
        )  # fmt: skip
        pump = threading.Thread(target=self._pump, args=(self.process, tail), daemon=True)
        pump.start()
        try:
            while self.process.poll() is None:
                if self.on_poll is not None:
                    self.on_poll(attempt, self.process)
                time.sleep(self.poll_s)
        finally:
            if self.process.poll() is None:  # the supervisor itself failed: take the job down with it
                kill_tree(self.process.pid)
            self.process.wait()
            pump.join(timeout=10)
        returncode = self.process.returncode
        text = "".join(tail)
        return Launch(attempt, returncode, started, time.monotonic(), decide(returncode, text), text)

    def _pump(self, process: subprocess.Popen, tail: deque[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            tail.append(line)
            self.output.write(line)
            self.output.flush()

    def _wait_for_space(self, folder: Path, needed: int) -> bool:
        deadline = time.monotonic() + self.disk_wait_s
        free = free_bytes(folder)
        if free < needed:
            self.say(
                f"supervise: waiting for {needed / 2**20:.1f} MiB free at {folder} "
                f"({free / 2**20:.1f} MiB now; --disk-wait {self.disk_wait_s:g} s)"
            )
        while free < needed:
            if time.monotonic() > deadline or self.stopping:
                self.say(f"supervise: {folder} still has {free / 2**20:.1f} MiB free; not relaunching")
                return False
            time.sleep(min(1.0, self.poll_s * 20))
            free = free_bytes(folder)
        return True

    def forward(self, signum: int, frame: object = None) -> None:
        """Signal handler: pass SIGTERM/SIGINT on to the job and relaunch no more."""
        self.stopping = True
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m launch.supervise",
        description="Relaunch a pretraining job on exit 75, 76 and a freed full disk (launch/supervise.py).",
    )
    parser.add_argument("--max-restarts", type=int, default=100, help="relaunches at most (default 100)")
    parser.add_argument(
        "--disk-wait", type=float, default=3600.0, help="seconds to wait for space after a full disk"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the job's command line")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command: python -m launch.supervise [options] -- <command>")
    supervisor = Supervisor(command, max_restarts=args.max_restarts, disk_wait_s=args.disk_wait)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, supervisor.forward)
    try:
        return supervisor.run()
    except FileNotFoundError as error:
        print(f"supervise: error: cannot run {command[0]}: {error.strerror}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
