"""Learning-rate schedules of the BERT recipes, per phase (the step counter restarts each phase).

- `nvidia_poly` (NVIDIA BERT/LAMB): linear warmup to the peak over `warmup_steps`, then
  peak · (1 − t/T)^power with t counted from the phase start (power 0.5).
- `deepspeed_ee` (DeepSpeed BERT 1-bit LAMB): peak · (t/W)^warmup_power during warmup (quadratic),
  then peak · decay_rate^((t − W)/decay_steps); `lr_offset` is added throughout.
- `linear` / `constant`: transformers' `get_linear_schedule_with_warmup` /
  `get_constant_schedule_with_warmup` (the same thing, so we use them).

LEGW (You et al.) is how the recipes derive warmup and peak LR across batch sizes (LR ∝ √batch,
warmup iterations constant), not a schedule shape: see conf/batch/*.yaml.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from functools import partial

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR
from transformers import get_constant_schedule_with_warmup, get_linear_schedule_with_warmup


class ScheduleName(str, enum.Enum):
    nvidia_poly = "nvidia_poly"
    deepspeed_ee = "deepspeed_ee"
    linear = "linear"
    constant = "constant"


@dataclass
class ScheduleConfig:
    name: ScheduleName = ScheduleName.nvidia_poly
    warmup_steps: int = 0
    power: float = 0.5  # nvidia_poly
    warmup_power: float = 2.0  # deepspeed_ee
    decay_rate: float = 0.9  # deepspeed_ee
    decay_steps: int = 250  # deepspeed_ee
    lr_offset: float = 0.0  # deepspeed_ee: absolute LR added to the schedule

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError("schedule.warmup_steps must be >= 0")
        if self.decay_steps < 1:
            raise ValueError("schedule.decay_steps must be >= 1")
        if not 0.0 < self.decay_rate <= 1.0:
            raise ValueError("schedule.decay_rate must be in (0, 1]")


def nvidia_poly_factor(step: int, *, warmup_steps: int, total_steps: int, power: float) -> float:
    if step < warmup_steps:
        return step / warmup_steps
    return max(0.0, 1.0 - step / total_steps) ** power


def deepspeed_ee_factor(
    step: int, *, warmup_steps: int, warmup_power: float, decay_rate: float, decay_steps: int, offset: float
) -> float:
    if step < warmup_steps:
        return (step / warmup_steps) ** warmup_power + offset
    return decay_rate ** ((step - warmup_steps) / decay_steps) + offset


def build_scheduler(optimizer: Optimizer, cfg: ScheduleConfig, total_steps: int) -> LambdaLR:
    """A scheduler over `total_steps` optimizer steps of one phase; the peak LR is the optimizer's."""
    name = ScheduleName(cfg.name)
    if name is ScheduleName.linear:
        return get_linear_schedule_with_warmup(optimizer, cfg.warmup_steps, total_steps)
    if name is ScheduleName.constant:
        return get_constant_schedule_with_warmup(optimizer, cfg.warmup_steps)
    if name is ScheduleName.nvidia_poly:
        factor = partial(
            nvidia_poly_factor, warmup_steps=cfg.warmup_steps, total_steps=total_steps, power=cfg.power
        )
        return LambdaLR(optimizer, factor)
    peak = optimizer.param_groups[0]["lr"]
    factor = partial(
        deepspeed_ee_factor,
        warmup_steps=cfg.warmup_steps,
        warmup_power=cfg.warmup_power,
        decay_rate=cfg.decay_rate,
        decay_steps=cfg.decay_steps,
        offset=cfg.lr_offset / peak if peak > 0 else 0.0,
    )
    return LambdaLR(optimizer, factor)


def legw_scale(base_batch: int, base_lr: float, batch: int) -> float:
    """LEGW: when the batch grows k x, the peak LR grows √k x (warmup iterations unchanged)."""
    return base_lr * math.sqrt(batch / base_batch)
