"""The compressed allreduce's elementwise passes as ``torch.compile``'d kernels (``kernels=compiled``): one
generated loop per operation over a whole buffer, any device (Triton on CUDA, vectorised C++ on CPU).

Issue #15 asks for the passes at memory speed on the device users train on. On the CPU the numba loops
(:class:`~pretrain.comm.kernels.NumbaKernels`) do that; on a GPU the reference's torch passes
(:class:`~pretrain.comm.kernels.TorchKernels`: pack, unpack, a multiply per segment group, subtract) run
the call at 19-39x a memory copy (`results/bench/gpu.json`, H200). Here every operation is one expression
that Inductor turns into one kernel, whatever the layout:

- the scale of element i is ``scales[segment(i)]``, read through a *segment map* of the plan, built once
  per plan: per byte b the segment of its first element (int32) and a mask of the byte's elements that
  start a new segment (uint8), so segment(8b + j) = first[b] + popcount(mask[b] & positions 1..j). That is
  5 bytes per 8 elements, where an int32 index per element would read 4 bytes per element in every pass
  (one-segment plans, DeepSpeed's layout, need no map);
- ``compress_``: bit = ``v >= 0`` (MSB first), ``v ← v − (bit ? s : −s)``, the packed byte as the sum of
  the eight bits' weights: reads the values and the map, writes the values and the bytes;
- ``accumulate_``: ``e ← e + (Σ_i (bit_i ? s_i : −s_i)) / n`` with the sum in worker order;
- ``decode_chunks_``: all n chunks in one call, through one map of the whole buffer (the chunk maps with
  their segments offset to the chunk's place among all scales).

Same bits as the reference: ``±s`` is exactly ``s·(±1)``, the sum runs in the same order, and the
division by n is IEEE-rounded (``eager_numerics.division_rounding``: Triton's ``/`` is approximate by
default) with subnormals kept (``disable_ftz``); n arrives as a 0-d tensor, so no reciprocal is folded in.
A multiply-add that the code generator may fuse is exact here (one factor is ±1). Tested bitwise against
the torch kernels on the CPU (tests/unit/test_comm_kernels.py); `make gpu-check` checks and times it on a
GPU against the torch kernels.

Costs: a compiled call costs tens of microseconds before it touches an element (Dynamo's guards, the
launcher), so the pipelined exchange's per-piece calls add up where pieces are many; the segment maps hold
0.625 bytes per element of every plan (the worker plan covers the buffer, the decode map too, the server
plans one chunk each, the pipeline's pieces the buffer again).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pretrain.comm.plan import CompressionKernels, RunPlan

_OPTIONS: dict[str, str | int | bool | Callable[..., Any]] = {
    "eager_numerics.division_rounding": True,
    "eager_numerics.disable_ftz": True,
}


class SegmentMap:
    """Per byte of a plan's elements: ``first`` (int32) the segment of its element 0, ``steps`` (uint8)
    bit 7 − j set where element j (≥ 1) starts a new segment."""

    def __init__(self, first: torch.Tensor, steps: torch.Tensor) -> None:
        self.first, self.steps = first, steps

    @classmethod
    def of_runs(cls, runs: list[tuple[int, int, int, int]], numel: int, device: torch.device) -> SegmentMap:
        """From (start, rows, row_length, first segment) runs that tile [0, numel) in order."""
        starts = np.concatenate(
            [start + np.arange(rows, dtype=np.int64) * length for start, rows, length, _ in runs]
        )
        segments = np.concatenate([first + np.arange(rows, dtype=np.int64) for _, rows, _, first in runs])
        byte_starts = np.arange(0, numel, 8, dtype=np.int64)
        owner = np.searchsorted(starts, byte_starts, side="right") - 1
        first = segments[owner].astype(np.int32)
        inside = starts[starts % 8 != 0]
        steps = np.zeros(numel // 8, dtype=np.uint8)
        np.bitwise_or.at(steps, inside >> 3, (1 << (7 - (inside & 7))).astype(np.uint8))
        return cls(torch.from_numpy(first).to(device), torch.from_numpy(steps).to(device))


def _plan_runs(
    plan: RunPlan, segment_offset: int = 0, element_offset: int = 0
) -> list[tuple[int, int, int, int]]:
    table, position = [], segment_offset
    for run in plan.runs:
        table.append((element_offset + run.start, run.rows, run.row_length, position))
        position += run.rows
    return table


# ------------------------------------------------------------------------ the compiled expressions


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """[bytes] uint8 → [bytes, 8] bool, MSB first."""
    shifts = torch.arange(7, -1, -1, device=packed.device, dtype=torch.int32)
    return ((packed.to(torch.int32).unsqueeze(-1) >> shifts) & 1).bool()


def _segments(first: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """[bytes, 8] int64: the segment of every element (module docstring)."""
    position = torch.arange(8, device=first.device, dtype=torch.int32)
    masks = (0xFF << (7 - position)) & 0x7F  # positions 1..j, MSB first
    x = steps.to(torch.int32).unsqueeze(-1) & masks
    x = x - ((x >> 1) & 0x55)
    x = (x & 0x33) + ((x >> 2) & 0x33)
    x = (x + (x >> 4)) & 0x0F
    return (first.unsqueeze(-1) + x).long()


def _scale_of(scales: torch.Tensor, first: torch.Tensor | None, steps: torch.Tensor | None) -> torch.Tensor:
    """Each element's scale ([bytes, 8]; a 0-d tensor for one segment). ``scales`` 1-D."""
    if first is None or steps is None:
        return scales[0]
    return scales[_segments(first, steps)]


# The expressions take [bytes, 8] views made outside the graph: a reshape of a dynamic length inside it
# costs a modulo per element in the generated index arithmetic.


def compress_expression(
    rows: torch.Tensor,
    scales: torch.Tensor,
    packed: torch.Tensor,
    first: torch.Tensor | None,
    steps: torch.Tensor | None,
) -> None:
    """packed ← signs (bit 1 for ``v >= 0``, MSB first); rows ← rows − (bit ? s : −s). rows [bytes, 8]."""
    positive = rows >= 0
    byte = positive[:, 0].to(torch.int32) << 7
    for j in range(1, 8):  # an OR of shifted columns, not a sum reduction (which needs an int64 buffer)
        byte = byte | (positive[:, j].to(torch.int32) << (7 - j))
    packed.copy_(byte.to(torch.uint8))
    s = _scale_of(scales, first, steps)
    rows.sub_(torch.where(positive, s, -s))


def accumulate_expression(
    rows: torch.Tensor,
    signs: torch.Tensor,
    scales: torch.Tensor,
    count: torch.Tensor,
    first: torch.Tensor | None,
    steps: torch.Tensor | None,
) -> None:
    """rows ← rows + (Σ_i (bit_i ? s_i : −s_i)) / n, the sum in source order. rows [bytes, 8] (the server
    error), signs [n, bytes], scales [n, segments]."""
    segments = None if first is None or steps is None else _segments(first, steps)
    total = None
    for source in range(signs.shape[0]):
        s = scales[source, 0] if segments is None else scales[source][segments]
        term = torch.where(_bits(signs[source]), s, -s)
        total = term if total is None else total + term
    assert total is not None
    rows.add_(total / count)


def decode_expression(
    packed: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor,
    first: torch.Tensor | None,
    steps: torch.Tensor | None,
) -> None:
    """out ← bit ? s : −s. packed [bytes], out [bytes, 8]."""
    s = _scale_of(scales, first, steps)
    out.copy_(torch.where(_bits(packed), s, -s))


_EXPRESSIONS: dict[str, Callable[..., None]] = {
    "compress": compress_expression,
    "accumulate": accumulate_expression,
    "decode": decode_expression,
}


@functools.cache
def _compiled(name: str) -> Callable[..., None]:
    """One compiled function per operation and process (a graph per kind of call: one segment or a map,
    the number of sources), shared by every engine; dynamic shapes serve every length."""
    return torch.compile(_EXPRESSIONS[name], dynamic=True, options=_OPTIONS)


class CompiledKernels(CompressionKernels):
    """The passes as compiled kernels (module docstring); bitwise equal to the torch kernels."""

    name = "compiled"

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._maps: dict[Any, SegmentMap | None] = {}
        self._counts: dict[int, torch.Tensor] = {}

    def _map(self, plan: RunPlan) -> SegmentMap | None:
        key = id(plan)
        if key not in self._maps:  # plans live as long as their engine, which holds this object
            one = plan.one_segment  # the engine's plans tile [0, end) of what they describe
            self._maps[key] = (
                None if one else SegmentMap.of_runs(_plan_runs(plan), plan.runs[-1].end, self.device)
            )
        return self._maps[key]

    def _chunks_map(self, plans: list[RunPlan], offsets: list[int]) -> SegmentMap:
        key = tuple(id(plan) for plan in plans) + tuple(offsets)
        if key not in self._maps:
            chunk = plans[0].runs[-1].end
            runs = [row for j, plan in enumerate(plans) for row in _plan_runs(plan, offsets[j], j * chunk)]
            self._maps[key] = SegmentMap.of_runs(runs, chunk * len(plans), self.device)
        found = self._maps[key]
        assert found is not None
        return found

    def _count(self, n: int) -> torch.Tensor:
        if n not in self._counts:
            self._counts[n] = torch.tensor(float(n), device=self.device)
        return self._counts[n]

    @staticmethod
    def _parts(segment_map: SegmentMap | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return (None, None) if segment_map is None else (segment_map.first, segment_map.steps)

    def compress_(
        self,
        values: torch.Tensor,
        scales: torch.Tensor,
        plan: RunPlan,
        packed: torch.Tensor,
        scratch: torch.Tensor,
    ) -> None:
        _compiled("compress")(
            values.view(-1, 8), scales.reshape(-1), packed.reshape(-1), *self._parts(self._map(plan))
        )

    def accumulate_(
        self,
        error: torch.Tensor,
        signs: torch.Tensor,
        scales: torch.Tensor,
        plan: RunPlan,
        scratch: torch.Tensor,
    ) -> None:
        n = signs.shape[0]
        _compiled("accumulate")(
            error.view(-1, 8),
            signs.reshape(n, -1),
            scales.reshape(n, -1),
            self._count(n),
            *self._parts(self._map(plan)),
        )

    def decode_(self, packed: torch.Tensor, scales: torch.Tensor, plan: RunPlan, out: torch.Tensor) -> None:
        _compiled("decode")(
            packed.reshape(-1), scales.reshape(-1), out.view(-1, 8), *self._parts(self._map(plan))
        )

    def decode_chunks_(
        self,
        signs: torch.Tensor,
        scales: torch.Tensor,
        plans: list[RunPlan],
        offsets: list[int],
        out: torch.Tensor,
    ) -> None:
        segment_map = self._chunks_map(plans, offsets)
        _compiled("decode")(
            signs.reshape(-1), scales.reshape(-1), out.view(-1, 8), segment_map.first, segment_map.steps
        )


def compiled_unavailable_reason(device: torch.device | str) -> str | None:
    """Why ``torch.compile`` cannot generate the kernels for ``device`` here, or None."""
    device = torch.device(device)
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "Triton is not installed (torch.compile needs it on CUDA)"
    if device.type == "cpu":
        from torch._inductor.cpp_builder import get_cpp_compiler

        try:
            get_cpp_compiler()
        except Exception as error:  # no C++ compiler on this machine
            return f"no C++ compiler for torch.compile on the CPU ({error})"
        return None
    return f"torch.compile kernels are not set up for {device.type} buffers"
