"""What the training loop needs from an optimizer besides torch.optim.Optimizer's own interface.

Every optimizer of the registry (`pretrain.optim.OPTIMIZERS`) keeps `TrainingOptimizer`: LAMB through
`OptimizerBase`, the 1-bit optimizers through `OnebitOptimizer`, AdamW through `pretrain.optim.adamw`.
The trainer reads it and never asks an optimizer what kind it is; the optimizer never reaches into the
trainer. Per optimizer step the loop calls, in this order:

    sync = optimizer.needs_gradient_allreduce      # before the backward pass: average gradients or not
    optimizer.mark_gradients_checked(norm)         # no rank's gradients hold Inf/NaN (loss scaler's check)
    optimizer.step()
    optimizer.last_step_skipped                    # the step changed nothing (any rank's Inf/NaN)
    optimizer.bytes_sent                           # cumulative bytes the optimizer itself sent

and at each phase start `start_phase(freeze_step=..., max_seq_length=...)`, at log steps
`statistics()`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, cast, runtime_checkable

from torch import Tensor
from torch.optim import Optimizer


@runtime_checkable
class TrainingOptimizer(Protocol):
    @property
    def needs_gradient_allreduce(self) -> bool:
        """Whether the trainer must mean-allreduce the gradients over the data-parallel group before the
        next `step()` (False in the 1-bit compression stage: the optimizer exchanges momenta itself)."""
        ...

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last `step()` left everything as it was (Inf/NaN gradients on some rank)."""
        ...

    @property
    def bytes_sent(self) -> float:
        """Bytes this rank sent inside `step()` so far (compressed exchanges; 0 for an optimizer whose
        gradients the trainer averages): the trainer's traffic counters take the difference per step."""
        ...

    def start_phase(self, *, freeze_step: int | None, max_seq_length: int) -> None:
        """A training phase starts. `freeze_step`: the last warmup step of a staged optimizer (None: keep
        the current one); `max_seq_length`: the longest sequence the phase trains on (momentum masks of
        position-embedding rows). Optimizers without stages or masks ignore both."""
        ...

    def mark_gradients_checked(self, grad_norm: Tensor | None = None) -> None:
        """The caller found no Inf/NaN in any rank's gradients this step and (optionally) computed their
        global norm; the next `step()` may skip its own check (`OptimizerBase.mark_gradients_checked`)."""
        ...

    def statistics(self) -> dict[str, float]:
        """A few numbers for the metrics log (logged as `optim/<key>`; host syncs: log steps only)."""
        ...


if TYPE_CHECKING:

    class LoopOptimizer(Optimizer, TrainingOptimizer):
        """For type checkers only: a torch optimizer that keeps `TrainingOptimizer`
        (what `as_training_optimizer` returns)."""

else:
    LoopOptimizer = Optimizer


def as_training_optimizer(optimizer: Optimizer) -> LoopOptimizer:
    """`optimizer` itself, checked to keep `TrainingOptimizer` (TypeError naming what it lacks)."""
    if not isinstance(optimizer, TrainingOptimizer):
        members = ("needs_gradient_allreduce", "last_step_skipped", "bytes_sent", "start_phase")
        missing = [m for m in (*members, "mark_gradients_checked", "statistics") if not hasattr(optimizer, m)]
        raise TypeError(f"{type(optimizer).__name__} does not keep TrainingOptimizer (lacks {missing})")
    return cast("LoopOptimizer", optimizer)
