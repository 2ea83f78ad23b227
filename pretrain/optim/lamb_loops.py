"""LAMB's step fused for CPU in numba: two loops over memory per tensor, on every thread torch uses.

The eager foreach step (`functional.lamb_update_`) makes about a dozen passes over each chunk of tensors
(the moments' four, the direction's five into a workspace, the two norms, the step) and
`Lamb(compile=True)` two Inductor kernels per tensor at ~50-130 µs of fixed cost per call; on the 2-core bench
machine they took 4.8× and 2.2× the time of `torch.optim.AdamW(fused=True)` on BERT-Large's
tensors (`bench optim`, issue #15). Here, per tensor,

1. `direction`: m ← β1·m + (1−β1)·s·g, v ← β2·v + (1−β2)·(s·g)², and the sums Σp², Σu² (float64) of the
   direction u = a·m/(√v + e) + λp: reads p, g, m, v, writes m, v (the bytes fused AdamW moves, less one
   write);
2. from the norms the trust ratio c in fp32 (`functional.trust_ratios`: 1 where a norm is 0; clamped for
   DeepSpeed's variant; 1 for nvlamb's groups without weight decay), then `apply`: p ← p − η·b·c·u, u
   formed again from m and v: reads p, m, v, writes p. Nothing parameter-sized is stored but p, m and v.

a, e and b are `functional.lamb_kernel_scalars`' (nvlamb: bias correction in the direction; deepspeed: on
the step), so the math is the compiled kernels'; results agree with the foreach path to float rounding,
not bitwise (sums in another order, m/(√v+e) divided rather than multiplied by a reciprocal).

Both loops run over the blocks of `pretrain.optim.blocks` on torch's threads (the loops release the GIL);
each block's sums are kept apart and added per tensor in block order, so the bits do not depend on the
number of threads: a run resumed with another thread count repeats the uninterrupted one. 1-bit LAMB's
warmup takes this same step (`OnebitLamb._eager_warmup_group`), so it stays LAMB's bit for bit.

Used for CPU fp32 tensors of one memory order per tensor (`base.flat_views`) where numba imports
(:mod:`pretrain.comm.numba_support`); elsewhere the callers take the foreach path.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pretrain.comm.numba_support import numba_unavailable_reason
from pretrain.optim import functional as F
from pretrain.optim.base import flat_views
from pretrain.optim.blocks import Blocks
from pretrain.optim.kernel_path import KernelPath, kernel_path

# Elements per fp32 partial sum of the norms (a divisor of `blocks.BLOCK`), the partial sums added in
# float64: as accurate as float64 terms for the trust ratio, and the first loop took 0.91x fused AdamW's
# time on one thread against 1.32x with every term converted to float64 (the conversion was the bound).
SPAN = 1024


def span_sums(
    kernel: Any,
    arrays: list[np.ndarray],
    fills: tuple[float, ...],
    scalars: tuple[Any, ...],
    written: tuple[int, ...] = (),
) -> tuple[float, float]:
    """`kernel(*arrays, *scalars)` (a numba loop over whole spans of SPAN elements, returning two float64
    sums) over any length: the whole spans in place, the rest (fewer than SPAN elements) through copies
    padded to a span with `fills` (one per array: values whose terms are 0), the arrays at `written` copied
    back. Keeps one loop body per kernel, of constant length (vectorised)."""
    numel = arrays[0].shape[0]
    whole = numel - numel % SPAN
    first, second = kernel(*(x[:whole] for x in arrays), *scalars) if whole else (0.0, 0.0)
    if whole < numel:
        pads = [np.full(SPAN, fill, dtype=np.float32) for fill in fills]
        for pad, x in zip(pads, arrays):
            pad[: numel - whole] = x[whole:]
        rest = kernel(*pads, *scalars)
        for index in written:
            arrays[index][whole:] = pads[index][: numel - whole]
        first, second = first + rest[0], second + rest[1]
    return first, second


@functools.cache
def _loops() -> Any:
    """(direction, apply) compiled on first use; None where numba cannot be used."""
    if numba_unavailable_reason() is not None:
        return None
    import numba

    # error_model="numpy": x/0 is inf as in torch, with no per-element check to keep LLVM from vectorising
    jit = functools.partial(numba.njit, cache=True, boundscheck=False, nogil=True, error_model="numpy")

    @jit(fastmath={"reassoc"})  # the sums only: vectorised, in an order fixed by the compiled code
    def direction(param, grad, exp_avg, exp_avg_sq, scale, beta1, weight1, beta2, weight2, a, e, decay):
        # whole spans only (`span_sums` passes the rest padded): the terms summed in fp32 per span of SPAN
        # elements, the spans' sums added in float64
        param_sum, update_sum = 0.0, 0.0
        for span in range(param.shape[0] // SPAN):  # `range(0, n, SPAN)` kept LLVM from vectorising
            param_part, update_part = np.float32(0.0), np.float32(0.0)
            for j in range(SPAN):  # constant length: a variable one vectorised 4x slower
                i = span * SPAN + j
                g = grad[i] * scale
                m = exp_avg[i] * beta1 + g * weight1
                v = exp_avg_sq[i] * beta2 + g * g * weight2
                exp_avg[i] = m
                exp_avg_sq[i] = v
                p = param[i]
                u = a * m / (np.sqrt(v) + e) + decay * p
                param_part += p * p
                update_part += u * u
            param_sum += np.float64(param_part)
            update_sum += np.float64(update_part)
        return param_sum, update_sum

    @jit
    def apply(param, exp_avg, exp_avg_sq, a, e, decay, step):
        for i in range(param.shape[0]):
            p = param[i]
            param[i] = p + step * (a * exp_avg[i] / (np.sqrt(exp_avg_sq[i]) + e) + decay * p)

    return direction, apply


def usable(*tensor_lists: list[Tensor]) -> bool:
    """Whether `lamb_step_` can take these (params, grads, exp_avgs, exp_avg_sqs): numba imports, and the
    tensors are CPU fp32, each with its gradient and moments of its shape and memory order."""
    if _loops() is None or not tensor_lists[0]:
        return False
    if kernel_path(tensor_lists[0][0].device) is not KernelPath.cpu:
        return False
    for tensors in zip(*tensor_lists):
        first = tensors[0]
        if first.device.type != "cpu" or any(
            t.dtype != torch.float32 or t.device.type != "cpu" or t.shape != first.shape for t in tensors
        ):
            return False
        try:
            flat_views(*tensors)
        except ValueError:
            return False
    return True


def lamb_step_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    /,
    *,
    nvlamb: bool,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction1: float = 1.0,
    bias_correction2_sqrt: float = 1.0,
    grad_scale: float = 1.0,
    min_coeff: float = 0.0,
    max_coeff: float = 0.0,
) -> Tensor | None:
    """One group's LAMB step in place, as `functional.lamb_update_` (the same arguments) and with the same
    result: the trust ratios applied, shape [len(params)], or None for an nvlamb group without weight decay.
    The caller checks `usable`."""
    direction, apply = _loops()
    scalars = F.lamb_kernel_scalars(
        clamp_ratio=not nvlamb, lr=lr, eps=eps, weight_decay=weight_decay, bias_correction1=bias_correction1,
        bias_correction2_sqrt=bias_correction2_sqrt, grad_scale=grad_scale, beta1=beta1, beta2=beta2,
        min_coeff=min_coeff, max_coeff=max_coeff,
    ).numpy()  # fmt: skip
    lr32, scale, a, e, decay, step_scale = scalars[:6]
    moments = (scalars[8], scalars[9], scalars[10], scalars[11])
    arrays = [
        [t.numpy() for t in flat_views(*(t.detach() for t in tensors))]
        for tensors in zip(params, grads, exp_avgs, exp_avg_sqs)
    ]
    blocks = Blocks([p.shape[0] for p, *_ in arrays])

    def moments_and_norms(k: int, start: int, stop: int) -> tuple[float, float]:
        block = [x[start:stop] for x in arrays[k]]  # padding: p = g = m = v = 0 gives u = 0
        return span_sums(direction, block, (0.0,) * 4, (scale, *moments, a, e, decay), written=(2, 3))

    totals = blocks.sums(moments_and_norms)
    # the norms rounded to fp32 and the ratio in fp32, as `functional.trust_ratios`
    ratios = F.trust_ratios(*torch.from_numpy(np.sqrt(totals).astype(np.float32)).unbind(1))
    if not nvlamb:
        usable_norms = torch.from_numpy((totals > 0).all(1))
        ratios = torch.where(usable_norms, ratios.clamp(min_coeff, max_coeff), 1.0)
    elif weight_decay == 0.0:
        ratios = torch.ones(len(arrays))
    steps = (-(lr32 * step_scale) * ratios.numpy().astype(np.float32)).astype(np.float32)

    def parameters(k: int, start: int, stop: int) -> None:
        p, _, m, v = (x[start:stop] for x in arrays[k])
        apply(p, m, v, a, e, decay, steps[k])

    blocks.run(parameters)
    return None if nvlamb and weight_decay == 0.0 else ratios
