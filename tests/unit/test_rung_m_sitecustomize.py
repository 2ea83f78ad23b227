"""results/cpu-study-m/ablations/sitecustomize.py: a run's processes get the patch RUNG_ABLATION names."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FOLDER = REPO / "results" / "cpu-study-m" / "ablations"
PROBE = (  # the modules that the engine class's own methods come from
    "from pretrain.comm.compressed_allreduce import CompressedAllreduce as E; "
    "print(' '.join({f.__module__ for f in vars(E).values() if callable(f) and hasattr(f, '__module__')}))"
)


def method_modules(ablation: str | None) -> set[str]:
    env = {k: v for k, v in os.environ.items() if k != "RUNG_ABLATION"}
    env["PYTHONPATH"] = f"{FOLDER}:{REPO}"
    if ablation is not None:
        env["RUNG_ABLATION"] = ablation
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    return set(done.stdout.split())


@pytest.mark.parametrize(
    "ablation", ["fp32_server", "fp32_worker", "two_bit_worker", "worker_decay", "exact_mean"]
)
def test_the_named_patch_replaces_the_engines_methods(ablation: str):
    # its own methods, and the unpipelined __init__ every patch installs
    assert method_modules(ablation) == {"pretrain.comm.compressed_allreduce", ablation, "patching"}


def test_without_a_name_or_with_an_unknown_one_the_engine_is_the_default():
    assert method_modules(None) == {"pretrain.comm.compressed_allreduce"}
    assert method_modules("no_such_patch") == {"pretrain.comm.compressed_allreduce"}


def test_the_live_variance_patch_takes_the_exact_mean_call():
    # the engine's call is exact_mean's (the patch adds the optimizer's live variance on top of it)
    assert method_modules("exact_live_variance") == {
        "pretrain.comm.compressed_allreduce",
        "exact_mean",
        "patching",
    }
