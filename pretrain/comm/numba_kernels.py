"""The compressed allreduce's elementwise passes as fused CPU loops (numba): :class:`NumbaKernels`, bitwise
equal to the torch reference (:class:`~pretrain.comm.kernels.TorchKernels`; why and how fast:
:mod:`pretrain.comm.kernels`' docstring). The loops themselves are :mod:`pretrain.comm.numba_loops`,
imported when the first instance is built (numba is optional: :func:`~pretrain.comm.numba_support.
numba_unavailable_reason` first); a :class:`~pretrain.comm.plan.MomentumSource` brings the optimizer's
own loops for the tensors it forms (:mod:`pretrain.optim.numba_loops`).
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import torch

from pretrain.comm.layout import cut_runs, run_table, segment_bounds
from pretrain.comm.numba_support import SUM_BLOCK
from pretrain.comm.packing import sign_table
from pretrain.comm.plan import CompressionKernels, MomentumSource, RunPlan

# Elements `accumulate_` sums over all sources at a time (a multiple of 8: 16 KiB of running sums, in L1).
ACCUMULATE_BLOCK = 4096


class NumbaKernels(CompressionKernels):
    """Fused CPU loops (numba), bitwise equal to :class:`~pretrain.comm.kernels.TorchKernels`. CPU tensors
    only."""

    name = "numba"

    def __init__(self) -> None:
        from pretrain.comm import numba_loops  # imports numba (optional: `numba_unavailable_reason` first)

        self._loops = numba_loops
        # row b: the ±1 that byte b decodes to, MSB first (the torch packer's table)
        self._signs = sign_table(torch.float32, torch.device("cpu")).numpy()
        # accumulate's running sum and one source's term, a block of ACCUMULATE_BLOCK elements each (L1)
        self._total = np.empty(ACCUMULATE_BLOCK, dtype=np.float32)
        self._term = np.empty(ACCUMULATE_BLOCK, dtype=np.float32)
        # compress's sign flags, one byte per element of a stretch (+ 8 for its first, partial byte)
        self._flags = np.zeros(SUM_BLOCK + 8, dtype=np.uint8)
        # a source's marginals: none, and the fp32 column partials of `square_marginal_rows`
        self._no_sums = np.zeros(0, dtype=np.float32)
        self._partials = np.empty(0, dtype=np.float32)
        # `_source_tables`, per plan and source layout
        self._tables: weakref.WeakKeyDictionary[RunPlan, dict[tuple[Any, ...], Any]] = (
            weakref.WeakKeyDictionary()
        )

    def add_scales_(
        self,
        error: torch.Tensor,
        values: torch.Tensor,
        plan: RunPlan,
        out: torch.Tensor,
        source: MomentumSource | None = None,
    ) -> torch.Tensor:
        if plan.root or not plan.tiles(error.numel()):
            return super().add_scales_(error, values, plan, out, source)
        if source is not None and source.loops is None:  # a source without loops: x formed first
            source.fill(values)
            source = None
        # the 1-norms of `plan.scales` (pretrain.comm.norms), fused with the addition: same bits
        if source is None:
            blocks = self._blocks_of(plan)
            self._loops.add_segment_abs_sums(error.numpy(), values.numpy(), blocks, out.numpy())
        else:
            self._add_source(error.numpy(), values.numpy(), plan, out.numpy(), source)
        return out.div_(plan.segment_divisors)

    def _add_source(
        self, error: np.ndarray, values: np.ndarray, plan: RunPlan, out: np.ndarray, source: MomentumSource
    ) -> None:
        """`add_segment_abs_sums` with x formed from ``source`` tensor by tensor (one loop of its
        ``loops`` each), the rest of the buffer from ``values``."""
        assert source.loops is not None
        fused = source.loops.add_momentum_abs_sums
        beta1, weight = np.float32(source.beta1), np.float32(1.0 - source.beta1)  # fp32, as torch rounds them
        scale = np.float32(source.grad_scale)
        marginals = source.marginals or [None] * len(source.grads)
        for k, low, high, table in self._source_tables(plan, source):
            if k < 0:
                self._loops.add_segment_abs_sums(error[low:high], values[low:high], table, out)
                continue
            sums = marginals[k]
            outer, inner = (self._no_sums, self._no_sums) if sums is None else (s.numpy() for s in sums)
            if inner.shape[0] > self._partials.shape[0]:
                self._partials = np.empty(inner.shape[0], dtype=np.float32)
            fused(
                error[low:high],
                source.exp_avgs[k].numpy(),
                source.grads[k].numpy(),
                source.divisors[k].numpy(),
                table,
                out,
                beta1,
                weight,
                scale,
                inner.shape[0],
                outer,
                inner,
                self._partials[: inner.shape[0]],
            )

    def worker_pass(
        self,
        error: torch.Tensor,
        values: torch.Tensor,
        plan: RunPlan,
        scales: torch.Tensor,
        source: MomentumSource | None = None,
        *,
        bfloat16: bool = False,
    ) -> WorkerPass | None:
        if not self.fuses_worker_pass(plan, error.numel()):
            return None
        return WorkerPass(self, error, values, plan, scales, source, bfloat16)

    def fuses_worker_pass(self, plan: RunPlan, numel: int) -> bool:
        return not plan.root and plan.tiles(numel)  # mean_abs: the 1-norms summed as the pass goes

    def server_pass(
        self,
        error: torch.Tensor,
        signs: torch.Tensor,
        scales: torch.Tensor,
        plan: RunPlan,
        out_scales: torch.Tensor,
        *,
        bfloat16: bool = False,
    ) -> ServerPass | None:
        if not self.fuses_worker_pass(plan, error.numel()):
            return None
        return ServerPass(self, error, signs, scales, plan, out_scales, bfloat16)

    def _segment_starts(self, plan: RunPlan) -> np.ndarray:
        """Every segment's first element, and the end of the last one, ascending; once per plan."""
        tables = self._tables.setdefault(plan, {})
        if ("starts",) not in tables:
            tables[("starts",)] = segment_bounds(plan.runs)
        return tables[("starts",)]

    def _parts(
        self, plan: RunPlan, source: MomentumSource | None, low: int, high: int
    ) -> list[tuple[int, int, int, np.ndarray]]:
        """(k, begin, end, runs) for the parts of elements [low, high) in order: source tensor k's elements
        there, or k = −1 for the stretches between them (the buffer's own values); runs: the part's run
        table, starts relative to ``begin``, segment indices the plan's. Raises ValueError where a bound would
        cut a segment (a segment's sum must come from one loop) or the tensors overlap."""
        bounds = [(low, high, -1)]
        if source is not None:
            bounds, position = [], low
            for k, (begin, length) in enumerate(zip(source.offsets, source.lengths)):
                begin, end = max(begin, low), min(begin + length, high)
                if begin >= end:
                    continue
                if begin < position:
                    raise ValueError("the source's tensors must come in buffer order, without overlaps")
                if begin > position:
                    bounds.append((position, begin, -1))
                bounds.append((begin, end, k))
                position = end
            if position < high:
                bounds.append((position, high, -1))
        starts = self._segment_starts(plan)
        parts = []
        for begin, end, k in bounds:
            for bound in (begin, end):
                found = int(np.searchsorted(starts, bound))
                if found == len(starts) or starts[found] != bound:
                    raise ValueError(f"element {bound} is inside a segment of the plan")
            runs, first = cut_runs(plan.runs, begin, end)
            rows = run_table(runs)
            rows[:, 3] += first
            parts.append((k, begin, end, rows))
        return parts

    def _pass_parts(
        self, plan: RunPlan, source: MomentumSource | None, low: int, high: int
    ) -> list[tuple[int, int, np.ndarray]]:
        """(tensor index or −1 for `values`, the part's end, its runs: absolute starts and segment indices)
        for the parts of elements [low, high) that one `worker_pass` call each takes (`_parts`), once per
        plan, source layout and stretch."""
        key = ("pass", low, high) if source is None else ("pass", low, high, source.offsets, source.lengths)
        tables = self._tables.setdefault(plan, {})
        if key not in tables:
            parts = self._parts(plan, source, low, high)
            for _, begin, _, rows in parts:
                rows[:, 0] += begin
            tables[key] = [(k, end, rows) for k, _, end, rows in parts]
        return tables[key]

    def _blocks_of(self, plan: RunPlan) -> np.ndarray:
        """`sum_blocks` of the plan's runs, computed once per plan."""
        tables = self._tables.setdefault(plan, {})
        if ("blocks",) not in tables:
            tables[("blocks",)] = sum_blocks(plan.table)
        return tables[("blocks",)]

    def _source_tables(self, plan: RunPlan, source: MomentumSource) -> list[tuple[int, int, int, np.ndarray]]:
        """(k, low, high, `sum_blocks` relative to low with the plan's segment indices) for the source's
        tensors (k) and the stretches between them (k = −1: the pad), over the whole buffer (`_parts`);
        computed once per plan and source layout."""
        key = (source.offsets, source.lengths)
        tables = self._tables.setdefault(plan, {})
        if key not in tables:
            parts = self._parts(plan, source, 0, plan.runs[-1].end)
            tables[key] = [(k, low, high, sum_blocks(rows)) for k, low, high, rows in parts]
        return tables[key]

    def compress_(
        self,
        values: torch.Tensor,
        scales: torch.Tensor,
        plan: RunPlan,
        packed: torch.Tensor,
        scratch: torch.Tensor,
    ) -> None:
        self._loops.compress(
            values.numpy(), packed.reshape(-1).numpy(), plan.table, scales.reshape(-1).numpy(), self._flags
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
        scales = scales.reshape(n, -1)
        self._loops.accumulate(
            error.numpy(),
            # with k virtual workers the sources' rows are strided views: one copy of n·C/8 bytes makes them
            # C-contiguous, which the vectorised loop needs
            signs.reshape(n, -1).contiguous().numpy(),
            plan.table,
            scales.numpy(),
            scales.view(torch.int32).numpy().view(np.uint32),  # the scales' bits (a view, any strides)
            np.float32(n),
            self._signs,
            self._total,
            self._term,
            self._flags,
        )

    def decode_(self, packed: torch.Tensor, scales: torch.Tensor, plan: RunPlan, out: torch.Tensor) -> None:
        scales = scales.reshape(-1)
        self._loops.decode(
            packed.reshape(-1).numpy(),
            plan.table,
            scales.numpy(),
            scales.view(torch.int32).numpy().view(np.uint32),
            out.numpy(),
            out.numpy().view(np.uint32),
            self._signs,
        )


def _check_stretch(who: str, low: int, high: int, base: int, stopped: int) -> None:
    """A worker or server pass's next stretch [low, high): it continues where the last one stopped or starts
    on a whole byte, and ``base`` (the element of its signs' byte 0) is a multiple of 8 not after ``low``."""
    if base % 8 or not base <= low <= high or (low != stopped and low % 8):
        raise ValueError(
            f"a {who} pass continues where it stopped ({stopped}) or starts on a whole byte, and its "
            f"signs' byte 0 is element {base} (a multiple of 8, not after {low}): got [{low}, {high})"
        )


class WorkerPass:
    """One call's worker step in one pass over memory (issue #15): per segment, y = e + x, its 1-norm, the
    scale (rounded to bfloat16 where the wire carries that), then the signs and e ← y − s·sign(y) while the
    segment is still in cache; the separate passes (``add_scales_``, the rounding, ``compress_``) read y
    back from memory for the signs. The same arithmetic in the same order, so the same bits (tested).

    ``run(low, high, packed, base)`` takes elements [low, high) (segment bounds), writing their signs into
    ``packed`` (byte 0: elements base … base + 7, base a multiple of 8) and their scales into ``scales``
    (the plan's segment order); calls go in buffer order within each of the pipeline's chunks, the chunks
    in any order (the pipeline sends each stretch as it is done: :mod:`pretrain.comm.pipeline`), and
    together cover the buffer once. A call that ends inside a byte leaves that byte to the next call, which
    continues where it stopped (into the same ``packed``): after ``run(low, high, …)`` the bytes of
    elements up to high & ~7 are complete. With a :class:`MomentumSource`, x is formed from it tensor by
    tensor, and a matrix's square marginals are summed as its rows go by (a call also sums the rows before
    its stretch still undone: always in row order, so the same bits), its column sums rounded and added
    once its last stretch is done (which sums every row left)."""

    def __init__(
        self,
        kernels: NumbaKernels,
        error: torch.Tensor,
        values: torch.Tensor,
        plan: RunPlan,
        scales: torch.Tensor,
        source: MomentumSource | None,
        bfloat16: bool,
    ) -> None:
        if source is not None and source.loops is None:  # a source without loops: x formed first
            source.fill(values)
            source = None
        self._kernels, self._plan, self._source, self._bfloat16 = kernels, plan, source, bfloat16
        self._error, self._values, self._scales = error.numpy(), values.numpy(), scales.numpy()
        self._divisors = plan.segment_divisors.numpy()
        self._cell = np.zeros(1, dtype=np.float32)
        self._acc, self._next = 0, 0  # the signs of elements [high & ~7, high) of the last call, and high
        empty = np.zeros(0, dtype=np.float32)
        self._empty, self._no_columns = empty, np.zeros(0, dtype=np.float64)
        self._tensors: list[tuple[np.ndarray, ...]] = []
        self._marginals: list[list[Any] | None] = []
        if source is not None:
            beta1 = np.float32(source.beta1)  # fp32, as torch rounds them
            self._coefficients = (beta1, np.float32(1.0 - source.beta1), np.float32(source.grad_scale))
            self._tensors = [
                (m.numpy(), g.numpy(), d.numpy())
                for m, g, d in zip(source.exp_avgs, source.grads, source.divisors)
            ]
            for sums in source.marginals or [None] * len(self._tensors):
                if sums is None:
                    self._marginals.append(None)
                    continue
                outer, inner = (t.numpy() for t in sums)
                # [outer sums, inner sums, float64 column sums, rows done, fp32 column partials]
                self._marginals.append(
                    [outer, inner, np.zeros(inner.shape[0]), 0, np.empty(inner.shape[0], dtype=np.float32)]
                )

    def run(self, low: int, high: int, packed: torch.Tensor, base: int) -> None:
        _check_stretch("worker", low, high, base, self._next)
        packed_bytes = packed.reshape(-1).numpy()
        acc = self._acc if low == self._next else 0
        for k, end, runs in self._kernels._pass_parts(self._plan, self._source, low, high):
            if k >= 0:
                acc = self._run_source(k, end, runs, packed_bytes, base, acc)
                continue
            acc = self._kernels._loops.worker_pass(
                self._error,
                self._values,
                runs,
                self._divisors,
                self._bfloat16,
                self._scales,
                packed_bytes,
                base,
                acc,
                self._kernels._flags,
                self._cell,
                self._cell.view(np.uint32),
            )
        self._acc, self._next = acc, high

    def _run_source(self, k: int, end: int, runs: np.ndarray, packed: np.ndarray, base: int, acc: int) -> int:
        """Whole segments of the source's tensor k through its loop (`SourceLoops.worker_pass`): x formed
        from (m, g, d), the tensor's square marginals summed as its rows go by; returns the carried byte."""
        source = self._source
        assert source is not None and source.loops is not None
        exp_avg, grad, divisor = self._tensors[k]
        offset, marginal = source.offsets[k], self._marginals[k]
        if marginal is None:
            inner, outer_sums, inner_sums, columns, done, row = (
                0,
                self._empty,
                self._empty,
                self._no_columns,
                0,
                self._empty,
            )
        else:
            outer_sums, inner_sums, columns, done, row = marginal
            inner = inner_sums.shape[0]
        beta1, weight, scale = self._coefficients
        acc, done = source.loops.worker_pass(
            self._error,
            exp_avg,
            grad,
            divisor,
            offset,
            runs,
            self._divisors,
            self._bfloat16,
            self._scales,
            packed,
            base,
            acc,
            beta1,
            weight,
            scale,
            inner,
            outer_sums,
            columns,
            done,
            row,
            self._kernels._flags,
            self._cell,
            self._cell.view(np.uint32),
        )
        if marginal is not None:
            marginal[3] = done
            if end == offset + exp_avg.shape[0]:  # the matrix's last stretch: its column sums, once
                inner_sums += columns.astype(np.float32)
        return acc


class ServerPass:
    """One call's server step in one pass over memory (issue #15): per segment, z = e + (Σ_i s_i·sign_i)/n
    (``accumulate_``'s arithmetic and order), its 1-norm, the scale (rounded where the wire carries
    bfloat16), the signs and e ← z − s·sign(z), while the segment is in cache; the separate passes read e
    back twice (the norms, then the signs). The same bits (tested). ``signs`` [n, chunk bytes] and ``scales``
    [n, chunk segments] are the workers' (C-contiguous); ``run(low, high, packed, base)`` as
    :meth:`WorkerPass.run`, over the chunk's elements, writing ``out_scales`` (the chunk's segments)."""

    def __init__(
        self,
        kernels: NumbaKernels,
        error: torch.Tensor,
        signs: torch.Tensor,
        scales: torch.Tensor,
        plan: RunPlan,
        out_scales: torch.Tensor,
        bfloat16: bool,
    ) -> None:
        if not (signs.is_contiguous() and scales.is_contiguous()):
            raise ValueError("the server pass reads the workers' signs and scales C-contiguous")
        self._kernels, self._plan, self._bfloat16 = kernels, plan, bfloat16
        self._error, self._signs, self._out_scales = error.numpy(), signs.numpy(), out_scales.numpy()
        self._scales = scales.numpy()
        self._scale_bits = self._scales.view(np.uint32)
        self._count = np.float32(signs.shape[0])
        self._divisors = plan.segment_divisors.numpy()
        self._cell = np.zeros(1, dtype=np.float32)
        self._acc, self._next = 0, 0

    def run(self, low: int, high: int, packed: torch.Tensor, base: int) -> None:
        _check_stretch("server", low, high, base, self._next)
        kernels = self._kernels
        acc = self._acc if low == self._next else 0
        ((_, _, runs),) = kernels._pass_parts(self._plan, None, low, high)
        acc = kernels._loops.server_pass(
            self._error,
            self._signs,
            runs,
            self._scales,
            self._scale_bits,
            self._count,
            kernels._signs,
            kernels._total,
            kernels._term,
            kernels._flags,
            self._divisors,
            self._bfloat16,
            self._out_scales,
            packed.reshape(-1).numpy(),
            base,
            acc,
            self._cell,
            self._cell.view(np.uint32),
        )
        self._acc, self._next = acc, high


def sum_blocks(runs: np.ndarray) -> np.ndarray:
    """The blocks the fused worker pass adds and sums, for a run table (`layout.run_table`): [B, 5] int64 rows
    (low, high, segment, count, last). count > 0: ``count`` whole segments of (high − low)/count elements from
    segment ``segment`` on, each summed on its own; count == 0: elements [low, high) of segment ``segment``,
    which ends with this block where last == 1. Segments shorter than `SUM_BLOCK` go `SUM_BLOCK` // length
    to a block, longer ones in blocks of `SUM_BLOCK` from their start (the norms' order,
    `pretrain.comm.norms`)."""
    blocks = []
    for start, rows, length, first in runs.tolist():
        if length < SUM_BLOCK:
            group = SUM_BLOCK // length
            for row in range(0, rows, group):
                count, base = min(group, rows - row), start + row * length
                blocks.append((base, base + count * length, first + row, count, 1))
            continue
        for row in range(rows):
            base = start + row * length
            for offset in range(0, length, SUM_BLOCK):
                end = min(offset + SUM_BLOCK, length)
                blocks.append((base + offset, base + end, first + row, 0, int(end == length)))
    return np.asarray(blocks, dtype=np.int64).reshape(-1, 5)
