"""Row and column sums of a gradient's squares: what 1-bit LAMB's variance refresh adds
up every compression step (:meth:`OnebitLamb._accumulate_marginals`), for every weight matrix.

On CPU with numba (:mod:`pretrain.optim.numba_loops`) one loop reads the
matrix once: each row's squares summed in fp32 (vectorised: ``reassoc`` on this loop, an order fixed by the
compiled code), the columns' in an fp32 row of length C (in cache) over `numba_loops.MARGINAL_FLUSH` rows at a
time, each such block added into float64 column sums, rounded to fp32 once per call; within a few units in
the last place of the rounded float64 sums (tested; float64 throughout cost 0.24–0.29 ns per element of the
fused worker pass, this 0.16: issue #15). The torch path (elsewhere, or without numba) squares blocks of rows
into the workspace and sums them with ATen, four passes over a block: 0.12 s of each 4-rank BERT-Base step
per rank on the 2-core bench machine; ``python -m bench optim``'s ``onebit_lamb_square_marginals`` record
compares the two on one thread. They differ in the last bits; each is deterministic, and every worker
(virtual or a real rank) runs the same one, so virtual workers still match real ranks bit for bit.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pretrain.comm.numba_support import numba_unavailable_reason
from pretrain.optim.base import CPU_CHUNK_NUMEL, Workspace
from pretrain.optim.kernel_path import KernelPath, kernel_path


@functools.cache
def _numba_marginals() -> Any:
    """The numba loop, compiled on first use; None where numba cannot be used (the torch path then). Its
    rows go through `numba_loops.square_marginal_rows`, which the compressed allreduce's fused worker pass
    runs too (`pretrain.comm.plan.MomentumSource`): the same sums, bit for bit, either way."""
    if numba_unavailable_reason() is not None:
        return None
    import numba

    from pretrain.optim.numba_loops import square_marginal_rows as rows_of

    @numba.njit(cache=True, boundscheck=False, nogil=True)
    def add_square_marginals(flat, rows, cols, row_sums, col_sums, scale, scratch):
        # the row-major matrix `flat` [rows·cols] times `scale` (1: as it is); `scratch`: fp32 column partials
        columns = np.zeros(cols, dtype=np.float64)
        rows_of(flat, rows * cols, 0, cols, scale, row_sums, columns, scratch)
        for j in range(cols):
            col_sums[j] += np.float32(columns[j])

    return add_square_marginals


def add_square_marginals(
    matrix: Tensor, row_sums: Tensor, col_sums: Tensor, workspace: Workspace, scale: float = 1.0
) -> None:
    """row_sums += Σⱼ m², col_sums += Σᵢ m² for a matrix m = ``scale``·matrix (module docstring; the
    product rounded to fp32, as scaling the matrix in place first would). Without numba, on CPU in blocks
    of rows of at most `CPU_CHUNK_NUMEL` elements (no matrix-sized temporary; the squares stay in cache
    between the two sums), elsewhere the whole matrix at once."""
    if not matrix.is_contiguous() and matrix.t().is_contiguous():  # column-major: its transpose's rows
        matrix, row_sums, col_sums = matrix.t(), col_sums, row_sums
    if _numba_usable(matrix, row_sums, col_sums):
        rows, cols = matrix.shape
        scratch = workspace.flat(cols, matrix.device).numpy()
        flat = matrix.reshape(-1).numpy()
        _numba_marginals()(flat, rows, cols, row_sums.numpy(), col_sums.numpy(), np.float32(scale), scratch)
        return
    torch_add_square_marginals(matrix, row_sums, col_sums, workspace, scale)


def torch_add_square_marginals(
    matrix: Tensor, row_sums: Tensor, col_sums: Tensor, workspace: Workspace, scale: float = 1.0
) -> None:
    """:func:`add_square_marginals` in torch ops, for a row-major (or any) matrix: the fallback, and the
    reference the numba loop is tested and benchmarked against."""
    rows, cols = matrix.shape
    step = max(1, CPU_CHUNK_NUMEL // cols) if matrix.device.type == "cpu" else rows
    scratch = workspace.flat(min(rows, step) * cols, matrix.device)
    for first in range(0, rows, step):
        block = matrix[first : first + step]
        square = scratch[: block.numel()].view(block.shape)
        if scale == 1.0:
            torch.mul(block, block, out=square)
        else:
            torch.mul(block, scale, out=square).mul_(square)
        row_sums[first : first + step].add_(square.sum(1))
        col_sums.add_(square.sum(0))


def _numba_usable(matrix: Tensor, row_sums: Tensor, col_sums: Tensor) -> bool:
    tensors = (matrix, row_sums, col_sums)
    return (
        all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)
        and not matrix.requires_grad
        and _numba_marginals() is not None
    )


# the multi-tensor path: the squares of this many elements at a time (256 MiB of fp32 scratch)
MULTI_TENSOR_NUMEL = 1 << 26


def add_square_marginals_many(
    matrices: list[Tensor], sums: list[tuple[Tensor, Tensor]], workspace: Workspace, scale: float = 1.0
) -> None:
    """:func:`add_square_marginals` for every matrix with its (row_sums, col_sums). On the CPU path one call
    each (the same bits); on the multi-tensor path (`kernel_path`) in few ops
    (:func:`multi_tensor_marginals`)."""
    if matrices and kernel_path(matrices[0].device) is KernelPath.multi_tensor:
        multi_tensor_marginals(matrices, sums, workspace, scale)
        return
    for matrix, (row_sums, col_sums) in zip(matrices, sums):
        add_square_marginals(matrix, row_sums, col_sums, workspace, scale)


def multi_tensor_marginals(
    matrices: list[Tensor],
    sums: list[tuple[Tensor, Tensor]],
    workspace: Workspace,
    scale: float = 1.0,
    chunk_numel: int = MULTI_TENSOR_NUMEL,
) -> None:
    """The square marginals in a number of ops that does not grow with the number of matrices (BERT-Large's
    ~150 through `torch_add_square_marginals` dispatched six torch ops each, ~900 launches): the squares of
    up to `chunk_numel` elements at a time in multi-tensor ops, written into `workspace` grouped by shape,
    then for each shape the row and column sums of all its matrices as two reductions over one [k, R, C]
    view, added into the sums by two multi-tensor adds: 3 or 4 ops per chunk and 2 per shape among its
    matrices (BERT: about 6 shapes, whatever its depth). The squares as the other paths form them (s·m
    rounded to fp32 first); the sums up to fp32 rounding order."""
    oriented = []
    for matrix, (row_sums, col_sums) in zip(matrices, sums):
        if not matrix.is_contiguous() and matrix.t().is_contiguous():  # column-major: its transpose's rows
            matrix, row_sums, col_sums = matrix.t(), col_sums, row_sums
        oriented.append((matrix, row_sums, col_sums))
    start = 0
    while start < len(oriented):
        stop, numel = start, 0
        while stop < len(oriented) and (stop == start or numel + oriented[stop][0].numel() <= chunk_numel):
            numel += oriented[stop][0].numel()
            stop += 1
        shapes: dict[tuple[int, ...], list[int]] = {}
        for k in range(start, stop):
            shapes.setdefault(tuple(oriented[k][0].shape), []).append(k)
        order = [k for ks in shapes.values() for k in ks]
        flat = workspace.flat(numel, oriented[start][0].device)
        squares, offset = [], 0
        for k in order:
            rows, cols = oriented[k][0].shape
            squares.append(flat[offset : offset + rows * cols].view(rows, cols))
            offset += rows * cols
        torch._foreach_copy_(squares, [oriented[k][0] for k in order])
        if scale != 1.0:  # (s·m)², the product rounded to fp32 first, as the other paths
            torch._foreach_mul_(squares, scale)
        torch._foreach_mul_(squares, squares)
        row_targets: list[Tensor] = []
        col_targets: list[Tensor] = []
        row_parts: list[Tensor] = []
        col_parts: list[Tensor] = []
        offset = 0
        for (rows, cols), ks in shapes.items():
            stacked = flat[offset : offset + len(ks) * rows * cols].view(len(ks), rows, cols)
            offset += len(ks) * rows * cols
            row_parts += stacked.sum(2).unbind(0)
            col_parts += stacked.sum(1).unbind(0)
            row_targets += [oriented[k][1] for k in ks]
            col_targets += [oriented[k][2] for k in ks]
        torch._foreach_add_(row_targets, row_parts)
        torch._foreach_add_(col_targets, col_parts)
        start = stop
