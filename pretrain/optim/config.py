"""Typed optimizer configs, one dataclass per registry entry (`pretrain.optim.OPTIMIZERS`), which
registers each as `<name>_schema` in Hydra's ConfigStore, group `optim`.

`conf/optim/<name>.yaml` starts with `defaults: [<name>_schema, _self_]`, so a misspelt key fails at
composition; `__post_init__` range checks raise ValueError naming the key (`optim.<key>`). Defaults are
the spec's library defaults (§1.3, §3.1, §4) except weight_decay = 0.01 (BERT, §1.5; DeepSpeed's 1-bit
default is 0), which `param_groups` applies to all but biases and LayerNorm.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, fields
from typing import Any

from pretrain.comm.compressed_allreduce import ScaleDtype, SignScale
from pretrain.optim import compiled
from pretrain.optim.lamb import LambVariant
from pretrain.optim.onebit import Compression
from pretrain.optim.onebit_lamb import RefreshFrom, TrustRatio, Warmup

logger = logging.getLogger(__name__)


def _require(condition: bool, key: str, requirement: str) -> None:
    if not condition:
        raise ValueError(f"optim.{key} {requirement}")


class GradAllreduce(str, enum.Enum):
    """The dtype the gradients are averaged in (LAMB, AdamW and the 1-bit warmup stage). float32: exact.
    bfloat16 / float16: DDP's compression hooks (each bucket cast, divided by n, allreduced, cast back):
    half the bytes, what GPU users run LAMB with and NVIDIA and DeepSpeed compare 1-bit against."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"

    @property
    def bytes(self) -> int:
        return 4 if self is GradAllreduce.float32 else 2


@dataclass
class OptimizerConfig:
    name: str = ""
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.01
    grad_allreduce: GradAllreduce = GradAllreduce.float32  # not an optimizer argument: the trainer's hook

    def __post_init__(self) -> None:
        _require(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        _require(0.0 <= self.beta1 < 1.0, "beta1", f"must be in [0, 1), got {self.beta1}")
        _require(0.0 <= self.beta2 < 1.0, "beta2", f"must be in [0, 1), got {self.beta2}")
        _require(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")

    def _check_name(self, expected: str) -> None:
        _require(
            self.name == expected,
            "name",
            f"must be '{expected}' for {type(self).__name__}, got '{self.name}'",
        )

    def optimizer_kwargs(self) -> dict[str, Any]:
        """Constructor keyword arguments (besides params and the process group)."""
        return {"lr": self.lr, "betas": (self.beta1, self.beta2), "weight_decay": self.weight_decay}

    def options(self) -> dict[str, str]:
        """Every key as text (enums by value): what a checkpoint records of the optimizer's options."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: str(v.value if isinstance(v, enum.Enum) else v) for k, v in values.items()}

    def changed_options(self, saved: dict[str, str] | None) -> list[str]:
        """'key saved -> now' for every option that differs from a checkpoint's `options()` (none saved:
        nothing to compare)."""
        now = self.options()
        return [f"{k} {saved[k]} -> {now[k]}" for k in now if saved and k in saved and saved[k] != now[k]]


@dataclass
class LambConfig(OptimizerConfig):
    name: str = "lamb"
    eps: float | None = None  # None: variant default (nvlamb 1e-6, deepspeed 1e-8)
    variant: LambVariant = LambVariant.nvlamb
    bias_correction: bool = True
    max_grad_norm: float | None = None  # None: variant default (nvlamb 1.0, deepspeed 0 = off)
    min_coeff: float = 0.01  # deepspeed variant only
    max_coeff: float = 10.0  # deepspeed variant only
    compile: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_name("lamb")
        _require(self.eps is None or self.eps > 0, "eps", f"must be > 0 or null, got {self.eps}")
        _require(
            self.max_grad_norm is None or self.max_grad_norm >= 0,
            "max_grad_norm",
            f"must be >= 0 (0 = off) or null, got {self.max_grad_norm}",
        )
        _require(
            0 <= self.min_coeff <= self.max_coeff, "min_coeff", "must satisfy 0 <= min_coeff <= max_coeff"
        )

    def optimizer_kwargs(self) -> dict[str, Any]:
        return {
            **super().optimizer_kwargs(),
            "eps": self.eps,
            "variant": self.variant,
            "bias_correction": self.bias_correction,
            "max_grad_norm": self.max_grad_norm,
            "min_coeff": self.min_coeff,
            "max_coeff": self.max_coeff,
            "compile": self.compile,
        }


@dataclass
class AdamWConfig(OptimizerConfig):
    name: str = "adamw"
    eps: float = 1e-8
    fused: bool | None = None  # None: fused when the parameters' device supports it

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_name("adamw")
        _require(self.eps > 0, "eps", f"must be > 0, got {self.eps}")

    def optimizer_kwargs(self) -> dict[str, Any]:
        return {**super().optimizer_kwargs(), "eps": self.eps, "fused": self.fused}


@dataclass
class _OnebitConfig(OptimizerConfig):
    freeze_step: int = 100000  # warmup steps; the tutorial advises 15-25% of the run
    eps: float | None = 1e-8  # None: the optimizer's default (1-bit LAMB: its warmup's)
    # Momentum mask for position-embedding rows >= max_seq_length (never trained): `param_groups(...,
    # max_seq_length=...)` builds it; 1-bit signs cannot encode the zero momentum of those rows.
    mask_unused_position_embeddings: bool = True
    # The momentum exchange (pretrain/optim/onebit.py): `deepspeed` = DeepSpeed's algorithm exactly;
    # per_tensor / per_row: one scale per tensor / also per embedding row; per_column: per_row and one per
    # input column of every other matrix. exact_vectors: 1-D tensors averaged exactly. sign_scale: rms
    # (DeepSpeed) or mean_abs.
    compression: Compression = Compression.deepspeed
    exact_vectors: bool = False
    sign_scale: SignScale = SignScale.rms
    block_size: int = 2048  # compression=per_block: elements per scale in tensors without row scales
    # per_row / per_block: also the MLM decoder bias with one scale per entry, i.e. exactly (4 B per
    # vocabulary entry per phase; bench/fidelity.py has the bytes for BERT-Large). results/cpu-study/README.md
    exact_output_bias: bool = False
    # exchange m/(√v+ε) (v frozen: the same divisor on every rank, no bytes) instead of m, so each sign
    # scale covers elements of like size in the step's own units (pretrain/optim/onebit.py)
    precondition: bool = False
    # every worker keeps its own momentum and steps on the compressed average (DeepSpeed replaces the
    # momentum by the average, so the compression error re-enters it); 1-bit LAMB: a live trust_ratio
    local_momentum: bool = False
    # > 0: the 1-D tensors (biases, LayerNorm) with one scale per vector_block elements (4/vector_block
    # bytes per element and phase on top of the sign bit); 0: one per tensor. results/cpu-study/README.md
    vector_block: int = 0
    # how the scales travel: float32 (DeepSpeed) or bfloat16 (rounded where computed, the error feedback takes
    # the rounding; half the scale bytes: pretrain/comm/compressed_allreduce.py ScaleDtype)
    scale_dtype: ScaleDtype = ScaleDtype.float32
    # (1-bit LAMB's config defaults to the remedy instead: OnebitLambConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.eps is None:
            self.eps = 1e-8
        _require(self.freeze_step >= 1, "freeze_step", f"must be >= 1, got {self.freeze_step}")
        _require(self.block_size >= 8, "block_size", f"must be >= 8, got {self.block_size}")
        _require(self.eps > 0, "eps", f"must be > 0, got {self.eps}")
        _require(
            self.vector_block >= 0,
            "vector_block",
            f"must be >= 0 (0: one scale per tensor), got {self.vector_block}",
        )

    def optimizer_kwargs(self) -> dict[str, Any]:
        return {
            **super().optimizer_kwargs(),
            "eps": self.eps,
            "freeze_step": self.freeze_step,
            "compression": Compression(self.compression),
            "exact_vectors": self.exact_vectors,
            "sign_scale": SignScale(self.sign_scale),
            "block_size": self.block_size,
            "precondition": self.precondition,
            "local_momentum": self.local_momentum,
            "vector_block": self.vector_block,
            "scale_dtype": ScaleDtype(self.scale_dtype),
        }

    @property
    def row_scales(self) -> bool:
        """Whether `param_groups` should put the embeddings in groups with per-row scales."""
        return Compression(self.compression).row_scales


@dataclass
class OnebitLambConfig(_OnebitConfig):
    name: str = "onebit_lamb"
    max_coeff: float = 10.0  # DeepSpeed BERT recipes use 0.3
    min_coeff: float = 0.01
    coeff_beta: float = 0.9
    factor_max: float = 4.0
    factor_min: float = 0.5
    factor_threshold: float = 0.1
    coeff_bias_correction: bool = False  # freeze c̄/(1 − coeff_beta^k) instead of DeepSpeed's c̄
    # the compression stage's coefficient: live (LAMB's trust ratio on the compressed momentum, every step),
    # live_clamped (also >= min_coeff) or frozen (DeepSpeed: c̄ x factor); pretrain/optim/onebit_lamb.py
    trust_ratio: TrustRatio = TrustRatio.live
    # the warmup's LAMB: deepspeed (DeepSpeed's: no bias correction, clamped ratio on every tensor) or nvlamb
    # (optim=lamb's exactly; the compression stage keeps its rules: pretrain/optim/onebit_lamb.py)
    warmup: Warmup = Warmup.nvlamb
    max_grad_norm: float = 1.0  # warmup=nvlamb: global gradient pre-normalization (0 disables)
    # the 1-D tensors' variance stays live after the freeze, from their exactly averaged momentum (no bytes;
    # with exact_vectors only, else it does nothing): pretrain/optim/onebit_lamb.py
    live_vector_variance: bool = True
    # K >= 2: every K-th compression step refreshes the variance of the matrices (the default rank1: from
    # the workers' row and column sums of g², one small exact allreduce per K steps); 0: v stays frozen
    # (DeepSpeed). pretrain/optim/onebit_lamb.py
    variance_refresh: int = 64
    # what a refresh folds into v: exact (the K-th step's averaged gradient), local (every worker's own
    # squared gradients over the K steps, averaged over workers by one exact allreduce; decayed tensors only)
    # or factored (those squares' row and column sums per decayed matrix, rescaling the frozen v) or
    # blocks (their sums over blocks of refresh_block consecutive elements, rescaling v block by block;
    # bf16 on the wire) or rank1 (the row and column sums rebuilt into r·cᵀ/Σr and folded into v)
    refresh_from: RefreshFrom = RefreshFrom.rank1
    refresh_block: int = 128
    eps: float | None = None  # None: the warmup's default (nvlamb 1e-6 as optim=lamb, deepspeed 1e-8)
    # The remedy is the default (results/cpu-study/: measured against LAMB and DeepSpeed's algorithm);
    # DeepSpeed's exactly: warmup=deepspeed live_vector_variance=false compression=deepspeed sign_scale=rms
    # trust_ratio=frozen precondition=false exact_vectors=false scale_dtype=float32 variance_refresh=0.
    compression: Compression = Compression.per_column
    sign_scale: SignScale = SignScale.mean_abs
    precondition: bool = True
    exact_vectors: bool = True  # the 1-D tensors exactly, affordable with bfloat16 scales (15.55x vs fp16)
    scale_dtype: ScaleDtype = ScaleDtype.bfloat16
    # torch.compile the warmup and compression steps (pretrain/optim/compiled.py): a live trust_ratio,
    # precondition, no local_momentum and sim_world_size=1 (checked in pretrain/config.py)
    compile: bool = False

    def __post_init__(self) -> None:
        if self.eps is None:  # the warmup's default: nvlamb 1e-6 (as optim=lamb), deepspeed 1e-8
            self.eps = 1e-6 if Warmup(self.warmup) is Warmup.nvlamb else 1e-8
        super().__post_init__()
        self._check_name("onebit_lamb")
        _require(
            not (Warmup(self.warmup) is Warmup.nvlamb and TrustRatio(self.trust_ratio) is TrustRatio.frozen),
            "warmup",
            "nvlamb needs optim.trust_ratio=live or live_clamped (DeepSpeed's: optim.warmup=deepspeed)",
        )
        _require(self.max_grad_norm >= 0, "max_grad_norm", f"must be >= 0, got {self.max_grad_norm}")
        _require(
            self.variance_refresh == 0 or self.variance_refresh >= 2,
            "variance_refresh",
            f"must be 0 (off) or >= 2, got {self.variance_refresh}",
        )
        reason = compiled.unsupported_reason(
            trust_ratio_live=TrustRatio(self.trust_ratio) is not TrustRatio.frozen,
            precondition=self.precondition,
            virtual_workers=1,
            local_momentum=self.local_momentum,
        )
        _require(not self.compile or reason is None, "compile", f"true {reason}")
        _require(
            not self.variance_refresh
            or (TrustRatio(self.trust_ratio) is not TrustRatio.frozen and not self.local_momentum),
            "variance_refresh",
            "needs optim.trust_ratio=live or live_clamped and optim.local_momentum=false "
            "(optim.variance_refresh=0 turns the refresh off)",
        )
        _require(
            self.refresh_block >= 2,
            "refresh_block",
            f"must be >= 2, got {self.refresh_block}",
        )
        _require(
            not (self.local_momentum and TrustRatio(self.trust_ratio) is TrustRatio.frozen),
            "local_momentum",
            "needs optim.trust_ratio=live or live_clamped (frozen reads DeepSpeed's shared momentum)",
        )
        _require(
            0 <= self.min_coeff <= self.max_coeff, "min_coeff", "must satisfy 0 <= min_coeff <= max_coeff"
        )
        _require(0.0 < self.coeff_beta < 1.0, "coeff_beta", f"must be in (0, 1), got {self.coeff_beta}")
        _require(0 < self.factor_min <= 1.0, "factor_min", f"must be in (0, 1], got {self.factor_min}")
        _require(self.factor_max >= 1.0, "factor_max", f"must be >= 1, got {self.factor_max}")
        _require(
            0.0 <= self.factor_threshold < 1.0,
            "factor_threshold",
            f"must be in [0, 1), got {self.factor_threshold}",
        )
        if 1.0 / (1.0 - self.coeff_beta) > self.freeze_step:
            logger.warning(
                "optim.coeff_beta: 1/(1 - coeff_beta) > freeze_step; DeepSpeed advises the opposite"
            )

    def optimizer_kwargs(self) -> dict[str, Any]:
        return {
            **super().optimizer_kwargs(),
            "max_coeff": self.max_coeff,
            "min_coeff": self.min_coeff,
            "coeff_beta": self.coeff_beta,
            "factor_max": self.factor_max,
            "factor_min": self.factor_min,
            "factor_threshold": self.factor_threshold,
            "coeff_bias_correction": self.coeff_bias_correction,
            "trust_ratio": TrustRatio(self.trust_ratio),
            "warmup": Warmup(self.warmup),
            "max_grad_norm": self.max_grad_norm,
            "live_vector_variance": self.live_vector_variance,
            "variance_refresh": self.variance_refresh,
            "refresh_from": RefreshFrom(self.refresh_from),
            "refresh_block": self.refresh_block,
            "compile": self.compile,
        }


@dataclass
class OnebitAdamConfig(_OnebitConfig):
    name: str = "onebit_adam"

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_name("onebit_adam")
