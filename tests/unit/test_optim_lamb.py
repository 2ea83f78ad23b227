"""LAMB: spec §8.7 (DeepSpeed FusedLamb) and §8.8 (apex defaults), compile, fp32 masters, overflow skip."""

from __future__ import annotations

import copy

import pytest
import torch

from pretrain.optim import Lamb
from pretrain.optim import compiled as compiled_module
from pretrain.optim import functional as F


def _param(values, dtype=torch.float32) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.tensor(values, dtype=dtype))


def _one_step(optimizer: torch.optim.Optimizer, params, grads) -> None:
    for p, g in zip(params, grads):
        p.grad = torch.tensor(g, dtype=p.dtype)
    optimizer.step()


def _assert_close(actual: torch.Tensor, expected, atol: float = 2e-6) -> None:
    torch.testing.assert_close(actual.detach().float(), torch.tensor(expected), atol=atol, rtol=0)


# -- spec §8.7: DeepSpeed FusedLamb, p=[3,4], g=[1,1], η=0.01, λ=0.01, clamp [0.01, 0.3] ------
def test_deepspeed_lamb_without_bias_correction():
    p = _param([3.0, 4.0])
    opt = Lamb([p], lr=0.01, weight_decay=0.01, variant="deepspeed", bias_correction=False, max_coeff=0.3)
    _one_step(opt, [p], [[1.0, 1.0]])
    _assert_close(p, [2.990423, 3.990393])


def test_deepspeed_lamb_update_and_clamped_ratio():
    p, m, v = [torch.tensor([3.0, 4.0])], [torch.zeros(2)], [torch.zeros(2)]
    coeffs = F.lamb_update_(
        p, [torch.ones(2)], m, v, nvlamb=False, lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
        min_coeff=0.01, max_coeff=0.3,
    )  # fmt: skip
    assert coeffs.tolist() == pytest.approx([0.3])  # raw ratio 1.105794 clamped
    u = torch.tensor([3.192277, 3.202277])
    assert (torch.tensor([3.0, 4.0]).norm() / u.norm()).item() == pytest.approx(1.105794, abs=1e-5)


def test_deepspeed_lamb_with_bias_correction_scales_the_step_after_the_ratio():
    p = _param([3.0, 4.0])
    opt = Lamb([p], lr=0.01, weight_decay=0.01, variant="deepspeed", bias_correction=True, max_coeff=0.3)
    _one_step(opt, [p], [[1.0, 1.0]])
    # step factor √(1−β2)/(1−β1) = 0.316228 multiplies η·c·u
    _assert_close(p, [2.996972, 3.996962])


def test_deepspeed_variant_applies_ratio_to_zero_decay_tensors():
    p = _param([3.0, 4.0])
    opt = Lamb([p], lr=0.01, weight_decay=0.0, variant="deepspeed", bias_correction=False, max_coeff=0.3)
    _one_step(opt, [p], [[1.0, 1.0]])
    # u = m/(√v+ε) ≈ [3.162277]*2, ratio 5/4.472 = 1.118 -> 0.3
    _assert_close(p, [3.0 - 0.01 * 0.3 * 3.162277, 4.0 - 0.01 * 0.3 * 3.162277])


# -- spec §8.8: apex FusedLAMB defaults ------
def test_nvlamb_defaults_with_global_grad_norm_clipping():
    p = _param([3.0, 4.0])
    opt = Lamb([p], lr=0.01)  # nvlamb: ε=1e-6, λ=0.01, bias correction, max_grad_norm=1 (G=√2 -> clipped)
    _one_step(opt, [p], [[1.0, 1.0]])
    _assert_close(p, [2.964816, 3.964474])


def test_nvlamb_zero_decay_group_gets_no_trust_ratio():
    decayed, plain = _param([3.0, 4.0]), _param([3.0, 4.0])
    opt = Lamb([{"params": [decayed]}, {"params": [plain], "weight_decay": 0.0}], lr=0.01)
    _one_step(opt, [decayed, plain], [[1.0, 1.0], [1.0, 1.0]])
    # the global norm covers both groups (G = 2): clipped gradients, same m̂/√v̂ ≈ 1 per element
    _assert_close(plain, [2.99, 3.99])
    ratio = 5.0 / torch.tensor([1.03, 1.04]).norm().item()
    _assert_close(decayed, [3.0 - 0.01 * ratio * 1.03, 4.0 - 0.01 * ratio * 1.04], atol=1e-5)


def test_nvlamb_trust_ratio_is_one_for_zero_parameters():
    p = _param([0.0, 0.0])
    opt = Lamb([p], lr=0.01, max_grad_norm=0.0)
    _one_step(opt, [p], [[1.0, -1.0]])
    _assert_close(p, [-0.01, 0.01], atol=1e-7)


def test_variant_defaults_and_validation():
    p = _param([1.0])
    assert Lamb([p]).param_groups[0]["eps"] == 1e-6
    assert Lamb([p], variant="deepspeed").param_groups[0]["eps"] == 1e-8
    assert Lamb([p]).max_grad_norm == 1.0 and Lamb([p], variant="deepspeed").max_grad_norm == 0.0
    with pytest.raises(ValueError):
        Lamb([p], variant="paper")
    with pytest.raises(ValueError):
        Lamb([p], min_coeff=2.0, max_coeff=1.0)


def _model(dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.LayerNorm(12), torch.nn.Linear(12, 3))
    return model.to(dtype)


def _groups(model: torch.nn.Module) -> list[dict]:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0}]


def _set_grads(model: torch.nn.Module, step: int) -> None:
    generator = torch.Generator().manual_seed(step)
    for p in model.parameters():
        # bf16-representable values, so fp32 and bf16 models see the same gradients
        p.grad = torch.randn(p.shape, generator=generator).to(torch.bfloat16).to(p.dtype)


@pytest.mark.parametrize("variant", ["nvlamb", "deepspeed"])
def test_bf16_params_keep_fp32_masters(variant):
    low, full = _model(torch.bfloat16), _model()
    with torch.no_grad():  # the fp32 run starts from the bf16 values
        for a, b in zip(full.parameters(), low.parameters()):
            a.copy_(b.float())
    opt_low, opt_full = Lamb(_groups(low), variant=variant), Lamb(_groups(full), variant=variant)
    for step in range(3):
        for model, opt in ((low, opt_low), (full, opt_full)):
            _set_grads(model, step)
            opt.step()
    for p_low, p_full in zip(low.parameters(), full.parameters()):
        master = opt_low.state[p_low]["master_param"]
        assert master.dtype == torch.float32 and opt_low.state[p_low]["exp_avg"].dtype == torch.float32
        torch.testing.assert_close(master, p_full.detach(), rtol=0, atol=0)  # same fp32 math
        assert torch.equal(p_low.detach(), master.to(torch.bfloat16))


def test_bf16_checkpoint_keeps_fp32_state():
    model = _model(torch.bfloat16)
    opt = Lamb(_groups(model))
    _set_grads(model, 0)
    opt.step()
    restored = Lamb(_groups(model))
    restored.load_state_dict(copy.deepcopy(opt.state_dict()))
    for p in model.parameters():
        for key in ("exp_avg", "exp_avg_sq", "master_param"):
            assert restored.state[p][key].dtype == torch.float32
            assert torch.equal(restored.state[p][key], opt.state[p][key])
    assert [g["step"] for g in restored.param_groups] == [1, 1]


def test_resume_is_bitwise_identical():
    model, twin = _model(), _model()
    opt = Lamb(_groups(model))
    for step in range(2):
        _set_grads(model, step)
        opt.step()
    twin.load_state_dict(model.state_dict())
    resumed = Lamb(_groups(twin))
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    for step in range(2, 5):
        for m, o in ((model, opt), (twin, resumed)):
            _set_grads(m, step)
            o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_overflow_skips_the_step_and_counts_it(bad):
    model = _model()
    opt = Lamb(_groups(model))
    _set_grads(model, 0)
    opt.step()
    before_params = [p.detach().clone() for p in model.parameters()]
    before_state = copy.deepcopy(opt.state_dict())
    _set_grads(model, 1)
    next(iter(model.parameters())).grad[0, 0] = bad
    opt.step()
    assert opt.last_step_skipped and opt.num_skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before_params, model.parameters()))
    after_state = opt.state_dict()
    assert [g["step"] for g in after_state["param_groups"]] == [1, 1]
    for index, state in before_state["state"].items():
        assert all(torch.equal(value, after_state["state"][index][key]) for key, value in state.items())
    _set_grads(model, 1)
    opt.step()
    assert not opt.last_step_skipped and opt.param_groups[0]["step"] == 2


@pytest.mark.parametrize("variant", ["nvlamb", "deepspeed"])
def test_a_step_the_caller_checked_takes_its_norm_and_reads_no_gradient_norm(variant, monkeypatch):
    """mark_gradients_checked(norm): the step uses the caller's norm for the pre-normalization (nvlamb;
    the deepspeed variant needs none) instead of its own pass, and takes the same step to the bit when
    that norm is the one it would compute; a scaled norm changes the step as the pre-normalization says;
    the mark lasts one step."""
    from pretrain.optim import lamb as lamb_module
    from pretrain.optim import mark_gradients_checked

    calls = []
    norm = lamb_module.global_grad_norm
    monkeypatch.setattr(lamb_module, "global_grad_norm", lambda grads: calls.append(1) or norm(grads))
    plain, marked, doubled = _model(), _model(), _model()
    optimizers = [Lamb(_groups(model), variant=variant) for model in (plain, marked, doubled)]
    for step in range(4):
        for model, optimizer in zip((plain, marked, doubled), optimizers):
            _set_grads(model, step)
            grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
            mark = model is not plain and step != 2
            if mark:
                given = norm(grads) * (2.0 if model is doubled else 1.0)
                mark_gradients_checked(optimizer, given)
            before = len(calls)
            optimizer.step()
            assert (len(calls) > before) == (not mark), (step, mark)  # unmarked: the finiteness check
            assert not optimizer.last_step_skipped
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), marked.parameters()))
    differs = any(not torch.equal(a, b) for a, b in zip(plain.parameters(), doubled.parameters()))
    # the test gradients' norm exceeds max_grad_norm=1, so nvlamb's scale follows the norm given
    assert differs == (variant == "nvlamb")


@pytest.mark.slow  # compiling takes ~15 s on 2 CPU cores with a cold inductor cache
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("variant", ["nvlamb", "deepspeed"])
# every tensor compiled; only the 72-element weight compiled, the rest eager
@pytest.mark.parametrize("min_numel", [0, 64])
def test_compiled_update_matches_eager(variant, min_numel, monkeypatch):
    monkeypatch.setattr(compiled_module, "COMPILED_MIN_NUMEL", min_numel)
    eager_model, compiled_model = _model(), _model()
    eager = Lamb(_groups(eager_model), variant=variant)
    compiled = Lamb(_groups(compiled_model), variant=variant, compile=True)
    for step in range(3):
        for model, opt in ((eager_model, eager), (compiled_model, compiled)):
            _set_grads(model, step)
            opt.step()
    for a, b in zip(eager_model.parameters(), compiled_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_small_tensors_take_the_eager_path():
    tensors = [torch.zeros(compiled_module.COMPILED_MIN_NUMEL), torch.zeros(3), torch.zeros(2, 1 << 15)]
    assert compiled_module.split_by_size(tensors) == ([1], [0, 2])
    assert compiled_module.pick([tensors, ["a", "b", "c"]], [2, 0]) == [[tensors[2], tensors[0]], ["c", "a"]]


def test_statistics_report_the_applied_trust_ratios():
    """nvlamb: the decayed group's ratio is ‖p‖/‖u‖ (§8.8: 3.415940 for p=[3,4], g=[1,1]); the λ=0 group
    has none. deepspeed: the clamped ratio on every group (§8.7: 0.3)."""

    def run(variant: str, **kwargs):
        decayed = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
        plain = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
        optimizer = Lamb(
            [{"params": [decayed], "weight_decay": 0.01}, {"params": [plain], "weight_decay": 0.0}],
            lr=0.01,
            variant=variant,
            **kwargs,
        )
        decayed.grad, plain.grad = torch.ones(2), torch.ones(2)
        optimizer.step()
        return optimizer.statistics()

    nvlamb = run("nvlamb")
    assert nvlamb["trust_ratio_mean_group0"] == pytest.approx(3.415940, abs=1e-5)
    assert "trust_ratio_mean_group1" not in nvlamb
    deepspeed = run("deepspeed", bias_correction=False, min_coeff=0.01, max_coeff=0.3)
    assert deepspeed["trust_ratio_max_group0"] == pytest.approx(0.3)
    assert deepspeed["trust_ratio_min_group1"] == pytest.approx(0.3)


def test_global_grad_norm_equals_the_norm_of_norms_and_flags_inf_nan():
    from pretrain.optim.base import global_grad_norm, global_norm

    torch.manual_seed(0)
    grads = [torch.randn(3, 5), torch.randn(7).t(), torch.randn(4, 6).t()]  # non-contiguous too
    expected = global_norm(F.grad_norms(grads))
    torch.testing.assert_close(global_grad_norm(grads), expected, rtol=1e-6, atol=0)
    low = [g.bfloat16() for g in grads]  # not fp32: the multi-tensor norm path
    torch.testing.assert_close(global_grad_norm(low), global_norm(F.grad_norms(low)), rtol=1e-6, atol=0)
    assert global_grad_norm(low).dtype == torch.float32
    assert float(global_grad_norm([])) == 0.0
    for bad in (float("inf"), float("nan")):
        broken = [g.clone() for g in grads]
        broken[1][2] = bad
        assert not torch.isfinite(global_grad_norm(broken))
