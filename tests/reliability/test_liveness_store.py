"""The survivor's diagnosis ends even when the rendezvous store's host is stopped (found by the chaos soak,
tests/chaos/: a 1-bit LAMB run over network namespaces, without torchrun's agent store, rank 0 SIGSTOPped).

Rank 0 hosts the store there; a TCPStore client's `check` on a stopped server blocks for good, whatever
its timeout, so the survivor waited in `silent_ranks` until rank 0 woke up, and then named no one
("every other rank still beats"). The diagnosis is now bounded and says the store is unreachable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pretrain.config import DistConfig
from pretrain.distributed.liveness import Heartbeat, describe
from pretrain.distributed.process_group import DistributedEnv


# slow tier: it waits out the diagnosis's 15 s bound (wall time, ~2 s of CPU)
@pytest.mark.slow
def test_a_stopped_store_host_does_not_hang_the_survivor(tmp_path: Path):
    code = (
        "import sys, time, torch.distributed as d; "
        "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False); "
        "print(s.port, flush=True); time.sleep(300)"
    )
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())  # type: ignore[union-attr]
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
        env = DistributedEnv(1, 2, 1, torch.device("cpu"), "gloo")
        cfg = DistConfig(timeout_s=2.0, heartbeat_s=0.5)
        heartbeat = Heartbeat(store, env, cfg, progress=lambda: 5)
        store.set("beat/0", f"{time.time():.3f} 5")
        os.kill(server.pid, signal.SIGSTOP)  # rank 0, and the store it hosts, stall
        started = time.monotonic()
        line = describe(RuntimeError("Timed out waiting 2000ms"), heartbeat, 5, cfg, tmp_path)
        seconds = time.monotonic() - started
    finally:
        server.kill()
        server.wait()
    assert seconds < 2 * cfg.heartbeat_s + 15 + 5, seconds
    assert "the rendezvous store is unreachable too" in line, line
    assert line.startswith("step 5: a collective timed out after 2 s (dist.timeout_s)"), line
