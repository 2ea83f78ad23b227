"""Host memory on CPU runs: keep freed memory in the process instead of handing it back to the kernel.

glibc's malloc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh ``mmap``
and unmaps it again on ``free``. A training step allocates many buffers larger than that and frees them
before the next step (BERT-Base: the tied word embedding's gradient sum, 94 MB; the 1-bit step's
statistics), so every step touches freshly mapped pages: about 250,000 page faults per step and rank
on the 2-core bench machine, ~0.3 s of a 2.4 s 1-bit LAMB step at 2 ranks. ``keep_freed_memory()``
turns that off (``mallopt``: no mmap'd chunks, no trimming of the heap), so freed blocks are reused
and a step faults no pages at all once warm.

The cost: the process keeps its high-water mark of heap memory (what a step needs anyway; the peak RSS
is unchanged within noise). The trainer applies it to CPU runs (``keep_host_memory``, default true);
GPU runs allocate their tensors through CUDA's caching allocator and gain nothing. Only glibc has
these knobs; elsewhere (musl, macOS) this is a no-op that says so. PyTorch's CPU tuning guide gets the
same effect by preloading jemalloc or tcmalloc; this needs no extra library.
"""

from __future__ import annotations

import ctypes
import logging
import platform

log = logging.getLogger(__name__)

# mallopt(3) parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
# the largest trim threshold mallopt takes (an int): the heap is never trimmed in practice
NEVER_TRIM = 2**31 - 1

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Make glibc's malloc serve every allocation from its heap and never trim it (module docstring).
    Returns whether it applies; idempotent (process-wide, the first call decides)."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        log.info("keep_host_memory: not glibc (%s); malloc left as is", platform.libc_ver()[0] or "unknown")
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        log.info("keep_host_memory: mallopt not found, malloc left as it is")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))
    if not _applied:
        log.warning("keep_host_memory: mallopt refused; large temporaries will fault fresh pages each step")
    return _applied
