"""Loss scaling and the skip-on-Inf/NaN decision, agreed across ranks.

Every step the trainer asks the scaler whether ANY rank's gradients hold Inf/NaN; the flag is
MAX-allreduced so every rank skips the same steps. In the 1-bit compression stage gradients are not
averaged, so one rank can go non-finite alone: deciding locally would desynchronize the ranks (the next
collective hangs, docs/pretraining.md) and stepping would spread NaN into every replica's momentum. The check
reuses the gradient norm the metrics report, so it costs one small allreduce per step.
fp16 uses `DynamicLossScaler`; bf16 and fp32 use `NoScaler` (the check without scaling).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pretrain.optim.base import global_grad_norm


def nonfinite_on_any_rank(params: list[torch.Tensor]) -> tuple[bool, torch.Tensor]:
    """(whether some rank's gradients hold Inf/NaN, this rank's global gradient norm as a 0-dim tensor)."""
    norm = global_grad_norm([p.grad for p in params if p.grad is not None])
    flag = (~torch.isfinite(norm)).float().reshape(1)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item()), norm


class NoScaler:
    scale = 1.0
    grad_norm: torch.Tensor | None = None  # this rank's gradient norm at the last check (unscaled)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale_and_check(self, params: list[torch.Tensor]) -> bool:
        """True when any rank saw Inf/NaN (then every rank skips the step)."""
        skip, self.grad_norm = nonfinite_on_any_rank(params)
        return skip

    def update(self, skipped: bool) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class DynamicLossScaler(NoScaler):
    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_interval: int = 2000,
        backoff: float = 0.5,
        growth: float = 2.0,
        min_scale: float = 1.0,
    ):
        self.scale = init_scale
        self.growth_interval, self.backoff, self.growth, self.min_scale = (
            growth_interval,
            backoff,
            growth,
            min_scale,
        )
        self.good_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_and_check(self, params: list[torch.Tensor]) -> bool:
        """Divide gradients by the scale; True when any rank saw Inf/NaN (then skip the step)."""
        grads = [p.grad for p in params if p.grad is not None]
        torch._foreach_mul_(grads, 1.0 / self.scale)
        return super().unscale_and_check(params)

    def update(self, skipped: bool) -> None:
        if skipped:
            self.scale = max(self.min_scale, self.scale * self.backoff)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= self.growth

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
