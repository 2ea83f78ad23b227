"""The pretraining loop: phases of optimizer steps over DDP, with exact resume.

Per step (`train_step`): fetch the rank's micro-batches, forward/backward under `no_sync` except the
last micro-batch (DDP's hook averages gradients, or not at all in the 1-bit compression stage), the
optimizer step (the 1-bit optimizers exchange compressed momentum inside it), metrics at log steps.

The trainer is handed its components (`pretrain.train.train_setup.build_components`, the composition root):
model and DDP wrapper, the optimizer as `pretrain.optim.protocol.TrainingOptimizer`, loss scaler, phase
data, checkpoints and HF export (`pretrain.train.checkpointing`), counters and step metrics
(`pretrain.train.step_metrics`), preemption signals (`pretrain.distributed.preemption`), run records and
loggers
(`pretrain.train.run_records`), diagnostics and the test-only fault injector. `Trainer(cfg, env)` builds them.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from pretrain.config import PhaseConfig, TrainConfig
from pretrain.distributed.preemption import PREEMPTED_EXIT_CODE, Preempted
from pretrain.distributed.process_group import DistributedEnv, autocast_context
from pretrain.observability.metrics import MetricsLogger, NullLogger
from pretrain.optim.schedule import build_scheduler
from pretrain.train.phase_data import PhaseData
from pretrain.train.simulated import VirtualPhaseData
from pretrain.train.step_metrics import StepTimer, TrainState
from pretrain.train.train_setup import TrainerComponents, build_components

__all__ = ["PREEMPTED_EXIT_CODE", "Preempted", "TrainState", "Trainer"]


class Trainer:
    """Trains `cfg.batch.phases` in order on this rank; `fit()` runs (or resumes) the whole run.

    `components`: what `build_components(cfg, env)` builds, which is what happens when none are given;
    the trainer then reads the config as the components hold it (`TrainerComponents.cfg`)."""

    def __init__(self, cfg: TrainConfig, env: DistributedEnv, components: TrainerComponents | None = None):
        parts = components if components is not None else build_components(cfg, env)
        self.cfg, self.env, self.phases = parts.cfg, env, parts.cfg.batch.phases
        self.model, self.ddp, self.sync, self.optimizer = parts.model, parts.ddp, parts.sync, parts.optimizer
        self.scaler, self.precision, self.simulated = parts.scaler, parts.precision, parts.simulated
        self.workers, self.num_params = parts.workers, parts.num_params
        self.phase_data, self.checkpointer, self.step_metrics = parts.data, parts.checkpointer, parts.metrics
        self.signals, self.records = parts.signals, parts.records
        self.faults, self.diagnostics = parts.faults, parts.diagnostics
        self.state = TrainState()
        self.data: PhaseData | VirtualPhaseData | None = None
        self.scheduler: Any = None
        self.logger: MetricsLogger = NullLogger()

    # -- phases ----------------------------------------------------------------------------------------
    def _freeze_step_for(self, phase_index: int) -> int | None:
        """The last freeze_step set by this or an earlier phase (null continues the previous stage)."""
        values = [p.freeze_step for p in self.phases[: phase_index + 1] if p.freeze_step is not None]
        return values[-1] if values else None

    def _enter_phase(self, index: int) -> PhaseConfig:
        """The phase's peak LR and schedule, the optimizer's phase start, the phase's data."""
        phase = self.phases[index]
        for group in self.optimizer.param_groups:
            group["lr"] = phase.lr
            group.pop("initial_lr", None)  # LambdaLR would otherwise keep the previous phase's peak
        self.optimizer.start_phase(
            freeze_step=self._freeze_step_for(index), max_seq_length=phase.max_seq_length
        )
        self.scheduler = build_scheduler(self.optimizer, phase.schedule, phase.steps)
        if self.data is not None:
            self.data.close()
        self.data = self.phase_data.open(index, phase)
        return phase

    # -- the loop --------------------------------------------------------------------------------------
    def fit(self) -> TrainState:
        resume_from = self.checkpointer.resume_path()
        shared = None
        if resume_from:
            self.state, shared = self.checkpointer.load(resume_from)
        if self.cfg.dry_run:
            for index in range(len(self.phases)):
                self._enter_phase(index)
            self.records.describe_dry_run(self.num_params, self.workers)
            return self.state
        self.signals.install()
        self.logger = self.records.logger()
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
                if shared is not None:  # mid-phase resume: scheduler, data cursor
                    self.checkpointer.restore_phase(shared, self.state, self.scheduler, self.data)
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
                    self._after_step(phase)
                self.save()  # phase end
                self.state.phase_index += 1
                self.state.step_in_phase = 0
            self.records.write_summary(self.state)
            return self.state
        finally:
            bar.close()
            self.logger.close()
            if self.data is not None:
                self.data.close()

    def _after_step(self, phase: PhaseConfig) -> None:
        """A preemption signal on any rank: checkpoint and raise `Preempted`; else the periodic save."""
        signum = self.signals.agree()
        if signum:
            self.save()
            self.signals.hand_over()
            raise self.signals.preempted(signum, self.state.global_step)
        every = self.cfg.checkpoint.every_steps
        if every and self.state.global_step % every == 0 and self.state.step_in_phase < phase.steps:
            self.save(periodic=True)

    def train_step(self, phase: PhaseConfig) -> dict[str, float] | None:
        """One optimizer step of `phase.global_batch` samples; metrics on log steps, else None."""
        accumulation = phase.accumulation_steps(self.workers)
        step = self.state.global_step + 1
        self.faults.step = step  # the step the communication layer's points belong to
        timer = StepTimer(self.env.device)
        assert self.data is not None
        # fetch
        batches: Any = self.data.next_step(accumulation)  # simulated workers: one list per worker
        timer.lap("data")
        # forward / backward; the last micro-batch's backward runs the gradient sync hook
        sync = self.optimizer.needs_gradient_allreduce
        log_step = step % self.cfg.log_every == 0
        measure = log_step and sync and self.env.world_size > 1 and self.simulated is None
        self.sync.start_step(enabled=sync, measure=measure)
        if self.diagnostics is not None:
            self.diagnostics.begin_step(log_step)
        params: list[torch.Tensor] = [p for p in self.model.parameters() if p.requires_grad]
        totals = self._forward_backward(batches, accumulation, params)
        timer.lap("forward_backward")
        # optimizer (1-bit: compressed momentum exchange inside)
        self.faults.poison(step, params)
        self.faults.at("mid_step", step)
        # Inf/NaN on any rank: every rank skips the step (parameters, moments, 1-bit errors untouched)
        overflow = self.scaler.unscale_and_check(params)
        grad_norm = float(self.scaler.grad_norm) if log_step and self.scaler.grad_norm is not None else None
        skipped, optimizer_bytes = self._optimizer_step(overflow)
        diagnostics = self.diagnostics.end_step(skipped) if self.diagnostics is not None else {}
        self.scaler.update(skipped)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        timer.lap("optimizer")
        # counters and metrics
        self.step_metrics.count(self.state, phase, totals, sync, skipped, optimizer_bytes)
        if not log_step:
            return None
        lr, epoch = self.optimizer.param_groups[0]["lr"], self.data.epoch if self.data else 0
        metrics = self.step_metrics.metrics(
            self.state, phase, totals, timer, grad_norm, accumulation, lr=lr, epoch=epoch
        )
        return {**metrics, **diagnostics}

    def _forward_backward(self, batches: Any, accumulation: int, params: list[torch.Tensor]) -> torch.Tensor:
        """Every micro-batch's forward and backward; -> [mlm loss, nsp loss, correct, masked, non-pad
        tokens] summed over them (and over the simulated workers)."""
        if self.simulated is not None:  # k workers; their gradients averaged, or kept apart for 1-bit
            return self.simulated.forward_backward(
                batches, lambda batch: self._micro_step(batch, accumulation), self.optimizer, params
            )
        totals = torch.zeros(5, device=self.env.device)
        for index, batch in enumerate(batches):
            totals += self._micro_step(batch, accumulation, sync_gradients=index == accumulation - 1)
        return totals

    def _optimizer_step(self, overflow: bool) -> tuple[bool, float]:
        """The optimizer's step unless some rank's gradients overflowed; -> (whether the step was skipped,
        the bytes the optimizer sent in it)."""
        bytes_before = self.optimizer.bytes_sent
        if not overflow:
            self.optimizer.mark_gradients_checked(self.scaler.grad_norm)  # the step need not check again
            self.optimizer.step()
        return overflow or self.optimizer.last_step_skipped, self.optimizer.bytes_sent - bytes_before

    def _micro_step(self, batch: dict[str, torch.Tensor], accumulation: int, sync_gradients: bool = False):
        """Forward and backward of one micro-batch (gradients synchronized by DDP's hook only when asked);
        -> [mlm loss, nsp loss, correct, masked, non-pad tokens]."""
        batch = {k: v.to(self.env.device, non_blocking=True) for k, v in batch.items()}
        with self.ddp.no_sync() if not sync_gradients else nullcontext():
            with autocast_context(self.env.device, self.precision.value):
                mlm, nsp, correct, masked = self.ddp(**batch)
            # the mean over this rank's micro-batches (docs/pretraining.md, "Optimizers"), in every stage
            self.scaler.scale_loss((mlm + nsp) / accumulation).backward()
        return torch.stack([mlm.detach(), nsp.detach(), correct, masked, batch["attention_mask"].sum()])

    # -- checkpoints -----------------------------------------------------------------------------------
    def save(self, periodic: bool = False) -> Path | None:
        """Write a checkpoint (collective). A periodic one that fails (full disk) with
        checkpoint.on_error=continue is skipped with a warning (-> None); any other failure raises."""
        self.step_metrics.flush_tokens(self.state)
        return self.checkpointer.save(self.state, self.scheduler, self.data, periodic=periodic)

    def close(self) -> None:
        self.logger.close()
