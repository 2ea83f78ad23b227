"""1-bit Adam on one process (spec §4): warmup numbers, frozen-v compression, masks, overflow, resume."""

from __future__ import annotations

import copy

import pytest
import torch

from pretrain.optim import OnebitAdam, Stage


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(10, 6), torch.nn.Linear(6, 8), torch.nn.Linear(8, 3))


def _groups(model: torch.nn.Module, mask_rows: int | None = None) -> list[dict]:
    embedding, *rest = model.parameters()
    group = {"params": [embedding], "weight_decay": 0.01}
    if mask_rows is not None:
        group["exp_avg_mask"] = (torch.arange(10) < mask_rows).float().unsqueeze(1)
    return [
        {"params": [p for p in rest if p.dim() > 1]},
        {"params": [p for p in rest if p.dim() == 1], "weight_decay": 0.0},
        group,
    ]


def _run(model, opt, steps) -> None:
    for step in steps:
        generator = torch.Generator().manual_seed(500 + step)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=generator)
        opt.step()


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_warmup_step_numbers():
    p = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    opt = OnebitAdam([p], lr=0.01, weight_decay=0.01, freeze_step=10)
    p.grad = torch.ones(2)
    opt.step()
    # m = 0.1, v = 0.001, no bias correction: m/(√v+ε) = 3.162277; p ← p − η(3.162277 + λp)
    torch.testing.assert_close(p.detach(), torch.tensor([2.968077, 3.967977]), atol=2e-6, rtol=0)


def test_compression_with_one_rank_is_adam_with_frozen_variance():
    freeze_step, model, reference = 3, _model(), _model()
    opt = OnebitAdam(_groups(model), lr=0.01, freeze_step=freeze_step, weight_decay=0.01)
    _run(model, opt, range(freeze_step))
    assert not opt.needs_gradient_allreduce and opt.stage is Stage.compression
    assert len(opt._segments) == 3  # one fused buffer (and compressor) per param group
    frozen = [opt.state[p]["exp_avg_sq"].clone() for p in model.parameters()]
    _run(model, opt, range(freeze_step, freeze_step + 4))
    assert all(torch.equal(a, opt.state[p]["exp_avg_sq"]) for a, p in zip(frozen, model.parameters()))
    # reference: plain per-tensor Adam without bias correction, v frozen after freeze_step
    state = {}
    for t in range(freeze_step + 4):
        generator = torch.Generator().manual_seed(500 + t)
        grads = {p: torch.randn(p.shape, generator=generator) for p in reference.parameters()}
        for group in _groups(reference):
            for p in group["params"]:
                g = grads[p]
                m, v = state.get(p, (torch.zeros_like(p), torch.zeros_like(p)))
                m = 0.9 * m + 0.1 * g
                v = 0.999 * v + 0.001 * g * g if t < freeze_step else v
                state[p] = (m, v)
                with torch.no_grad():
                    p -= 0.01 * (m / (v.sqrt() + 1e-8) + group.get("weight_decay", 0.01) * p)
    for actual, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(actual.detach(), expected.detach(), rtol=1e-5, atol=1e-6)


def test_mask_zeroes_momentum_rows_in_the_compression_stage():
    model = _model()
    opt = OnebitAdam(_groups(model, mask_rows=4), freeze_step=2)
    _run(model, opt, range(5))
    momentum = opt.state[next(iter(model.parameters()))]["exp_avg"]
    assert momentum[4:].abs().max() == 0 and momentum[:4].abs().max() > 0


@pytest.mark.parametrize("steps_before", [1, 3])
def test_overflow_skips_without_touching_state(steps_before):
    model = _model()
    opt = OnebitAdam(_groups(model), freeze_step=2)
    _run(model, opt, range(steps_before))
    params, state = _params(model), copy.deepcopy(opt.state_dict()["state"])
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    list(model.parameters())[1].grad[0, 0] = float("inf")
    opt.step()
    assert opt.last_step_skipped and opt.num_skipped_steps == 1 and opt.step_count == steps_before
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    after = opt.state_dict()["state"]
    assert all(torch.equal(v, after[i][k]) for i, s in state.items() for k, v in s.items())


@pytest.mark.parametrize("save_after", [1, 4])
def test_resume_continues_bitwise(save_after):
    model = _model()
    opt = OnebitAdam(_groups(model, mask_rows=4), freeze_step=2)
    _run(model, opt, range(save_after))
    twin = _model()
    twin.load_state_dict(model.state_dict())
    resumed = OnebitAdam(_groups(twin, mask_rows=4), freeze_step=2)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    _run(model, opt, range(save_after, 7))
    _run(twin, resumed, range(save_after, 7))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
