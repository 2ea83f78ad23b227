"""Python side of the emulated-Ethernet harness (launch/netns.sh): run a function on N gloo ranks that
talk over rate-limited veth links, one network namespace per rank.

    reason = unavailable_reason()            # None, or one line saying why (not root, netns refused...)
    with EmulatedNetwork(world_size=2, rate="1gbit") as network:
        results = network.run(fn, args=(...))     # fn(rank, world_size, *args) -> picklable, per rank
        network.set_rate("10gbit")                # between runs; inside fn: set_rate_from_rank("none")
        print(network.counters())                 # per rank: tx/rx bytes of nx0, tbf "Sent" bytes

`fn` must be importable by module and name (it is pickled by reference); each rank is a fresh
interpreter started with `ip netns exec`, one thread by default, with the gloo process group already
initialized over the rank's `nx0` interface (GLOO_SOCKET_IFNAME, MASTER_ADDR = rank 0's address).
Inside `fn`, `interface_counters()` reads this rank's byte counters, so a benchmark can attribute
bytes to each operation. The network is always removed: on exit of the `with` block, on an exception,
and (via the shell script's cleanup) for leftovers of a killed run: `launch/netns.sh cleanup`.
"""

from __future__ import annotations

import json
import os
import pickle
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve().with_name("netns.sh")
INTERFACE = "nx0"
MASTER_PORT = 29500  # every network has its own namespaces, so a fixed port never collides
_ENV_ID = "NETNS_ID"


def unavailable_reason() -> str | None:
    """Why this machine cannot build the emulated network (one line), or None when it can."""
    if sys.platform != "linux":
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return f"needs root (network namespaces, veth and tc); running as uid {os.geteuid()}"
    try:
        check = subprocess.run([str(SCRIPT), "check"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"{SCRIPT.name} check failed: {error}"
    if check.returncode != 0:
        line = (check.stdout or check.stderr).strip().splitlines()
        return line[-1].removeprefix("netns: unavailable: ") if line else f"{SCRIPT.name} check failed"
    return None


def _script(*args: str) -> str:
    result = subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise RuntimeError(f"{SCRIPT.name} {' '.join(args)}: {(result.stderr or result.stdout).strip()}")
    return result.stdout


def rank_namespace(run_id: str, rank: int) -> str:
    return f"{os.environ.get('NETNS_PREFIX', 'bln')}-{run_id}-r{rank}"


class EmulatedNetwork:
    """N namespaces on a bridge with `rate` on each rank's egress ("none": no limit); a context manager."""

    def __init__(self, world_size: int, rate: str = "1gbit") -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.rate = rate
        # The owner PID first: `launch/netns.sh cleanup` removes networks whose owner is gone.
        self.run_id = f"{os.getpid()}-{secrets.token_hex(3)}"
        self._up = False

    def __enter__(self) -> EmulatedNetwork:
        # SIGTERM would end the interpreter without running `finally` blocks: make it an exception so
        # the network is removed (SIGINT already is one). Restored on exit.
        self._previous_sigterm = None
        if threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, _raise_terminated)
        try:
            _script("up", "--id", self.run_id, "--ranks", str(self.world_size), "--rate", self.rate)
        except BaseException:
            self.close()
            raise
        self._up = True
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove everything this network created (ends processes still running inside it)."""
        try:
            _script("down", "--id", self.run_id)
        finally:
            self._up = False
            if getattr(self, "_previous_sigterm", None) is not None:
                signal.signal(signal.SIGTERM, self._previous_sigterm)
                self._previous_sigterm = None

    def namespaces(self) -> list[str]:
        return [rank_namespace(self.run_id, rank) for rank in range(self.world_size)]

    def set_rate(self, rate: str) -> None:
        _script("rate", "--id", self.run_id, rate)
        self.rate = rate

    def counters(self) -> list[dict[str, int]]:
        """Per rank: `tx_bytes`/`rx_bytes` of nx0 and the tbf qdisc's `qdisc_sent_bytes` (0 unshaped)."""
        return [
            _counters(["ip", "netns", "exec", namespace], ["tc", "-n", namespace])
            for namespace in self.namespaces()
        ]

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple = (),
        *,
        timeout: float = 1800,
        num_threads: int = 1,
        env: dict[str, str] | None = None,
    ) -> list[Any]:
        """`fn(rank, world_size, *args)` on every rank; the rank-ordered results. A failing rank fails the
        call with its traceback; the others are stopped (they would otherwise wait for the gloo timeout)."""
        if not self._up:
            raise RuntimeError("EmulatedNetwork.run outside its `with` block")
        with tempfile.TemporaryDirectory(prefix="netns-run-") as folder:
            work = Path(folder)
            with open(work / "call.pkl", "wb") as f:
                pickle.dump((fn, args), f)
            processes = [
                self._start_rank(rank, work, num_threads, env or {}) for rank in range(self.world_size)
            ]
            try:
                self._wait(processes, work, timeout)
            finally:
                for process in processes:
                    if process.poll() is None:
                        process.kill()
                        process.wait()
            return [_load_result(work, rank) for rank in range(self.world_size)]

    def _start_rank(self, rank: int, work: Path, num_threads: int, env: dict[str, str]) -> subprocess.Popen:
        rank_env = {
            **os.environ,
            **env,
            "RANK": str(rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": "0",
            "MASTER_ADDR": "10.77.0.1",
            "MASTER_PORT": str(MASTER_PORT),
            "GLOO_SOCKET_IFNAME": INTERFACE,
            "OMP_NUM_THREADS": str(num_threads),
            _ENV_ID: self.run_id,
        }
        command = ["ip", "netns", "exec", rank_namespace(self.run_id, rank)]
        command += [sys.executable, "-m", "launch.netns", str(work), str(rank)]
        log = open(work / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed with the folder
        return subprocess.Popen(command, env=rank_env, stdout=log, stderr=subprocess.STDOUT, cwd=Path.cwd())

    def _wait(self, processes: list[subprocess.Popen], work: Path, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in processes):
            if any(p.poll() not in (None, 0) for p in processes):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"ranks still running after {timeout:.0f} s; stopped")
            time.sleep(0.2)
        failed = [
            rank for rank, p in enumerate(processes) if p.poll() not in (None, 0) or _failed(work, rank)
        ]
        if failed:
            # One rank's error makes its peers fail too (connection reset), sometimes before the rank at fault
            # has exited (it writes its result, then tears its process group down): report the first to fail.
            first = min(failed, key=lambda rank: _finished_at(work, rank))
            raise RuntimeError(_failure(work, first, processes[first].returncode))


def _result(work: Path, rank: int) -> tuple[bool, Any, int] | None:
    """(ok, value or traceback, when the call ended) as the rank wrote it; None before it has."""
    result = work / f"result{rank}.pkl"
    if not result.exists():
        return None
    with open(result, "rb") as f:
        return pickle.load(f)


def _failed(work: Path, rank: int) -> bool:
    """Whether the rank's call raised (its result is written before the process exits)."""
    result = _result(work, rank)
    return result is not None and not result[0]


def _finished_at(work: Path, rank: int) -> float:
    """When the rank's call ended (the system-wide monotonic clock, taken in the rank as the call returned or
    raised): a file's mtime is too coarse to order a failure and the connection reset it causes."""
    result = _result(work, rank)
    return float("inf") if result is None else result[2]


def _raise_terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _failure(work: Path, rank: int, returncode: int) -> str:
    result = _result(work, rank)
    if result is not None and not result[0]:
        return f"rank {rank} failed:\n{result[1]}"
    log = (work / f"rank{rank}.log").read_text(errors="replace")[-4000:]
    return f"rank {rank} exited with code {returncode}; its output ends:\n{log}"


def _load_result(work: Path, rank: int) -> Any:
    result = _result(work, rank)
    if result is None:
        raise FileNotFoundError(work / f"result{rank}.pkl")
    ok, payload, _ = result
    if not ok:
        raise RuntimeError(f"rank {rank} failed:\n{payload}")
    return payload


def _counters(exec_prefix: list[str], tc_prefix: list[str]) -> dict[str, int]:
    read = subprocess.run(
        [*exec_prefix, "cat", f"/sys/class/net/{INTERFACE}/statistics/tx_bytes",
         f"/sys/class/net/{INTERFACE}/statistics/rx_bytes"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    tx_bytes, rx_bytes = (int(line) for line in read.stdout.split())
    qdisc = subprocess.run(
        [*tc_prefix, "-s", "-j", "qdisc", "show", "dev", INTERFACE],
        capture_output=True,
        text=True,
        check=True,
    )
    sent = sum(q.get("bytes", 0) for q in json.loads(qdisc.stdout or "[]") if q.get("kind") == "tbf")
    return {"tx_bytes": tx_bytes, "rx_bytes": rx_bytes, "qdisc_sent_bytes": sent}


# ------------------------------------------------------------------- helpers for code running in a rank


def interface_counters() -> dict[str, int]:
    """This rank's nx0 byte counters (call from inside `fn`): tx_bytes, rx_bytes, qdisc_sent_bytes."""
    return _counters([], ["tc"])


def set_rate_from_rank(rate: str) -> None:
    """Change the limit of every rank of this network (call on one rank, between barriers)."""
    _script("rate", "--id", os.environ[_ENV_ID], rate)


def _rank_main(work: Path, rank: int) -> int:
    """Entry of one rank (inside its namespace): init gloo, run the pickled call, pickle the result."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        with open(work / "call.pkl", "rb") as f:
            fn, args = pickle.load(f)
        world_size = int(os.environ["WORLD_SIZE"])
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        outcome: tuple[bool, Any] = (True, fn(rank, world_size, *args))
    except BaseException:
        outcome = (False, traceback.format_exc())
    ended = time.monotonic_ns()  # before the process group goes: its teardown makes the peers fail
    try:
        temporary = work / f".result{rank}.pkl.tmp"
        with open(temporary, "wb") as f:
            pickle.dump((*outcome, ended), f)
        os.replace(temporary, work / f"result{rank}.pkl")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0 if outcome[0] else 1


if __name__ == "__main__":
    sys.exit(_rank_main(Path(sys.argv[1]), int(sys.argv[2])))
