"""`optim.refresh_unbiased`: 1-bit LAMB's variance refresh estimates the global batch's mean square (μ² plus
the global batch's noise) instead of each worker's (μ² plus n times that noise). Two virtual workers whose
gradients are μ ± δ with opposite signs (their average is μ exactly) and alternate sign every step (so
g_t ⊙ g_(t−1) = μ² − δ² and the workers' g² = μ² + δ², and with n = 2 the estimate (μ² + δ²)/2 +
(μ² − δ²)/2 is μ² to the rounding): the refresh folds μ² into v, where the plain refresh folds μ² + δ². A
resumed run equals an uninterrupted one, and the option without a refresh is refused by name."""

from __future__ import annotations

import pytest
import torch

from pretrain.optim import OnebitLamb
from pretrain.optim.config import OnebitLambConfig

K = 4  # refresh every 4th compression step


def _setup(unbiased: bool) -> tuple[torch.nn.Module, OnebitLamb]:
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 5, bias=False)
    config = OnebitLambConfig(
        freeze_step=1, lr=0.01, max_grad_norm=0.0, variance_refresh=K, refresh_unbiased=unbiased
    )
    return model, OnebitLamb(model.parameters(), virtual_workers=2, **config.optimizer_kwargs())


MU = torch.outer(torch.linspace(0.5, 1.5, 5), torch.linspace(-1.0, 2.0, 6)) * 1e-2  # rank 1: μ² is too
# |δ| < |μ| everywhere, so no row's sum of g_t ⊙ g_(t−1) = μ² − δ² is clamped at 0
DELTA = 0.8 * MU * torch.randn(5, 6, generator=torch.Generator().manual_seed(1)).sign()


def _step(model: torch.nn.Module, optimizer: OnebitLamb, step: int, random: bool = False) -> None:
    """`random`: each worker's noise drawn afresh every step instead of ±δ."""
    if step == 0:  # the warmup step: the averaged gradient
        model.weight.grad = MU.clone()
    else:
        for worker in range(2):
            (view,) = optimizer.worker_gradient_views(worker)
            generator = torch.Generator().manual_seed(2 * step + worker)
            sign = (-1) ** (worker + step)
            noise = torch.randn(MU.shape, generator=generator) * 1e-2 if random else sign * DELTA
            view.copy_(MU + noise)
    optimizer.step()


def _refreshes(unbiased: bool, steps: int, monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.Tensor, ...]]:
    """(v before, v after) at every refresh."""
    model, optimizer = _setup(unbiased)
    seen = []
    original = OnebitLamb._refresh_rank1

    def refresh(self, segment):
        before = self.state[model.weight]["exp_avg_sq"].clone()
        original(self, segment)
        seen.append((before, self.state[model.weight]["exp_avg_sq"].clone()))

    with monkeypatch.context() as patch:
        patch.setattr(OnebitLamb, "_refresh_rank1", refresh)
        for step in range(steps):
            _step(model, optimizer, step)
    return seen


def _folded(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """The estimate the refresh folded in: after = β2^K·before + (1 − β2^K)·estimate."""
    weight = 1.0 - 0.999**K
    return (after - (1.0 - weight) * before) / weight


def test_the_unbiased_refresh_folds_the_global_batch_mean_square(monkeypatch):
    unbiased = _refreshes(True, 2 * K + 2, monkeypatch)
    plain = _refreshes(False, 2 * K + 2, monkeypatch)
    assert len(unbiased) == len(plain) == 2
    for before, after in unbiased:  # the first window has K − 1 products, the second K: both exact
        torch.testing.assert_close(_folded(before, after), MU**2, rtol=2e-3, atol=1e-12)
    # the plain refresh: the workers' own mean square μ² + δ², rank-1 projected
    square = MU**2 + DELTA**2
    expected = torch.outer(square.sum(1), square.sum(0)) / square.sum()
    before, after = plain[-1]
    torch.testing.assert_close(_folded(before, after), expected, rtol=2e-3, atol=1e-12)
    assert not torch.allclose(expected, MU**2, rtol=0.5)  # 1.64 μ²


def test_a_resumed_run_equals_an_uninterrupted_one():
    model, optimizer = _setup(True)
    for step in range(2 * K + 3):
        _step(model, optimizer, step, random=True)
    straight = model.weight.detach().clone()

    model, optimizer = _setup(True)
    for step in range(K + 2):  # stopped inside the second window: its sums and the last gradients saved
        _step(model, optimizer, step, random=True)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved = optimizer.state_dict()
    assert saved["extra"]["lag_steps"] > 0 and saved["extra"]["previous_grads"].abs().sum() > 0
    model, optimizer = _setup(True)
    model.load_state_dict(saved_model)
    optimizer.load_state_dict(saved)
    for step in range(K + 2, 2 * K + 3):
        _step(model, optimizer, step, random=True)
    assert torch.equal(model.weight.detach(), straight)


def test_without_a_refresh_it_is_refused_by_name():
    with pytest.raises(ValueError, match=r"optim\.refresh_unbiased"):
        OnebitLambConfig(variance_refresh=0, refresh_unbiased=True)
    with pytest.raises(ValueError, match="refresh_unbiased needs variance_refresh"):
        OnebitLamb(torch.nn.Linear(2, 2).parameters(), refresh_unbiased=True)
