"""Whether the numba loops can run here, and the block length they share; imports nothing but the standard
library, so that every user (the kernels, the norms, the optimizer's loops) can ask before it imports numba.

The loops themselves: :mod:`pretrain.comm.numba_helpers` (what the compressed allreduce's loops and the
optimizer's share), :mod:`pretrain.comm.numba_loops` (the compressed allreduce's), :mod:`pretrain.optim.
numba_loops` (the optimizer's, which the kernels run inside their passes through a
:class:`~pretrain.comm.plan.MomentumSource`). Each module compiles its functions on first call and caches
them on disk (``cache=True``); numba keys a cache by its own module's source only, so a change to a helper
or a constant here wants ``NUMBA_CACHE_DIR`` cleared (or the importing module touched) to take effect.
"""

from __future__ import annotations

import functools
import sys

# Elements per float64 partial sum of the `mean_abs` scales' 1-norms (:mod:`pretrain.comm.norms`): a
# segment's norm is the sum, in order, of the partial sums of its blocks of this many elements from its
# start. 16 KiB: the fused worker pass adds a block and sums it while it is in L1.
SUM_BLOCK = 4096


def numba_unavailable_reason() -> str | None:
    """Why the numba loops cannot be used here, or None."""
    if sys.byteorder != "little":  # the packing and expanding loops read eight flag bytes as one uint64
        return "the numba kernels need a little-endian CPU"
    try:
        check_numba()
    except ImportError as error:
        return f"numba is not installed ({error})"
    except Exception as error:  # e.g. no writable cache location for the compiled code
        return f"numba cannot be used here ({type(error).__name__}: {error})"
    return None


@functools.cache
def check_numba() -> None:
    """Import numba and set up a cached function the way the loops are (``cache=True`` finds a writable
    cache location for this package at decoration, or raises); raises where numba cannot be used."""
    import numba

    numba.njit(cache=True)(_identity)


def _identity(x: int) -> int:
    return x
