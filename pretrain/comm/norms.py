"""The 1-norms behind ``sign_scale=mean_abs``'s scales, fast on CPU.

ATen's ``vector_norm(ord=1)`` runs a scalar loop on CPU: ~0.9 ns per element on the 2-core bench machine,
eight times its 2-norm (``python -m bench comm``'s ``segment_l1_norms_ns_per_element``), which made the
scales ~150 ms of each BERT-Base compression step. :func:`abs_row_sums` writes |x| into a 1 MiB scratch and
sums it there, block by block: two vectorised passes, the second in cache (0.22–0.36 ns per element on that
machine; scratch sizes from 64 KiB to 8 MiB measured, 1 MiB the best). It is also the more accurate sum:
ATen's 1-norm accumulates a long row naively in fp32 (4 % off over 55M elements, a BERT-Large chunk of the
single-scale layout), the blocks keep it within 1e-7. Every kernel implementation takes its scales from
here, so they still agree bit for bit. Other devices keep ``vector_norm``. The 2-norm (``rms``,
DeepSpeed's) stays ``vector_norm`` everywhere: it is vectorised, and it is spec §2's expression.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Elements of |x| held at a time (1 MiB of fp32: in L2 on current CPUs; smaller blocks pay Python's
# per-call overhead, 0.5 ns per element at 256 KiB).
BLOCK = 1 << 18


def abs_row_sums(rows: Tensor, out: Tensor) -> Tensor:
    """out[i] ← Σ_j |rows[i, j]| for a [R, L] tensor with contiguous rows. Each row's sum is computed
    the same way whatever R is and whatever the other rows hold (a row longer than `BLOCK` is summed
    block by block, then the blocks' sums), so a segment's scale does not depend on its neighbours."""
    if rows.device.type != "cpu":
        return torch.linalg.vector_norm(rows, 1, dim=1, out=out)
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
