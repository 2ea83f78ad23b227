"""The rung-M ablation patches' tests' run: the demo recipe's tiny 1-bit LAMB run (2 simulated workers, freeze
at step 12) to step 15, checkpointed every step, with a patch of results/cpu-study-m/ablations/ applied in its
processes by that folder's sitecustomize.py, as the screens run it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from launch.local import run_local
from tests.integration.pretrain_helpers import tiny_run_overrides, train_worker

REPO = Path(__file__).resolve().parents[2]
ABLATIONS = REPO / "results" / "cpu-study-m" / "ablations"


def train_patched(
    data: Path,
    run: Path,
    monkeypatch: pytest.MonkeyPatch,
    ablation: str | None,
    *extra: str,
    **environment: str,
) -> None:
    """Train into `run` with the patch `ablation` (None: the default) and `environment` set; `extra`: more
    overrides."""
    with monkeypatch.context() as env:
        for name, value in environment.items():
            env.setenv(name, value)
        if ablation is not None:
            env.setenv("RUNG_ABLATION", ablation)
            env.setenv(
                "PYTHONPATH", os.pathsep.join([str(ABLATIONS), str(REPO), os.environ.get("PYTHONPATH", "")])
            )
        steps = ("sim_world_size=2", "checkpoint.every_steps=1", "checkpoint.keep_last=16", "max_steps=15")
        run_local(train_worker, 1, (tiny_run_overrides(data, run, "onebit_lamb", *steps, *extra),))
