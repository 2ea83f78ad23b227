"""The trainer's pieces without a training run: the optimizers' loop interface (`TrainingOptimizer`),
step counters and metrics, preemption signals, where a resume starts."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from pretrain.checkpoint import CheckpointError
from pretrain.config import CheckpointConfig, PhaseConfig
from pretrain.distributed.faults import FaultInjector
from pretrain.distributed.gradient_sync import GradientSync
from pretrain.distributed.preemption import PreemptionSignals
from pretrain.optim import OPTIMIZERS, OnebitOptimizer, build_optimizer
from pretrain.optim.protocol import TrainingOptimizer, as_training_optimizer
from pretrain.train.checkpointing import Checkpointer
from pretrain.train.precision import NoScaler
from pretrain.train.step_metrics import StepMetrics, StepTimer, TrainState
from pretrain.train.train_setup import compresses


def _groups() -> list[dict]:
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(4, 3))
    positions = torch.nn.Parameter(torch.randn(6, 3))
    mask = torch.zeros(6, 1)
    mask[:2] = 1.0
    return [
        {"params": [weight], "weight_decay": 0.01},
        {"params": [positions], "weight_decay": 0.01, "exp_avg_mask": mask},
    ]


def _build(name: str):
    optimizer_class, config_class = OPTIMIZERS[name]
    config = config_class()
    groups = _groups() if issubclass(optimizer_class, OnebitOptimizer) else _groups()[:1]
    return build_optimizer(name, config, groups)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_registered_optimizer_keeps_the_loop_interface(name):
    optimizer = as_training_optimizer(_build(name))
    assert isinstance(optimizer, TrainingOptimizer)
    assert optimizer.needs_gradient_allreduce  # a fresh optimizer averages gradients (warmup)
    assert optimizer.bytes_sent == 0.0 and not optimizer.last_step_skipped
    assert all(isinstance(v, float) for v in optimizer.statistics().values())
    for p in (p for group in optimizer.param_groups for p in group["params"]):
        p.grad = torch.ones_like(p)
    optimizer.mark_gradients_checked(None)
    optimizer.step()
    assert not optimizer.last_step_skipped
    assert optimizer.bytes_sent == 0.0  # one process: nothing on the wire


def test_a_plain_torch_optimizer_is_refused_by_name():
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(TypeError, match="SGD does not keep TrainingOptimizer"):
        as_training_optimizer(sgd)


def test_start_phase_moves_freeze_step_and_the_position_mask_of_a_onebit_optimizer():
    optimizer = as_training_optimizer(_build("onebit_lamb"))
    assert isinstance(optimizer, OnebitOptimizer)
    optimizer.start_phase(freeze_step=7, max_seq_length=4)
    assert optimizer.freeze_step == 7
    mask = optimizer.param_groups[-1]["exp_avg_mask"]
    assert mask.flatten().tolist() == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    optimizer.start_phase(freeze_step=None, max_seq_length=3)  # null: the stage goes on
    assert optimizer.freeze_step == 7
    assert mask.flatten().tolist() == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("name", ["lamb", "adamw"])
def test_start_phase_changes_nothing_in_a_plain_optimizer(name):
    optimizer = as_training_optimizer(_build(name))
    before = [dict(group) for group in optimizer.param_groups]
    optimizer.start_phase(freeze_step=3, max_seq_length=4)
    assert [dict(group) for group in optimizer.param_groups] == before


def test_the_composition_root_tells_the_onebit_optimizers_by_their_class():
    assert {name for name in OPTIMIZERS if compresses(name)} == {
        name for name, (cls, _) in OPTIMIZERS.items() if issubclass(cls, OnebitOptimizer)
    }
    assert not compresses("lamb") and not compresses("no_such_optimizer")


def _metrics(workers: int = 1) -> StepMetrics:
    optimizer = as_training_optimizer(_build("lamb"))
    sync = GradientSync(None, 1)
    return StepMetrics(
        optimizer,
        sync,
        NoScaler(),
        torch.device("cpu"),
        1,
        workers=workers,
        num_params=12,
        simulated=False,
        peak_tflops=None,
        report_stage=False,
    )


def test_counters_advance_per_step_and_tokens_fold_in_at_a_flush():
    metrics, state = _metrics(), TrainState()
    phase = PhaseConfig(name="p", max_seq_length=8, global_batch=4, micro_batch=4, steps=3, lr=1e-3)
    totals = torch.tensor([1.0, 0.5, 3.0, 6.0, 20.0])
    metrics.count(state, phase, totals, sync=False, skipped=True, optimizer_bytes=100.0)
    metrics.count(state, phase, totals, sync=False, skipped=False, optimizer_bytes=50.0)
    assert (state.global_step, state.step_in_phase, state.skipped_steps, state.samples_seen) == (2, 2, 1, 8)
    assert state.bytes_sent == 150.0 and state.bytes_lamb_equivalent == 0.0  # one worker: no traffic
    assert state.tokens_seen == 0
    metrics.flush_tokens(state)
    assert state.tokens_seen == 40


def test_log_step_metrics_name_losses_throughput_and_the_optimizer_statistics():
    metrics, state = _metrics(), TrainState()
    phase = PhaseConfig(name="p", max_seq_length=8, global_batch=4, micro_batch=2, steps=3, lr=1e-3)
    totals = torch.tensor([2.0, 1.0, 3.0, 6.0, 20.0])
    timer = StepTimer(torch.device("cpu"))
    timer.lap("data")
    metrics.count(state, phase, totals, sync=True, skipped=False, optimizer_bytes=0.0)
    logged = metrics.metrics(state, phase, totals, timer, None, 2, lr=0.5, epoch=1)
    assert logged["loss"] == pytest.approx(1.5) and logged["mlm_accuracy"] == 0.5
    assert (logged["lr"], logged["epoch"], logged["tokens_seen"]) == (0.5, 1, 20)
    assert "time_data" in logged and logged["optim/skipped_steps"] == 0.0
    assert "onebit_stage" not in logged and "mfu" not in logged


def test_the_ranks_agree_on_a_received_signal_and_name_it():
    signals = PreemptionSignals(torch.device("cpu"), world_size=1)
    assert signals.agree() == 0
    signals.received = signal.SIGUSR1
    assert signals.agree() == signal.SIGUSR1
    assert str(signals.preempted(signal.SIGUSR1, 12)) == "SIGUSR1: checkpoint written at step 12"


def _checkpointer(tmp_path: Path, resume: str) -> Checkpointer:
    model = torch.nn.Linear(2, 2)
    optimizer = _build("lamb")
    return Checkpointer(
        tmp_path / "checkpoints",
        CheckpointConfig(),
        resume=resume,
        rank=0,
        world_size=1,
        model=model,
        optimizer=optimizer,
        optim_config=OPTIMIZERS["lamb"][1](),
        scaler=NoScaler(),
        simulated=None,
        faults=FaultInjector([], 0, 0),
        hf_export=None,
    )


def test_a_resume_starts_nowhere_at_the_newest_checkpoint_or_at_a_named_folder(tmp_path: Path):
    assert _checkpointer(tmp_path, "none").resume_path() is None
    assert _checkpointer(tmp_path, "auto").resume_path() is None  # no checkpoint yet
    assert _checkpointer(tmp_path, str(tmp_path)).resume_path() == tmp_path
    with pytest.raises(CheckpointError, match="is not a checkpoint folder"):
        _checkpointer(tmp_path, str(tmp_path / "missing")).resume_path()


def _one_worker_data(tiny_data: Path):
    """Phase 1's data on one rank, micro-batches of 1 from one DataLoader worker."""
    from pretrain.train.phase_data import PhaseData, phase_folder

    return PhaseData(
        phase_folder(tiny_data, 128), global_batch=2, micro_batch=1, rank=0, world_size=1, seed=1,
        num_workers=1, vocab_size=None,
    )  # fmt: skip


def test_a_data_worker_outlives_a_preemption_signal_to_its_process_group(tiny_data: Path):
    """torchrun's agent, Slurm's cancel and `kill -- -PGID` signal the data workers too: they must leave the
    signal to the trainer (torch's own worker dies of a SIGTERM sent by anyone but its parent, and the
    trainer then fails inside the checkpoint the signal asked for)."""
    data = _one_worker_data(tiny_data)
    first = data.next_step(2)
    workers = data._iterator._workers  # type: ignore[union-attr]
    for name in ("TERM", "USR1"):  # from another process, as the agent or Slurm sends them
        subprocess.run(["kill", f"-{name}", *(str(worker.pid) for worker in workers)], check=True)
    time.sleep(0.5)
    assert all(worker.is_alive() for worker in workers)
    assert [len(batch["input_ids"]) for batch in first + data.next_step(2)] == [1] * 4


def test_a_data_worker_still_stops_on_its_parents_sigterm(tiny_data: Path):
    """The loader's shutdown and multiprocessing's exit handler terminate a live worker and then wait for
    it: a worker ignoring its parent's SIGTERM too would hang a trainer leaving on an error."""
    data = _one_worker_data(tiny_data)
    data.next_step(2)
    (worker,) = data._iterator._workers  # type: ignore[union-attr]
    worker.terminate()  # SIGTERM from this process, the worker's parent
    worker.join(timeout=10)
    assert worker.exitcode == 0
    data.close()
