"""1-bit LAMB's eager compression-stage step with the live trust ratio, fused for CPU in numba.

After the exchange every tensor takes p ← p − η·c·u, u = m/(√v+ε) + λp, c = clamp(‖p‖/‖u‖, min, max)
(1 where a norm is 0): `functional.clamped_trust_ratio_step_`, which in torch ops makes five passes over each
1M-element chunk (u into the workspace, + λp, both norms, the update), each a separate ATen loop. On the
2-core bench machine that was 0.48 s of a 4-rank BERT-Base step per rank, half of LAMB's whole step (issue
#15's e2e probe). Here two numba loops per tensor read p, m and the divisor from memory: the first sums p²
and u² (vectorised: ``reassoc`` on that loop only, an order fixed by the compiled code; the terms in fp32
over spans of `lamb_loops.SPAN` elements, the spans' sums in float64), the second forms u again and writes
p. Nothing is stored but p.

The bits differ from the torch path's in the last place (the norms' summation order; u as m/(√v+ε) rather
than m·(1/(√v+ε))). Every loop here runs over the blocks of `pretrain.optim.blocks` on torch's threads
(one per rank in the multi-rank runs; the norms' block sums added in block order, so the bits do not depend
on the thread count). Virtual workers and real ranks run this same code after the exchange, so they stay equal
bit for bit, and a resumed run repeats an uninterrupted one. Used on CPU for fp32 tensors laid out alike
(row-major, or all three column-major) when numba imports (:mod:`pretrain.comm.numba_support`); otherwise,
and on accelerators, the torch path (the compiled path, ``optim.compile``, is separate:
:mod:`pretrain.optim.compiled`).

Around the exchange (preconditioned, issue #15), two more passes fold into these loops:

- before it, `preconditioned_momentum_` forms x = (β1·m + (1−β1)·g)/(√v+ε) in one loop per tensor (read m,
  g and the divisor, write x) where the torch path made three (m·β1, + (1−β1)·g, ÷ divisor): 4 memory
  passes instead of 8. The sum is one fused multiply-add, as ATen's vectorised ``add(alpha=)`` computes it
  on x86 (the LLVM intrinsic ``llvm.fma``), so the bits are the torch path's there; virtual workers take
  the same loop, so real ranks and virtual workers agree bit for bit wherever it runs;
- with one torch thread and nothing exchanged transposed, `momentum_source` hands that loop's arithmetic to
  the compressed allreduce instead (:class:`~pretrain.comm.plan.MomentumSource`): its first pass forms x
  while it adds x into the error buffer, so x is never stored (the same bits); without an exchange,
  `local_momentum_` forms β1·m + (1−β1)·s·g in one loop;
- after it, the exchange's average ū (in units of u) need not be multiplied back by √v+ε in a pass of its
  own: `live_trust_ratio_step_(..., averages=True)` forms m = ū·(√v+ε) inside both loops and stores m in
  the second (the same fp32 products as that pass, so the same bits).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pretrain.comm.numba_support import numba_unavailable_reason
from pretrain.comm.plan import MomentumSource
from pretrain.optim.base import Workspace, flat_views
from pretrain.optim.blocks import Blocks, run_shared, shares
from pretrain.optim.kernel_path import KernelPath, kernel_path
from pretrain.optim.lamb_loops import SPAN, span_sums
from pretrain.optim.marginals import add_square_marginals


@functools.cache
def _numba_loops() -> Any:
    """(norms, apply) numba loops compiled on first use; None where numba cannot be used."""
    if numba_unavailable_reason() is not None:
        return None
    import numba

    # error_model="numpy": x/0 gives inf as in torch instead of a Python ZeroDivisionError check per
    # element, which kept LLVM from vectorising the loops (1.5–1.8 ns per element instead of 0.53–0.76)
    jit = functools.partial(numba.njit, cache=True, boundscheck=False, nogil=True, error_model="numpy")

    @jit(fastmath={"reassoc"})
    def square_norms_rooted(param, exp_avg, denominator, weight_decay):
        # (Σp², Σu²) over whole spans (`lamb_loops.span_sums`: fp32 per span, float64 across), u in fp32
        # as `apply_` forms it
        param_sum, update_sum = 0.0, 0.0
        for span in range(param.shape[0] // SPAN):
            param_part, update_part = np.float32(0.0), np.float32(0.0)
            for j in range(SPAN):
                i = span * SPAN + j
                p = param[i]
                u = exp_avg[i] / denominator[i] + weight_decay * p
                param_part += p * p
                update_part += u * u
            param_sum += np.float64(param_part)
            update_sum += np.float64(update_part)
        return param_sum, update_sum

    @jit(fastmath={"reassoc"})
    def square_norms(param, exp_avg, denominator, weight_decay, eps):
        # as square_norms_rooted with v in place of √v+ε
        param_sum, update_sum = 0.0, 0.0
        for span in range(param.shape[0] // SPAN):
            param_part, update_part = np.float32(0.0), np.float32(0.0)
            for j in range(SPAN):
                i = span * SPAN + j
                p = param[i]
                u = exp_avg[i] / (np.sqrt(denominator[i]) + eps) + weight_decay * p
                param_part += p * p
                update_part += u * u
            param_sum += np.float64(param_part)
            update_sum += np.float64(update_part)
        return param_sum, update_sum

    @jit
    def apply_(param, exp_avg, denominator, weight_decay, eps, rooted, step):
        # p ← p + step·u, step = −η·c (fp32)
        if rooted:
            for i in range(param.shape[0]):
                p = param[i]
                param[i] = p + step * (exp_avg[i] / denominator[i] + weight_decay * p)
        else:
            for i in range(param.shape[0]):
                p = param[i]
                param[i] = p + step * (exp_avg[i] / (np.sqrt(denominator[i]) + eps) + weight_decay * p)

    @jit(fastmath={"reassoc"})
    def square_norms_of_averages(param, average, denominator, weight_decay):
        # as square_norms_rooted with m = ū·d formed here
        param_sum, update_sum = 0.0, 0.0
        for span in range(param.shape[0] // SPAN):
            param_part, update_part = np.float32(0.0), np.float32(0.0)
            for j in range(SPAN):
                i = span * SPAN + j
                p = param[i]
                u = average[i] * denominator[i] / denominator[i] + weight_decay * p
                param_part += p * p
                update_part += u * u
            param_sum += np.float64(param_part)
            update_sum += np.float64(update_part)
        return param_sum, update_sum

    @jit
    def apply_averages_(param, average, denominator, weight_decay, step):
        # m = ū·d stored in place of ū, p ← p + step·u
        for i in range(param.shape[0]):
            p = param[i]
            m = average[i] * denominator[i]
            average[i] = m
            param[i] = p + step * (m / denominator[i] + weight_decay * p)

    return square_norms_rooted, square_norms, apply_, square_norms_of_averages, apply_averages_


MARGINAL_BLOCK = 1 << 13  # elements per block of `local_momentum_`'s loop with the square marginals


@functools.cache
def _numba_momentum() -> Any:
    """The `preconditioned_momentum_` loop compiled on first use; None where numba cannot be used."""
    if numba_unavailable_reason() is not None:
        return None
    import numba

    from pretrain.comm.numba_helpers import fma
    from pretrain.optim.numba_loops import square_marginal_rows as rows_of

    @numba.njit(cache=True, boundscheck=False, nogil=True, error_model="numpy")
    def momentum_(out, exp_avg, grad, denominator, beta1, weight, scale):
        # out ← (β1·m + weight·(s·g))/d; out may be exp_avg or grad itself (s = 1: g·s is g, the same bits)
        for i in range(out.shape[0]):
            out[i] = fma(weight, grad[i] * scale, beta1 * exp_avg[i]) / denominator[i]

    @numba.njit(cache=True, boundscheck=False, nogil=True)
    def plain_momentum_(exp_avg, grad, beta1, weight, scale):
        # m ← β1·m + weight·(s·g)
        for i in range(exp_avg.shape[0]):
            exp_avg[i] = fma(weight, grad[i] * scale, beta1 * exp_avg[i])

    @numba.njit(cache=True, boundscheck=False, nogil=True)
    def plain_momentum_marginals_(exp_avg, grad, beta1, weight, scale, inner, outer, inner_sums, scratch):
        # plain_momentum_ over a matrix (rows of `inner` elements in memory order) a cache-sized block at a
        # time, each block's whole rows of (s·g)² added into the marginals right after it, from cache: the
        # rows in order through `square_marginal_rows`, as `marginals.add_square_marginals` adds them
        columns = np.zeros(inner, dtype=np.float64)
        done, numel = 0, exp_avg.shape[0]
        for low in range(0, numel, MARGINAL_BLOCK):
            high = min(low + MARGINAL_BLOCK, numel)
            plain_momentum_(exp_avg[low:high], grad[low:high], beta1, weight, scale)
            done = rows_of(grad, high, done, inner, scale, outer, columns, scratch)
        for j in range(inner):
            inner_sums[j] += np.float32(columns[j])

    return momentum_, plain_momentum_, plain_momentum_marginals_


def preconditioned_momentum_(
    outs: list[Tensor],
    exp_avgs: list[Tensor],
    grads: list[Tensor],
    denominators: list[Tensor],
    *,
    beta1: float,
    grad_scale: float = 1.0,
) -> bool:
    """outs ← (β1·m + (1−β1)·(s·g))/d per tensor (d = √v+ε, s = ``grad_scale``, s·g rounded to fp32 as
    ``g.mul_(s)`` would) in one numba loop each (module docstring); an out may be its m or its g. Returns
    False, changing nothing, where the loop cannot be used (no numba, not CPU fp32 tensors laid out
    alike), for the caller to take the torch path."""
    loops = _numba_momentum()
    if loops is None or not outs:
        return False
    loop = loops[0]
    flats = [_flat_alike(tensors) for tensors in zip(outs, exp_avgs, grads, denominators)]
    if any(f is None for f in flats):
        return False
    decay, weight = np.float32(beta1), np.float32(1.0 - beta1)  # as torch rounds β1 and alpha to fp32
    scale = np.float32(grad_scale)
    arrays = [[t.numpy() for t in flat] for flat in flats]  # type: ignore[union-attr]

    def momentum(k: int, start: int, stop: int) -> None:
        out, exp_avg, grad, denominator = (x[start:stop] for x in arrays[k])
        loop(out, exp_avg, grad, denominator, decay, weight, scale)

    Blocks([out.shape[0] for out, *_ in arrays]).run(momentum)
    return True


def local_momentum_(
    exp_avgs: list[Tensor],
    grads: list[Tensor],
    *,
    beta1: float,
    grad_scale: float = 1.0,
    marginals: list[tuple[Tensor, Tensor] | None] | None = None,
) -> bool:
    """m ← β1·m + (1−β1)·(s·g) per tensor (`functional.local_momentum_`, s = ``grad_scale``) in one numba
    loop each: one fused multiply-add, as ATen's ``add(alpha=)`` on x86, so the bits of the torch ops there
    (two passes over m). ``marginals`` (per tensor, None or a matrix's (row sums, column sums), as
    `marginals.add_square_marginals` takes them): the squares of s·g are summed into them in the same loop,
    block by block from cache (the same sums as that function's), each such matrix whole on one thread.
    Returns False, changing nothing, where the loop cannot be used (marginals included)."""
    loops = _numba_momentum()
    if loops is None or not exp_avgs:
        return False
    flats = [_flat_alike(tensors) for tensors in zip(exp_avgs, grads)]
    if any(f is None for f in flats):
        return False
    oriented = _oriented_marginals(grads, marginals) if marginals is not None else [None] * len(flats)
    if oriented is None:
        return False
    decay, weight, scale = np.float32(beta1), np.float32(1.0 - beta1), np.float32(grad_scale)
    arrays = [[t.numpy() for t in flat] for flat in flats]  # type: ignore[union-attr]

    def momentum(k: int, start: int, stop: int) -> None:
        exp_avg, grad = (x[start:stop] for x in arrays[k])
        loops[1](exp_avg, grad, decay, weight, scale)

    # the matrices with marginals take no blocks here: each is one piece of work below
    Blocks([0 if o is not None else m.shape[0] for (m, _), o in zip(arrays, oriented)]).run(momentum)
    folded = [k for k, o in enumerate(oriented) if o is not None]

    def momentum_marginals(j: int) -> None:
        k = folded[j]
        (exp_avg, grad), (outer, inner) = arrays[k], oriented[k]  # type: ignore[misc]
        scratch = np.empty(inner.numel(), dtype=np.float32)
        loops[2](exp_avg, grad, decay, weight, scale, inner.numel(), outer.numpy(), inner.numpy(), scratch)

    sizes = [arrays[k][0].shape[0] for k in folded]
    run_shared(momentum_marginals, shares(sizes, torch.get_num_threads()), len(folded))
    return True


def momentum_source(
    buffer: Tensor,
    exp_avgs: list[Tensor],
    grads: list[Tensor],
    denominators: list[Tensor],
    *,
    beta1: float,
    grad_scale: float = 1.0,
    marginals: list[tuple[Tensor, Tensor] | None] | None = None,
) -> MomentumSource | None:
    """The local momenta (β1·m + (1−β1)·(s·g))/d of `preconditioned_momentum_`, not formed but handed to
    the compressed allreduce (:class:`~pretrain.comm.plan.MomentumSource`, with the loops of
    :mod:`pretrain.optim.numba_loops`), which forms them inside
    its first pass over ``buffer``. `exp_avgs` are views of ``buffer``, each over one stretch of it in
    memory order. None where the numba loops cannot be used (as `preconditioned_momentum_`), for the
    caller to form them itself. ``marginals`` (per tensor, None or a matrix's (row sums, column sums), as
    `marginals.add_square_marginals` takes them): the squares of s·g are summed into them in that pass."""
    if _numba_momentum() is None or not exp_avgs:
        return None
    flats = [_flat_alike(tensors) for tensors in zip(exp_avgs, grads, denominators)]
    if any(f is None for f in flats):
        return None
    base, storage = buffer.storage_offset(), buffer.untyped_storage().data_ptr()
    offsets: list[int] = []
    for exp_avg, _, _ in flats:  # type: ignore[misc]
        offset, length = int(exp_avg.storage_offset()) - int(base), len(exp_avg)
        if exp_avg.untyped_storage().data_ptr() != storage or not 0 <= offset <= buffer.numel() - length:
            return None
        offsets.append(offset)
    exp_avg_flats, grad_flats, divisor_flats = (list(x) for x in zip(*flats))  # type: ignore[arg-type]
    oriented = None
    if marginals is not None:
        oriented = _oriented_marginals(grads, marginals)
        if oriented is None:
            return None

    def fill(values: Tensor) -> None:  # the same x, formed into `values` (laid out like `buffer`)
        outs = [values[offset : offset + len(m)] for offset, m in zip(offsets, exp_avg_flats)]
        formed = preconditioned_momentum_(
            outs, exp_avg_flats, grad_flats, divisor_flats, beta1=beta1, grad_scale=grad_scale
        )
        if not formed:
            raise AssertionError("the momentum loop turned unusable")
        for grad, sums in zip(grad_flats, oriented or []):
            if sums is not None:
                outer, inner = sums
                matrix = grad.view(outer.numel(), inner.numel())
                add_square_marginals(matrix, outer, inner, Workspace(), grad_scale)

    from pretrain.optim import numba_loops  # imports numba (usable: `_numba_momentum` above)

    return MomentumSource(
        loops=numba_loops,
        offsets=tuple(offsets),
        exp_avgs=exp_avg_flats,
        grads=grad_flats,
        divisors=divisor_flats,
        beta1=beta1,
        grad_scale=grad_scale,
        fill=fill,
        marginals=oriented,  # type: ignore[arg-type]
    )


def _oriented_marginals(
    grads: list[Tensor], marginals: list[tuple[Tensor, Tensor] | None]
) -> list[tuple[Tensor, Tensor] | None] | None:
    """Per tensor, None or its (row sums, column sums) as (outer, inner) of its memory order
    (`_memory_order_sums`); None where any given pair does not fit."""
    oriented = [None if sums is None else _memory_order_sums(g, *sums) for g, sums in zip(grads, marginals)]
    if any(o is None for o, sums in zip(oriented, marginals) if sums is not None):
        return None
    return oriented


def _memory_order_sums(grad: Tensor, row_sums: Tensor, col_sums: Tensor) -> tuple[Tensor, Tensor] | None:
    """A matrix's (row sums, column sums) as (outer, inner) of its memory order: swapped for a column-major
    one. None where they do not fit it or numba's loops cannot add to them (CPU fp32, contiguous)."""
    if grad.dim() != 2 or any(
        s.dtype != torch.float32 or not s.is_contiguous() for s in (row_sums, col_sums)
    ):
        return None
    if (row_sums.numel(), col_sums.numel()) != tuple(grad.shape):
        return None
    return (row_sums, col_sums) if grad.is_contiguous() else (col_sums, row_sums)


def _flat_alike(tensors: tuple[Tensor, ...]) -> list[Tensor] | None:
    """The tensors' 1-D views in memory order (`base.flat_views`) when all are CPU fp32 of one shape and
    one memory order, else None."""
    first = tensors[0]
    if (
        first.device.type != "cpu"
        or kernel_path(first.device) is not KernelPath.cpu
        or any(t.dtype != torch.float32 or t.shape != first.shape for t in tensors)
    ):
        return None
    try:
        return flat_views(*(t.detach() for t in tensors))
    except ValueError:  # different memory orders, or neither row- nor column-major
        return None


def live_trust_ratio_step_(
    params: list[Tensor],
    exp_avgs: list[Tensor],
    denominators: list[Tensor],
    *,
    lr: float,
    eps: float,
    weight_decay: float,
    min_coeff: float,
    max_coeff: float,
    rooted: bool,
    averages: bool = False,
) -> Tensor | None:
    """`functional.clamped_trust_ratio_step_` (same arguments; `denominators` is v, or √v+ε if `rooted`)
    in numba loops (module docstring); returns c per tensor, or None (and changes nothing) where they
    cannot be used, for the caller to take the torch path. `averages` (needs `rooted`): `exp_avgs` hold
    the exchange's ū = m/(√v+ε); m = ū·(√v+ε) is formed here and stored in their place."""
    if averages and not rooted:
        raise ValueError("live_trust_ratio_step_: averages=True needs rooted divisors (√v+ε)")
    loops = _numba_loops()
    if loops is None or not params:
        return None
    flats = [_flat_alike(tensors) for tensors in zip(params, exp_avgs, denominators)]
    if any(f is None for f in flats):
        return None
    square_norms_rooted, square_norms, apply_, square_norms_of_averages, apply_averages_ = loops
    decay, epsilon = np.float32(weight_decay), np.float32(eps)  # fp32 scalars: the loops stay in fp32
    arrays = [[t.numpy() for t in flat] for flat in flats]  # type: ignore[union-attr]
    blocks = Blocks([param.shape[0] for param, _, _ in arrays])

    scalars: tuple[Any, ...]
    if averages:
        kernel, scalars = square_norms_of_averages, (decay,)
    elif rooted:
        kernel, scalars = square_norms_rooted, (decay,)
    else:
        kernel, scalars = square_norms, (decay, epsilon)

    def norms(k: int, start: int, stop: int) -> tuple[float, float]:
        # padding: p = m = 0 and a divisor of 1 give u = 0
        return span_sums(kernel, [x[start:stop] for x in arrays[k]], (0.0, 0.0, 1.0), scalars)

    # the norms rounded to fp32, the ratio in fp32 and clamped (in double), as the torch path
    param_norms, update_norms = np.sqrt(blocks.sums(norms)).astype(np.float32).T
    usable = (param_norms > 0) & (update_norms > 0)
    ratios = param_norms / np.where(usable, update_norms, np.float32(1.0))
    coeffs = np.where(usable, np.clip(ratios.astype(np.float64), min_coeff, max_coeff), 1.0)
    steps = (-lr * coeffs.astype(np.float32).astype(np.float64)).astype(np.float32)

    def step(k: int, start: int, stop: int) -> None:
        param, exp_avg, denominator = (x[start:stop] for x in arrays[k])
        if averages:
            apply_averages_(param, exp_avg, denominator, decay, steps[k])
        else:
            apply_(param, exp_avg, denominator, decay, epsilon, rooted, steps[k])

    blocks.run(step)
    return torch.from_numpy(coeffs.astype(np.float32))
