"""The preconditioned momentum exchange (`precondition=True`, pretrain/optim/onebit.py): workers send
m/(√v+ε) with v frozen and the average is multiplied back.

- With a constant v it changes nothing (the mean-|y| quantizer is positively homogeneous per segment),
  so the option only moves where the compression error falls.
- With gradients whose columns differ in size by orders of magnitude (the hidden-state outlier
  dimensions of a transformer), the averaged momentum it delivers is closer to the exact average in the
  units of the step, u = m/(√v+ε), than the plain exchange's, over a run of compression steps.
Bitwise equality with real ranks and bitwise resume are in tests/distributed/test_virtual_workers.py
(the `preconditioned` configs).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launcher import run_distributed

pytestmark = pytest.mark.distributed

WORKERS, ROWS, COLS, BETA1, EPS = 4, 24, 32, 0.9, 1e-8


def _gradient(worker: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(97 * step + worker)
    column_sizes = torch.logspace(-3, 1, COLS)  # four orders of magnitude across the columns
    common = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(step))
    return column_sizes * (common + 0.5 * torch.randn(ROWS, COLS, generator=generator))


def _run(precondition: bool, constant_variance: bool, steps: int) -> dict:
    from pretrain.optim import OnebitLamb

    weight = torch.nn.Parameter(torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(0)))
    optimizer = OnebitLamb(
        [{"params": [weight], "weight_decay": 0.0}],
        lr=1e-3,
        freeze_step=2,
        coeff_beta=0.5,
        betas=(BETA1, 0.999),
        eps=EPS,
        compression="per_tensor",
        sign_scale="mean_abs",
        trust_ratio="live",
        virtual_workers=WORKERS,
        precondition=precondition,
    )
    errors, momenta = [], []
    for step in range(2 + steps):
        if optimizer.needs_gradient_allreduce:
            weight.grad = torch.stack([_gradient(w, step) for w in range(WORKERS)]).mean(0)
            optimizer.step()
            if constant_variance and not optimizer.needs_gradient_allreduce:
                optimizer.state[weight]["exp_avg_sq"].fill_(0.3)
            continue
        state = optimizer.state[weight]
        grads = [_gradient(w, step) for w in range(WORKERS)]
        exact = BETA1 * state["exp_avg"] + (1 - BETA1) * torch.stack(grads).mean(0)
        for w, grad in enumerate(grads):
            optimizer.worker_gradient_views(w)[0].copy_(grad)
        weight.grad = None
        optimizer.step()
        divisor = state["exp_avg_sq"].sqrt() + EPS
        errors.append(float(((state["exp_avg"] - exact) / divisor).norm() / (exact / divisor).norm()))
        momenta.append(state["exp_avg"].clone())
    return {
        "errors": errors,
        "momenta": momenta,
        "error_norm": optimizer.statistics()["compression_error_norm"],
    }


def _compare(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    plain, preconditioned = (_run(flag, True, 3) for flag in (False, True))
    pairs = list(zip(plain["momenta"], preconditioned["momenta"]))
    return {  # plain Python values: tensors do not outlive the worker process
        "constant_max_difference": max(float((a - b).abs().max()) for a, b in pairs),
        "constant_max_value": max(float(a.abs().max()) for a, _ in pairs),
        "constant_error_norms": [plain["error_norm"], preconditioned["error_norm"]],
        "outliers": [_run(flag, False, 30)["errors"] for flag in (False, True)],
    }


def test_preconditioned_exchange():
    results = run_distributed(_compare, 1, ())[0]
    assert results["constant_max_difference"] <= 1e-5 * results["constant_max_value"], results
    # the logged error norm is in momentum units either way (the preconditioned buffer holds units of u)
    plain_norm, preconditioned_norm = results["constant_error_norms"]
    assert preconditioned_norm == pytest.approx(plain_norm, rel=1e-4)
    plain_errors, preconditioned_errors = results["outliers"]
    plain_mean = sum(plain_errors[10:]) / 20
    preconditioned_mean = sum(preconditioned_errors[10:]) / 20
    # the plain exchange's sign scale is set by the large columns; in u units the small ones are noise
    assert preconditioned_mean < 0.6 * plain_mean, (plain_mean, preconditioned_mean)
