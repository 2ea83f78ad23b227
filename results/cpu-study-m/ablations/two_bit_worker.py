"""Ablation `abl-2bitworker` (rung M, results/cpu-study-m/README.md, "The workers' compression"): each
worker sends its values in 2 bits instead of 1. The worker's pass runs twice on the same error buffer: y = x
+ e_w, Q1 = s1·sign(y) (the default's scales), then Q2 = s2·sign(y − Q1) on the remainder, e_w ← y − Q1 −
Q2: two sign bits and two scales per segment, twice the default's first-phase bytes (the exchange's 1.5×).
The servers average the workers' Q1 + Q2 and compress the average in 1 bit as the default does
(`fp32_worker.serve_mean`). The result is what that 2-bit message gives; the patch forms each worker's
Q1 + Q2 in fp32 and averages them exactly in worker order instead of packing them (a study's patch, not an
option: `apply` replaces the call of the engine class it is given; `sitecustomize.py` here applies it with
RUNG_ABLATION=two_bit_worker, the rung driver's `ARM_PATCH`). Not pipelined; the byte counters still count
the default's 1-bit exchange.
"""

from __future__ import annotations

from typing import Any

import torch
from fp32_worker import serve_mean
from patching import patch, replaced_call

from pretrain.comm.compressed_allreduce import CompressedAllreduce
from pretrain.comm.counter import TrafficCounter
from pretrain.comm.exact import worker_order_mean


def two_bit_workers(self: Any, local: torch.Tensor, out: torch.Tensor) -> None:
    """Each worker's 2-bit value Q1 + Q2 (its error feedback kept), their exact mean, the servers' 1 bit."""
    scratch = torch.empty(self.numel, device=local.device)
    for worker in range(self.virtual_workers):
        error = self.worker_errors[worker]
        sent = local[worker]
        scratch.copy_(sent)  # x (the passes use their values as scratch)
        sent.add_(error)  # y = x + e_w: what the two passes send between them, less their final error
        self._compress_worker(worker, scratch, None)  # e_w ← y − Q1
        self._compress_worker(worker, scratch.zero_(), None)  # e_w ← (y − Q1) − Q2
        sent.sub_(error)  # Q1 + Q2
    mean = worker_order_mean(local, self.group, self.num_processes, TrafficCounter())
    serve_mean(self, mean, out)


def apply(engine: type[CompressedAllreduce]) -> type[CompressedAllreduce]:
    """Patch `engine` (CompressedAllreduce or a subclass) in place; returns it."""
    return patch(engine, {"__call__": replaced_call(two_bit_workers)})
