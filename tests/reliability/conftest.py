"""Fixtures of the reliability suite. `record` appends facts for the report (tests/reliability/report.py)
to $RELIABILITY_RECORD when set, and does nothing otherwise."""

from __future__ import annotations

import json
import os

import pytest

FULL_ENV = "RELIABILITY_FULL"  # 1: the slow suite's 10 kill points instead of CI's 3


def full_suite() -> bool:
    return os.environ.get(FULL_ENV, "") not in ("", "0")


@pytest.fixture
def record(request):
    path = os.environ.get("RELIABILITY_RECORD")

    def write(kind: str, **facts) -> None:
        if path:
            with open(path, "a") as file:
                file.write(json.dumps({"kind": kind, "test": request.node.nodeid, **facts}) + "\n")

    return write
