"""Host memory on CPU runs (opt-in, ``keep_host_memory=true``): keep freed memory in the process.

glibc's malloc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh ``mmap`` and
unmaps it again on ``free``. A training step allocates many buffers larger than that and frees them before
the next step (BERT-Base: the tied word embedding's 94 MB gradient sum, optimizer scratch), so every step
touches freshly mapped pages: ~77,000 page faults per 1-bit LAMB step and rank at 2 ranks on the 2-core
bench machine (~250,000 before that step's own matrix-sized temporaries went). ``keep_freed_memory()``
turns that off (``mallopt``: no mmap'd chunks, no trimming of the heap), so freed blocks are reused and a
warm step faults no pages at all.

Measured (``python -m bench net --part=e2e``, 2026-11-26, BERT-Base at 1 Gbit/s, commit d24dfb3 where it
was the default): LAMB's no-communication bound ran 1.214 samples/s against 1.018 in the run before it, and
1-bit LAMB reached 1.86x LAMB at 2 ranks (1.46x before). The price is memory: glibc's heap fragments
(PyTorch's aligned allocations cannot reuse a freed block of exactly their size until neighbours
coalesce), +0.1 to +0.45 GB per rank at 4 eager ranks, and BERT-Base at 4 ranks with ``optim.compile``
ran out of the machine's 24 GB. Hence opt-in: for runs with memory to spare. Transparent huge pages
(PyTorch's ``THP_MEM_ALLOC_ENABLE=1``) cut the faults only to ~30,000 per step and made every variant
slower in the same benchmark (the bound 0.83 samples/s), so they are not used.

Only glibc has these knobs; elsewhere (musl, macOS) this is a no-op that says so. GPU runs allocate their
tensors through CUDA's caching allocator and do not need it.
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


def kept() -> bool:
    """Whether `keep_freed_memory()` applied in this process."""
    return bool(_applied)
