"""The trainer's counters and step metrics: samples, tokens and bytes per step, and at log steps the
losses, throughput, phase times, traffic, gradient noise scale and MFU.

`TrainState` holds the counters (checkpointed under `train_state`); `StepMetrics` advances them after
every optimizer step (`count`, no host sync: tokens are summed on the device and folded in at log steps
and saves, `flush_tokens`) and builds the log step's metrics (`metrics`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pretrain.comm.counter import ring_allreduce_bytes
from pretrain.config import PhaseConfig
from pretrain.distributed.gradient_sync import GradientSync
from pretrain.optim.protocol import TrainingOptimizer
from pretrain.train.precision import NoScaler


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


class StepTimer:
    """Wall time of a step's named phases (CUDA: synchronized at each lap)."""

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


class StepMetrics:
    """Counters and log-step metrics of one rank.

    `workers`: data-parallel workers (processes x simulated workers per process); `simulated`: whether
    this process stands for several (their gradient bytes are computed, not measured); `peak_tflops`: the
    device's peak for MFU (CUDA only; None or 0: no MFU); `report_stage`: log `onebit_stage` (whether the
    next step skips the gradient allreduce), for optimizers with a compression stage.
    """

    def __init__(
        self,
        optimizer: TrainingOptimizer,
        sync: GradientSync,
        scaler: NoScaler,
        device: torch.device,
        world_size: int,
        *,
        workers: int,
        num_params: int,
        simulated: bool,
        peak_tflops: float | None,
        report_stage: bool,
    ):
        self.optimizer, self.sync, self.scaler = optimizer, sync, scaler
        self.device, self.world_size, self.workers = device, world_size, workers
        self.num_params, self.simulated = num_params, simulated
        self.peak_tflops, self.report_stage = peak_tflops, report_stage
        self._pending_tokens = torch.zeros((), device=device)

    def gradient_bytes(self) -> float:
        """Bytes a worker sent averaging gradients this step (a simulated run: what its workers would)."""
        if not self.simulated:
            return self.sync.bytes_sent
        return ring_allreduce_bytes(self.num_params, self.sync.dtype.itemsize, self.workers)

    def count(
        self,
        state: TrainState,
        phase: PhaseConfig,
        totals: torch.Tensor,
        sync: bool,
        skipped: bool,
        optimizer_bytes: float,
    ) -> None:
        """After an optimizer step (skipped or not): `totals` the step's [mlm, nsp, correct, masked,
        non-pad tokens], `sync` whether gradients were averaged, `optimizer_bytes` what the optimizer sent."""
        state.global_step += 1
        state.step_in_phase += 1
        state.skipped_steps += int(skipped)
        state.samples_seen += phase.global_batch
        # tokens: this rank's count x world size (exact per-rank counts would need a collective per step);
        # summed on the device and folded into the state at log steps and saves (no host sync per step)
        self._pending_tokens += totals[4]
        state.bytes_sent += self.gradient_bytes() if sync else optimizer_bytes
        if self.workers > 1:
            state.bytes_lamb_equivalent += ring_allreduce_bytes(self.num_params, 4, self.workers)

    def flush_tokens(self, state: TrainState) -> None:
        """Fold the tokens counted on the device into `state` (one host sync)."""
        state.tokens_seen += int(self._pending_tokens.item()) * self.world_size
        self._pending_tokens.zero_()

    def metrics(
        self,
        state: TrainState,
        phase: PhaseConfig,
        totals: torch.Tensor,
        timer: StepTimer,
        grad_norm: float | None,
        accumulation: int,
        *,
        lr: float,
        epoch: int,
    ) -> dict[str, float]:
        """The log step's metrics (collective: the totals are summed over ranks)."""
        self.flush_tokens(state)
        if self.world_size > 1:
            dist.all_reduce(totals)
        mlm, nsp = (totals[:2] / (accumulation * self.workers)).tolist()
        seconds = timer.total
        metrics: dict[str, float] = {
            "loss": mlm + nsp,
            "mlm_loss": mlm,
            "nsp_loss": nsp,
            "mlm_accuracy": float(totals[2] / totals[3].clamp(min=1)),
            "lr": lr,
            "phase": state.phase_index + 1,
            "epoch": epoch,
            "samples_seen": state.samples_seen,
            "tokens_seen": state.tokens_seen,
            "skipped_steps": state.skipped_steps,
            "loss_scale": self.scaler.scale,
            "samples_per_s": phase.global_batch / seconds,
            "tokens_per_s": float(totals[4]) / seconds,
            "step_seconds": seconds,
            **{f"time_{name}": value for name, value in timer.laps.items()},
            "time_communication": self.sync.seconds,
            "bytes_step": self.gradient_bytes() if self.sync.enabled else 0.0,
            "bytes_cumulative": state.bytes_sent,
            "bytes_lamb_cumulative": state.bytes_lamb_equivalent,
        }
        if state.bytes_sent:
            metrics["volume_reduction_vs_lamb"] = state.bytes_lamb_equivalent / state.bytes_sent
        if grad_norm is not None:
            metrics["grad_norm"] = grad_norm
            noise_scale = self.gradient_noise_scale(grad_norm, phase, accumulation)
            if noise_scale is not None:
                metrics["gradient_noise_scale"] = noise_scale
        if self.report_stage:
            metrics["onebit_stage"] = float(not self.optimizer.needs_gradient_allreduce)
        metrics.update({f"optim/{k}": float(v) for k, v in self.optimizer.statistics().items()})
        if self.device.type == "cuda" and self.peak_tflops:
            flops = 6 * self.num_params * metrics["tokens_per_s"]  # dense training FLOPs per token
            metrics["mfu"] = flops / (self.peak_tflops * 1e12 * self.world_size)
        return metrics

    def gradient_noise_scale(self, grad_norm: float, phase: PhaseConfig, accumulation: int) -> float | None:
        """B_simple = tr(Σ)/|G|² from the per-rank (small batch) and averaged (big batch) gradient norms."""
        if not (self.sync.measure and self.sync.enabled):
            return None
        local = self.sync.local_square_norm.reshape(1).float() / self.scaler.scale**2
        dist.all_reduce(local)
        small_sq = float(local) / self.world_size
        big_sq = grad_norm**2
        b_small, b_big = phase.micro_batch * accumulation, phase.global_batch
        true_sq = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
        trace = (small_sq - big_sq) / (1 / b_small - 1 / b_big)
        return trace / true_sq if true_sq > 0 else None
