"""GradientSync: the benchmark-only `communicate = False` switch keeps each rank's own gradient, and the
bfloat16/float16 allreduce (`optim.grad_allreduce`) averages what DDP's compression hooks average."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from launch.local import run_local
from pretrain.distributed.gradient_sync import GradientSync

pytestmark = pytest.mark.distributed


def _gradients(rank: int, world_size: int) -> dict:
    return {communicate: _one_step(rank, world_size, communicate) for communicate in (True, False)}


def _one_step(rank: int, world_size: int, communicate: bool, dtype: torch.dtype = torch.float32) -> dict:
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Linear(4, 3)
    sync = GradientSync(None, world_size, dtype)
    sync.communicate = communicate
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(sync, GradientSync.hook)
    sync.start_step(enabled=True, measure=False)
    inputs = torch.full((2, 4), float(rank + 1))  # a different batch per rank
    ddp(inputs).pow(2).sum().backward()
    local = torch.autograd.grad(model(inputs).pow(2).sum(), model.weight)[0]
    return {"grad": model.weight.grad.numpy().copy(), "local": local.numpy(), "bytes": sync.bytes_sent}


def test_communicate_false_skips_the_allreduce():
    results = run_local(_gradients, 2)
    synced, skipped = [r[True] for r in results], [r[False] for r in results]
    np.testing.assert_allclose(synced[0]["grad"], synced[1]["grad"])
    np.testing.assert_allclose(synced[0]["grad"], (synced[0]["local"] + synced[1]["local"]) / 2, rtol=1e-6)
    assert synced[0]["bytes"] > 0
    for result in skipped:
        np.testing.assert_allclose(result["grad"], result["local"], rtol=1e-6)
        assert result["bytes"] == 0.0
    assert not np.allclose(skipped[0]["grad"], skipped[1]["grad"])


def _low_precision(rank: int, world_size: int) -> dict:
    return {
        dtype: _one_step(rank, world_size, True, getattr(torch, dtype)) for dtype in ("bfloat16", "float16")
    }


@pytest.mark.slow
def test_low_precision_allreduce_is_ddps_compression_hook_at_half_the_bytes():
    results = run_local(_low_precision, 2)
    exact = run_local(_gradients, 2)[0][True]
    for dtype in ("bfloat16", "float16"):
        synced = [r[dtype] for r in results]
        np.testing.assert_array_equal(synced[0]["grad"], synced[1]["grad"])
        # each rank's gradient cast, divided by n, summed in that dtype (two terms: exact up to one rounding)
        parts = [torch.from_numpy(r["local"]).to(getattr(torch, dtype)).div_(2) for r in synced]
        expected = (parts[0] + parts[1]).float().numpy()
        np.testing.assert_array_equal(synced[0]["grad"], expected)
        assert not np.array_equal(synced[0]["grad"], exact["grad"])  # it did round
        np.testing.assert_allclose(synced[0]["grad"], exact["grad"], rtol=1e-2)
        assert synced[0]["bytes"] == exact["bytes"] / 2
