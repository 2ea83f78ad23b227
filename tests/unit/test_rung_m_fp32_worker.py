"""results/cpu-study-m/ablations/fp32_worker.py: the exchange without the workers' 1-bit compression."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pretrain.comm.compressed_allreduce import CompressedAllreduce

PATCH = Path(__file__).resolve().parents[2] / "results" / "cpu-study-m" / "ablations" / "fp32_worker.py"
NUMEL, WORKERS = 8 * 16 * 64, 4


def patched_engine() -> type:
    spec = importlib.util.spec_from_file_location("fp32_worker", PATCH)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    class Patched(CompressedAllreduce):  # patched, not the class every other test uses
        pass

    return module.apply(Patched)


def values(step: int) -> torch.Tensor:
    return torch.randn(WORKERS, NUMEL, generator=torch.Generator().manual_seed(step))


def test_the_average_is_the_servers_one_bit_pass_on_the_exact_mean():
    engine = patched_engine()(NUMEL, virtual_workers=WORKERS)
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
    first = patched_engine()(NUMEL, virtual_workers=WORKERS)
    out = torch.empty(NUMEL)
    first(values(0), out)
    assert not torch.equal(out, expected)


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
    """2 processes × 2 virtual workers (the exact mean's all-to-all, the servers' all-gather) = 1 × 4."""
    mp.spawn(_two_processes, args=(f"file://{tmp_path / 'init'}", str(tmp_path / "out")), nprocs=2)
    single = patched_engine()(NUMEL, virtual_workers=WORKERS)
    out = torch.empty(NUMEL)
    for step in range(3):
        single(values(step).clone(), out)
    for rank in range(2):
        assert torch.equal(torch.load(tmp_path / f"out-{rank}.pt", weights_only=True), out)
