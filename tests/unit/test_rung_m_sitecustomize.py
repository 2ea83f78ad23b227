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


def probe(ablation: str | None, **extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNG_")}
    env["PYTHONPATH"] = f"{FOLDER}:{REPO}"
    if ablation is not None:
        env["RUNG_ABLATION"] = ablation
    env.update(extra)
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)


def method_modules(ablation: str | None, **extra: str) -> set[str]:
    done = probe(ablation, **extra)
    assert done.returncode == 0, done.stderr
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


def test_the_step_ranged_patch_wraps_the_default_call():
    # exact_until keeps the default's methods (its own steps are the default's) and wraps the call
    assert method_modules("exact_until", RUNG_EXACT_UNTIL="800") == {
        "pretrain.comm.compressed_allreduce",
        "exact_until",
    }


@pytest.mark.parametrize("until", [None, "0", "eight hundred"])
def test_the_step_ranged_patch_needs_its_last_exact_step(until: str | None):
    done = probe("exact_until", **({} if until is None else {"RUNG_EXACT_UNTIL": until}))
    assert done.returncode != 0
    assert "RUNG_EXACT_UNTIL must be the last exactly averaged step" in done.stderr
