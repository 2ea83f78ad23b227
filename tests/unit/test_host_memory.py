"""pretrain/train/host_memory.py: with it, a freed large buffer is reused instead of faulting in fresh pages;
the
trainer applies it on CPU by default; releasing gives the kept memory back."""

from __future__ import annotations

import functools
import platform
import subprocess
import sys

import pytest

# Allocates, touches and frees a 64 MiB tensor (above glibc's largest mmap threshold) as a training loop
# does, and prints the page faults of the last three allocations; `keep` then releases the kept memory and
# prints the bytes given back. (glibc's heap needs a few rounds before it reuses a freed block for a
# same-sized aligned request: small allocations pin the blocks apart.)
SCRIPT = """
import resource, sys, torch
from pretrain.train.host_memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory() and keep_freed_memory()
faults = []
for _ in range(16):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffer = torch.ones(16 * 2**20)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    del buffer
print(sum(faults[-3:]))
if sys.argv[1] == "keep":
    from pretrain.train.host_memory import release_freed_memory
    import psutil
    kept = psutil.Process().memory_info().rss
    assert release_freed_memory()
    print(kept - psutil.Process().memory_info().rss)  # bytes given back
"""


@functools.cache
def _script(mode: str) -> tuple[int, ...]:
    """SCRIPT's output: page faults of the last three allocations and (keep) then the bytes that releasing
    the kept memory gave back. Cached: one process per mode, shared by the tests."""
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True, timeout=120
    )
    return tuple(int(line) for line in result.stdout.strip().splitlines())


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_a_freed_large_buffer_is_reused_without_page_faults():
    pages = 64 * 2**20 // 4096
    assert _script("default")[0] > 3 * pages // 2  # the mechanism: every allocation maps fresh pages
    assert _script("keep")[0] < 3 * pages // 100


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_releasing_gives_the_kept_memory_back():
    assert _script("keep")[1] >= 48 * 2**20  # the 64 MiB block the loop freed last, kept until then


TRAINER = """
import sys
from tests.integration.pretrain_helpers import compose_train_config
from pretrain.train import host_memory
from pretrain.distributed.process_group import init_distributed
from pretrain.train.trainer import Trainer
overrides = ["batch=demo", "model=bert_tiny", f"data_dir={sys.argv[1]}", f"run_dir={sys.argv[2]}",
             "wandb.mode=disabled", "num_workers=0", *sys.argv[3:]]
Trainer(compose_train_config(overrides), init_distributed())
print(host_memory.kept())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
@pytest.mark.parametrize(
    ("overrides", "kept"),
    # `make test`: the default is checked on the ranks of tests/integration/test_pretrain.py's 2-rank run
    [
        pytest.param([], "True", marks=pytest.mark.slow),
        pytest.param(["keep_host_memory=false"], "False", marks=pytest.mark.slow),
    ],
)
def test_a_cpu_trainer_keeps_freed_memory_by_default(tiny_data, tmp_path, repo_root, overrides, kept):
    # on by default: the same peak memory per rank in a one-optimizer run, no page faults per step (module
    # docstring); one process per case, as the setting is process-wide
    result = subprocess.run(
        [sys.executable, "-c", TRAINER, str(tiny_data), str(tmp_path / "run"), *overrides],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=repo_root,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == kept
