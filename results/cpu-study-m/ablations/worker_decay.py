"""Ablation `abl-decay` (rung M, results/cpu-study-m/README.md, "Screens"): the default's exchange with each
worker's error feedback decayed, e_w ← γ·(y − Q(y)) (γ from RUNG_DECAY, 0.9 unless set). At 32 simulated
workers (4 sequences each) each worker's error holds much of its own gradient noise, which it sends again on
top of the next step's; the decay forgets part of it, at the price of what the error owes the average. No
bytes change. A study's patch, not an option: `apply` replaces the call of the engine class it is given;
`sitecustomize.py` here applies it with RUNG_ABLATION=worker_decay. Not pipelined (the decay follows the whole
call; the worker errors are not touched after the workers' pass).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from patching import patch

from pretrain.comm.compressed_allreduce import CompressedAllreduce

DECAY = float(os.environ.get("RUNG_DECAY", "0.9"))


def apply(engine: type[CompressedAllreduce], decay: float = DECAY) -> type[CompressedAllreduce]:
    """Patch `engine` (CompressedAllreduce or a subclass) in place; returns it."""
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"RUNG_DECAY must be in [0, 1], got {decay}")
    call = engine.__call__

    def __call__(self: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The default's call, then every worker's error times the decay."""
        result = call(self, *args, **kwargs)
        self.worker_error.mul_(decay)
        return result

    return patch(engine, {"__call__": __call__})
