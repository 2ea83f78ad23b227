"""results/cpu-study-m/ablations/fp32_server.py: the exchange without the server's 1-bit compression."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pretrain.comm.compressed_allreduce import CompressedAllreduce

PATCH = Path(__file__).resolve().parents[2] / "results" / "cpu-study-m" / "ablations" / "fp32_server.py"
NUMEL, WORKERS = 8 * 16 * 64, 4


def patched_engine() -> type:
    spec = importlib.util.spec_from_file_location("fp32_server", PATCH)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    class Patched(CompressedAllreduce):  # patched, not the class every other test uses
        pass

    return module.apply(Patched)


def values(step: int) -> torch.Tensor:
    return torch.randn(WORKERS, NUMEL, generator=torch.Generator().manual_seed(step))


def test_the_average_is_the_workers_one_bit_values_in_fp32_with_no_server_error():
    engine = patched_engine()(NUMEL, virtual_workers=WORKERS)
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
    """2 processes × 2 virtual workers (the all_gather of the fp32 averages) = 1 process × 4, bitwise."""
    mp.spawn(_two_processes, args=(f"file://{tmp_path / 'init'}", str(tmp_path / "out")), nprocs=2)
    single = patched_engine()(NUMEL, virtual_workers=WORKERS)
    out = torch.empty(NUMEL)
    for step in range(3):
        single(values(step).clone(), out)
    for rank in range(2):
        assert torch.equal(torch.load(tmp_path / f"out-{rank}.pt", weights_only=True), out)
