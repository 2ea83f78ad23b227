"""The scaling model (bench/scaling.py): its formulas against hand-computed values, and the report built
from the committed quick measurements."""

from __future__ import annotations

import json

import pytest

from bench import scaling
from bench.records import RESULTS_DIR

N = 336_000_000


def test_ring_allreduce_seconds_by_hand():
    # 4 ranks: each link carries 2*3/4 = 1.5x the buffer; 2 buckets x 2*3 messages x alpha
    assert scaling.ring_allreduce_seconds(1e9, 4, 1e9, 1e-3, num_buckets=2) == pytest.approx(1.5 + 12e-3)
    assert scaling.ring_allreduce_seconds(1e9, 1, 1e9, 1e-3) == 0.0


def test_compressed_nic_bytes_flat_and_hierarchical():
    assert scaling.compressed_nic_bytes(N, 8, 8, hierarchical=False) == 0.0  # one node: no NIC
    # 16 GPUs, 2 nodes: all_to_all 8 x 8/16 x N/8 plus the all_gather's 15/16 x N/8
    assert scaling.compressed_nic_bytes(N, 16, 8, hierarchical=False) == pytest.approx(
        N / 2 + 15 / 16 * N / 8
    )
    # hierarchical over 2 nodes: (2-1)/2 x N/4
    assert scaling.compressed_nic_bytes(N, 16, 8, hierarchical=True) == pytest.approx(N / 8)
    flat = scaling.compressed_nic_bytes(N, 256, 8, hierarchical=False)
    fp16_ring = 2 * 255 / 256 * 2 * N
    # 256 GPUs: the fp16 ring carries 4 x 255/256 N; flat 1-bit (8 x 248 + 255)/256 x N/8: ~3.6x, not 16x
    assert fp16_ring / flat == pytest.approx(4 * 255 * 8 / (8 * 248 + 255))


def test_volume_reduction_limits():
    assert scaling.volume_reduction(100, 100, 64, N) == pytest.approx(1.0)
    assert scaling.volume_reduction(0, 100, 64, N) == pytest.approx(16.0, rel=1e-4)
    # warmup fraction w: 1 / (w + (1 - w)/16)
    assert scaling.volume_reduction(16, 100, 64, N) == pytest.approx(1 / (0.16 + 0.84 / 16), rel=1e-4)


def test_step_times_compression_stage_beats_lamb_on_slow_links_only():
    calibration = scaling.Calibration(0.9, 20.0, 1e-9, 1e10, {})
    gpu = scaling.GPUS[0]
    slow = scaling.step_times(gpu, scaling.NETWORKS[0], calibration, 256, 65536, 64, 128)
    fast = scaling.step_times(gpu, scaling.NETWORKS[-1], calibration, 256, 65536, 64, 128)
    assert slow.lamb / slow.onebit_flat > fast.lamb / fast.onebit_flat >= 0.9
    assert slow.compute == pytest.approx(65536 / (256 * gpu.samples_per_s[128]))
    assert slow.onebit_hierarchical < slow.onebit_flat


def test_report_from_the_committed_quick_measurements(tmp_path):
    scaling.main(
        [
            f"--net={RESULTS_DIR / 'net_quick.json'}",
            f"--e2e={RESULTS_DIR / 'net_e2e_quick.json'}",
            f"--out={tmp_path}",
        ]
    )
    projection = json.loads((tmp_path / "projection.json").read_text())
    rows = projection["projection"]
    expected = len(scaling.GPUS) * len(scaling.NETWORKS) * len(scaling.GPU_COUNTS) * len(scaling.BATCHES)
    assert len(rows) == expected
    assert 0 < projection["calibration"]["bandwidth_efficiency"] <= 1.0
    assert all(r["speedup_hierarchical"] >= r["speedup_flat"] > 0 for r in rows)
    ten_gbe = {r["gpus"]: r["speedup_flat"] for r in rows if r["network"] == "10GbE" and r["batch"] == "64k"}
    assert ten_gbe[256] > ten_gbe[16] and ten_gbe[256] > 1.0  # communication-bound: 1-bit LAMB gains
    assert projection["validation_cpu"], "the CPU check of the model has no rows"
    report = (tmp_path / "report.md").read_text()
    assert "## Against the published 1-bit LAMB claims" in report and "speedup.png" in report
    assert (tmp_path / "speedup.png").stat().st_size > 10_000
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*"))


def test_the_checks_comment_follows_the_sign_of_its_misses():
    def rows(*pairs):
        return [{"predicted_onebit_seconds": p, "measured_seconds": {"onebit_lamb": m}} for p, m in pairs]

    shorter = " ".join(scaling._validation_comment(rows((1.0, 2.0))))
    longer = " ".join(scaling._validation_comment(rows((2.1, 1.8), (4.2, 3.9))))
    both = " ".join(scaling._validation_comment(rows((1.0, 2.0), (4.2, 3.9))))
    assert "shorter than the measured" in shorter and "longer" not in shorter
    assert "longer than the measured" in longer and "shorter" not in longer
    assert "shorter than the measured" in both and "longer than the measured" in both
