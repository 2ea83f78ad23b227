"""bench/fidelity.py: the study's comparison as benchmark records, and BERT-Large's exchange bytes."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.fidelity import (
    BYTE_COST_MODES,
    BYTE_COST_WORLD_SIZES,
    REFRESH_MODES,
    byte_cost_records,
    records_from_summary,
)
from results.compare.runs import load_local_runs
from tests.unit.test_compare import LAMB_1, LAMB_2, ONEBIT_1, ONEBIT_2, summary_of, write_run


def test_records_name_arms_workers_and_ratios(tmp_path: Path):
    for seed, losses in ((1, LAMB_1), (2, LAMB_2)):
        write_run(tmp_path, f"lamb-s{seed}", "lamb", seed, losses)
    write_run(tmp_path, "ds-s1", "onebit_lamb_deepspeed", 1, ONEBIT_1)
    write_run(tmp_path, "ds-s2", "onebit_lamb_deepspeed", 2, [*ONEBIT_2[:4], float("nan"), float("nan")])
    write_run(tmp_path, "default-sim-s1", "onebit_lamb", 1, ONEBIT_2, sim_world_size=16)
    write_run(tmp_path, "frozen-v-s1", "onebit_lamb", 1, ONEBIT_2, optim={"variance_refresh": 0})
    summary = summary_of(load_local_runs(["*"], root=tmp_path))
    records = {record.name: record for record in records_from_summary(summary)}
    deepspeed = records["final_mlm_loss_ratio_onebit_lamb_deepspeed_n2"]
    assert deepspeed.value == pytest.approx((6.6 + 5.9) / 2)  # the diverged seed is left out
    assert deepspeed.peer_value == pytest.approx((6.0 + 5.0 + 6.0 + 7.0) / 4)
    assert deepspeed.config["diverged_runs"] == 1 and deepspeed.target is None
    default = records["final_mlm_loss_ratio_onebit_lamb_n32sim"]
    assert default.config["simulated_workers"] and default.config["workers"] == 32
    assert default.target is not None and default.value == pytest.approx((7.0 + 6.5) / 2)
    ablation = records["final_mlm_loss_ratio_onebit_lamb_variance_refresh_0_n2"]
    assert ablation.target is None and ablation.config["variant"] == "variance_refresh=0"
    assert "lamb_final_mlm_accuracy_n2" not in records  # the synthetic runs log no accuracy
    assert records["volume_reduction_vs_fp32_onebit_lamb_deepspeed_n2"].value > 1
    long = {record.name for record in records_from_summary(summary, tail="_long")}
    assert "final_mlm_loss_ratio_onebit_lamb_deepspeed_n2_long" in long and len(long) == len(records)


def test_bert_large_exchange_bytes_stay_15_5x_below_fp16():
    records = {record.name: record for record in byte_cost_records()}
    assert set(records) == {
        f"bert_large_compression_bytes_{mode}_n{n}"
        for mode in (*BYTE_COST_MODES, *REFRESH_MODES)
        for n in BYTE_COST_WORLD_SIZES
    }
    assert records["bert_large_compression_bytes_deepspeed_n64"].config[
        "times_less_than_fp16"
    ] == pytest.approx(16.0, abs=0.01)
    # per_column: a scale per tensor, embedding row and input column of every other matrix
    per_column = records["bert_large_compression_bytes_per_column_n64"]
    assert per_column.config["parameters"] > 330_000_000
    assert per_column.peer_value / per_column.value >= 15.5
    # 24 layers x (Q, K, V, O, FFN-in: 1,024 columns; FFN-out: 4,096) + the 30,522 + 2 embedding rows
    assert per_column.config["scale_segments"] >= 24 * 9216 + 30_524
    # optim=onebit_lamb's exchange: the 1-D tensors exactly, affordable with bfloat16 scales
    default = records["bert_large_compression_bytes_per_column_exact_vectors_bfloat16_n64"]
    assert default.config["times_less_than_fp16"] >= 15.5
    assert default.value > records["bert_large_compression_bytes_per_column_bfloat16_n64"].value


def test_the_variance_refresh_keeps_the_exchange_within_the_budget():
    """optim=onebit_lamb's refresh every 64 steps (the decayed matrices' row and column sums in fp32) on
    top of its exchange: still >= 15.5x less than an fp16 allreduce."""
    records = {record.name: record for record in byte_cost_records()}
    exchange = records["bert_large_compression_bytes_per_column_exact_vectors_bfloat16_n64"]
    rank1 = records["bert_large_compression_bytes_default_refresh_rank1_k64_n64"]
    assert rank1.config["exchange_bytes"] == exchange.value
    assert 0 < rank1.config["refresh_bytes_per_step"] < exchange.value / 100
    assert rank1.config["times_less_than_fp16"] >= 15.5
