"""A 2-rank pretraining launch over the emulated Ethernet (launch/netns.sh: one network namespace per rank,
joined by veth pairs on a bridge), for the chaos soak's link faults:

    python -m tests.chaos.netjob --id <owner pid>-<suffix> -- <pretrain overrides>

Unlike `launch/netns.sh run`, which stops the other ranks at the first failure (a survivor would then
die before it prints its one line), it waits for every rank like torchrun's agent: once one rank has
failed the others have `--grace` seconds to exit on their own, then they are SIGKILLed. The exit code
follows launch/elastic.py: the first failed rank's code when it is one the project reports itself
(2, 75, 76), else 76 when a rank exited 76, else the first failed rank's (1 for a signal). A rank killed
by a signal is reported as torchrun would (`exitcode  : -9`). The network is removed on every way out;
`NETNS_PREFIX=<prefix> launch/netns.sh cleanup` removes what a killed harness left.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "launch" / "netns.sh"
REPORTED = (2, 75, 76)
DEFAULT_PREFIX = "chaos"  # `python -m tests.chaos` sets it when NETNS_PREFIX is unset


def prefix() -> str:
    """The namespaces' prefix, read when it is used: the soak process and the netjob it starts (which
    inherits the soak's environment) name the same namespaces whenever NETNS_PREFIX was set."""
    return os.environ.get("NETNS_PREFIX", DEFAULT_PREFIX)


def hub(run_id: str) -> str:
    return f"{prefix()}-{run_id}-hub"


def link(run_id: str, rank: int, up: bool) -> None:
    """Take rank `rank`'s cable out of the bridge (its hub end down), or put it back."""
    state = "up" if up else "down"
    subprocess.run(["ip", "-n", hub(run_id), "link", "set", f"r{rank}", state], check=True, timeout=30)


def _script(*args: str) -> None:
    env = {**os.environ, "NETNS_PREFIX": prefix()}
    done = subprocess.run([str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"netns.sh {' '.join(args)}: {(done.stderr or done.stdout).strip()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.netjob")
    parser.add_argument("--id", required=True)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--grace", type=float, default=30.0)
    parser.add_argument("overrides", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    overrides = args.overrides[1:] if args.overrides[:1] == ["--"] else args.overrides
    processes: list[subprocess.Popen] = []

    def stop(signum: int, frame: object) -> None:  # the supervisor forwards SIGTERM: pass it on
        for process in processes:
            if process.poll() is None:
                process.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    _script("up", "--id", args.id, "--ranks", str(args.ranks), "--rate", "none")
    try:
        for rank in range(args.ranks):
            env = {
                **os.environ,
                "RANK": str(rank), "WORLD_SIZE": str(args.ranks), "LOCAL_RANK": "0",
                "MASTER_ADDR": "10.77.0.1", "MASTER_PORT": "29500", "GLOO_SOCKET_IFNAME": "nx0",
            }  # fmt: skip
            command = ["ip", "netns", "exec", f"{prefix()}-{args.id}-r{rank}"]
            command += [sys.executable, "-m", "pretrain", *overrides]
            processes.append(subprocess.Popen(command, env=env, cwd=REPO))
        first_failure: int | None = None
        deadline = None
        while any(p.poll() is None for p in processes):
            if first_failure is None:
                failed = [r for r, p in enumerate(processes) if p.poll() not in (None, 0)]
                if failed:
                    first_failure, deadline = failed[0], time.monotonic() + args.grace
            elif deadline is not None and time.monotonic() > deadline:
                for process in processes:
                    if process.poll() is None:
                        process.kill()
            time.sleep(0.1)
        codes = [p.returncode for p in processes]
        for rank, code in enumerate(codes):
            if code < 0:
                print(f"netjob: rank {rank} exitcode  : {code} ({signal.Signals(-code).name})", flush=True)
        if first_failure is None:
            first_failure = next((r for r, code in enumerate(codes) if code != 0), None)
        if first_failure is None:
            return 0
        first = codes[first_failure]
        if first in REPORTED:
            return first
        if 76 in codes:
            return 76
        return first if first > 0 else 1
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        _script("down", "--id", args.id)


if __name__ == "__main__":
    sys.exit(main())
