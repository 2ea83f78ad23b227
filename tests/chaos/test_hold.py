"""faults.py's `hold`: the rank announces the fault point and waits there until the harness lets it go."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from pretrain.distributed.faults import Fault, FaultInjector, parse


def test_hold_waits_at_its_point_until_the_file_is_removed(tmp_path: Path, monkeypatch):
    marker = tmp_path / "hold"
    monkeypatch.setenv("BERT_LAMB_TEST_FAULT_FILE", str(marker))
    assert parse("hold@7:exchange,rank=1") == [Fault("hold", 7, "exchange", rank=1)]
    assert parse("hold@3")[0].point == "mid_step"
    injector = FaultInjector(parse("hold@7:after_step,rank=1"), rank=1, attempt=0)
    injector.at("after_step", 6)  # another step: no hold
    assert not marker.exists()
    released = threading.Event()

    def rank() -> None:
        injector.at("after_step", 7)
        released.set()

    thread = threading.Thread(target=rank)
    thread.start()
    deadline = time.monotonic() + 10
    while not marker.exists():
        assert time.monotonic() < deadline, "the rank never announced the point"
        time.sleep(0.01)
    assert marker.read_text().split() == [str(os.getpid()), "1", "after_step", "7"]
    time.sleep(0.2)
    assert not released.is_set()  # still held
    marker.unlink()
    thread.join(timeout=10)
    assert released.is_set()
    injector.at("after_step", 7)  # fired once only
    assert not marker.exists()
