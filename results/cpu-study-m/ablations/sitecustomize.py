"""Applies the ablation patch RUNG_ABLATION names to every Python process of a run (fp32_server.py,
fp32_worker.py, two_bit_worker.py, worker_decay.py, exact_mean.py, exact_live_variance.py, exact_until.py);
a patch that fails to apply ends the process with its error (Python itself would run on unpatched)."""

import importlib
import os
import sys

PATCHES = (
    "fp32_server",
    "fp32_worker",
    "two_bit_worker",
    "worker_decay",
    "exact_mean",
    "exact_live_variance",
    "exact_until",
)

if os.environ.get("RUNG_ABLATION") in PATCHES:
    try:
        patch = importlib.import_module(os.environ["RUNG_ABLATION"])

        from pretrain.comm.compressed_allreduce import CompressedAllreduce

        patch.apply(CompressedAllreduce)
    except Exception as error:  # Python would report it and run on unpatched: the run would be the default's
        sys.stderr.write(f"sitecustomize.py: RUNG_ABLATION={os.environ['RUNG_ABLATION']}: {error}\n")
        os._exit(2)
