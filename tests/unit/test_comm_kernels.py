"""The fused numba passes of the compressed allreduce equal the torch reference bit for bit, and the
choice between them (`get_kernels`) falls back to torch where numba cannot run."""

from __future__ import annotations

import sys

import pytest
import torch

from pretrain.comm import kernels as kernels_module
from pretrain.comm.compressed_allreduce import SignScale, _RunPlan
from pretrain.comm.kernels import NumbaKernels, TorchKernels, get_kernels
from pretrain.comm.layout import Run
from pretrain.comm.packing import TorchSignPacker

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


def _scales(plan: _RunPlan, seed: int, rows: int | None = None) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    shape = (plan.num_segments,) if rows is None else (rows, plan.num_segments)
    return torch.rand(shape, generator=generator) + 0.1


def _pair() -> tuple[TorchKernels, NumbaKernels]:
    return TorchKernels(TorchSignPacker()), NumbaKernels()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compress_packs_and_feeds_back_the_error_like_torch(layout):
    plan = _RunPlan(LAYOUTS[layout], SignScale.rms, torch.device("cpu"))
    scales = _scales(plan, 1)
    results = []
    for implementation in _pair():
        values, packed = _values(0), torch.empty(NUMEL // 8, dtype=torch.uint8)
        implementation.compress_(values, scales, plan, packed, scratch=torch.empty(NUMEL))
        results.append((values, packed))
    (torch_values, torch_packed), (numba_values, numba_packed) = results
    assert torch.equal(numba_packed, torch_packed)
    assert torch.equal(numba_values, torch_values)
    # and what that is: the signs of the input, minus each segment's scale times them
    assert torch.equal(numba_packed, TorchSignPacker().pack(_values(0)))
    assert numba_values[7] == -scales[0]  # +0.0 packs as + (first segment of the "runs" layout too)


def test_the_compress_pass_is_vectorised():
    """Regression (issue #15): the whole-byte loop of `compress_` ran over range(first, first + count) of the
    whole buffer, which LLVM did not vectorise on this project's AMD EPYC machine: 6.6 ns per element,
    against 0.5 for `decode_`, which moves as much memory. Over views counted from 0 it takes 0.6 ns.
    Here: compress within 4x decode's time per element (best of 5, 4M elements in rows of 1,024)."""
    import time

    numel = 1 << 22
    numba_kernels = NumbaKernels()
    plan = _RunPlan([Run(0, numel // 1024, 1024)], SignScale.mean_abs, torch.device("cpu"))
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


@pytest.mark.parametrize("sources", [2, 3, 4])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_accumulate_averages_the_sources_in_worker_order_like_torch(layout, sources):
    plan = _RunPlan(LAYOUTS[layout], SignScale.mean_abs, torch.device("cpu"))
    packer = TorchSignPacker()
    signs = torch.stack([packer.pack(_values(10 + source)) for source in range(sources)])
    scales = _scales(plan, 2, rows=sources)
    results = []
    for implementation in _pair():
        error = _values(3) * 1e-3
        implementation.accumulate_(error, signs, scales, plan, scratch=torch.empty(sources * NUMEL))
        results.append(error)
    assert torch.equal(results[1], results[0])
    assert not torch.equal(results[1], _values(3) * 1e-3)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_decode_like_torch(layout):
    plan = _RunPlan(LAYOUTS[layout], SignScale.rms, torch.device("cpu"))
    packed = TorchSignPacker().pack(_values(4))
    scales = _scales(plan, 5)
    decoded = []
    for implementation in _pair():
        out = torch.full((NUMEL,), float("nan"))
        implementation.decode_(packed, scales, plan, out)
        decoded.append(out)
    assert torch.equal(decoded[1], decoded[0])
    expected = scales.expand(NUMEL) if layout == "single" else scales[:5].repeat_interleave(24)
    assert torch.equal(decoded[1].abs()[: expected.numel()], expected)


def test_the_choice_of_kernels(monkeypatch):
    packer = TorchSignPacker()
    monkeypatch.delenv(kernels_module.KERNELS_ENV, raising=False)
    assert get_kernels("cpu", packer).name == "numba"
    assert get_kernels("cpu", packer, "torch").name == "torch"
    assert get_kernels("cuda", packer).name == "torch"  # numba's loops are CPU code
    with pytest.raises(ValueError, match="CPU buffers only"):
        get_kernels("cuda", packer, "numba")
    monkeypatch.setenv(kernels_module.KERNELS_ENV, "torch")
    assert get_kernels("cpu", packer).name == "torch"
    monkeypatch.setenv(kernels_module.KERNELS_ENV, "fast")
    with pytest.raises(ValueError, match=r"BERT_LAMB_COMM_KERNELS/kernels must be one of auto, torch, numba"):
        get_kernels("cpu", packer)


def test_without_numba_the_torch_kernels_are_used(monkeypatch):
    monkeypatch.delenv(kernels_module.KERNELS_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "numba", None)  # `import numba` now raises ImportError
    kernels_module._numba_functions.cache_clear()
    try:
        assert kernels_module.numba_unavailable_reason().startswith("numba is not installed")
        assert get_kernels("cpu", TorchSignPacker()).name == "torch"
        with pytest.raises(ValueError, match="kernels=numba: numba is not installed"):
            get_kernels("cpu", TorchSignPacker(), "numba")
    finally:
        kernels_module._numba_functions.cache_clear()


def test_a_numba_that_cannot_compile_here_falls_back_too(monkeypatch):
    def unusable():
        raise RuntimeError("cannot cache function: no locator available")

    monkeypatch.delenv(kernels_module.KERNELS_ENV, raising=False)
    monkeypatch.setattr(kernels_module, "_numba_functions", unusable)
    assert kernels_module.numba_unavailable_reason() == (
        "numba cannot be used here (RuntimeError: cannot cache function: no locator available)"
    )
    assert get_kernels("cpu", TorchSignPacker()).name == "torch"
