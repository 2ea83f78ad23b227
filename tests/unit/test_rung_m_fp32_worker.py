"""results/cpu-study-m/ablations/fp32_worker.py: the exchange without the workers' 1-bit compression."""

from __future__ import annotations

from pathlib import Path

import torch

from pretrain.comm.compressed_allreduce import CompressedAllreduce
from tests.unit.rung_m_patches import (
    NUMEL,
    WORKERS,
    assert_two_processes_give_one_process,
    patched_engine,
    values,
)


def test_the_average_is_the_servers_one_bit_pass_on_the_exact_mean():
    engine = patched_engine("fp32_worker")(NUMEL, virtual_workers=WORKERS)
    chunk = NUMEL // WORKERS
    error = torch.zeros(NUMEL)  # the servers' errors, chunk by chunk
    for step in range(3):
        x = values(step)
        out = torch.empty(NUMEL)
        engine(x.clone(), out)
        new_error = engine.server_error.reshape(-1).clone()
        # error feedback on the exact mean: what was sent is mean + e_s − e_s'
        torch.testing.assert_close(out, x.mean(0) + error - new_error, rtol=0, atol=1e-5)
        error = new_error
        for c in range(WORKERS):  # 1 bit: one magnitude per chunk (one scale each by default)
            assert out[c * chunk : (c + 1) * chunk].abs().unique().numel() == 1
        assert not engine.worker_error.any()  # the workers compress nothing
    # the default's average differs: its workers' signs lose what the exact mean keeps
    default = CompressedAllreduce(NUMEL, virtual_workers=WORKERS)
    expected = torch.empty(NUMEL)
    default(values(0), expected)
    first = patched_engine("fp32_worker")(NUMEL, virtual_workers=WORKERS)
    out = torch.empty(NUMEL)
    first(values(0), out)
    assert not torch.equal(out, expected)


def test_two_processes_give_what_one_process_of_all_workers_gives(tmp_path: Path):
    """2 processes × 2 virtual workers (the exact mean's all-to-all, the servers' all-gather) = 1 × 4."""
    assert_two_processes_give_one_process("fp32_worker", tmp_path)
