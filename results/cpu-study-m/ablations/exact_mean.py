"""Ablation `abl-exact` (rung M, results/cpu-study-m/README.md, "Screens"): the compressed allreduce with no
compression at all. Every process receives the exact mean of the n workers' values (fp32, worker order,
`pretrain.comm.exact.worker_order_mean`), so 1-bit LAMB keeps everything but the compression: the frozen
variance, the preconditioned exchange, the refresh, the live trust ratio. What it loses against LAMB at a
worker count is the algorithm's; what the default loses beyond it is the compression's (the workers' pass
and the servers'). A study's patch, not an option: `apply` replaces the call of the engine class it is given;
`sitecustomize.py` here applies it with RUNG_ABLATION=exact_mean. Not pipelined; no error buffer is used;
the byte counters still count the default's exchange.
"""

from __future__ import annotations

from typing import Any

import torch
from patching import patch, replaced_call

from pretrain.comm.compressed_allreduce import CompressedAllreduce
from pretrain.comm.counter import TrafficCounter
from pretrain.comm.exact import worker_order_mean


def exact_mean(self: Any, local: torch.Tensor, out: torch.Tensor) -> None:
    """The exact mean of the n workers' values."""
    out.copy_(worker_order_mean(local, self.group, self.num_processes, TrafficCounter()))


def apply(engine: type[CompressedAllreduce]) -> type[CompressedAllreduce]:
    """Patch `engine` (CompressedAllreduce or a subclass) in place; returns it."""
    return patch(engine, {"__call__": replaced_call(exact_mean)})
