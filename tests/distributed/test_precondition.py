"""The preconditioned momentum exchange (`precondition=True`, pretrain/optim/onebit.py): workers send
m/(√v+ε) with v frozen and the average is multiplied back.

- With a constant v it changes nothing (the mean-|y| quantizer is positively homogeneous per segment),
  so the option only moves where the compression error falls.
- With gradients whose columns differ in size by orders of magnitude (the hidden-state outlier
  dimensions of a transformer), the averaged momentum it delivers is closer to the exact average in the
  units of the step, u = m/(√v+ε), than the plain exchange's, over a run of compression steps.
- `per_column` (one scale per input column of every matrix, exchanged transposed) delivers momenta
  whose columns each have one magnitude exactly, where one scale per tensor cannot; preconditioned, its
  logged error norm (error buffers in the transposed layout) is still in momentum units.
Bitwise equality with real ranks and bitwise resume are in tests/distributed/test_virtual_workers.py
(the `preconditioned` and `per_column` configs).
"""

from __future__ import annotations

import pytest
import torch

from pretrain.optim.onebit_lamb import DEEPSPEED_ALGORITHM
from tests.distributed.launcher import run_distributed

pytestmark = pytest.mark.distributed

WORKERS, ROWS, COLS, BETA1, EPS = 4, 24, 32, 0.9, 1e-8


def _gradient(worker: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(97 * step + worker)
    column_sizes = torch.logspace(-3, 1, COLS)  # four orders of magnitude across the columns
    common = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(step))
    return column_sizes * (common + 0.5 * torch.randn(ROWS, COLS, generator=generator))


def _column_gradient(worker: int, step: int) -> torch.Tensor:
    """The same on every worker: fixed signs, one magnitude per column that changes with the step, so the
    momentum's columns each keep one magnitude."""
    signs = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(5)).sign()
    return signs * torch.logspace(-3, 1, COLS) * (1.0 + 0.1 * step)


def _run(
    precondition: bool,
    constant_variance: bool,
    steps: int,
    compression: str = "deepspeed",
    gradient=_gradient,
) -> dict:
    from pretrain.optim import OnebitLamb

    weight = torch.nn.Parameter(torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(0)))
    optimizer = OnebitLamb(
        [{"params": [weight], "weight_decay": 0.0}],
        lr=0.001,
        freeze_step=2,
        coeff_beta=0.5,
        betas=(BETA1, 0.999),
        eps=EPS,
        virtual_workers=WORKERS,
        algorithm=DEEPSPEED_ALGORITHM.replace(
            compression=compression, sign_scale="mean_abs", trust_ratio="live", precondition=precondition
        ),
    )
    errors, momenta = [], []
    for step in range(2 + steps):
        if optimizer.needs_gradient_allreduce:
            weight.grad = torch.stack([gradient(w, step) for w in range(WORKERS)]).mean(0)
            optimizer.step()
            if constant_variance and not optimizer.needs_gradient_allreduce:
                optimizer.state[weight]["exp_avg_sq"].fill_(0.3)
            continue
        state = optimizer.state[weight]
        grads = [gradient(w, step) for w in range(WORKERS)]
        exact = BETA1 * state["exp_avg"] + (1 - BETA1) * torch.stack(grads).mean(0)
        for w, grad in enumerate(grads):
            optimizer.worker_gradient_views(w)[0].copy_(grad)
        weight.grad = None
        optimizer.step()
        divisor = state["exp_avg_sq"].sqrt() + EPS
        errors.append(float(((state["exp_avg"] - exact) / divisor).norm() / (exact / divisor).norm()))
        if gradient is _column_gradient:  # the momentum's own error, in momentum units
            errors[-1] = float((state["exp_avg"] - exact).norm() / exact.norm())
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


def _columns(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    constant = [_run(flag, True, 3, "per_column") for flag in (False, True)]
    return {
        "column_errors": {
            compression: max(_run(False, False, 5, compression, _column_gradient)["errors"])
            for compression in ("per_column", "deepspeed")
        },
        "constant_max_difference": max(
            float((a - b).abs().max()) for a, b in zip(constant[0]["momenta"], constant[1]["momenta"])
        ),
        "constant_max_value": max(float(a.abs().max()) for a in constant[0]["momenta"]),
        "constant_error_norms": [run["error_norm"] for run in constant],
    }


def test_per_column_scales():
    results = run_distributed(_columns, 1, ())[0]
    errors = results["column_errors"]
    # one magnitude per column: per-column scales deliver it exactly, DeepSpeed's one scale per chunk cannot
    assert errors["per_column"] < 1e-6, errors
    assert errors["deepspeed"] > 0.1, errors
    assert results["constant_max_difference"] <= 1e-5 * results["constant_max_value"], results
    plain_norm, preconditioned_norm = results["constant_error_norms"]
    assert plain_norm > 0
    assert preconditioned_norm == pytest.approx(plain_norm, rel=1e-4)


@pytest.mark.slow
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


def _divisor_run(rank: int, world_size: int) -> dict:
    """Two real ranks, per-column scales, the 1-D tensor's variance live and the matrices' refreshed every
    2 steps: after every compression step the divisors the live step divides by (instead of rooting v
    again) must be √v+ε of the current v, bit for bit."""
    from pretrain.optim import OnebitLamb

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(ROWS, COLS, generator=generator))
    bias = torch.nn.Parameter(torch.randn(COLS, generator=generator))
    optimizer = OnebitLamb(
        [weight, bias],
        lr=0.001,
        freeze_step=2,
        betas=(BETA1, 0.999),
        eps=EPS,
        variance_refresh=2,
        algorithm=DEEPSPEED_ALGORITHM.replace(
            compression="per_column",
            sign_scale="mean_abs",
            trust_ratio="live",
            precondition=True,
            exact_vectors=True,
            live_vector_variance=True,
        ),
    )
    mismatches, steps = [], 0
    for step in range(9):
        averaged = optimizer.needs_gradient_allreduce
        for p in (weight, bias):
            workers = [
                _gradient(w, step)[: p.shape[0]] if p.dim() == 2 else _gradient(w, step)[0] for w in range(2)
            ]
            p.grad = torch.stack(workers).mean(0) if averaged else workers[rank].clone()
        optimizer.step()
        if averaged:
            continue
        steps += 1
        (segment,) = optimizer._segments
        for p, divisor in zip(segment.params, segment.divisors):
            expected = optimizer.state[p]["exp_avg_sq"].sqrt().add_(EPS)
            mismatches += [] if torch.equal(divisor, expected) else [(step, tuple(p.shape))]
    return {"mismatches": mismatches, "compression_steps": steps, "weight": weight.detach().clone().tolist()}


@pytest.mark.slow
def test_the_divisors_follow_the_variance():
    results = run_distributed(_divisor_run, 2, ())
    for result in results:
        assert result["compression_steps"] >= 6 and result["mismatches"] == [], result["mismatches"]
    assert results[0]["weight"] == results[1]["weight"]  # the ranks stay in step
