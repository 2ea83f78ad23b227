"""The 1-norms behind ``sign_scale=mean_abs``'s scales, fast on CPU.

ATen's ``vector_norm(ord=1)`` runs a scalar loop on CPU: ~0.9 ns per element on the 2-core bench machine,
eight times its 2-norm (``python -m bench comm``'s ``segment_l1_norms_ns_per_element``), which made the
scales ~150 ms of each BERT-Base compression step. Here, on CPU with numba (the compressed allreduce's
kernels, :mod:`pretrain.comm.numba_loops`), one loop over the layout's runs sums each segment block by block:
float64 partial sums of ``SUM_BLOCK`` elements (vectorised by LLVM), added in order, rounded to fp32 once
(0.22 ns per element from memory in a one-thread probe of 64M elements, against 0.37–0.40 for the torch
blocks below). The worker's fused pass (``NumbaKernels.add_scales_``) adds x + e and sums each block in the
same order, so the scales are the same bits either way. Without numba (or for non-fp32 or non-CPU
tensors) :func:`_torch_abs_row_sums` writes |x| into a 1 MiB scratch and sums it block by block; its bits
differ from numba's in the last place. Both are the more accurate sum: ATen's 1-norm accumulates a long
row naively in fp32 (4 % off over 55M elements, a BERT-Large chunk of the single-scale layout), these stay
within 1e-7. Every kernel implementation takes its scales from here, so on one machine they agree bit for
bit. The 2-norm (``rms``, DeepSpeed's) stays ``vector_norm`` everywhere: it is vectorised, and it is
DeepSpeed's expression.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from pretrain.comm.numba_support import numba_unavailable_reason

# Elements of |x| the torch fallback holds at a time (1 MiB of fp32: in L2 on current CPUs; smaller
# blocks pay Python's per-call overhead, 0.5 ns per element at 256 KiB).
BLOCK = 1 << 18


def _numba_sums() -> Any:
    """The numba loops (:mod:`pretrain.comm.numba_loops`), or None where numba cannot be used."""
    if numba_unavailable_reason() is not None:
        return None
    from pretrain.comm import numba_loops  # imports numba

    return numba_loops


def _numba_usable(values: Tensor, out: Tensor) -> bool:
    return (
        values.device.type == "cpu"
        and values.dtype == torch.float32 == out.dtype
        and values.is_contiguous()
        and out.is_contiguous()
        and _numba_sums() is not None
    )


def segment_abs_sums(values: Tensor, table: np.ndarray, out: Tensor) -> Tensor:
    """out[s] ← Σ|values| over segment s of the runs in ``table``
    (:func:`~pretrain.comm.layout.run_table`: start, rows, row length, first segment); returns ``out``."""
    if _numba_usable(values, out):
        _numba_sums().segment_abs_sums(values.numpy(), table, out.numpy())
        return out
    for start, rows, length, first in table.tolist():
        rows_view = values[start : start + rows * length].view(rows, length)
        if values.device.type == "cpu":
            _torch_abs_row_sums(rows_view, out[first : first + rows])
        else:
            torch.linalg.vector_norm(rows_view, 1, dim=1, out=out[first : first + rows])
    return out


def abs_row_sums(rows: Tensor, out: Tensor) -> Tensor:
    """out[i] ← Σ_j |rows[i, j]| for a [R, L] tensor. Each row's sum is computed the same way whatever R
    is and whatever the other rows hold, so a segment's scale does not depend on its neighbours."""
    count, length = rows.shape
    if _numba_usable(rows, out):
        table = np.asarray([[0, count, length, 0]], dtype=np.int64)
        _numba_sums().segment_abs_sums(rows.reshape(-1).numpy(), table, out.numpy())
        return out
    if rows.device.type != "cpu":
        return torch.linalg.vector_norm(rows, 1, dim=1, out=out)
    return _torch_abs_row_sums(rows, out)


def _torch_abs_row_sums(rows: Tensor, out: Tensor) -> Tensor:
    """:func:`abs_row_sums` in torch ops (CPU): |x| into a 1 MiB scratch, summed there; a row longer
    than `BLOCK` block by block, then the blocks' sums."""
    count, length = rows.shape
    if length <= BLOCK:
        step = BLOCK // length
        scratch = torch.empty(min(count, step) * length, dtype=rows.dtype)
        for first in range(0, count, step):
            block = rows[first : first + step]
            absolute = scratch[: block.numel()].view(block.shape)
            torch.abs(block, out=absolute)
            torch.sum(absolute, dim=1, out=out[first : first + step])
        return out
    pieces = -(-length // BLOCK)
    scratch = torch.empty(BLOCK, dtype=rows.dtype)
    partial = torch.empty(pieces, dtype=rows.dtype)
    for row in range(count):
        for piece in range(pieces):
            values = rows[row, piece * BLOCK : (piece + 1) * BLOCK]
            absolute = scratch[: values.numel()]
            torch.abs(values, out=absolute)
            torch.sum(absolute, dim=0, out=partial[piece])
        torch.sum(partial, dim=0, out=out[row])
    return out
