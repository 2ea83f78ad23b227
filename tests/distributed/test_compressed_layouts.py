"""The compressed allreduce with segment scales and with virtual workers, against the reference model.

Each case runs the real engine on P gloo processes with k virtual workers each (n = P·k workers) for
several successive calls and compares every rank's output, and the error buffers, bitwise with the
single-process reference of n workers (`pretrain.comm.reference`): both do the same fp32 operations in
the same order, so with k virtual workers one process gives what k processes give. Layouts: DeepSpeed's
single scale, and one scale per row of an "embedding" and per tensor (rows split by chunk boundaries
included), with both sign scales, and with scales sent in bfloat16 (`scale_dtype`). Each case runs with
both implementations of the elementwise passes (`pretrain.comm.kernels`: torch ops and the fused numba
loops), which must both equal the reference bit for bit, and, with one worker per process, with the signs
sent in 3 pieces (`pipeline=3`, `pretrain.comm.pipeline`; with numba and mean |y| scales, the worker's step
fused and its stretches sent point to point) as well as in one. The torch.compile'd kernels
(`pretrain.comm.compiled_kernels`, the candidate for GPUs) go through the same cases in the slow tier (their
first compile takes a minute on 2 cores).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pretrain.comm import CompressedAllreduce, padded_numel
from pretrain.comm.layout import Block, ScaleLayout
from pretrain.comm.reference import ReferenceCompressedAllreduce
from tests.distributed.launcher import run_distributed

pytestmark = pytest.mark.distributed

UNPADDED = 700
KERNELS = ("torch", "numba")
PIECES = 3
CALLS = 4
# (processes, virtual workers per process)
SHAPES = [(1, 2), (1, 4), (2, 1), (2, 2), (3, 1), (4, 1)]
CASES = [
    ("single", "rms", "float32"),
    ("blocks", "rms", "float32"),
    ("blocks", "mean_abs", "float32"),
    ("single", "rms", "bfloat16"),
    ("elements", "mean_abs", "bfloat16"),  # the vector with a scale per element, as `exact_vectors`
]


def _layout(kind: str, numel: int, world_size: int) -> ScaleLayout | None:
    if kind == "single":
        return None
    used = 37 * 16 + 13 + 64  # an embedding of 37 rows of 16, a vector, a matrix, then the pad
    vector = Block(13, 1 if kind == "elements" else 13)
    blocks = [Block(37 * 16, 16), vector, Block(64, 64), Block(numel - used, numel - used)]
    return ScaleLayout.from_blocks(blocks, numel, world_size)


def _input(call: int, worker: int, numel: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * call + worker)
    values = torch.randn(numel, generator=generator) * torch.linspace(0.01, 3.0, numel)
    values[UNPADDED:] = 0.0
    return values


def _run(rank: int, processes: int, virtual: int, modes: list[str], kernel_choices=KERNELS) -> dict:
    world_size = processes * virtual
    numel = padded_numel(UNPADDED, world_size)
    results = {}
    pipelined = virtual == 1 and processes > 1
    variants = [(mode, kernels, 0) for mode in modes for kernels in kernel_choices]
    variants += [("native", kernels, PIECES) for kernels in kernel_choices] if pipelined else []
    for mode, kernels, pieces in variants:
        for kind, sign_scale, scale_dtype in CASES:
            engine = CompressedAllreduce(
                numel,
                layout=_layout(kind, numel, world_size),
                virtual_workers=virtual,
                sign_scale=sign_scale,
                collective_mode=mode,
                scale_dtype=scale_dtype,
                kernels=kernels,
                pipeline=pieces,
            )
            assert engine.kernels.name == kernels
            assert engine.pieces == max(1, pieces)
            outputs = []
            for call in range(CALLS):
                local = torch.stack([_input(call, rank * virtual + w, numel) for w in range(virtual)])
                out = torch.empty(numel)
                if virtual == 1:
                    out = engine(local[0].clone())
                else:
                    engine(local, out)
                outputs.append(out.numpy().copy())
            results[(mode, f"{kernels}/{pieces}", kind, sign_scale, scale_dtype)] = {
                "outputs": outputs,
                "worker_error": engine.worker_error.numpy().copy(),
                "server_error": engine.server_error.numpy().copy(),
                "bytes": engine.traffic.compressed_bytes,
                # the worker's step fused and sent stretch by stretch (`pipeline.fused_stretches`)
                "fused_stretches": engine._pipeline is not None and engine._pipeline.stretches is not None,
            }
    return results


# `make test`: virtual workers in one process, and 2 processes (pipelined, fused); the rest: slow tier
FAST_SHAPES = [(1, 2), (2, 1)]


@pytest.fixture(
    scope="module",
    params=[
        shape if shape in FAST_SHAPES else pytest.param(shape, marks=pytest.mark.slow) for shape in SHAPES
    ],
    ids=[f"p{p}k{k}" for p, k in SHAPES],
)
def shape_runs(request):
    processes, virtual = request.param
    modes = ["native", "all_gather"] if processes > 1 else ["native"]
    return processes, virtual, run_distributed(_run, processes, args=(virtual, modes))


def test_engine_equals_reference_bitwise(shape_runs):
    _assert_equal_to_reference(*shape_runs)
    # the fused phase one (issue #15) ran wherever it can: numba, segment scales of mean |y|, pipelined
    _processes, _virtual, results = shape_runs
    for (mode, kernels, kind, sign_scale, _), result in results[0].items():
        expected = kernels == "numba/3" and kind != "single" and sign_scale == "mean_abs"
        assert result["fused_stretches"] == expected, (mode, kernels, kind, sign_scale)


@pytest.mark.slow
@pytest.mark.parametrize("processes, virtual", [(1, 4), (2, 2), (3, 1)], ids=["p1k4", "p2k2", "p3k1"])
def test_the_compiled_kernels_equal_the_reference_bitwise(processes, virtual):
    modes = ["native", "all_gather"] if processes > 1 else ["native"]
    results = run_distributed(_run, processes, args=(virtual, modes, ("compiled",)))
    _assert_equal_to_reference(processes, virtual, results)
    assert {key[1] for key in results[0]} == {"compiled/0"} | ({"compiled/3"} if virtual == 1 else set())


def _assert_equal_to_reference(processes: int, virtual: int, results: list[dict]) -> None:
    world_size = processes * virtual
    numel = padded_numel(UNPADDED, world_size)
    for (mode, kernels, kind, sign_scale, scale_dtype), _ in results[0].items():
        reference = ReferenceCompressedAllreduce(
            numel, world_size, _layout(kind, numel, world_size), sign_scale, scale_dtype
        )
        for call in range(CALLS):
            expected = reference([_input(call, worker, numel) for worker in range(world_size)]).numpy()
            for rank in range(processes):
                got = results[rank][(mode, kernels, kind, sign_scale, scale_dtype)]["outputs"][call]
                assert np.array_equal(got, expected), (
                    mode,
                    kernels,
                    kind,
                    sign_scale,
                    scale_dtype,
                    call,
                    rank,
                )
        for rank in range(processes):
            result = results[rank][(mode, kernels, kind, sign_scale, scale_dtype)]
            workers = result["worker_error"].reshape(virtual, numel)
            servers = result["server_error"].reshape(virtual, -1)
            for w in range(virtual):
                assert np.array_equal(workers[w], reference.worker_errors[rank * virtual + w].numpy())
                assert np.array_equal(servers[w], reference.server_errors[rank * virtual + w].numpy())


def test_per_row_scales_cost_a_few_percent_of_the_signs(shape_runs):
    processes, virtual, results = shape_runs
    world_size = processes * virtual
    numel = padded_numel(UNPADDED, world_size)
    single = results[0][("native", "numba/0", "single", "rms", "float32")]["bytes"] / CALLS
    rows = results[0][("native", "numba/0", "blocks", "rms", "float32")]["bytes"] / CALLS
    segments = _layout("blocks", numel, world_size).total_chunk_segments
    assert rows - single == pytest.approx(8 * (world_size - 1) / world_size * (segments - world_size))
    # bfloat16 scales: 2 bytes each instead of 4, the signs unchanged
    single_bf16 = results[0][("native", "numba/0", "single", "rms", "bfloat16")]["bytes"] / CALLS
    assert single - single_bf16 == pytest.approx(4 * (world_size - 1) / world_size * world_size)
    elements = results[0][("native", "numba/0", "elements", "mean_abs", "bfloat16")]["bytes"] / CALLS
    segments = _layout("elements", numel, world_size).total_chunk_segments
    assert elements - single_bf16 == pytest.approx(
        4 * (world_size - 1) / world_size * (segments - world_size)
    )


def test_bfloat16_scales_round_trip_the_vector_it_sends_per_element():
    """With a scale per element, bfloat16 scales deliver each element of a first call to within
    bfloat16 rounding, and the error feedback returns the rounding on the next calls."""
    numel = padded_numel(UNPADDED, 2)
    reference = ReferenceCompressedAllreduce(numel, 2, _layout("elements", numel, 2), "mean_abs", "bfloat16")
    vector = slice(37 * 16, 37 * 16 + 13)
    inputs = [_input(0, worker, numel) for worker in range(2)]
    exact = (inputs[0] + inputs[1]) / 2
    out = reference(inputs)
    relative = ((out[vector] - exact[vector]).abs() / exact[vector].abs()).max()
    assert 0 < relative < 2 * 2**-8  # two roundings to bfloat16 (worker, server), each <= 2^-9
    total_in, total_out = exact.clone(), out.clone()
    for _ in range(20):  # the same inputs again: the time average of the output converges
        total_in += exact
        total_out += reference(inputs)
    drift = ((total_out[vector] - total_in[vector]).abs() / total_in[vector].abs()).max()
    assert drift < relative / 5


def _check_virtual_buffers(rank: int, world_size: int) -> list[str]:
    engine = CompressedAllreduce(64, virtual_workers=2)
    errors = []
    for buffer, out in [
        (torch.zeros(64), None),
        (torch.zeros(2, 64), None),
        (torch.zeros(3, 64), torch.zeros(64)),
    ]:
        try:
            engine(buffer, out)
        except ValueError as error:
            errors.append(str(error))
    return errors


def test_virtual_worker_buffers_are_checked():
    (errors,) = run_distributed(_check_virtual_buffers, 1)
    assert len(errors) == 3
    assert "[2, 64] buffer" in errors[0] and "`out`" in errors[1] and "[2, 64] buffer" in errors[2]


# A momentum source (issue #15, `pretrain.comm.kernels.MomentumSource`): the tensors of `_layout`'s blocks
SOURCE_BOUNDS = [(0, 37 * 16), (37 * 16, 37 * 16 + 13), (37 * 16 + 13, 37 * 16 + 13 + 64)]
SOURCE_CASES = [("blocks", "mean_abs"), ("elements", "mean_abs"), ("blocks", "rms")]


def _source_input(call: int, worker: int, numel: int, grad_scale: float):
    """(buffer of momenta, zero pad; its `live_step.momentum_source`; the values x it stands for)."""
    from pretrain.optim.live_step import momentum_source

    generator = torch.Generator().manual_seed(7000 + 1000 * call + worker)
    buffer = torch.zeros(numel)
    buffer[:UNPADDED] = torch.randn(UNPADDED, generator=generator)
    views = [buffer[low:high] for low, high in SOURCE_BOUNDS]
    grads = [torch.randn(high - low, generator=generator) for low, high in SOURCE_BOUNDS]
    divisors = [torch.rand(high - low, generator=generator) + 0.01 for low, high in SOURCE_BOUNDS]
    source = momentum_source(buffer, views, grads, divisors, beta1=0.9, grad_scale=grad_scale)
    assert source is not None
    formed = buffer.clone()
    source.fill(formed)
    return buffer, source, formed


def _run_sources(rank: int, processes: int, grad_scale: float) -> dict:
    numel = padded_numel(UNPADDED, processes)
    results = {}
    for kernels in KERNELS:
        for pieces in (0, PIECES):
            for kind, sign_scale in SOURCE_CASES:
                engine = CompressedAllreduce(
                    numel,
                    layout=_layout(kind, numel, processes),
                    sign_scale=sign_scale,
                    kernels=kernels,
                    pipeline=pieces,
                )
                outputs = []
                for call in range(CALLS):
                    buffer, source, _ = _source_input(call, rank, numel, grad_scale)
                    outputs.append(engine(buffer, source=source).numpy().copy())
                results[(kernels, pieces, kind, sign_scale)] = outputs
    return results


@pytest.mark.slow
@pytest.mark.parametrize("processes, grad_scale", [(2, 1.0), (3, 0.37)])
def test_a_momentum_source_gives_what_its_values_give(processes, grad_scale):
    """The engine handed the momenta (`source=`: x formed inside the worker's first pass where the numba
    kernels can, into the buffer first elsewhere) equals the reference fed the values x themselves, bit for
    bit, pipelined or not, on every rank."""
    results = run_distributed(_run_sources, processes, args=(grad_scale,))
    numel = padded_numel(UNPADDED, processes)
    inputs = [
        [_source_input(call, worker, numel, grad_scale)[2] for worker in range(processes)]
        for call in range(CALLS)
    ]
    for (kernels, pieces, kind, sign_scale), _ in results[0].items():
        reference = ReferenceCompressedAllreduce(
            numel, processes, _layout(kind, numel, processes), sign_scale, "float32"
        )
        for call in range(CALLS):
            expected = reference(inputs[call]).numpy()
            for rank in range(processes):
                got = results[rank][(kernels, pieces, kind, sign_scale)][call]
                assert np.array_equal(got, expected), (kernels, pieces, kind, sign_scale, call, rank)
