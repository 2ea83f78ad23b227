"""Stalled and dying ranks: heartbeats in the rendezvous store, and one line when a collective fails.

    with watch(env, cfg.dist, progress=lambda: trainer.state.global_step + 1, run_dir=...):
        trainer.fit()                         # a failed collective leaves as PeerLost (exit 76)

Every rank's daemon thread writes `<wall time> <step>` to the store every `dist.heartbeat_s`. The store
is torchrun's agent store (or rank 0's TCPStore without an agent): a rank stopped by SIGSTOP, wedged in a
driver or cut off the network stops writing, while ranks blocked in a collective keep writing (c10d
releases the GIL while it waits). When a collective fails on a rank, because a peer died (gloo:
"Connection closed by peer") or because it waited `dist.timeout_s` (the process group's timeout), the
rank marks itself as a survivor, reads the heartbeats twice `heartbeat_s` apart and names the ranks whose
heartbeat stood still, with their last step: `PeerLost`, one line, exit code 76 (`PEER_LOST_EXIT_CODE`)
so a scheduler can requeue the job; the run continues from its newest complete checkpoint. Rank 0 also
logs a warning while a peer has been silent for more than half the timeout (on NCCL, torch's watchdog may
abort the process at the timeout before Python sees an error; the warning names the rank first).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from launch import cli
from pretrain.config import DistConfig
from pretrain.distributed.process_group import DistributedEnv

log = logging.getLogger(__name__)

PEER_LOST_EXIT_CODE = 76  # a peer stalled or died: requeue; the run resumes from its newest checkpoint
# what c10d's gloo and NCCL errors say when a peer is gone or silent (their exception types vary)
_COMM_MARKERS = (
    "gloo",
    "nccl",
    "connection closed",
    "connection reset",
    "timed out",
    "timeout",
    "broken pipe",
)
_STORE_TIMEOUT = timedelta(seconds=5)  # diagnosis reads: a store in a stopped rank 0 must not hang them


class PeerLost(Exception):
    """A collective failed because another rank died or stalled; the message is one line."""


def is_comm_failure(error: BaseException) -> bool:
    if isinstance(error, dist.DistError):
        return True
    text = str(error).lower()
    if text.startswith("dataloader"):  # "DataLoader timed out after N seconds": a slow reader, not a peer
        return False
    return isinstance(error, RuntimeError) and any(m in text for m in _COMM_MARKERS)


class Heartbeat:
    """This rank's heartbeat thread, and the reading of everyone's."""

    def __init__(self, store: dist.Store, env: DistributedEnv, cfg: DistConfig, progress: Callable[[], int]):
        self.store, self.env, self.cfg, self.progress = store, env, cfg, progress
        self._stop = threading.Event()
        self._warned: set[int] = set()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._beat()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating and wait for the thread: a daemon thread still inside a store call while the
        interpreter exits aborts the process (std::terminate, exit -6) instead of exiting with its code."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * _STORE_TIMEOUT.total_seconds())

    def _beat(self) -> None:
        self.store.set(f"beat/{self.env.rank}", f"{time.time():.3f} {self.progress()}")

    def _run(self) -> None:
        while not self._stop.wait(self.cfg.heartbeat_s):
            try:
                self._beat()
                if self.env.rank == 0:
                    self._warn_silent()
            except Exception as error:  # the store went away (the job is ending): stop beating
                log.debug("heartbeat stopped: %s", error)
                return

    def read(self) -> dict[int, tuple[float, int]]:
        """rank -> (wall time of its last heartbeat, its step then), for the ranks that have one."""
        keys = [f"beat/{rank}" for rank in range(self.env.world_size)]
        present = [key for key in keys if self.store.check([key])]
        beats = {}
        for key, value in zip(present, self.store.multi_get(present) if present else []):
            stamp, step = value.decode().split()
            beats[int(key.split("/")[1])] = (float(stamp), int(step))
        return beats

    def _warn_silent(self) -> None:
        now = time.time()
        for rank, (stamp, step) in self.read().items():
            silent = now - stamp
            if silent > self.cfg.timeout_s / 2 and rank not in self._warned:
                self._warned.add(rank)
                log.warning("rank %d silent for %.0f s (last heartbeat at step %d)", rank, silent, step)
            elif silent <= self.cfg.timeout_s / 2:
                self._warned.discard(rank)

    def silent_ranks(self) -> dict[int, tuple[float, int]]:
        """Ranks whose heartbeat stands still over 2 x heartbeat_s (survivors that marked themselves
        excluded) -> (seconds since their last heartbeat, their step then)."""
        self.store.set(f"survivor/{self.env.rank}", "1")
        first = self.read()
        time.sleep(2 * self.cfg.heartbeat_s)
        second, now = self.read(), time.time()
        survivors = {
            rank for rank in range(self.env.world_size) if self.store.check([f"survivor/{rank}"])
        }  # fmt: skip
        silent = {}
        for rank in range(self.env.world_size):
            if rank in survivors or rank == self.env.rank:
                continue
            if rank not in second or first.get(rank) == second[rank]:
                stamp, step = second.get(rank, (float("nan"), -1))
                silent[rank] = (now - stamp, step)
        return silent


def _client_store(env: DistributedEnv) -> dist.Store:
    """A store connection of this thread's own (the default group's client is not shared across threads),
    private to this torchrun restart attempt like the process group's (pretrain.distributed.process_group)."""
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(address, port, is_master=False, timeout=_STORE_TIMEOUT)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return dist.PrefixStore(f"/bert_lamb/liveness/attempt_{attempt}", store)
    return dist.PrefixStore("/bert_lamb/liveness", store)


@contextmanager
def watch(
    env: DistributedEnv, cfg: DistConfig, progress: Callable[[], int], run_dir: str | Path
) -> Iterator[Heartbeat | None]:
    """Heartbeats while the body runs (world size > 1); a communication failure inside it leaves as
    PeerLost naming the silent ranks and the step."""
    if env.world_size == 1:
        yield None
        return
    heartbeat = Heartbeat(_client_store(env), env, cfg, progress).start()
    try:
        yield heartbeat
    except Exception as error:
        if not is_comm_failure(error):
            raise
        raise PeerLost(describe(error, heartbeat, progress(), cfg, Path(run_dir))) from error
    finally:
        heartbeat.stop()


def _within(seconds: float, read: Callable[[], dict[int, tuple[float, int]]]) -> dict[int, tuple[float, int]]:
    """`read()` in a daemon thread; TimeoutError when it has not returned after `seconds`."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = read()
        except Exception as error:
            outcome["error"] = error

    thread = threading.Thread(target=run, name="liveness-diagnosis", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"no answer in {seconds:.0f} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def describe(error: BaseException, heartbeat: Heartbeat, step: int, cfg: DistConfig, run_dir: Path) -> str:
    from pretrain.checkpoint import latest_checkpoint

    text = cli.first_line(error)
    text = re.sub(r"^\[[^\]]*\] ", "", text)  # c10d's "[/path/to/gloo/file.cc:78] " prefix
    timed_out = "timed out" in str(error).lower() or "timeout" in str(error).lower()
    what = (
        f"a collective timed out after {cfg.timeout_s:g} s (dist.timeout_s)"
        if timed_out
        else "a peer is gone"
    )
    try:
        # bounded: a store whose host is stopped (rank 0's store without torchrun's agent, SIGSTOP) never
        # answers `check`, whatever the client's timeout; the survivor must still exit
        limit = 2 * cfg.heartbeat_s + 3 * _STORE_TIMEOUT.total_seconds()
        silent = _within(limit, heartbeat.silent_ranks)
        if silent:
            who = "; ".join(
                f"rank {rank} {'stalled' if timed_out else 'died or stalled'} "
                f"(no heartbeat for {age:.0f} s, last at step {last})"
                for rank, (age, last) in sorted(silent.items())
            )
        else:
            who = "every other rank still beats (a network fault between ranks?)"
    except Exception as store_error:  # the store itself is unreachable (its host died or stalled)
        who = f"the rendezvous store is unreachable too ({type(store_error).__name__})"
    newest = latest_checkpoint(run_dir / "checkpoints")
    resume = f"newest checkpoint {newest.name}" if newest is not None else "no checkpoint yet"
    return (
        f"step {step}: {what}: {who}; exiting {PEER_LOST_EXIT_CODE} to be requeued, the run resumes "
        f"from its {resume} [{text[:160]}]"
    )
