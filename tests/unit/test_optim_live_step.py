"""1-bit LAMB's live trust-ratio step in numba against the torch path (`clamped_trust_ratio_step_`):
rooted divisors or v, with and without weight decay, row- and column-major, zero tensors, clamping;
deterministic; and where it does not apply it changes nothing and says so (None). The loops around the
exchange: the momentum formed in units of u (one fused multiply-add and a division), the step from the
average ū, and 1-bit LAMB taking both and the same steps as without them."""

from __future__ import annotations

import pytest
import torch

from pretrain.comm.numba_support import numba_unavailable_reason
from pretrain.optim import functional as F
from pretrain.optim.live_step import live_trust_ratio_step_, local_momentum_, preconditioned_momentum_
from pretrain.optim.onebit_lamb import DEEPSPEED_ALGORITHM

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
    optimizer = OnebitLamb(
        model.parameters(), freeze_step=2, algorithm=DEEPSPEED_ALGORITHM.replace(trust_ratio="live")
    )
    for _ in range(4):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
    assert len(results) == 2 and all(r is not None and r.shape == (4,) for r in results)


# -- the loops around the exchange: the momentum into units of u, the average ū back ------------------------
def _torch_momentum(exp_avg, grad, divisor, beta1):
    out = exp_avg.clone()
    F.local_momentum_([out], [grad], beta1=beta1)
    return out.div_(divisor)


def _fma_momentum(exp_avg, grad, divisor, beta1):
    """(β1·m + (1−β1)·g)/d with the sum rounded once (float64 holds (1−β1)·g exactly; the sum is rounded
    twice, to float64 and to float32, which differs from once only in rare ties: none in these vectors)."""
    scaled = exp_avg * torch.tensor(beta1, dtype=torch.float32)
    weight = torch.tensor(1.0 - beta1, dtype=torch.float32).double()
    return (scaled.double() + weight * grad.double()).float() / divisor


@pytest.mark.parametrize("column_major", [False, True])
@pytest.mark.parametrize("into", ["exp_avg", "grad", "other"])
def test_preconditioned_momentum_is_one_fused_multiply_add_and_a_division(column_major, into):
    params, exp_avgs, divisors = _tensors(column_major)
    grads = _tensors(column_major, seed=1)[1]
    want = [_fma_momentum(m, g, d, 0.9) for m, g, d in zip(exp_avgs, grads, divisors)]
    torch_path = [_torch_momentum(m, g, d, 0.9) for m, g, d in zip(exp_avgs, grads, divisors)]
    outs = {"exp_avg": exp_avgs, "grad": grads, "other": [torch.empty_like(p) for p in params]}[into]
    assert preconditioned_momentum_(outs, exp_avgs, grads, divisors, beta1=0.9)
    for out, expected, reference, param in zip(outs, want, torch_path, params):
        assert torch.equal(out, expected)
        assert out.stride() == param.stride()
        # ATen's add(alpha=) fuses the multiply-add on x86 with FMA (then equal), else one rounding apart
        torch.testing.assert_close(out, reference, rtol=2e-7, atol=0)


@pytest.mark.parametrize("column_major", [False, True])
@pytest.mark.parametrize("grad_scale", [1.0, 0.37])
def test_the_local_momentum_loop_is_the_torch_ops_fused(column_major, grad_scale):
    """`local_momentum_` (1-bit optimizers at n = 1, and wherever the exchange does not take the momentum
    from a source): m ← β1·m + (1−β1)·(s·g) as one fused multiply-add, the bits of
    `functional.local_momentum_` on (s·g) where ATen fuses its add(alpha=) (x86 with FMA), else within a
    rounding."""
    _, exp_avgs, _ = _tensors(column_major)
    grads = _tensors(column_major, seed=1)[1]
    scaled = [g * grad_scale for g in grads]
    ones = [torch.ones_like(m) for m in exp_avgs]
    want = [_fma_momentum(m, g, d, 0.9) for m, g, d in zip(exp_avgs, scaled, ones)]
    reference = [m.clone() for m in exp_avgs]
    F.local_momentum_(reference, scaled, beta1=0.9)
    assert local_momentum_(exp_avgs, grads, beta1=0.9, grad_scale=grad_scale)
    for out, expected, torch_ops in zip(exp_avgs, want, reference):
        assert torch.equal(out, expected)
        torch.testing.assert_close(out, torch_ops, rtol=2e-7, atol=0)
    other = exp_avgs[0].contiguous() if column_major else exp_avgs[0].t().contiguous().t()
    mixed = [other, *exp_avgs[1:]]  # m and g in different memory orders: declined, untouched
    before = [m.clone() for m in mixed]
    assert not local_momentum_(mixed, grads, beta1=0.9)
    assert all(torch.equal(m, b) for m, b in zip(mixed, before))


@pytest.mark.parametrize("column_major", [False, True])
@pytest.mark.parametrize("grad_scale", [1.0, 0.37])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_local_momentum_loop_takes_the_square_marginals_with_the_same_bits(
    column_major, grad_scale, threads
):
    """`local_momentum_(..., marginals=)` (1-bit LAMB at one process with the rank-1/factored refresh): the
    momentum and the matrices' square marginals of s·g in one loop give the bits of the momentum loop
    followed by `marginals.add_square_marginals`, on one thread or shared out; a matrix whose sums do not
    fit is declined with nothing changed."""
    from pretrain.optim.base import Workspace
    from pretrain.optim.marginals import add_square_marginals

    # a matrix longer than the loop's blocks, so its rows straddle them
    shapes = [*SHAPES, (300, 70)]
    generator = torch.Generator().manual_seed(3)

    def make(shape):
        if column_major and len(shape) == 2:
            return torch.randn(shape[::-1], generator=generator).t()
        return torch.randn(shape, generator=generator)

    exp_avgs, grads = [make(s) for s in shapes], [make(s) for s in shapes]
    sums = [(torch.rand(s[0]), torch.rand(s[1])) if len(s) == 2 else None for s in shapes]
    sums[0] = None  # a matrix without marginals takes the plain blocks
    want_m = [m.clone() for m in exp_avgs]
    want_sums = [None if x is None else (x[0].clone(), x[1].clone()) for x in sums]
    assert local_momentum_(want_m, grads, beta1=0.9, grad_scale=grad_scale)
    for g, x in zip(grads, want_sums):
        if x is not None:
            add_square_marginals(g, x[0], x[1], Workspace(), grad_scale)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert local_momentum_(exp_avgs, grads, beta1=0.9, grad_scale=grad_scale, marginals=sums)
    finally:
        torch.set_num_threads(previous)
    assert all(torch.equal(m, w) for m, w in zip(exp_avgs, want_m))
    for got, want in zip(sums, want_sums):
        assert (got is None) == (want is None)
        if got is not None:
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    bad = [None] * len(shapes)
    bad[-1] = (torch.zeros(3), torch.zeros(70))  # row sums of the wrong length
    before = [m.clone() for m in exp_avgs]
    assert not local_momentum_(exp_avgs, grads, beta1=0.9, marginals=bad)
    assert all(torch.equal(m, b) for m, b in zip(exp_avgs, before))


def test_preconditioned_momentum_declines_what_it_cannot_take():
    _, exp_avgs, divisors = _tensors(False)
    before = [m.clone() for m in exp_avgs]
    mixed = [exp_avgs[0].t().contiguous().t(), *exp_avgs[1:]]  # column-major gradient for a row-major m
    assert not preconditioned_momentum_(exp_avgs, exp_avgs, mixed, divisors, beta1=0.9)
    doubles = [g.double() for g in exp_avgs]
    assert not preconditioned_momentum_(exp_avgs, exp_avgs, doubles, divisors, beta1=0.9)
    assert all(torch.equal(m, b) for m, b in zip(exp_avgs, before))


@pytest.mark.parametrize("column_major", [False, True])
def test_the_step_from_the_averages_is_the_step_after_the_multiplication(column_major):
    """averages=True (ū in the momentum's place) equals m ← ū·d then the usual step, bit for bit, and
    leaves m = ū·d behind."""
    options = dict(lr=0.1, eps=1e-6, weight_decay=0.01, min_coeff=0.0, max_coeff=10.0, rooted=True)
    fused, reference = _tensors(column_major), _tensors(column_major)
    torch._foreach_mul_(reference[1], reference[2])
    coeffs = live_trust_ratio_step_(*fused, **options, averages=True)
    want = live_trust_ratio_step_(*reference, **options)
    assert coeffs is not None and torch.equal(coeffs, want)
    for actual, expected in zip(fused[0] + fused[1], reference[0] + reference[1]):
        assert torch.equal(actual, expected)
    with pytest.raises(ValueError, match="averages=True needs rooted"):
        live_trust_ratio_step_(*fused, **{**options, "rooted": False}, averages=True)


def test_onebit_lamb_fuses_around_the_exchange_and_takes_the_same_steps(monkeypatch):
    """Two virtual workers, the default 1-bit LAMB (per_column, preconditioned, live ratio): the fused loops
    run (momentum into units of u, ū back inside the live step) and the run equals one with both passes
    in torch ops: to the bit where ATen's add(alpha=) fuses its multiply-add (x86 with FMA), else to a
    rounding."""
    from pretrain.optim import OnebitLamb
    from pretrain.optim import onebit as base_module
    from pretrain.optim import onebit_lamb as lamb_module
    from pretrain.optim.config import OnebitLambConfig

    calls, averages = [], []
    real = base_module.preconditioned_momentum_
    monkeypatch.setattr(
        base_module, "preconditioned_momentum_", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    live = lamb_module.live_trust_ratio_step_
    monkeypatch.setattr(
        lamb_module, "live_trust_ratio_step_", lambda *a, **k: averages.append(k["averages"]) or live(*a, **k)
    )
    _, exp_avgs, divisors = _tensors(False)
    grads = _tensors(False, seed=1)[1]
    aten_fuses = all(
        torch.equal(_torch_momentum(m, g, d, 0.9), _fma_momentum(m, g, d, 0.9))
        for m, g, d in zip(exp_avgs, grads, divisors)
    )
    models = []
    for fused in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Linear(40, 7))
        config = OnebitLambConfig(freeze_step=2, lr=0.01)
        optimizer = OnebitLamb(model.parameters(), virtual_workers=2, **config.optimizer_kwargs())
        if not fused:
            monkeypatch.setattr(optimizer, "_fused_exchange", lambda segment, kappas: False)
        generator = torch.Generator().manual_seed(1)
        for step in range(5):
            before = len(calls)
            if step < 2:
                for p in model.parameters():
                    p.grad = torch.randn(p.shape, generator=generator)
            else:
                for worker in range(2):
                    views = optimizer.worker_gradient_views(worker)
                    torch._foreach_copy_(views, [torch.randn(v.shape, generator=generator) for v in views])
            optimizer.step()
            assert (len(calls) > before) == (fused and step >= 2)
        models.append((model, optimizer))
    (fused_model, fused_opt), (plain_model, plain_opt) = models
    for p, q in zip(fused_model.parameters(), plain_model.parameters()):
        m, n = fused_opt.state[p]["exp_avg"], plain_opt.state[q]["exp_avg"]
        if aten_fuses:
            assert torch.equal(p, q) and torch.equal(m, n)
        else:
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-9)
            torch.testing.assert_close(m, n, rtol=1e-5, atol=1e-9)
    assert averages == [True] * 3 + [False] * 3  # the fused run's live steps took ū, the other's m


def test_one_process_onebit_lamb_takes_the_refresh_marginals_in_its_momentum_loop(monkeypatch):
    """1-bit LAMB at one process with the rank-1 refresh: the marginals go into the local momentum's loop
    (no separate pass over the gradients), and the run is bit for bit the one with the separate pass,
    refresh steps included."""
    import pretrain.optim.onebit_lamb as onebit_lamb
    from pretrain.optim.onebit_lamb import OnebitLamb

    def run(fold: bool) -> tuple[list[torch.Tensor], int]:
        separate = []
        original = OnebitLamb._accumulate_marginals

        def accumulate(self, *args, **kwargs):
            separate.append(1)
            return original(self, *args, **kwargs)

        with monkeypatch.context() as patch:
            patch.setattr(OnebitLamb, "_accumulate_marginals", accumulate)
            if not fold:  # the loop declines marginals: the optimizer's separate pass
                patch.setattr(
                    onebit_lamb,
                    "local_momentum_",
                    lambda *a, marginals=None, **k: marginals is None and local_momentum_(*a, **k),
                )
            generator = torch.Generator().manual_seed(0)
            params = [
                torch.nn.Parameter(torch.randn(s, generator=generator)) for s in [(300, 70), (70,), (64, 32)]
            ]
            optimizer = OnebitLamb(
                [{"params": params}],
                lr=0.001,
                freeze_step=1,
                coeff_beta=0.5,
                variance_refresh=2,
                algorithm=DEEPSPEED_ALGORITHM.replace(
                    compression="per_column",
                    precondition=True,
                    trust_ratio="live",
                    exact_vectors=True,
                    warmup="nvlamb",
                    live_vector_variance=True,
                ),
            )
            for _ in range(7):  # the warmup, then six compression steps (three refreshes)
                for p in params:
                    p.grad = torch.randn(p.shape, generator=generator)
                optimizer.step()
        return [p.detach().clone() for p in params], len(separate)

    folded, separate_passes = run(fold=True)
    reference, reference_passes = run(fold=False)
    assert all(torch.equal(a, b) for a, b in zip(folded, reference))
    assert reference_passes > separate_passes  # the separate pass ran without the fold, less often with it
