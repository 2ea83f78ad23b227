"""results/cpu-study-m/ablations/two_bit_worker.py: each worker's values in 2 bits, the server's 1 bit."""

from __future__ import annotations

from pathlib import Path

import torch

from pretrain.comm.compressed_allreduce import CompressedAllreduce
from pretrain.comm.layout import Block, ScaleLayout
from tests.unit.rung_m_patches import (
    NUMEL,
    WORKERS,
    assert_two_processes_give_one_process,
    patched_engine,
    values,
)


def one_bit(y: torch.Tensor) -> torch.Tensor:
    """The default layout's worker value: one rms scale for the buffer, its signs."""
    return y.norm(dim=-1, keepdim=True) / y.shape[-1] ** 0.5 * y.sign()


def test_each_worker_sends_two_sign_passes_and_keeps_what_they_miss():
    engine = patched_engine("two_bit_worker")(NUMEL, virtual_workers=WORKERS)
    chunk = NUMEL // WORKERS
    worker_errors, server_error = torch.zeros(WORKERS, NUMEL), torch.zeros(NUMEL)
    for step in range(3):
        x = values(step)
        out = torch.empty(NUMEL)
        engine(x.clone(), out)
        y = x + worker_errors
        first = one_bit(y)
        second = one_bit(y - first)
        worker_errors = y - first - second
        torch.testing.assert_close(engine.worker_errors, worker_errors, rtol=0, atol=1e-5)
        # closer to y than one sign pass: the remainder is smaller
        assert worker_errors.norm() < 0.8 * (y - first).norm()
        new_server_error = engine.server_error.reshape(-1).clone()
        sent = (first + second).mean(0)
        torch.testing.assert_close(out, sent + server_error - new_server_error, rtol=0, atol=1e-5)
        server_error = new_server_error
        for c in range(WORKERS):  # the servers' pass stays 1 bit: one magnitude per chunk
            assert out[c * chunk : (c + 1) * chunk].abs().unique().numel() == 1


def test_the_runs_fused_worker_pass_gives_the_reference_passes_bits():
    """The study's runs take the fused numba worker pass (mean_abs scales per row, bfloat16 on the wire);
    patched, it gives the torch kernels' bits, and the second pass leaves less than the first."""
    blocks = [Block(NUMEL // 2, 64), Block(NUMEL // 4, 256), Block(NUMEL // 4, NUMEL // 4)]
    options = dict(virtual_workers=WORKERS, sign_scale="mean_abs", scale_dtype="bfloat16")
    patched = patched_engine("two_bit_worker")
    engines = [
        patched(NUMEL, layout=ScaleLayout.from_blocks(blocks, NUMEL, WORKERS), kernels=k, **options)
        for k in ("numba", "torch")
    ]
    one_pass = CompressedAllreduce(
        NUMEL, layout=ScaleLayout.from_blocks(blocks, NUMEL, WORKERS), kernels="torch", **options
    )
    one_pass(values(0), torch.empty(NUMEL))
    for step in range(3):
        outs = [torch.empty(NUMEL), torch.empty(NUMEL)]
        for engine, out in zip(engines, outs):
            engine(values(step), out)
        assert torch.equal(outs[0], outs[1])
        assert torch.equal(engines[0].worker_error, engines[1].worker_error)
        if step == 0:
            assert engines[0].worker_error.norm() < 0.8 * one_pass.worker_error.norm()


def test_two_processes_give_what_one_process_of_all_workers_gives(tmp_path: Path):
    """2 processes × 2 virtual workers = 1 × 4, bit for bit."""
    assert_two_processes_give_one_process("two_bit_worker", tmp_path)
