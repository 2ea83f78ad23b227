"""The optimizer math as pure functions over lists of same-device fp32 tensors (docs/pretraining.md,
docs/onebit-lamb.md).

Every function updates the tensors it is given in place (names ending in `_`) or returns new tensors;
none reads optimizer state, process groups or globals, so each is tested against hand-computed numbers
(`tests/unit/test_optim_*.py`) and can be wrapped in `torch.compile`. Per-tensor scalars (norms, trust
ratios, factors) travel as 1-D tensors of length `len(params)` and are applied through `per_tensor` (lists
of 0-dim tensors, or on the multi-tensor path the values expanded to their tensors' elements), so nothing
here synchronizes with the device.

Notation as in docs/onebit-lamb.md: m = exp_avg, v = exp_avg_sq, v_f = fresh exp_avg_sq, λ = weight decay.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "adam_direction_",
    "adam_frozen_update_",
    "adam_moments_",
    "adam_update_",
    "bias_corrections",
    "clamped_trust_ratio_step_",
    "compressed_lamb_update_",
    "denominators_",
    "factor_rule",
    "freeze_coeff_ema",
    "grad_norms",
    "lamb_kernel_scalars",
    "lamb_tensor_apply_",
    "lamb_tensor_direction_",
    "lamb_update_",
    "live_apply_",
    "live_ratio",
    "live_scalars",
    "local_momentum_",
    "per_tensor",
    "preconditioned_momentum_",
    "scaling_coefficients",
    "trust_ratios",
]


def grad_norms(grads: list[Tensor]) -> Tensor:
    """Per-tensor L2 norms in fp32, shape [len(grads)]; non-finite where a tensor holds Inf/NaN."""
    if not grads:
        return torch.zeros(0)
    return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32))


def bias_corrections(beta1: float, beta2: float, step: int) -> tuple[float, float]:
    """Adam's (1 − β1^t, √(1 − β2^t)) for the 1-based step t, computed on the host: inside a compiled
    kernel a power or root of a scalar argument would be re-evaluated for every vector of elements."""
    return 1.0 - beta1**step, math.sqrt(1.0 - beta2**step)


def per_tensor(values: Tensor, like: list[Tensor], counts: Tensor | None = None) -> list[Tensor]:
    """values[i] for the elements of like[i], as a foreach op takes per-tensor values: 0-dim tensors
    (`counts` None: the reference), or, given `counts` (the numels of `like` as a tensor on values' device:
    the multi-tensor path, `pretrain.optim.kernel_path`), tensors of like[i]'s shape and strides holding
    values[i] in every element, expanded in one op. A foreach op over 0-dim tensors runs tensor by tensor on
    CUDA (they do not match the other lists' shapes); over these it is one multi-tensor launch. The
    elements' arithmetic is the same either way, so are the bits."""
    if counts is None:
        return list(values.unbind())
    flat = torch.repeat_interleave(values, counts, output_size=sum(t.numel() for t in like))
    views, offset = [], 0
    for t in like:
        views.append(flat.as_strided(t.shape, t.stride(), offset))
        offset += t.numel()
    return views


def adam_moments_(
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    grads: list[Tensor],
    *,
    beta1: float,
    beta2: float,
    grad_scale: float = 1.0,
) -> None:
    """m ← β1·m + (1−β1)·s·g and v ← β2·v + (1−β2)·(s·g)², s = grad_scale (the clip factor)."""
    torch._foreach_mul_(exp_avgs, beta1)
    torch._foreach_add_(exp_avgs, grads, alpha=(1.0 - beta1) * grad_scale)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=(1.0 - beta2) * grad_scale * grad_scale)


def trust_ratios(param_norms: Tensor, update_norms: Tensor) -> Tensor:
    """‖p‖/‖u‖ per tensor, 1 where either norm is 0 (a fresh zero-initialized bias, a zero update)."""
    usable = (param_norms > 0) & (update_norms > 0)
    return torch.where(usable, param_norms / torch.where(usable, update_norms, 1.0), 1.0)


def _scratch(workspace: list[Tensor] | None, like: list[Tensor]) -> list[Tensor]:
    """Scratch tensors shaped like `like`: the caller's (reused across steps) or freshly allocated."""
    return workspace if workspace is not None else [torch.empty_like(t, dtype=torch.float32) for t in like]


def denominators_(out: list[Tensor], exp_avg_sqs: list[Tensor], eps: float) -> None:
    """out ← √v + ε, in place in `out` (Adam's denominator; 1-bit LAMB's exchange divisors)."""
    torch._foreach_copy_(out, exp_avg_sqs)
    torch._foreach_sqrt_(out)
    torch._foreach_add_(out, eps)


def adam_direction_(
    out: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor], eps: float, *, rooted: bool = False
) -> None:
    """out ← m / (√v + ε), built in place in `out` (no allocation). `rooted`: `exp_avg_sqs` holds √v + ε
    already (1-bit LAMB's preconditioner divisors; elementwise sqrt and add round alike: the same bits)."""
    if rooted:
        torch._foreach_copy_(out, exp_avg_sqs)
    else:
        denominators_(out, exp_avg_sqs, eps)
    torch._foreach_reciprocal_(out)
    torch._foreach_mul_(out, exp_avgs)


def _decayed_direction(
    params: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    *,
    eps: float,
    weight_decay: float,
    workspace: list[Tensor] | None,
    rooted: bool = False,
) -> list[Tensor]:
    """u = m/(√v+ε) + λp in scratch (`workspace`, else new tensors), as `adam_direction_` forms m/(√v+ε)."""
    updates = _scratch(workspace, params)
    adam_direction_(updates, exp_avgs, exp_avg_sqs, eps, rooted=rooted)
    if weight_decay != 0.0:
        torch._foreach_add_(updates, params, alpha=weight_decay)
    return updates


def lamb_update_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
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
    workspace: list[Tensor] | None = None,
    counts: Tensor | None = None,
) -> Tensor | None:
    """One LAMB step on one parameter group, in place (docs/pretraining.md, "Optimizers"): moments as
    `adam_moments_`, u = m/(√v+ε) + λp (decoupled decay, ε outside the root), p ← p − η·c·u. Bias
    corrections from `bias_corrections()`; `grad_scale` is the global pre-normalization 1/max(1,
    G/max_grad_norm), computed by the caller over ALL groups. `workspace`: optional scratch tensors shaped
    like `params`, overwritten. `counts`: the multi-tensor path's (`per_tensor`). Returns the trust ratios
    applied, shape [len(params)].

    `nvlamb` (apex/NVIDIA LAMB): m̂, v̂ bias-corrected in u; c = ‖p‖/‖u‖ when λ ≠ 0 (1 where a norm is 0),
    no trust ratio at all when λ = 0 (returns None). With s = √bc2/bc1, m̂/(√v̂+ε) = s·m/(√v+ε√bc2); u is
    built as u/s, which the trust ratio cancels, and s is folded into the final step size: two fewer passes
    over memory.

    Else DeepSpeed-FusedLamb (also DeepSpeed's 1-bit LAMB warmup): uncorrected moments; c = clamp(‖p‖/‖u‖,
    min_coeff, max_coeff) on EVERY tensor (c = 1, unclamped, where a norm is 0); p ← p − η·b·c·u with
    b = √bc2/bc1 (1 without bias correction, the defaults); `clamped_trust_ratio_step_`.
    """
    adam_moments_(exp_avgs, exp_avg_sqs, grads, beta1=beta1, beta2=beta2, grad_scale=grad_scale)
    scale = bias_correction2_sqrt / bias_correction1
    if not nvlamb:
        return clamped_trust_ratio_step_(
            params,
            exp_avgs,
            exp_avg_sqs,
            lr=lr * bias_correction2_sqrt / bias_correction1,
            eps=eps,
            weight_decay=weight_decay,
            min_coeff=min_coeff,
            max_coeff=max_coeff,
            workspace=workspace,
            counts=counts,
        )
    updates = _scratch(workspace, params)
    adam_direction_(updates, exp_avgs, exp_avg_sqs, eps * bias_correction2_sqrt)  # u/s
    if weight_decay == 0.0:
        torch._foreach_add_(params, updates, alpha=-lr * scale)
        return None
    torch._foreach_add_(updates, params, alpha=weight_decay / scale)
    param_norms, update_norms = grad_norms(params), grad_norms(updates)
    usable = (param_norms > 0) & (update_norms > 0)
    # `updates` holds u/s: the trust ratio cancels s, the fallback ratio 1 does not.
    coeffs = torch.where(usable, trust_ratios(param_norms, update_norms), scale)
    torch._foreach_addcmul_(params, updates, per_tensor(coeffs, params, counts), value=-lr)
    return coeffs / scale


def clamped_trust_ratio_step_(
    params: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    *,
    lr: float,
    eps: float,
    weight_decay: float,
    min_coeff: float,
    max_coeff: float,
    workspace: list[Tensor] | None = None,
    rooted: bool = False,
    counts: Tensor | None = None,
) -> Tensor:
    """p ← p − η·c·u with u = m/(√v+ε) + λp and c = clamp(‖p‖/‖u‖, min_coeff, max_coeff) on every tensor
    (1 where a norm is 0): DeepSpeed LAMB's step for given moments (docs/pretraining.md). Also 1-bit
    LAMB's compression step with `trust_ratio=live` (m the compressed momentum, v frozen; `rooted`: the
    third list is √v+ε, as `adam_direction_`). Returns c."""
    updates = _decayed_direction(
        params, exp_avgs, exp_avg_sqs, eps=eps, weight_decay=weight_decay, workspace=workspace, rooted=rooted
    )
    param_norms, update_norms = grad_norms(params), grad_norms(updates)
    usable = (param_norms > 0) & (update_norms > 0)
    coeffs = torch.where(usable, trust_ratios(param_norms, update_norms).clamp(min_coeff, max_coeff), 1.0)
    torch._foreach_addcmul_(params, updates, per_tensor(coeffs, params, counts), value=-lr)
    return coeffs


def lamb_tensor_direction_(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    scalars: Tensor,
    *,
    clamp_ratio: bool,
) -> Tensor:
    """First half of one tensor's LAMB step, written for `torch.compile` (one fused loop).

    Moments as `adam_moments_`, then the norms of p and of the direction u = a·m/(√v + e) + λp, and from
    them the trust ratio r = ‖p‖/‖u‖ (1 where a norm is 0), clamped to [min, max] if `clamp_ratio`
    (deepspeed), else applied only where λ ≠ 0 (nvlamb). Returns [r, η·b·r], the second the factor
    `lamb_tensor_apply_` steps by. u is not stored: `lamb_tensor_apply_` forms it again from m and v. A
    stored u cost a write stream (with write-allocate, a read and a write of a parameter-sized buffer) and
    a read stream; forming it twice costs a read of m and v instead, and compute that hides under the
    memory traffic (`bench optim`'s `lamb_kernel_*` records: issue #15). Everything that changes between
    steps, and the betas, arrive in the 1-D tensor `scalars` (`lamb_kernel_scalars`): one compiled graph
    serves every step, no scalar power or root is re-evaluated inside the generated element loop, and a
    call wraps no Python float (each float argument costs a tensor conversion per call).
    """
    grad_scale = scalars[1]
    beta1, one_minus_beta1, beta2, one_minus_beta2 = scalars[8], scalars[9], scalars[10], scalars[11]
    scaled_grad = grad * grad_scale
    exp_avg.mul_(beta1).add_(scaled_grad * one_minus_beta1)
    exp_avg_sq.mul_(beta2).add_(scaled_grad * scaled_grad * one_minus_beta2)
    update = _lamb_direction(param, exp_avg, exp_avg_sq, scalars)
    lr, weight_decay, step_scale = scalars[0], scalars[4], scalars[5]
    ratio = _trust_ratio(
        torch.linalg.vector_norm(param),
        torch.linalg.vector_norm(update),
        (scalars[6], scalars[7]) if clamp_ratio else None,
    )
    if not clamp_ratio:
        ratio = torch.where(weight_decay != 0, ratio, 1.0)
    return torch.stack([ratio, lr * step_scale * ratio])


def _trust_ratio(param_norm: Tensor, update_norm: Tensor, clamp: tuple[Tensor, Tensor] | None) -> Tensor:
    """‖p‖/‖u‖, 1 where a norm is 0; clamped to `clamp` = (min, max) where usable, if given."""
    usable = (param_norm > 0) & (update_norm > 0)
    ratio = torch.where(usable, param_norm / torch.where(usable, update_norm, 1.0), 1.0)
    if clamp is not None:
        ratio = torch.where(usable, ratio.clamp(*clamp), 1.0)
    return ratio


def _lamb_direction(param: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, scalars: Tensor) -> Tensor:
    """u = a·m/(√v + e) + λp, the one expression both compiled LAMB kernels evaluate."""
    direction_scale, eps, weight_decay = scalars[2], scalars[3], scalars[4]
    return direction_scale * exp_avg / (exp_avg_sq.sqrt() + eps) + weight_decay * param


def lamb_tensor_apply_(
    param: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, coeffs: Tensor, scalars: Tensor
) -> None:
    """Second half: p ← p − η·b·r·u, u formed again from the updated moments, η·b·r = coeffs[1] from
    `lamb_tensor_direction_`. Only the element loop: with the ratio's scalar arithmetic in the same graph,
    Inductor's CPU code ran the loop on one thread (0.94 of fused AdamW's time on a 64M-element tensor at 2
    threads, 0.62 without it: issue #15)."""
    param.sub_(_lamb_direction(param, exp_avg, exp_avg_sq, scalars) * coeffs[1])


def lamb_kernel_scalars(
    *,
    clamp_ratio: bool,
    lr: float,
    eps: float,
    weight_decay: float,
    bias_correction1: float,
    bias_correction2_sqrt: float,
    grad_scale: float,
    beta1: float,
    beta2: float,
    min_coeff: float = 0.0,
    max_coeff: float = 0.0,
    device: torch.device | str = "cpu",
) -> Tensor:
    """`scalars` of `lamb_tensor_direction_`/`lamb_tensor_apply_`. nvlamb (clamp_ratio False) puts the bias
    correction in the direction (a = √bc2/bc1, e = ε·√bc2, b = 1), deepspeed on the step (a = 1, e = ε,
    b = √bc2/bc1): the same numbers as `lamb_update_`. The betas' complements
    are taken here in double precision, as the eager foreach calls take them."""
    correction = bias_correction2_sqrt / bias_correction1
    direction_scale, scaled_eps, step_scale = (
        (1.0, eps, correction) if clamp_ratio else (correction, eps * bias_correction2_sqrt, 1.0)
    )
    values = [lr, grad_scale, direction_scale, scaled_eps, weight_decay, step_scale, min_coeff, max_coeff]
    values += [beta1, 1.0 - beta1, beta2, 1.0 - beta2]
    return torch.tensor(values, dtype=torch.float32, device=device)


def live_scalars(
    *, beta1: float, lr: float, weight_decay: float, min_coeff: float, max_coeff: float, device: torch.device
) -> Tensor:
    """`scalars` of the compiled compression step's kernels (`preconditioned_momentum_`, `live_ratio`,
    `live_apply_`): [β1, η, λ, min_coeff, max_coeff]. A tensor, so one graph serves every learning rate."""
    return torch.tensor([beta1, lr, weight_decay, min_coeff, max_coeff], dtype=torch.float32, device=device)


def preconditioned_momentum_(
    exp_avg: Tensor, grad: Tensor, divisor: Tensor, out: Tensor, scalars: Tensor
) -> None:
    """out ← (β1·m + (1−β1)·g)/d, the value a worker sends in the preconditioned exchange (one pass,
    written for `torch.compile`; all four alike in shape). `out` is the tensor's place in the exchange
    layout, or m itself for a matrix that goes out transposed (`pretrain.optim.compiled`): m is not needed
    after this, the exchange replaces it (`live_apply_`)."""
    beta1 = scalars[0]
    out.copy_((exp_avg * beta1 + grad * (1.0 - beta1)) / divisor)


def live_ratio(
    exp_avg: Tensor, divisor: Tensor, param: Tensor, scalars: Tensor, source: Tensor | None = None
) -> Tensor:
    """LAMB's ratio c = clamp(‖p‖/‖u‖, min_coeff, max_coeff), 1 where a norm is 0, for the step direction
    u = m/d + λp, d = √v+ε, where m = ū·d is the new momentum from the exchanged average ū (`source`, or m
    itself when the caller already copied ū into it). Returns [c, η·c]. Reads only (written for
    `torch.compile`): `live_apply_` stores m and steps p. Written here as well, m took Inductor a second
    loop over ū and d after the norms' reduction loop (CPU: 3.0 copies' time against 1.5 for the apply;
    issue #15), so the store moved to the apply's loop, which reads ū and d anyway."""
    _, lr, weight_decay, min_coeff, max_coeff = scalars.unbind()
    momentum = (exp_avg if source is None else source) * divisor
    update = momentum / divisor + weight_decay * param
    ratio = _trust_ratio(
        torch.linalg.vector_norm(param), torch.linalg.vector_norm(update), (min_coeff, max_coeff)
    )
    return torch.stack([ratio, lr * ratio])


def live_apply_(
    param: Tensor,
    exp_avg: Tensor,
    divisor: Tensor,
    coeffs: Tensor,
    scalars: Tensor,
    source: Tensor | None = None,
) -> None:
    """m ← ū·d (ū: `source`, or m itself) and p ← p − η·c·(m/d + λp), η·c = coeffs[1] from `live_ratio`,
    in one loop: `clamped_trust_ratio_step_` for one tensor, for `torch.compile` (the element loop alone,
    as `lamb_tensor_apply_`)."""
    weight_decay = scalars[2]
    momentum = (exp_avg if source is None else source) * divisor
    exp_avg.copy_(momentum)
    param.sub_((momentum / divisor + weight_decay * param) * coeffs[1])


def freeze_coeff_ema(coeff_freeze: Tensor, coeffs: Tensor, coeff_beta: float) -> Tensor:
    """c̄ ← β·c̄ + (1−β)·c where c ≠ 1 (an unusable ratio does not count), no bias correction
    (docs/onebit-lamb.md)."""
    return torch.where(coeffs != 1.0, coeff_beta * coeff_freeze + (1.0 - coeff_beta) * coeffs, coeff_freeze)


def scaling_coefficients(exp_avgs: list[Tensor]) -> Tensor:
    """κ per tensor (docs/onebit-lamb.md): ρ = ‖m‖/√numel, κ = mean(ρ)/ρ, so every tensor enters the one-scale
    compressor at the same RMS.

    Guard (not in DeepSpeed): a tensor whose momentum RMS is 0 or non-finite gets κ = 1 and is left
    out of the mean; if no tensor qualifies every κ is 1. Shape [len(exp_avgs)], fp32.
    """
    numels = torch.tensor([float(m.numel()) for m in exp_avgs])
    rms = grad_norms(exp_avgs) / numels.to(exp_avgs[0].device).sqrt()
    usable = torch.isfinite(rms) & (rms > 0)
    count = usable.sum()
    mean_rms = torch.where(usable, rms, 0.0).sum() / count.clamp(min=1)
    return torch.where(usable, mean_rms / torch.where(usable, rms, 1.0), 1.0)


def local_momentum_(exp_avgs: list[Tensor], grads: list[Tensor], *, beta1: float) -> None:
    """m ← β1·m + (1−β1)·g with this rank's own (not averaged) gradient (docs/onebit-lamb.md)."""
    torch._foreach_mul_(exp_avgs, beta1)
    torch._foreach_add_(exp_avgs, grads, alpha=1.0 - beta1)


def factor_rule(
    raw_factors: Tensor,
    last_factors: Tensor,
    *,
    factor_min: float,
    factor_max: float,
    factor_threshold: float,
) -> Tensor:
    """f ← clamp(f, min, max), then within ±threshold (relative) of the previous factor
    (docs/onebit-lamb.md)."""
    bounded = raw_factors.clamp(factor_min, factor_max)
    low, high = last_factors * (1.0 - factor_threshold), last_factors * (1.0 + factor_threshold)
    return torch.minimum(torch.maximum(bounded, low), high)


def compressed_lamb_update_(
    params: list[Tensor],
    exp_avgs: list[Tensor],
    prev_exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    fresh_exp_avg_sqs: list[Tensor],
    coeff_freeze: Tensor,
    last_factors: Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    factor_min: float,
    factor_max: float,
    factor_threshold: float,
    workspace: list[Tensor] | None = None,
    counts: Tensor | None = None,
) -> Tensor:
    """1-bit LAMB compression-stage update of one group after the momentum exchange, in place
    (docs/onebit-lamb.md).

    `exp_avgs` is the synchronized momentum of this step, `prev_exp_avgs` that of the previous step (it is
    overwritten with scratch values), `exp_avg_sqs` the frozen v. Updates v_f from the reconstructed
    gradient ĝ = (m − β1·m_prev)/(1−β1), then p ← p − η·c̄·f·(m/(√v+ε) + λp), f the clamped, rate-limited
    ratio max(√v+ε)/(√v_f+ε) (blended towards 1 by ‖u₀‖/‖u‖ when λ > 0). Returns f, shape [len(params)].
    """
    # f. v_f ← β2·v_f + (1−β2)·ĝ². prev becomes β1·m_prev − m = −(1−β1)·ĝ; the 1/(1−β1)² is folded in.
    torch._foreach_mul_(prev_exp_avgs, beta1)
    torch._foreach_sub_(prev_exp_avgs, exp_avgs)
    torch._foreach_mul_(fresh_exp_avg_sqs, beta2)
    torch._foreach_addcmul_(
        fresh_exp_avg_sqs, prev_exp_avgs, prev_exp_avgs, value=(1.0 - beta2) / (1.0 - beta1) ** 2
    )
    # g, h. denom = √v + ε (v frozen, in `prev`); raw f = max(denom / (√v_f + ε)) (in `ratios`).
    denoms, ratios = prev_exp_avgs, _scratch(workspace, params)
    denominators_(denoms, exp_avg_sqs, eps)
    denominators_(ratios, fresh_exp_avg_sqs, eps)
    torch._foreach_reciprocal_(ratios)
    torch._foreach_mul_(ratios, denoms)
    raw = torch.stack(torch._foreach_max(ratios))
    # u0 = m / denom, in the ratio buffer.
    updates = ratios
    torch._foreach_copy_(updates, exp_avgs)
    torch._foreach_div_(updates, denoms)
    if weight_decay != 0.0:
        # i. blend towards 1 by q = min(1, ‖u0‖/‖u‖): the share of the step the variance acts on.
        base_norms = grad_norms(updates)
        torch._foreach_add_(updates, params, alpha=weight_decay)
        full_norms = grad_norms(updates)
        usable = full_norms > 0
        q = torch.where(usable, base_norms / torch.where(usable, full_norms, 1.0), 1.0).clamp(max=1.0)
        raw = q * raw + (1.0 - q)
    factors = factor_rule(
        raw, last_factors, factor_min=factor_min, factor_max=factor_max, factor_threshold=factor_threshold
    )
    torch._foreach_addcmul_(params, updates, per_tensor(coeff_freeze * factors, params, counts), value=-lr)
    return factors


def adam_update_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    workspace: list[Tensor] | None = None,
) -> None:
    """1-bit Adam warmup step: moments without bias correction, then `adam_frozen_update_`."""
    adam_moments_(exp_avgs, exp_avg_sqs, grads, beta1=beta1, beta2=beta2)
    adam_frozen_update_(
        params, exp_avgs, exp_avg_sqs, lr=lr, eps=eps, weight_decay=weight_decay, workspace=workspace
    )


def adam_frozen_update_(
    params: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    *,
    lr: float,
    eps: float,
    weight_decay: float,
    workspace: list[Tensor] | None = None,
) -> None:
    """p ← p − η·(m/(√v+ε) + λp) with the given (in the compression stage: frozen) v."""
    updates = _decayed_direction(
        params, exp_avgs, exp_avg_sqs, eps=eps, weight_decay=weight_decay, workspace=workspace
    )
    torch._foreach_add_(params, updates, alpha=-lr)
