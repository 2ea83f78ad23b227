"""Inf/NaN in one rank's gradients (pretrain/distributed/faults.py poisons one element after backward): the
step is
skipped on every rank, parameters, momentum, variance and the 1-bit error-feedback buffers stay as they
were, the skipped-step counter rises in the metrics, and training continues with identical replicas.

The poison lands after DDP's gradient averaging, on one rank only: the hardest case, where only the
cross-rank agreement (a MAX-allreduced flag) keeps the other rank from stepping alone.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from launch.local import run_local
from tests.integration.pretrain_helpers import compose_train_config
from tests.reliability.harness import _digest

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]

FREEZE_STEP = 4
NUM_STEPS = 9
# step -> (action, rank): one in the warmup stage (gradients averaged), one in the compression stage
# (local gradients, momentum exchanged 1-bit compressed)
POISON = {3: ("nan", 1), 7: ("inf", 0)}


def _snapshot(trainer) -> dict[str, str]:
    """Digests of what a skipped step must leave alone (the optimizer state includes the 1-bit
    error-feedback buffers and momentum pad under its "extra" key)."""
    optimizer = trainer.optimizer.state_dict()  # its param groups' lr follows the schedule: left out
    return {
        "parameters": _digest(dict(trainer.model.state_dict())),
        "optimizer": _digest({"state": optimizer["state"], "extra": optimizer.get("extra")}),
    }


def poisoned_worker(rank: int, world_size: int, overrides: list[str]) -> dict:
    from pretrain.distributed.process_group import init_distributed
    from pretrain.train.trainer import Trainer

    os.environ["BERT_LAMB_TEST_FAULT"] = ";".join(f"{a}@{s},rank={r}" for s, (a, r) in POISON.items())
    trainer = Trainer(compose_train_config(overrides), init_distributed())
    phase = trainer._enter_phase(0)
    steps = []
    for step in range(1, NUM_STEPS + 1):
        before = _snapshot(trainer)
        metrics = trainer.train_step(phase)
        assert metrics is not None
        steps.append(
            {
                "step": step,
                "unchanged": _snapshot(trainer) == before,
                "loss": metrics["loss"],
                "skipped_steps": metrics["skipped_steps"],
                "stage": metrics.get("onebit_stage"),
            }
        )
    return {"steps": steps, "final": _snapshot(trainer), "skipped": trainer.state.skipped_steps}


@pytest.mark.parametrize("optim", ["onebit_lamb", "adamw"])
def test_nonfinite_gradient_on_one_rank_skips_the_step_everywhere(
    tiny_data: Path, tmp_path: Path, optim: str, record
):
    overrides = [
        "batch=demo",
        f"optim={optim}",
        "model=bert_tiny",
        f"data_dir={tiny_data}",
        f"run_dir={tmp_path / 'run'}",
        "wandb.mode=disabled",
        "num_workers=0",
        "log_every=1",
        "show_progress=false",
        f"batch.phases.0.freeze_step={FREEZE_STEP}",
        "batch.phases.0.schedule.warmup_steps=2",
    ]
    if optim == "adamw":
        overrides.append("batch.phases.0.lr=1e-3")
    results = run_local(poisoned_worker, 2, (overrides,))
    for rank, result in enumerate(results):
        for entry in result["steps"]:
            skipped = entry["step"] in POISON
            assert entry["unchanged"] == skipped, (rank, entry)  # a skipped step changes nothing at all
            assert math.isfinite(entry["loss"]), (rank, entry)
            assert entry["skipped_steps"] == sum(s <= entry["step"] for s in POISON), (rank, entry)
        assert result["skipped"] == len(POISON)
    # identical replicas (optimizer states differ by design: the 1-bit error feedback is per rank)
    assert results[0]["final"]["parameters"] == results[1]["final"]["parameters"], "replicas diverged"
    if optim == "onebit_lamb":  # the second poisoned step is in the compression stage
        assert results[0]["steps"][6]["stage"] == 1.0 and results[0]["steps"][2]["stage"] == 0.0
    record("nonfinite", optim=optim, poisoned_steps=len(POISON), ranks=2, passed=True)
