"""bench/fidelity.py: the study's comparison as benchmark records, and BERT-Large's exchange bytes."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.fidelity import byte_cost_records, records_from_summary
from results.compare.runs import load_local_runs
from tests.unit.test_compare import LAMB_1, LAMB_2, ONEBIT_1, ONEBIT_2, summary_of, write_run

REMEDY = {"compression": "per_row", "sign_scale": "mean_abs", "trust_ratio": "live"}


def test_records_name_arms_workers_and_ratios(tmp_path: Path):
    for seed, losses in ((1, LAMB_1), (2, LAMB_2)):
        write_run(tmp_path, f"lamb-s{seed}", "lamb", seed, losses)
    write_run(tmp_path, "ds-s1", "onebit_lamb", 1, ONEBIT_1, optim={"compression": "deepspeed"})
    write_run(tmp_path, "ds-s2", "onebit_lamb", 2, [*ONEBIT_2[:4], float("nan"), float("nan")])
    write_run(tmp_path, "remedy-sim-s1", "onebit_lamb", 1, ONEBIT_2, optim=REMEDY, sim_world_size=16)
    summary = summary_of(load_local_runs(["*"], root=tmp_path))
    records = {record.name: record for record in records_from_summary(summary)}
    deepspeed = records["final_mlm_loss_ratio_deepspeed_n2"]
    assert deepspeed.value == pytest.approx((6.6 + 5.9) / 2)  # the diverged seed is left out
    assert deepspeed.peer_value == pytest.approx((6.0 + 5.0 + 6.0 + 7.0) / 4)
    assert deepspeed.config["diverged_runs"] == 1 and deepspeed.target is None
    remedy = records["final_mlm_loss_ratio_per_row_sign_scale_mean_abs_trust_ratio_live_n32sim"]
    assert remedy.config["simulated_workers"] and remedy.config["workers"] == 32
    assert remedy.target is not None and remedy.value == pytest.approx((7.0 + 6.5) / 2)
    assert "lamb_final_mlm_accuracy_n2" not in records  # the synthetic runs log no accuracy
    assert records["volume_reduction_vs_fp32_deepspeed_n2"].value > 1
    long = {record.name for record in records_from_summary(summary, tail="_long")}
    assert "final_mlm_loss_ratio_deepspeed_n2_long" in long and len(long) == len(records)


def test_bert_large_exchange_bytes_stay_15_5x_below_fp16_with_per_row_scales():
    records = {record.name: record for record in byte_cost_records()}
    per_row = records["bert_large_compression_bytes_per_row_n64"]
    assert per_row.config["parameters"] > 330_000_000
    assert per_row.peer_value / per_row.value >= 15.5
    assert per_row.config["scale_segments"] > 30_000  # a scale per embedding row and per tensor
    assert records["bert_large_compression_bytes_deepspeed_n64"].config[
        "times_less_than_fp16"
    ] == pytest.approx(16.0, abs=0.01)
    assert (
        records["bert_large_compression_bytes_per_row_exact_vectors_n64"].config["times_less_than_fp16"]
        < 15.5
    )
    # the default (per_column): a scale per input column of every matrix too, still within the budget
    per_column = records["bert_large_compression_bytes_per_column_n64"]
    assert per_column.peer_value / per_column.value >= 15.5
    # 24 layers x (Q, K, V, O, FFN-in: 1,024 columns; FFN-out: 4,096) + the embedding rows, on top of per_row
    assert per_column.config["scale_segments"] - per_row.config["scale_segments"] >= 24 * 9216
    assert per_column.value > per_row.value


def test_variance_refresh_bytes_local_over_the_budget_blocks_within():
    """One refresh per 64 steps on top of the default exchange: `local`'s fp32 allreduce of every element
    costs BERT-Large a third of its saving; `blocks`' bfloat16 sum per 128 elements and `rank1`'s row and
    column sums keep it >= 15.5x."""
    records = {record.name: record for record in byte_cost_records()}
    exchange = records["bert_large_compression_bytes_per_column_exact_vectors_bfloat16_n64"]
    local = records["bert_large_compression_bytes_default_refresh_local_k64_n64"]
    blocks = records["bert_large_compression_bytes_default_refresh_blocks128_k64_n64"]
    assert local.config["exchange_bytes"] == blocks.config["exchange_bytes"] == exchange.value
    # local: 2·63/64 · 4 bytes · N / 64 per step, half again the exchange's bytes
    assert local.config["refresh_bytes_per_step"] == pytest.approx(2 * 63 / 64 * 4 * 336.2e6 / 64, rel=0.01)
    assert local.config["times_less_than_fp16"] == pytest.approx(10.46, abs=0.02)
    assert blocks.config["times_less_than_fp16"] >= 15.5
    assert blocks.config["refresh_bytes_per_step"] < local.config["refresh_bytes_per_step"] / 200
    rank1 = records["bert_large_compression_bytes_default_refresh_rank1_k64_n64"]
    assert rank1.config["times_less_than_fp16"] >= 15.5
    assert rank1.config["refresh_bytes_per_step"] < blocks.config["refresh_bytes_per_step"]
