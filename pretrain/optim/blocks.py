"""The CPU loops' unit of work: every tensor cut into blocks, the blocks shared out among torch's threads.

The numba loops of the optimizers (`lamb_loops`, `live_step`) release the GIL, so a few Python threads run
them side by side. `Blocks` cuts each tensor's elements into blocks of `BLOCK` (the last one shorter) and
the list of all blocks into at most `torch.get_num_threads()` contiguous runs of about equal element counts,
one per thread. A loop that sums (the trust ratio's norms) returns one pair per block, and the pairs are
added per tensor in block order (`Blocks.sums`): the bits do not depend on the number of threads, so a run
resumed with another thread count repeats the uninterrupted one, and one thread (each rank of a multi-rank
run on a small machine) does the same arithmetic in the calling thread.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

BLOCK = 1 << 20  # elements per block


@functools.cache
def _pool(threads: int, pid: int) -> ThreadPoolExecutor:
    """Worker threads for this process (a forked child makes its own: `pid`)."""
    return ThreadPoolExecutor(threads, thread_name_prefix="optim-loops")


def shares(sizes: list[int], threads: int) -> list[range]:
    """Indices of `sizes` cut into at most `threads` contiguous runs of about equal sums."""
    runs: list[range] = []
    total, start, done = sum(sizes), 0, 0
    for index, size in enumerate(sizes):
        done += size
        if len(runs) < threads - 1 and done * threads >= total * (len(runs) + 1):
            runs.append(range(start, index + 1))
            start = index + 1
    if start < len(sizes):
        runs.append(range(start, len(sizes)))
    return runs


def run_shared(work: Callable[[int], Any], runs: list[range], count: int) -> list[Any]:
    """work(i) for i in every run of `runs` (from `shares`), one thread per run (the calling thread if
    there is one run); the results in index order, `count` of them."""
    results: list[Any] = [None] * count

    def run(indices: range) -> None:
        for i in indices:
            results[i] = work(i)

    if len(runs) <= 1:
        for indices in runs:
            run(indices)
    else:
        pool = _pool(len(runs), os.getpid())
        for future in [pool.submit(run, indices) for indices in runs]:
            future.result()
    return results


class Blocks:
    """The blocks of tensors of `numels` elements (module docstring)."""

    def __init__(self, numels: list[int], threads: int | None = None) -> None:
        self.num_tensors = len(numels)
        self.blocks = [
            (k, start, min(start + BLOCK, numel))
            for k, numel in enumerate(numels)
            for start in range(0, numel, BLOCK)
        ]
        self.shares = shares(
            [stop - start for _, start, stop in self.blocks], threads or torch.get_num_threads()
        )

    def run(self, work: Callable[[int, int, int], Any]) -> list[Any]:
        """work(tensor, start, stop) for every block, on the threads; the results in block order."""
        return run_shared(lambda j: work(*self.blocks[j]), self.shares, len(self.blocks))

    def sums(self, work: Callable[[int, int, int], tuple[float, float]]) -> np.ndarray:
        """[tensors, 2] float64: the pairs `work` returns per block, added per tensor in block order."""
        pairs = np.asarray(self.run(work), dtype=np.float64).reshape(len(self.blocks), 2)
        totals = np.zeros((self.num_tensors, 2))
        np.add.at(totals, np.array([k for k, _, _ in self.blocks], dtype=np.int64), pairs)
        return totals
