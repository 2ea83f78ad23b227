"""results/cpu-study-m/ablations/exact_mean.py: the exchange with no compression."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.unit.rung_m_patches import (
    NUMEL,
    WORKERS,
    assert_two_processes_give_one_process,
    patched_engine,
    values,
)


def test_every_step_sends_the_exact_mean_and_keeps_no_error():
    engine = patched_engine("exact_mean")(NUMEL, virtual_workers=WORKERS)
    for step in range(3):
        x = values(step)
        out = torch.empty(NUMEL)
        engine(x.clone(), out)
        # the workers' values summed in worker order, divided by n: no 1-bit pass on either side
        expected = sum(x[w] for w in range(WORKERS)) / WORKERS
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
        assert out.abs().unique().numel() > WORKERS  # not a sign pattern with one scale per chunk
        assert not engine.worker_error.any() and not engine.server_error.any()


def test_two_processes_give_what_one_process_of_all_workers_gives(tmp_path: Path):
    assert_two_processes_give_one_process("exact_mean", tmp_path)
