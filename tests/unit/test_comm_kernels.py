"""The fused passes of the compressed allreduce (numba's loops, and the torch.compile'd kernels of
`pretrain.comm.compiled_kernels`) equal the torch reference bit for bit, and the choice between them
(`get_kernels`) falls back to torch where numba cannot run."""

from __future__ import annotations

import itertools
import sys

import pytest
import torch

from pretrain.comm import compiled_kernels as compiled_kernels_module
from pretrain.comm import kernels as kernels_module
from pretrain.comm import numba_support
from pretrain.comm.compiled_kernels import CompiledKernels, SegmentMap
from pretrain.comm.kernels import NumbaKernels, TorchKernels, describe_kernels, get_kernels
from pretrain.comm.layout import Run
from pretrain.comm.numba_support import SUM_BLOCK
from pretrain.comm.packing import TorchSignPacker
from pretrain.comm.plan import RunPlan, SignScale

# Runs that tile 1,000 elements: rows aligned and not to bytes, one-element segments (exact vectors),
# a row split by nothing in particular, and a long single run that ends the buffer.
RUNS = [Run(0, 5, 24), Run(120, 1, 3), Run(123, 13, 1), Run(136, 7, 9), Run(199, 1, 801)]
NUMEL = 1000
LAYOUTS = {"single": [Run(0, 1, NUMEL)], "runs": RUNS}


def _values(seed: int, numel: int = NUMEL) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=generator) * torch.linspace(0.01, 3.0, numel)
    values[7], values[8], values[130] = 0.0, -0.0, -0.0  # zeros of both signs pack as +
    return values


def _scales(plan: RunPlan, seed: int, rows: int | None = None) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    shape = (plan.num_segments,) if rows is None else (rows, plan.num_segments)
    return torch.rand(shape, generator=generator) + 0.1


FUSED = ("numba", "compiled")


def _pair(fused: str) -> tuple[TorchKernels, NumbaKernels | CompiledKernels]:
    return TorchKernels(TorchSignPacker()), NumbaKernels() if fused == "numba" else CompiledKernels("cpu")


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compress_packs_and_feeds_back_the_error_like_torch(layout, fused):
    plan = RunPlan(LAYOUTS[layout], SignScale.rms, torch.device("cpu"))
    scales = _scales(plan, 1)
    results = []
    for implementation in _pair(fused):
        values, packed = _values(0), torch.empty(NUMEL // 8, dtype=torch.uint8)
        implementation.compress_(values, scales, plan, packed, scratch=torch.empty(NUMEL))
        results.append((values, packed))
    (torch_values, torch_packed), (fused_values, fused_packed) = results
    assert torch.equal(fused_packed, torch_packed)
    assert torch.equal(fused_values, torch_values)
    # and what that is: the signs of the input, minus each segment's scale times them
    assert torch.equal(fused_packed, TorchSignPacker().pack(_values(0)))
    assert fused_values[7] == -scales[0]  # +0.0 packs as + (first segment of the "runs" layout too)


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("sign_scale", list(SignScale))
@pytest.mark.parametrize("layout", [*LAYOUTS, "long"])
def test_the_worker_step_adds_and_takes_the_scales_like_torch(layout, sign_scale, fused):
    """`add_scales_` (y = x + e and the scales of y; numba fuses the two for mean_abs) equals the reference's
    addition and `plan.scales`, bit for bit; "long": segments of several of the norms' sum blocks."""
    numel = NUMEL if layout != "long" else 3 * SUM_BLOCK + 40
    runs = LAYOUTS.get(layout) or [Run(0, 1, 5), Run(5, 2, SUM_BLOCK + 3), Run(8203, 1, 4125)]
    plan = RunPlan(runs, sign_scale, torch.device("cpu"))
    assert plan.tiles(numel)
    results = []
    for implementation in _pair(fused):
        error, scales = _values(4, numel) * 1e-2, torch.empty(plan.num_segments)
        returned = implementation.add_scales_(error, _values(5, numel), plan, scales)
        assert returned is scales
        results.append((error, scales))
    (torch_error, torch_scales), (fused_error, fused_scales) = results
    assert torch.equal(fused_error, torch_error)
    assert torch.equal(fused_error, _values(4, numel) * 1e-2 + _values(5, numel))
    assert torch.equal(fused_scales, torch_scales)
    assert torch.equal(fused_scales, plan.scales(torch_error, torch.empty(plan.num_segments)))


def test_the_fused_worker_step_stays_in_place_where_runs_do_not_tile():
    """A plan that leaves elements out (or does not start at 0) takes the unfused path: every element of
    the error is still added to, none is skipped."""
    plan = RunPlan([Run(8, 2, 16)], SignScale.mean_abs, torch.device("cpu"))
    assert not plan.tiles(40)
    error, values = torch.zeros(40), torch.arange(40.0)
    NumbaKernels().add_scales_(error, values, plan, torch.empty(2))
    assert torch.equal(error, values)


def test_the_compress_pass_is_vectorised():
    """Regression (issue #15): the whole-byte loop of `compress_` ran over range(first, first + count) of the
    whole buffer, which LLVM did not vectorise on this project's AMD EPYC machine: 6.6 ns per element,
    against 0.5 for `decode_`, which moves as much memory. Over views counted from 0 it takes 0.6 ns.
    Here: compress within 4x decode's time per element (best of 5, 4M elements in rows of 1,024)."""
    import time

    numel = 1 << 22
    numba_kernels = NumbaKernels()
    plan = RunPlan([Run(0, numel // 1024, 1024)], SignScale.mean_abs, torch.device("cpu"))
    scales = _scales(plan, 3)
    values = torch.randn(numel, generator=torch.Generator().manual_seed(3))
    packed, out = torch.empty(numel // 8, dtype=torch.uint8), torch.empty(numel)

    def best(call) -> float:
        call()  # numba's first call compiles (or loads its cache)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        return min(times)

    compress = best(lambda: numba_kernels.compress_(values, scales, plan, packed, scratch=out))
    decode = best(lambda: numba_kernels.decode_(packed, scales, plan, out))
    per_element = f"compress {compress / numel * 1e9:.2f} ns/element, decode {decode / numel * 1e9:.2f}"
    assert compress < 4 * decode, per_element


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("sources", [2, 3, 4])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_accumulate_averages_the_sources_in_worker_order_like_torch(layout, sources, fused):
    plan = RunPlan(LAYOUTS[layout], SignScale.mean_abs, torch.device("cpu"))
    packer = TorchSignPacker()
    signs = torch.stack([packer.pack(_values(10 + source)) for source in range(sources)])
    scales = _scales(plan, 2, rows=sources)
    results = []
    for implementation in _pair(fused):
        error = _values(3) * 1e-3
        implementation.accumulate_(error, signs, scales, plan, scratch=torch.empty(sources * NUMEL))
        results.append(error)
    assert torch.equal(results[1], results[0])
    assert not torch.equal(results[1], _values(3) * 1e-3)


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_decode_like_torch(layout, fused):
    plan = RunPlan(LAYOUTS[layout], SignScale.rms, torch.device("cpu"))
    packed = TorchSignPacker().pack(_values(4))
    scales = _scales(plan, 5)
    decoded = []
    for implementation in _pair(fused):
        out = torch.full((NUMEL,), float("nan"))
        implementation.decode_(packed, scales, plan, out)
        decoded.append(out)
    assert torch.equal(decoded[1], decoded[0])
    expected = scales.expand(NUMEL) if layout == "single" else scales[:5].repeat_interleave(24)
    assert torch.equal(decoded[1].abs()[: expected.numel()], expected)


@pytest.mark.parametrize("fused", FUSED)
def test_decode_chunks_like_torch(fused):
    """n chunks with their own plans, scales at their offsets (the compiled kernels decode all chunks in one
    call, through one map of the whole buffer)."""
    chunk_plans = [
        RunPlan([Run(0, 1, 200)], SignScale.rms, torch.device("cpu")),
        RunPlan([Run(0, 4, 24), Run(96, 13, 1), Run(109, 1, 91)], SignScale.rms, torch.device("cpu")),
        RunPlan([Run(0, 25, 8)], SignScale.rms, torch.device("cpu")),
    ]
    offsets = [0, 1, 1 + chunk_plans[1].num_segments]
    scales = torch.rand(offsets[-1] + chunk_plans[2].num_segments, generator=torch.Generator().manual_seed(6))
    signs = torch.stack([TorchSignPacker().pack(_values(20 + j, 200)) for j in range(3)])
    decoded = []
    for implementation in _pair(fused):
        out = torch.full((600,), float("nan"))
        implementation.decode_chunks_(signs, scales, chunk_plans, offsets, out)
        decoded.append(out)
    assert torch.equal(decoded[1], decoded[0])
    assert decoded[1][200:296].abs().unique().numel() == 4  # chunk 1's four rows, four scales


def test_the_segment_map_gives_every_element_its_segment():
    """`SegmentMap`: per byte the first element's segment and the bits of the elements that start a new
    one; the compiled kernels' popcount over them names each element's segment (rows of 24 and of 9, 13
    one-element segments, a long run: starts inside bytes and several per byte)."""
    from pretrain.comm.compiled_kernels import _plan_runs, _segments

    plan = RunPlan(RUNS, SignScale.rms, torch.device("cpu"))
    segment_map = SegmentMap.of_runs(_plan_runs(plan), NUMEL, torch.device("cpu"))
    expected = torch.cat(
        [
            torch.arange(first, first + rows).repeat_interleave(length)
            for _, rows, length, first in _plan_runs(plan)
        ]
    )
    assert torch.equal(_segments(segment_map.first, segment_map.steps).reshape(-1), expected)
    assert segment_map.first.dtype == torch.int32 and segment_map.steps.numel() == NUMEL // 8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_compiled_kernels_on_cuda_equal_the_torch_kernels_on_cuda_and_the_cpu():
    """Triton's code for the three passes (division rounded as IEEE, subnormals kept) against the torch
    kernels on the same GPU and on the CPU: every byte and every float equal. (The torch kernels divided the
    accumulated error by n as a Python number, which CUDA turns into a multiplication by 1/n: 501 of 1000
    elements 1 ulp off the CPU's at n = 3 on an H200, 2026-11-28; they divide by a device tensor now.)"""
    from pretrain.comm.packing import get_packer

    cuda = torch.device("cuda")
    plan = RunPlan(RUNS, SignScale.mean_abs, cuda)
    scales, sources = _scales(plan, 7), 3
    signs = torch.stack([TorchSignPacker().pack(_values(30 + source)) for source in range(sources)])
    many_scales = _scales(plan, 8, rows=sources)
    results = []
    for implementation, device in [
        (TorchKernels(TorchSignPacker()), torch.device("cpu")),
        (TorchKernels(get_packer(cuda)), cuda),
        (CompiledKernels(cuda), cuda),
    ]:
        device_plan = RunPlan(RUNS, SignScale.mean_abs, device)
        values, packed = _values(9).to(device), torch.empty(NUMEL // 8, dtype=torch.uint8, device=device)
        implementation.compress_(values, scales.to(device), device_plan, packed, torch.empty_like(values))
        error = _values(10).to(device) * 1e-3
        implementation.accumulate_(
            error,
            signs.to(device),
            many_scales.to(device),
            device_plan,
            torch.empty(sources * NUMEL, device=device),
        )
        decoded = torch.empty(NUMEL, device=device)
        implementation.decode_(packed, scales.to(device), device_plan, decoded)
        results.append([t.cpu() for t in (values, packed, error, decoded)])
    for other in results[1:]:
        for got, expected in zip(other, results[0], strict=True):
            assert torch.equal(got, expected)


def test_the_choice_of_kernels(monkeypatch):
    packer = TorchSignPacker()
    monkeypatch.delenv(kernels_module.KERNELS_ENV, raising=False)
    assert get_kernels("cpu", packer).name == "numba"
    assert get_kernels("cpu", packer, "torch").name == "torch"
    # CUDA buffers: the compiled kernels where Triton is there (faster on an H200 and bitwise the reference),
    # the torch kernels where it is not; numba's loops are CPU code
    real_reason = compiled_kernels_module.compiled_unavailable_reason  # kept for the CPU buffers below
    monkeypatch.setattr(compiled_kernels_module, "compiled_unavailable_reason", lambda device: None)
    assert get_kernels("cuda", packer).name == "compiled"
    monkeypatch.setattr(
        compiled_kernels_module,
        "compiled_unavailable_reason",
        lambda device: "no Triton" if torch.device(device).type == "cuda" else real_reason(device),
    )
    assert get_kernels("cuda", packer).name == "torch"
    with pytest.raises(ValueError, match="kernels=compiled: no Triton"):
        get_kernels("cuda", packer, "compiled")
    with pytest.raises(ValueError, match="CPU buffers only"):
        get_kernels("cuda", packer, "numba")
    monkeypatch.setenv(kernels_module.KERNELS_ENV, "torch")
    assert get_kernels("cpu", packer).name == "torch"
    assert get_kernels("cpu", packer, "compiled").name == "compiled"  # on CPU buffers: asked for by name
    monkeypatch.setenv(kernels_module.KERNELS_ENV, "fast")
    with pytest.raises(ValueError, match=r"BERT_LAMB_COMM_KERNELS/kernels must be one of auto, torch, numba"):
        get_kernels("cpu", packer)


def test_the_description_of_the_choice_names_the_packer_only_for_the_torch_kernels(monkeypatch):
    from pretrain.comm import packing

    monkeypatch.delenv(kernels_module.KERNELS_ENV, raising=False)
    assert describe_kernels("cpu") == "numba"
    assert describe_kernels("cpu", "compiled") == "compiled"
    assert describe_kernels("cpu", "torch") == "torch ops, torch packer"
    monkeypatch.setattr(compiled_kernels_module, "compiled_unavailable_reason", lambda device: "no Triton")
    monkeypatch.setattr(packing, "_import_cupy", lambda: None)
    assert describe_kernels("cuda") == "torch ops, torch packer"  # a GPU without Triton or cupy
    monkeypatch.setenv(kernels_module.KERNELS_ENV, "numba")
    with pytest.raises(ValueError, match="CPU buffers only"):
        describe_kernels("cuda")


def test_compiled_kernels_without_a_compiler_are_refused_with_the_reason(monkeypatch):
    from torch._inductor import cpp_builder

    from pretrain.comm.compiled_kernels import compiled_unavailable_reason

    def no_compiler():
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    assert (
        compiled_unavailable_reason("cpu")
        == "no C++ compiler for torch.compile on the CPU (no C++ compiler found)"
    )
    with pytest.raises(ValueError, match=r"kernels=compiled: no C\+\+ compiler"):
        get_kernels("cpu", TorchSignPacker(), "compiled")
    assert get_kernels("cpu", TorchSignPacker()).name == "numba"  # auto never picks it


def test_without_numba_the_torch_kernels_are_used(monkeypatch):
    monkeypatch.delenv(kernels_module.KERNELS_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "numba", None)  # `import numba` now raises ImportError
    numba_support.check_numba.cache_clear()
    try:
        assert kernels_module.numba_unavailable_reason().startswith("numba is not installed")
        assert get_kernels("cpu", TorchSignPacker()).name == "torch"
        with pytest.raises(ValueError, match="kernels=numba: numba is not installed"):
            get_kernels("cpu", TorchSignPacker(), "numba")
    finally:
        numba_support.check_numba.cache_clear()


def test_a_big_endian_cpu_falls_back_to_torch(monkeypatch):
    """The pack and expand loops read eight flag bytes as one little-endian uint64."""
    monkeypatch.delenv(kernels_module.KERNELS_ENV, raising=False)
    monkeypatch.setattr(sys, "byteorder", "big")
    assert kernels_module.numba_unavailable_reason() == "the numba kernels need a little-endian CPU"
    assert get_kernels("cpu", TorchSignPacker()).name == "torch"


def test_a_numba_that_cannot_compile_here_falls_back_too(monkeypatch):
    def unusable():
        raise RuntimeError("cannot cache function: no locator available")

    monkeypatch.delenv(kernels_module.KERNELS_ENV, raising=False)
    monkeypatch.setattr(numba_support, "check_numba", unusable)
    assert kernels_module.numba_unavailable_reason() == (
        "numba cannot be used here (RuntimeError: cannot cache function: no locator available)"
    )
    assert get_kernels("cpu", TorchSignPacker()).name == "torch"


def _source_case(runs, bounds, numel, grad_scale, seed=0):
    """A buffer of `numel` momenta whose tensors are the stretches `bounds` (the rest is pad, holding
    values of its own), their gradients and divisors, and the `live_step.momentum_source` over them."""
    from pretrain.optim.live_step import momentum_source

    generator = torch.Generator().manual_seed(seed)
    buffer = torch.randn(numel, generator=generator)
    views = [buffer[low:high] for low, high in bounds]
    grads = [torch.randn(high - low, generator=generator) for low, high in bounds]
    divisors = [torch.rand(high - low, generator=generator) + 1e-3 for low, high in bounds]
    source = momentum_source(buffer, views, grads, divisors, beta1=0.9, grad_scale=grad_scale)
    assert source is not None
    return buffer, source


@pytest.mark.parametrize("grad_scale", [1.0, 0.37])
@pytest.mark.parametrize("layout", ["runs", "long"])
def test_the_worker_step_forms_the_momentum_inside_its_pass_like_the_reference(layout, grad_scale):
    """`add_scales_` with a `MomentumSource` (issue #15: x = (β1·m + (1−β1)·s·g)/d formed in the worker's
    first pass instead of in a pass of its own): the same error and scales, bit for bit, as forming x into
    the buffer first and adding it (numba and torch), with tensors of one-element, short and several-block
    segments, and a pad that is not a source tensor (taken from the buffer as it is). The torch kernels
    take the source the unfused way."""
    if layout == "runs":
        runs, numel = RUNS, NUMEL
        bounds = [(0, 120), (120, 123), (123, 136), (136, 199)]  # the pad: [199, 1000)
    else:
        block = SUM_BLOCK
        runs = [Run(0, 1, 5), Run(5, 2, block + 3), Run(2 * block + 11, 3, 64), Run(2 * block + 203, 1, 29)]
        numel, bounds = 2 * block + 232, [(0, 5), (5, 2 * block + 11), (2 * block + 11, 2 * block + 203)]
    plan = RunPlan(runs, SignScale.mean_abs, torch.device("cpu"))
    assert plan.tiles(numel)
    results = []
    torch_kernels = TorchKernels(TorchSignPacker())  # with a source: forms x into the buffer, then adds
    for implementation, fused in [(NumbaKernels(), True), (NumbaKernels(), False), (torch_kernels, True)]:
        buffer, source = _source_case(runs, bounds, numel, grad_scale)
        error, scales = _values(4, numel) * 1e-2, torch.empty(plan.num_segments)
        if fused:
            implementation.add_scales_(error, buffer, plan, scales, source=source)
        else:
            source.fill(buffer)  # x formed into the buffer first, then added
            implementation.add_scales_(error, buffer, plan, scales)
        results.append((error, scales))
    for error, scales in results[1:]:
        assert torch.equal(results[0][0], error)
        assert torch.equal(results[0][1], scales)
    # and what x is: the momentum loop's arithmetic, the pad untouched by it
    buffer, source = _source_case(runs, bounds, numel, grad_scale)
    expected = buffer.clone()
    for (low, high), g, d in zip(bounds, source.grads, source.divisors):
        m = buffer[low:high]
        expected[low:high] = (0.9 * m.double() + 0.1 * (g * grad_scale).double()).float() / d
    torch.testing.assert_close(results[0][0], _values(4, numel) * 1e-2 + expected, rtol=1e-6, atol=1e-7)


def test_a_source_tensor_that_cuts_a_segment_is_refused():
    """The sums of a segment split between two tensors would be taken in another order: refused."""
    plan = RunPlan([Run(0, 1, 64), Run(64, 1, 64)], SignScale.mean_abs, torch.device("cpu"))
    buffer, source = _source_case(plan.runs, [(0, 32), (32, 64)], 128, 1.0)
    with pytest.raises(ValueError, match="inside a segment"):
        NumbaKernels().add_scales_(torch.zeros(128), buffer, plan, torch.empty(2), source=source)


@pytest.mark.parametrize("grad_scale", [1.0, 0.37])
def test_the_worker_pass_sums_the_square_marginals_as_their_own_loop_does(grad_scale):
    """A source with square marginals (1-bit LAMB's variance refresh): the fused pass adds each
    matrix's row and column sums of (s·g)² bit for bit as `marginals.add_square_marginals` does on its own
    (a row-major matrix with a scale per row, a column-major one with a scale per column, the pad after), and
    the torch kernels' unfused way (the source's `fill`) adds the same; the error and scales are unchanged by
    them."""
    from pretrain.optim.base import Workspace
    from pretrain.optim.live_step import momentum_source
    from pretrain.optim.marginals import add_square_marginals

    runs = [Run(0, 6, 40), Run(240, 16, 30), Run(720, 1, 80)]
    plan = RunPlan(runs, SignScale.mean_abs, torch.device("cpu"))

    def case():
        generator = torch.Generator().manual_seed(3)
        buffer = torch.randn(800, generator=generator)
        views = [buffer[:240].view(6, 40), buffer[240:720].view(16, 30).t()]
        grads = [torch.randn(6, 40, generator=generator), torch.randn(16, 30, generator=generator).t()]
        divisors = [
            torch.rand(6, 40, generator=generator) + 0.01,
            torch.rand(16, 30, generator=generator).t(),
        ]
        sums = [(torch.rand(6, generator=generator), torch.rand(40, generator=generator))]
        sums.append((torch.rand(30, generator=generator), torch.rand(16, generator=generator)))
        source = momentum_source(
            buffer, views, grads, divisors, beta1=0.9, grad_scale=grad_scale, marginals=list(sums)
        )
        assert source is not None and source.marginals is not None
        return buffer, grads, sums, source

    results = []
    for implementation in (NumbaKernels(), TorchKernels(TorchSignPacker())):
        buffer, grads, sums, source = case()
        error, scales = _values(4, 800) * 1e-2, torch.empty(plan.num_segments)
        implementation.add_scales_(error, buffer, plan, scales, source=source)
        results.append((error, scales, sums))
    _, grads, expected, _ = case()
    for grad, (rows, cols) in zip(grads, expected):
        add_square_marginals(grad, rows, cols, Workspace(), grad_scale)
    for error, scales, sums in results:
        assert torch.equal(error, results[0][0]) and torch.equal(scales, results[0][1])
        for (rows, cols), (want_rows, want_cols) in zip(sums, expected):
            assert torch.equal(rows, want_rows) and torch.equal(cols, want_cols)
    # and what they are: the sums of squares, to float32 rounding
    _, grads, start, _ = case()
    for grad, (rows, cols), (rows0, cols0) in zip(grads, results[0][2], start):
        squares = (grad.double() * grad_scale) ** 2
        torch.testing.assert_close(rows.double(), rows0.double() + squares.sum(1), rtol=1e-5, atol=0)
        torch.testing.assert_close(cols.double(), cols0.double() + squares.sum(0), rtol=1e-5, atol=0)


def _fused_case(with_source: bool):
    """A plan of per-row, per-column, one-element and one several-block segment, and a buffer whose first
    three stretches are source tensors (two matrices with square marginals, a vector) and the rest pad."""
    from pretrain.optim.live_step import momentum_source

    long = SUM_BLOCK + 72
    runs = [Run(0, 6, 40), Run(240, 16, 30), Run(720, 8, 1), Run(728, 1, long)]
    numel = 728 + long
    plan = RunPlan(runs, SignScale.mean_abs, torch.device("cpu"))
    generator = torch.Generator().manual_seed(5)
    buffer = torch.randn(numel, generator=generator)
    if not with_source:  # one-element segments: a tie to even, a scale past bfloat16's largest finite one
        buffer[720:722] = torch.tensor([1.0 + 2.0**-8, 3.4e38])
        return plan, buffer, None, None
    views = [buffer[:240].view(6, 40), buffer[240:720].view(16, 30).t(), buffer[720:728]]
    grads = [torch.randn(6, 40, generator=generator), torch.randn(16, 30, generator=generator).t()]
    grads.append(torch.randn(8, generator=generator))
    divisors = [torch.rand(6, 40, generator=generator) + 0.01, torch.rand(16, 30, generator=generator).t()]
    divisors.append(torch.rand(8, generator=generator) + 0.5)
    sums = [(torch.rand(6, generator=generator), torch.rand(40, generator=generator))]
    sums += [(torch.rand(30, generator=generator), torch.rand(16, generator=generator)), None]
    source = momentum_source(buffer, views, grads, divisors, beta1=0.9, grad_scale=0.37, marginals=sums)
    assert source is not None
    return plan, buffer, source, sums


@pytest.mark.parametrize("bfloat16", [False, True])
@pytest.mark.parametrize("with_source", [False, True])
@pytest.mark.parametrize(
    "cuts, rotate",
    [((), 0), ((120, 360, 728), 0), ((270, 721, 723), 0), ((120, 360, 728), 2)],
    ids=["whole", "bytes", "mid_byte", "chunks_rotated"],
)
def test_the_fused_worker_pass_equals_the_separate_passes(cuts, rotate, with_source, bfloat16):
    """`worker_pass` (issue #15: y = e + x, the scales, their rounding, the signs and e ← y − s·sign(y) per
    segment while it is in cache) gives the error, scales, signs and square marginals of `add_scales_`, the
    rounding and `compress_` bit for bit, in one stretch or cut at segment bounds (a matrix's rows in two
    stretches: its marginals carried over; stretches that end inside a byte, whose next call completes it),
    from a buffer or from a `MomentumSource`, with bfloat16 scales
    (a tie, and a scale rounding to infinity) or fp32 ones; the torch kernels do not fuse it. Rotated: the
    stretches from element 360 on first, then those before it (as the pipeline takes its own chunk last), the
    column-major matrix's later rows before its earlier ones: its marginals still summed in row order."""
    plan, _, _, _ = _fused_case(with_source)
    numel = plan.runs[-1].end
    results = []
    for fused in (True, False):
        _, buffer, source, sums = _fused_case(with_source)
        error, scales = _values(4, numel) * 1e-2, torch.empty(plan.num_segments)
        error[720:722] = 0.0  # y = x there: the tie stays a tie
        packed = torch.zeros(numel // 8, dtype=torch.uint8)
        kernels = NumbaKernels()
        if fused:
            worker = kernels.worker_pass(error, buffer, plan, scales, source, bfloat16=bfloat16)
            assert worker is not None
            stretches = list(itertools.pairwise([0, *cuts, numel]))
            for low, high in stretches[rotate:] + stretches[:rotate]:
                untouched = packed[high // 8 :].clone()
                worker.run(low, high, packed, 0)
                assert torch.equal(packed[high // 8 :], untouched)
        else:
            kernels.add_scales_(error, buffer, plan, scales, source=source)
            if bfloat16:
                scales.copy_(scales.to(torch.bfloat16))
            kernels.compress_(error, scales, plan, packed, scratch=buffer.clone())
        results.append((error, scales, packed, sums))
    (error, scales, packed, sums), (error0, scales0, packed0, sums0) = results
    assert torch.equal(error, error0) and torch.equal(scales, scales0) and torch.equal(packed, packed0)
    if bfloat16:
        assert torch.equal(scales, scales.to(torch.bfloat16).float())
        if not with_source:  # |1 + 2^-8 + e| near the tie, and 3.4e38 past bfloat16's largest finite value
            assert scales[6 + 16] == 1.0 and torch.isinf(scales[6 + 16 + 1])
    for pair, pair0 in zip(sums or [], sums0 or []):
        if pair is not None:
            assert torch.equal(pair[0], pair0[0]) and torch.equal(pair[1], pair0[1])
    assert TorchKernels(TorchSignPacker()).worker_pass(error, error, plan, scales) is None


def test_a_worker_pass_refuses_stretches_that_cut_a_segment_or_skip_a_byte():
    plan, buffer, _, _ = _fused_case(False)
    numel = plan.runs[-1].end
    worker = NumbaKernels().worker_pass(torch.zeros(numel), buffer, plan, torch.empty(plan.num_segments))
    packed = torch.zeros(numel // 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="element 104 is inside a segment"):
        worker.run(0, 104, packed, 0)  # inside the third row of 40
    worker.run(0, 270, packed, 0)
    with pytest.raises(ValueError, match=r"continues where it stopped \(270\) or starts on a whole byte"):
        worker.run(300, 360, packed, 0)  # neither: the signs of 264…269 would be lost
    with pytest.raises(ValueError, match="a multiple of 8, not after"):
        worker.run(270, 300, packed, 4)
    rms = RunPlan(plan.runs, SignScale.rms, torch.device("cpu"))
    assert NumbaKernels().worker_pass(torch.zeros(numel), buffer, rms, torch.empty(rms.num_segments)) is None


@pytest.mark.parametrize("sources", [2, 3])
@pytest.mark.parametrize("bfloat16", [False, True])
@pytest.mark.parametrize("cuts", [(), (120, 360, 728), (270, 721, 723)], ids=["whole", "bytes", "mid_byte"])
def test_the_fused_server_pass_equals_the_separate_passes(cuts, bfloat16, sources):
    """`server_pass` (issue #15: z = e + (Σ s_i·sign_i)/n, the scales, their rounding, the signs and
    e ← z − s·sign(z) per segment while it is in cache) gives the server error, scales and signs of
    `accumulate_`, `plan.scales`, the rounding and `compress_` bit for bit, whole or in stretches (some
    ending inside a byte), from 2 and 3 workers."""
    plan, _, _, _ = _fused_case(False)
    numel = plan.runs[-1].end
    generator = torch.Generator().manual_seed(11)
    signs = torch.randint(0, 256, (sources, numel // 8), dtype=torch.uint8, generator=generator)
    scales = torch.rand(sources, plan.num_segments, generator=generator).to(torch.bfloat16).float()
    results = []
    for fused in (True, False):
        error = _values(6, numel) * 1e-1
        out_scales = torch.empty(plan.num_segments)
        packed = torch.zeros(numel // 8, dtype=torch.uint8)
        kernels = NumbaKernels()
        if fused:
            server = kernels.server_pass(error, signs, scales, plan, out_scales, bfloat16=bfloat16)
            assert server is not None
            bounds = [0, *cuts, numel]
            for low, high in itertools.pairwise(bounds):
                server.run(low, high, packed, 0)
        else:
            kernels.accumulate_(error, signs, scales, plan, scratch=torch.empty(0))
            plan.scales(error, out=out_scales)
            if bfloat16:
                out_scales.copy_(out_scales.to(torch.bfloat16))
            kernels.compress_(error, out_scales, plan, packed, scratch=torch.empty(0))
        results.append((error, out_scales, packed))
    for got, expected in zip(*results):
        assert torch.equal(got, expected)
    assert TorchKernels(TorchSignPacker()).server_pass(error, signs, scales, plan, out_scales) is None
