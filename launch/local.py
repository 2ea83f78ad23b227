"""Run a function on N gloo processes on this machine and collect what each returns.

    results = run_local(fn, world_size=2, args=(...))   # fn(rank, world_size, *args) -> picklable

Used by the distributed tests and the benchmarks. Each call gets a free TCP port on 127.0.0.1; an
exception in any rank fails the call with that rank's traceback, and a rank that dies without
reporting (killed, out of memory) fails it with the exit codes. Return numpy arrays or plain Python
values rather than torch tensors: tensors sent through the queue can break when the worker exits.
"""

from __future__ import annotations

import os
import queue as queue_module
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _process_entry(
    rank: int, world_size: int, port: int, num_threads: int, fn: Callable, args: tuple, results
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS=str(num_threads),
    )
    # With n processes on few cores, more threads per process only contend.
    torch.set_num_threads(num_threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        results.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_local(
    fn: Callable, world_size: int, args: tuple = (), *, timeout: float = 600, num_threads: int = 1
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` spawned gloo processes; rank-ordered results."""
    context = mp.get_context("spawn")
    results_queue = context.Queue()
    port = free_port()
    processes = [
        context.Process(
            target=_process_entry,
            args=(rank, world_size, port, num_threads, fn, args, results_queue),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            try:
                rank, ok, payload = results_queue.get(timeout=2)
            except queue_module.Empty:
                dead = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"processes died without reporting, exit codes {dead}") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no answer from all ranks within {timeout:.0f} s") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for process in processes:
            process.join(timeout=30 if len(results) == world_size else 1)
            if process.is_alive():
                process.kill()
    return [results[rank] for rank in range(world_size)]
