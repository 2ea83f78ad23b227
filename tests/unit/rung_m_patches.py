"""What the tests of rung M's ablation patches (results/cpu-study-m/ablations/) share: loading a patch onto a
subclass of the engine, the workers' values, and the check that 2 processes × 2 virtual workers give what one
process of 4 gives."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pretrain.comm.compressed_allreduce import CompressedAllreduce

FOLDER = Path(__file__).resolve().parents[2] / "results" / "cpu-study-m" / "ablations"
NUMEL, WORKERS = 8 * 16 * 64, 4


def patched_engine(name: str, **options: object) -> type:
    """A subclass of CompressedAllreduce with the patch `name` (e.g. "fp32_server") applied with `options`,
    not the class every other test uses."""
    if str(FOLDER) not in sys.path:  # the patches import each other as the run's PYTHONPATH lets them
        sys.path.insert(0, str(FOLDER))
    spec = importlib.util.spec_from_file_location(name, FOLDER / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    class Patched(CompressedAllreduce):
        pass

    return module.apply(Patched, **options)


def values(step: int) -> torch.Tensor:
    return torch.randn(WORKERS, NUMEL, generator=torch.Generator().manual_seed(step))


def _two_processes(rank: int, name: str, init: str, results: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    engine = patched_engine(name)(NUMEL, virtual_workers=WORKERS // 2)
    out = torch.empty(NUMEL)
    for step in range(3):
        x = values(step)[rank * 2 : rank * 2 + 2]
        engine(x.clone(), out)
    torch.save(out, f"{results}-{rank}.pt")
    dist.destroy_process_group()


def assert_two_processes_give_one_process(name: str, tmp_path: Path) -> None:
    """2 processes × 2 virtual workers with patch `name` give 1 process × 4 workers' output bit for bit."""
    mp.spawn(_two_processes, args=(name, f"file://{tmp_path / 'init'}", str(tmp_path / "out")), nprocs=2)
    single = patched_engine(name)(NUMEL, virtual_workers=WORKERS)
    out = torch.empty(NUMEL)
    for step in range(3):
        single(values(step).clone(), out)
    for rank in range(2):
        assert torch.equal(torch.load(tmp_path / f"out-{rank}.pt", weights_only=True), out)
