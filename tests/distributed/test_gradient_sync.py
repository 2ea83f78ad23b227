"""GradientSync's benchmark-only `communicate = False` switch: the hook keeps each rank's own gradient."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from launch.local import run_local
from pretrain.gradient_sync import GradientSync

pytestmark = pytest.mark.distributed


def _gradients(rank: int, world_size: int) -> dict:
    return {communicate: _one_step(rank, world_size, communicate) for communicate in (True, False)}


def _one_step(rank: int, world_size: int, communicate: bool) -> dict:
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Linear(4, 3)
    sync = GradientSync(None, world_size)
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
