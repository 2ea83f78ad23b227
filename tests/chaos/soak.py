"""The chaos soak: one 2-rank pretraining run (the demo recipe, 40 + 10 steps, freeze_step 12, or shortened
to 16 + 4 steps, freeze_step 6; a checkpoint after every step) driven through a seeded schedule of faults
(tests/chaos/schedule.py) by the supervisor (launch/supervise.py), which relaunches it as a scheduler's
requeue would; then the verdict:

- the run finished (the supervisor's exit 0) and as many faults struck as were asked for (the schedule's,
  and reserve faults drawn in place of those that found no step: tests/chaos/schedule.py `Planner`);
- the final checkpoint (parameters, every rank's optimizer state with the 1-bit error buffers, RNG, data
  cursor) and every step's metrics are bitwise those of an uninterrupted run with the same seed;
- after every launch, every complete checkpoint folder (what `resume=auto` could pick) passes its
  checksums;
- every fault produced its documented one-line message, and the launch ended the way the fault's
  documentation says (exit 75, 76, 2) or, for a short link outage, did not end at all;
- the wall time each fault cost: from the fault to the first step past the furthest step trained before it.

Launches run under torchrun (`python -m launch.elastic`), except those carrying a link fault, which run over
the emulated Ethernet (tests/chaos/netjob.py). Faults at fault points use BERT_LAMB_TEST_FAULT
(pretrain/distributed/faults.py): `kill` and `term` act from inside, `hold` stops the rank at the point while
the soak acts from outside (SIGSTOP, `ip link set down`, filling the tmpfs the run writes to, flipping a
shard byte). Kinds that need root (disk: a tmpfs mount; link: network namespaces) are skipped with the
reason when it is missing, and the summary says so.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from data.config import REPO_ROOT
from data.dataset import SHARD_CHECK_INTERVAL_S
from launch.supervise import Launch, Supervisor, kill_tree
from pretrain.checkpoint import CHECKSUMS, STEP_DIR, latest_checkpoint, list_checkpoints
from tests.chaos import netjob
from tests.chaos.schedule import KINDS, SHORT, ChaosFault, Planner, Recipe
from tests.integration.pretrain_helpers import tiny_run_overrides
from tests.reliability.harness import checkpoint_digests, compare_trajectories, job_env, read_metrics

FAULT_ENV, FILE_ENV = "BERT_LAMB_TEST_FAULT", "BERT_LAMB_TEST_FAULT_FILE"
HOLD_KINDS = ("stall", "disk", "link", "flip")
# the documented one-line message of each kind ({rank}: the rank the fault struck)
MESSAGES = {
    "kill": r"pretrain: error: step \d+: a peer is gone: (rank {rank} died or stalled|the rendezvous store)",
    "stall": r"pretrain: error: step \d+: a collective timed out after [\d.]+ s \(dist\.timeout_s\): "
    r"(rank {rank} stalled|the rendezvous store)",
    "term": r"pretrain: SIGTERM: checkpoint written at step \d+",
    "disk": r"pretrain: error: \S+: checkpoint not saved: .*MiB needed.*; "
    r"(step-\d{{8}} is intact|no earlier checkpoint)",
    "link": r"pretrain: error: step \d+: a (collective timed out|peer is gone)",
    "flip": r"pretrain: error: \S+shard-\d+\.arrow: changed on disk during training",
    "restart": r"(pretrain: error: step \d+: a peer is gone|exitcode\s*:\s*-9)",
}
# how the supervisor must see the launch end (launch/supervise.py `Decision.kind`)
ENDINGS = {
    "kill": ("peer_lost",),
    "stall": ("peer_lost",),
    "term": ("preempted",),
    "disk": ("disk_full",),
    "link": ("peer_lost",),
    # the rank that read the shard exits 2; its peer, blocked in a collective, exits 76 once the reader's
    # sockets close; when that peer's exit reaches torchrun first (its 2 s diagnosis against the reader's
    # interpreter shutdown, on a busy machine), the job's code is 76. Either way the supervisor relaunches,
    # and the relaunch's start-up check of every shard decides.
    "flip": ("shard_changed", "peer_lost"),
    "restart": ("peer_lost", "killed"),
}


@dataclass
class Armed:
    """A fault of the schedule as one launch carries it: the global step and point it strikes."""

    fault: ChaosFault
    step: int | None  # None: a restart kill (by time, not step)
    point: str
    launch: int
    fired_at: float | None = None  # time.monotonic()
    frontier: int = 0  # the furthest step trained when it struck
    recovered_at: float | None = None
    message: str | None = None
    problems: list[str] = field(default_factory=list)

    timeout_s: float = 20.0

    @property
    def ends_launch(self) -> bool:
        return not (self.fault.kind == "link" and self.fault.hold_s < self.timeout_s)

    def spec(self) -> str | None:
        action = {"kill": "kill", "term": "term"}.get(self.fault.kind, "hold")
        if self.fault.kind == "restart":
            return None
        return f"{action}@{self.step}:{self.point},rank={self.fault.rank}"

    def record(self) -> dict[str, Any]:
        lost = (
            round(self.recovered_at - self.fired_at, 2)
            if self.recovered_at is not None and self.fired_at is not None
            else None
        )
        return {
            **self.fault.as_dict(),
            "step": self.step,
            "point": self.point,
            "drawn_point": self.fault.point,
            "launch": self.launch,
            "fired": self.fired_at is not None,
            "frontier": self.frontier,
            "seconds_lost": lost,
            "message": self.message,
            "problems": self.problems,
        }


def soak_overrides(data: Path, run_dir: Path, optim: str, seed: int, recipe: Recipe, dist: tuple[str, ...],
                   *extra: str) -> list[str]:  # fmt: skip
    return tiny_run_overrides(
        data, run_dir, optim, "deterministic=true", f"seed={seed}", *dist, *recipe.overrides, *extra
    )


def verify_checkpoints(directory: Path) -> list[str]:
    """Every complete checkpoint `resume=auto` could pick: COMPLETE, and every file in checksums.json with
    its sha256. -> problems (empty: all good)."""
    problems = []
    for folder in list_checkpoints(directory):
        listing = folder / CHECKSUMS
        try:
            sums = json.loads(listing.read_text())["sha256"]
        except (OSError, ValueError, KeyError) as error:
            problems.append(f"{folder.name}: {CHECKSUMS} unreadable ({error})")
            continue
        files = {p.name for p in folder.iterdir() if p.is_file()} - {CHECKSUMS, "COMPLETE"}
        if files - set(sums):
            problems.append(f"{folder.name}: files without a checksum: {sorted(files - set(sums))}")
        for name, digest in sums.items():
            path = folder / name
            if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != digest:
                problems.append(f"{folder.name}/{name}: fails its checksum")
    return problems


def checkpoint_step(folder: Path | None) -> int:
    if folder is None:
        return 0
    match = STEP_DIR.match(folder.name)
    return int(match.group(1)) if match else 0


class Disk:
    """A tmpfs the run writes to, and the ballast that fills it (root only)."""

    def __init__(self, folder: Path, size_bytes: int):
        self.folder, self.size_bytes, self.mounted = folder, size_bytes, False
        self.ballast = folder / "ballast"

    def mount(self) -> str | None:
        """None when mounted, else why not (one line)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={self.size_bytes}", "tmpfs", str(self.folder)],
            capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode != 0:
            return f"cannot mount a tmpfs ({(done.stderr or 'mount failed').strip()}; needs root)"
        self.mounted = True
        return None

    def fill(self, leave_free: int) -> None:
        size = shutil.disk_usage(self.folder).free - leave_free
        if size > 0:
            with open(self.ballast, "ab") as file, contextlib.suppress(OSError):
                file.write(b"\0" * size)

    def free(self) -> None:
        self.ballast.unlink(missing_ok=True)

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.folder)], check=False)
            self.mounted = False


def flip_byte(path: Path) -> None:
    """Flip the middle byte in place (token ids): same size, same inode; flipping it again restores it."""
    with open(path, "r+b") as handle:
        handle.seek(path.stat().st_size // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))


def reference_run(
    data: Path, out: Path, optim: str, seed: int, recipe: Recipe, dist: tuple[str, ...]
) -> tuple[Path, float]:
    """The uninterrupted run (checkpoints at phase ends only), cached in `out`; -> (run folder, its wall
    time in seconds)."""
    run_dir = out / "run"
    if latest_checkpoint(run_dir / "checkpoints") is not None and (out / "done").exists():
        return run_dir, float((out / "done").read_text() or 0)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    overrides = soak_overrides(data, run_dir, optim, seed, recipe, dist, "checkpoint.every_steps=0")
    started = time.monotonic()
    with open(out / "log", "w") as log:
        done = subprocess.run(
            torchrun_command(overrides), cwd=REPO_ROOT, env=job_env(), stdout=log, stderr=subprocess.STDOUT,
            timeout=1800,
        )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the uninterrupted run failed (exit {done.returncode}): {out / 'log'}")
    seconds = time.monotonic() - started
    (out / "done").write_text(f"{seconds:.1f}")
    return run_dir, seconds


def torchrun_command(overrides: list[str]) -> list[str]:
    command = [sys.executable, "-m", "launch.elastic", "--standalone", "--nproc-per-node", "2"]
    return [*command, "--max-restarts", "0", "--monitor-interval", "0.2", "-m", "pretrain", *overrides]


class Soak:
    def __init__(
        self,
        workdir: Path,
        data: Path,
        *,
        seed: int,
        faults: int,
        optim: str = "onebit_lamb",
        kinds: tuple[str, ...] = KINDS,
        recipe: Recipe = SHORT,
        timeout_s: float = 20.0,
        heartbeat_s: float = 1.0,
        launch_timeout_s: float = 600.0,
        say: Any = print,
    ):
        self.workdir, self.source_data, self.seed, self.count = workdir, data, seed, faults
        self.optim, self.kinds, self.recipe = optim, kinds, recipe
        self.timeout_s, self.launch_timeout_s, self.say = timeout_s, launch_timeout_s, say
        self.dist = (f"dist.timeout_s={timeout_s:g}", f"dist.heartbeat_s={heartbeat_s:g}")
        self.skipped: dict[str, str] = {}
        self.armed: list[Armed] = []
        self.launch_records: list[dict[str, Any]] = []
        self.problems: list[str] = []
        self.current: list[Armed] = []
        self.net_ids: list[str] = []
        self.frontier_seen = 0
        self.log_offset = 0
        self.reference_seconds = 0.0
        self.finished_at = 0.0
        self._reset_launch_state()

    # -- setup -------------------------------------------------------------------------------------------
    def _reset_launch_state(self) -> None:
        self.timed_out = False
        self.launch_text = ""  # this launch's output (the log holds every launch's, from `log_offset` on)
        self.started = time.monotonic()
        self.stalled: tuple[int, Armed, float | None] | None = None  # pid, fault, when it was named
        self.link_up_at: tuple[float, int] | None = None
        self.flipped: list[Path] = []
        self.net_id: str | None = None
        self.stand = 0

    def _check_root_kinds(self) -> None:
        if "link" in self.kinds:
            from launch.netns import unavailable_reason

            reason = unavailable_reason()
            if reason:
                self.skipped["link"] = f"the emulated network is unavailable: {reason}"
        if "disk" in self.kinds:
            reason = self.disk.mount()
            if reason:
                self.skipped["disk"] = reason

    def run(self) -> dict[str, Any]:
        started = time.monotonic()
        shutil.rmtree(self.workdir / "soak", ignore_errors=True)
        base = self.workdir / "soak"
        base.mkdir(parents=True)
        self.data = base / "data"
        shutil.copytree(self.source_data, self.data)
        self.hold_file = base / "hold"
        self.log_path = base / "soak.log"
        # a checkpoint of the tiny model is ~21 MB; keep_last=2 plus the one being written fit in 5
        self.disk = Disk(base / "disk", 5 * self.checkpoint_bytes_estimate())
        try:
            self._check_root_kinds()
            kinds = tuple(k for k in self.kinds if k not in self.skipped)
            for kind, reason in self.skipped.items():
                self.say(f"chaos: {kind} faults skipped: {reason}")
            self.planner = Planner(self.seed, self.count, kinds, self.recipe, self.optim, self.timeout_s)
            schedule = list(self.planner.queue)
            self.run_dir = (self.disk.folder if self.disk.mounted else base) / "run"
            reference, self.reference_seconds = reference_run(
                self.source_data, self.workdir / f"reference-{self.optim}-seed{self.seed}", self.optim,
                self.seed, self.recipe, self.dist,
            )  # fmt: skip
            ready = f"chaos: reference run ready ({self.reference_seconds:.0f} s)"
            self.say(f"{ready}; {len(schedule)} faults scheduled")
            soak_started = time.monotonic()
            self.log_path.write_text("")
            with open(self.log_path, "a") as output:  # appending, as `_say_supervisor` does
                supervisor = Supervisor(
                    ["true"], max_restarts=self.count + 20, disk_wait_s=300, output=output,
                    say=self._say_supervisor, prepare=self._prepare, on_poll=self._poll, on_end=self._end,
                    cwd=REPO_ROOT,
                )  # fmt: skip
                returncode = supervisor.run()
            self.finished_at = time.monotonic()
            soak_seconds = time.monotonic() - soak_started
            return self._verdict(returncode, reference, schedule, soak_seconds, time.monotonic() - started)
        finally:
            self._cleanup()

    def checkpoint_bytes_estimate(self) -> int:
        return 24 * 2**20

    def _say_supervisor(self, line: str) -> None:
        self.say(line)
        with open(self.log_path, "a") as log:
            log.write(line + "\n")

    def _cleanup(self) -> None:
        with contextlib.suppress(Exception):
            self._end_faults()
        for run_id in self.net_ids:  # a network a killed netjob left
            with contextlib.suppress(Exception):
                netjob._script("down", "--id", run_id)
        self.disk.unmount()

    # -- arming a launch ---------------------------------------------------------------------------------
    def _prepare(self, attempt: int) -> tuple[list[str], dict[str, str]]:
        self._reset_launch_state()
        self.disk.free()
        self.stand = checkpoint_step(latest_checkpoint(self.run_dir / "checkpoints"))
        self.current = [
            Armed(p.fault, p.step, p.point, attempt, timeout_s=self.timeout_s)
            for p in self.planner.arm(self.stand)
        ]
        self.armed.extend(self.current)
        overrides = soak_overrides(
            self.data, self.run_dir, self.optim, self.seed, self.recipe, self.dist,
            "checkpoint.every_steps=1", "checkpoint.keep_last=2",
        )  # fmt: skip
        specs = [spec for a in self.current if (spec := a.spec()) is not None]
        env = {FILE_ENV: str(self.hold_file)}
        if specs:
            env[FAULT_ENV] = ";".join(specs)
        self.hold_file.unlink(missing_ok=True)
        described = ", ".join(f"{a.fault.kind}@{a.step}:{a.point},rank={a.fault.rank}" for a in self.current)
        self._say_supervisor(
            f"chaos: launch {attempt} from step {self.stand}: {described or 'no fault (to the end)'}"
        )
        if any(a.fault.kind == "link" for a in self.current):
            self.net_id = f"{os.getpid()}-c{attempt}"
            self.net_ids.append(self.net_id)
            command = [sys.executable, "-m", "tests.chaos.netjob", "--id", self.net_id, "--", *overrides]
        else:
            command = torchrun_command(overrides)
        self.started = time.monotonic()
        return command, job_env(env)

    # -- while a launch runs ------------------------------------------------------------------------------
    def _read_log(self) -> str:
        with open(self.log_path, "rb") as log:
            log.seek(self.log_offset)
            data = log.read()
        cut = data.rfind(b"\n") + 1  # whole lines only
        self.log_offset += cut
        new = data[:cut].decode(errors="replace")
        self.launch_text += new
        return new

    def _frontier(self) -> int:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return 0
        steps = [0]
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError, KeyError):
                steps.append(int(json.loads(line)["step"]))
        return max(steps)

    def _fire(self, armed: Armed) -> None:
        if armed.fired_at is None:
            armed.fired_at = time.monotonic()
            armed.frontier = self.frontier_seen

    def _poll(self, attempt: int, process: subprocess.Popen) -> None:
        now = time.monotonic()
        new = self._read_log()
        self.frontier_seen = max(self.frontier_seen, self._frontier())
        for armed in self.armed:
            if (
                armed.fired_at is not None
                and armed.recovered_at is None
                and self.frontier_seen > armed.frontier
            ):
                armed.recovered_at = now
        for match in re.finditer(r"^fault: (\w+) rank (\d+) at step (\d+) \((\w+)\)", new, re.MULTILINE):
            action, rank, step, point = (
                match.group(1),
                int(match.group(2)),
                int(match.group(3)),
                match.group(4),
            )
            for armed in self.current:
                if (armed.fault.rank, armed.step, armed.point) == (rank, step, point) and action != "hold":
                    self._fire(armed)
        if self.hold_file.exists():
            self._act(self.hold_file.read_text().split())
        if self.stalled is not None:
            pid, armed, named = self.stalled
            if named is None and (
                "pretrain: error: step" in self.launch_text
                or now - (armed.fired_at or now) > self.timeout_s + 30
            ):
                self.stalled = (pid, armed, now)
            elif named is not None and now - named >= armed.fault.hold_s:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                self.stalled = None
        # a failed `ip` command leaves link_up_at set: the next tick tries again
        due = self.link_up_at is not None and now >= self.link_up_at[0]
        if due and self._link(self.link_up_at[1], up=True):  # type: ignore[index]
            self.link_up_at = None
        first = self.current[0] if self.current else None
        restart = first is not None and first.fault.kind == "restart" and first.fired_at is None
        if restart and first is not None and now - self.started >= first.fault.hold_s:
            worker = self._worker(process.pid, first.fault.rank)
            if worker is not None:
                with contextlib.suppress(psutil.NoSuchProcess):
                    worker.send_signal(signal.SIGKILL)
                    self._fire(first)
        if now - self.started > self.launch_timeout_s and process.poll() is None and not self.timed_out:
            self.timed_out = True
            self.problems.append(f"launch {attempt} ran past {self.launch_timeout_s:.0f} s; killed")
            kill_tree(process.pid)

    def _worker(self, pid: int, rank: int) -> psutil.Process | None:
        with contextlib.suppress(psutil.NoSuchProcess):
            for child in psutil.Process(pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    env = child.environ()
                    worker = "LOCAL_RANK" in env and "pretrain" in " ".join(child.cmdline())
                    if worker and env.get("RANK") == str(rank):
                        return child
        return None

    def _link(self, rank: int, up: bool) -> bool:
        """Rank `rank`'s cable down or up; a failed `ip` command is a problem of the soak, not a crash of it
        (the launch goes on, and its record says what the network did)."""
        assert self.net_id is not None
        try:
            netjob.link(self.net_id, rank, up)
        except (OSError, subprocess.SubprocessError) as error:
            problem = f"link {'up' if up else 'down'} for rank {rank} failed: {error}"
            if problem not in self.problems:
                self.problems.append(problem)
            return False
        return True

    def _act(self, words: list[str]) -> None:
        """A rank holds at a fault point: do the fault from outside, then let it go on."""
        if len(words) != 4:
            return  # not fully written yet
        pid, rank, point, step = int(words[0]), int(words[1]), words[2], int(words[3])
        match = [
            a for a in self.current
            if (a.fault.rank, a.point, a.step) == (rank, point, step) and a.fired_at is None
        ]  # fmt: skip
        if not match:
            self.problems.append(f"a rank held at an unscheduled point: {words}")
            self.hold_file.unlink(missing_ok=True)
            return
        armed = match[0]
        kind = armed.fault.kind
        self._fire(armed)
        if kind == "stall":
            os.kill(pid, signal.SIGSTOP)
            self.stalled = (pid, armed, None)
        elif kind == "disk":
            newest = latest_checkpoint(self.run_dir / "checkpoints")
            size = sum(p.stat().st_size for p in newest.rglob("*") if p.is_file()) if newest else 2**20
            self.disk.fill(leave_free=size // 3)
        elif kind == "link":
            if self._link(1, up=False):  # rank 1's cable: the only link between the two ranks
                self.link_up_at = (time.monotonic() + armed.fault.hold_s, 1)
        elif kind == "flip":
            # the shard the next step reads: phase 2's when the fault is at phase 1's last step
            folder = "seq128" if step < self.recipe.phase1_steps else "seq512"
            shard = self.data / folder / "shard-00000.arrow"
            flip_byte(shard)
            self.flipped.append(shard)
            time.sleep(SHARD_CHECK_INTERVAL_S + 0.3)  # every process's next read re-checks the shard
        self.hold_file.unlink(missing_ok=True)

    def _end_faults(self) -> None:
        """What a fault left that must not outlive its launch: a stopped rank, a link down, a flipped byte."""
        if self.stalled is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.stalled[0], signal.SIGCONT)
            self.stalled = None
        if self.link_up_at is not None:
            self._link(self.link_up_at[1], up=True)
            self.link_up_at = None
        for shard in self.flipped:
            flip_byte(shard)
        self.flipped = []

    # -- after a launch ------------------------------------------------------------------------------------
    def _end(self, launch: Launch) -> None:
        self._read_log()
        self._end_faults()
        text = self.launch_text
        newest = latest_checkpoint(self.run_dir / "checkpoints")
        record: dict[str, Any] = {
            "launch": launch.attempt,
            "from_step": self.stand,
            "faults": [a.fault.index for a in self.current],
            "exit": launch.returncode,
            "decision": launch.decision.kind,
            "seconds": round(launch.ended - launch.started, 1),
            "newest_checkpoint": checkpoint_step(newest),
        }
        problems = verify_checkpoints(self.run_dir / "checkpoints")
        self.problems += [f"launch {launch.attempt}: {p}" for p in problems]
        if self.stand and re.search(r"^step \d+:", text, re.MULTILINE):
            resumed = set(int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", text))
            if resumed and self.stand not in resumed:
                self.problems.append(
                    f"launch {launch.attempt}: resumed from {resumed}, newest was {self.stand}"
                )
        for armed in self.current:
            kind = armed.fault.kind
            if armed.fired_at is None:
                armed.problems.append("never struck")
                continue
            if kind == "link" and not armed.ends_launch:
                armed.message = "(none: the run went on)"
                continue
            pattern = MESSAGES[kind].format(rank=armed.fault.rank)
            found = re.search(pattern + r".*", text)
            if found:
                armed.message = found.group(0)[:300]
            else:
                armed.problems.append(f"no documented line /{pattern}/")
        ending = self.current[-1] if self.current else None
        if ending is not None and ending.ends_launch:  # recovered once the run trains past this launch
            ending.frontier = max(ending.frontier, self._frontier())
            ending.recovered_at = None
        if ending is None or not ending.ends_launch:
            if launch.decision.kind != "done":
                self.problems.append(
                    f"launch {launch.attempt}: ended '{launch.decision.kind}' (exit {launch.returncode}) "
                    "with no fault to end it"
                )
        elif ending.fired_at is not None and launch.decision.kind not in ENDINGS[ending.fault.kind]:
            ending.problems.append(
                f"launch ended '{launch.decision.kind}' (exit {launch.returncode}), expected "
                f"{ENDINGS[ending.fault.kind]}"
            )
        if launch.decision.kind == "disk_full":  # the space comes back while the supervisor waits for it
            threading.Timer(ending.fault.hold_s if ending else 0.5, self.disk.free).start()
        record["problems"] = [p for a in self.current for p in a.problems]
        self.launch_records.append(record)
        errors = [line for line in text.splitlines() if line.startswith(("pretrain: error", "pretrain: SIG"))]
        self.say(
            f"chaos: launch {launch.attempt} exit {launch.returncode} ({launch.decision.kind}) after "
            f"{record['seconds']} s, newest checkpoint {record['newest_checkpoint']}"
            + (f"; {errors[0][:160]}" if errors else "")
            + (f"; PROBLEMS {record['problems']}" if record["problems"] else "")
        )

    # -- the verdict ----------------------------------------------------------------------------------------
    def _verdict(
        self, returncode: int, reference: Path, schedule: list[ChaosFault], soak_s: float, total_s: float
    ) -> dict[str, Any]:
        problems = list(self.problems)
        if returncode != 0:
            problems.append(f"the supervisor ended with exit {returncode}")
        fired = [a for a in self.armed if a.fired_at is not None]
        for armed in self.armed:
            problems += [f"fault {armed.fault.index} ({armed.fault.kind}): {p}" for p in armed.problems]
        if len(fired) < self.count:
            problems.append(
                f"{len(fired)} of {self.count} faults struck ({self.planner.drawn} drawn): the run got to "
                "its end first"
            )
        bitwise, files = False, 0
        final_step = 0
        try:
            reference_final = latest_checkpoint(reference / "checkpoints")
            final = latest_checkpoint(self.run_dir / "checkpoints")
            assert reference_final is not None and final is not None, "no final checkpoint"
            expected = checkpoint_digests(reference_final)
            final_step = checkpoint_step(final)
            got = checkpoint_digests(final)
            files = len(expected)
            differing = sorted(k for k in expected.keys() | got.keys() if expected.get(k) != got.get(k))
            if final_step != self.recipe.total_steps:
                problems.append(f"the final checkpoint is step {final_step}")
            elif differing:
                problems.append(f"final checkpoint differs from the uninterrupted run's in {differing}")
            else:
                bitwise = True
            compare_trajectories(read_metrics(reference), read_metrics(self.run_dir))
        except (AssertionError, TypeError, OSError) as error:
            bitwise = False
            problems.append(f"verdict: {str(error)[:300]}")
        for armed in fired:  # struck once the last step was trained: recovered when the run was done
            if armed.recovered_at is None and armed.frontier >= self.recipe.total_steps:
                armed.recovered_at = self.finished_at
        # a fault's time ends when the run got past it or when the next fault struck (no time counted twice)
        order = sorted(fired, key=lambda a: a.fired_at or 0.0)
        for armed, following in zip(order, [*order[1:], None]):
            if armed.recovered_at is not None and following is not None and following.fired_at is not None:
                armed.recovered_at = min(armed.recovered_at, max(following.fired_at, armed.fired_at or 0.0))
        lost = [
            a.recovered_at - a.fired_at
            for a in fired
            if a.recovered_at is not None and a.fired_at is not None
        ]
        by_kind: dict[str, int] = {}
        by_point: dict[str, int] = {}
        for armed in fired:
            by_kind[armed.fault.kind] = by_kind.get(armed.fault.kind, 0) + 1
            by_point[armed.point] = by_point.get(armed.point, 0) + 1
        return {
            "seed": self.seed,
            "optim": self.optim,
            "faults_scheduled": len(schedule),
            "faults_struck": len(fired),
            "faults_drawn": self.planner.drawn,  # the schedule's and the reserve's drawn to replace them
            "faults_unplaced": self.planner.left(),
            "by_kind": dict(sorted(by_kind.items())),
            "by_point": dict(sorted(by_point.items())),
            "skipped_kinds": self.skipped,
            "launches": len(self.launch_records),
            "restarts": len(self.launch_records) - 1,
            "bitwise": bitwise,
            "final_step": final_step,
            "checkpoint_files_compared": files,
            "messages_ok": sum(1 for a in fired if a.message and not a.problems),
            "seconds_lost": {
                "median": round(statistics.median(lost), 1) if lost else None,
                "worst": round(max(lost), 1) if lost else None,
                # the soak's wall time beyond the uninterrupted run's, per fault
                "overall_per_fault": round((soak_s - self.reference_seconds) / max(len(fired), 1), 1),
            },
            "timeout_s": self.timeout_s,
            "recipe": {
                "phase1_steps": self.recipe.phase1_steps,
                "phase2_steps": self.recipe.phase2_steps,
                "freeze_step": self.recipe.freeze_step,
            },
            "soak_seconds": round(soak_s, 1),
            "reference_seconds": round(self.reference_seconds, 1),
            "total_seconds": round(total_s, 1),
            "problems": problems,
            "passed": not problems and bitwise,
            "faults": [a.record() for a in self.armed],
            "launch_records": self.launch_records,
        }
