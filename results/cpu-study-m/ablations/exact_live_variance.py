"""Ablation `exact_live_variance` (rung M, results/cpu-study-m/README.md, "Screens"): no compression
(`exact_mean.py`) and every tensor's variance live, as LAMB keeps it: after each step v ← β2·v + (1−β2)·ĝ²
with ĝ = (m̂ₜ − β1·m̂ₜ₋₁)/(1−β1), the exactly averaged (pre-normalized) gradient, for the matrices as the
default does for its exactly averaged 1-D tensors (`OnebitLamb._update_live_variance`); the refresh is off
(v is live: nothing to refresh). What is left of 1-bit LAMB's rule against LAMB's is the frozen
pre-normalization factor and the bias corrections folded into m and v at the freeze. A study's patch, not an
option: `sitecustomize.py` here applies it with RUNG_ABLATION=exact_live_variance.
"""

from __future__ import annotations

from typing import Any

import exact_mean

from pretrain.comm.compressed_allreduce import CompressedAllreduce
from pretrain.optim.onebit_lamb import OnebitLamb, OnebitLambAlgorithm


def every_position(self: Any, params: list[Any]) -> list[int]:
    """Every tensor's variance stays live after the freeze (the exchange is exact)."""
    return list(range(len(params)))


def never(self: Any) -> bool:
    """No variance refresh."""
    return False


def apply(engine: type[CompressedAllreduce]) -> type[CompressedAllreduce]:
    """Patch `engine` with `exact_mean` and 1-bit LAMB's classes (live variance, no refresh) in place."""
    OnebitLambAlgorithm.live_variance_positions = every_position  # type: ignore[method-assign]
    OnebitLamb._refresh_next = never  # type: ignore[method-assign]
    return exact_mean.apply(engine)
