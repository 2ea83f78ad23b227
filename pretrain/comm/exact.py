"""An exact mean over data-parallel workers that sums in worker order, so k virtual workers in one process
and k real processes give the same bits (`pretrain.train.simulated`): each process sends every chunk of its
workers' rows to the chunk's owner (all_to_all), the owner adds the n rows in worker order and divides by
n, and the owners' chunks are gathered (all_gather). Ring-allreduce traffic: each rank sends
2·(n − 1)/n of the buffer (`TrafficCounter.record_exact`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pretrain.comm.collectives import all_gather_flat
from pretrain.comm.counter import TrafficCounter


def worker_order_mean(
    rows: torch.Tensor,
    group: Any,
    processes: int,
    counter: TrafficCounter,
    wire_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Mean of the [k, N] `rows` (this process's k workers, workers numbered process·k + row) over all
    processes·k workers; N must be a multiple of `processes`. Returns a new fp32 [N] tensor, the same on every
    process. With a 16-bit `wire_dtype` the rows and the mean travel rounded to it (on one process too, so
    that k virtual workers give what k processes give); the sums are fp32."""
    workers, numel = rows.shape
    rows = rows.to(wire_dtype)
    world_size = processes * workers
    if processes == 1:
        total = rows[0].to(torch.float32, copy=True)
    else:
        chunk = numel // processes
        assert chunk * processes == numel, f"{numel} elements do not split into {processes} chunks"
        send = rows.view(workers, processes, chunk).transpose(0, 1).contiguous()  # [owner, worker, chunk]
        received = torch.empty_like(send)  # [sender, its worker, my chunk]
        dist.all_to_all_single(received.view(-1), send.view(-1), group=group)
        ordered = received.view(world_size, chunk)
        total = ordered[0].to(torch.float32, copy=True)
        rows = ordered
    for row in rows[1:]:
        total.add_(row)
    total = total.div_(world_size).to(wire_dtype)
    if processes > 1:
        gathered = torch.empty(numel, dtype=total.dtype, device=total.device)
        all_gather_flat(gathered, total, group=group)
        total = gathered
    counter.record_exact(numel, torch.finfo(wire_dtype).bits // 8, world_size)
    return total.float()
