"""1-bit LAMB's live trust-ratio step in numba against the torch path (`clamped_trust_ratio_step_`):
rooted divisors or v, with and without weight decay, row- and column-major, zero tensors, clamping;
deterministic; and where it does not apply it changes nothing and says so (None)."""

from __future__ import annotations

import pytest
import torch

from pretrain.comm.kernels import numba_unavailable_reason
from pretrain.optim import functional as F
from pretrain.optim.live_step import live_trust_ratio_step_

pytestmark = pytest.mark.skipif(numba_unavailable_reason() is not None, reason="numba unavailable")

SHAPES = [(37, 11), (5000,), (64, 300), (1,)]


def _tensors(column_major: bool, seed: int = 0) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)

    def make(shape, scale, positive=False):
        if column_major and len(shape) == 2:
            values = torch.randn(shape[::-1], generator=generator).t()
        else:
            values = torch.randn(shape, generator=generator)
        return (values.abs() + 0.1 if positive else values) * scale

    params = [make(s, 0.02) for s in SHAPES]
    params[3].zero_()  # a zero parameter: ratio 1
    return [params, [make(s, 1e-3) for s in SHAPES], [make(s, 1e-3, positive=True) for s in SHAPES]]


@pytest.mark.parametrize("column_major", [False, True])
@pytest.mark.parametrize("rooted", [False, True])
@pytest.mark.parametrize(
    "weight_decay,bounds", [(0.01, (0.0, 10.0)), (0.0, (0.5, 2.0)), (0.01, (0.01, 0.05))]
)
def test_numba_step_matches_the_torch_path(column_major, rooted, weight_decay, bounds):
    options = dict(lr=0.1, eps=1e-6, weight_decay=weight_decay, min_coeff=bounds[0], max_coeff=bounds[1])
    fused, reference = _tensors(column_major), _tensors(column_major)
    coeffs = live_trust_ratio_step_(*fused, **options, rooted=rooted)
    want = F.clamped_trust_ratio_step_(*reference, **options, rooted=rooted)
    assert coeffs is not None
    torch.testing.assert_close(coeffs, want, rtol=1e-5, atol=0)
    assert coeffs[3] == 1.0  # the zero parameter
    for actual, expected, before in zip(fused[0], reference[0], _tensors(column_major)[0]):
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-8)  # u: m/d vs m·(1/d)
        assert actual.stride() == before.stride()
    assert not any(torch.equal(a, b) for a, b in zip(fused[0], _tensors(column_major)[0]))  # all stepped


def test_same_bits_every_time():
    first, second = _tensors(False), _tensors(False)
    options = dict(lr=0.1, eps=1e-6, weight_decay=0.01, min_coeff=0.0, max_coeff=10.0, rooted=True)
    a, b = live_trust_ratio_step_(*first, **options), live_trust_ratio_step_(*second, **options)
    assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(first[0], second[0]))


@pytest.mark.parametrize("case", ["mixed_layout", "float64"])
def test_declines_what_it_cannot_take_and_changes_nothing(case):
    params, exp_avgs, divisors = _tensors(False)
    if case == "mixed_layout":
        exp_avgs[0] = exp_avgs[0].t().contiguous().t()  # column-major momentum, row-major parameter
    else:
        params, exp_avgs, divisors = ([t.double() for t in ts] for ts in (params, exp_avgs, divisors))
    before = [p.clone() for p in params]
    options = dict(lr=0.1, eps=1e-6, weight_decay=0.01, min_coeff=0.0, max_coeff=10.0, rooted=True)
    assert live_trust_ratio_step_(params, exp_avgs, divisors, **options) is None
    assert all(torch.equal(p, b) for p, b in zip(params, before))


def test_onebit_lamb_takes_it_in_the_compression_stage(monkeypatch):
    from pretrain.optim import OnebitLamb
    from pretrain.optim import onebit_lamb as module

    results = []
    real = module.live_trust_ratio_step_
    monkeypatch.setattr(
        module, "live_trust_ratio_step_", lambda *a, **k: results.append(real(*a, **k)) or results[-1]
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Linear(12, 3))
    optimizer = OnebitLamb(model.parameters(), freeze_step=2, trust_ratio="live")
    for _ in range(4):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
    assert len(results) == 2 and all(r is not None and r.shape == (4,) for r in results)
