"""Applies the ablation patch RUNG_ABLATION names to every Python process of a run (fp32_server.py)."""

import os

if os.environ.get("RUNG_ABLATION") == "fp32_server":
    import fp32_server

    from pretrain.comm.compressed_allreduce import CompressedAllreduce

    fp32_server.apply(CompressedAllreduce)
