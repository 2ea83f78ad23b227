"""Applies the ablation patch RUNG_ABLATION names to every Python process of a run (fp32_server.py,
fp32_worker.py, two_bit_worker.py, worker_decay.py, exact_mean.py, exact_live_variance.py)."""

import importlib
import os

PATCHES = (
    "fp32_server",
    "fp32_worker",
    "two_bit_worker",
    "worker_decay",
    "exact_mean",
    "exact_live_variance",
)

if os.environ.get("RUNG_ABLATION") in PATCHES:
    patch = importlib.import_module(os.environ["RUNG_ABLATION"])

    from pretrain.comm.compressed_allreduce import CompressedAllreduce

    patch.apply(CompressedAllreduce)
