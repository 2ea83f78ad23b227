"""1-bit LAMB's compression step as a few compiled passes over memory (`optim.compile=true`).

The eager step (`OnebitLamb._compression_step` with `precondition` and a live trust ratio, the project's
default) runs about fourteen separate full-buffer passes around the compressed allreduce: the local
momentum (two), the division by √v+ε (into a scratch, then a transposed copy for a per-column matrix),
the same two passes back with the multiplication, and the trust-ratio step (eight); on CPU with numba
(`pretrain.optim.live_step`) the eager step itself makes three loops per tensor: the momentum already
divided, and the trust-ratio step's two, which multiply by √v+ε on the way. Here they are at most
four per tensor (items 1, 3-5; five for a `per_column` matrix), each one `torch.compile`d function
(Inductor: vectorised C++ on CPU, Triton on GPU):

1. `preconditioned_momentum_`: x = (β1·m + (1−β1)·g)/d, written into the exchange layout of a scratch
   buffer. A `per_column` matrix stored column-major (the trainer's, `pretrain.model`) is already in that
   layout; a row-major one's x is written into m itself (the exchange replaces m) and goes out by a tiled
   transposed copy: one kernel writing xᵀ from three row-major inputs took 2.9 ns per element on CPU, the
   contiguous kernel plus the copy 0.9 + 1.3 (BERT-Base at 2 ranks: 0.31 → 0.21 s per step). Every kernel
   takes its tensors flat in memory order (`base.flat_views`, which refuses operands of mixed orders);
2. the compressed allreduce on that scratch buffer (the engine's own passes, `pretrain.comm`);
3. for a transposed matrix, one tiled transposed copy of its average ū back into m;
4. `live_ratio`: the norms ‖p‖, ‖m/d + λp‖ of m = ū·d and from them c, LAMB's clamped ratio (reads only);
5. `live_apply_`: m ← ū·d and p ← p − η·c·(m/d + λp), the element loop alone (the ratio's scalar arithmetic
   in the same graph kept Inductor's CPU code from running the loop on more than one thread; m's store in
   the ratio's graph took Inductor a second loop after the reduction: 10 → 8 passes over memory).

The scratch buffer is the segment's momentum snapshot (`MomentumSegment.scratch()`), which the frozen rule's
eager step uses; the eager live step does not allocate it, so the compiled step holds one momentum-sized fp32
buffer more than that (4 bytes per parameter). With one process the exchange is the identity and nothing is
transposed. The math is the eager step's (the same formulas in the same order of operations); results agree
to float rounding, not bitwise: the compiled kernels may contract a multiply and an add into one FMA where
the eager ones do not (tests/distributed/test_compiled_step.py states the tolerance). Like every other path
it is deterministic, so a run resumes bitwise on the path it was saved from.

The warmup stage uses LAMB's compiled kernels (`functional.lamb_tensor_direction_` / `lamb_tensor_apply_`,
DeepSpeed's clamped variant without bias correction), which also return the trust ratios c̄ averages.

Where it applies: 1-bit LAMB's live trust ratio with the preconditioned exchange, one worker per process
(`unsupported_reason`): `optim=onebit_lamb`; the config refuses `optim.compile=true` elsewhere. Log steps
with diagnostics switched on take the eager path (the probes read its intermediate buffers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from pretrain.optim import functional as F
from pretrain.optim.base import flat_views

_COMPILED: dict[str, Callable[..., Any]] = {}

# A call of a compiled kernel costs ~50-130 µs on CPU before any element is touched (Dynamo's guards, the
# AOT wrapper, Inductor's launcher), more than the eager multi-tensor (foreach) update of a tensor this
# small: measured crossover 64K elements (bench optim's note). Smaller tensors (BERT's biases and LayerNorm
# parameters: 60 % of its tensors, 0.2 % of its elements) take the eager foreach path in one batch.
COMPILED_MIN_NUMEL = 1 << 16


def compiled(function: Callable[..., Any]) -> Callable[..., Any]:
    """`torch.compile(function, dynamic=True)`, made once per process and shared by every optimizer: one
    graph per kind of input (transposed or not, 1-D or 2-D) serves every tensor size and every step.

    With Inductor's `cpp.dynamic_threads`: its CPU code otherwise decides at compile time, from a size hint,
    whether a loop runs on all threads, and a graph recompiled for a new kind of input (e.g. tensors that
    do not require grad) came out single-threaded: LAMB's apply kernel at 0.94 of fused AdamW's time on a
    64M-element tensor at 2 threads instead of 0.63 (`bench optim`, issue #15). No effect on Triton."""
    name = function.__name__
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(function, dynamic=True, options={"cpp.dynamic_threads": True})
    return _COMPILED[name]


def split_by_size(tensors: list[Tensor]) -> tuple[list[int], list[int]]:
    """Positions of the tensors below `COMPILED_MIN_NUMEL` (eager foreach path) and of the rest."""
    small = [i for i, t in enumerate(tensors) if t.numel() < COMPILED_MIN_NUMEL]
    large = [i for i, t in enumerate(tensors) if t.numel() >= COMPILED_MIN_NUMEL]
    return small, large


def pick(tensor_lists: list[list[Tensor]], positions: list[int]) -> list[list[Tensor]]:
    """The same positions of every list."""
    return [[tensors[i] for i in positions] for tensors in tensor_lists]


def transpose_into_(source: Tensor, out: Tensor) -> None:
    """out ← sourceᵀ (Inductor tiles it; an eager strided copy is several times slower on CPU)."""
    out.copy_(source.t())


def unsupported_reason(*, trust_ratio_live: bool, precondition: bool, virtual_workers: int) -> str | None:
    """Why the compiled compression step cannot run with these options, or None."""
    if not trust_ratio_live:
        return "needs the live trust ratio (the frozen c̄·f rule has no compiled step)"
    if not precondition:
        return "needs precondition=true"
    if virtual_workers > 1:
        return "needs one worker per process (sim_world_size=1)"
    return None


@dataclass
class GroupStep:
    """One parameter group's share of the step: fp32 parameters, gradients, divisors √v+ε and the
    momentum views (all in the segment's parameter order), with the kernels' scalars."""

    params: list[Tensor]
    grads: list[Tensor]
    divisors: list[Tensor]
    exp_avgs: list[Tensor]
    exchange_views: list[Tensor]  # the tensors' places in the scratch buffer, in the exchange layout
    transposed: list[bool]
    mask: Tensor | None
    scalars: Tensor  # `functional.live_scalars`


class CompiledCompressionStep:
    """The passes of the module docstring for one momentum segment; `exchange(scratch)` is the
    compressed allreduce in place (identity with one worker)."""

    def __init__(self) -> None:
        self._momentum = compiled(F.preconditioned_momentum_)
        self._transpose = compiled(transpose_into_)
        self._ratio = compiled(F.live_ratio)
        self._apply = compiled(F.live_apply_)

    def __call__(
        self, groups: list[GroupStep], buffer: Tensor, scratch: Tensor, exchange: Callable[[Tensor], Any]
    ) -> list[Tensor]:
        """Step every group; `buffer` holds the momenta (views `exp_avgs`) and the pad after them,
        `scratch` is as long. Returns each group's trust ratios c, shape [len(params)]."""
        numel = sum(m.numel() for group in groups for m in group.exp_avgs)
        for group in groups:
            for m, g, d, out, transposed in zip(
                group.exp_avgs, group.grads, group.divisors, group.exchange_views, group.transposed
            ):
                flat_m, flat_g, flat_d, flat_out = flat_views(m, g, d, out)  # one graph for every shape
                if transposed:  # x into m itself (the exchange replaces it), then the tiled transpose
                    self._momentum(flat_m, flat_g, flat_d, flat_m, group.scalars)
                    self._transpose(m, out)
                else:
                    self._momentum(flat_m, flat_g, flat_d, flat_out, group.scalars)
        scratch[numel:].copy_(buffer[numel:])  # the pad takes part in the exchange, as in the eager path
        exchange(scratch)
        buffer[numel:].copy_(scratch[numel:])
        ratios = []
        for group in groups:
            if group.mask is not None:
                for view, transposed in zip(group.exchange_views, group.transposed):
                    view.mul_(group.mask.t() if transposed else group.mask)
            group_ratios = []
            for p, m, d, view, transposed in zip(
                group.params, group.exp_avgs, group.divisors, group.exchange_views, group.transposed
            ):
                flat_p, flat_m, flat_d = flat_views(p, m, d)
                source = None  # ū: in m after the transposed copy (the apply scales m in place), else in view
                if transposed:
                    self._transpose(view, m)
                else:
                    source = flat_views(m, view)[1]
                coeffs = self._ratio(flat_m, flat_d, flat_p, group.scalars, source)
                self._apply(flat_p, flat_m, flat_d, coeffs, group.scalars, source)
                group_ratios.append(coeffs[0])
            ratios.append(torch.stack(group_ratios) if group_ratios else torch.zeros(0, device=buffer.device))
        return ratios


class CompiledWarmupStep:
    """LAMB's step through its compiled kernels, for `Lamb(compile=True)` and 1-bit LAMB's warmup
    (`clamp_ratio`: DeepSpeed's, else NVLAMB's for a group with weight decay; `scalars` from
    `lamb_kernel_scalars`); returns the ratios. The caller sends tensors below `COMPILED_MIN_NUMEL` through
    the eager foreach step instead (`split_by_size`)."""

    def __init__(self) -> None:
        self._direction = compiled(F.lamb_tensor_direction_)
        self._apply = compiled(F.lamb_tensor_apply_)

    def __call__(
        self,
        params: list[Tensor],
        grads: list[Tensor],
        exp_avgs: list[Tensor],
        exp_avg_sqs: list[Tensor],
        *,
        scalars: Tensor,
        clamp_ratio: bool = True,
    ) -> Tensor:
        ratios = []
        for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
            p, g, m, v = flat_views(p, g, m, v)
            coeffs = self._direction(p, g, m, v, scalars, clamp_ratio=clamp_ratio)
            self._apply(p, m, v, coeffs, scalars)
            ratios.append(coeffs[0])
        return torch.stack(ratios)
