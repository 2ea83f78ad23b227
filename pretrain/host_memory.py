"""Host memory: large CPU tensors on transparent huge pages.

glibc's malloc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh ``mmap`` and
unmaps it on ``free``. A training step allocates and frees many buffers larger than that (BERT-Base: the
tied word embedding's 94 MB gradient sum, the optimizers' scratch), so every step faulted in fresh 4 KiB
pages: ~77,000 page faults per step and rank for a 1-bit LAMB step at 2 ranks on the 2-core bench machine
(~250,000 before that step's own matrix-sized temporaries went), each paid in kernel time.

PyTorch's ``THP_MEM_ALLOC_ENABLE=1`` aligns CPU allocations of 2 MiB and more to 2 MiB and advises the
kernel to back them with transparent huge pages (``MADV_HUGEPAGE``): one fault per 2 MiB instead of 512
(the 2 MiB-aligned interior of each allocation; its unaligned ends keep 4 KiB pages).
Memory is still returned on ``free``, so the footprint does not change. (Keeping freed memory inside glibc
instead, ``mallopt(M_MMAP_MAX, 0)``, removed every fault but fragmented the heap: +0.1 to +0.45 GB per rank,
and BERT-Base at 4 compiled ranks no longer fit the 24 GB machine.)

PyTorch reads the variable once, at its first CPU allocation, so importing the ``pretrain`` package sets it
(:func:`request_huge_pages`, unless the environment already sets it: ``THP_MEM_ALLOC_ENABLE=0`` opts out),
and the trainer reports with :func:`huge_pages_in_use` whether it took. The kernel must allow THP
(``/sys/kernel/mm/transparent_hugepage/enabled``: ``always`` or ``madvise``); with ``never`` the advice is
ignored and nothing changes. On GPU machines it applies to host tensors only (checkpoints, data); device
memory goes through CUDA's caching allocator.
"""

from __future__ import annotations

import logging
import os
import platform
from pathlib import Path

log = logging.getLogger(__name__)

ENV = "THP_MEM_ALLOC_ENABLE"
HUGE_PAGE = 2 << 20
KERNEL_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def kernel_allows_huge_pages() -> bool:
    """The kernel's THP mode is `always` or `madvise` (Linux only)."""
    try:
        mode = KERNEL_SETTING.read_text()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def huge_pages_in_use() -> bool:
    """Large CPU tensors of this process land on huge pages: a 32 MiB tensor, touched once, takes far fewer
    page faults than its 8,192 small pages (~530 with huge pages: the 2 MiB-aligned interior faults once per
    huge page, the unaligned ends page by page). PyTorch's setting and the kernel's together."""
    import resource

    import torch

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    probe = torch.ones(16 * HUGE_PAGE // 4, dtype=torch.float32)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    del probe
    return faults < 16 * HUGE_PAGE // 4096 // 4


def request_huge_pages() -> None:
    """Set ``THP_MEM_ALLOC_ENABLE=1`` unless the environment sets it (call before any CPU allocation)."""
    if platform.system() == "Linux":
        os.environ.setdefault(ENV, "1")
