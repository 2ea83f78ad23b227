"""The types the compressed allreduce's layers share: how a segment's scale is taken and how it travels
(:class:`SignScale`, :class:`ScaleDtype`), a list of runs prepared for the engine (:class:`RunPlan`), a
worker's values not formed yet (:class:`MomentumSource`), and the interface of the elementwise passes
(:class:`CompressionKernels`, implemented by :mod:`pretrain.comm.kernels`, :mod:`pretrain.comm.numba_kernels`
and :mod:`pretrain.comm.compiled_kernels`).

The modules of :mod:`pretrain.comm` import one way only (pyproject.toml's import contract): this one and
the layout, packing and norms below it; the kernels above it; the pipeline above them; the compressed
allreduce on top.
"""

from __future__ import annotations

import abc
import enum
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from pretrain.comm.layout import Run, run_table
from pretrain.comm.norms import segment_abs_sums


class SignScale(str, enum.Enum):
    """The scale s of a segment y in Q(y) = s·sign(y)."""

    rms = "rms"  # ‖y‖₂/√len (DeepSpeed): ‖Q(y)‖ = ‖y‖
    mean_abs = "mean_abs"  # ‖y‖₁/len: minimises ‖y − s·sign(y)‖₂ for the given signs


class ScaleDtype(str, enum.Enum):
    """How the segment scales travel. ``float32`` (DeepSpeed); ``bfloat16``: every scale is rounded to
    bfloat16 where it is computed (worker and server alike) and sent in 2 bytes. The error feedback
    takes the rounded scale (e ← y − round(s)·sign(y)), so the rounding (≤ 2⁻⁹ relative) is returned
    by later steps like any other compression error; bfloat16 keeps fp32's range, so no scale can
    overflow or flush to zero. It halves the scales' bytes, which is what makes one scale per element of
    the 1-D tensors (``exact_vectors``) fit BERT-Large's byte budget."""

    float32 = "float32"
    bfloat16 = "bfloat16"

    @property
    def bytes(self) -> int:
        return 4 if self is ScaleDtype.float32 else 2


class RunPlan:
    """One list of runs prepared for the engine: the scale of every segment, and segment-wise scaling.

    Single-row runs (a whole tensor, a piece of one) are scaled by one `_foreach` call (their 2-norms
    taken by one too, their 1-norms run by run); each multi-row run (an embedding's rows, a transposed
    matrix's columns) by one call on a [rows, row_length] view.
    """

    def __init__(self, runs: list[Run], sign_scale: SignScale, device: torch.device) -> None:
        self.runs = runs
        self.num_segments = sum(run.rows for run in runs)
        self.order = 2 if sign_scale is SignScale.rms else 1
        self.root = sign_scale is SignScale.rms
        self.one_segment = len(runs) == 1 and runs[0].rows == 1
        singles, positions, self.row_blocks = [], [], []
        position = 0
        for run in runs:
            if run.rows == 1:
                singles.append(run)
                positions.append(position)
            else:
                self.row_blocks.append((run, position))
            position += run.rows
        self.single_bounds = [(run.start, run.end) for run in singles]
        self.single_positions = torch.tensor(positions, dtype=torch.int64, device=device)
        self.single_divisors = torch.tensor(
            [self.divisor(run.row_length) for run in singles], dtype=torch.float32, device=device
        )
        self.table = run_table(runs)
        # mean_abs: every segment's length, the divisor of its 1-norm (lengths < 2^24: exact in fp32)
        self.segment_divisors = torch.repeat_interleave(
            torch.tensor([float(run.row_length) for run in runs], dtype=torch.float32),
            torch.tensor([run.rows for run in runs], dtype=torch.int64),
        ).to(device)
        self._tiled_numel = runs[-1].end if _tile(runs) else -1

    def tiles(self, numel: int) -> bool:
        """Whether the runs cover elements [0, numel) in order without gaps."""
        return self._tiled_numel == numel

    def divisor(self, length: int) -> float:
        return math.sqrt(length) if self.root else float(length)

    def scales(self, values: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out[i] ← the scale of segment i of ``values`` (1-D, laid out like the runs). 1-norms through
        :func:`~pretrain.comm.norms.segment_abs_sums` (one numba loop on CPU), divided by the lengths;
        2-norms through ``vector_norm``."""
        if not self.root:
            segment_abs_sums(values, self.table, out)
            return out.div_(self.segment_divisors)
        if self.one_segment:  # DeepSpeed's expression (docs/onebit-lamb.md), for bitwise parity
            (run,) = self.runs
            norm = torch.linalg.vector_norm(values[run.start : run.end], self.order)
            return out.copy_((norm / self.divisor(run.row_length)).reshape(1))
        if self.single_bounds:
            pieces = [values[start:end] for start, end in self.single_bounds]
            norms = torch.stack(torch._foreach_norm(pieces, self.order))
            out.index_copy_(0, self.single_positions, norms.div_(self.single_divisors))
        for run, position in self.row_blocks:
            target = out[position : position + run.rows]
            rows = values[run.start : run.end].view(run.rows, run.row_length)
            torch.linalg.vector_norm(rows, self.order, dim=1, out=target)
            target.div_(self.divisor(run.row_length))
        return out

    def apply(self, values: torch.Tensor, scales: torch.Tensor) -> None:
        """values[segment i] *= scales[i] (values hold ±1 here: the products are exact)."""
        if self.single_bounds:
            pieces = [values[start:end] for start, end in self.single_bounds]
            torch._foreach_mul_(pieces, list(scales.index_select(0, self.single_positions).unbind()))
        for run, position in self.row_blocks:
            rows = values[run.start : run.end].view(run.rows, run.row_length)
            rows.mul_(scales[position : position + run.rows].unsqueeze(1))

    def apply_rows(self, values: torch.Tensor, scales: torch.Tensor) -> None:
        """``apply`` for many buffers at once: values [m, len], scales [m, num_segments]."""
        position = 0
        for run in self.runs:
            block = values[:, run.start : run.end].view(values.shape[0], run.rows, run.row_length)
            block.mul_(scales[:, position : position + run.rows].unsqueeze(-1))
            position += run.rows


def _tile(runs: list[Run]) -> bool:
    return bool(runs) and runs[0].start == 0 and all(a.end == b.start for a, b in itertools.pairwise(runs))


class SourceLoops(Protocol):
    """The numba loops of a :class:`MomentumSource` (:mod:`pretrain.optim.numba_loops`): the numba kernels
    call them over the source's tensors where they would add ``values`` (their own loops,
    :mod:`pretrain.comm.numba_loops`: ``add_segment_abs_sums``, ``worker_pass``), with x formed from
    (m, g, d) and the square marginals summed; the arguments are those loops' and the source's."""

    add_momentum_abs_sums: Callable[..., None]
    worker_pass: Callable[..., tuple[int, int]]


class StretchPass(Protocol):
    """A fused worker or server step run stretch by stretch (:class:`~pretrain.comm.numba_kernels.
    WorkerPass`): ``run(low, high, packed, base)`` takes elements [low, high), their signs into ``packed``
    (byte 0: elements base … base + 7)."""

    def run(self, low: int, high: int, packed: torch.Tensor, base: int) -> None: ...


@dataclass(frozen=True)
class MomentumSource:
    """A worker's values not formed yet (issue #15): x = (β1·m + (1−β1)·(s·g))/d, tensor by tensor, for
    ``add_scales_`` to form inside its own pass instead of reading them from a buffer the caller filled
    (the write and the read of x, 8 of 28 bytes per element, never happen).

    Tensor k's momentum, gradient and divisor (``exp_avgs[k]``, ``grads[k]``, ``divisors[k]``: 1-D fp32
    CPU views in the buffer's element order) are elements [offsets[k], offsets[k] + len) of the buffer; the
    buffer's other elements (its pad) are the call's ``values`` as they are. ``fill(values)`` writes the
    same x into ``values`` in the same arithmetic (one fused multiply-add, then the division), for the
    kernels that do not fuse. ``marginals``: the square marginals of some of the (scaled) gradients are
    summed in the same pass (1-bit LAMB's variance refresh). The optimizer owns the
    arithmetic: it builds the source (`pretrain.optim.live_step.momentum_source`) and hands the kernels
    its loops with it (``loops``)."""

    offsets: tuple[int, ...]
    exp_avgs: list[torch.Tensor]
    grads: list[torch.Tensor]
    divisors: list[torch.Tensor]
    beta1: float
    grad_scale: float
    fill: Callable[[torch.Tensor], None]
    # per tensor, None or the (outer, inner) sums its s·g's squares are added to, rows and columns in memory
    # order (`pretrain.optim.marginals`); `fill` adds them too
    marginals: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None
    # the optimizer's numba loops that form x inside the numba kernels' passes (`SourceLoops`); None: those
    # kernels `fill` x first too (the same bits)
    loops: SourceLoops | None = None

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(g.shape[0] for g in self.grads)


class CompressionKernels(abc.ABC):
    """The engine's elementwise passes (:mod:`pretrain.comm.kernels`' docstring). ``plan`` describes where
    each scale applies."""

    name: str

    def add_scales_(
        self,
        error: torch.Tensor,
        values: torch.Tensor,
        plan: RunPlan,
        out: torch.Tensor,
        source: MomentumSource | None = None,
    ) -> torch.Tensor:
        """The worker's first step: error ← error + values (y = x + e), then out ← the scales of its
        segments (``plan.scales``); returns ``out``. Implementations may fuse the two passes. With a
        ``source``, x is the source's (:class:`MomentumSource`; the buffer's pad still from ``values``):
        here formed into ``values`` first."""
        if source is not None:
            source.fill(values)
        error.add_(values)
        return plan.scales(error, out=out)

    def worker_pass(
        self,
        error: torch.Tensor,
        values: torch.Tensor,
        plan: RunPlan,
        scales: torch.Tensor,
        source: MomentumSource | None = None,
        *,
        bfloat16: bool = False,
    ) -> StretchPass | None:
        """The worker's whole step (``add_scales_``, the scales' rounding, ``compress_``) fused segment by
        segment, run stretch by stretch (:class:`StretchPass`); None where these kernels do not fuse it
        (`fuses_worker_pass`: the caller runs the separate passes, same bits)."""
        return None

    def fuses_worker_pass(self, plan: RunPlan, numel: int) -> bool:
        """Whether `worker_pass` (and `server_pass`) fuse the step for ``numel`` elements under ``plan``."""
        return False

    def server_pass(
        self,
        error: torch.Tensor,
        signs: torch.Tensor,
        scales: torch.Tensor,
        plan: RunPlan,
        out_scales: torch.Tensor,
        *,
        bfloat16: bool = False,
    ) -> StretchPass | None:
        """The server's whole step (``accumulate_``, the scales, their rounding, ``compress_``) fused
        segment by segment, run stretch by stretch (:class:`StretchPass`); None where `worker_pass` is."""
        return None

    @abc.abstractmethod
    def compress_(
        self,
        values: torch.Tensor,
        scales: torch.Tensor,
        plan: RunPlan,
        packed: torch.Tensor,
        scratch: torch.Tensor,
    ) -> None:
        """packed ← signs(values); values ← values − scale·sign(values). ``values`` 1-D fp32; ``scratch``:
        fp32 the length of ``values`` that may be overwritten."""

    @abc.abstractmethod
    def accumulate_(
        self,
        error: torch.Tensor,
        signs: torch.Tensor,
        scales: torch.Tensor,
        plan: RunPlan,
        scratch: torch.Tensor,
    ) -> None:
        """error ← error + (Σ_i decode(signs[i], scales[i])) / n. signs [n, bytes], scales [n, segments];
        ``scratch``: n · len(error) fp32 that may be overwritten."""

    @abc.abstractmethod
    def decode_(self, packed: torch.Tensor, scales: torch.Tensor, plan: RunPlan, out: torch.Tensor) -> None:
        """out ← decode(packed, scales) under ``plan``."""

    def decode_chunks_(
        self,
        signs: torch.Tensor,
        scales: torch.Tensor,
        plans: list[RunPlan],
        offsets: list[int],
        out: torch.Tensor,
    ) -> None:
        """out (n chunks of equal length) ← chunk j decoded from signs[j] and its scales
        ``scales[offsets[j] : offsets[j] + plans[j].num_segments]``."""
        chunks = out.view(len(plans), -1)
        for chunk, plan in enumerate(plans):
            offset = offsets[chunk]
            self.decode_(signs[chunk], scales[offset : offset + plan.num_segments], plan, chunks[chunk])
