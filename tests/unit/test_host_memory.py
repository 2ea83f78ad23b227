"""pretrain/host_memory.py: importing `pretrain` puts large CPU tensors on transparent huge pages, which
fault 512× less often; THP_MEM_ALLOC_ENABLE=0 in the environment opts out."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pretrain.host_memory import ENV, kernel_allows_huge_pages

# Allocates, touches and frees a 64 MiB tensor (above glibc's largest mmap threshold: a fresh mapping each
# time) as a training loop does, and prints the page faults of the last three allocations.
SCRIPT = """
import resource, sys
import torch
import pretrain
from pretrain.host_memory import huge_pages_in_use
assert huge_pages_in_use() == (sys.argv[1] == "1")
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffer = torch.ones(16 * 2**20)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    del buffer
print(sum(faults[-3:]))
"""


def _faults(setting: str | None) -> int:
    env = {key: value for key, value in os.environ.items() if key != ENV}
    if setting is not None:
        env[ENV] = setting
    expected = "0" if setting == "0" else "1"
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, expected],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        env=env,
    )
    return int(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not kernel_allows_huge_pages(), reason="the kernel's THP mode is `never`")
def test_a_large_temporary_faults_far_fewer_pages():
    pages = 3 * 64 * 2**20 // 4096
    assert _faults("0") > pages // 2  # the mechanism: every allocation maps fresh 4 KiB pages
    assert _faults(None) < pages // 20  # importing pretrain asked for huge pages
