"""1-bit LAMB (arXiv 2104.06069; DeepSpeed `OnebitLamb`, spec §3) on plain torch.distributed.

Warmup (steps 1..freeze_step, gradients averaged by the trainer): exactly
`Lamb(variant="deepspeed", bias_correction=False)` — clamped trust ratio c on every tensor — plus an
EMA c̄ of c (coeff_beta, no bias correction, only where c ≠ 1). At step freeze_step v_f ← v.

Compression (later steps, local gradients, §3.5): κ scaling (computed once, at the first compression
step, guarded against all-zero momentum; DeepSpeed's layout only), local momentum, ONE compressed
allreduce of the fused flat momentum of all tensors (scales per `compression`, see
`pretrain.optim.onebit`), momentum masks, frozen v, v_f from the reconstructed gradient, the factor
rule (factor_min/max/threshold) and p ← p − η·c̄·f·(m/(√v+ε) + λp). With `trust_ratio=live` the step
instead takes LAMB's own rule on the compressed momentum every step, p ← p − η·c·u with
u = m/(√v+ε) + λp and c = min(‖p‖/‖u‖, max_coeff): every input is replicated (synchronized m, frozen v,
p), so it costs no communication, and the step's norm is η·‖p‖ (LAMB's) however large ‖u‖ grows. It
grows: sign compression gives every element of a segment the same magnitude, and with v frozen early
the gradients of some tensors outgrow it (the query and key matrices, whose gradients are ~0 while
attention is still uniform: results/cpu-study/README.md). `trust_ratio=live_clamped` also clamps c from
below at `min_coeff` as the warmup does; once ‖u‖ > ‖p‖/min_coeff that floor makes the step
η·min_coeff·‖u‖, larger than LAMB's and growing with ‖u‖ (measured: 10-90x on the query/key matrices,
and a divergence). With `coeff_bias_correction` the
frozen coefficient is the bias-corrected EMA c̄/(1 − coeff_beta^k), k the number of warmup updates that
entered it (DeepSpeed uses c̄ as is, which after k updates of a constant c is only (1 − β^k)·c).

`warmup="nvlamb"` makes the warmup steps exactly `Lamb(variant="nvlamb")` (the LAMB the project compares
against: gradients pre-normalized by max(1, G/max_grad_norm), bias-corrected moments, the trust ratio
only on tensors whose group has weight decay, no clamp), and the compression stage keeps its rules: at
the freeze m and v are replaced by their bias-corrected values (the EMAs then continue unbiased), the
local gradients are multiplied by the warmup's average pre-normalization factor (EMA with β2,
bias-corrected; frozen like v, since the global norm of the averaged gradient is not known before the
exchange), and the tensors without weight decay step η·m/(√v+ε) (ratio 1) while the others take the
live trust ratio. Needs a live trust ratio. DeepSpeed's warmup applies the clamped ratio to every
tensor: zero-initialised biases (the MLM decoder bias, the output prior, among them) then step
η·max(min_coeff, ‖p‖/‖u‖)·u, 8-30x below LAMB's in the seq-32 study (results/cpu-study/README.md).

`live_vector_variance` keeps the variance of the 1-D tensors (biases, LayerNorm) live through the
compression stage: `exact_vectors` averages them exactly, so each step's average gradient is their
momentum's own increment, ĝ = (m̂ₜ − β1·m̂ₜ₋₁)/(1 − β1), and v ← β2·v + (1 − β2)·ĝ² after the step
(used from the next one, also as their exchange divisor √v+ε: replicated, so it costs no bytes). With
v frozen, the tensors without a trust ratio step η·m/√v_frozen, ~2x LAMB's in the seq-32 study once
their gradients outgrow the variance frozen before attention learned.

`variance_refresh=K` (K ≥ 2; 0: off) keeps the other tensors' variance learning too: every K-th
compression step (steps F+K, F+2K, … after the freeze at F) averages the gradients exactly, as a warmup
step does (`needs_gradient_allreduce` is True for it, so the trainer allreduces them), and
- the momentum takes the exact average, m ← β1·m + (1−β1)·ḡ (ḡ the average of the pre-normalized local
  gradients, the compression stage's units); the error-feedback buffers are kept for the next exchange;
- v ← β2^K·v + (1−β2^K)·ḡ² for every tensor whose variance is not live already: one sample stands for
  the K steps between refreshes, so v keeps the EMA's time scale (1/(1−β2) steps) with ~(2−w)/w samples
  in it (w = 1−β2^K: 31 at K = 64 against ~2,000 for the dense EMA); the exchange divisors follow;
- the step is the compression stage's own (live trust ratio) on that momentum.
It costs one full-precision gradient allreduce per K steps (the trainer counts its bytes as a warmup
step's). `refresh_from="local"` takes the K steps' gradients instead of one: every worker adds its own
(pre-normalized) g_w² into a local buffer at every compression step (no bytes), and every K-th step the
buffers' mean over workers (one exact fp32 allreduce, `pretrain.comm.exact`, summed in worker order)
divided by K replaces the one-step sample, on the tensors with weight decay only. That estimate has K
times the samples, but a worker's gradient carries n times the averaged gradient's noise (E[g_w²] =
μ² + n·σ²/B against μ² + σ²/B): a uniform factor is cancelled by the trust ratio, which the tensors
without weight decay do not have (they keep the frozen or live variance), and what remains is the shift
between elements whose gradients are signal and those that are noise.

`refresh_from="factored"` reduces those squares to each decayed matrix's row and column sums (~0.1% of the
elements on the wire) and sets v to the frozen v times (row sum / its value at the first refresh) × (column
sum / its value at the first refresh), normalised by the total (a rank-1 model of how v moved). Measured
(seq-32 study, 2 ranks; results/cpu-study/README.md): with v frozen at the freeze the run ends 1.024× LAMB's
final MLM loss (3 seeds); `local` at K = 64 1.003× (3 seeds) for one fp32 allreduce per 64 steps (BERT-
Large's compression stage then 10.5× below fp16 instead of 15.55×: over the byte budget, so off by default);
`exact` at K = 64 1.033× (seed 1: its one-step samples are too few), at K = 16 1.013×; `factored` at K = 64
1.029× (seed 1: the product of row and column ratios over-amplifies elements whose row and column both
grew).

`refresh_from="blocks"` is `local` at the resolution of blocks of `refresh_block` consecutive elements of
each decayed tensor, to fit the byte budget: the workers' block sums of Σ g_w² are averaged exactly with
bfloat16 on the wire (N/`refresh_block` values per K steps), and within a block v keeps its shape and is
rescaled, v ← v·(β2^K + (1−β2^K)·M_b/V_b), M_b the block's mean square per element and step and V_b its
mean of v (a block whose v is all zero takes M_b). At `refresh_block=128`, K = 64 BERT-Large's compression
stage stays 15.5× below fp16. Measured 1.014× (seed 1; `local` 1.005, frozen 1.018 on that seed): a block of
128 is a whole row of the study's model, and within a row the columns' variance moves apart after the freeze.

`refresh_from="rank1"` sends `factored`'s row and column sums (~0.1% of the elements) but rebuilds the
window's mean squares from them, r·cᵀ/Σr (Adafactor's estimator of a non-negative matrix from its
marginals), and folds that into v as `local` folds the squares: v ← β2^K·v + (1−β2^K)·r·cᵀ/Σr, decayed
matrices only; no reference window, so nothing is counted twice. Measured 1.004× LAMB at K = 64 (3 seeds,
2 ranks; `local` 1.003×) with BERT-Large's compression stage at 15.54× below fp16: the project's default.

Defaults: this class's arguments are DeepSpeed's algorithm (spec §3: one scale per buffer, RMS sign scale,
frozen c̄·f, DeepSpeed's warmup), the parity mode. The project's config (`conf/optim/onebit_lamb.yaml`,
`OnebitLambConfig`) defaults to the remedy instead — `compression=per_column`, `precondition=True`,
`sign_scale=mean_abs`, `trust_ratio=live`, `exact_vectors=True` with `scale_dtype=bfloat16`, `warmup=nvlamb`,
`live_vector_variance=True`, `variance_refresh=64` with `refresh_from="rank1"` — because the CPU study
(results/cpu-study/) measured DeepSpeed's algorithm losing to LAMB and diverging on some seeds where the
remedy did not (spec §3.8 has the mechanism); at seq 32, where LAMB learns context, the remedy with a frozen
variance ends 2.4% above LAMB's final MLM loss (3 seeds; 10.2% with DeepSpeed's warmup rule), with the rank-1
variance refresh 0.4%.

Per-parameter state: step count lives in the param groups; `exp_avg` (view into the flat buffer),
`exp_avg_sq`, `lamb_coeff_freeze` (c̄), `lamb_coeff_updates` (k), `last_factor`, from step freeze_step
`exp_avg_sq_fresh` (v_f), from the first compression step `scaling_coeff` (κ); with
`refresh_from="factored"`, from the first refresh, `exp_avg_sq_base`, `refresh_rows`, `refresh_cols` and
their `_ref` values; `master_param` for bf16/fp16 parameters. Scalars are 0-dim fp32 tensors on the
parameter's device. Rank-local (checkpointed per rank): the `local`/`blocks`/`factored`/`rank1` refresh sums.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from pretrain.comm.compressed_allreduce import ScaleDtype, SignScale
from pretrain.comm.exact import worker_order_mean
from pretrain.comm.kernels import MomentumSource
from pretrain.optim import compiled, lamb_loops
from pretrain.optim import functional as F
from pretrain.optim.base import global_grad_norm
from pretrain.optim.live_step import live_trust_ratio_step_, local_momentum_
from pretrain.optim.marginals import add_square_marginals_many
from pretrain.optim.onebit import Compression, ExchangeOptions, OnebitOptimizer, Stage

logger = logging.getLogger(__name__)


class Warmup(str, enum.Enum):
    """The warmup's LAMB, and the rules the compression stage keeps from it (module docstring)."""

    deepspeed = "deepspeed"  # DeepSpeed's LAMB: no bias correction, clamped trust ratio on every tensor
    nvlamb = "nvlamb"  # `Lamb(variant="nvlamb")`: pre-normalized gradients, bias correction, ratio on decayed


class RefreshFrom(str, enum.Enum):
    """What a variance refresh folds into v (module docstring)."""

    exact = "exact"  # the K-th step's exactly averaged gradient (the trainer allreduces it), one sample
    local = "local"  # every worker's own squared gradients summed over the K steps, averaged over workers
    factored = "factored"  # the same reduced to each matrix's row and column sums: v_frozen rescaled by them
    blocks = "blocks"  # the same reduced to sums over blocks of consecutive elements: v rescaled per block
    rank1 = "rank1"  # the row and column sums again, the squares rebuilt from them as r·cᵀ/Σr (Adafactor)


class TrustRatio(str, enum.Enum):
    """The compression stage's step coefficient (module docstring)."""

    frozen = "frozen"  # DeepSpeed: c̄ (EMA of the warmup's trust ratios) times the fresh-variance factor
    live = "live"  # LAMB's trust ratio ‖p‖/‖u‖ (capped at max_coeff), every step on the compressed momentum
    live_clamped = "live_clamped"  # the same, clamped to [min_coeff, max_coeff] as in the warmup


class OnebitLamb(OnebitOptimizer):
    """1-bit LAMB. Hyperparameters and defaults as DeepSpeed (spec §3.1).

    Args:
        params: parameters or groups; a group may carry `exp_avg_mask`, a 0/1 tensor broadcastable to
            each of its parameters, multiplied into the momentum after every compressed exchange.
        lr, betas, eps, weight_decay: as in LAMB (ε outside the root, decoupled decay).
        freeze_step: number of warmup steps (≥ 1); compression from step freeze_step + 1.
        min_coeff, max_coeff: clamp of the warmup trust ratio.
        coeff_beta: EMA factor of c̄; DeepSpeed advises 1/(1 − coeff_beta) ≤ freeze_step.
        factor_min, factor_max, factor_threshold: the compression-stage factor rule (§3.5j).
        group: data-parallel process group (None: the default group, or a world of one without
            torch.distributed).
        compression, exact_vectors, sign_scale, virtual_workers, block_size, precondition, local_momentum,
            vector_block, scale_dtype:
            the momentum exchange (`pretrain.optim.onebit`); the defaults are DeepSpeed's algorithm on real
            ranks. `local_momentum` needs a live trust ratio.
        coeff_bias_correction: freeze the bias-corrected c̄ (module docstring).
        warmup: `deepspeed` (DeepSpeed's LAMB, the parity mode) or `nvlamb` (module docstring).
        max_grad_norm: `warmup="nvlamb"`: the global gradient pre-normalization threshold (0 disables).
        live_vector_variance: keep the 1-D tensors' variance live (module docstring); with
            `exact_vectors` only (without it they are not averaged exactly and this does nothing).
        variance_refresh: K ≥ 2: every K-th compression step averages gradients exactly and refreshes
            the variance (module docstring); 0: off. Needs a live trust ratio and no `local_momentum`.
        refresh_from: `exact` (the K-th step's averaged gradient), `local` (the workers' own squared
            gradients over the K steps), `factored`, `blocks` or `rank1` (module docstring).
        refresh_block: `refresh_from="blocks"`: elements per block (≥ 2).
        trust_ratio: `frozen` (DeepSpeed: c̄·f), `live` or `live_clamped` (module docstring).
        compile: run the warmup and compression steps as `torch.compile`d passes
            (`pretrain.optim.compiled`; the first steps compile, about 10–30 s on CPU). Needs a live trust
            ratio, `precondition`, one worker per process and no `local_momentum`. Same math; results
            agree with the eager steps to float rounding, not bitwise.
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
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
        group: Any = None,
        compression: Compression | str = Compression.deepspeed,
        exact_vectors: bool = False,
        sign_scale: SignScale | str = SignScale.rms,
        virtual_workers: int = 1,
        block_size: int = 2048,
        precondition: bool = False,
        local_momentum: bool = False,
        vector_block: int = 0,
        scale_dtype: ScaleDtype | str = ScaleDtype.float32,
        coeff_bias_correction: bool = False,
        trust_ratio: TrustRatio | str = TrustRatio.frozen,
        warmup: Warmup | str = Warmup.deepspeed,
        max_grad_norm: float = 1.0,
        live_vector_variance: bool = False,
        variance_refresh: int = 0,
        refresh_from: RefreshFrom | str = RefreshFrom.exact,
        refresh_block: int = 128,
        compile: bool = False,
    ) -> None:
        if not 0.0 <= min_coeff <= max_coeff or not 0.0 < factor_min <= factor_max:
            raise ValueError("OnebitLamb needs 0 <= min_coeff <= max_coeff and 0 < factor_min <= factor_max")
        if local_momentum and TrustRatio(trust_ratio) is TrustRatio.frozen:
            raise ValueError("OnebitLamb: local_momentum needs trust_ratio='live' or 'live_clamped'")
        if Warmup(warmup) is Warmup.nvlamb and TrustRatio(trust_ratio) is TrustRatio.frozen:
            raise ValueError("OnebitLamb: warmup='nvlamb' needs trust_ratio='live' or 'live_clamped'")
        if max_grad_norm < 0:
            raise ValueError(f"OnebitLamb: max_grad_norm must be >= 0, got {max_grad_norm}")
        if variance_refresh < 0 or variance_refresh == 1:
            raise ValueError(f"OnebitLamb: variance_refresh must be 0 (off) or >= 2, got {variance_refresh}")
        if variance_refresh and (TrustRatio(trust_ratio) is TrustRatio.frozen or local_momentum):
            raise ValueError("OnebitLamb: variance_refresh needs a live trust_ratio and no local_momentum")
        if refresh_block < 2:
            raise ValueError(f"OnebitLamb: refresh_block must be >= 2, got {refresh_block}")
        if 1.0 / (1.0 - coeff_beta) > freeze_step:
            logger.warning("OnebitLamb: 1/(1 - coeff_beta) > freeze_step, the coefficient EMA is still young")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        exchange = ExchangeOptions(
            Compression(compression),
            exact_vectors,
            SignScale(sign_scale),
            virtual_workers,
            block_size,
            precondition,
            local_momentum,
            vector_block,
            ScaleDtype(scale_dtype),
        )
        if compile:
            reason = compiled.unsupported_reason(
                trust_ratio_live=TrustRatio(trust_ratio) is not TrustRatio.frozen,
                precondition=precondition,
                virtual_workers=virtual_workers,
                local_momentum=local_momentum,
            )
            if reason is not None:
                raise ValueError(f"OnebitLamb(compile=True) {reason}")
        super().__init__(params, defaults, freeze_step=freeze_step, group=group, exchange=exchange)
        self.compile = compile
        self._compiled_warmup = compiled.CompiledWarmupStep() if compile else None
        self._compiled_compression = compiled.CompiledCompressionStep() if compile else None
        self.min_coeff, self.max_coeff, self.coeff_beta = min_coeff, max_coeff, coeff_beta
        self.coeff_bias_correction = coeff_bias_correction
        self.trust_ratio = TrustRatio(trust_ratio)
        self.warmup, self.max_grad_norm = Warmup(warmup), max_grad_norm
        self.live_vector_variance = live_vector_variance
        self.variance_refresh = variance_refresh
        self.refresh_from = RefreshFrom(refresh_from)
        self.refresh_block = refresh_block
        # refresh_from local / blocks / factored: Σ g_w² (or row and column sums) per worker since the last
        # refresh
        self._square_sums: Tensor | None = None
        self._factored: list[int] | None = None  # `_factored_positions`, once computed
        self._last_live_coeffs: dict[int, Any] = {}  # `live`: the last step's coefficients, per group
        self.factor_min, self.factor_max, self.factor_threshold = factor_min, factor_max, factor_threshold

    def _segment_groups(self) -> list[list[Tensor]]:
        return [[p for group in self.param_groups for p in group["params"]]]

    def _init_param_state(self, param: Tensor) -> None:
        self.state[param].update(
            exp_avg_sq=torch.zeros_like(param, dtype=torch.float32),
            lamb_coeff_freeze=torch.zeros((), dtype=torch.float32, device=param.device),
            lamb_coeff_updates=torch.zeros((), dtype=torch.float32, device=param.device),
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
            counts = self._coeff_update_counts(params)
            torch._foreach_add_(counts, list((coeffs != 1.0).float().unbind()))

    def _warmup_grad_scale(self, grads: list[Tensor]) -> float:
        """nvlamb: the pre-normalization 1/max(1, G/max_grad_norm) of this step (G over all tensors, one
        host sync, as `Lamb`), folded into every group's β2-EMA of it (`grad_scale_ema`); else 1."""
        if self.warmup is not Warmup.nvlamb or self.max_grad_norm <= 0:
            return 1.0
        norm = self._grad_norm if self._grad_norm is not None else global_grad_norm(grads)
        scale = 1.0 / max(1.0, float(norm) / self.max_grad_norm)
        for group in self.param_groups:
            beta2 = group["betas"][1]
            group["grad_scale_ema"] = beta2 * group.get("grad_scale_ema", 0.0) + (1.0 - beta2) * scale
        return scale

    def _warmup_hyper(self, group: dict[str, Any], grad_scale: float) -> dict[str, Any]:
        hyper = self._hyper(group)
        if self.warmup is Warmup.nvlamb:
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
        """LAMB's eager step (`Lamb._eager_update`): the numba loops on CPU, else the foreach functions."""
        nvlamb = self.warmup is Warmup.nvlamb
        if lamb_loops.usable(*tensors):
            clamp: dict[str, Any] = {} if nvlamb else dict(min_coeff=self.min_coeff, max_coeff=self.max_coeff)
            return lamb_loops.lamb_step_(*tensors, nvlamb=nvlamb, **clamp, **hyper)
        if nvlamb:
            return self._chunked(F.nvlamb_update_, tensors, (), **hyper)
        extra = dict(min_coeff=self.min_coeff, max_coeff=self.max_coeff)
        coeffs = self._chunked(F.deepspeed_lamb_update_, tensors, (), **extra, **hyper)
        assert coeffs is not None
        return coeffs

    def _compiled_warmup_group(self, hyper: dict[str, Any], tensors: list[list[Tensor]]) -> Tensor | None:
        """Compiled kernels for the large tensors, the eager foreach step for the small ones (one
        compiled call costs more than their whole update: `compiled.COMPILED_MIN_NUMEL`)."""
        assert self._compiled_warmup is not None
        params = tensors[0]
        clamp_ratio = self.warmup is Warmup.deepspeed
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
        if self.warmup is Warmup.nvlamb:
            self._correct_moments()
        super()._freeze()
        self._square_sums = None
        self._drop_factored_state()
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
        if self.warmup is not Warmup.nvlamb:
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

    def _live_variance_positions(self, segment: Any) -> list[int]:
        if not (self.live_vector_variance and self.exchange.exact_vectors):
            return []
        return [i for i, p in enumerate(segment.params) if p.dim() <= 1]

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

    def _ratio_bounds(self, group: dict[str, Any]) -> tuple[float, float]:
        """The compression stage's clamp of the live ratio: [1, 1] (no ratio) for an nvlamb group
        without weight decay."""
        if self.warmup is Warmup.nvlamb and group["weight_decay"] == 0.0:
            return 1.0, 1.0
        min_coeff = self.min_coeff if self.trust_ratio is TrustRatio.live_clamped else 0.0
        return min_coeff, self.max_coeff

    def _coeff_update_counts(self, params: list[Tensor]) -> list[Tensor]:
        for p in params:  # state saved before the count existed: the EMA is taken as fully warmed up
            self.state[p].setdefault("lamb_coeff_updates", torch.full((), 1e9, device=p.device))
        return self._states(params, "lamb_coeff_updates")

    def _refresh_next(self) -> bool:
        """`variance_refresh`: the next step is the K-th compression step since the freeze."""
        refresh, frozen_at = self.variance_refresh, self.frozen_at
        if not refresh or frozen_at is None or self.stage is not Stage.compression:
            return False
        return (self.step_count + 1 - frozen_at) % refresh == 0

    def _exact_step_next(self) -> bool:
        return self.refresh_from is RefreshFrom.exact and self._refresh_next()

    def _compression_step(self, grads: list[Tensor]) -> None:
        (segment,) = self._segments or []
        refresh_now = self._refresh_next()  # read before the step, as the trainer did
        refresh = refresh_now and self.refresh_from is RefreshFrom.exact
        # the frozen pre-normalization factor: multiplied into the gradients in a pass of their own, or
        # where nothing else reads them scaled, into the passes that read them anyway (the marginals'
        # loop and the local momentum's: the same fp32 products, so the same bits)
        deferred = self._defers_grad_scale(segment, refresh)
        if not deferred:
            self._scale_gradients(None if refresh else segment.local, grads)
        grad_scale = self._compression_grad_scale() if deferred else 1.0
        live = self._live_variance_positions(segment)
        marginals = None
        if self.variance_refresh and self.refresh_from in (RefreshFrom.local, RefreshFrom.blocks):
            self._accumulate_squares(segment, grads)
            if refresh_now and self.refresh_from is RefreshFrom.local:
                self._refresh_from_squares(segment, live)
            elif refresh_now:
                self._refresh_from_blocks(segment, live)
        elif self.variance_refresh and self.refresh_from in (RefreshFrom.factored, RefreshFrom.rank1):
            if not refresh_now and segment.local is None:  # added where the local momentum is formed
                marginals = self._marginal_targets(segment)
            else:
                self._accumulate_marginals(segment, grads, grad_scale)
            if refresh_now and self.refresh_from is RefreshFrom.factored:
                self._refresh_factored(segment)
            elif refresh_now:
                self._refresh_rank1(segment)
        # m̂ₜ₋₁ of the exactly averaged tensors: copies (×1 is exact) in one multi-tensor op
        previous = list(torch._foreach_mul([segment.views[i] for i in live], 1.0)) if live else []
        if refresh:
            self._refresh_update(segment, grads, live)
        else:
            self._compression_update(segment, grads, grad_scale, marginals)
        self._update_live_variance(segment, live, previous)

    def _defers_grad_scale(self, segment: Any, refresh: bool) -> bool:
        """Whether this compression step's gradients reach only passes that take the nvlamb factor
        themselves: one worker per process, the eager step, neither an exact refresh nor the local squares
        (`_accumulate_squares`) reading them."""
        squares = self.variance_refresh and self.refresh_from in (RefreshFrom.local, RefreshFrom.blocks)
        probing = self.probe is not None and self.probe.active
        return (
            self._compression_grad_scale() != 1.0
            and segment.local is None
            and not refresh
            and not squares
            and (self._compiled_compression is None or probing)
        )

    def _refresh_targets(self, live: list[int], decayed_only: bool) -> list[tuple[dict[str, Any], int]]:
        """(group, segment position) of each tensor a refresh folds into v: not live already and, with
        ``decayed_only`` (the workers' own squares: no trust ratio to cancel their extra noise otherwise),
        with weight decay."""
        skip = set(live)
        return [
            (group, i)
            for group, span in self._group_slices()
            if not (decayed_only and group["weight_decay"] == 0.0)
            for i in range(span.start, span.stop)
            if i not in skip
        ]

    @staticmethod
    def _set_divisor(divisors: list[Tensor] | None, i: int, exp_avg_sq: Tensor, eps: float) -> None:
        """The preconditioned exchange's divisor of tensor ``i`` follows its refreshed v: √v + ε."""
        if divisors is not None:
            torch.sqrt(exp_avg_sq, out=divisors[i]).add_(eps)

    def _accumulate_squares(self, segment: Any, grads: list[Tensor]) -> None:
        """refresh_from=local: Σ g_w² += g_w² for each of this process's workers (its own gradients)."""
        if self._square_sums is None:
            shape = segment.local.shape if segment.local is not None else segment.buffer.shape
            self._square_sums = torch.zeros(shape, dtype=torch.float32, device=segment.buffer.device)
        if segment.local is not None:  # the rows' tail is the momentum pad after an exchange: not a gradient
            numel = segment.buffer.numel() - segment.pad.numel()
            own = segment.local[:, :numel]
            self._square_sums[:, :numel].addcmul_(own, own)
        else:
            torch._foreach_addcmul_(segment.views_of(self._square_sums), grads, grads)

    def _refresh_from_squares(self, segment: Any, live: list[int]) -> None:
        """refresh_from=local: v ← β2^K·v + (1−β2^K)·mean_w(Σ g_w²)/K on the tensors with weight decay
        (not live already); the divisors follow and the sums restart."""
        sums = self._square_sums
        assert sums is not None
        rows = sums if sums.dim() == 2 else sums.unsqueeze(0)
        mean = worker_order_mean(rows, self.group, self.num_processes, self.traffic)
        views = segment.views_of(mean.div_(self.variance_refresh))
        for group, i in self._refresh_targets(live, decayed_only=True):
            weight = 1.0 - group["betas"][1] ** self.variance_refresh
            exp_avg_sq = self.state[segment.params[i]]["exp_avg_sq"]
            exp_avg_sq.mul_(1.0 - weight).add_(views[i], alpha=weight)
            self._set_divisor(segment.divisors, i, exp_avg_sq, group["eps"])
        sums.zero_()

    def _refresh_from_blocks(self, segment: Any, live: list[int]) -> None:
        """refresh_from=blocks (module docstring): the workers' block sums of their Σ g_w² averaged exactly in
        bfloat16, then v of each decayed tensor (not live) rescaled block by block; the sums restart."""
        sums = self._square_sums
        assert sums is not None
        rows = sums if sums.dim() == 2 else sums.unsqueeze(0)
        block = self.refresh_block
        refreshed = self._refresh_targets(live, decayed_only=True)
        per_worker = []
        for row in rows:
            views = segment.views_of(row)
            per_worker.append(torch.cat([_block_sums(views[i], block) for _, i in refreshed]))
        stacked = torch.stack(per_worker)
        stacked = torch.nn.functional.pad(stacked, (0, -stacked.shape[1] % self.num_processes))
        mean = worker_order_mean(stacked, self.group, self.num_processes, self.traffic, torch.bfloat16)
        mean.div_(self.variance_refresh)
        start = 0
        for group, i in refreshed:
            exp_avg_sq = self.state[segment.params[i]]["exp_avg_sq"]
            numel = exp_avg_sq.numel()
            observed = mean[start : start + -(-numel // block)]
            start += observed.numel()
            current = _block_sums(exp_avg_sq, block)
            weight = 1.0 - group["betas"][1] ** self.variance_refresh
            factor = _ratio(observed, current).mul_(weight).add_(1.0 - weight)
            counts = torch.full_like(observed, float(block))
            counts[-1] = numel - block * (observed.numel() - 1)
            empty = torch.where(current > 0, 0.0, observed * weight / counts)  # a zero block takes M_b
            shape = exp_avg_sq.shape  # blocks of the flattened tensor, in index order (any memory order)
            exp_avg_sq.mul_(factor.repeat_interleave(block)[:numel].view(shape))
            exp_avg_sq.add_(empty.repeat_interleave(block)[:numel].view(shape))
            self._set_divisor(segment.divisors, i, exp_avg_sq, group["eps"])
        sums.zero_()

    def _factored_positions(self, segment: Any) -> list[int]:
        """refresh_from=factored/rank1: the matrices with weight decay, in segment order (computed once: the
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
        """refresh_from=factored: each worker adds the row and column sums of its own g² (no bytes); g =
        `grad_scale`·grads (1 where `grads` hold the scaled gradients already)."""
        positions = self._factored_positions(segment)
        for worker, sums in enumerate(self._square_sums_of(segment)):
            own = grads if segment.local is None else segment.views_of(segment.local[worker])
            matrices = [own[i] for i in positions]
            add_square_marginals_many(
                matrices, self._marginal_views(sums, segment), self.workspace, grad_scale
            )

    def _refresh_factored(self, segment: Any) -> None:
        """refresh_from=factored: the row and column sums' mean over workers and the K steps enter β2^K-EMAs;
        v ← v_base·(r/r₀)ᵢ·(c/c₀)ⱼ·(Σr₀/Σr), with v_base the variance frozen at the freeze and r₀, c₀ the
        first refresh's sums (the same estimator, so the workers' extra noise cancels in the ratios)."""
        assert self._square_sums is not None
        mean = worker_order_mean(self._square_sums, self.group, self.num_processes, self.traffic)
        mean.div_(self.variance_refresh)
        betas = {id(p): group["betas"][1] for group in self.param_groups for p in group["params"]}
        eps = {id(p): group["eps"] for group in self.param_groups for p in group["params"]}
        divisors = segment.divisors
        for i, (rows, cols) in zip(self._factored_positions(segment), self._marginal_views(mean, segment)):
            param = segment.params[i]
            state = self.state[param]
            if "refresh_rows" not in state:  # the first refresh since the freeze: the reference
                state["exp_avg_sq_base"] = state["exp_avg_sq"].clone()
                state["refresh_rows_ref"], state["refresh_cols_ref"] = rows.clone(), cols.clone()
                state["refresh_rows"], state["refresh_cols"] = rows.clone(), cols.clone()
            else:
                weight = 1.0 - betas[id(param)] ** self.variance_refresh
                state["refresh_rows"].mul_(1.0 - weight).add_(rows, alpha=weight)
                state["refresh_cols"].mul_(1.0 - weight).add_(cols, alpha=weight)
            row_factor = _ratio(state["refresh_rows"], state["refresh_rows_ref"])
            col_factor = _ratio(state["refresh_cols"], state["refresh_cols_ref"])
            total = _ratio(state["refresh_rows_ref"].sum(), state["refresh_rows"].sum())
            exp_avg_sq = state["exp_avg_sq"]
            torch.mul(state["exp_avg_sq_base"], row_factor.mul_(total).unsqueeze(1), out=exp_avg_sq)
            exp_avg_sq.mul_(col_factor.unsqueeze(0))
            self._set_divisor(divisors, i, exp_avg_sq, eps[id(param)])
        self._square_sums.zero_()

    def _refresh_rank1(self, segment: Any) -> None:
        """refresh_from=rank1 (module docstring): the workers' row and column sums of Σ g_w² averaged exactly;
        each decayed matrix's mean square over the K steps rebuilt as r·cᵀ/Σr and folded into v as `local`
        folds the squares themselves, v ← β2^K·v + (1−β2^K)·r·cᵀ/Σr; the sums restart."""
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

    def _refresh_update(self, segment: Any, grads: list[Tensor], live: list[int]) -> None:
        """`variance_refresh` (module docstring): on exactly averaged gradients, m ← β1·m + (1−β1)·ḡ,
        v ← β2^K·v + (1−β2^K)·ḡ² where v is not live already (divisors follow), then the live-ratio step."""
        for group, span in self._group_slices():
            F.local_momentum_(segment.views[span], grads[span], beta1=group["betas"][0])
        for group, i in self._refresh_targets(live, decayed_only=False):
            weight = 1.0 - group["betas"][1] ** self.variance_refresh
            exp_avg_sq = self.state[segment.params[i]]["exp_avg_sq"]
            exp_avg_sq.mul_(1.0 - weight).addcmul_(grads[i], grads[i], value=weight)
            self._set_divisor(segment.divisors, i, exp_avg_sq, group["eps"])
        self._apply_masks()
        for group, span in self._group_slices():
            self._compressed_update(group, segment.views[span])

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
        prev_exp_avgs = segment.snapshot() if self.trust_ratio is TrustRatio.frozen else segment.views
        kappas = None
        if self.exchange.compression is Compression.deepspeed:
            kappas = self._scaling_coefficients(segment.params)
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
            momenta = self.momentum_views(segment)
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
        averages = self._fused_exchange(segment, kappas) and self.trust_ratio is not TrustRatio.frozen
        source = prepared if isinstance(prepared, MomentumSource) else None
        divided = prepared is not False
        self._exchange(segment, kappas, beta1=beta1, divided=divided, scale_back=not averages, source=source)
        self._apply_masks()  # a 0/1 mask: the same bits on ū as on m = ū·(√v+ε)
        divisors = segment.divisors  # √v+ε, kept in step with v (built by the preconditioned exchange)
        for group, span in self._group_slices():
            group_divisors = None if divisors is None else divisors[span]
            self._compressed_update(group, prev_exp_avgs[span], group_divisors, averages=averages)

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
            min_coeff, max_coeff = self._ratio_bounds(group)
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

    def _compressed_update(
        self,
        group: dict[str, Any],
        prev_exp_avgs: list[Tensor],
        divisors: list[Tensor] | None = None,
        *,
        averages: bool = False,
    ) -> None:
        """`divisors`: the group's √v+ε where the exchange keeps them (the live step then skips the root).
        `averages`: the momenta still hold the exchange's ū = m/(√v+ε) (`_exchange(scale_back=False)`);
        the live step forms m = ū·(√v+ε) and stores it."""
        params = group["params"]
        if self.trust_ratio is not TrustRatio.frozen:
            exp_avgs = self._states(params, "exp_avg")
            tensors = [[self._fp32_param(p) for p in params], exp_avgs]
            tensors.append(self._states(params, "exp_avg_sq") if divisors is None else divisors)
            hyper = self._hyper(group)
            min_coeff, max_coeff = self._ratio_bounds(group)
            options = dict(
                lr=hyper["lr"],
                eps=hyper["eps"],
                weight_decay=hyper["weight_decay"],
                min_coeff=min_coeff,
                max_coeff=max_coeff,
                rooted=divisors is not None,
            )
            # numba on CPU (None: not usable here, nothing changed)
            coeffs = live_trust_ratio_step_(*tensors, **options, averages=averages)
            if coeffs is None:
                if averages:  # the pass `_exchange` left out, with its arithmetic
                    assert divisors is not None
                    torch._foreach_mul_(exp_avgs, divisors)
                coeffs = self._chunked(F.clamped_trust_ratio_step_, tensors, (), **options)
            self._last_live_coeffs[id(group)] = coeffs
            return
        tensors = [[self._fp32_param(p) for p in params], self._states(params, "exp_avg"), prev_exp_avgs]
        tensors += [self._states(params, "exp_avg_sq"), self._states(params, "exp_avg_sq_fresh")]
        last_factors = self._states(params, "last_factor")
        coeffs = torch.stack(self._states(params, "lamb_coeff_freeze"))
        if self.coeff_bias_correction:
            counts = torch.stack(self._coeff_update_counts(params))
            coeffs = coeffs / (1.0 - torch.pow(self.coeff_beta, counts)).clamp(min=1e-12)
        scalars = (coeffs, torch.stack(last_factors))
        factor_rule = dict(
            factor_min=self.factor_min, factor_max=self.factor_max, factor_threshold=self.factor_threshold
        )
        factors = self._chunked(
            F.compressed_lamb_update_, tensors, scalars, **factor_rule, **self._hyper(group)
        )
        torch._foreach_copy_(last_factors, list(factors.unbind()))  # type: ignore[union-attr]

    def _drop_factored_state(self) -> None:
        """A new compression stage starts its factored refresh from its own frozen variance."""
        for p in self._segment_groups()[0]:
            for key in (
                "exp_avg_sq_base",
                "refresh_rows",
                "refresh_cols",
                "refresh_rows_ref",
                "refresh_cols_ref",
            ):
                self.state[p].pop(key, None)

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
        self._drop_factored_state()

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


def _block_sums(values: Tensor, block: int) -> Tensor:
    """Sums over consecutive blocks of `block` elements of the flattened `values` (the last one shorter)."""
    flat = values.reshape(-1)
    return torch.nn.functional.pad(flat, (0, -flat.numel() % block)).view(-1, block).sum(1)


def _ratio(numerator: Tensor, denominator: Tensor) -> Tensor:
    """numerator / denominator, 1 where the denominator is 0 (a row or column that had no gradient)."""
    return torch.where(denominator > 0, numerator / denominator.clamp(min=1e-30), torch.ones_like(numerator))
