"""Typed configuration of `python -m pretrain`, registered in Hydra's ConfigStore.

Root: conf/pretrain.yaml composes `model/`, `optim/`, `batch/`. A misspelt key fails at composition;
cross-field checks raise ValueError naming the key. The trainer converts the DictConfig to these
objects once; each component receives only its own section.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

import data.config  # noqa: F401 - registers the repo_root/shared_data resolvers
import pretrain.optim.config  # noqa: F401 - registers the optim/*_schema nodes
from pretrain.model import ModelConfig
from pretrain.optim.config import GradAllreduce
from pretrain.optim.schedule import ScheduleConfig


class Precision(str, enum.Enum):
    auto = "auto"  # fp32 on CPU, bf16 on CUDA
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"  # with dynamic loss scaling; overflow agreed across ranks


# a compiled step keeps one graph per shape (Dynamo's recompile limit is 8): the bins plus phase 1's shape
MAX_LENGTH_BINS = 6


@dataclass
class PhaseConfig:
    """One pretraining phase. Steps are optimizer steps of `global_batch` sequences."""

    name: str = MISSING
    max_seq_length: int = MISSING
    global_batch: int = MISSING
    micro_batch: int = MISSING  # sequences per device per forward/backward
    steps: int = MISSING
    lr: float = MISSING
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    # 1-bit optimizers only: the optimizer step, counted from the start of phase 1 (the step counter is
    # cumulative across phases because phase 2 continues phase 1's optimizer state), at which the
    # compression stage starts. null in a later phase: continue the previous phase's stage.
    freeze_step: int | None = None
    # a few fixed sequence lengths, ascending, the last max_seq_length: each step's samples on a rank are
    # ordered by length into its micro-batches and each micro-batch cut to the shortest bin that holds it
    # (the same samples and tokens, less padding; a compiled step sees len(length_bins) static shapes).
    # pretrain.train.phase_data.bin_by_length. null: every micro-batch padded to max_seq_length.
    length_bins: list[int] | None = None

    def __post_init__(self) -> None:
        for key in ("global_batch", "micro_batch", "steps"):
            if getattr(self, key) < 1:
                raise ValueError(f"batch.phases[{self.name}].{key} must be >= 1")
        bins = self.length_bins
        if bins is not None and (
            not bins
            or list(bins) != sorted(set(bins))
            or bins[-1] != self.max_seq_length
            or any(b < 8 or b % 8 for b in bins)
            or len(bins) > MAX_LENGTH_BINS
        ):
            raise ValueError(
                f"batch.phases[{self.name}].length_bins={bins}: up to {MAX_LENGTH_BINS} ascending multiples "
                f"of 8, the last max_seq_length={self.max_seq_length}"
            )
        if self.global_batch % self.micro_batch:
            raise ValueError(
                f"batch.phases[{self.name}].global_batch={self.global_batch} is not a multiple of "
                f"micro_batch={self.micro_batch}"
            )
        if self.lr <= 0:
            raise ValueError(f"batch.phases[{self.name}].lr must be > 0")

    def accumulation_steps(self, world_size: int) -> int:
        """global_batch / (world_size x micro_batch), or a one-line error naming the keys."""
        per_step = world_size * self.micro_batch
        if self.global_batch % per_step:
            raise ValueError(
                f"batch.phases[{self.name}].global_batch={self.global_batch} is not divisible by "
                f"world_size ({world_size}) x micro_batch ({self.micro_batch}) = {per_step}"
            )
        return self.global_batch // per_step


@dataclass
class BatchConfig:
    name: str = MISSING
    phases: list[PhaseConfig] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.phases:
            raise ValueError("batch.phases is empty")
        names = [p.name for p in self.phases]
        if len(set(names)) != len(names):
            raise ValueError(f"batch.phases: duplicate phase names {names}")


@dataclass
class CheckpointConfig:
    every_steps: int = 500  # 0 = only at phase ends and on signals
    keep_last: int = 3
    export_hf: bool = True
    # a save that fails for lack of space (or another OS error): `stop` ends the run (exit 2) with the
    # previous checkpoint intact; `continue` warns, removes the partial folder and trains on (the phase-end
    # and final saves always stop on failure: nothing after them would save the run)
    on_error: str = "stop"

    def __post_init__(self) -> None:
        if self.every_steps < 0 or self.keep_last < 1:
            raise ValueError("checkpoint.every_steps must be >= 0 and checkpoint.keep_last >= 1")
        if self.on_error not in ("stop", "continue"):
            raise ValueError(f"checkpoint.on_error must be stop or continue, got {self.on_error!r}")


@dataclass
class DistConfig:
    # a collective that waits longer than this fails (a stalled or unreachable rank): the survivors name
    # the rank and the step and exit 76 (pretrain.distributed.liveness.PEER_LOST_EXIT_CODE) for the scheduler
    # to requeue
    timeout_s: float = 600.0
    # how often each rank's heartbeat thread writes to the rendezvous store (the stalled-rank diagnosis)
    heartbeat_s: float = 5.0

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.heartbeat_s <= 0:
            raise ValueError("dist.timeout_s and dist.heartbeat_s must be > 0")
        if self.heartbeat_s * 2 > self.timeout_s:
            raise ValueError(
                f"dist.heartbeat_s={self.heartbeat_s} must be at most half of dist.timeout_s={self.timeout_s}"
            )


class WandbMode(str, enum.Enum):
    auto = "auto"  # online with an API key configured, offline otherwise
    online = "online"
    offline = "offline"
    disabled = "disabled"


@dataclass
class WandbConfig:
    mode: WandbMode = WandbMode.auto
    project: str = "bert-lamb"
    group: str | None = None  # default: the experiment (batch recipe); fine-tunes join this group
    tags: list[str] = field(default_factory=list)


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: Any = MISSING  # one of pretrain.optim.config's dataclasses, chosen by the optim group
    batch: BatchConfig = MISSING
    data_dir: str = MISSING  # prepared data: <data_dir>/seq<L>/manifest.json per phase length
    run_name: str = MISSING
    run_dir: str = MISSING
    seed: int = 1234
    precision: Precision = Precision.auto
    resume: str = "auto"  # auto: newest complete checkpoint in run_dir if any; none; or a checkpoint path
    dry_run: bool = False  # compose, build model/optimizer/data, run zero steps
    # dry runs on a laptop: check the batch arithmetic for the cluster's world size (e.g. 64 GPUs)
    dry_run_world_size: int | None = None
    max_steps: int | None = None  # stop after this many optimizer steps in total (smoke runs, tests)
    log_every: int = 10
    num_workers: int = 2  # DataLoader workers per rank
    deterministic: bool = False  # torch.use_deterministic_algorithms (bitwise resume tests)
    # sha256 of every shard against the manifest before the first step, once per node (one read of the
    # data); false keeps the cheap checks (shard sizes, tokenizer hash) only
    verify_data: bool = True
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    show_progress: bool = True
    peak_tflops: float | None = None  # per-device peak (e.g. 989 for H100 bf16 dense): enables the MFU metric
    # simulated data parallelism (pretrain/train/simulated.py): each process runs k workers, so the run is
    # one of
    # world size x k workers (1-bit error feedback, data split and averaging as on that many real ranks)
    sim_world_size: int = 1
    # per parameter family: 1-bit exchange fidelity, update sizes, vocabulary rows by token frequency
    # (pretrain/observability/diagnostics.py), at log steps; costs an fp32 allreduce of the momentum there
    # (not counted)
    diagnostics: bool = False
    # CPU runs: glibc keeps freed memory for reuse instead of unmapping it (pretrain/train/host_memory.py):
    # no page
    # faults per step from large temporaries; the same peak memory per rank in one-optimizer runs
    keep_host_memory: bool = True

    def __post_init__(self) -> None:
        if self.log_every < 1:
            raise ValueError("log_every must be >= 1")
        if not 1 <= self.sim_world_size <= 1024:
            raise ValueError(f"sim_world_size must be in [1, 1024], got {self.sim_world_size}")
        if self.sim_world_size > 1 and self.precision is Precision.fp16:
            raise ValueError(
                "sim_world_size > 1 needs precision fp32 or bf16 (fp16 loss scales are per rank)"
            )
        grad_allreduce = GradAllreduce(getattr(self.optim, "grad_allreduce", GradAllreduce.float32))
        if self.sim_world_size > 1 and grad_allreduce is not GradAllreduce.float32:
            raise ValueError(
                "optim.grad_allreduce: simulated workers (sim_world_size > 1) average gradients in float32; "
                "use real ranks to measure a bfloat16/float16 gradient allreduce"
            )
        if self.sim_world_size > 1 and getattr(self.optim, "compile", False) and self.optim.name != "lamb":
            raise ValueError(
                "optim.compile: the compiled 1-bit step needs one worker per process (sim_world_size=1)"
            )
        if self.max_steps is not None and self.max_steps < 0:
            raise ValueError("max_steps must be >= 0 or null")
        if self.resume not in ("auto", "none") and not self.resume:
            raise ValueError("resume must be auto, none or a checkpoint folder")
        longest = max(p.max_seq_length for p in self.batch.phases)
        if longest > self.model.max_position_embeddings:
            raise ValueError(
                f"batch.phases: max_seq_length {longest} > model.max_position_embeddings "
                f"{self.model.max_position_embeddings}"
            )
        total = sum(p.steps for p in self.batch.phases)
        freeze = self.batch.phases[0].freeze_step
        if hasattr(self.optim, "freeze_step") and freeze is not None and freeze >= total:
            raise ValueError(
                f"batch.phases[{self.batch.phases[0].name}].freeze_step={freeze} >= total steps {total}: "
                "the 1-bit compression stage would never start"
            )


if not OmegaConf.has_resolver("value"):  # ${value:${model.size}} -> "bert_large", not "ModelSize.bert_large"
    OmegaConf.register_new_resolver("value", lambda node: getattr(node, "value", node))


def register_configs() -> None:
    store = ConfigStore.instance()
    store.store(name="pretrain_schema", node=TrainConfig)
    store.store(group="batch", name="batch_schema", node=BatchConfig)
    store.store(group="model", name="model_schema", node=ModelConfig)


register_configs()


def to_object(cfg: Any) -> TrainConfig:
    """DictConfig -> dataclasses, once; runs every `__post_init__` check."""
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, TrainConfig)
    return obj
