"""Host memory on CPU runs (``keep_host_memory``, on by default): keep freed memory in the process.

glibc's malloc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh ``mmap`` and
unmaps it again on ``free``, and trims the top of its heap when enough of it is free. A training step
allocates buffers larger than that and frees them before the next step (BERT-Base: the tied word
embedding's two 94 MB gradients, optimizer scratch), so every step touches freshly mapped pages: 82,000 to
91,000 page faults per 1-bit LAMB step and rank at 4 ranks on the 2-core bench machine, 46,000 for LAMB
(exactly the two 94 MB gradients; `strace` shows their two 89.4 MiB ``munmap`` calls per step).
``keep_freed_memory()`` turns that off (``mallopt``: no mmap'd chunks, no trimming of the heap), so freed
blocks are reused and a warm step faults (almost) no pages.

Measured (BERT-Base at 1 Gbit/s, one optimizer per process as in a real run, 4 ranks on 2
cores): a 1-bit LAMB step 3.92 s without against 3.25 s with it, and the same peak RSS per rank (4.49-4.64
GiB against 4.51-4.64); compiled, 4.16 against 3.83 s, peak 4.97-5.22 against 4.99-5.16 GiB. Hence on by
default. It costs memory only where one process runs models of different shapes one after another (the
heap keeps the fragments of the first for the second): `bench net`'s e2e runs four variants per process
and calls ``release_freed_memory()`` between them. In such a process it measured +0.1 to +0.45 GB per rank (4
compiled ranks on a 24 GB machine).
Transparent huge pages (PyTorch's ``THP_MEM_ALLOC_ENABLE=1``) cut the faults only to ~30,000 per step and
made every variant slower in the same benchmark, so they are not used.

Only glibc has these knobs; elsewhere (musl, macOS) this is a no-op that says so. GPU runs allocate their
tensors through CUDA's caching allocator (which keeps freed blocks in the same way) and the trainer leaves
malloc alone there.
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


def release_freed_memory() -> bool:
    """Give the heap's free memory back to the system now (``malloc_trim(0)``: the free top of the heap and
    the free pages inside it), e.g. between two models in one process. Returns whether any was released."""
    if not _applied:
        return False
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(malloc_trim(0))
