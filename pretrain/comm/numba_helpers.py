"""What the numba loops of the compressed allreduce (:mod:`pretrain.comm.numba_loops`) and of the optimizer
(:mod:`pretrain.optim.numba_loops`, :mod:`pretrain.optim.live_step`) share: the compile options, ``fma`` and
the block 1-norm. Imports numba: import it only where :func:`~pretrain.comm.numba_support.
numba_unavailable_reason` is None.
"""

from __future__ import annotations

import functools
from typing import Any

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

# Every loop: compiled once and cached on disk, no bounds checks, the GIL released (Any: the loops are
# typed by numba at their first call, not by mypy)
jit: Any = functools.partial(numba.njit, cache=True, boundscheck=False, nogil=True)


@intrinsic
def fma(typingctx: Any, a: Any, b: Any, c: Any) -> Any:
    """``fma(a, b, c)``: a·b + c in float32 rounded once, for numba code (``llvm.fma``: one instruction
    where the CPU has FMA, libm's fmaf elsewhere), as ATen's vectorised ``add(alpha=)`` computes it on x86."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.fma(*args)

    return types.float32(types.float32, types.float32, types.float32), codegen


@jit(fastmath={"reassoc"})
def abs_sum(x):
    # Σ|x| in float64 over one block (a view counted from 0). `reassoc` (this function only) lets LLVM
    # vectorise the sum: lanes, then a fixed tree, an order fixed by the compiled code and so the same
    # wherever it is called (0.08 ns per element in L1 against 0.32 for the strict scalar loop).
    total = 0.0
    for i in range(x.shape[0]):
        total += abs(np.float64(x[i]))
    return total
