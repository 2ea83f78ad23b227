"""LAMB's numba loops for CPU (pretrain/optim/lamb_loops.py) against the foreach path, thread counts."""

from __future__ import annotations

import pytest
import torch

from pretrain.optim import Lamb, OnebitLamb, blocks, lamb_loops

pytestmark = pytest.mark.skipif(lamb_loops._loops() is None, reason="numba is not installed")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 96), torch.nn.LayerNorm(96), torch.nn.Linear(96, 7))
    with torch.no_grad():
        model[0].bias.zero_()  # a zero tensor: ‖p‖ = 0, ratio 1
    return model


def _groups(model: torch.nn.Module) -> list[dict]:
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() == 1]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0}]


def _set_grads(model: torch.nn.Module, step: int) -> None:
    generator = torch.Generator().manual_seed(step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator)


def _train(optimizer_of, steps: int = 4, loops: bool = True, monkeypatch=None):
    if not loops:
        monkeypatch.setattr(lamb_loops, "usable", lambda *lists: False)
    model = _model()
    optimizer = optimizer_of(_groups(model))
    ratios = []
    for step in range(steps):
        _set_grads(model, step)
        optimizer.step()
        ratios.append(dict(optimizer.statistics()))
    if not loops:
        monkeypatch.undo()
    return model, optimizer, ratios


@pytest.mark.parametrize("variant", ["nvlamb", "deepspeed"])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_loops_take_the_foreach_step(variant, bias_correction, monkeypatch):
    """Both variants, with and without bias correction, pre-normalization (nvlamb: G > 1), a zero bias
    and a group without decay: parameters, moments and the reported ratios agree to float rounding."""

    def make(groups):
        return Lamb(groups, lr=0.05, variant=variant, bias_correction=bias_correction, max_coeff=0.5)

    calls = []
    step_ = lamb_loops.lamb_step_
    monkeypatch.setattr(lamb_loops, "lamb_step_", lambda *a, **k: calls.append(1) or step_(*a, **k))
    fused, fused_opt, fused_ratios = _train(make)
    assert calls, "the loops did not run"
    plain, plain_opt, plain_ratios = _train(make, loops=False, monkeypatch=monkeypatch)
    for a, b, initial in zip(fused.parameters(), plain.parameters(), _model().parameters()):
        assert not torch.equal(a, initial)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for key in ("exp_avg", "exp_avg_sq"):  # m near 0 where β1·m and (1−β1)·g cancel: atol
            torch.testing.assert_close(fused_opt.state[a][key], plain_opt.state[b][key], rtol=1e-5, atol=1e-7)
    for a, b in zip(fused_ratios, plain_ratios):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-5), key


@pytest.mark.parametrize("threads", [1, 3])
def test_bits_do_not_depend_on_the_number_of_threads(threads, monkeypatch):
    """Blocks of 100 elements (every weight spans several): the same bits with 2 threads and with 1 or 3,
    for LAMB and for 1-bit LAMB's warmup, which takes the same step."""
    monkeypatch.setattr(blocks, "BLOCK", 100)
    before = torch.get_num_threads()
    results = {}
    try:
        for count in (2, threads):
            torch.set_num_threads(count)
            for name, make in (
                ("lamb", lambda g: Lamb(g, lr=0.05)),
                ("onebit", lambda g: OnebitLamb(g, freeze_step=9)),
            ):
                results[name, count] = list(_train(make)[0].parameters())
    finally:
        torch.set_num_threads(before)
    for name in ("lamb", "onebit"):
        assert all(torch.equal(a, b) for a, b in zip(results[name, 2], results[name, threads]))


def test_shares_cover_every_block_once_in_order():
    sizes = [100, 100, 5, 100, 100, 100, 3]
    for threads in (1, 2, 3, 4, 16):
        shares = blocks.shares(sizes, threads)
        assert 1 <= len(shares) <= threads
        assert [j for share in shares for j in share] == list(range(len(sizes)))
    assert [len(s) for s in blocks.shares([10] * 6, 2)] == [3, 3]


def test_mixed_memory_orders_and_other_dtypes_take_the_foreach_path():
    p = torch.zeros(4, 3)
    column_major = torch.zeros(3, 4).t()
    assert lamb_loops.usable([p], [p.clone()], [p.clone()], [p.clone()])
    assert lamb_loops.usable(
        [column_major], [column_major.clone()], [column_major.clone()], [column_major.clone()]
    )
    assert not lamb_loops.usable([p], [column_major], [p.clone()], [p.clone()])
    assert not lamb_loops.usable([p.double()], [p.double()], [p.double()], [p.double()])


def test_live_step_and_momentum_loops_do_not_depend_on_the_number_of_threads(monkeypatch):
    """1-bit LAMB's loops (`live_step`) share the blocks: the same bits at 1, 2 and 3 threads, each
    block's norms added per tensor in order (blocks of 100 elements: every tensor spans several)."""
    from pretrain.optim import live_step

    monkeypatch.setattr(blocks, "BLOCK", 100)
    generator = torch.Generator().manual_seed(3)
    shapes = [(40, 96), (96,), (7, 96), (0,)]

    def tensors(scale: float = 1.0, positive: bool = False) -> list[torch.Tensor]:
        made = [scale * torch.randn(shape, generator=generator) for shape in shapes]
        return [t.abs() + 1e-3 if positive else t for t in made]

    params, exp_avgs, grads, divisors = tensors(), tensors(0.1), tensors(0.1), tensors(0.1, positive=True)
    before = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            p, m = [t.clone() for t in params], [t.clone() for t in exp_avgs]
            assert live_step.preconditioned_momentum_(m, m, grads, divisors, beta1=0.9)
            coeffs = live_step.live_trust_ratio_step_(
                p, m, divisors, lr=0.01, eps=1e-6, weight_decay=0.01, min_coeff=0.01, max_coeff=10.0,
                rooted=True, averages=True,
            )  # fmt: skip
            results.append((p, m, coeffs))
    finally:
        torch.set_num_threads(before)
    assert results[0][2][3] == 1.0  # the empty tensor: no norms, ratio 1
    for p, m, coeffs in results[1:]:
        assert torch.equal(coeffs, results[0][2])
        assert all(torch.equal(a, b) for a, b in zip(p + m, results[0][0] + results[0][1]))
