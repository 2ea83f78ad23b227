"""Optimizers for large-batch BERT pretraining: LAMB, 1-bit LAMB, AdamW, 1-bit Adam.

The registry is the explicit dict `OPTIMIZERS` (name -> (class, config dataclass)); adding an optimizer
is one file, one line here, one `conf/optim/<name>.yaml` and its tests.

What a trainer does each optimizer step (data-parallel over `group`):

    sync = needs_gradient_allreduce(optimizer)   # read BEFORE the step; it turns False after freeze_step
    for micro_batch in micro_batches:            # loss / len(micro_batches): gradients are the MEAN
        (loss / len(micro_batches)).backward()
    if sync:
        allreduce-mean the gradients over the group   # never in the 1-bit compression stage
    optimizer.step()                              # every rank; skips on all ranks if any had Inf/NaN
    optimizer.zero_grad()

Checkpoints: `optimizer.state_dict()` is rank-local for the 1-bit optimizers (their error-feedback
buffers differ per rank): save one file per rank, load each rank its own.
"""

from __future__ import annotations

import logging
from typing import Any

from hydra.core.config_store import ConfigStore
from torch import Tensor
from torch.optim import Optimizer

from pretrain.optim.adamw import AdamW
from pretrain.optim.config import (
    AdamWConfig,
    LambConfig,
    OnebitAdamConfig,
    OnebitLambConfig,
    OnebitLambDeepspeedConfig,
    OptimizerConfig,
)
from pretrain.optim.lamb import Lamb, LambVariant
from pretrain.optim.onebit import OnebitOptimizer, Stage
from pretrain.optim.onebit_adam import OnebitAdam
from pretrain.optim.onebit_lamb import OnebitLamb
from pretrain.optim.params import param_groups
from pretrain.optim.protocol import TrainingOptimizer, as_training_optimizer

logger = logging.getLogger(__name__)

OPTIMIZERS: dict[str, tuple[type[Optimizer], type[OptimizerConfig]]] = {
    "lamb": (Lamb, LambConfig),
    "onebit_lamb": (OnebitLamb, OnebitLambConfig),
    "onebit_lamb_deepspeed": (OnebitLamb, OnebitLambDeepspeedConfig),
    "adamw": (AdamW, AdamWConfig),
    "onebit_adam": (OnebitAdam, OnebitAdamConfig),
}


def register_configs() -> None:
    """`conf/optim/<name>.yaml` composes on top of `<name>_schema` in the Hydra group `optim`."""
    store = ConfigStore.instance()
    for name, (_, config_class) in OPTIMIZERS.items():
        store.store(group="optim", name=f"{name}_schema", node=config_class)


register_configs()

__all__ = [
    "OPTIMIZERS",
    "AdamW",
    "AdamWConfig",
    "Lamb",
    "LambConfig",
    "LambVariant",
    "OnebitAdam",
    "OnebitAdamConfig",
    "OnebitLamb",
    "OnebitLambConfig",
    "OnebitLambDeepspeedConfig",
    "OnebitOptimizer",
    "OptimizerConfig",
    "Stage",
    "TrainingOptimizer",
    "as_training_optimizer",
    "build_optimizer",
    "mark_gradients_checked",
    "needs_gradient_allreduce",
    "param_groups",
]


def needs_gradient_allreduce(optimizer: Optimizer) -> bool:
    """Whether the trainer must mean-allreduce gradients before the next step (True for any optimizer
    that does not say otherwise, e.g. torch's AdamW)."""
    return bool(getattr(optimizer, "needs_gradient_allreduce", True))


def mark_gradients_checked(optimizer: Optimizer, grad_norm: Tensor | None = None) -> None:
    """Tell `optimizer` that no rank's gradients hold Inf/NaN this step (the caller MAX-allreduced that)
    and, if given, their global norm (`base.global_grad_norm` of the same unscaled `.grad`s): our
    optimizers then skip repeating the check and the norm's pass over the gradients in the next step
    (`OptimizerBase.mark_gradients_checked`); other optimizers ignore it."""
    mark = getattr(optimizer, "mark_gradients_checked", None)
    if mark is not None:
        mark(grad_norm)


def build_optimizer(
    name: str,
    config: OptimizerConfig,
    param_groups: list[dict[str, Any]],
    group: Any = None,
    *,
    virtual_workers: int = 1,
) -> Optimizer:
    """Build registry entry `name` from its config over `param_groups` (see `param_groups()`).

    `group` is the data-parallel process group and `virtual_workers` the simulated workers per process
    (`pretrain.train.simulated`), used by the 1-bit optimizers only (the others see averaged gradients).
    `exp_avg_mask` and `row_scales` keys are dropped, with a warning for the mask, for optimizers that
    do not use them.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"optim.name: unknown optimizer '{name}'; known: {sorted(OPTIMIZERS)}")
    optimizer_class, config_class = OPTIMIZERS[name]
    if not isinstance(config, config_class):
        raise ValueError(f"optim: '{name}' needs a {config_class.__name__}, got {type(config).__name__}")
    kwargs = config.optimizer_kwargs()
    if issubclass(optimizer_class, OnebitOptimizer):
        return optimizer_class(param_groups, group=group, virtual_workers=virtual_workers, **kwargs)  # type: ignore[call-arg]
    param_groups = [{k: v for k, v in g.items() if k != "row_scales"} for g in param_groups]
    if any("exp_avg_mask" in g for g in param_groups):
        logger.warning("optim.%s does not use momentum masks: exp_avg_mask ignored", name)
        param_groups = [{k: v for k, v in g.items() if k != "exp_avg_mask"} for g in param_groups]
    if optimizer_class is AdamW:
        return _adamw(param_groups, kwargs)
    return optimizer_class(param_groups, **kwargs)


def _adamw(param_groups: list[dict[str, Any]], kwargs: dict[str, Any]) -> Optimizer:
    """AdamW (torch's, `adamw.AdamW`), fused unless the config says otherwise or the device has none."""
    fused = kwargs.pop("fused")
    if fused is not None:
        return AdamW(param_groups, fused=fused, **kwargs)
    try:
        return AdamW(param_groups, fused=True, **kwargs)
    except RuntimeError as error:
        logger.info("AdamW: fused kernel unavailable (%s); using the foreach implementation", error)
        return AdamW(param_groups, **kwargs)
