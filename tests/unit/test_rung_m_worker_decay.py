"""results/cpu-study-m/ablations/worker_decay.py: the default's exchange with the workers' errors decayed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pretrain.comm.compressed_allreduce import CompressedAllreduce
from tests.unit.rung_m_patches import (
    NUMEL,
    WORKERS,
    assert_two_processes_give_one_process,
    patched_engine,
    values,
)


def test_each_step_is_the_defaults_and_the_workers_errors_are_decayed():
    decayed = patched_engine("worker_decay")(NUMEL, virtual_workers=WORKERS)
    default = CompressedAllreduce(NUMEL, virtual_workers=WORKERS)
    for step in range(3):
        x = values(step)
        out, expected = torch.empty(NUMEL), torch.empty(NUMEL)
        decayed(x.clone(), out)
        default(x.clone(), expected)
        # the same call on the same errors, then the workers' errors times 0.9 (the servers' kept)
        assert torch.equal(out, expected)
        assert torch.equal(decayed.worker_error, default.worker_error * 0.9)
        assert torch.equal(decayed.server_error, default.server_error)
        default.worker_error.mul_(0.9)  # from the same errors on
        assert decayed.worker_error.any()


def test_a_decay_outside_zero_to_one_is_refused():
    with pytest.raises(ValueError, match="RUNG_DECAY"):
        patched_engine("worker_decay", decay=1.5)


def test_two_processes_give_what_one_process_of_all_workers_gives(tmp_path: Path):
    assert_two_processes_give_one_process("worker_decay", tmp_path)
