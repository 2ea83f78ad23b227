"""The pretraining loop: phases of optimizer steps over DDP, with exact resume.

Per step (`train_step`): fetch the rank's micro-batches, forward/backward under `no_sync` except the
last micro-batch (DDP's hook averages gradients, or not at all in the 1-bit compression stage), the
optimizer step (the 1-bit optimizers exchange compressed momentum inside it), metrics at log steps.
Everything with state is checkpointed under a fixed key (pretrain/checkpoint.py).
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import transformers
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from data.dataset import PretrainingDataset
from data.shards import load_manifest
from data.tokenizer import load_prepared_tokenizer
from pretrain import checkpoint as ckpt
from pretrain.comm.counter import ring_allreduce_bytes
from pretrain.comm.kernels import describe_kernels
from pretrain.config import PhaseConfig, Precision, TrainConfig
from pretrain.diagnostics import Diagnostics, token_counts
from pretrain.distributed import DistributedEnv, autocast_context, no_buffer_sync
from pretrain.faults import FaultInjector
from pretrain.gradient_sync import GradientSync
from pretrain.host_memory import keep_freed_memory
from pretrain.metrics import (
    ConsoleLogger,
    FanoutLogger,
    JsonlLogger,
    MetricsLogger,
    NullLogger,
    WandbLogger,
    scrub_secrets,
)
from pretrain.model import PretrainingObjective, build_model, column_major_linear_weights_
from pretrain.optim import build_optimizer, mark_gradients_checked, needs_gradient_allreduce, param_groups
from pretrain.optim.base import split_replicated
from pretrain.optim.config import GradAllreduce
from pretrain.optim.onebit import Compression
from pretrain.optim.schedule import build_scheduler
from pretrain.phase_data import PhaseData, phase_folder
from pretrain.precision import DynamicLossScaler, NoScaler
from pretrain.simulated import SimulatedRanks, VirtualPhaseData, worker_seed

log = logging.getLogger("pretrain")
PREEMPTED_EXIT_CODE = 75  # checkpoint written on SIGTERM/SIGUSR1; resume with resume=auto


@dataclass
class TrainState:
    phase_index: int = 0
    step_in_phase: int = 0
    global_step: int = 0  # optimizer steps over all phases, skipped ones included
    samples_seen: int = 0
    tokens_seen: int = 0  # non-padding tokens
    bytes_sent: float = 0.0  # this rank's gradient/momentum traffic
    bytes_lamb_equivalent: float = 0.0  # what an fp32 gradient allreduce (LAMB) would have sent
    skipped_steps: int = 0


class Preempted(Exception):
    """Raised after the checkpoint on SIGTERM/SIGUSR1 has been written."""


class Trainer:
    def __init__(self, cfg: TrainConfig, env: DistributedEnv):
        self.cfg, self.env, self.phases = cfg, env, cfg.batch.phases
        _seed_everything(cfg.seed + env.rank)
        if cfg.deterministic:
            torch.use_deterministic_algorithms(True)
        if cfg.keep_host_memory and env.device.type == "cpu":
            keep_freed_memory()  # no page faults per step from large temporaries (pretrain/host_memory.py)
        self.run_dir = Path(cfg.run_dir)
        # data-parallel workers: processes x simulated workers per process (pretrain/simulated.py)
        self.workers = env.world_size * cfg.sim_world_size
        self.simulated = None
        if cfg.sim_world_size > 1:
            self.simulated = SimulatedRanks(
                cfg.sim_world_size, env.rank, env.world_size, cfg.seed, env.device
            )
        self.tokenizer, vocab_size = self._check_data()
        self.model = build_model(cfg.model, vocab_size, env.device)
        if Compression(getattr(cfg.optim, "compression", Compression.deepspeed)) is Compression.per_column:
            column_major_linear_weights_(self.model)  # the 1-bit exchange's layout (before DDP sees them)
        self.num_params = sum(p.numel() for p in self.model.parameters())
        self.precision = _resolve_precision(cfg.precision, env.device)
        grad_dtype = getattr(torch, GradAllreduce(cfg.optim.grad_allreduce).value)
        self.sync = GradientSync(None, env.world_size, grad_dtype)
        objective: torch.nn.Module = PretrainingObjective(self.model)
        if cfg.model.compile:
            objective = torch.compile(objective)  # type: ignore[assignment]
        self.ddp = DistributedDataParallel(
            objective,
            device_ids=[env.device.index] if env.device.type == "cuda" else None,
            **no_buffer_sync(),  # BERT's buffers (position ids) are constants
        )
        self.ddp.register_comm_hook(self.sync, GradientSync.hook)
        self.onebit = hasattr(cfg.optim, "freeze_step")
        self._configure_optimizer_for_phase0()
        mask_length = self.phases[0].max_seq_length if self._masks_positions() else None
        row_scales = self.onebit and bool(getattr(cfg.optim, "row_scales", False))
        groups = param_groups(
            self.model,
            cfg.optim.weight_decay,
            max_seq_length=mask_length,
            row_scales=row_scales,
            exact_output_bias=row_scales and bool(getattr(cfg.optim, "exact_output_bias", False)),
        )
        self.optimizer = build_optimizer(
            cfg.optim.name, cfg.optim, groups, virtual_workers=cfg.sim_world_size
        )
        self.scaler = DynamicLossScaler() if self.precision is Precision.fp16 else NoScaler()
        self.state = TrainState()
        self.data: PhaseData | VirtualPhaseData | None = None
        self.scheduler: Any = None
        self.logger: MetricsLogger = NullLogger()
        self._signal: int | None = None
        self._pending_tokens = torch.zeros((), device=env.device)
        self._previous_handlers: dict[int, Any] = {}
        self.faults = FaultInjector.from_env(env.rank)  # test-only (tests/reliability); inert unless set
        self.diagnostics = None
        if cfg.diagnostics:
            counts = token_counts(phase_folder(cfg.data_dir, self.phases[0].max_seq_length), vocab_size)
            self.diagnostics = Diagnostics(self.model, self.optimizer, counts)
        # this rank's dropout stream, as its simulated twin would have it (pretrain/simulated.py)
        torch.manual_seed(worker_seed(cfg.seed, env.rank))

    # -- set-up ----------------------------------------------------------------------------------------
    def _check_data(self):
        """Every phase's shards exist and share one tokenizer; -> (tokenizer, vocab size)."""
        folders = [phase_folder(self.cfg.data_dir, p.max_seq_length) for p in self.phases]
        manifests = [load_manifest(f) for f in folders]
        hashes = {m["tokenizer"]["sha256"] for m in manifests}
        if len(hashes) != 1:
            raise ValueError(f"data_dir: the phases' shards were made with different tokenizers ({folders})")
        # before anything is written: every phase's tokenizer hash and shard sizes, and (once per node,
        # as local disks may differ) every shard's sha256, since a flipped byte would train silently
        verify = self.cfg.verify_data and not self.cfg.dry_run and self.env.local_rank == 0
        for folder in folders:
            PretrainingDataset(folder, verify=verify)
        for phase in self.phases:
            phase.accumulation_steps(self.workers)
            if self.cfg.dry_run and self.cfg.dry_run_world_size:
                phase.accumulation_steps(self.cfg.dry_run_world_size)
        return load_prepared_tokenizer(folders[0]), int(manifests[0]["tokenizer"]["vocab_size"])

    def _masks_positions(self) -> bool:
        return self.onebit and bool(getattr(self.cfg.optim, "mask_unused_position_embeddings", False))

    def _configure_optimizer_for_phase0(self) -> None:
        freeze = self.phases[0].freeze_step
        if freeze is not None and self.onebit:
            self.cfg.optim.freeze_step = freeze
        elif any(p.freeze_step is not None for p in self.phases) and not self.onebit:
            log.warning(
                "batch.phases[*].freeze_step is ignored by optim=%s (not a 1-bit optimizer)",
                self.cfg.optim.name,
            )

    def _freeze_step_for(self, phase_index: int) -> int | None:
        """The last freeze_step set by this or an earlier phase (null continues the previous stage)."""
        values = [p.freeze_step for p in self.phases[: phase_index + 1] if p.freeze_step is not None]
        return values[-1] if values else None

    def _enter_phase(self, index: int) -> PhaseConfig:
        phase = self.phases[index]
        for group in self.optimizer.param_groups:
            group["lr"] = phase.lr
            group.pop("initial_lr", None)  # LambdaLR would otherwise keep the previous phase's peak
        if self.onebit:
            freeze = self._freeze_step_for(index)
            if freeze is not None:
                self.optimizer.freeze_step = freeze  # type: ignore[attr-defined]
            if self._masks_positions():
                mask = self.optimizer.param_groups[-1]["exp_avg_mask"]
                mask.zero_()
                mask[: phase.max_seq_length] = 1.0
        self.scheduler = build_scheduler(self.optimizer, phase.schedule, phase.steps)
        if self.data is not None:
            self.data.close()

        def make(rank: int, world_size: int) -> PhaseData:
            return PhaseData(
                phase_folder(self.cfg.data_dir, phase.max_seq_length),
                global_batch=phase.global_batch,
                micro_batch=phase.micro_batch,
                rank=rank,
                world_size=world_size,
                seed=self.cfg.seed + index,
                num_workers=self.cfg.num_workers,
                vocab_size=len(self.tokenizer),
                pin_memory=self.env.device.type == "cuda",
                dry_run=self.cfg.dry_run,
            )

        if self.simulated is None:
            self.data = make(self.env.rank, self.env.world_size)
        else:
            self.data = VirtualPhaseData(make, self.simulated.first, self.cfg.sim_world_size, self.workers)
        return phase

    # -- the loop --------------------------------------------------------------------------------------
    def fit(self) -> TrainState:
        resume_from = self._resume_path()
        shared = self._load(resume_from) if resume_from else None
        if self.cfg.dry_run:
            for index in range(len(self.phases)):
                self._enter_phase(index)
            self._describe()
            return self.state
        self._install_signal_handlers()
        self.logger = self._build_logger()
        total_steps = sum(p.steps for p in self.phases)
        bar = tqdm(
            total=total_steps,
            initial=self.state.global_step,
            disable=not (self.env.is_main and self.cfg.show_progress),
            desc=self.cfg.run_name,
            unit="step",
        )
        try:
            while self.state.phase_index < len(self.phases):
                phase = self._enter_phase(self.state.phase_index)
                if shared is not None:  # mid-phase resume: scheduler, data cursor, loss scale
                    self._restore_phase_state(shared)
                    shared = None
                while self.state.step_in_phase < phase.steps:
                    if self.cfg.max_steps is not None and self.state.global_step >= self.cfg.max_steps:
                        self.save()
                        return self.state
                    metrics = self.train_step(phase)
                    bar.update(1)
                    if metrics:
                        self.logger.log(self.state.global_step, metrics)
                        bar.set_postfix(loss=f"{metrics['loss']:.3f}")
                    self.faults.at("after_step", self.state.global_step)
                    every = self.cfg.checkpoint.every_steps
                    signum = self._agree_on_signal()
                    if signum:
                        self.save()
                        self._hand_over_signal()
                        name = signal.Signals(signum).name
                        raise Preempted(f"{name}: checkpoint written at step {self.state.global_step}")
                    if (
                        every
                        and self.state.global_step % every == 0
                        and self.state.step_in_phase < phase.steps
                    ):
                        self.save(periodic=True)
                self.save()  # phase end
                self.state.phase_index += 1
                self.state.step_in_phase = 0
            self._write_summary()
            return self.state
        finally:
            bar.close()
            self.logger.close()
            if self.data is not None:
                self.data.close()

    def train_step(self, phase: PhaseConfig) -> dict[str, float] | None:
        """One optimizer step of `phase.global_batch` samples; metrics on log steps, else None."""
        accumulation = phase.accumulation_steps(self.workers)
        self.faults.step = self.state.global_step + 1  # the step the communication layer's points belong to
        timer = _Timer(self.env.device)
        assert self.data is not None
        # fetch
        batches: Any = self.data.next_step(accumulation)  # simulated workers: one list per worker
        timer.lap("data")
        # forward / backward; the last micro-batch's backward runs the gradient sync hook
        sync = needs_gradient_allreduce(self.optimizer)
        log_step = (self.state.global_step + 1) % self.cfg.log_every == 0
        measure = log_step and sync and self.env.world_size > 1 and self.simulated is None
        self.sync.start_step(enabled=sync, measure=measure)
        if self.diagnostics is not None:
            self.diagnostics.begin_step(log_step)
        params: list[torch.Tensor] = [p for p in self.model.parameters() if p.requires_grad]
        if self.simulated is None:
            totals = torch.zeros(5, device=self.env.device)  # mlm, nsp, correct, masked, non-pad tokens
            for index, batch in enumerate(batches):
                totals += self._micro_step(batch, accumulation, sync_gradients=index == accumulation - 1)
        else:  # k workers; their gradients averaged, or kept apart for the 1-bit exchange
            totals = self.simulated.forward_backward(
                batches, lambda batch: self._micro_step(batch, accumulation), self.optimizer, params
            )
        timer.lap("forward_backward")
        # optimizer (1-bit: compressed momentum exchange inside)
        self.faults.poison(self.state.global_step + 1, params)
        self.faults.at("mid_step", self.state.global_step + 1)
        # Inf/NaN on any rank: every rank skips the step (parameters, moments, 1-bit errors untouched)
        overflow = self.scaler.unscale_and_check(params)
        grad_norm = float(self.scaler.grad_norm) if log_step and self.scaler.grad_norm is not None else None
        traffic_before = _onebit_bytes(self.optimizer)
        if not overflow:
            mark_gradients_checked(self.optimizer, self.scaler.grad_norm)  # the step need not check again
            self.optimizer.step()
        skipped = overflow or bool(getattr(self.optimizer, "last_step_skipped", False))
        diagnostics = self.diagnostics.end_step(skipped) if self.diagnostics is not None else {}
        self.scaler.update(skipped)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        timer.lap("optimizer")
        # counters and metrics
        self._count(phase, totals, sync, skipped, _onebit_bytes(self.optimizer) - traffic_before)
        if not log_step:
            return None
        return {**self._metrics(phase, totals, timer, grad_norm, accumulation), **diagnostics}

    def _micro_step(self, batch: dict[str, torch.Tensor], accumulation: int, sync_gradients: bool = False):
        """Forward and backward of one micro-batch (gradients synchronized by DDP's hook only when asked);
        -> [mlm loss, nsp loss, correct, masked, non-pad tokens]."""
        batch = {k: v.to(self.env.device, non_blocking=True) for k, v in batch.items()}
        with self.ddp.no_sync() if not sync_gradients else nullcontext():
            with autocast_context(self.env.device, self.precision.value):
                mlm, nsp, correct, masked = self.ddp(**batch)
            # the mean over this rank's micro-batches (spec §5.2), in every stage
            self.scaler.scale_loss((mlm + nsp) / accumulation).backward()
        return torch.stack([mlm.detach(), nsp.detach(), correct, masked, batch["attention_mask"].sum()])

    def _gradient_bytes(self) -> float:
        """Bytes a worker sent averaging gradients this step (a simulated run: what its workers would)."""
        if self.simulated is None:
            return self.sync.bytes_sent
        return ring_allreduce_bytes(self.num_params, self.sync.dtype.itemsize, self.workers)

    # -- metrics ---------------------------------------------------------------------------------------
    def _count(
        self, phase: PhaseConfig, totals: torch.Tensor, sync: bool, skipped: bool, onebit_bytes: float
    ) -> None:
        state = self.state
        state.global_step += 1
        state.step_in_phase += 1
        state.skipped_steps += int(skipped)
        state.samples_seen += phase.global_batch
        # tokens: this rank's count x world size (exact per-rank counts would need a collective per step);
        # summed on the device and folded into the state at log steps and saves (no host sync per step)
        self._pending_tokens += totals[4]
        state.bytes_sent += self._gradient_bytes() if sync else onebit_bytes
        if self.workers > 1:
            state.bytes_lamb_equivalent += ring_allreduce_bytes(self.num_params, 4, self.workers)

    def _flush_tokens(self) -> None:
        self.state.tokens_seen += int(self._pending_tokens.item()) * self.env.world_size
        self._pending_tokens.zero_()

    def _metrics(self, phase, totals, timer, grad_norm, accumulation) -> dict[str, float]:
        self._flush_tokens()
        if self.env.world_size > 1:
            dist.all_reduce(totals)
        mlm, nsp = (totals[:2] / (accumulation * self.workers)).tolist()
        seconds = timer.total
        metrics: dict[str, float] = {
            "loss": mlm + nsp,
            "mlm_loss": mlm,
            "nsp_loss": nsp,
            "mlm_accuracy": float(totals[2] / totals[3].clamp(min=1)),
            "lr": self.optimizer.param_groups[0]["lr"],
            "phase": self.state.phase_index + 1,
            "epoch": self.data.epoch if self.data else 0,
            "samples_seen": self.state.samples_seen,
            "tokens_seen": self.state.tokens_seen,
            "skipped_steps": self.state.skipped_steps,
            "loss_scale": self.scaler.scale,
            "samples_per_s": phase.global_batch / seconds,
            "tokens_per_s": float(totals[4]) / seconds,
            "step_seconds": seconds,
            **{f"time_{name}": value for name, value in timer.laps.items()},
            "time_communication": self.sync.seconds,
            "bytes_step": self._gradient_bytes() if self.sync.enabled else 0.0,
            "bytes_cumulative": self.state.bytes_sent,
            "bytes_lamb_cumulative": self.state.bytes_lamb_equivalent,
        }
        if self.state.bytes_sent:
            metrics["volume_reduction_vs_lamb"] = self.state.bytes_lamb_equivalent / self.state.bytes_sent
        if grad_norm is not None:
            metrics["grad_norm"] = grad_norm
            noise_scale = self._gradient_noise_scale(grad_norm, phase, accumulation)
            if noise_scale is not None:
                metrics["gradient_noise_scale"] = noise_scale
        if self.onebit:
            metrics["onebit_stage"] = float(not needs_gradient_allreduce(self.optimizer))
        statistics = getattr(self.optimizer, "statistics", None)
        if callable(statistics):
            metrics.update({f"optim/{k}": float(v) for k, v in statistics().items()})
        if self.env.device.type == "cuda" and self.cfg.peak_tflops:
            flops = 6 * self.num_params * metrics["tokens_per_s"]  # dense training FLOPs per token
            metrics["mfu"] = flops / (self.cfg.peak_tflops * 1e12 * self.env.world_size)
        return metrics

    def _gradient_noise_scale(self, grad_norm: float, phase: PhaseConfig, accumulation: int) -> float | None:
        """B_simple = tr(Σ)/|G|² from the per-rank (small batch) and averaged (big batch) gradient norms."""
        if not (self.sync.measure and self.sync.enabled):
            return None
        local = self.sync.local_square_norm.reshape(1).float() / self.scaler.scale**2
        dist.all_reduce(local)
        small_sq = float(local) / self.env.world_size
        big_sq = grad_norm**2
        b_small, b_big = phase.micro_batch * accumulation, phase.global_batch
        true_sq = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
        trace = (small_sq - big_sq) / (1 / b_small - 1 / b_big)
        return trace / true_sq if true_sq > 0 else None

    # -- checkpoints -----------------------------------------------------------------------------------
    def _resume_path(self) -> Path | None:
        if self.cfg.resume == "none":
            return None
        if self.cfg.resume == "auto":
            return ckpt.latest_checkpoint(self.run_dir / "checkpoints")
        path = Path(self.cfg.resume)
        if not path.is_dir():
            raise ckpt.CheckpointError(f"resume: {path} is not a checkpoint folder")
        return path

    def save(self, periodic: bool = False) -> Path | None:
        """Write a checkpoint (collective). A periodic one that fails (full disk) with
        checkpoint.on_error=continue is skipped with a warning (-> None); any other failure raises."""
        try:
            return self._save()
        except ckpt.CheckpointSaveError as error:
            if not (periodic and self.cfg.checkpoint.on_error == "continue"):
                raise
            log.warning("%s; training goes on (checkpoint.on_error=continue)", error)
            return None

    def _save(self) -> Path:
        self._flush_tokens()
        shared = {
            "train_state": asdict(self.state),
            "lr_scheduler": self.scheduler.state_dict() if self.scheduler else None,
            "dataloader": self.data.state_dict() if self.data else None,
            "grad_scaler": self.scaler.state_dict(),
            "world_size": self.env.world_size,
            "optim_options": self.cfg.optim.options(),  # a resume names what changed (`_load`)
        }
        replicated, own = split_replicated(self.optimizer.state_dict())  # m, v: written once, by rank 0
        rank_state = {"optimizer": own, "rng": ckpt.rng_state()}
        if self.simulated is not None:
            rank_state["simulated"] = self.simulated.state_dict()
        step = self.state.global_step
        path = ckpt.save_checkpoint(
            self.run_dir / "checkpoints",
            step,
            rank=self.env.rank,
            model=self.model,
            rank_state=rank_state,
            shared_state=shared,
            replicated_state={"optimizer": replicated},
            export_hf=self._export_hf if self.cfg.checkpoint.export_hf else None,
            keep_last=self.cfg.checkpoint.keep_last,
            before_commit=lambda: self.faults.at("checkpoint_write", step),
        )
        self.faults.at("after_checkpoint", step)
        return path

    def _export_hf(self, folder: Path) -> None:
        transformers.utils.logging.disable_progress_bar()
        self.model.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)
        # fine-tunes read it: samples seen (their x axis), the run and its W&B group (to join its curves)
        state = {
            **asdict(self.state),
            "run_name": self.cfg.run_name,
            "wandb_group": scrub_secrets(self.cfg.wandb.group or self.cfg.batch.name),  # as in _build_logger
            # the dashboard groups fine-tunes like their pretraining runs (see _run_config)
            "optimizer": self.cfg.optim.name,
            "global_batch": self.phases[0].global_batch,
        }
        (folder / "pretraining_state.json").write_text(json.dumps(state, indent=1))

    def _load(self, path: Path) -> dict[str, Any]:
        rank_state, shared = ckpt.load_checkpoint(path, self.env.rank, self.model, self.env.world_size)
        try:
            self.optimizer.load_state_dict(rank_state["optimizer"])
        except (ValueError, KeyError) as error:
            raise ckpt.CheckpointError(
                f"{path}: optimizer state does not fit optim={self.cfg.optim.name} ({error})"
            ) from None
        self.state = TrainState(**shared["train_state"])
        changed = self.cfg.optim.changed_options(shared.get("optim_options"))
        if changed:  # e.g. a 1-bit LAMB checkpoint of an older default: its rules switch mid-run
            log.warning(
                "resume: optim options differ from the checkpoint's (%s); the run goes on with the new ones",
                ", ".join(changed),
            )
        if int(shared.get("world_size", self.env.world_size)) == self.env.world_size:
            ckpt.set_rng_state(rank_state["rng"])
            restored = self.simulated is None or self.simulated.load_state_dict(
                rank_state.get("simulated", {})
            )
            if not restored:
                log.warning("resume: the simulated workers changed; their RNG streams restart")
        else:
            log.warning(
                "resume: world size changed (%s -> %s): every rank takes rank 0's optimizer state, the "
                "data order is re-split exactly, RNG streams restart",
                shared["world_size"],
                self.env.world_size,
            )
        self.scaler.load_state_dict(shared["grad_scaler"])
        log.info(
            "resumed from %s at step %d (phase %d)", path, self.state.global_step, self.state.phase_index + 1
        )
        return shared

    def _restore_phase_state(self, shared: dict[str, Any]) -> None:
        if shared.get("lr_scheduler") is None or self.state.step_in_phase == 0:
            return
        self.scheduler.load_state_dict(shared["lr_scheduler"])
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr
        assert self.data is not None
        self.data.load_state_dict(shared["dataloader"])

    # -- signals, logging, summary --------------------------------------------------------------------
    def _install_signal_handlers(self) -> None:
        """SIGTERM/SIGUSR1 (and submitit's preemption signal): checkpoint after the current step."""
        signums = [signal.SIGTERM, signal.SIGUSR1]
        if os.environ.get("SUBMITIT_EXECUTOR") == "slurm":
            signums.append(getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")))

        def handler(signum, frame):
            if self._signal is None:  # the first one decides
                self._signal = signum

        self._previous_handlers = {signum: signal.signal(signum, handler) for signum in signums}

    def _hand_over_signal(self) -> None:
        """After the checkpoint: let submitit's own handler (requeue) run, if there was one."""
        previous = self._previous_handlers.get(self._signal) if self._signal is not None else None
        if callable(previous):
            previous(self._signal, None)

    def _agree_on_signal(self) -> int:
        """The signal a rank received since the last step (the highest number when several did; 0: none),
        the same on every rank, so that each names it (not only the rank the scheduler signalled)."""
        flag = torch.tensor([float(self._signal or 0)], device=self.env.device)
        if self.env.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def _run_config(self) -> dict[str, Any]:
        """The resolved config, secrets redacted, plus flat keys to group runs by (W&B cannot group by a
        list element such as batch.phases[0].global_batch); also written to <run_dir>/config.yaml."""
        config = dict(OmegaConf.to_container(OmegaConf.structured(self.cfg)))  # type: ignore[arg-type]
        config.update(
            optimizer=self.cfg.optim.name,
            global_batch=self.phases[0].global_batch,
            world_size=self.env.world_size,
            # what the compressed allreduce runs on this device (numba, compiled, or torch ops + a packer)
            comm_kernels=describe_kernels(self.env.device) if self.onebit else None,
            # the overrides this process was started with (None when not started as `python -m pretrain`)
            command=" ".join(["python -m pretrain", *sys.argv[1:]]) if _started_as_pretrain() else None,
        )
        return scrub_secrets(config)

    def _build_logger(self) -> MetricsLogger:
        if not self.env.is_main:
            return NullLogger()
        run_config = self._run_config()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.run_dir / f".config.yaml.tmp-{os.getpid()}"
        tmp.write_text(OmegaConf.to_yaml(run_config))
        os.replace(tmp, self.run_dir / "config.yaml")
        loggers: list[MetricsLogger] = [JsonlLogger(self.run_dir / "metrics.jsonl"), ConsoleLogger()]
        wandb = self.cfg.wandb
        if wandb.mode.value != "disabled":
            loggers.append(
                WandbLogger(
                    project=wandb.project,
                    group=wandb.group or self.cfg.batch.name,
                    name=self.cfg.run_name,
                    tags=[*wandb.tags, self.cfg.optim.name, self.cfg.batch.name, self.cfg.model.size.value],
                    mode=wandb.mode.value,
                    config=run_config,
                    directory=self.run_dir,
                )
            )
        return FanoutLogger(*loggers)

    def _describe(self) -> None:
        if not self.env.is_main:
            return
        print(
            f"dry run: {self.cfg.model.size.value} with {self.num_params / 1e6:.1f}M parameters, "
            f"optim={self.cfg.optim.name}, world size {self.env.world_size}, {self.env.backend}"
            + (f", {self.workers} workers ({self.cfg.sim_world_size} per process)" if self.simulated else "")
        )
        world_sizes = [self.workers]
        if self.cfg.dry_run_world_size and self.cfg.dry_run_world_size != self.workers:
            world_sizes.append(self.cfg.dry_run_world_size)
        for phase in self.phases:
            folder = phase_folder(self.cfg.data_dir, phase.max_seq_length)
            instances = load_manifest(folder)["num_instances"]
            for world in world_sizes:
                accumulation = phase.accumulation_steps(world)
                print(
                    f"  {phase.name}: seq {phase.max_seq_length}, global batch {phase.global_batch} = "
                    f"{world} x {phase.micro_batch} x {accumulation} accumulation, {phase.steps} steps, "
                    f"lr {phase.lr}, data {instances} instances in {folder}"
                )

    def _write_summary(self) -> None:
        if self.env.is_main:
            summary = {"run_name": self.cfg.run_name, **asdict(self.state)}
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))

    def close(self) -> None:
        self.logger.close()


class _Timer:
    def __init__(self, device: torch.device):
        self.device = device
        self.laps: dict[str, float] = {}
        self.start = self.last = time.perf_counter()

    def lap(self, name: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.laps[name] = now - self.last
        self.last = now

    @property
    def total(self) -> float:
        return self.last - self.start


def _started_as_pretrain() -> bool:
    main = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path()
    return main.name == "__main__.py" and main.parent.name == "pretrain"


def _onebit_bytes(optimizer: Any) -> float:
    """Cumulative bytes a 1-bit optimizer sent itself (compressed calls, exact exchanges; 0 for others)."""
    traffic = getattr(optimizer, "traffic", None)
    return float(traffic.bytes_sent) if traffic is not None else 0.0


def _resolve_precision(precision: Precision, device: torch.device) -> Precision:
    if precision is Precision.auto:
        return Precision.bf16 if device.type == "cuda" else Precision.fp32
    if device.type != "cuda" and precision is not Precision.fp32:
        log.warning("precision=%s needs CUDA; using fp32 on %s", precision.value, device)
        return Precision.fp32
    return precision


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
