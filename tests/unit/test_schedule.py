"""LR schedules of the recipes (pretrain/optim/schedule.py) against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from pretrain.optim.schedule import ScheduleConfig, ScheduleName, build_scheduler, legw_scale


def lrs(cfg: ScheduleConfig, total: int, peak: float, steps: list[int]) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    scheduler = build_scheduler(optimizer, cfg, total)
    seen = []
    for _ in range(max(steps) + 1):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return [seen[s] for s in steps]


def test_nvidia_poly_warmup_then_sqrt_decay():
    cfg = ScheduleConfig(name=ScheduleName.nvidia_poly, warmup_steps=2000, power=0.5)
    got = lrs(cfg, 7038, 6e-3, [0, 1000, 2000, 5000, 7037])
    expected = [
        0.0,
        3e-3,
        6e-3 * math.sqrt(1 - 2000 / 7038),
        6e-3 * math.sqrt(1 - 5000 / 7038),
        6e-3 * math.sqrt(1 / 7038),
    ]
    assert got == pytest.approx(expected, rel=1e-9)


def test_deepspeed_ee_quadratic_warmup_exponential_decay_and_offset():
    cfg = ScheduleConfig(
        name=ScheduleName.deepspeed_ee, warmup_steps=450, decay_rate=0.9, decay_steps=250, lr_offset=1e-3
    )
    got = lrs(cfg, 6150, 11e-3, [0, 225, 450, 700])
    expected = [1e-3, 11e-3 * 0.25 + 1e-3, 12e-3, 11e-3 * 0.9 + 1e-3]
    assert got == pytest.approx(expected, rel=1e-9)


def test_linear_and_constant_come_from_transformers():
    linear = lrs(ScheduleConfig(name=ScheduleName.linear, warmup_steps=10), 110, 1.0, [5, 10, 60, 110])
    assert linear == pytest.approx([0.5, 1.0, 0.5, 0.0])
    constant = lrs(ScheduleConfig(name=ScheduleName.constant, warmup_steps=4), 100, 2.0, [2, 4, 90])
    assert constant == pytest.approx([1.0, 2.0, 2.0])


def test_legw_scales_lr_with_sqrt_batch():
    assert legw_scale(65536, 6e-3, 16384) == pytest.approx(3e-3)


def test_bad_schedule_values_name_the_key():
    with pytest.raises(ValueError, match=r"schedule\.decay_steps"):
        ScheduleConfig(decay_steps=0)
