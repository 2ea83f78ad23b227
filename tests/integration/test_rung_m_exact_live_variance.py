"""results/cpu-study-m/ablations/exact_live_variance.py: no compression and every tensor's variance live.

The demo recipe's tiny 1-bit LAMB run (2 simulated workers, freeze at step 12) with the patch applied in its
processes (sitecustomize.py, as the screens run it), checkpointed every step: between two compression steps
every matrix's v moved as LAMB's does, v ← β2·v + (1−β2)·ĝ², ĝ the averaged gradient recovered from the two
momenta; without the patch the matrices' v stays frozen.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import BertConfig, BertForPreTraining

from pretrain.checkpoint import load_checkpoint
from tests.integration.rung_m_patched import train_patched

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]

BETA1, BETA2 = 0.9, 0.999


def matrices(run: Path, step: int) -> list[dict[str, torch.Tensor]]:
    checkpoint = run / "checkpoints" / f"step-{step:08d}"
    model = BertForPreTraining(BertConfig.from_pretrained(checkpoint / "hf"))
    states = load_checkpoint(checkpoint, 0, model)[0]["optimizer"]["state"]
    return [states[i] for i in sorted(states) if states[i]["exp_avg"].dim() == 2]


def test_every_matrix_variance_follows_the_averaged_gradient(
    tiny_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    train_patched(
        tiny_data, tmp_path / "live", monkeypatch, "exact_live_variance", "checkpoint.export_hf=true"
    )
    before, after = matrices(tmp_path / "live", 14), matrices(tmp_path / "live", 15)
    for old, new in zip(before, after, strict=True):
        gradient = (new["exp_avg"] - BETA1 * old["exp_avg"]) / (1 - BETA1)
        expected = BETA2 * old["exp_avg_sq"] + (1 - BETA2) * gradient.square()
        torch.testing.assert_close(new["exp_avg_sq"], expected, rtol=1e-4, atol=1e-12)
        assert not torch.equal(new["exp_avg_sq"], old["exp_avg_sq"])
        assert not torch.equal(new["exp_avg_sq"], new["exp_avg_sq_fresh"])  # not the freeze's v any more

    train_patched(tiny_data, tmp_path / "default", monkeypatch, None, "checkpoint.export_hf=true")
    before, after = matrices(tmp_path / "default", 14), matrices(tmp_path / "default", 15)
    assert all(torch.equal(new["exp_avg_sq"], old["exp_avg_sq"]) for old, new in zip(before, after))
