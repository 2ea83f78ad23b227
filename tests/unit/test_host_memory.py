"""pretrain/host_memory.py: with it, a freed large buffer is reused instead of faulting in fresh pages."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from pretrain.config import TrainConfig

# Allocates, touches and frees a 64 MiB tensor (above glibc's largest mmap threshold) as a training loop
# does, and prints the page faults of the last three allocations. (glibc's heap needs a few rounds before
# it reuses a freed block for a same-sized aligned request: small allocations pin the blocks apart.)
SCRIPT = """
import resource, sys, torch
from pretrain.host_memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory() and keep_freed_memory()
faults = []
for _ in range(16):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffer = torch.ones(16 * 2**20)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    del buffer
print(sum(faults[-3:]))
"""


def _faults(mode: str) -> int:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True, timeout=120
    )
    return int(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_a_freed_large_buffer_is_reused_without_page_faults():
    pages = 64 * 2**20 // 4096
    assert _faults("default") > 3 * pages // 2  # the mechanism: every allocation maps fresh pages
    assert _faults("keep") < 3 * pages // 100


def test_it_is_opt_in():
    # it fragments the heap (more memory per rank): only for runs with memory to spare
    assert TrainConfig.__dataclass_fields__["keep_host_memory"].default is False
