"""results/cpu-study-m/ablations/exact_live_variance.py: no compression and every tensor's variance live.

The demo recipe's tiny 1-bit LAMB run (2 simulated workers, freeze at step 12) with the patch applied in its
processes (sitecustomize.py, as the screens run it), checkpointed every step: between two compression steps
every matrix's v moved as LAMB's does, v ← β2·v + (1−β2)·ĝ², ĝ the averaged gradient recovered from the two
momenta; without the patch the matrices' v stays frozen.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import BertConfig, BertForPreTraining

from launch.local import run_local
from pretrain.checkpoint import load_checkpoint
from tests.integration.pretrain_helpers import tiny_run_overrides, train_worker

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
FOLDER = REPO / "results" / "cpu-study-m" / "ablations"
BETA1, BETA2 = 0.9, 0.999


def matrices(run: Path, step: int) -> list[dict[str, torch.Tensor]]:
    checkpoint = run / "checkpoints" / f"step-{step:08d}"
    model = BertForPreTraining(BertConfig.from_pretrained(checkpoint / "hf"))
    states = load_checkpoint(checkpoint, 0, model)[0]["optimizer"]["state"]
    return [states[i] for i in sorted(states) if states[i]["exp_avg"].dim() == 2]


def train(data: Path, run: Path, monkeypatch: pytest.MonkeyPatch, ablation: str | None) -> None:
    with monkeypatch.context() as env:
        if ablation is not None:
            env.setenv("RUNG_ABLATION", ablation)
            env.setenv(
                "PYTHONPATH", os.pathsep.join([str(FOLDER), str(REPO), os.environ.get("PYTHONPATH", "")])
            )
        extra = ("sim_world_size=2", "checkpoint.export_hf=true", "checkpoint.every_steps=1", "max_steps=15")
        run_local(train_worker, 1, (tiny_run_overrides(data, run, "onebit_lamb", *extra),))


def test_every_matrix_variance_follows_the_averaged_gradient(
    tiny_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    train(tiny_data, tmp_path / "live", monkeypatch, "exact_live_variance")
    before, after = matrices(tmp_path / "live", 14), matrices(tmp_path / "live", 15)
    for old, new in zip(before, after, strict=True):
        gradient = (new["exp_avg"] - BETA1 * old["exp_avg"]) / (1 - BETA1)
        expected = BETA2 * old["exp_avg_sq"] + (1 - BETA2) * gradient.square()
        torch.testing.assert_close(new["exp_avg_sq"], expected, rtol=1e-4, atol=1e-12)
        assert not torch.equal(new["exp_avg_sq"], old["exp_avg_sq"])
        assert not torch.equal(new["exp_avg_sq"], new["exp_avg_sq_fresh"])  # not the freeze's v any more

    train(tiny_data, tmp_path / "default", monkeypatch, None)
    before, after = matrices(tmp_path / "default", 14), matrices(tmp_path / "default", 15)
    assert all(torch.equal(new["exp_avg_sq"], old["exp_avg_sq"]) for old, new in zip(before, after))
