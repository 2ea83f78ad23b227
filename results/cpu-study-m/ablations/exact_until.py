"""Ablation `exact_until` (rung M, results/cpu-study-m/README.md, "Screens"): exact averaging
(`exact_mean.py`) for the optimizer steps up to RUNG_EXACT_UNTIL, the default's compressed exchange from
the step after it. The exact steps leave the default's error buffers as the freeze left them (zero), so
its compression starts from a clean exchange state, as if it began at step RUNG_EXACT_UNTIL + 1.
Screened from the freeze, it asks what the first compression steps alone leave in the state: a screen with
the patch against `exact_mean` from the same checkpoint separates the cost of the steps up to
RUNG_EXACT_UNTIL from the cost of those after it. A study's patch, not an option: `sitecustomize.py` here
applies it with RUNG_ABLATION=exact_until. The exact steps are not pipelined (the default's own steps are
as the default's).
"""

from __future__ import annotations

import os
from typing import Any

import exact_mean
import torch
from patching import replaced_call

from pretrain.comm.compressed_allreduce import CompressedAllreduce
from pretrain.optim.onebit import OnebitOptimizer

UNTIL = os.environ.get("RUNG_EXACT_UNTIL", "")


class _Step:
    """The optimizer step being taken (1-based), set as an optimizer's `step()` begins."""

    number = 0


def parse_until(value: str) -> int:
    """RUNG_EXACT_UNTIL's step (an integer ≥ 1); a clear error otherwise."""
    try:
        until = int(value)
    except ValueError:
        until = 0
    if until < 1:
        raise ValueError(
            f"RUNG_EXACT_UNTIL must be the last exactly averaged step (an integer >= 1): {value!r}"
        )
    return until


def apply(engine: type[CompressedAllreduce], until: str = UNTIL) -> type[CompressedAllreduce]:
    """Patch `engine` (CompressedAllreduce or a subclass) and the optimizers' `step` in place; returns the
    engine."""
    last = parse_until(until)
    step, call, exact_call = OnebitOptimizer.step, engine.__call__, replaced_call(exact_mean.exact_mean)

    def counted_step(self: Any, closure: Any = None) -> Any:
        """The optimizer's step, its number recorded for the exchange."""
        _Step.number = self.step_count + 1
        return step(self, closure)

    def __call__(self: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The exact mean through step `last`, the default's call after it."""
        return (exact_call if _Step.number <= last else call)(self, *args, **kwargs)

    OnebitOptimizer.step = counted_step  # type: ignore[method-assign]
    engine.__call__ = __call__  # type: ignore[method-assign]
    return engine
