"""What 1-bit LAMB and 1-bit Adam share: the two stages, fused momentum buffers, the momentum exchange,
overflow agreement and rank-local checkpoint state.

Stages, with t the 1-based index of the step being taken and F = freeze_step:
- warmup, t ≤ F: the trainer allreduces (means) gradients; the subclass runs exact LAMB/Adam.
- compression, t > F: every rank steps on its OWN gradients; the momentum is exchanged with the 1-bit
  compressed allreduce (`pretrain.comm`); the variance v is frozen at its value after step F.
`needs_gradient_allreduce` is `step_count < freeze_step`, so it turns False right after step F. There
is no DeepSpeed-style first-step no-op: a fresh optimizer's first `step()` updates, so our F warmup
updates are DeepSpeed's freeze_step F + 1. `freeze_step` may be changed between steps (e.g. per phase):
lowered below the step count, the next step freezes and compresses; raised above it, warmup resumes and
freezes again at the new value (v_f ← v, κ recomputed, factor and error feedback restarted).

Momentum storage: `state[p]["exp_avg"]` is a view into a flat fp32 buffer (one per `_segments()` entry:
all tensors for 1-bit LAMB, one per group for 1-bit Adam), padded with `padded_numel`; the pad takes
part in the compressed allreduce and is kept (and checkpointed), as DeepSpeed does.

Every parameter takes part in every step: a missing gradient counts as zero, so state, step counters
and the flat buffer always cover all parameters (DeepSpeed fails or desynchronizes there).

The exchange (`ExchangeOptions`): each worker sends its local momentum as sign bits plus scales (two
phases: to the server of each chunk, back from it) with error feedback on both sides.
- `compression`: where the scales apply. `deepspeed` is DeepSpeed's exchange exactly: one scale per rank's
  whole buffer and per server chunk, with κ (per-tensor scaling computed once at the first compression step)
  to equalise tensors. `per_column` gives every tensor its own scales: one per row of the embeddings (the
  groups flagged `row_scales`, `pretrain.optim.params.param_groups`; with `optim.ffn_row_scales` the FFN
  intermediate matrices too, kept row-major) and one per input column of every other matrix, so a
  hidden-state outlier dimension, which feeds one column of every matrix that reads it, does not set the
  scale of the others. A column is a row of the exchange layout (the compressor's error
  buffers live in that layout); the trainer stores those matrices column-major
  (`pretrain.model.column_major_linear_weights_`), so their momentum views are that layout already, and a
  row-major matrix is copied into it and back around the exchange.
- `exact_vectors`: the 1-D tensors (biases, LayerNorm) with one scale per element, i.e. averaged exactly.
- `scale_dtype`: fp32 scales (DeepSpeed), or bfloat16 rounded where computed (the error feedback takes
  the rounding) and sent in 2 bytes.
- `sign_scale`: the scale of a segment's signs: `rms` (DeepSpeed) or `mean_abs` (the least-squares one).
- `precondition`: every worker sends m/(√v+ε) instead of m (v frozen at freeze_step, so the divisor is the
  same on every rank) and the average is multiplied back: averaging commutes with the division, so only
  where the compression error falls changes: one scale covers elements of like size in the units of the
  step itself. No bytes; one divisor buffer per rank.
What each choice measured: docs/onebit-lamb.md and results/cpu-study/README.md.

Virtual workers (`virtual_workers=k`, simulated data parallelism, `pretrain.train.simulated`): this process
stands for k workers. In warmup the caller averages their gradients into `.grad` as usual; in the
compression stage it writes worker w's own gradient into row w of `worker_gradients()` (views per
parameter from `worker_gradient_views(w)`) instead of `.grad`, and `step()` forms each worker's local
momentum from it and exchanges all k through the compressed allreduce (a world of n = group size · k).

Diagnostics: an optional `probe` (`pretrain.observability.diagnostics`) with `active`,
`before_exchange(local, world
size, group)` and `after_exchange(averaged, params, kappas)` sees the κ-scaled local and averaged
momentum of each exchange while active (log steps only; its own traffic is not counted).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from pretrain.comm import CompressedAllreduce, TrafficCounter, padded_numel
from pretrain.comm.compressed_allreduce import ScaleDtype, SignScale
from pretrain.comm.kernels import MomentumSource
from pretrain.comm.layout import Block, ScaleLayout
from pretrain.optim.base import OptimizerBase, Workspace, evaluate_closure, global_grad_norm, views_like
from pretrain.optim.live_step import momentum_source, preconditioned_momentum_

logger = logging.getLogger(__name__)


class Stage(str, enum.Enum):
    warmup = "warmup"
    compression = "compression"


class Compression(str, enum.Enum):
    """Where the 1-bit exchange's scales apply (module docstring)."""

    deepspeed = "deepspeed"  # one per rank's buffer and per server chunk, κ-equalised tensors (parity)
    per_column = "per_column"  # one per tensor, per embedding row and per input column of other matrices

    @property
    def row_scales(self) -> bool:
        """Whether the embeddings get one scale per row (`param_groups(row_scales=True)`)."""
        return self is Compression.per_column


@dataclass(frozen=True)
class ExchangeOptions:
    """How a momentum segment is exchanged (module docstring). Strings are taken for the enums."""

    compression: Compression = Compression.deepspeed
    exact_vectors: bool = False
    sign_scale: SignScale = SignScale.rms
    precondition: bool = False  # exchange m/(√v+ε) with v frozen (module docstring), not m
    scale_dtype: ScaleDtype = ScaleDtype.float32  # how the scales travel (`pretrain.comm.ScaleDtype`)

    def __post_init__(self) -> None:
        object.__setattr__(self, "compression", Compression(self.compression))
        object.__setattr__(self, "sign_scale", SignScale(self.sign_scale))
        object.__setattr__(self, "scale_dtype", ScaleDtype(self.scale_dtype))

    def blocks(self, params: list[Tensor], row_scaled: set[int], pad: int) -> list[Block] | None:
        """The scale blocks of a buffer holding `params` then `pad` zeros; None: DeepSpeed's layout."""
        if self.compression is Compression.deepspeed:
            return None
        rows = self.compression.row_scales
        column_scaled = self.column_scaled(params, row_scaled)
        blocks = []
        for p, columns in zip(params, column_scaled):
            if self.exact_vectors and p.dim() <= 1:
                blocks.append(Block(p.numel(), 1))
            elif rows and id(p) in row_scaled:  # a 1-D row-scaled tensor: rows of one element (exact)
                if p.dim() >= 2 and not p.is_contiguous():  # its rows must be contiguous runs of the buffer
                    raise ValueError(
                        f"a row-scaled {tuple(p.shape)} tensor must be row-major (contiguous): leave it out "
                        "of column_major_linear_weights_ (its `skip`)"
                    )
                blocks.append(Block(p.numel(), p.shape[-1] if p.dim() >= 2 else 1))
            elif columns:  # a row of the exchange layout is one column of the matrix: p.shape[0] elements
                blocks.append(Block(p.numel(), p.shape[0]))
            else:
                blocks.append(Block(p.numel(), p.numel()))
        if pad:
            blocks.append(Block(pad, pad))
        return blocks

    def layout(
        self, params: list[Tensor], row_scaled: set[int], padded: int, world_size: int
    ) -> ScaleLayout | None:
        """The scale layout of a `padded`-element buffer holding `params` (then zeros), exchanged by
        `world_size` workers; None: DeepSpeed's (one scale per rank's buffer)."""
        blocks = self.blocks(params, row_scaled, padded - sum(p.numel() for p in params))
        return None if blocks is None else ScaleLayout.from_blocks(blocks, padded, world_size)

    def column_scaled(self, params: list[Tensor], row_scaled: set[int]) -> list[bool]:
        """Per tensor: whether each of its columns gets a scale (`per_column`: the matrices without row
        scales)."""
        columns = self.compression is Compression.per_column
        return [columns and p.dim() == 2 and id(p) not in row_scaled for p in params]

    def transposed(self, params: list[Tensor], row_scaled: set[int]) -> list[bool]:
        """Per tensor: whether it is exchanged transposed: the column-scaled matrices stored row-major. A
        column-major one (`pretrain.model.column_major_linear_weights_`, what the trainer makes of them)
        already holds its columns contiguously, in the exchange layout itself."""
        return [c and p.is_contiguous() for p, c in zip(params, self.column_scaled(params, row_scaled))]


@dataclass
class MomentumSegment:
    """One flat fp32 buffer holding the momenta of `params` as views, plus its compressor (n > 1)."""

    params: list[Tensor]
    buffer: Tensor
    views: list[Tensor]
    pad: Tensor
    compressor: CompressedAllreduce | None
    previous: Tensor | None = None  # snapshot of `buffer` (1-bit LAMB), allocated once
    _scaled: Tensor | None = None  # β1·buffer for the virtual workers' local momenta, allocated once
    local: Tensor | None = None  # [k, len(buffer)]: the virtual workers' gradients, then local momenta
    divisors: list[Tensor] | None = None  # `precondition`: √v+ε per tensor (v frozen), built at first use
    transposed: list[bool] | None = None  # `per_column`: the tensors exchanged transposed (None: none)

    @classmethod
    def build(
        cls,
        params: list[Tensor],
        world_size: int,
        group: Any,
        traffic: TrafficCounter,
        options: ExchangeOptions,
        row_scaled: set[int],
        virtual_workers: int = 1,
    ) -> MomentumSegment:
        """`world_size` counts workers (processes × `virtual_workers` per process)."""
        numel = sum(p.numel() for p in params)
        device = params[0].device
        buffer = torch.zeros(padded_numel(numel, world_size), dtype=torch.float32, device=device)
        compressor = None
        if world_size > 1:
            layout = options.layout(params, row_scaled, buffer.numel(), world_size)
            compressor = CompressedAllreduce(
                buffer.numel(),
                group,
                device,
                counter=traffic,
                layout=layout,
                virtual_workers=virtual_workers,
                sign_scale=options.sign_scale,
                scale_dtype=options.scale_dtype,
            )
        segment = cls(params, buffer, views_like(buffer, params), buffer[numel:], compressor)
        transposed = options.transposed(params, row_scaled)
        segment.transposed = transposed if any(transposed) else None
        if virtual_workers > 1:
            segment.local = torch.zeros(virtual_workers, buffer.numel(), device=device)
        return segment

    def snapshot(self) -> list[Tensor]:
        """Copy the momentum into the persistent `previous` buffer; per-parameter views of the copy."""
        self.scratch().copy_(self.buffer)
        return views_like(self.scratch(), self.params)

    def scratch(self) -> Tensor:
        """The persistent `previous` buffer (as long as `buffer`), allocated on first use: the snapshot
        of the frozen trust-ratio rule, or the compiled step's exchange buffer (`pretrain.optim.compiled`)."""
        if self.previous is None:
            self.previous = torch.empty_like(self.buffer)
        return self.previous

    def reset_exchange_state(self) -> None:
        """Zero the error-feedback buffers and the pad (a fresh start of compression); forget the
        preconditioner (v is frozen anew)."""
        self.pad.zero_()
        self.divisors = None
        if self.compressor is not None:
            self.compressor.reset_errors()

    def views_of(self, flat: Tensor) -> list[Tensor]:
        """Per-parameter views into another buffer laid out like `buffer` (e.g. a snapshot)."""
        return views_like(flat, self.params)

    def exchange_views(self, flat: Tensor) -> list[Tensor]:
        """Like `views_of` for a buffer in the exchange layout (the compressor's error buffers): a
        transposed tensor's view is [columns, rows]."""
        views = views_like(flat, self.params)
        if self.transposed is None:
            return views
        return [v.view(v.shape[1], v.shape[0]) if t else v for v, t in zip(views, self.transposed)]

    def to_exchange_layout_(self, flat: Tensor, divisors: list[Tensor] | None, workspace: Workspace) -> None:
        """flat ([len] or [k, len]) ← its tensors divided by `divisors` (None: as they are), the
        `transposed` ones transposed: each matrix column becomes a contiguous row with its own scale.

        A transposed matrix goes through one matrix-sized scratch of `workspace`: a contiguous division
        into it, then ATen's blocked transposed copy back. The division in place, a `.contiguous()`
        temporary per matrix (its pages faulted in anew every step) and a copy back took both directions
        0.59 s of BERT-Base's 1.53 s step at 2 loopback ranks, this way 0.35 s (README, issue #15)."""
        for row in [flat] if flat.dim() == 1 else list(flat):
            views = views_like(row, self.params)
            transposed = self.transposed or [False] * len(views)
            plain = [i for i, t in enumerate(transposed) if not t]
            if divisors is not None and plain:
                torch._foreach_div_([views[i] for i in plain], [divisors[i] for i in plain])
            for i in (i for i, t in enumerate(transposed) if t):
                view = views[i]
                scratch = workspace.flat(view.numel(), view.device).view(view.shape)
                if divisors is None:
                    scratch.copy_(view)
                else:
                    torch.div(view, divisors[i], out=scratch)
                view.view(view.shape[1], view.shape[0]).copy_(scratch.t())

    def from_exchange_layout_(
        self, flat: Tensor, divisors: list[Tensor] | None, workspace: Workspace
    ) -> None:
        """Undo `to_exchange_layout_` on `flat` ([len]): transpose back, multiply by `divisors`."""
        views = views_like(flat, self.params)
        transposed = self.transposed or [False] * len(views)
        for i in (i for i, t in enumerate(transposed) if t):
            view = views[i]
            scratch = workspace.flat(view.numel(), view.device).view(view.shape)
            scratch.copy_(view.view(view.shape[1], view.shape[0]).t())
            if divisors is None:
                view.copy_(scratch)
            else:
                torch.mul(scratch, divisors[i], out=view)
        plain = [i for i, t in enumerate(transposed) if not t]
        if divisors is not None and plain:
            torch._foreach_mul_([views[i] for i in plain], [divisors[i] for i in plain])

    def snapshot_scaled(self, factor: float) -> Tensor:
        """factor · buffer, in a scratch buffer kept for the purpose (virtual workers)."""
        if self._scaled is None:
            self._scaled = torch.empty_like(self.buffer)
        return torch.mul(self.buffer, factor, out=self._scaled)


def _world_size(group: Any) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


class OnebitOptimizer(OptimizerBase):
    """Base class; subclasses define `_segment_groups()`, `_init_param_state()`, `_warmup_step()`,
    `_compression_step()` and may extend `_on_load_warmup()`.

    Overflow: each rank checks its gradients for Inf/NaN and the flag is MAX-allreduced over `group`
    (needed in the compression stage, where gradients differ per rank); if set, no rank changes any
    state (parameters, moments, errors, counters except `num_skipped_steps`). So every rank must call
    `step()` every step, overflow or not: a rank that skips the call alone leaves the others waiting.

    `traffic` (a `pretrain.comm.TrafficCounter`) totals the bytes of the compressed exchanges.
    """

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        *,
        freeze_step: int,
        group: Any = None,
        exchange: ExchangeOptions | None = None,
        virtual_workers: int = 1,
    ) -> None:
        if freeze_step < 1:
            raise ValueError(f"freeze_step must be >= 1, got {freeze_step}")
        if virtual_workers < 1:
            raise ValueError(f"virtual_workers must be >= 1, got {virtual_workers}")
        super().__init__(params, {**defaults, "step": 0})
        self.freeze_step = freeze_step
        self.group = group
        self.exchange = exchange or ExchangeOptions()
        self.virtual_workers = virtual_workers
        self.num_processes = _world_size(group)
        self.world_size = self.num_processes * self.virtual_workers  # data-parallel workers
        self.probe: Any = None  # diagnostics (module docstring)
        self.traffic = TrafficCounter()  # bytes of the compressed exchanges (zero with one rank)
        self.frozen_at: int | None = None  # step count at the last switch to compression
        self._segments: list[MomentumSegment] | None = None
        self._grad_norm: Tensor | None = None  # this step's norm of `.grad` (None: worker gradients)

    # -- stage -----------------------------------------------------------------------------------------
    @property
    def step_count(self) -> int:
        """Steps taken (skipped ones not counted); the same in every group."""
        return self.param_groups[0]["step"]

    @property
    def stage(self) -> Stage:
        """Stage of the NEXT `step()`."""
        return Stage.warmup if self.step_count < self.freeze_step else Stage.compression

    @property
    def needs_gradient_allreduce(self) -> bool:
        """True in warmup: mean-allreduce gradients before the next step. False in compression: do NOT."""
        return self.stage is Stage.warmup

    # -- step ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step. Warmup: gradients must be averaged over ranks; compression: this rank's own. Either
        way they must be the MEAN over this rank's micro-batches (divide the loss by their number).
        After `mark_gradients_checked(norm)` (`OptimizerBase`) a compression-stage step reading `.grad`
        skips its own check (a full read of the gradients and an allreduce), and so does a warmup step
        given the norm (it feeds nvlamb's pre-normalization); virtual workers' compression steps check
        their own gradients anyway."""
        loss = evaluate_closure(closure)
        segments = self._ensure_state()
        grads = [self._fp32_grad(p) for segment in segments for p in segment.params]
        checked_by_caller, caller_norm = self.take_caller_check()
        if (
            checked_by_caller
            and not self.uses_worker_gradients
            and (self.stage is Stage.compression or caller_norm is not None)
        ):
            # the caller's MAX-allreduced check covered these gradients (its norm is theirs); the
            # compression stage needs no norm
            self._grad_norm = caller_norm
            self._record_skip(False)
        else:
            checked = grads
            if self.uses_worker_gradients:
                checked = [segment.local for segment in segments if segment.local is not None]
            norm = global_grad_norm(checked)
            # the norm of `grads` (averaged in warmup), for a subclass that needs it (nvlamb's scale)
            self._grad_norm = norm if checked is grads else None
            if self._record_skip(self._any_rank_nonfinite(norm)):
                return loss
        if self.stage is Stage.warmup:
            self._warmup_step(grads)
        else:
            self._compress(grads)
        for group in self.param_groups:
            group["step"] += 1
        if self.step_count == self.freeze_step:
            self._freeze()
        self._copy_masters_back([p for segment in segments for p in segment.params])
        return loss

    @property
    def uses_worker_gradients(self) -> bool:
        """True when the next `step()` reads the virtual workers' own gradients from
        `worker_gradients()` rather than `.grad` (virtual workers, compression stage)."""
        return self.virtual_workers > 1 and self.stage is Stage.compression

    def worker_gradients(self) -> list[Tensor]:
        """Per segment, the [k, len] buffer whose row w takes virtual worker w's own gradient."""
        if self.virtual_workers == 1:
            raise RuntimeError("worker_gradients() needs virtual_workers > 1")
        return [segment.local for segment in self._ensure_state()]  # type: ignore[misc]

    def worker_gradient_views(self, worker: int) -> list[Tensor]:
        """Views of row `worker` of `worker_gradients()` shaped like the parameters, in parameter order."""
        return [view for segment in self._ensure_state() for view in segment.views_of(segment.local[worker])]  # type: ignore[index]

    def _any_rank_nonfinite(self, norm: Tensor) -> bool:
        """Whether this rank's gradient norm `norm`, or any other rank's, is not finite."""
        flag = (~torch.isfinite(norm)).float().reshape(1)
        if self.num_processes > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    # -- state -----------------------------------------------------------------------------------------
    def _segment_groups(self) -> list[list[Tensor]]:
        """Parameter lists sharing one flat momentum buffer (and one compressor)."""
        raise NotImplementedError

    def _init_param_state(self, param: Tensor) -> None:
        """Create the subclass's per-parameter state besides exp_avg (fresh optimizer)."""
        raise NotImplementedError

    def _warmup_step(self, grads: list[Tensor]) -> None:
        raise NotImplementedError

    def _freeze(self) -> None:
        """End of the warmup (after step freeze_step): compression starts from clean exchange state.
        Subclasses add their own (v_f ← v, forget κ)."""
        for segment in self._segments or []:
            segment.reset_exchange_state()
        self.frozen_at = self.step_count

    def _compress(self, grads: list[Tensor]) -> None:
        if self.frozen_at is None:  # freeze_step was lowered below the step count (e.g. between phases)
            self._freeze()
        self._compression_step(grads)

    def _compression_step(self, grads: list[Tensor]) -> None:
        raise NotImplementedError

    def _ensure_state(self) -> list[MomentumSegment]:
        """Build the flat momentum buffers once; exp_avg becomes a view (loaded values are copied in)."""
        if self._segments is not None:
            return self._segments
        self._segments = []
        row_scaled = {id(p) for g in self.param_groups if g.get("row_scales") for p in g["params"]}
        for params in self._segment_groups():
            segment = MomentumSegment.build(
                params,
                self.world_size,
                self.group,
                self.traffic,
                self.exchange,
                row_scaled,
                self.virtual_workers,
            )
            for param, view in zip(params, segment.views):
                state = self.state[param]
                if "exp_avg" in state:
                    view.copy_(state["exp_avg"])
                else:
                    self._init_param_state(param)
                state["exp_avg"] = view
            self._segments.append(segment)
        for group in self.param_groups:
            self._check_mask(group)
        return self._segments

    @staticmethod
    def _check_mask(group: dict[str, Any]) -> None:
        mask = group.get("exp_avg_mask")
        if mask is None:
            return
        for p in group["params"]:
            if torch.broadcast_shapes(mask.shape, p.shape) != p.shape:
                raise ValueError(
                    f"exp_avg_mask of shape {tuple(mask.shape)} does not fit a {tuple(p.shape)} param"
                )
        group["exp_avg_mask"] = mask.to(device=group["params"][0].device, dtype=torch.float32)

    def _apply_masks(self) -> None:
        """m ← m·mask for groups with `exp_avg_mask` (zero momentum where the model never trains)."""
        for group in self.param_groups:
            mask = group.get("exp_avg_mask")
            if mask is not None:
                for p in group["params"]:
                    self.state[p]["exp_avg"].mul_(mask)

    def _group_slices(self) -> list[tuple[dict[str, Any], slice]]:
        """Each param group with the slice of the flat parameter order (segments concatenated) it owns."""
        slices, start = [], 0
        for group in self.param_groups:
            slices.append((group, slice(start, start + len(group["params"]))))
            start += len(group["params"])
        return slices

    # -- checkpoints -----------------------------------------------------------------------------------
    def _extra_state(self) -> dict[str, Any]:
        segments = self._segments or []
        return {
            **super()._extra_state(),
            "world_size": self.world_size,
            "freeze_step": self.freeze_step,
            "frozen_at": self.frozen_at,
            # a copy: the pad is a view of the momentum buffer, and saving a view saves its whole storage
            # (the momenta, which the checkpoint writes once, in its replicated part)
            "momentum_pads": [segment.pad.clone() for segment in segments],
            "compressors": [segment.compressor.state_dict() for segment in segments if segment.compressor],
        }

    def _load_extra_state(self, extra: dict[str, Any]) -> None:
        super()._load_extra_state(extra)
        self._segments = None
        segments = self._ensure_state()
        self.frozen_at = extra.get("frozen_at")
        if self.stage is Stage.warmup:
            self.frozen_at = None
            self._on_load_warmup()
            return
        if extra.get("world_size") != self.world_size:
            logger.warning(
                "1-bit optimizer checkpoint saved with world size %s, resumed with %s: the error-feedback "
                "buffers and the momentum pad start from zero",
                extra.get("world_size"),
                self.world_size,
            )
        else:
            for segment, pad in zip(segments, extra.get("momentum_pads", [])):
                segment.pad.copy_(pad)
            compressors = [segment.compressor for segment in segments if segment.compressor]
            for compressor, saved in zip(compressors, extra.get("compressors", [])):
                compressor.load_state_dict(saved, reset_on_mismatch=True)

    def _on_load_warmup(self) -> None:
        """Loaded at step < freeze_step: drop compression-only state (errors and pad start at zero)."""

    def _fused_exchange(self, segment: MomentumSegment, kappas: list[Tensor] | None) -> bool:
        """Whether the passes around a preconditioned exchange may fold into the step's own loops: the
        local momentum formed already divided by √v+ε (`live_step.preconditioned_momentum_`) and, for
        1-bit LAMB's live step, the average left in units of u. Needs more than one worker, no κ and no
        diagnostics probe (it reads the momentum before the division)."""
        probing = self.probe is not None and self.probe.active
        exchanged = segment.compressor is not None
        return self.exchange.precondition and exchanged and kappas is None and not probing

    def _preconditioned_local_momentum(
        self,
        segment: MomentumSegment,
        grads: list[Tensor],
        kappas: list[Tensor] | None,
        *,
        beta1: float,
        grad_scale: float = 1.0,
        marginals: list[tuple[Tensor, Tensor] | None] | None = None,
    ) -> MomentumSource | bool:
        """k == 1 where `_fused_exchange` allows: x = (β1·m + (1−β1)·(s·g))/(√v+ε) (`grads` those of the
        segment's parameters, s = `grad_scale`), ready for `_exchange(..., divided=True)`: a
        `MomentumSource` for the exchange to form x inside its first pass (one torch thread and nothing
        exchanged transposed: `live_step.momentum_source`), or True: formed into the segment's views.
        False (nothing changed) elsewhere: the caller forms m itself (and scales `grads` first).
        `marginals` (`live_step.momentum_source`) go into a source only: elsewhere the caller adds them."""
        if segment.local is not None or not self._fused_exchange(segment, kappas):
            return False
        views, divisors = segment.views, self._divisors(segment)
        if segment.transposed is None and torch.get_num_threads() == 1:
            source = momentum_source(
                segment.buffer,
                views,
                grads,
                divisors,
                beta1=beta1,
                grad_scale=grad_scale,
                marginals=marginals,
            )
            if source is not None:
                return source
        return preconditioned_momentum_(views, views, grads, divisors, beta1=beta1, grad_scale=grad_scale)

    def _exchange(
        self,
        segment: MomentumSegment,
        kappas: list[Tensor] | None,
        *,
        beta1: float,
        divided: bool = False,
        scale_back: bool = True,
        source: MomentumSource | None = None,
    ) -> None:
        """Replace the segment's local momentum by the compressed average over all workers.

        k == 1: `segment.buffer` holds this rank's local momentum (views updated by the caller); `divided`:
        the caller formed it already divided by √v+ε (`_preconditioned_local_momentum`), or hands it over
        as `source` (`divided`; the compressor forms it inside its first pass).
        k > 1: row w of `segment.local` holds worker w's own gradient g_w; here it becomes that
        worker's local momentum β1·m + (1−β1)·g_w (m the synchronized momentum in `segment.buffer`,
        the pad kept from it), with the arithmetic of
        `functional.local_momentum_` (preconditioned: divided by √v+ε in the same numba loop where
        `_fused_exchange` allows, as k == 1 does). κ (DeepSpeed's layout only) scales every tensor before
        the exchange and is divided out after it. `scale_back=False` (preconditioned): the buffer keeps
        the average ū in units of u, for the caller's step to multiply by √v+ε (`live_step`).
        """
        compressor = segment.compressor
        if compressor is None:  # one worker: the exchange is the identity, κ·(1/κ) only adds rounding
            return
        if segment.local is None:
            local = segment.buffer
            if kappas is not None:
                torch._foreach_mul_(segment.views, kappas)
        else:
            local = segment.local
            divided = self._virtual_local_momenta(segment, kappas, beta1=beta1)
        probe = self.probe if self.probe is not None and self.probe.active else None
        if probe is not None:
            probe.before_exchange(local, self.world_size, self.group)
        divisors = self._divisors(segment) if self.exchange.precondition else None
        segment.to_exchange_layout_(local, None if divided else divisors, self.workspace)
        if segment.local is None:
            compressor(segment.buffer, source=source)
        else:
            compressor(segment.local, out=segment.buffer)
        segment.from_exchange_layout_(segment.buffer, divisors if scale_back else None, self.workspace)
        if probe is not None:
            probe.after_exchange(segment.buffer, segment.params, kappas)
        if kappas is not None:
            torch._foreach_div_(segment.views, kappas)

    def _virtual_local_momenta(
        self, segment: MomentumSegment, kappas: list[Tensor] | None, *, beta1: float
    ) -> bool:
        """`_exchange`'s k > 1 local momenta (its docstring), row by row of `segment.local`; returns whether
        they came out divided by √v+ε (the fused loop)."""
        assert segment.local is not None
        local = segment.local
        numel = segment.buffer.numel() - segment.pad.numel()
        if self._fused_exchange(segment, kappas):
            divisors, momenta = self._divisors(segment), segment.views
            first, *rest = [segment.views_of(row) for row in local]
            if preconditioned_momentum_(first, momenta, first, divisors, beta1=beta1):
                for views in rest:  # the first row told whether the loop runs here at all
                    preconditioned_momentum_(views, momenta, views, divisors, beta1=beta1)
                local[:, numel:].copy_(segment.pad)
                return True
        scaled = segment.snapshot_scaled(beta1)  # β1·m, once for all workers
        for worker in range(self.virtual_workers):
            row = local[worker]
            torch.add(scaled[:numel], row[:numel], alpha=1.0 - beta1, out=row[:numel])
            row[numel:].copy_(segment.pad)
            if kappas is not None:
                torch._foreach_mul_(segment.views_of(row), kappas)
        return False

    def _divisors(self, segment: MomentumSegment) -> list[Tensor]:
        """√v+ε per tensor of `segment` from the frozen variance (built once per compression stage)."""
        if segment.divisors is None:
            eps = {id(p): group["eps"] for group in self.param_groups for p in group["params"]}
            segment.divisors = [self.state[p]["exp_avg_sq"].sqrt().add_(eps[id(p)]) for p in segment.params]
        return segment.divisors

    def _error_norm(self, segment: MomentumSegment) -> Tensor:
        """‖worker error‖ of `segment`; a preconditioned exchange's (in units of u) times √v+ε first, one
        tensor at a time through the workspace (no buffer-sized temporary: this runs at every log step)."""
        assert segment.compressor is not None
        error = segment.compressor.worker_error
        if segment.divisors is None or error.numel() == 0:
            return torch.linalg.vector_norm(error)
        rows = error.view(-1, segment.buffer.numel())
        divisors = segment.divisors
        if segment.transposed is not None:  # the error buffers are in the exchange layout
            divisors = [d.t() if t else d for d, t in zip(divisors, segment.transposed)]
        scratch = self.workspace.flat(max(d.numel() for d in divisors), error.device)
        norms = []
        for row in rows:
            row_norms = []
            for view, divisor in zip(segment.exchange_views(row), divisors):
                product = scratch[: view.numel()].view(view.shape)
                torch.mul(view, divisor, out=product)
                row_norms.append(torch.linalg.vector_norm(product))
            norms.append(torch.linalg.vector_norm(torch.stack(row_norms)))
        pads = rows[:, segment.buffer.numel() - segment.pad.numel() :]
        return torch.linalg.vector_norm(torch.stack([*norms, torch.linalg.vector_norm(pads)]))

    def statistics(self) -> dict[str, float]:
        statistics = {**super().statistics(), "compression_stage": float(self.stage is Stage.compression)}
        segments = [s for s in self._segments or [] if s.compressor is not None]
        if segments:  # the error feedback carried to the next step (worker side, this rank; momentum units)
            norms = torch.stack([self._error_norm(segment) for segment in segments])
            statistics["compression_error_norm"] = float(torch.linalg.vector_norm(norms))
        return statistics

    # -- the training loop's interface (`pretrain.optim.protocol.TrainingOptimizer`) ---------------------
    @property
    def bytes_sent(self) -> float:
        """Bytes of this rank's compressed calls and exact exchanges so far (`traffic`)."""
        return float(self.traffic.bytes_sent)

    def start_phase(self, *, freeze_step: int | None, max_seq_length: int) -> None:
        """A training phase starts: `freeze_step` (None: keep it) takes effect from the next step (module
        docstring), and every `exp_avg_mask` (the position embeddings', `params.param_groups`) lets the
        momentum through on the rows < `max_seq_length` only."""
        if freeze_step is not None:
            self.freeze_step = freeze_step
        for group in self.param_groups:
            mask = group.get("exp_avg_mask")
            if mask is not None:
                mask.zero_()
                mask[:max_seq_length] = 1.0
