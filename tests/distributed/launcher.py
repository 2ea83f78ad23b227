"""Run a function on N gloo processes on this machine and collect what each returns.

    results = run_distributed(fn, world_size=2, args=(...))   # fn(rank, world_size, *args) -> picklable

Each process gets its own free TCP port on 127.0.0.1; an exception in any rank fails the call with
that rank's traceback.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, args: tuple = (), timeout: float = 300) -> list[Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    for _ in range(world_size):
        try:
            rank, ok, payload = queue.get(timeout=timeout)
        except Exception:  # queue.Empty: a rank died or hung
            errors.append(f"no answer within {timeout}s (exit codes {[p.exitcode for p in procs]})")
            break
        if ok:
            results[rank] = payload
        else:
            errors.append(f"rank {rank}:\n{payload}")
            break
    for p in procs:
        p.join(timeout=timeout if not errors else 5)
        if p.is_alive():
            p.kill()
    if errors:
        raise AssertionError("distributed worker failed\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
