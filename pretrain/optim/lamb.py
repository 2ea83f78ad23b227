"""LAMB (arXiv 1904.00962) in two explicit variants (docs/pretraining.md, "Optimizers"):

- `nvlamb` (default): apex FusedLAMB / NVIDIA BERT semantics. Global gradient-norm
  pre-normalization by `max_grad_norm` (default 1.0), bias-corrected m̂/v̂, ε = 1e-6 outside the root,
  decoupled weight decay, trust ratio ‖p‖/‖u‖ only on tensors whose group has weight decay ≠ 0.
- `deepspeed`: DeepSpeed FusedLamb. Trust ratio on every tensor, clamped to [min_coeff,
  max_coeff]; bias correction optional and applied to the step after the ratio; ε = 1e-8; no
  pre-normalization unless `max_grad_norm` is set. With `bias_correction=False` this is exactly the
  warmup stage of `OnebitLamb`.

Gradients must already be averaged over data-parallel ranks (`needs_gradient_allreduce` is always True)
and, with gradient accumulation, be the MEAN over micro-batches (divide the loss by their number).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from pretrain.optim import functional as F
from pretrain.optim import lamb_loops
from pretrain.optim.base import (
    OptimizerBase,
    Workspace,
    chunked,
    evaluate_closure,
    global_grad_norm,
    is_finite,
)
from pretrain.optim.compiled import CompiledWarmupStep, pick, split_by_size


class LambVariant(str, enum.Enum):
    nvlamb = "nvlamb"
    deepspeed = "deepspeed"


def eager_lamb_update(
    workspace: Workspace,
    tensor_lists: list[list[Tensor]],
    variant: LambVariant,
    min_coeff: float,
    max_coeff: float,
    **hyper: Any,
) -> Tensor | None:
    """One group's eager LAMB step over (params, grads, exp_avgs, exp_avg_sqs), in place: on CPU the numba
    loops (`lamb_loops`), else the foreach functions, chunk by chunk on the CPU, a group at a time in
    multi-tensor ops elsewhere (`kernel_path`), temporaries in `workspace`. The clamp [min_coeff,
    max_coeff] is the deepspeed variant's. Returns the trust ratios (None: an nvlamb group without weight
    decay, which has none). `Lamb`'s step and 1-bit LAMB's warmup."""
    nvlamb = variant is LambVariant.nvlamb
    clamp: dict[str, Any] = {} if nvlamb else dict(min_coeff=min_coeff, max_coeff=max_coeff)
    if lamb_loops.usable(*tensor_lists):
        return lamb_loops.lamb_step_(*tensor_lists, nvlamb=nvlamb, **clamp, **hyper)
    return chunked(workspace, F.lamb_update_, tensor_lists, expand=True, nvlamb=nvlamb, **clamp, **hyper)


DEFAULT_EPS = {LambVariant.nvlamb: 1e-6, LambVariant.deepspeed: 1e-8}
DEFAULT_MAX_GRAD_NORM = {LambVariant.nvlamb: 1.0, LambVariant.deepspeed: 0.0}


class Lamb(OptimizerBase):
    """LAMB over fp32 math (fp32 masters for bf16/fp16 parameters).

    Args:
        params: parameters or param groups (groups may override lr, betas, eps, weight_decay).
        lr, betas, weight_decay: as in Adam(W); weight decay is decoupled (added to the update).
        eps: None = the variant's default (nvlamb 1e-6, deepspeed 1e-8).
        variant: "nvlamb" or "deepspeed" (module docstring).
        bias_correction: nvlamb: in m̂/v̂; deepspeed: factor √(1−β2^t)/(1−β1^t) on the step.
        max_grad_norm: gradients are divided by max(1, G/max_grad_norm), G the global norm over all
            groups; 0 disables; None = the variant's default (nvlamb 1.0, deepspeed 0).
        min_coeff, max_coeff: trust-ratio clamp of the deepspeed variant (ignored by nvlamb).
        compile: run the update as two `torch.compile`d kernels per tensor (`F.lamb_tensor_direction_`,
            `F.lamb_tensor_apply_`; the first steps compile, about 10–30 s on CPU) instead of the eager
            foreach functions, for tensors of at least `compiled.COMPILED_MIN_NUMEL` elements (the smaller
            ones, whose update costs less than one compiled call, stay on the foreach path). Same math;
            results agree to float rounding, not bitwise.

    The step counter is per group (`group["step"]`, apex semantics); a parameter without a gradient is
    left untouched. A step whose gradients hold Inf/NaN is skipped (`last_step_skipped`). After
    `mark_gradients_checked(norm)` (the trainer's check, `OptimizerBase`) the step takes that norm for the
    pre-normalization instead of a pass of its own over the gradients.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float | None = None,
        weight_decay: float = 0.01,
        *,
        variant: LambVariant | str = LambVariant.nvlamb,
        bias_correction: bool = True,
        max_grad_norm: float | None = None,
        min_coeff: float = 0.01,
        max_coeff: float = 10.0,
        compile: bool = False,
    ) -> None:
        self.variant = LambVariant(variant)
        eps = DEFAULT_EPS[self.variant] if eps is None else eps
        self.max_grad_norm = DEFAULT_MAX_GRAD_NORM[self.variant] if max_grad_norm is None else max_grad_norm
        if lr < 0 or eps <= 0 or weight_decay < 0 or self.max_grad_norm < 0:
            raise ValueError(f"invalid Lamb hyperparameters lr={lr} eps={eps} weight_decay={weight_decay}")
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(f"Lamb needs 0 <= min_coeff <= max_coeff, got {min_coeff}, {max_coeff}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, step=0)
        super().__init__(params, defaults)
        self.bias_correction = bias_correction
        self.min_coeff, self.max_coeff = min_coeff, max_coeff
        self.compile = compile
        self._trust_ratios: dict[int, Tensor | None] = {}  # last step's, per param group
        if compile:
            self._compiled_step = CompiledWarmupStep()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One LAMB step on averaged (and micro-batch-mean) gradients; skipped if any is Inf/NaN."""
        loss = evaluate_closure(closure)
        groups = [[p for p in group["params"] if p.grad is not None] for group in self.param_groups]
        grads = [[self._fp32_grad(p) for p in params] for params in groups]
        checked, total_norm = self.take_caller_check()
        if total_norm is None and (not checked or self.max_grad_norm > 0):
            total_norm = global_grad_norm([g for gs in grads for g in gs])
        if self._record_skip(not checked and not is_finite(total_norm)):  # type: ignore[arg-type]
            return loss
        grad_scale = 1.0 if total_norm is None else self._grad_scale(total_norm)
        self._trust_ratios = {}
        for index, (group, params, group_grads) in enumerate(zip(self.param_groups, groups, grads)):
            if params:
                self._trust_ratios[index] = self._update_group(group, params, group_grads, grad_scale)
        self._copy_masters_back([p for params in groups for p in params])
        return loss

    def statistics(self) -> dict[str, float]:
        """Trust ratios of the last step per param group (group 0: decayed weights, 1: biases and
        LayerNorm, which get none under nvlamb): mean, min, max. Host sync: log steps only."""
        statistics = super().statistics()
        for index, ratios in self._trust_ratios.items():
            if ratios is not None and ratios.numel():
                statistics[f"trust_ratio_mean_group{index}"] = float(ratios.mean())
                statistics[f"trust_ratio_min_group{index}"] = float(ratios.min())
                statistics[f"trust_ratio_max_group{index}"] = float(ratios.max())
        return statistics

    def _grad_scale(self, total_norm: Tensor) -> float:
        if self.max_grad_norm <= 0:
            return 1.0
        return 1.0 / max(1.0, float(total_norm) / self.max_grad_norm)

    def _update_group(
        self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor], grad_scale: float
    ) -> Tensor | None:
        for p in params:
            if "exp_avg" not in self.state[p]:
                self.state[p]["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                self.state[p]["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        group["step"] += 1
        beta1, beta2 = group["betas"]
        bias_correction1, bias_correction2_sqrt = (
            F.bias_corrections(beta1, beta2, group["step"]) if self.bias_correction else (1.0, 1.0)
        )
        tensors = (
            [self._fp32_param(p) for p in params],
            grads,
            [self.state[p]["exp_avg"] for p in params],
            [self.state[p]["exp_avg_sq"] for p in params],
        )
        hyper = dict(
            lr=group["lr"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            bias_correction1=bias_correction1,
            bias_correction2_sqrt=bias_correction2_sqrt,
            grad_scale=grad_scale,
        )
        if self.compile:  # the compiled kernels keep their ratios to themselves: no statistics
            self._compiled_update(*tensors, beta1=beta1, beta2=beta2, **hyper)
            return None
        return self._eager_update(*tensors, beta1=beta1, beta2=beta2, **hyper)

    def _eager_update(self, *tensor_lists: list[Tensor], **hyper: Any) -> Tensor | None:
        return eager_lamb_update(
            self.workspace, list(tensor_lists), self.variant, self.min_coeff, self.max_coeff, **hyper
        )

    def _compiled_update(
        self,
        params: list[Tensor],
        grads: list[Tensor],
        exp_avgs: list[Tensor],
        exp_avg_sqs: list[Tensor],
        *,
        beta1: float,
        beta2: float,
        **hyper: Any,
    ) -> None:
        """Two compiled kernels per tensor (one graph each for 1-D tensors of any length): the moments and
        the norms of p and of the direction, then the trust-ratio step, which forms the direction again
        (nothing parameter-sized is stored besides m, v and p). Tensors below
        `compiled.COMPILED_MIN_NUMEL` elements take the eager foreach update in one batch instead: a
        compiled call's fixed cost is more than their whole update."""
        tensor_lists = [params, grads, exp_avgs, exp_avg_sqs]
        small, large = split_by_size(params)
        if small:
            self._eager_update(*pick(tensor_lists, small), beta1=beta1, beta2=beta2, **hyper)
        if not large:
            return
        params, grads, exp_avgs, exp_avg_sqs = pick(tensor_lists, large)
        clamp_ratio = self.variant is LambVariant.deepspeed
        scalars = F.lamb_kernel_scalars(
            clamp_ratio=clamp_ratio, min_coeff=self.min_coeff, max_coeff=self.max_coeff, beta1=beta1,
            beta2=beta2, device=params[0].device, **hyper,
        )  # fmt: skip
        self._compiled_step(params, grads, exp_avgs, exp_avg_sqs, scalars=scalars, clamp_ratio=clamp_ratio)
