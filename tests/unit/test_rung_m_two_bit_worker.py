"""results/cpu-study-m/ablations/two_bit_worker.py: each worker's values in 2 bits, the server's 1 bit."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pretrain.comm.compressed_allreduce import CompressedAllreduce
from pretrain.comm.layout import Block, ScaleLayout

FOLDER = Path(__file__).resolve().parents[2] / "results" / "cpu-study-m" / "ablations"
NUMEL, WORKERS = 8 * 16 * 64, 4


def patched_engine() -> type:
    if str(FOLDER) not in sys.path:  # the patch imports fp32_worker as the run's PYTHONPATH lets it
        sys.path.insert(0, str(FOLDER))
    spec = importlib.util.spec_from_file_location("two_bit_worker", FOLDER / "two_bit_worker.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    class Patched(CompressedAllreduce):  # patched, not the class every other test uses
        pass

    return module.apply(Patched)


def values(step: int) -> torch.Tensor:
    return torch.randn(WORKERS, NUMEL, generator=torch.Generator().manual_seed(step))


def one_bit(y: torch.Tensor) -> torch.Tensor:
    """The default layout's worker value: one rms scale for the buffer, its signs."""
    return y.norm(dim=-1, keepdim=True) / y.shape[-1] ** 0.5 * y.sign()


def test_each_worker_sends_two_sign_passes_and_keeps_what_they_miss():
    engine = patched_engine()(NUMEL, virtual_workers=WORKERS)
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
    engines = [
        patched_engine()(NUMEL, layout=ScaleLayout.from_blocks(blocks, NUMEL, WORKERS), kernels=k, **options)
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


def _two_processes(rank: int, init: str, results: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    engine = patched_engine()(NUMEL, virtual_workers=WORKERS // 2)
    out = torch.empty(NUMEL)
    for step in range(3):
        x = values(step)[rank * 2 : rank * 2 + 2]
        engine(x.clone(), out)
    torch.save(out, f"{results}-{rank}.pt")
    dist.destroy_process_group()


def test_two_processes_give_what_one_process_of_all_workers_gives(tmp_path: Path):
    """2 processes × 2 virtual workers = 1 × 4, bit for bit."""
    mp.spawn(_two_processes, args=(f"file://{tmp_path / 'init'}", str(tmp_path / "out")), nprocs=2)
    single = patched_engine()(NUMEL, virtual_workers=WORKERS)
    out = torch.empty(NUMEL)
    for step in range(3):
        single(values(step).clone(), out)
    for rank in range(2):
        assert torch.equal(torch.load(tmp_path / f"out-{rank}.pt", weights_only=True), out)
