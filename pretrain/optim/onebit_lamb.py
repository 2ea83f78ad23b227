"""1-bit LAMB (arXiv 2104.06069) on plain torch.distributed: this project's algorithm and DeepSpeed's.

Two stages (`pretrain.optim.onebit`), with F = freeze_step:

1. Warmup, steps 1..F: the trainer averages the gradients exactly and the step is LAMB's. With
   `warmup="nvlamb"` it is `Lamb(variant="nvlamb")` exactly (global pre-normalization by
   max(1, G/max_grad_norm), bias-corrected moments, the trust ratio on tensors with weight decay, no clamp);
   with `warmup="deepspeed"` DeepSpeed's LAMB (no bias correction, the ratio clamped to
   [min_coeff, max_coeff] on every tensor). Either way an EMA c̄ of the trust ratios (coeff_beta) is kept.
2. Freeze, after step F: v is frozen (v_f ← v). nvlamb: m and v are replaced by their bias-corrected
   values and the warmup's average pre-normalization factor is frozen with them (the compression stage's
   local gradients are multiplied by it: the global norm of the averaged gradient is not known before the
   exchange).
3. Exchange, every later step: each worker forms its local momentum m_w = β1·m + (1−β1)·g_w from its own
   gradients and the workers' momenta are averaged by ONE 1-bit compressed allreduce with error feedback
   (`pretrain.comm`): sign bits plus one scale per segment, in two phases (to the chunk's server, back).
   The exchange options are `pretrain.optim.onebit.ExchangeOptions`: with `precondition` each worker sends
   m_w/(√v+ε) (v frozen, so the divisor is the same on every rank) and the average is multiplied back;
   `compression="per_column"` gives one scale per tensor, per embedding row and per input column of the
   other matrices; `exact_vectors` sends the 1-D tensors with one scale per element (exactly averaged);
   `scale_dtype=bfloat16` sends scales in 2 bytes; `sign_scale="mean_abs"` is the least-squares scale.
4. Step: with `trust_ratio="live"`, LAMB's own rule on the averaged momentum, p ← p − η·c·u with
   u = m/(√v+ε) + λp and c = min(‖p‖/‖u‖, max_coeff) (1 on nvlamb's tensors without weight decay): every
   input is replicated, so it costs no bytes and the step's norm is LAMB's however large ‖u‖ grows. With
   `trust_ratio="frozen"` DeepSpeed's rule, p ← p − η·c̄·f·u with the factor f from the fresh variance
   (factor_min/max/threshold). `live_vector_variance` keeps the 1-D tensors' v live: they are averaged
   exactly, so their momentum's increment is their averaged gradient ĝ = (m̂ₜ − β1·m̂ₜ₋₁)/(1 − β1), and
   v ← β2·v + (1 − β2)·ĝ² after the step.
5. Refresh, every `variance_refresh`-th compression step (K ≥ 2; 0: off): each worker has summed the row
   and column sums of its own g² over the K steps (no bytes); they are averaged exactly (~0.1 % of the
   elements, one small fp32 allreduce) and each matrix with weight decay folds the rank-1 estimate of its
   mean square, r·cᵀ/Σr, into v: v ← β2^K·v + (1−β2^K)·r·cᵀ/Σr; the exchange divisors follow.

The algorithm is one `OnebitLambAlgorithm`, chosen at construction. This project's 1-bit LAMB
(`optim=onebit_lamb`, `ONEBIT_LAMB_ALGORITHM`) is: nvlamb warmup, live trust ratio, per_column scales,
preconditioned exchange, exact vectors with bfloat16 scales, mean_abs sign scale, live vector variance and
the refresh every 64 steps. DeepSpeed's (`optim=onebit_lamb_deepspeed`, `DEEPSPEED_ALGORITHM`, this
class's default): deepspeed warmup, frozen c̄·f, one scale per rank's buffer with κ scaling (computed once
at the first compression step), no preconditioning, rms sign scale, fp32 scales, v frozen. What each change
does and the measurements behind it: docs/onebit-lamb.md and results/cpu-study/README.md.

Per-parameter state: the step count lives in the param groups; `exp_avg` (a view into the flat buffer),
`exp_avg_sq`, `lamb_coeff_freeze` (c̄), `last_factor`, from step F `exp_avg_sq_fresh` (v_f), from the
first compression step `scaling_coeff` (κ); `master_param` for bf16/fp16 parameters. Scalars are 0-dim
fp32 tensors on the parameter's device. Rank-local (checkpointed per rank): the refresh's square sums.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import Tensor

from pretrain.comm.compressed_allreduce import ScaleDtype, SignScale
from pretrain.comm.exact import worker_order_mean
from pretrain.comm.kernels import MomentumSource
from pretrain.optim import compiled
from pretrain.optim import functional as F
from pretrain.optim.base import global_grad_norm
from pretrain.optim.lamb import LambVariant, eager_lamb_update
from pretrain.optim.live_step import live_trust_ratio_step_, local_momentum_
from pretrain.optim.marginals import add_square_marginals_many
from pretrain.optim.onebit import Compression, ExchangeOptions, OnebitOptimizer, Stage

logger = logging.getLogger(__name__)


class TrustRatio(str, enum.Enum):
    """The compression stage's step coefficient (module docstring)."""

    frozen = "frozen"  # DeepSpeed: c̄ (EMA of the warmup's trust ratios) times the fresh-variance factor
    live = "live"  # LAMB's trust ratio ‖p‖/‖u‖ (capped at max_coeff), every step on the compressed momentum


@dataclass(frozen=True)
class OnebitLambAlgorithm:
    """Which 1-bit LAMB (module docstring), fixed at construction: the warmup's LAMB variant, the compression
    stage's trust ratio, the momentum exchange, and whether the 1-D tensors keep a live variance. The two
    algorithms are `ONEBIT_LAMB_ALGORITHM` (this project's, `optim=onebit_lamb`) and `DEEPSPEED_ALGORITHM`
    (`optim=onebit_lamb_deepspeed`); a study of one change is `replace(...)` of either. The optimizer asks it
    what its steps differ by (the properties and methods below), so the steps hold no option branches of
    their own. Strings are taken for the enums."""

    warmup: LambVariant = LambVariant.deepspeed
    trust_ratio: TrustRatio = TrustRatio.frozen
    exchange: ExchangeOptions = field(default_factory=ExchangeOptions)
    live_vector_variance: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "warmup", LambVariant(self.warmup))
        object.__setattr__(self, "trust_ratio", TrustRatio(self.trust_ratio))
        if self.nvlamb and not self.live:
            raise ValueError("OnebitLamb: warmup='nvlamb' needs trust_ratio='live'")

    def replace(self, **changes: Any) -> OnebitLambAlgorithm:
        """A copy with `changes`; the exchange's keys (`compression`, `precondition`, ...) go into
        `exchange`."""
        names = {f.name for f in fields(ExchangeOptions)}
        exchange = {key: changes.pop(key) for key in list(changes) if key in names}
        return dataclasses.replace(self, exchange=dataclasses.replace(self.exchange, **exchange), **changes)

    def options(self) -> dict[str, Any]:
        """Every choice by name, the exchange's among them, enums as their values (records, reports)."""
        exchange = {f.name: getattr(self.exchange, f.name) for f in fields(self.exchange)}
        values = {"warmup": self.warmup, "trust_ratio": self.trust_ratio, **exchange}
        values["live_vector_variance"] = self.live_vector_variance
        return {key: value.value if isinstance(value, enum.Enum) else value for key, value in values.items()}

    @property
    def nvlamb(self) -> bool:
        """NVLAMB's rules: pre-normalized gradients (frozen at F for the compression stage), moments
        bias-corrected at the freeze, no trust ratio on tensors without weight decay."""
        return self.warmup is LambVariant.nvlamb

    @property
    def live(self) -> bool:
        """The compression step is LAMB's own rule with the live trust ratio (else DeepSpeed's c̄·f)."""
        return self.trust_ratio is TrustRatio.live

    @property
    def kappa(self) -> bool:
        """The tensors enter the exchange scaled by κ (DeepSpeed's one scale per rank's buffer)."""
        return self.exchange.compression is Compression.deepspeed

    def ratio_bounds(self, weight_decay: float, max_coeff: float) -> tuple[float, float]:
        """The live ratio's clamp: [1, 1] (no ratio) for an NVLAMB group without weight decay."""
        return (1.0, 1.0) if self.nvlamb and weight_decay == 0.0 else (0.0, max_coeff)

    def live_variance_positions(self, params: list[Tensor]) -> list[int]:
        """The tensors whose variance stays live after the freeze: the 1-D ones, averaged exactly."""
        if not (self.live_vector_variance and self.exchange.exact_vectors):
            return []
        return [i for i, p in enumerate(params) if p.dim() <= 1]


# This project's 1-bit LAMB and DeepSpeed's (module docstring; what each change does and the measurements
# behind it: docs/onebit-lamb.md).
ONEBIT_LAMB_ALGORITHM = OnebitLambAlgorithm(
    warmup=LambVariant.nvlamb,
    trust_ratio=TrustRatio.live,
    exchange=ExchangeOptions(
        compression=Compression.per_column,
        exact_vectors=True,
        sign_scale=SignScale.mean_abs,
        precondition=True,
        scale_dtype=ScaleDtype.bfloat16,
    ),
    live_vector_variance=True,
)
DEEPSPEED_ALGORITHM = OnebitLambAlgorithm()


class OnebitLamb(OnebitOptimizer):
    """1-bit LAMB. Hyperparameters and defaults as DeepSpeed's (docs/onebit-lamb.md).

    Args:
        params: parameters or groups; a group may carry `exp_avg_mask`, a 0/1 tensor broadcastable to
            each of its parameters, multiplied into the momentum after every compressed exchange.
        lr, betas, eps, weight_decay: as in LAMB (ε outside the root, decoupled decay).
        freeze_step: number of warmup steps (≥ 1); compression from step freeze_step + 1.
        algorithm: `OnebitLambAlgorithm` (default DeepSpeed's).
        max_coeff: cap of the trust ratio (the live one's; the warmup's clamp with `min_coeff`).
        min_coeff, coeff_beta, factor_min, factor_max, factor_threshold: DeepSpeed's rules: the clamp of
            its warmup's trust ratio, the EMA factor of c̄ (DeepSpeed advises 1/(1 − coeff_beta) ≤
            freeze_step), the compression-stage factor rule (docs/onebit-lamb.md).
        max_grad_norm: NVLAMB's warmup: the global gradient pre-normalization threshold (0 disables).
        variance_refresh: K ≥ 2: every K-th compression step refreshes the matrices' variance from the
            workers' row and column sums of g² (module docstring); 0: off. Needs the live trust ratio.
        compile: run the warmup and compression steps as `torch.compile`d passes
            (`pretrain.optim.compiled`; the first steps compile, about 10–30 s on CPU). Needs the live trust
            ratio, `precondition` and one worker per process. Same math; results
            agree with the eager steps to float rounding, not bitwise.
        group: data-parallel process group (None: the default group, or a world of one without
            torch.distributed).
        virtual_workers: simulated workers per process (`pretrain.optim.onebit`).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        freeze_step: int = 100000,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        algorithm: OnebitLambAlgorithm = DEEPSPEED_ALGORITHM,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
        max_grad_norm: float = 1.0,
        variance_refresh: int = 0,
        compile: bool = False,
        group: Any = None,
        virtual_workers: int = 1,
    ) -> None:
        if not 0.0 <= min_coeff <= max_coeff or not 0.0 < factor_min <= factor_max:
            raise ValueError("OnebitLamb needs 0 <= min_coeff <= max_coeff and 0 < factor_min <= factor_max")
        if max_grad_norm < 0:
            raise ValueError(f"OnebitLamb: max_grad_norm must be >= 0, got {max_grad_norm}")
        if variance_refresh < 0 or variance_refresh == 1:
            raise ValueError(f"OnebitLamb: variance_refresh must be 0 (off) or >= 2, got {variance_refresh}")
        if variance_refresh and not algorithm.live:
            raise ValueError("OnebitLamb: variance_refresh needs trust_ratio='live'")
        if 1.0 / (1.0 - coeff_beta) > freeze_step:
            logger.warning("OnebitLamb: 1/(1 - coeff_beta) > freeze_step, the coefficient EMA is still young")
        if compile:
            reason = compiled.unsupported_reason(
                trust_ratio_live=algorithm.live,
                precondition=algorithm.exchange.precondition,
                virtual_workers=virtual_workers,
            )
            if reason is not None:
                raise ValueError(f"OnebitLamb(compile=True) {reason}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(
            params,
            defaults,
            freeze_step=freeze_step,
            group=group,
            exchange=algorithm.exchange,
            virtual_workers=virtual_workers,
        )
        self.algorithm = algorithm
        self.compile = compile
        self._compiled_warmup = compiled.CompiledWarmupStep() if compile else None
        self._compiled_compression = compiled.CompiledCompressionStep() if compile else None
        self.min_coeff, self.max_coeff, self.coeff_beta = min_coeff, max_coeff, coeff_beta
        self.factor_min, self.factor_max, self.factor_threshold = factor_min, factor_max, factor_threshold
        self.max_grad_norm = max_grad_norm
        self.variance_refresh = variance_refresh
        # the variance refresh: each worker's row and column sums of its g² since the last refresh
        self._square_sums: Tensor | None = None
        self._factored: list[int] | None = None  # `_factored_positions`, once computed
        self._last_live_coeffs: dict[int, Any] = {}  # `live`: the last step's coefficients, per group

    def _segment_groups(self) -> list[list[Tensor]]:
        return [[p for group in self.param_groups for p in group["params"]]]

    def _init_param_state(self, param: Tensor) -> None:
        self.state[param].update(
            exp_avg_sq=torch.zeros_like(param, dtype=torch.float32),
            lamb_coeff_freeze=torch.zeros((), dtype=torch.float32, device=param.device),
            last_factor=torch.ones((), dtype=torch.float32, device=param.device),
        )

    def _states(self, params: list[Tensor], key: str) -> list[Tensor]:
        return [self.state[p][key] for p in params]

    def _hyper(self, group: dict[str, Any]) -> dict[str, Any]:
        beta1, beta2 = group["betas"]
        return dict(
            lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"]
        )

    def _warmup_step(self, grads: list[Tensor]) -> None:
        grad_scale = self._warmup_grad_scale(grads)
        for group, span in self._group_slices():
            params = group["params"]
            tensors = [[self._fp32_param(p) for p in params], grads[span]]
            tensors += [self._states(params, "exp_avg"), self._states(params, "exp_avg_sq")]
            hyper = self._warmup_hyper(group, grad_scale)
            coeffs: Tensor | None
            if self._compiled_warmup is not None:
                coeffs = self._compiled_warmup_group(hyper, tensors)
            else:
                coeffs = self._eager_warmup_group(hyper, tensors)
            if coeffs is None:  # nvlamb, a group without weight decay: no trust ratio (1 counts as none)
                coeffs = torch.ones(len(params), dtype=torch.float32, device=params[0].device)
            coeff_freeze = self._states(params, "lamb_coeff_freeze")
            ema = F.freeze_coeff_ema(torch.stack(coeff_freeze), coeffs, self.coeff_beta)
            torch._foreach_copy_(coeff_freeze, list(ema.unbind()))

    def _warmup_grad_scale(self, grads: list[Tensor]) -> float:
        """nvlamb: the pre-normalization 1/max(1, G/max_grad_norm) of this step (G over all tensors, one
        host sync, as `Lamb`), folded into every group's β2-EMA of it (`grad_scale_ema`); else 1."""
        if not self.algorithm.nvlamb or self.max_grad_norm <= 0:
            return 1.0
        norm = self._grad_norm if self._grad_norm is not None else global_grad_norm(grads)
        scale = 1.0 / max(1.0, float(norm) / self.max_grad_norm)
        for group in self.param_groups:
            beta2 = group["betas"][1]
            group["grad_scale_ema"] = beta2 * group.get("grad_scale_ema", 0.0) + (1.0 - beta2) * scale
        return scale

    def _warmup_hyper(self, group: dict[str, Any], grad_scale: float) -> dict[str, Any]:
        hyper = self._hyper(group)
        if self.algorithm.nvlamb:
            bias_correction1, bias_correction2_sqrt = F.bias_corrections(
                hyper["beta1"], hyper["beta2"], group["step"] + 1
            )
            hyper.update(
                bias_correction1=bias_correction1,
                bias_correction2_sqrt=bias_correction2_sqrt,
                grad_scale=grad_scale,
            )
        return hyper

    def _eager_warmup_group(self, hyper: dict[str, Any], tensors: list[list[Tensor]]) -> Tensor | None:
        """LAMB's eager step, `Lamb`'s own (`lamb.eager_lamb_update`)."""
        warmup = self.algorithm.warmup
        return eager_lamb_update(self.workspace, tensors, warmup, self.min_coeff, self.max_coeff, **hyper)

    def _compiled_warmup_group(self, hyper: dict[str, Any], tensors: list[list[Tensor]]) -> Tensor | None:
        """Compiled kernels for the large tensors, the eager foreach step for the small ones (one
        compiled call costs more than their whole update: `compiled.COMPILED_MIN_NUMEL`)."""
        assert self._compiled_warmup is not None
        params = tensors[0]
        clamp_ratio = not self.algorithm.nvlamb
        if not clamp_ratio and hyper["weight_decay"] == 0.0:  # nvlamb: no ratio, a plain foreach step
            return self._eager_warmup_group(hyper, tensors)
        coeffs = torch.empty(len(params), dtype=torch.float32, device=params[0].device)
        small, large = compiled.split_by_size(params)
        if small:
            small_coeffs = self._eager_warmup_group(hyper, compiled.pick(tensors, small))
            assert small_coeffs is not None
            coeffs[small] = small_coeffs
        if large:
            corrections = dict(bias_correction1=1.0, bias_correction2_sqrt=1.0, grad_scale=1.0)
            corrections.update({k: hyper[k] for k in corrections if k in hyper})
            scalars = F.lamb_kernel_scalars(
                clamp_ratio=clamp_ratio, lr=hyper["lr"], eps=hyper["eps"],
                weight_decay=hyper["weight_decay"], beta1=hyper["beta1"], beta2=hyper["beta2"],
                min_coeff=self.min_coeff, max_coeff=self.max_coeff, device=params[0].device, **corrections,
            )  # fmt: skip
            params, grads, exp_avgs, exp_avg_sqs = compiled.pick(tensors, large)
            coeffs[large] = self._compiled_warmup(
                params, grads, exp_avgs, exp_avg_sqs, scalars=scalars, clamp_ratio=clamp_ratio
            )
        return coeffs

    def _freeze(self) -> None:
        """v_f ← v; κ is recomputed at the next (first compression) step; the factor rule restarts at 1.
        nvlamb: m, v ← their bias-corrected values first, and the gradient pre-normalization is frozen."""
        if self.algorithm.nvlamb:
            self._correct_moments()
        super()._freeze()
        self._square_sums = None
        for p in self._segment_groups()[0]:
            state = self.state[p]
            state["exp_avg_sq_fresh"] = state["exp_avg_sq"].clone()
            state.pop("scaling_coeff", None)
            state["last_factor"].fill_(1.0)

    def _correct_moments(self) -> None:
        for group in self.param_groups:
            step = group["step"]
            if step == 0:
                continue
            beta1, beta2 = group["betas"]
            params = group["params"]
            torch._foreach_div_(self._states(params, "exp_avg"), 1.0 - beta1**step)
            torch._foreach_div_(self._states(params, "exp_avg_sq"), 1.0 - beta2**step)
            group["frozen_grad_scale"] = group.get("grad_scale_ema", 0.0) / (1.0 - beta2**step)
            if self.max_grad_norm <= 0:
                group["frozen_grad_scale"] = 1.0

    def _compression_grad_scale(self) -> float:
        """nvlamb: the frozen average pre-normalization factor the local gradients are multiplied by."""
        if not self.algorithm.nvlamb:
            return 1.0
        return float(self.param_groups[0].get("frozen_grad_scale", 1.0))

    def _scale_gradients(self, worker_rows: Tensor | None, grads: list[Tensor]) -> None:
        """Multiply the step's gradients (the virtual workers' own rows when given) by the frozen
        pre-normalization factor."""
        scale = self._compression_grad_scale()
        if scale == 1.0:
            return
        if worker_rows is not None:  # virtual workers: their own gradients, one row each
            worker_rows.mul_(scale)
        else:
            torch._foreach_mul_(grads, scale)

    def _update_live_variance(self, segment: Any, positions: list[int], previous: list[Tensor]) -> None:
        """v ← β2·v + (1−β2)·ĝ², ĝ = (m̂ₜ − β1·m̂ₜ₋₁)/(1−β1), for the exactly averaged tensors; their
        exchange divisor √v+ε follows (the same on every rank)."""
        if not positions:
            return
        # the tensors by their group's (β1, β2, ε), each such list in multi-tensor ops: a few launches on a
        # GPU instead of five per tensor (~250 vectors in BERT-Large), the same ops per tensor on CPU
        hyper = {
            id(p): (*group["betas"], group["eps"]) for group in self.param_groups for p in group["params"]
        }
        lists: dict[tuple[float, float, float], list[int]] = {}
        for k, i in enumerate(positions):
            lists.setdefault(hyper[id(segment.params[i])], []).append(k)
        divisors = segment.divisors
        for (beta1, beta2, eps), ks in lists.items():
            gradients = [previous[k] for k in ks]
            torch._foreach_mul_(gradients, -beta1)
            torch._foreach_add_(gradients, [segment.views[positions[k]] for k in ks])
            torch._foreach_div_(gradients, 1.0 - beta1)
            exp_avg_sqs = [self.state[segment.params[positions[k]]]["exp_avg_sq"] for k in ks]
            torch._foreach_mul_(exp_avg_sqs, beta2)
            torch._foreach_addcmul_(exp_avg_sqs, gradients, gradients, value=1.0 - beta2)
            if divisors is not None:
                roots = [divisors[positions[k]] for k in ks]
                torch._foreach_copy_(roots, exp_avg_sqs)
                torch._foreach_sqrt_(roots)
                torch._foreach_add_(roots, eps)

    def _refresh_next(self) -> bool:
        """`variance_refresh`: the next step is the K-th compression step since the freeze."""
        refresh, frozen_at = self.variance_refresh, self.frozen_at
        if not refresh or frozen_at is None or self.stage is not Stage.compression:
            return False
        return (self.step_count + 1 - frozen_at) % refresh == 0

    def _compression_step(self, grads: list[Tensor]) -> None:
        """Exchange, step, refresh: the local momentum's exchange and the live (or frozen) step; every
        `variance_refresh`-th step also refreshes the matrices' variance (`_refresh_rank1`) first."""
        (segment,) = self._segments or []
        refresh_now = self._refresh_next()
        # the frozen pre-normalization factor: multiplied into the gradients in a pass of their own, or
        # where nothing else reads them scaled, into the passes that read them anyway (the marginals'
        # loop and the local momentum's: the same fp32 products, so the same bits)
        deferred = self._defers_grad_scale(segment)
        if not deferred:
            self._scale_gradients(segment.local, grads)
        grad_scale = self._compression_grad_scale() if deferred else 1.0
        live = self.algorithm.live_variance_positions(segment.params)
        marginals = None
        if self.variance_refresh:
            if not refresh_now and segment.local is None:  # added where the local momentum is formed
                marginals = self._marginal_targets(segment)
            else:
                self._accumulate_marginals(segment, grads, grad_scale)
            if refresh_now:
                self._refresh_rank1(segment)
        # m̂ₜ₋₁ of the exactly averaged tensors: copies (×1 is exact) in one multi-tensor op
        previous = list(torch._foreach_mul([segment.views[i] for i in live], 1.0)) if live else []
        self._compression_update(segment, grads, grad_scale, marginals)
        self._update_live_variance(segment, live, previous)

    def _defers_grad_scale(self, segment: Any) -> bool:
        """Whether this compression step's gradients reach only passes that take the nvlamb factor
        themselves: one worker per process and the eager step."""
        probing = self.probe is not None and self.probe.active
        return (
            self._compression_grad_scale() != 1.0
            and segment.local is None
            and (self._compiled_compression is None or probing)
        )

    @staticmethod
    def _set_divisor(divisors: list[Tensor] | None, i: int, exp_avg_sq: Tensor, eps: float) -> None:
        """The preconditioned exchange's divisor of tensor ``i`` follows its refreshed v: √v + ε."""
        if divisors is not None:
            torch.sqrt(exp_avg_sq, out=divisors[i]).add_(eps)

    def _factored_positions(self, segment: Any) -> list[int]:
        """The variance refresh's matrices: those with weight decay, in segment order (computed once: the
        one segment and the groups are fixed after construction)."""
        if self._factored is None:
            decayed = {
                id(p) for group in self.param_groups if group["weight_decay"] != 0.0 for p in group["params"]
            }
            self._factored = [i for i, p in enumerate(segment.params) if p.dim() == 2 and id(p) in decayed]
        return self._factored

    def _marginal_views(self, flat: Tensor, segment: Any) -> list[tuple[Tensor, Tensor]]:
        """Per factored matrix [R, C]: views of its R row sums and C column sums in `flat`."""
        views, start = [], 0
        for i in self._factored_positions(segment):
            rows, cols = segment.params[i].shape
            views.append((flat[start : start + rows], flat[start + rows : start + rows + cols]))
            start += rows + cols
        return views

    def _square_sums_of(self, segment: Any) -> Tensor:
        """The workers' row and column sums ([workers, length]), allocated at first use."""
        if self._square_sums is None:
            length = sum(sum(segment.params[i].shape) for i in self._factored_positions(segment))
            length += -length % self.num_processes  # worker_order_mean splits it into one chunk per process
            workers = segment.local.shape[0] if segment.local is not None else 1
            self._square_sums = torch.zeros(workers, length, device=segment.buffer.device)
        return self._square_sums

    def _marginal_targets(self, segment: Any) -> list[tuple[Tensor, Tensor] | None]:
        """Per tensor of the segment: None, or the views of this worker's (row sums, column sums) its g²
        adds to (one worker per process)."""
        targets: list[tuple[Tensor, Tensor] | None] = [None] * len(segment.params)
        views = self._marginal_views(self._square_sums_of(segment)[0], segment)
        for i, sums in zip(self._factored_positions(segment), views):
            targets[i] = sums
        return targets

    def _accumulate_marginals(self, segment: Any, grads: list[Tensor], grad_scale: float = 1.0) -> None:
        """The variance refresh: each worker adds the row and column sums of its own g² (no bytes); g =
        `grad_scale`·grads (1 where `grads` hold the scaled gradients already)."""
        positions = self._factored_positions(segment)
        for worker, sums in enumerate(self._square_sums_of(segment)):
            own = grads if segment.local is None else segment.views_of(segment.local[worker])
            matrices = [own[i] for i in positions]
            add_square_marginals_many(
                matrices, self._marginal_views(sums, segment), self.workspace, grad_scale
            )

    def _refresh_rank1(self, segment: Any) -> None:
        """The variance refresh (module docstring): the workers' row and column sums of Σ g_w² averaged
        exactly; each decayed matrix's mean square over the K steps rebuilt as r·cᵀ/Σr and folded into v,
        v ← β2^K·v + (1−β2^K)·r·cᵀ/Σr; the sums restart."""
        assert self._square_sums is not None
        mean = worker_order_mean(self._square_sums, self.group, self.num_processes, self.traffic)
        mean.div_(self.variance_refresh)
        groups = {id(p): group for group in self.param_groups for p in group["params"]}
        divisors = segment.divisors
        for i, (rows, cols) in zip(self._factored_positions(segment), self._marginal_views(mean, segment)):
            param = segment.params[i]
            group = groups[id(param)]
            weight = 1.0 - group["betas"][1] ** self.variance_refresh
            estimate = torch.outer(rows, cols).div_(rows.sum().clamp(min=1e-30))  # no gradient at all: 0
            exp_avg_sq = self.state[param]["exp_avg_sq"]
            exp_avg_sq.mul_(1.0 - weight).add_(estimate, alpha=weight)
            self._set_divisor(divisors, i, exp_avg_sq, group["eps"])
        self._square_sums.zero_()

    def _compression_update(
        self,
        segment: Any,
        grads: list[Tensor],
        grad_scale: float = 1.0,
        marginals: list[tuple[Tensor, Tensor] | None] | None = None,
    ) -> None:
        """`grad_scale` (`_defers_grad_scale`): the factor `grads` still need. `marginals`
        (`_marginal_targets`): the square marginals still to add, in the exchange's first pass where it
        forms the local momentum itself, else here first."""
        probing = self.probe is not None and self.probe.active
        if self._compiled_compression is not None and not probing:
            assert grad_scale == 1.0, "the compiled step takes the gradients scaled"
            if marginals is not None:
                self._accumulate_marginals(segment, grads)
            self._compiled_compression_step(segment, grads)
            return
        # the frozen rule reads the previous momentum; the live step needs no copy of it
        prev_exp_avgs = segment.views if self.algorithm.live else segment.snapshot()
        kappas = self._scaling_coefficients(segment.params) if self.algorithm.kappa else None
        betas = {group["betas"][0] for group in self.param_groups}
        if segment.local is not None and len(betas) > 1:
            raise ValueError("virtual workers need one beta1 for all parameter groups")
        beta1 = self.param_groups[0]["betas"][0]
        # one numba loop forms (β1·m + (1−β1)·g)/(√v+ε) where it can (`live_step`)
        prepared = len(betas) == 1 and self._preconditioned_local_momentum(
            segment, grads, kappas, beta1=beta1, grad_scale=grad_scale, marginals=marginals
        )
        # without an exchange to take them, the marginals go into the local momentum's loop (`live_step`)
        folded = marginals if segment.local is None and prepared is False and len(betas) == 1 else None
        if marginals is not None and not isinstance(prepared, MomentumSource) and folded is None:
            self._accumulate_marginals(segment, grads, grad_scale)
        if segment.local is None and prepared is False:  # virtual workers: in the exchange
            # m ← β1·m + (1−β1)·(s·g) in one numba loop where it can (one beta1), else in torch ops
            momenta = segment.views
            formed = len(betas) == 1 and local_momentum_(
                momenta, grads, beta1=beta1, grad_scale=grad_scale, marginals=folded
            )
            if not formed and folded is not None:  # from the gradients as they are, before any scaling
                self._accumulate_marginals(segment, grads, grad_scale)
            if not formed and grad_scale != 1.0:
                torch._foreach_mul_(grads, grad_scale)
            for group, span in [] if formed else self._group_slices():
                F.local_momentum_(momenta[span], grads[span], beta1=group["betas"][0])
        # the live step multiplies the average ū back by √v+ε itself (`_compressed_update`)
        averages = self._fused_exchange(segment, kappas) and self.algorithm.live
        source = prepared if isinstance(prepared, MomentumSource) else None
        divided = prepared is not False
        self._exchange(segment, kappas, beta1=beta1, divided=divided, scale_back=not averages, source=source)
        self._apply_masks()  # a 0/1 mask: the same bits on ū as on m = ū·(√v+ε)
        divisors = segment.divisors  # √v+ε, kept in step with v (built by the preconditioned exchange)
        for group, span in self._group_slices():
            if self.algorithm.live:
                self._live_step(group, None if divisors is None else divisors[span], averages=averages)
            else:
                self._frozen_step(group, prev_exp_avgs[span])

    def _compiled_compression_step(self, segment: Any, grads: list[Tensor]) -> None:
        """`pretrain.optim.compiled.CompiledCompressionStep` over every group (live ratio, preconditioned)."""
        assert self._compiled_compression is not None
        scratch = segment.scratch()
        divisors = self._divisors(segment)
        # one worker: the exchange is the identity, so nothing goes out in the exchange layout
        exchanged = segment.compressor is not None
        exchange_views = segment.exchange_views(scratch) if exchanged else segment.views_of(scratch)
        transposed = (exchanged and segment.transposed) or [False] * len(segment.params)
        steps = []
        for group, span in self._group_slices():
            hyper = self._hyper(group)
            params = group["params"]
            min_coeff, max_coeff = self.algorithm.ratio_bounds(group["weight_decay"], self.max_coeff)
            scalars = F.live_scalars(
                beta1=hyper["beta1"], lr=hyper["lr"], weight_decay=hyper["weight_decay"],
                min_coeff=min_coeff, max_coeff=max_coeff, device=segment.buffer.device,
            )  # fmt: skip
            steps.append(
                compiled.GroupStep(
                    [self._fp32_param(p) for p in params],
                    grads[span],
                    divisors[span],
                    segment.views[span],
                    exchange_views[span],
                    transposed[span],
                    group.get("exp_avg_mask"),
                    scalars,
                )
            )
        exchange = segment.compressor if segment.compressor is not None else (lambda flat: flat)
        ratios = self._compiled_compression(steps, segment.buffer, scratch, exchange)
        for (group, _), group_ratios in zip(self._group_slices(), ratios):
            self._last_live_coeffs[id(group)] = group_ratios

    def _scaling_coefficients(self, params: list[Tensor]) -> list[Tensor]:
        """κ per tensor, computed from the synchronized momentum at the first compression step."""
        if any("scaling_coeff" not in self.state[p] for p in params):
            kappas = F.scaling_coefficients(self._states(params, "exp_avg"))
            for p, kappa in zip(params, kappas.unbind()):
                self.state[p]["scaling_coeff"] = kappa.clone()
        return self._states(params, "scaling_coeff")

    def _live_step(self, group: dict[str, Any], divisors: list[Tensor] | None, *, averages: bool) -> None:
        """LAMB's rule on the averaged momentum: p ← p − η·c·(m/(√v+ε) + λp), c = clamp(‖p‖/‖u‖) (module
        docstring). `divisors`: the group's √v+ε where the exchange keeps them (the step then skips the
        root). `averages`: the momenta still hold the exchange's ū = m/(√v+ε) (`_exchange(scale_back=False)`);
        the step forms m = ū·(√v+ε) and stores it. The numba loops on CPU, else the foreach functions."""
        params = group["params"]
        exp_avgs = self._states(params, "exp_avg")
        tensors = [[self._fp32_param(p) for p in params], exp_avgs]
        tensors.append(self._states(params, "exp_avg_sq") if divisors is None else divisors)
        min_coeff, max_coeff = self.algorithm.ratio_bounds(group["weight_decay"], self.max_coeff)
        options = dict(
            lr=group["lr"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            min_coeff=min_coeff,
            max_coeff=max_coeff,
            rooted=divisors is not None,
        )
        coeffs = live_trust_ratio_step_(*tensors, **options, averages=averages)  # None: not usable here
        if coeffs is None:
            if averages:  # the pass `_exchange` left out, with its arithmetic
                assert divisors is not None
                torch._foreach_mul_(exp_avgs, divisors)
            coeffs = self._chunked(F.clamped_trust_ratio_step_, tensors, (), expand=True, **options)
        self._last_live_coeffs[id(group)] = coeffs

    def _frozen_step(self, group: dict[str, Any], prev_exp_avgs: list[Tensor]) -> None:
        """DeepSpeed's rule: p ← p − η·c̄·f·(m/(√v+ε) + λp), f from the fresh variance (module docstring)."""
        params = group["params"]
        tensors = [[self._fp32_param(p) for p in params], self._states(params, "exp_avg"), prev_exp_avgs]
        tensors += [self._states(params, "exp_avg_sq"), self._states(params, "exp_avg_sq_fresh")]
        last_factors = self._states(params, "last_factor")
        coeffs = torch.stack(self._states(params, "lamb_coeff_freeze"))
        scalars = (coeffs, torch.stack(last_factors))
        factor_rule = dict(
            factor_min=self.factor_min, factor_max=self.factor_max, factor_threshold=self.factor_threshold
        )
        factors = self._chunked(
            F.compressed_lamb_update_, tensors, scalars, expand=True, **factor_rule, **self._hyper(group)
        )
        torch._foreach_copy_(last_factors, list(factors.unbind()))  # type: ignore[union-attr]

    def _extra_state(self) -> dict[str, Any]:
        return {**super()._extra_state(), "square_sums": self._square_sums}

    def _load_extra_state(self, extra: dict[str, Any]) -> None:
        super()._load_extra_state(extra)
        sums = extra.get("square_sums")
        self._square_sums = None  # restarts at zero in warmup and after a world-size change
        if (
            sums is not None
            and self.stage is Stage.compression
            and extra.get("world_size") == self.world_size
        ):
            self._square_sums = sums.to(self.param_groups[0]["params"][0].device).clone()

    def _on_load_warmup(self) -> None:
        # c̄ is kept (it is accumulated over the whole warmup; DeepSpeed resets it, which makes a resumed
        # warmup differ from an uninterrupted one); state that only the compression stage uses is dropped.
        for p in self._segment_groups()[0]:
            state = self.state[p]
            state.pop("scaling_coeff", None)
            state.pop("exp_avg_sq_fresh", None)
            state["last_factor"].fill_(1.0)

    def statistics(self) -> dict[str, float]:
        """Means of c̄ and of the last factors over tensors (host sync: log steps only)."""
        params = self._segment_groups()[0]
        if not params or "lamb_coeff_freeze" not in self.state[params[0]]:
            return super().statistics()
        coeffs = torch.stack(self._states(params, "lamb_coeff_freeze"))
        factors = torch.stack(self._states(params, "last_factor"))
        statistics = {
            **super().statistics(),
            "lamb_coeff_freeze_mean": float(coeffs.mean()),
            "factor_mean": float(factors.mean()),
        }
        live = [c for c in self._last_live_coeffs.values() if c is not None]
        if live and self.stage is Stage.compression:
            statistics["live_coeff_mean"] = float(torch.cat(live).mean())
        return statistics
