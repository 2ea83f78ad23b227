"""The optimizer's numba loops that the compressed allreduce runs inside its own passes: the local
momentum x = (β1·m + (1−β1)·(s·g))/d formed as it is added into the error buffer, and the square marginals
of s·g summed as its rows go by (:class:`~pretrain.comm.plan.MomentumSource`: `live_step.momentum_source`
hands this module to the exchange as the source's ``loops``). :mod:`pretrain.optim.marginals` and
:mod:`pretrain.optim.live_step` run :func:`square_marginal_rows` too, so the sums are the same bits either
way. Built on the exchange's loops (:mod:`pretrain.comm.numba_loops`) and the shared helpers
(:mod:`pretrain.comm.numba_helpers`); imports numba: import it only where
:func:`~pretrain.comm.numba_support.numba_unavailable_reason` is None.
"""

from __future__ import annotations

import numpy as np

from pretrain.comm.numba_helpers import abs_sum, fma, jit
from pretrain.comm.numba_loops import compress_row, sum_block, to_bfloat16
from pretrain.comm.numba_support import SUM_BLOCK

# Rows of a matrix whose column squares `square_marginal_rows` sums in fp32 before adding them to its
# float64 column sums.
MARGINAL_FLUSH = 32


@jit(fastmath={"reassoc"})
def _square_row(row, scale, partial):
    # Σ (s·row)² in fp32 (vectorised: `reassoc` on this loop only, an order fixed by the compiled code),
    # and partial += (s·row)², the column squares of a block of rows in fp32
    total = np.float32(0.0)
    for j in range(row.shape[0]):
        value = row[j] * scale
        square = value * value
        total += square
        partial[j] += square
    return total


@jit
def _flush_columns(columns, partial):
    for j in range(columns.shape[0]):
        columns[j] += np.float64(partial[j])
        partial[j] = np.float32(0.0)


@jit
def square_marginal_rows(flat, stop, done, inner, scale, outer_sums, columns, partial):
    # The rows of `inner` elements of the row-major matrix `flat` (1-D) that end by `stop`, from row
    # `done` on: outer_sums[row] += Σ (s·g)² over it (in fp32), the columns' (s·g)² summed in fp32 over
    # MARGINAL_FLUSH rows at a time (counted from the matrix's first: `partial`, fp32, zeroed where such
    # a block starts) and each block's sums added into `columns` (float64); returns the rows done.
    # `pretrain.optim.marginals`, `live_step`'s momentum loop and the fused worker pass all run this.
    rows = flat.shape[0] // inner
    if done % MARGINAL_FLUSH == 0:
        partial[:inner] = np.float32(0.0)
    while (done + 1) * inner <= stop:
        outer_sums[done] += _square_row(flat[done * inner : (done + 1) * inner], scale, partial)
        done += 1
        if done % MARGINAL_FLUSH == 0 or done == rows:
            _flush_columns(columns, partial)
    return done


@jit(error_model="numpy")
def add_momentum(error, exp_avg, grad, divisor, beta1, weight, scale):
    # error ← error + (β1·m + weight·(s·g))/d, x as `live_step.preconditioned_momentum_` forms it
    # (error_model="numpy": the division vectorises)
    for i in range(error.shape[0]):
        error[i] = error[i] + fma(weight, grad[i] * scale, beta1 * exp_avg[i]) / divisor[i]


@jit
def add_momentum_abs_sums(
    error,
    exp_avg,
    grad,
    divisor,
    blocks,
    out,
    beta1,
    weight,
    scale,
    inner,
    outer_sums,
    inner_sums,
    scratch,
):
    # `add_segment_abs_sums` over one tensor's elements with x formed from (m, g, d): the same blocks
    # summed in the same order after the same additions, so the same bits. inner > 0: the square
    # marginals of s·g as well (`square_marginal_rows`, rows of `inner` elements in memory order), each
    # row right after its elements were added, while they are in cache
    columns = np.zeros(inner, dtype=np.float64)
    done, total = 0, 0.0
    for b in range(blocks.shape[0]):
        low, high = blocks[b, 0], blocks[b, 1]
        add_momentum(
            error[low:high], exp_avg[low:high], grad[low:high], divisor[low:high], beta1, weight, scale
        )
        if inner > 0:
            done = square_marginal_rows(grad, high, done, inner, scale, outer_sums, columns, scratch)
        total = sum_block(error, low, high, blocks[b, 2], blocks[b, 3], blocks[b, 4], out, total)
    for j in range(inner):
        inner_sums[j] += np.float32(columns[j])


@jit
def worker_pass(
    error,
    exp_avg,
    grad,
    divisor,
    offset,
    runs,
    segment_divisors,
    bfloat16,
    scales,
    packed,
    packed_base,
    acc,
    beta1,
    weight,
    scale,
    inner,
    outer_sums,
    columns,
    done,
    partials,
    flags,
    cell,
    cell_bits,
):
    # `pretrain.comm.numba_loops.worker_pass` over one source tensor's whole segments, x formed from
    # (m, g, d) elements [i − offset] as `add_momentum` forms it, with the square marginals of s·g
    # (`square_marginal_rows`, rows of `inner` elements) as `add_momentum_abs_sums` takes them. Returns
    # (the carried byte, the marginal rows done).
    words = flags.view(np.uint64)
    signs_of = error[packed_base:]
    for r in range(runs.shape[0]):
        start, rows, length, first = runs[r, 0], runs[r, 1], runs[r, 2], runs[r, 3]
        for row in range(rows):
            low, end = start + row * length, start + (row + 1) * length
            total = 0.0
            i = low
            while i < end:
                high = min(i + SUM_BLOCK, end)
                a, b = i - offset, high - offset
                add_momentum(error[i:high], exp_avg[a:b], grad[a:b], divisor[a:b], beta1, weight, scale)
                if inner > 0:
                    done = square_marginal_rows(grad, b, done, inner, scale, outer_sums, columns, partials)
                total += abs_sum(error[i:high])
                i = high
            s = np.float32(total) / segment_divisors[first + row]
            if bfloat16:
                s = to_bfloat16(s, cell, cell_bits)
            scales[first + row] = s
            acc = compress_row(signs_of, packed, low - packed_base, end - packed_base, s, flags, words, acc)
    return acc, done
