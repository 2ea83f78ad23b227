"""torch's AdamW keeping the training loop's interface (`pretrain.optim.protocol.TrainingOptimizer`).

The math, the state dict and the fused / foreach kernels are torch.optim.AdamW's own; the class only adds
what the loop reads: gradients are always averaged by the trainer, a step is never skipped by the optimizer
(the trainer's loss scaler skips the call on Inf/NaN), nothing is sent inside `step()`, phases change
nothing, and there are no statistics to log.
"""

from __future__ import annotations

import torch
from torch import Tensor


class AdamW(torch.optim.AdamW):
    @property
    def needs_gradient_allreduce(self) -> bool:
        return True

    @property
    def last_step_skipped(self) -> bool:
        return False

    @property
    def bytes_sent(self) -> float:
        return 0.0

    def start_phase(self, *, freeze_step: int | None, max_seq_length: int) -> None:
        """Nothing to do: AdamW has no stages and no momentum masks."""

    def mark_gradients_checked(self, grad_norm: Tensor | None = None) -> None:
        """Nothing to do: torch's step neither checks the gradients nor computes their norm."""

    def statistics(self) -> dict[str, float]:
        return {}
