"""The multi-tensor path (`pretrain.optim.kernel_path`: what LAMB's and 1-bit LAMB's eager steps take on
CUDA), run here on CPU tensors: the reference's results, and a number of ops per step that does not grow
with the number of tensors.

The ops are counted at the dispatcher (`OpCounter`): every op that runs a kernel counts once, except a
multi-tensor (foreach) op whose lists do not match tensor for tensor in shape and strides (a 0-dim tensor
per tensor, say): CUDA runs such an op tensor by tensor, so it counts once per tensor. Views and
allocations launch nothing and do not count.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pretrain.optim import Lamb, OnebitLamb, Stage, marginals, param_groups
from pretrain.optim import functional as F
from pretrain.optim.base import Workspace
from pretrain.optim.kernel_path import KernelPath, forced, kernel_path
from pretrain.optim.onebit_lamb import DEEPSPEED_ALGORITHM, ONEBIT_LAMB_ALGORITHM

_NO_KERNEL = {"aten.empty.memory_format", "aten.empty_like.default", "aten.empty_strided.default"}


class OpCounter(TorchDispatchMode):
    """Kernels an op sequence would launch on CUDA (module docstring); `syncs`: reads of a device value."""

    def __init__(self) -> None:
        super().__init__()
        self.ops, self.syncs = 0, 0
        self.names: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name == "aten._local_scalar_dense.default":
            self.syncs += 1
        elif not func.is_view and name not in _NO_KERNEL and name not in ("aten.detach.default",):
            count = self._foreach_launches(args) if "_foreach_" in name else 1
            self.ops += count
            self.names[name] = self.names.get(name, 0) + count
        return func(*args, **(kwargs or {}))

    @staticmethod
    def _foreach_launches(args) -> int:
        lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
        for tensors in zip(*lists):
            if any(t.shape != tensors[0].shape or t.stride() != tensors[0].stride() for t in tensors):
                return len(lists[0])  # CUDA's per-tensor path
        return 1


def _bert(layers: int) -> torch.nn.Module:
    """A BERT of `layers` layers, tiny widths (BERT-Large: 24 layers, 398 tensors)."""
    from transformers import BertConfig, BertForPreTraining

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=layers, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=24,
    )  # fmt: skip
    return BertForPreTraining(config)


def _set_gradients(model: torch.nn.Module, step: int) -> None:
    generator = torch.Generator().manual_seed(step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator) * 0.01


def _lamb(model: torch.nn.Module) -> Lamb:
    return Lamb(param_groups(model, 0.01), lr=1e-3)


def _onebit(model: torch.nn.Module) -> OnebitLamb:
    groups = param_groups(model, 0.01, max_seq_length=16, row_scales=True)
    return OnebitLamb(
        groups, lr=1e-3, freeze_step=2, eps=1e-6, algorithm=ONEBIT_LAMB_ALGORITHM, variance_refresh=8
    )


def _counted_step(build, layers: int, steps: int) -> OpCounter:
    """Ops of step `steps` + 1 of `build`'s optimizer (the earlier steps: state, the freeze, the divisors)."""
    model = _bert(layers)
    optimizer = build(model)
    with forced(KernelPath.multi_tensor):
        for step in range(steps):
            _set_gradients(model, step)
            optimizer.step()
        _set_gradients(model, steps)
        with OpCounter() as counter:
            optimizer.step()
    return counter


def test_the_cpu_takes_the_cpu_path_and_every_other_device_the_multi_tensor_one():
    assert kernel_path(torch.device("cpu")) is KernelPath.cpu
    assert kernel_path(torch.device("cuda", 0)) is KernelPath.multi_tensor
    assert kernel_path(torch.device("meta")) is KernelPath.multi_tensor
    with forced("multi_tensor"):
        assert kernel_path(torch.device("cpu")) is KernelPath.multi_tensor
    assert kernel_path(torch.device("cpu")) is KernelPath.cpu


@pytest.mark.parametrize(("name", "build", "steps"), [("lamb", _lamb, 1), ("onebit_lamb", _onebit, 3)])
def test_a_steps_op_count_does_not_grow_with_the_number_of_tensors(name, build, steps):
    shallow, deep = _counted_step(build, 2, steps), _counted_step(build, 8, steps)
    tensors = (len(list(_bert(2).parameters())), len(list(_bert(8).parameters())))
    assert tensors[1] - tensors[0] == 6 * 16  # 16 tensors a layer
    assert shallow.ops == deep.ops, (name, shallow.names, deep.names)
    assert shallow.syncs == deep.syncs


def test_the_count_sees_per_tensor_values_that_would_run_tensor_by_tensor(monkeypatch):
    """The counter has teeth: with the ratios as 0-dim tensors (the reference's `per_tensor`) the same
    step's count grows by one op per weight matrix added (nvlamb's ratios: the group with weight decay,
    six matrices a layer)."""
    reference = F.per_tensor
    monkeypatch.setattr(F, "per_tensor", lambda values, like, counts=None: reference(values, like))
    shallow, deep = _counted_step(_lamb, 2, 1), _counted_step(_lamb, 8, 1)
    assert deep.ops - shallow.ops == 6 * 6


def test_the_one_bit_step_counted_is_a_compression_step_that_adds_the_marginals():
    model = _bert(2)
    optimizer = _onebit(model)
    with forced(KernelPath.multi_tensor):
        for step in range(3):
            _set_gradients(model, step)
            optimizer.step()
        assert optimizer.stage is Stage.compression and not optimizer._refresh_next()
        _set_gradients(model, 3)
        with OpCounter() as counter:
            optimizer.step()
    assert counter.names.get("aten.sum.dim_IntList", 0) > 0  # the square marginals, per shape


def _lists(generator: torch.Generator) -> list[list[torch.Tensor]]:
    """(params, grads, exp_avgs, exp_avg_sqs): row-major tensors, a column-major matrix and a zero one."""
    shapes = [(5, 3), (7,), (4, 6), (2, 2, 3)]
    lists = [[torch.randn(s, generator=generator) for s in shapes] for _ in range(3)]
    lists.append([torch.rand(s, generator=generator) for s in shapes])
    for tensors in lists:
        tensors.append(torch.randn(3, 5, generator=generator).t())  # column-major 5 x 3
    lists[3][-1].abs_()  # the second moments are not negative
    lists[0][1].zero_()  # a zero-initialized bias: its ratio falls back to 1
    return lists


def _pair(generator_seed: int) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    lists = _lists(torch.Generator().manual_seed(generator_seed))
    return lists, [[t.clone() if t.is_contiguous() else t.t().clone().t() for t in ts] for ts in lists]


def _counts(tensors: list[torch.Tensor]) -> torch.Tensor:
    return Workspace().counts(tensors)


@pytest.mark.parametrize("nvlamb", [True, False])
def test_the_lamb_update_with_expanded_ratios_is_the_references_bit_for_bit(nvlamb: bool):
    """The same products per element (p + (−η)·u·c), with c a whole tensor instead of a 0-dim one."""
    reference, expanded = _pair(1)
    hyper = dict(
        nvlamb=nvlamb, lr=0.01, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, bias_correction1=0.1,
        bias_correction2_sqrt=0.0316, grad_scale=0.5, min_coeff=0.01, max_coeff=0.3,
    )  # fmt: skip
    want = F.lamb_update_(*reference, **hyper)
    got = F.lamb_update_(*expanded, **hyper, counts=_counts(expanded[0]))
    assert torch.equal(got, want)
    for a, b in zip(expanded, reference):
        assert all(torch.equal(x, y) and x.stride() == y.stride() for x, y in zip(a, b))


@pytest.mark.parametrize("rooted", [True, False])
def test_the_clamped_trust_ratio_step_with_expanded_ratios_is_the_references_bit_for_bit(rooted: bool):
    (params, _, exp_avgs, divisors), (params2, _, exp_avgs2, divisors2) = _pair(2)
    hyper = dict(lr=0.01, eps=1e-6, weight_decay=0.01, min_coeff=0.0, max_coeff=10.0, rooted=rooted)
    want = F.clamped_trust_ratio_step_(params, exp_avgs, divisors, **hyper)
    got = F.clamped_trust_ratio_step_(params2, exp_avgs2, divisors2, **hyper, counts=_counts(params2))
    assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(params2, params))


def test_the_frozen_rule_with_expanded_factors_is_the_references_bit_for_bit():
    reference, expanded = _pair(3)
    k = len(reference[0])
    coeffs, last = torch.full((k,), 0.5), torch.ones(k)
    rule = dict(
        lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, factor_min=0.5, factor_max=4.0,
        factor_threshold=0.1,
    )  # fmt: skip
    params, exp_avgs, prev, fresh = reference
    params2, exp_avgs2, prev2, fresh2 = expanded
    v, v2 = [t.abs() for t in fresh], [t.abs() for t in fresh2]
    fresh, fresh2 = [t * 0.5 for t in v], [t * 0.5 for t in v2]
    want = F.compressed_lamb_update_(params, exp_avgs, prev, v, fresh, coeffs, last, **rule)
    got = F.compressed_lamb_update_(
        params2, exp_avgs2, prev2, v2, fresh2, coeffs, last, **rule, counts=_counts(params2)
    )
    assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(params2, params))


def test_per_tensor_values_take_each_tensors_shape_and_strides():
    like = [torch.zeros(2, 3), torch.zeros(4), torch.zeros(3, 5).t(), torch.zeros(())]
    values = torch.tensor([1.0, 2.0, 3.0, 4.0])
    expanded = F.per_tensor(values, like, _counts(like))
    assert [(e.shape, e.stride()) for e in expanded] == [(t.shape, t.stride()) for t in like]
    assert [float(e.min()) for e in expanded] == [float(e.max()) for e in expanded] == [1.0, 2.0, 3.0, 4.0]
    assert [float(v) for v in F.per_tensor(values, like)] == [1.0, 2.0, 3.0, 4.0]  # the reference: 0-dim


@pytest.mark.parametrize("name", ["lamb", "onebit_lamb", "onebit_lamb_deepspeed", "onebit_lamb_ffn_rows"])
def test_whole_steps_on_the_multi_tensor_path_follow_the_cpu_path(name: str):
    """Eight steps (1-bit: four in the compression stage, one with a variance refresh) on each path. Not
    bit for bit: the CPU path's numba loops and BLAS norms sum in another order than ATen's foreach norms,
    and the marginals are summed per shape, so the results agree to float rounding (rtol 1e-5 after
    eight steps, the drift of a few ulps a step). `onebit_lamb_ffn_rows`: `optim.ffn_row_scales`' groups
    (the FFN intermediates in the row-scaled group)."""
    results = []
    for path in (KernelPath.cpu, KernelPath.multi_tensor):
        model = _bert(2)
        if name == "lamb":
            optimizer = _lamb(model)
        else:
            ours = name != "onebit_lamb_deepspeed"
            algorithm = ONEBIT_LAMB_ALGORITHM if ours else DEEPSPEED_ALGORITHM
            groups = param_groups(
                model,
                0.01,
                max_seq_length=16,
                row_scales=algorithm.exchange.compression.row_scales,
                ffn_row_scales=name == "onebit_lamb_ffn_rows",
            )
            refresh = 2 if ours else 0
            optimizer = OnebitLamb(
                groups, lr=1e-3, freeze_step=4, algorithm=algorithm, variance_refresh=refresh
            )
        with forced(path):
            for step in range(8):
                _set_gradients(model, step)
                optimizer.step()
        results.append([p.detach().clone() for p in model.parameters()])
    for cpu, multi in zip(*results):
        torch.testing.assert_close(multi, cpu, rtol=1e-5, atol=1e-7)


def test_multi_tensor_marginals_sum_each_shape_in_one_reduction():
    """Matrices of one shape, interleaved with others (as BERT's layers have them), added into their own
    sums: the torch path's up to fp32 summation order."""
    generator = torch.Generator().manual_seed(5)
    shapes = [(4, 3), (3, 4), (4, 3), (5, 2), (4, 3), (3, 4)]
    matrices = [torch.randn(s, generator=generator) for s in shapes]
    start = [
        (torch.rand(m.shape[0], generator=generator), torch.rand(m.shape[1], generator=generator))
        for m in matrices
    ]
    expected = [(r.clone(), c.clone()) for r, c in start]
    for matrix, (rows, cols) in zip(matrices, expected):
        marginals.torch_add_square_marginals(matrix, rows, cols, Workspace(), 0.5)
    got = [(r.clone(), c.clone()) for r, c in start]
    with OpCounter() as counter:
        marginals.multi_tensor_marginals(matrices, got, Workspace(), 0.5)
    for (rows, cols), (want_rows, want_cols) in zip(got, expected):
        torch.testing.assert_close(rows, want_rows, rtol=1e-6, atol=0)
        torch.testing.assert_close(cols, want_cols, rtol=1e-6, atol=0)
    assert counter.names["aten.sum.dim_IntList"] == 2 * 3  # three shapes
    assert counter.ops == 3 + 2 * 3 + 2  # copy, scale, square; two sums per shape; two adds
