"""Ablation `abl-fp32worker` (rung M, results/cpu-study-m/README.md, "The workers' compression"): the
compressed allreduce without the workers' 1-bit compression. The servers receive every worker's values in
fp32 and average them exactly (worker order, `pretrain.comm.exact.worker_order_mean`); each server then
compresses its chunk of that average as the default does, z = mean + e_s, sends Q(z), e_s ← z − Q(z). The
exchange's only compression is the server's, which does not depend on the worker count: at any n this is
what one worker with the server's error feedback would send. A study's patch, not an option: `apply`
replaces the call of the engine class it is given; `sitecustomize.py` here applies it to
`CompressedAllreduce` in every process of a run started with this folder first on PYTHONPATH and
RUNG_ABLATION=fp32_worker (the rung driver's `ARM_PATCH`). Not pipelined; the worker errors stay zero; the
byte counters still count the 1-bit first phase.
"""

from __future__ import annotations

from typing import Any

import torch
from patching import patch, replaced_call

from pretrain.comm.compressed_allreduce import CompressedAllreduce
from pretrain.comm.counter import TrafficCounter
from pretrain.comm.exact import worker_order_mean


def exact_workers(self: Any, local: torch.Tensor, out: torch.Tensor) -> None:
    """The exact mean of the n workers' values, then each server's 1-bit pass on its chunks of it."""
    serve_mean(self, worker_order_mean(local, self.group, self.num_processes, TrafficCounter()), out)


def serve_mean(self: Any, mean: torch.Tensor, out: torch.Tensor) -> None:
    """The servers' 1-bit pass on `mean` (the n workers' mean, the same on every process), as the default's
    `_serve` on its average: z = mean + e_s, Q(z) to every process, e_s ← z − Q(z); the result in `out`."""
    chunk_numel = self.chunk_numel
    scratch = torch.empty(chunk_numel, device=mean.device)
    for local_chunk, chunk in enumerate(self.local_chunks):
        plan, count = self.chunk_plans[chunk], self.layout.chunk_segments[chunk]
        offset = self._local_offsets[local_chunk]
        server_value = self.server_errors[local_chunk]
        server_value.add_(mean[chunk * chunk_numel : (chunk + 1) * chunk_numel])
        scales = self.round_scales(plan.scales(server_value, out=self.server_scales[offset : offset + count]))
        self.kernels.compress_(server_value, scales, plan, self.server_packed[local_chunk], scratch=scratch)
    self._exchange_server_chunks()
    self._decode_output(out)


def apply(engine: type[CompressedAllreduce]) -> type[CompressedAllreduce]:
    """Patch `engine` (CompressedAllreduce or a subclass) in place; returns it."""
    return patch(engine, {"__call__": replaced_call(exact_workers)})
