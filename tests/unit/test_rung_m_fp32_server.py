"""results/cpu-study-m/ablations/fp32_server.py: the exchange without the server's 1-bit compression."""

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


def test_the_average_is_the_workers_one_bit_values_in_fp32_with_no_server_error():
    engine = patched_engine("fp32_server")(NUMEL, virtual_workers=WORKERS)
    errors = torch.zeros(WORKERS, NUMEL)
    for step in range(3):
        x = values(step)
        out = torch.empty(NUMEL)
        engine(x.clone(), out)
        sent = x + errors  # what each worker compressed: its values plus its error
        errors = engine.worker_errors.clone()
        expected = (sent - errors).mean(0)  # the mean of the workers' 1-bit values Q_i
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
        # not 1-bit: a chunk's average takes many values (the default's: one magnitude per chunk)
        assert out[: NUMEL // WORKERS].abs().unique().numel() > 2
    default = CompressedAllreduce(NUMEL, virtual_workers=WORKERS)
    out = torch.empty(NUMEL)
    default(values(0), out)
    assert out[: NUMEL // WORKERS].abs().unique().numel() == 1


def test_two_processes_give_what_one_process_of_all_workers_gives(tmp_path: Path):
    """2 processes × 2 virtual workers (the all_gather of the fp32 averages) = 1 process × 4, bitwise."""
    assert_two_processes_give_one_process("fp32_server", tmp_path)
