"""Ablation `abl-decay` (rung M, results/cpu-study-m/README.md): the default's exchange with each worker's
error feedback decayed, e_w ← γ·(y − Q(y)) (γ from RUNG_DECAY, 0.9 unless set). At 32 simulated workers each
worker's error holds mostly its own gradient noise (its norm 3.5× the averaged momentum's, the workers' mean
error's 0.8×), which it sends again on top of the next step's; the decay forgets that noise at the price of
part of the error's common share. No bytes change. A study's patch, not an option: `apply` replaces the call
of the engine class it is given; `sitecustomize.py` here applies it with RUNG_ABLATION=worker_decay. Not
pipelined (the decay follows the whole call; the worker errors are not touched after the workers' pass).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from patching import patch

from pretrain.comm.compressed_allreduce import CompressedAllreduce
from pretrain.comm.plan import MomentumSource

DECAY = float(os.environ.get("RUNG_DECAY", "0.9"))


def apply(engine: type[CompressedAllreduce], decay: float = DECAY) -> type[CompressedAllreduce]:
    """Patch `engine` (CompressedAllreduce or a subclass) in place; returns it."""
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"RUNG_DECAY must be in [0, 1], got {decay}")
    call = engine.__call__

    @torch.no_grad()
    def __call__(
        self: Any,
        buffer: torch.Tensor,
        out: torch.Tensor | None = None,
        *,
        source: MomentumSource | None = None,
    ) -> torch.Tensor:
        """The default's call, then every worker's error times the decay."""
        result = call(self, buffer, out, source=source)
        self.worker_error.mul_(decay)
        return result

    return patch(engine, {"__call__": __call__})
