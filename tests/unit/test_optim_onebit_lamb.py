"""1-bit LAMB on one process: spec §8.9–8.13 and §8.15 (our semantics), κ guard, overflow, masks, bf16."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from pretrain.optim import Lamb, OnebitLamb, Stage, mark_gradients_checked
from pretrain.optim import functional as F
from pretrain.optim import onebit as onebit_module
from pretrain.optim.onebit_lamb import DEEPSPEED_ALGORITHM

FACTOR_RULE = dict(factor_min=0.5, factor_max=4.0, factor_threshold=0.1)


# -- spec §8.9: one compression step, n = 1 ------
def test_one_compression_step_matches_the_spec_numbers():
    p = [torch.tensor([1.0, -2.0, 3.0, -4.0])]
    m = [torch.tensor([0.1, -0.1, 0.2, -0.2])]
    prev = [m[0].clone()]
    v, v_fresh = [torch.tensor([0.01, 0.01, 0.04, 0.04])], [torch.tensor([0.01, 0.01, 0.04, 0.04])]
    F.local_momentum_(m, [torch.tensor([0.5, -0.5, 0.5, -0.5])], beta1=0.9)
    torch.testing.assert_close(m[0], torch.tensor([0.14, -0.14, 0.23, -0.23]))
    factors = F.compressed_lamb_update_(
        p, m, prev, v, v_fresh, torch.tensor([0.25]), torch.tensor([1.0]), lr=0.01, beta1=0.9, beta2=0.999,
        eps=1e-8, weight_decay=0.01, **FACTOR_RULE,
    )  # fmt: skip
    torch.testing.assert_close(
        v_fresh[0], torch.tensor([0.01024, 0.01024, 0.04021, 0.04021]), atol=1e-7, rtol=0
    )
    assert factors.item() == pytest.approx(0.997433, abs=1e-5)  # raw 0.997385, q 0.981631
    assert (0.25 * factors).item() == pytest.approx(0.249358, abs=1e-5)
    torch.testing.assert_close(
        p[0], torch.tensor([0.996484, -1.996459, 2.997058, -3.997033]), atol=2e-6, rtol=0
    )


# -- spec §8.10: κ ------
def test_scaling_coefficients_equalize_rms():
    kappa = F.scaling_coefficients([torch.full((16,), 1e-3), torch.full((4, 4), -4e-3)])
    torch.testing.assert_close(kappa, torch.tensor([2.5, 0.625]))


def test_scaling_coefficients_guard_all_zero_momentum():
    kappa = F.scaling_coefficients([torch.full((16,), 1e-3), torch.zeros(5), torch.full((3,), 4e-3)])
    torch.testing.assert_close(kappa, torch.tensor([2.5, 1.0, 0.625]))
    assert F.scaling_coefficients([torch.zeros(3), torch.zeros(2)]).tolist() == [1.0, 1.0]


# -- spec §8.11: factor ramp ------
@pytest.mark.parametrize(
    ("raw", "expected", "limit", "limit_step"),
    [
        (5.0, [1.1, 1.21, 1.331, 1.4641, 1.61051], 4.0, 15),
        (0.1, [0.9, 0.81, 0.729, 0.6561, 0.59049, 0.531441], 0.5, 7),
    ],
)
def test_factor_ramps_by_the_threshold_until_the_bounds(raw, expected, limit, limit_step):
    last, sequence = torch.tensor([1.0]), []
    for _ in range(limit_step):
        last = F.factor_rule(torch.tensor([raw]), last, **FACTOR_RULE)
        sequence.append(last.item())
    assert sequence[: len(expected)] == pytest.approx(expected, rel=1e-5)
    if raw > 1:
        assert sequence[13] == pytest.approx(3.797498, rel=1e-5)
    assert sequence[limit_step - 2] != pytest.approx(limit) and sequence[limit_step - 1] == limit


# -- spec §8.12: c̄ EMA ------
def test_coefficient_ema_of_a_constant_clamped_ratio():
    coeff = torch.zeros(1)
    for _ in range(10):
        coeff = F.freeze_coeff_ema(coeff, torch.tensor([0.3]), 0.9)
    assert coeff.item() == pytest.approx(0.195396, abs=1e-6)
    assert F.freeze_coeff_ema(coeff, torch.tensor([1.0]), 0.9).item() == coeff.item()  # c = 1 ignored


def test_warmup_accumulates_the_coefficient_ema():
    p = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    opt = OnebitLamb([p], lr=0.01, freeze_step=100, weight_decay=0.01, max_coeff=0.3)
    for _ in range(10):  # ratio ≈ 1.1 every step, clamped to 0.3
        p.grad = torch.ones(2)
        opt.step()
    assert opt.state[p]["lamb_coeff_freeze"].item() == pytest.approx(0.3 * (1 - 0.9**10), abs=1e-6)


# -- helpers for whole-optimizer tests ------
def _model(dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(10, 6), torch.nn.Linear(6, 12), torch.nn.LayerNorm(12), torch.nn.Linear(12, 3)
    )
    return model.to(dtype)


def _groups(model: torch.nn.Module, mask_rows: int | None = None) -> list[dict]:
    embedding, *rest = model.parameters()
    decay = [p for p in rest if p.dim() > 1]
    no_decay = [p for p in rest if p.dim() == 1]
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
    embedding_group = {"params": [embedding], "weight_decay": 0.01}
    if mask_rows is not None:
        embedding_group["exp_avg_mask"] = (torch.arange(10) < mask_rows).float().unsqueeze(1)
    return [*groups, embedding_group]


def _set_grads(model: torch.nn.Module, step: int) -> None:
    generator = torch.Generator().manual_seed(1000 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator).to(torch.bfloat16).to(p.dtype)


def _run(model, opt, steps) -> None:
    for step in steps:
        _set_grads(model, step)
        opt.step()


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _state_snapshot(opt) -> dict:
    return copy.deepcopy(
        {i: dict(opt.state[p]) for i, p in enumerate(q for g in opt.param_groups for q in g["params"])}
    )


# -- warmup == LAMB (DeepSpeed variant, no bias correction), bitwise ------
def test_warmup_is_exactly_deepspeed_lamb_without_bias_correction():
    onebit_model, lamb_model = _model(), _model()
    onebit = OnebitLamb(_groups(onebit_model), lr=0.01, freeze_step=6, max_coeff=0.3)
    lamb = Lamb(_groups(lamb_model), lr=0.01, variant="deepspeed", bias_correction=False, max_coeff=0.3)
    for step in range(6):
        _run(onebit_model, onebit, [step])
        _run(lamb_model, lamb, [step])
        assert _same(_params(onebit_model), _params(lamb_model)), f"differs after warmup step {step + 1}"


# -- spec §8.13 with our semantics (no first-step no-op) ------
def _reference_onebit_lamb_n1(model, steps: int, freeze_step: int, lr: float = 0.01) -> list[torch.Tensor]:
    """Spec §3.4/§3.5 with n = 1 written out per tensor: warmup LAMB with clamp and c̄ EMA, then LAMB with
    frozen v, v_f from the true gradient and coefficient c̄·f."""
    groups = _groups(model)
    state = {}
    for t in range(1, steps + 1):
        _set_grads(model, t - 1)
        for group in groups:
            decay = group["weight_decay"]
            for p in group["params"]:
                s = state.setdefault(
                    p, {"m": torch.zeros_like(p), "v": torch.zeros_like(p), "c": 0.0, "f": 1.0}
                )
                g = p.grad
                s["m"] = 0.9 * s["m"] + 0.1 * g
                if t <= freeze_step:
                    s["v"] = 0.999 * s["v"] + 0.001 * g * g
                    u = s["m"] / (s["v"].sqrt() + 1e-8) + decay * p.detach()
                    ratio = (p.norm() / u.norm()).item()
                    c = min(max(ratio, 0.01), 0.3) if p.norm() > 0 and u.norm() > 0 else 1.0
                    if c != 1.0:
                        s["c"] = 0.9 * s["c"] + 0.1 * c
                    if t == freeze_step:
                        s["vf"] = s["v"].clone()
                    coeff = c
                else:
                    s["vf"] = 0.999 * s["vf"] + 0.001 * g * g
                    denom = s["v"].sqrt() + 1e-8
                    u0 = s["m"] / denom
                    u = u0 + decay * p.detach()
                    raw = (denom / (s["vf"].sqrt() + 1e-8)).max().item()
                    if decay > 0:
                        q = min(1.0, (u0.norm() / u.norm()).item())
                        raw = q * raw + 1 - q
                    f = min(max(min(max(raw, 0.5), 4.0), s["f"] * 0.9), s["f"] * 1.1)
                    s["f"] = f
                    coeff = s["c"] * f
                with torch.no_grad():
                    p -= lr * coeff * u
    return _params(model)


def test_freeze_boundary_and_single_process_compression_trajectory():
    freeze_step, model = 4, _model()
    initial = _params(model)
    opt = OnebitLamb(_groups(model), lr=0.01, freeze_step=freeze_step, max_coeff=0.3)
    params = list(model.parameters())
    assert opt.needs_gradient_allreduce and opt.stage is Stage.warmup
    _run(model, opt, [0])
    assert not _same(initial, _params(model)), "the first step of a fresh optimizer must update"
    _run(model, opt, range(1, freeze_step))
    assert opt.step_count == freeze_step
    for p in params:
        assert torch.equal(opt.state[p]["exp_avg_sq_fresh"], opt.state[p]["exp_avg_sq"])
        assert "scaling_coeff" not in opt.state[p]
    assert not opt.needs_gradient_allreduce and opt.stage is Stage.compression
    frozen = [opt.state[p]["exp_avg_sq"].clone() for p in params]
    _run(model, opt, [freeze_step])
    assert all("scaling_coeff" in opt.state[p] for p in params)
    _run(model, opt, range(freeze_step + 1, freeze_step + 6))
    assert _same(frozen, [opt.state[p]["exp_avg_sq"] for p in params]), "v must stay frozen"
    expected = _reference_onebit_lamb_n1(_model(), freeze_step + 6, freeze_step)
    for actual, reference in zip(model.parameters(), expected):
        torch.testing.assert_close(actual.detach(), reference, rtol=1e-5, atol=1e-6)


def test_first_compression_step_factor_stays_within_the_threshold():
    model = _model()
    opt = OnebitLamb(_groups(model), freeze_step=1)
    _run(model, opt, [0])
    for p in model.parameters():  # a wildly different gradient at the first compression step
        p.grad = 100.0 * torch.randn_like(p)
    opt.step()
    factors = torch.stack([opt.state[p]["last_factor"] for p in model.parameters()])
    assert bool(((factors >= 0.9 - 1e-6) & (factors <= 1.1 + 1e-6)).all())


# -- κ guard within the optimizer: an all-zero-momentum tensor ------
def test_zero_momentum_tensor_gets_unit_kappa_and_no_nan():
    model = _model()
    frozen_layer = list(model.parameters())[1]  # never receives a gradient
    opt = OnebitLamb(_groups(model), freeze_step=2)
    for step in range(5):
        _set_grads(model, step)
        frozen_layer.grad = None
        opt.step()
    assert opt.state[frozen_layer]["scaling_coeff"].item() == 1.0
    for p in model.parameters():
        assert torch.isfinite(p).all()
        for value in opt.state[p].values():
            assert torch.isfinite(value).all()


# -- overflow ------
@pytest.mark.parametrize("steps_before", [1, 4])  # warmup, compression (freeze_step = 2)
def test_overflow_skips_and_leaves_all_state_unchanged(steps_before):
    model = _model()
    opt = OnebitLamb(_groups(model), freeze_step=2)
    _run(model, opt, range(steps_before))
    params, state = _params(model), _state_snapshot(opt)
    _set_grads(model, 99)
    list(model.parameters())[2].grad[3] = float("nan")
    opt.step()
    assert opt.last_step_skipped and opt.num_skipped_steps == 1 and opt.step_count == steps_before
    assert _same(params, _params(model))
    after = _state_snapshot(opt)
    assert all(_same(list(state[i].values()), list(after[i].values())) for i in state)
    _run(model, opt, [99])
    assert not opt.last_step_skipped and opt.step_count == steps_before + 1


def test_a_step_the_caller_checked_skips_its_own_check(monkeypatch):
    """mark_gradients_checked(): a compression-stage step skips its own norm and finiteness flag (the
    caller's check covered them) and takes the same step to the bit; a warmup step checks anyway unless
    the caller passed the norm too (it feeds nvlamb's pre-normalization), and the mark lasts one step."""
    calls = []
    norm = onebit_module.global_grad_norm
    monkeypatch.setattr(onebit_module, "global_grad_norm", lambda grads: calls.append(1) or norm(grads))
    plain, marked = _model(), _model()
    optimizers = [OnebitLamb(_groups(model), freeze_step=3) for model in (plain, marked)]
    for step in range(7):
        for model, optimizer in zip((plain, marked), optimizers):
            _set_grads(model, step)
            mark = model is marked and step != 5
            with_norm = mark and step in (1, 2, 4)  # warmup: steps 0-2
            if mark:
                given = norm([p.grad for p in _params_with_grad(optimizer)]) if with_norm else None
                mark_gradients_checked(optimizer, given)
            before = len(calls)
            optimizer.step()
            assert (len(calls) > before) == (not mark or (step < 3 and not with_norm)), (step, mark)
            assert not optimizer.last_step_skipped
    assert optimizers[1].stage is Stage.compression
    assert _same(_params(plain), _params(marked))
    first, second = map(_state_snapshot, optimizers)
    assert all(_same(list(first[i].values()), list(second[i].values())) for i in first)


def _params_with_grad(optimizer):
    return [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


# -- masks ------
def test_mask_keeps_masked_momentum_at_zero_in_the_compression_stage():
    model = _model()
    opt = OnebitLamb(_groups(model, mask_rows=7), freeze_step=2)
    embedding = next(iter(model.parameters()))
    _run(model, opt, range(2))
    for step in range(2, 6):  # the masked rows receive gradients too
        _run(model, opt, [step])
        momentum = opt.state[embedding]["exp_avg"]
        assert momentum[7:].abs().max() == 0 and momentum[:7].abs().max() > 0


# -- bf16 parameters, fp32 masters ------
def test_bf16_params_follow_the_fp32_run_through_both_stages():
    low, full = _model(torch.bfloat16), _model()
    with torch.no_grad():
        for a, b in zip(full.parameters(), low.parameters()):
            a.copy_(b.float())
    opt_low, opt_full = OnebitLamb(_groups(low), freeze_step=3), OnebitLamb(_groups(full), freeze_step=3)
    _run(low, opt_low, range(6))
    _run(full, opt_full, range(6))
    for p_low, p_full in zip(low.parameters(), full.parameters()):
        master = opt_low.state[p_low]["master_param"]
        assert master.dtype == torch.float32 and torch.equal(master, p_full.detach())
        assert torch.equal(p_low.detach(), master.to(torch.bfloat16))


# -- spec §8.15 adapted: checkpoint round trip ------
def _resume(model_state, opt_state, groups_fn, **kwargs):
    model = _model()
    model.load_state_dict(model_state)
    opt = OnebitLamb(groups_fn(model), **kwargs)
    opt.load_state_dict(copy.deepcopy(opt_state))
    return model, opt


@pytest.mark.parametrize("save_after", [2, 5])  # warmup (freeze_step 3), compression
def test_resume_continues_bitwise(save_after):
    model = _model()
    opt = OnebitLamb(_groups(model, mask_rows=7), freeze_step=3)
    _run(model, opt, range(save_after))
    twin, resumed = _resume(
        model.state_dict(), opt.state_dict(), lambda m: _groups(m, mask_rows=7), freeze_step=3
    )
    assert resumed.stage is opt.stage and resumed.needs_gradient_allreduce == opt.needs_gradient_allreduce
    _run(model, opt, range(save_after, 8))
    _run(twin, resumed, range(save_after, 8))
    assert _same(_params(model), _params(twin))


def test_checkpoint_contents_and_stage_rules():
    model = _model()
    opt = OnebitLamb(_groups(model, mask_rows=7), freeze_step=3)
    _run(model, opt, range(4))
    saved = opt.state_dict()
    assert all("exp_avg_mask" not in g for g in saved["param_groups"])
    assert saved["extra"]["world_size"] == 1 and saved["extra"]["compressors"] == []
    first = saved["state"][0]
    assert {
        "exp_avg",
        "exp_avg_sq",
        "exp_avg_sq_fresh",
        "lamb_coeff_freeze",
        "last_factor",
        "scaling_coeff",
    } <= set(first)
    # compression stage: c̄, last_factor and κ are kept; the current run's mask wins
    _, resumed = _resume(model.state_dict(), saved, lambda m: _groups(m, mask_rows=5), freeze_step=3)
    assert resumed.param_groups[2]["exp_avg_mask"][:, 0].tolist() == [1.0] * 5 + [0.0] * 5
    p0 = next(p for p in resumed.param_groups[0]["params"])
    for key in ("lamb_coeff_freeze", "last_factor", "scaling_coeff"):
        assert torch.equal(resumed.state[p0][key], first[key])
    # loading into the warmup stage (larger freeze_step): gradient allreduce back on, compression-only
    # state dropped, c̄ kept (a resumed warmup must equal an uninterrupted one)
    _, warm = _resume(model.state_dict(), saved, _groups, freeze_step=10)
    assert warm.needs_gradient_allreduce and warm.stage is Stage.warmup
    p0 = next(p for p in warm.param_groups[0]["params"])
    assert "scaling_coeff" not in warm.state[p0] and "exp_avg_sq_fresh" not in warm.state[p0]
    assert warm.state[p0]["last_factor"].item() == 1.0
    assert torch.equal(warm.state[p0]["lamb_coeff_freeze"], first["lamb_coeff_freeze"])


def test_other_world_size_resets_errors_with_a_warning(caplog):
    model = _model()
    opt = OnebitLamb(_groups(model), freeze_step=1)
    _run(model, opt, range(3))
    saved = opt.state_dict()
    saved["extra"]["world_size"] = 2
    with caplog.at_level(logging.WARNING):
        _, resumed = _resume(model.state_dict(), saved, _groups, freeze_step=1)
    assert "world size 2" in caplog.text
    assert resumed.stage is Stage.compression


# -- freeze_step changed between phases (the trainer sets `optimizer.freeze_step`) ------
def test_lowered_freeze_step_freezes_at_the_next_step():
    model = _model()
    opt = OnebitLamb(_groups(model), freeze_step=100)
    _run(model, opt, range(3))
    variance = {p: opt.state[p]["exp_avg_sq"].clone() for p in model.parameters()}
    opt.freeze_step = 2  # already past it: the next step compresses, freezing v as it is now
    assert not opt.needs_gradient_allreduce and opt.frozen_at is None
    _run(model, opt, [3])
    assert opt.frozen_at == 3
    for p in model.parameters():
        assert torch.equal(opt.state[p]["exp_avg_sq"], variance[p]) and "scaling_coeff" in opt.state[p]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_raised_freeze_step_returns_to_warmup_and_freezes_again():
    model = _model()
    opt = OnebitLamb(_groups(model), freeze_step=2)
    _run(model, opt, range(4))
    opt.freeze_step = 6
    assert opt.needs_gradient_allreduce
    _run(model, opt, range(4, 6))  # warmup again: v moves, then is frozen anew after step 6
    for p in model.parameters():
        assert torch.equal(opt.state[p]["exp_avg_sq_fresh"], opt.state[p]["exp_avg_sq"])
        assert "scaling_coeff" not in opt.state[p] and opt.state[p]["last_factor"].item() == 1.0
    assert opt.frozen_at == 6 and not opt.needs_gradient_allreduce


def test_traffic_and_statistics_with_one_rank():
    model = _model()
    opt = OnebitLamb(_groups(model), freeze_step=1)
    _run(model, opt, range(3))
    assert opt.traffic.num_calls == 0 and opt.traffic.compressed_bytes == 0  # nothing sent with one rank
    stats = opt.statistics()
    assert stats["compression_stage"] == 1.0 and stats["skipped_steps"] == 0.0
    assert 0.0 < stats["lamb_coeff_freeze_mean"] <= 10.0 and 0.5 <= stats["factor_mean"] <= 4.0


# -- the remedies' options (issue 14) ------
def _two_tensors() -> list[torch.nn.Parameter]:
    torch.manual_seed(3)
    return [torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(4))]


def _grads(step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(6, 4, generator=generator), torch.randn(4, generator=generator)]


def test_live_trust_ratio_takes_lambs_step_on_the_frozen_variance():
    """c = min(‖p‖/‖u‖, max_coeff), the step's norm LAMB's; the warmup's floor min_coeff does not apply."""
    params = _two_tensors()
    optimizer = OnebitLamb(
        [{"params": params, "weight_decay": 0.01}],
        lr=0.01,
        freeze_step=2,
        min_coeff=0.25,
        max_coeff=0.3,
        algorithm=DEEPSPEED_ALGORITHM.replace(trust_ratio="live"),
    )
    for step in range(2):
        for p, g in zip(params, _grads(step)):
            p.grad = g
        optimizer.step()
    frozen_v = [optimizer.state[p]["exp_avg_sq"].clone() for p in params]
    expected, ratios = [], []
    for p, g, v in zip(params, _grads(2), frozen_v):
        m = 0.9 * optimizer.state[p]["exp_avg"] + 0.1 * g
        u = m / (v.sqrt() + 1e-8) + 0.01 * p.detach()
        ratio = p.detach().norm() / u.norm()
        ratios.append(float(ratio))
        coeff = ratio.clamp(0.0, 0.3)
        expected.append(p.detach() - 0.01 * coeff * u)
        p.grad = g
    assert min(ratios) < 0.25  # below the warmup's floor on one tensor: the live ratio takes it as it is
    optimizer.step()
    for p, want, v in zip(params, expected, frozen_v):
        torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(optimizer.state[p]["exp_avg_sq"], v)
    assert optimizer.statistics()["live_coeff_mean"] <= 0.3


# -- warmup="nvlamb": the warmup is optim=lamb's LAMB, the compression stage keeps its rules ------
def test_nvlamb_warmup_is_exactly_lamb():
    onebit_model, lamb_model = _model(), _model()
    onebit = OnebitLamb(
        _groups(onebit_model),
        lr=0.01,
        freeze_step=6,
        eps=1e-6,
        algorithm=DEEPSPEED_ALGORITHM.replace(warmup="nvlamb", trust_ratio="live"),
    )
    lamb = Lamb(_groups(lamb_model), lr=0.01)  # nvlamb: bias correction, pre-normalization at 1.0
    for step in range(6):
        _run(onebit_model, onebit, [step])
        _run(lamb_model, lamb, [step])
        assert _same(_params(onebit_model), _params(lamb_model)), f"differs after warmup step {step + 1}"


def _nvlamb_reference(
    params, grads_at, freeze_step: int, steps: int, lr: float = 0.01, live_vectors=False, refresh=0
):
    """The nvlamb warmup and compression stage at n = 1 written out: LAMB with pre-normalized gradients;
    at the freeze m, v bias-corrected and the β2-EMA of the pre-normalization factor frozen; then
    m ← β1·m + (1−β1)·s·g, v fixed, p ← p − η·c·(m/(√v+ε) + λp), c the live ratio on decayed tensors, 1
    on the others. `refresh` = K: (s·g)² summed over the compression steps; at steps F+K, F+2K, … the
    decayed matrix's mean squares over the K steps, rebuilt from their row and column sums as r·cᵀ/Σr, are
    folded into v with weight 1 − β2^K before the step."""
    decays = [0.01, 0.0]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    scale_ema, frozen_scale = 0.0, None
    squares = [torch.zeros_like(p) for p in params]
    for t in range(1, steps + 1):
        grads = grads_at(t - 1)
        if t <= freeze_step:
            norm = torch.sqrt(sum((g * g).sum() for g in grads)).item()
            s = 1.0 / max(1.0, norm)
            scale_ema = 0.999 * scale_ema + 0.001 * s
        else:
            s = frozen_scale
        for i, (p, g) in enumerate(zip(params, grads)):
            m[i] = 0.9 * m[i] + 0.1 * s * g
            refreshed = refresh and t > freeze_step and (t - freeze_step) % refresh == 0
            if refresh and t > freeze_step:
                squares[i] = squares[i] + (s * g) ** 2
            if refreshed and decays[i] and p.dim() == 2:
                mean, weight = squares[i] / refresh, 1 - 0.999**refresh
                rows, cols = mean.sum(1), mean.sum(0)
                v[i] = (1 - weight) * v[i] + weight * torch.outer(rows, cols) / rows.sum()
            if refreshed:
                squares[i] = torch.zeros_like(p)
            if t <= freeze_step:
                v[i] = 0.999 * v[i] + 0.001 * (s * g) ** 2
                bc1, bc2 = 1 - 0.9**t, 1 - 0.999**t
                u = (m[i] / bc1) / ((v[i] / bc2).sqrt() + 1e-6)
            else:
                u = m[i] / (v[i].sqrt() + 1e-6)
            u = u + decays[i] * p
            c = (p.norm() / u.norm()).item() if decays[i] else 1.0
            p -= lr * c * u
            if t > freeze_step and live_vectors and p.dim() == 1:  # after the step: used from the next
                v[i] = 0.999 * v[i] + 0.001 * (s * g) ** 2
        if t == freeze_step:
            m = [x / (1 - 0.9**t) for x in m]
            v = [x / (1 - 0.999**t) for x in v]
            frozen_scale = scale_ema / (1 - 0.999**t)
    return params


def _big_grads(step: int) -> list[torch.Tensor]:
    return [3.0 * g for g in _grads(step)]  # global norm > 1: the pre-normalization binds


def test_nvlamb_compression_stage_keeps_lambs_rules_at_one_process():
    params = [torch.nn.Parameter(t) for t in _two_tensors()]
    start = [p.detach().clone() for p in params]
    optimizer = OnebitLamb(
        [{"params": [params[0]], "weight_decay": 0.01}, {"params": [params[1]], "weight_decay": 0.0}],
        lr=0.01,
        freeze_step=3,
        eps=1e-6,
        algorithm=DEEPSPEED_ALGORITHM.replace(warmup="nvlamb", trust_ratio="live"),
    )
    for step in range(7):
        for p, g in zip(params, _big_grads(step)):
            p.grad = g.clone()
        optimizer.step()
    expected = _nvlamb_reference([s.clone() for s in start], _big_grads, freeze_step=3, steps=7)
    for p, want in zip(params, expected):
        torch.testing.assert_close(p.detach(), want, rtol=1e-5, atol=1e-6)
    scale = optimizer.param_groups[0]["frozen_grad_scale"]
    assert 0.0 < scale < 1.0  # the gradients' norm is above max_grad_norm: the frozen factor is used
    assert optimizer.statistics()["live_coeff_mean"] > 0


def test_live_vector_variance_follows_the_vectors_gradients_after_the_freeze():
    params = [torch.nn.Parameter(t) for t in _two_tensors()]
    start = [p.detach().clone() for p in params]
    optimizer = OnebitLamb(
        [{"params": [params[0]], "weight_decay": 0.01}, {"params": [params[1]], "weight_decay": 0.0}],
        lr=0.01,
        freeze_step=3,
        eps=1e-6,
        algorithm=DEEPSPEED_ALGORITHM.replace(
            warmup="nvlamb",
            trust_ratio="live",
            exact_vectors=True,
            precondition=True,
            live_vector_variance=True,
        ),
    )
    frozen = None
    for step in range(7):
        for p, g in zip(params, _big_grads(step)):
            p.grad = g.clone()
        optimizer.step()
        if step == 2:
            frozen = [optimizer.state[p]["exp_avg_sq"].clone() for p in params]
    expected = _nvlamb_reference([s.clone() for s in start], _big_grads, 3, 7, live_vectors=True)
    for p, want in zip(params, expected):
        torch.testing.assert_close(p.detach(), want, rtol=1e-5, atol=1e-6)
    assert torch.equal(optimizer.state[params[0]]["exp_avg_sq"], frozen[0])  # the matrix's stays frozen
    assert not torch.equal(optimizer.state[params[1]]["exp_avg_sq"], frozen[1])


@pytest.mark.parametrize("live_vectors", [False, True])
def test_variance_refresh_updates_v_every_kth_compression_step(live_vectors: bool):
    """`variance_refresh=3` at freeze_step 3: steps 6 and 9 fold the rank-1 estimate of the matrix's mean
    squares over the 3 steps into v with weight 1 − β2³; the other compression steps leave v alone, and no
    compression step asks the trainer to average gradients."""
    params = [torch.nn.Parameter(t) for t in _two_tensors()]
    start = [p.detach().clone() for p in params]
    optimizer = OnebitLamb(
        [{"params": [params[0]], "weight_decay": 0.01}, {"params": [params[1]], "weight_decay": 0.0}],
        lr=0.01,
        freeze_step=3,
        eps=1e-6,
        variance_refresh=3,
        algorithm=DEEPSPEED_ALGORITHM.replace(
            warmup="nvlamb",
            trust_ratio="live",
            exact_vectors=True,
            precondition=True,
            live_vector_variance=live_vectors,
        ),
    )
    asked, changed = [], []
    for step in range(10):
        asked.append(optimizer.needs_gradient_allreduce)
        before = optimizer.state[params[0]]["exp_avg_sq"].clone() if step else None
        for p, g in zip(params, _big_grads(step)):
            p.grad = g.clone()
        optimizer.step()
        if before is not None:
            changed.append(not torch.equal(before, optimizer.state[params[0]]["exp_avg_sq"]))
    assert asked == [True] * 3 + [False] * 7  # steps 1-3 warmup, 4.. compression
    assert changed == [True, True, False, False, True, False, False, True, False]  # steps 2..10
    expected = _nvlamb_reference(
        [s.clone() for s in start], _big_grads, 3, 10, live_vectors=live_vectors, refresh=3
    )
    for p, want in zip(params, expected):
        torch.testing.assert_close(p.detach(), want, rtol=1e-5, atol=1e-6)


def _nvlamb_two_tensor_optimizer(params: list[torch.nn.Parameter], **options) -> OnebitLamb:
    """nvlamb, live ratio, preconditioned, freeze at 3: the matrix with weight decay, the vector without."""
    return OnebitLamb(
        [{"params": [params[0]], "weight_decay": 0.01}, {"params": [params[1]], "weight_decay": 0.0}],
        lr=0.01,
        freeze_step=3,
        eps=1e-6,
        algorithm=DEEPSPEED_ALGORITHM.replace(warmup="nvlamb", trust_ratio="live", precondition=True),
        **options,
    )


def _refreshed_two_tensors(steps: int, grads_at=None, **options):
    """The two tensors stepped `steps` times by `_nvlamb_two_tensor_optimizer(**options)`: (params, their
    start values, their v at the freeze (step 3), the optimizer)."""
    grads_at = grads_at or _big_grads
    params = [torch.nn.Parameter(t) for t in _two_tensors()]
    start = [p.detach().clone() for p in params]
    optimizer = _nvlamb_two_tensor_optimizer(params, **options)
    frozen = None
    for step in range(steps):
        for p, g in zip(params, grads_at(step)):
            p.grad = g.clone()
        optimizer.step()
        if step == 2:
            frozen = [optimizer.state[p]["exp_avg_sq"].clone() for p in params]
    return params, start, frozen, optimizer


def test_rank1_variance_refresh_folds_in_the_squares_rebuilt_from_their_marginals():
    """refresh_from=rank1 at one process: every 2nd compression step v of the decayed matrix takes
    (1 − β2²)·r·cᵀ/Σr of the window's mean squares; the vector without weight decay keeps its frozen v."""
    params, start, frozen, optimizer = _refreshed_two_tensors(10, variance_refresh=2)
    assert torch.equal(optimizer.state[params[1]]["exp_avg_sq"], frozen[1])
    expected = _nvlamb_reference([s.clone() for s in start], _big_grads, 3, 10, refresh=2)
    for p, want in zip(params, expected):
        torch.testing.assert_close(p.detach(), want, rtol=1e-5, atol=1e-6)
    frozen_run = _nvlamb_reference([s.clone() for s in start], _big_grads, 3, 10)
    assert not torch.allclose(params[0].detach(), frozen_run[0], rtol=1e-5, atol=1e-6)


def test_variance_refresh_needs_a_live_ratio_and_k_of_at_least_two():
    with pytest.raises(ValueError, match="variance_refresh"):
        OnebitLamb(
            _two_tensors(),
            freeze_step=2,
            variance_refresh=1,
            algorithm=DEEPSPEED_ALGORITHM.replace(trust_ratio="live"),
        )
    with pytest.raises(ValueError, match="variance_refresh"):
        OnebitLamb(_two_tensors(), freeze_step=2, variance_refresh=4)  # trust_ratio=frozen


def test_nvlamb_warmup_moves_a_zero_bias_like_lamb_and_deepspeeds_does_not():
    """A zero-initialised bias without weight decay: after its first step (ratio 1, ‖p‖ = 0), DeepSpeed's
    clamped ratio on every tensor makes its steps η·max(min_coeff, ‖p‖/‖u‖)·u, NVLAMB's η·u (the
    mechanism of results/cpu-study/README.md)."""
    moved = {}
    for warmup in ("deepspeed", "nvlamb"):
        weight, bias = torch.nn.Parameter(torch.ones(4, 4)), torch.nn.Parameter(torch.zeros(4))
        optimizer = OnebitLamb(
            [{"params": [weight], "weight_decay": 0.01}, {"params": [bias], "weight_decay": 0.0}],
            lr=0.01,
            freeze_step=20,
            algorithm=DEEPSPEED_ALGORITHM.replace(warmup=warmup, trust_ratio="live"),
        )
        for step in range(10):
            weight.grad, bias.grad = torch.full((4, 4), 0.1), torch.full((4,), 0.1)
            optimizer.step()
            if step == 0:
                after_first = bias.detach().clone()
        moved[warmup] = (bias.detach() - after_first).abs().max().item()
    assert moved["nvlamb"] > 10 * moved["deepspeed"] > 0


def test_nvlamb_warmup_needs_a_live_trust_ratio():
    with pytest.raises(ValueError, match="nvlamb"):
        OnebitLamb(
            _two_tensors(),
            freeze_step=2,
            algorithm=DEEPSPEED_ALGORITHM.replace(warmup="nvlamb", trust_ratio="frozen"),
        )


def test_live_vector_variance_in_multi_tensor_ops_keeps_each_tensors_arithmetic():
    """The live variance of the exactly averaged vectors runs as multi-tensor ops per (β1, β2, ε) (a few GPU
    launches instead of five per vector): on CPU the same bits as each tensor's own ops, groups kept apart."""
    from types import SimpleNamespace

    generator = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(n, generator=generator)) for n in (7, 5, 3, 9)]
    groups = [
        {"params": params[:2], "betas": (0.9, 0.999), "eps": 1e-6},
        {"params": params[2:], "betas": (0.8, 0.99), "eps": 1e-8},
    ]
    optimizer = OnebitLamb(
        groups,
        lr=0.01,
        freeze_step=3,
        algorithm=DEEPSPEED_ALGORITHM.replace(exact_vectors=True, live_vector_variance=True),
    )
    for p in params:
        optimizer.state[p]["exp_avg_sq"] = torch.rand(p.shape, generator=generator)
    views = [torch.randn(p.shape, generator=generator) for p in params]
    previous = [torch.randn(p.shape, generator=generator) for p in params]
    divisors = [torch.empty(p.shape) for p in params]
    expected_v, expected_d = [], []
    for p, view, before in zip(params, views, previous):
        group = groups[0] if any(p is q for q in groups[0]["params"]) else groups[1]
        (beta1, beta2), eps = group["betas"], group["eps"]
        gradient = before.clone().mul_(-beta1).add_(view).div_(1.0 - beta1)
        v = (
            optimizer.state[p]["exp_avg_sq"]
            .clone()
            .mul_(beta2)
            .addcmul_(gradient, gradient, value=1.0 - beta2)
        )
        expected_v.append(v)
        expected_d.append(torch.sqrt(v).add_(eps))
    segment = SimpleNamespace(params=params, views=views, divisors=divisors)
    optimizer._update_live_variance(segment, [0, 1, 2, 3], previous)
    for p, v, d, got in zip(params, expected_v, expected_d, divisors):
        assert torch.equal(optimizer.state[p]["exp_avg_sq"], v)
        assert torch.equal(got, d)
