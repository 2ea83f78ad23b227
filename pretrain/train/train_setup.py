"""The trainer's composition root: `build_components(cfg, env)` builds, in dependency order, everything
`pretrain.train.trainer.Trainer` is handed.

Order (the RNG draws depend on it): seeds; the data's checks (every phase's shards, one tokenizer); the
model (initialized from the seeded RNG) and its DDP wrapper with the switchable gradient-sync hook; the
optimizer over the parameter groups its kind needs; loss scaler, fault injector (test-only), diagnostics;
then this rank's dropout stream. The run-level components (checkpoints, step metrics, preemption signals,
run records) hold no RNG state.

This is the one place that knows which kind of optimizer the run uses (the registry's class): the 1-bit
optimizers get column-major matrices (`per_column`), momentum masks and row-scaled groups, the phases'
freeze_step, and their compression kernels are named in the run's config. The trainer itself only sees
`pretrain.optim.protocol.TrainingOptimizer`.
"""

from __future__ import annotations

import copy
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from data.dataset import PretrainingDataset
from data.shards import load_manifest
from data.tokenizer import load_prepared_tokenizer
from pretrain.config import PhaseConfig, Precision, TrainConfig
from pretrain.distributed.faults import FaultInjector
from pretrain.distributed.gradient_sync import GradientSync
from pretrain.distributed.preemption import PreemptionSignals
from pretrain.distributed.process_group import DistributedEnv, no_buffer_sync
from pretrain.model import GraphedStep, PretrainingObjective, build_model, column_major_linear_weights_
from pretrain.observability.diagnostics import Diagnostics, token_counts
from pretrain.optim import OPTIMIZERS, build_optimizer, param_groups
from pretrain.optim.config import GradAllreduce
from pretrain.optim.onebit import Compression, OnebitOptimizer
from pretrain.optim.params import ROW_SCALED_MATRICES
from pretrain.optim.protocol import LoopOptimizer, as_training_optimizer
from pretrain.train.checkpointing import Checkpointer, HfExport
from pretrain.train.host_memory import keep_freed_memory
from pretrain.train.phase_data import PhaseData, phase_folder
from pretrain.train.precision import DynamicLossScaler, NoScaler
from pretrain.train.run_records import RunRecords
from pretrain.train.simulated import SimulatedRanks, VirtualPhaseData, worker_seed
from pretrain.train.step_metrics import StepMetrics

log = logging.getLogger("pretrain")


class PhaseDataSource:
    """Opens a phase's data for this rank, or for each of its simulated workers
    (`pretrain.train.simulated`)."""

    def __init__(
        self,
        cfg: TrainConfig,
        env: DistributedEnv,
        vocab_size: int,
        simulated: SimulatedRanks | None,
        workers: int,
    ):
        self.cfg, self.env, self.vocab_size = cfg, env, vocab_size
        self.simulated, self.workers = simulated, workers

    def open(self, index: int, phase: PhaseConfig) -> PhaseData | VirtualPhaseData:
        def make(rank: int, world_size: int) -> PhaseData:
            return PhaseData(
                phase_folder(self.cfg.data_dir, phase.max_seq_length),
                global_batch=phase.global_batch,
                micro_batch=phase.micro_batch,
                rank=rank,
                world_size=world_size,
                seed=self.cfg.seed + index,
                num_workers=self.cfg.num_workers,
                vocab_size=self.vocab_size,
                pin_memory=self.env.device.type == "cuda",
                dry_run=self.cfg.dry_run,
                length_bins=phase.length_bins,
            )

        if self.simulated is None:
            return make(self.env.rank, self.env.world_size)
        return VirtualPhaseData(make, self.simulated.first, self.cfg.sim_world_size, self.workers)


@dataclass
class TrainerComponents:
    """What `Trainer` is handed. `cfg` is the run's config as the trainer reads it (the phase-0
    freeze_step in `optim` for a 1-bit optimizer); `workers` the data-parallel workers (processes x
    simulated workers per process)."""

    cfg: TrainConfig
    model: torch.nn.Module
    ddp: DistributedDataParallel
    sync: GradientSync
    optimizer: LoopOptimizer
    scaler: NoScaler
    precision: Precision
    simulated: SimulatedRanks | None
    workers: int
    num_params: int
    data: PhaseDataSource
    checkpointer: Checkpointer
    metrics: StepMetrics
    signals: PreemptionSignals
    records: RunRecords
    faults: FaultInjector
    diagnostics: Diagnostics | None


def build_components(cfg: TrainConfig, env: DistributedEnv) -> TrainerComponents:
    """Everything the trainer needs for `cfg` on this rank, in dependency order (module docstring)."""
    compressed = compresses(cfg.optim.name)
    if cfg.model.cuda_graphs and env.device.type != "cuda":
        raise ValueError(
            f"model.cuda_graphs=true needs a CUDA device (CUDA graphs); this run is on {env.device}"
        )
    cfg = _with_phase0_freeze_step(cfg, compressed)
    phases = cfg.batch.phases
    seed_everything(cfg.seed + env.rank)
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
    if cfg.keep_host_memory and env.device.type == "cpu":
        keep_freed_memory()  # no page faults per step from large temporaries (pretrain/train/host_memory.py)
    workers = env.world_size * cfg.sim_world_size
    simulated = None
    if cfg.sim_world_size > 1:
        simulated = SimulatedRanks(cfg.sim_world_size, env.rank, env.world_size, cfg.seed, env.device)
    tokenizer, vocab_size = check_data(cfg, env, workers)
    model = build_model(cfg.model, vocab_size, env.device)
    if Compression(getattr(cfg.optim, "compression", Compression.deepspeed)) is Compression.per_column:
        # the 1-bit exchange's layout (before DDP sees them); row-scaled matrices stay row-major
        column_major_linear_weights_(model, skip=ROW_SCALED_MATRICES if _ffn_rows(cfg, compressed) else ())
    num_params = sum(p.numel() for p in model.parameters())
    precision = resolve_precision(cfg.precision, env.device)
    sync = GradientSync(None, env.world_size, getattr(torch, GradAllreduce(cfg.optim.grad_allreduce).value))
    objective: torch.nn.Module = PretrainingObjective(model, cfg.model.vocab_multiple(env.device))
    if cfg.model.compile:
        objective = torch.compile(objective, **compile_options(cfg))  # type: ignore[assignment]
    if cfg.model.cuda_graphs:  # gradients accumulate into static buffers across the graphs' replays
        objective = GraphedStep(objective, [p for p in model.parameters() if p.requires_grad])
    ddp = DistributedDataParallel(
        objective,
        device_ids=[env.device.index] if env.device.type == "cuda" else None,
        **no_buffer_sync(),  # BERT's buffers (position ids) are constants
    )
    ddp.register_comm_hook(sync, GradientSync.hook)
    optimizer = as_training_optimizer(
        build_optimizer(
            cfg.optim.name,
            cfg.optim,
            _param_groups(cfg, model, compressed),
            virtual_workers=cfg.sim_world_size,
        )
    )
    scaler = DynamicLossScaler() if precision is Precision.fp16 else NoScaler()
    faults = FaultInjector.from_env(env.rank)  # test-only (tests/reliability); inert unless set
    diagnostics = None
    if cfg.diagnostics:
        counts = token_counts(phase_folder(cfg.data_dir, phases[0].max_seq_length), vocab_size)
        diagnostics = Diagnostics(model, optimizer, counts)
    # this rank's dropout stream, as its simulated twin would have it (pretrain/train/simulated.py)
    torch.manual_seed(worker_seed(cfg.seed, env.rank))

    records = RunRecords(cfg, env, compressed_exchange=compressed)
    checkpointer = Checkpointer(
        Path(cfg.run_dir) / "checkpoints",
        cfg.checkpoint,
        resume=cfg.resume,
        rank=env.rank,
        world_size=env.world_size,
        model=model,
        optimizer=optimizer,
        optim_config=cfg.optim,
        scaler=scaler,
        simulated=simulated,
        faults=faults,
        hf_export=HfExport(model, tokenizer, records.hf_run_info()) if cfg.checkpoint.export_hf else None,
    )
    metrics = StepMetrics(
        optimizer,
        sync,
        scaler,
        env.device,
        env.world_size,
        workers=workers,
        num_params=num_params,
        simulated=simulated is not None,
        peak_tflops=cfg.peak_tflops,
        report_stage=compressed,
    )
    return TrainerComponents(
        cfg=cfg,
        model=model,
        ddp=ddp,
        sync=sync,
        optimizer=optimizer,
        scaler=scaler,
        precision=precision,
        simulated=simulated,
        workers=workers,
        num_params=num_params,
        data=PhaseDataSource(cfg, env, len(tokenizer), simulated, workers),
        checkpointer=checkpointer,
        metrics=metrics,
        signals=PreemptionSignals(env.device, env.world_size),
        records=records,
        faults=faults,
        diagnostics=diagnostics,
    )


def compile_options(cfg: TrainConfig) -> dict[str, Any]:
    """torch.compile's options for the step: CUDA graphs (`model.cuda_graphs`); static shapes when a phase
    has length bins (one graph per bin, none with dynamic shapes); the defaults otherwise."""
    options: dict[str, Any] = {}
    if cfg.model.cuda_graphs:
        options["mode"] = "reduce-overhead"
    if any(phase.length_bins for phase in cfg.batch.phases):
        options["dynamic"] = False
    return options


def compresses(optimizer_name: str) -> bool:
    """Whether registry entry `optimizer_name` is a 1-bit optimizer (warmup, then compressed exchange)."""
    entry = OPTIMIZERS.get(optimizer_name)
    return entry is not None and issubclass(entry[0], OnebitOptimizer)


def _with_phase0_freeze_step(cfg: TrainConfig, compressed: bool) -> TrainConfig:
    """`cfg`, or for a 1-bit optimizer whose first phase sets freeze_step a copy with that value in
    `optim.freeze_step` (what the optimizer is built with, the checkpoints record and config.yaml shows);
    the caller's config is left as it is. Warns when a phase sets freeze_step for another optimizer."""
    freeze = cfg.batch.phases[0].freeze_step
    if freeze is not None and compressed:
        cfg = copy.copy(cfg)
        cfg.optim = copy.copy(cfg.optim)
        cfg.optim.freeze_step = freeze
    elif any(p.freeze_step is not None for p in cfg.batch.phases) and not compressed:
        log.warning(
            "batch.phases[*].freeze_step is ignored by optim=%s (not a 1-bit optimizer)", cfg.optim.name
        )
    return cfg


def _param_groups(cfg: TrainConfig, model: torch.nn.Module, compressed: bool) -> list[dict[str, Any]]:
    """The optimizer's groups: a 1-bit optimizer's may add the position embeddings' momentum mask (for
    phase 0's length; `start_phase` moves it) and row-scaled embeddings, with `optim.ffn_row_scales` the
    FFN intermediate matrices among them (`pretrain.optim.params`)."""
    masks = compressed and bool(getattr(cfg.optim, "mask_unused_position_embeddings", False))
    return param_groups(
        model,
        cfg.optim.weight_decay,
        max_seq_length=cfg.batch.phases[0].max_seq_length if masks else None,
        row_scales=compressed and bool(getattr(cfg.optim, "row_scales", False)),
        ffn_row_scales=_ffn_rows(cfg, compressed),
    )


def _ffn_rows(cfg: TrainConfig, compressed: bool) -> bool:
    """`optim.ffn_row_scales` in effect: the FFN intermediate matrices row-scaled and row-major (the groups
    and the memory layout ask this one place)."""
    return compressed and bool(getattr(cfg.optim, "ffn_rows", False))


def check_data(cfg: TrainConfig, env: DistributedEnv, workers: int) -> tuple[Any, int]:
    """Every phase's shards exist and share one tokenizer; -> (tokenizer, vocab size)."""
    folders = [phase_folder(cfg.data_dir, p.max_seq_length) for p in cfg.batch.phases]
    manifests = [load_manifest(f) for f in folders]
    hashes = {m["tokenizer"]["sha256"] for m in manifests}
    if len(hashes) != 1:
        raise ValueError(f"data_dir: the phases' shards were made with different tokenizers ({folders})")
    # before anything is written: every phase's tokenizer hash and shard sizes, and (once per node, as
    # local disks may differ) every shard's sha256, since a flipped byte would train silently
    verify = cfg.verify_data and not cfg.dry_run and env.local_rank == 0
    for folder in folders:
        PretrainingDataset(folder, verify=verify)
    for phase in cfg.batch.phases:
        phase.accumulation_steps(workers)
        if cfg.dry_run and cfg.dry_run_world_size:
            phase.accumulation_steps(cfg.dry_run_world_size)
    return load_prepared_tokenizer(folders[0]), int(manifests[0]["tokenizer"]["vocab_size"])


def resolve_precision(precision: Precision, device: torch.device) -> Precision:
    if precision is Precision.auto:
        return Precision.bf16 if device.type == "cuda" else Precision.fp32
    if device.type != "cuda" and precision is not Precision.fp32:
        log.warning("precision=%s needs CUDA; using fp32 on %s", precision.value, device)
        return Precision.fp32
    return precision


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
