"""The compiled compression step's kernels (pretrain/optim/compiled.py) against the eager foreach functions.

Run eagerly here (no compilation: the compiled runs, at 2 and 3 processes, are in
tests/distributed/test_compiled_step.py), the per-tensor kernels must compose to the eager step: local
momentum, division by √v+ε into the exchange layout (transposed for per-column matrices), the exchange
(identity here), multiplication back, LAMB's clamped trust-ratio step. Tolerance: float rounding (the
kernels compute the same formulas; the eager ones round (m/d)·d/d where the kernels use the same values).
"""

from __future__ import annotations

import pytest
import torch

from pretrain.optim import OnebitLamb
from pretrain.optim import functional as F
from pretrain.optim.compiled import transpose_into_, unsupported_reason
from pretrain.optim.onebit_lamb import DEEPSPEED_ALGORITHM

BETA1, LR, WD, EPS, MAX_COEFF = 0.9, 0.01, 0.01, 1e-8, 10.0


def _tensors(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    param = torch.randn(shape, generator=generator)
    grad = torch.randn(shape, generator=generator) * 1e-2
    exp_avg = torch.randn(shape, generator=generator) * 1e-2
    exp_avg_sq = torch.rand(shape, generator=generator) * 1e-4
    return param, grad, exp_avg, exp_avg_sq


@pytest.mark.parametrize(("shape", "transposed"), [((6, 10), True), ((6, 10), False), ((7,), False)])
@pytest.mark.parametrize("weight_decay", [WD, 0.0])
def test_kernels_compose_to_the_eager_step(shape, transposed, weight_decay):
    param, grad, exp_avg, exp_avg_sq = _tensors(shape, 3)
    divisor = exp_avg_sq.sqrt() + EPS
    # eager: m ← β1·m + (1−β1)·g; x = m/d; (exchange = identity); m ← x·d; clamped trust-ratio step
    eager_p, eager_m = param.clone(), exp_avg.clone()
    F.local_momentum_([eager_m], [grad], beta1=BETA1)
    eager_m.copy_(eager_m / divisor * divisor)
    eager_ratio = F.clamped_trust_ratio_step_(
        [eager_p], [eager_m], [exp_avg_sq], lr=LR, eps=EPS, weight_decay=weight_decay, min_coeff=0.0,
        max_coeff=MAX_COEFF,
    )  # fmt: skip
    # kernels
    scalars = F.live_scalars(
        beta1=BETA1, lr=LR, weight_decay=weight_decay, min_coeff=0.0, max_coeff=MAX_COEFF, device="cpu"
    )
    p, m = param.clone(), exp_avg.clone()
    sent = torch.empty(shape[::-1] if transposed else shape)
    if transposed:  # x into m itself (the exchange replaces m), then transposed into the exchange layout
        F.preconditioned_momentum_(m, grad, divisor, m, scalars)
        transpose_into_(m, sent)
    else:
        F.preconditioned_momentum_(m, grad, divisor, sent, scalars)
        assert torch.equal(m, exp_avg)  # the local momentum is not written: the exchange replaces it
    expected_sent = (BETA1 * exp_avg + (1 - BETA1) * grad) / divisor
    torch.testing.assert_close(sent, expected_sent.t() if transposed else expected_sent)
    if transposed:
        transpose_into_(sent, m)
        coeffs = F.live_ratio(m, divisor, p, scalars)
        F.live_apply_(p, m, divisor, coeffs, scalars)
    else:
        before = m.clone()
        coeffs = F.live_ratio(m, divisor, p, scalars, sent)
        assert torch.equal(m, before)  # the ratio only reads: the apply stores m
        F.live_apply_(p, m, divisor, coeffs, scalars, sent)
    ratio = coeffs[0]
    torch.testing.assert_close(m, eager_m)
    torch.testing.assert_close(p, eager_p, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ratio, eager_ratio[0])


def test_ratio_is_one_where_a_norm_is_zero_and_capped_at_max_coeff():
    scalars = F.live_scalars(beta1=BETA1, lr=LR, weight_decay=0.0, min_coeff=0.0, max_coeff=2.0, device="cpu")
    zero_param, m, d = torch.zeros(4), torch.ones(4), torch.ones(4)
    assert F.live_ratio(m, d, zero_param, scalars)[0] == 1.0
    param = torch.full((4,), 5.0)
    coeffs = F.live_ratio(m, d, param, scalars)  # ‖p‖/‖u‖ = 10/2 = 5, capped at 2
    assert coeffs[0] == 2.0 and coeffs[1] == torch.tensor(LR, dtype=torch.float32) * 2.0
    F.live_apply_(param, m, d, coeffs, scalars)
    torch.testing.assert_close(param, torch.full((4,), 5.0 - LR * 2.0))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(trust_ratio="frozen", precondition=True), "live trust ratio"),
        (dict(trust_ratio="live", precondition=False), "precondition=true"),
        (dict(trust_ratio="live", precondition=True, workers=2), "one worker per process"),
    ],
)
def test_compile_refuses_what_it_cannot_run(options, message):
    workers = options.pop("workers", 1)
    algorithm = DEEPSPEED_ALGORITHM.replace(**options)
    with pytest.raises(ValueError, match=message):
        OnebitLamb(
            [torch.nn.Parameter(torch.ones(3))],
            freeze_step=2,
            compile=True,
            algorithm=algorithm,
            virtual_workers=workers,
        )


def test_unsupported_reason_none_for_the_default():
    assert unsupported_reason(trust_ratio_live=True, precondition=True, virtual_workers=1) is None


def test_the_live_step_from_the_divisors_is_the_same_step():
    """1-bit LAMB's eager live step divides by the exchange's divisors √v+ε instead of rooting v again."""
    generator = torch.Generator().manual_seed(3)
    shapes = [(64, 48), (48,), (7, 5)]
    params = [torch.randn(*s, generator=generator) for s in shapes]
    exp_avgs = [torch.randn(*s, generator=generator) for s in shapes]
    exp_avg_sqs = [torch.rand(*s, generator=generator) * 1e-4 for s in shapes]
    divisors = [v.sqrt().add_(1e-6) for v in exp_avg_sqs]
    hyper = dict(lr=0.01, eps=1e-6, weight_decay=0.01, min_coeff=0.01, max_coeff=0.3)
    from_v, from_divisors = [p.clone() for p in params], [p.clone() for p in params]
    ratios = F.clamped_trust_ratio_step_(from_v, exp_avgs, exp_avg_sqs, **hyper)
    rooted = F.clamped_trust_ratio_step_(from_divisors, exp_avgs, divisors, **hyper, rooted=True)
    assert torch.equal(ratios, rooted)
    assert all(torch.equal(a, b) for a, b in zip(from_v, from_divisors))
    assert not torch.equal(from_v[0], params[0])
