"""The comparison step on real run folders: two short 2-process pretraining runs, LAMB and 1-bit LAMB."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from launch.local import run_local
from results.compare import build, load_local_runs, write_outputs
from results.compare.dashboard import GROUP_BY
from tests.integration.pretrain_helpers import read_metrics, train_worker

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]

STEPS = 16  # crosses the demo recipe's freeze_step (12)


def test_compare_real_runs(tiny_data: Path, tmp_path: Path):
    for optim in ("lamb", "onebit_lamb"):
        overrides = [
            "batch=demo",
            f"optim={optim}",
            "model=bert_tiny",
            f"data_dir={tiny_data}",
            f"run_dir={tmp_path / 'runs' / f'demo-{optim}'}",
            "wandb.mode=disabled",
            "num_workers=0",
            "log_every=2",
            "show_progress=false",
            "checkpoint.export_hf=false",
            f"max_steps={STEPS}",
        ]
        run_local(train_worker, 2, (overrides,))
    onebit_dir = tmp_path / "runs" / "demo-onebit_lamb"
    config = yaml.safe_load((onebit_dir / "config.yaml").read_text())
    # the flat keys the dashboard groups by are in what the trainer logs (and writes to config.yaml)
    assert {key: config[key] for key in GROUP_BY} == {"optimizer": "onebit_lamb", "global_batch": 32}
    assert config["world_size"] == 2

    runs = load_local_runs([str(tmp_path / "runs" / "demo-*")])
    cfg = SimpleNamespace(
        study="real",
        target_loss=None,
        target_margin=0.02,
        reference_optimizer="lamb",
        smoothing=0.5,
        final_window=3,
    )
    out = tmp_path / "out"
    write_outputs(out, build(runs, cfg, "test"))
    summary = json.loads((out / "summary.json").read_text())
    by_name = {r["name"]: r for r in summary["runs"]}
    onebit, lamb = by_name["demo-onebit_lamb"], by_name["demo-lamb"]
    metrics = read_metrics(onebit_dir)
    assert onebit["samples_seen"] == metrics[-1]["samples_seen"] == STEPS * 32
    assert onebit["onebit_start_samples"] == 12 * 32  # freeze_step x phase 1's global batch
    assert onebit["final_mlm_loss"] == pytest.approx(sum(m["mlm_loss"] for m in metrics[-3:]) / 3)
    reduction = metrics[-1]["bytes_lamb_cumulative"] / metrics[-1]["bytes_cumulative"]
    assert onebit["volume_reduction_vs_lamb"] == pytest.approx(reduction)
    # 12 fp32 steps, then 4 compressed steps at ~1/32 of one: 16 / (12 + 4 x ~1/32)
    assert 16 / (12 + 4 * 0.1) < reduction < 16 / 12
    assert lamb["volume_reduction_vs_lamb"] == pytest.approx(1.0, rel=1e-3)
    (gap,) = summary["gaps"]
    assert gap["equal_samples"] and gap["final_mlm_loss_gap_pct"] is not None
    assert (out / "pretrain_loss.png").stat().st_size > 10_000
