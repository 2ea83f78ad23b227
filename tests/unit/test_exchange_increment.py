"""`optim.exchange_increment`: 1-bit LAMB's exchange carries the momentum's increment (1−β1)·g_w and every
rank adds the replicated β1·m̂ₜ₋₁ back. With one worker (no exchange) it is the default's step to the
rounding; with 8 virtual workers the averaged momentum stays far closer to the exact average of the workers'
local momenta (β1·m̂ₜ₋₁ + (1−β1)·ḡ: what the default's exchange compresses whole) than the default's does;
the option is refused where it cannot apply."""

from __future__ import annotations

import pytest
import torch

from pretrain.observability.diagnostics import Diagnostics
from pretrain.optim import OnebitLamb
from pretrain.optim.config import OnebitLambConfig

BETA1 = 0.9
FREEZE = 20  # warmup steps: v is the mean square of 20 averaged gradients when the compression starts


def _setup(
    increment: bool, workers: int, shape: tuple[int, int] = (48, 64)
) -> tuple[torch.nn.Linear, OnebitLamb]:
    torch.manual_seed(0)
    model = torch.nn.Linear(shape[1], shape[0], bias=False)
    config = OnebitLambConfig(
        freeze_step=FREEZE, lr=0.01, max_grad_norm=0.0, variance_refresh=0, exchange_increment=increment
    )
    return model, OnebitLamb(model.parameters(), virtual_workers=workers, **config.optimizer_kwargs())


def _gradient(step: int, worker: int, shape: torch.Size) -> torch.Tensor:
    """A fixed signal and each worker's own noise, 2× the signal (small per-worker batches)."""
    signal = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(1000 * step + worker))
    return 1e-2 * (signal + 2.0 * noise)


def _cosines(increment: bool, workers: int, steps: int) -> list[float]:
    """Per compression step: cos(m̂ₜ, β1·m̂ₜ₋₁ + (1−β1)·ḡₜ), ḡ the workers' mean gradient."""
    model, optimizer = _setup(increment, workers)
    for step in range(FREEZE):  # the warmup: the workers' gradients averaged exactly
        model.weight.grad = torch.stack(
            [_gradient(step, w, model.weight.shape) for w in range(workers)]
        ).mean(0)
        optimizer.step()
    cosines = []
    for step in range(FREEZE, FREEZE + steps):
        grads = [_gradient(step, worker, model.weight.shape) for worker in range(workers)]
        for worker, grad in enumerate(grads):
            (view,) = optimizer.worker_gradient_views(worker)
            view.copy_(grad)
        previous = optimizer.state[model.weight]["exp_avg"].clone()
        optimizer.step()
        exact = BETA1 * previous + (1 - BETA1) * torch.stack(grads).mean(0)
        averaged = optimizer.state[model.weight]["exp_avg"]
        cosines.append(
            float(torch.nn.functional.cosine_similarity(averaged.flatten(), exact.flatten(), dim=0))
        )
    return cosines


def test_the_increment_keeps_the_averaged_momentum_close_to_the_exact_one():
    for workers in (2, 8):
        increment = _cosines(True, workers, 40)[5:]
        momentum = _cosines(False, workers, 40)[5:]  # the sign error of the whole momentum, every step
        assert min(increment) > 0.98 > 0.94 > max(momentum), (workers, increment, momentum)


def test_one_worker_steps_as_the_default():
    """No exchange: β1·m̂ + (1−β1)·g formed in two parts is the default's local momentum to the rounding."""
    results = []
    for increment in (False, True):
        model, optimizer = _setup(increment, 1)
        for step in range(FREEZE + 6):
            model.weight.grad = _gradient(step, 0, model.weight.shape)
            optimizer.step()
        results.append((model.weight.detach().clone(), optimizer.state[model.weight]["exp_avg"].clone()))
    (weight, momentum), (weight_inc, momentum_inc) = results
    torch.testing.assert_close(momentum_inc, momentum, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(weight_inc, weight, rtol=1e-6, atol=1e-9)


def test_the_option_is_refused_where_it_cannot_apply():
    with pytest.raises(ValueError, match=r"optim\.exchange_increment needs compile=false"):
        OnebitLambConfig(exchange_increment=True, compile=True)
    model = torch.nn.Linear(4, 3)
    with pytest.raises(ValueError, match="exchange_increment needs trust_ratio='live'"):
        OnebitLamb(model.parameters(), exchange_increment=True)  # DeepSpeed's algorithm: the frozen ratio


def test_the_diagnostics_compare_whole_momenta():
    """The probe's fidelity with the increment exchanged: the averaged momentum m̂ₜ against the exact
    β1·m̂ₜ₋₁ + (1−β1)·ḡ (the carried part added to both sides), as it compares the default's."""
    model, optimizer = _setup(True, 8)
    for step in range(FREEZE):
        model.weight.grad = torch.stack([_gradient(step, w, model.weight.shape) for w in range(8)]).mean(0)
        optimizer.step()
    diagnostics = Diagnostics(model, optimizer, None)
    grads = [_gradient(FREEZE, worker, model.weight.shape) for worker in range(8)]
    for worker, grad in enumerate(grads):
        (view,) = optimizer.worker_gradient_views(worker)
        view.copy_(grad)
    previous = optimizer.state[model.weight]["exp_avg"].clone()
    diagnostics.begin_step(active=True)
    optimizer.step()
    metrics = diagnostics.end_step(skipped=False)
    exact = BETA1 * previous + (1 - BETA1) * torch.stack(grads).mean(0)
    averaged = optimizer.state[model.weight]["exp_avg"]
    cosine = torch.nn.functional.cosine_similarity(averaged.flatten(), exact.flatten(), dim=0)
    assert metrics["diag/fidelity_cos/pooler_nsp"] == pytest.approx(float(cosine), abs=1e-5)
    assert metrics["diag/fidelity_cos/pooler_nsp"] > 0.98  # not the increment's own ~0.6–0.8
