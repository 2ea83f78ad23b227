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


@pytest.fixture(scope="session")
def ci_reference_run(tiny_data, tmp_path_factory):
    """The uninterrupted 2-rank run of CI's kill plan recipe (16 + 4 steps, freeze_step 6; checkpoints at
    phase ends only): the reference the kill -9 and fault tests compare with bit for bit."""
    from tests.reliability.harness import pretrain_overrides, torchrun
    from tests.reliability.test_kill_resume import CI_PLAN

    run_dir = tmp_path_factory.mktemp("reference") / "uninterrupted"
    overrides = pretrain_overrides(tiny_data, run_dir, *CI_PLAN.recipe, "checkpoint.every_steps=0")
    outcome = torchrun(overrides, run_dir.with_suffix(".log"))
    assert outcome.returncode == 0, outcome.log[-3000:]
    return run_dir
