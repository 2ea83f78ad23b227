"""Typed optimizer configs, one dataclass per registry entry (`pretrain.optim.OPTIMIZERS`), which
registers each as `<name>_schema` in Hydra's ConfigStore, group `optim`.

`conf/optim/<name>.yaml` starts with `defaults: [<name>_schema, _self_]`, so a misspelt key fails at
composition; `__post_init__` range checks raise ValueError naming the key (`optim.<key>`). Defaults are
the libraries' defaults (apex FusedLAMB, DeepSpeed's 1-bit LAMB and Adam; docs/pretraining.md)
except weight_decay = 0.01 (BERT; DeepSpeed's 1-bit
default is 0), which `param_groups` applies to all but biases and LayerNorm.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from pretrain.comm.compressed_allreduce import ScaleDtype, SignScale
from pretrain.optim.lamb import LambVariant
from pretrain.optim.onebit import Compression, ExchangeOptions
from pretrain.optim.onebit_lamb import DEEPSPEED_ALGORITHM, ONEBIT_LAMB_ALGORITHM, OnebitLambAlgorithm

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
    eps: float | None = 1e-8  # None: the optimizer's default
    # Momentum mask for position-embedding rows >= max_seq_length (never trained): `param_groups(...,
    # max_seq_length=...)` builds it; 1-bit signs cannot encode the zero momentum of those rows.
    mask_unused_position_embeddings: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.eps is None:
            self.eps = 1e-8
        _require(self.freeze_step >= 1, "freeze_step", f"must be >= 1, got {self.freeze_step}")
        _require(self.eps > 0, "eps", f"must be > 0, got {self.eps}")
        # `ffn_row_scales` (optim=onebit_lamb, optim=onebit_adam): the row-scaled groups must exist
        _require(
            not getattr(self, "ffn_row_scales", False) or self.row_scales,
            "ffn_row_scales",
            "needs the per_column compression (row-scaled groups); this optimizer's exchange has none",
        )

    def exchange_options(self) -> ExchangeOptions:
        """How the momentum is exchanged (`pretrain.optim.onebit.ExchangeOptions`)."""
        raise NotImplementedError

    def exchange_kwargs(self) -> dict[str, Any]:
        """`exchange_options()` as a dict of its fields (what the byte counts read)."""
        options = self.exchange_options()
        return {f.name: getattr(options, f.name) for f in fields(options)}

    def optimizer_kwargs(self) -> dict[str, Any]:
        return {**super().optimizer_kwargs(), "eps": self.eps, "freeze_step": self.freeze_step}

    @property
    def row_scales(self) -> bool:
        """Whether `param_groups` should put the embeddings in groups with per-row scales."""
        return self.exchange_options().compression.row_scales

    @property
    def ffn_rows(self) -> bool:
        """Whether `param_groups` should put the FFN intermediate matrices in the row-scaled group too (and
        the trainer keep them row-major): `ffn_row_scales` where the exchange has row scales."""
        return bool(getattr(self, "ffn_row_scales", False)) and self.row_scales


@dataclass
class _OnebitLambConfig(_OnebitConfig):
    """A 1-bit LAMB preset: its algorithm is fixed (`ALGORITHM`), the fields are what a user tunes."""

    ALGORITHM: ClassVar[OnebitLambAlgorithm]

    def exchange_options(self) -> ExchangeOptions:
        return self.ALGORITHM.exchange

    @property
    def compression(self) -> Compression:
        """The algorithm's scale layout (the trainer stores the matrices column-major for `per_column`)."""
        return self.ALGORITHM.exchange.compression

    def optimizer_kwargs(self) -> dict[str, Any]:
        return {**super().optimizer_kwargs(), "algorithm": self.ALGORITHM}


@dataclass
class OnebitLambConfig(_OnebitLambConfig):
    """This project's 1-bit LAMB (`optim=onebit_lamb`): what a user may tune; the algorithm is fixed
    (`ONEBIT_LAMB_ALGORITHM`, pretrain/optim/onebit_lamb.py)."""

    ALGORITHM: ClassVar[OnebitLambAlgorithm] = ONEBIT_LAMB_ALGORITHM
    name: str = "onebit_lamb"
    eps: float | None = 1e-6  # as optim=lamb (its warmup is optim=lamb's LAMB)
    max_coeff: float = 10.0  # cap of the live trust ratio
    max_grad_norm: float = 1.0  # the warmup's global gradient pre-normalization, as optim=lamb (0 disables)
    # K >= 2: every K-th compression step refreshes the matrices' variance from the workers' row and column
    # sums of g² (one small exact allreduce per K steps); 0: v stays frozen after freeze_step
    variance_refresh: int = 64
    # ablation under study (results/cpu-study-m), off by default: the FFN intermediate matrices get one scale
    # per row (neuron) instead of one per input column: they join the row-scaled group and stay row-major
    # (`pretrain.optim.params.param_groups(ffn_row_scales=True)`; per_column compression only)
    ffn_row_scales: bool = False
    # torch.compile the warmup and compression steps (pretrain/optim/compiled.py); sim_world_size=1 only
    # (checked in pretrain/config.py)
    compile: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_name("onebit_lamb")
        _require(self.max_coeff > 0, "max_coeff", f"must be > 0, got {self.max_coeff}")
        _require(self.max_grad_norm >= 0, "max_grad_norm", f"must be >= 0, got {self.max_grad_norm}")
        _require(
            self.variance_refresh == 0 or self.variance_refresh >= 2,
            "variance_refresh",
            f"must be 0 (off) or >= 2, got {self.variance_refresh}",
        )

    def optimizer_kwargs(self) -> dict[str, Any]:
        return {
            **super().optimizer_kwargs(),
            "max_coeff": self.max_coeff,
            "max_grad_norm": self.max_grad_norm,
            "variance_refresh": self.variance_refresh,
            "compile": self.compile,
        }


@dataclass
class OnebitLambDeepspeedConfig(_OnebitLambConfig):
    """DeepSpeed's 1-bit LAMB exactly (`optim=onebit_lamb_deepspeed`, the parity reference:
    `DEEPSPEED_ALGORITHM`), with DeepSpeed's hyperparameters."""

    ALGORITHM: ClassVar[OnebitLambAlgorithm] = DEEPSPEED_ALGORITHM

    name: str = "onebit_lamb_deepspeed"
    max_coeff: float = 10.0  # DeepSpeed BERT recipes use 0.3
    min_coeff: float = 0.01
    coeff_beta: float = 0.9
    factor_max: float = 4.0
    factor_min: float = 0.5
    factor_threshold: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_name("onebit_lamb_deepspeed")
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
        }


@dataclass
class OnebitAdamConfig(_OnebitConfig):
    """1-bit Adam (DeepSpeed's algorithm by default). The exchange (pretrain/optim/onebit.py): deepspeed
    = DeepSpeed's (one scale per rank's buffer); per_column = one per tensor, embedding row and input
    column of the other matrices. exact_vectors: 1-D tensors averaged exactly. precondition: exchange
    m/(√v+ε) (v frozen; no bytes). scale_dtype: how the scales travel. sign_scale: rms (DeepSpeed) or
    mean_abs."""

    name: str = "onebit_adam"
    compression: Compression = Compression.deepspeed
    exact_vectors: bool = False
    sign_scale: SignScale = SignScale.rms
    precondition: bool = False
    scale_dtype: ScaleDtype = ScaleDtype.float32
    ffn_row_scales: bool = False  # as optim=onebit_lamb's (an ablation, off by default; per_column only)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_name("onebit_adam")

    def exchange_options(self) -> ExchangeOptions:
        return ExchangeOptions(
            self.compression, self.exact_vectors, self.sign_scale, self.precondition, self.scale_dtype
        )

    def optimizer_kwargs(self) -> dict[str, Any]:
        return {**super().optimizer_kwargs(), "exchange": self.exchange_options()}
