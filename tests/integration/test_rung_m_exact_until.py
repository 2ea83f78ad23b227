"""results/cpu-study-m/ablations/exact_until.py: exact averaging through RUNG_EXACT_UNTIL, the default after.

The demo recipe's tiny 1-bit LAMB run (2 simulated workers, freeze at step 12) with the patch applied in its
processes (sitecustomize.py, as the screens run it), checkpointed every step, against the same run with
`exact_mean` and with the default: through step 13 its weights are `exact_mean`'s bit for bit (not the
default's); from step 14 its exchange compresses, so they leave `exact_mean`'s.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.integration.rung_m_patched import train_patched

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]


def weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / f"step-{step:08d}" / "model.safetensors")


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def test_exact_through_the_named_step_then_compressed(
    tiny_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    runs = {arm: tmp_path / arm for arm in ("until", "exact", "default")}
    train_patched(tiny_data, runs["until"], monkeypatch, "exact_until", RUNG_EXACT_UNTIL="13")
    train_patched(tiny_data, runs["exact"], monkeypatch, "exact_mean")
    train_patched(tiny_data, runs["default"], monkeypatch, None)
    assert same(weights(runs["until"], 12), weights(runs["default"], 12))  # the warmup is everyone's
    assert same(weights(runs["until"], 13), weights(runs["exact"], 13))
    assert not same(weights(runs["until"], 13), weights(runs["default"], 13))
    assert not same(weights(runs["until"], 14), weights(runs["exact"], 14))
