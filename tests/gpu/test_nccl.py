"""Multi-GPU checks over NCCL: `make test-gpu NPROC=2` (or more) on a machine with that many GPUs.

The compressed allreduce over NCCL between processes against the CPU reference model, and the demo
pretraining (1-bit LAMB through its compression stage) on NPROC GPU processes. One GPU cannot hold two
NCCL ranks, so on a machine with fewer than NPROC GPUs these skip and say why; `make gpu-check` covers
a single GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from launch.local import free_port

NPROC = max(2, int(os.environ.get("GPU_TEST_NPROC") or 2))
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        GPUS < NPROC, reason=f"needs {NPROC} GPUs for NCCL between processes, this machine has {GPUS}"
    ),
]
UNPADDED = 5000
CALLS = 3


def _inputs(world_size: int, numel: int, call: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(call)
    return [torch.randn(numel, generator=generator) * (1 + w) for w in range(world_size)]


def _allreduce_rank(rank: int, world_size: int, port: int, out_dir: str) -> None:
    from pretrain.comm import CompressedAllreduce, padded_numel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    try:
        numel = padded_numel(UNPADDED, world_size)
        engine = CompressedAllreduce(numel, device=torch.device("cuda", rank))
        outputs = []
        for call in range(CALLS):
            buffer = _inputs(world_size, numel, call)[rank].cuda()
            outputs.append(engine(buffer).cpu())
        torch.save(outputs, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_compressed_allreduce_over_nccl_matches_the_reference(tmp_path):
    from pretrain.comm import padded_numel
    from pretrain.comm.reference import ReferenceCompressedAllreduce

    mp.spawn(_allreduce_rank, args=(NPROC, free_port(), str(tmp_path)), nprocs=NPROC, join=True)
    numel = padded_numel(UNPADDED, NPROC)
    reference = ReferenceCompressedAllreduce(numel, NPROC)
    per_rank = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(NPROC)]
    for call in range(CALLS):
        expected = reference(_inputs(NPROC, numel, call))
        for rank in range(NPROC):
            assert torch.equal(per_rank[rank][call], per_rank[0][call]), "ranks disagree"
        difference = float((per_rank[0][call] - expected).norm() / expected.norm())
        assert difference <= 1e-6, (call, difference)


def test_demo_pretraining_over_nccl(tmp_path, tiny_data, repo_root):
    run_dir = tmp_path / "run"
    command = [
        str(repo_root / "launch" / "torchrun.sh"), "--nproc", str(NPROC), "--",
        "batch=demo", "optim=onebit_lamb", "model=bert_tiny", f"data_dir={tiny_data}", f"run_dir={run_dir}",
        "max_steps=20", "checkpoint.every_steps=10", "wandb.mode=disabled", "show_progress=false",
    ]  # fmt: skip
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "nccl" in result.stdout
    assert (run_dir / "checkpoints" / "step-00000020" / "COMPLETE").exists()
