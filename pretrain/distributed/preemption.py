"""Preemption: SIGTERM/SIGUSR1 (and submitit's preemption signal) ask for a checkpoint after the
current step; the trainer then raises `Preempted` and `python -m pretrain` exits with
`PREEMPTED_EXIT_CODE` (resume with resume=auto)."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import torch
import torch.distributed as dist

PREEMPTED_EXIT_CODE = 75  # checkpoint written on SIGTERM/SIGUSR1; resume with resume=auto


def preemption_signals() -> list[signal.Signals]:
    """The signals that ask for a checkpoint: SIGTERM, SIGUSR1, and submitit's preemption signal under it."""
    signums = [signal.SIGTERM, signal.SIGUSR1]
    if os.environ.get("SUBMITIT_EXECUTOR") == "slurm":
        signums.append(getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")))
    return signums


def ignore_in_data_worker(worker_id: int) -> None:
    """DataLoader `worker_init_fn`: a data worker leaves the preemption signals to the trainer, except its
    parent's SIGTERM, which stops it as torch's own worker stops.

    The signals often reach the whole process group or job step, the data workers too: torchrun's agent
    sends its own SIGTERM to each worker's process group, Slurm signals every process of a step on cancel or
    preemption, `kill -- -PGID` does. torch's worker dies of a SIGTERM from anyone but its parent, and the
    trainer then fails with "DataLoader worker ... is killed by signal" inside the checkpoint it was asked to
    write. Its parent's SIGTERM must still stop it: the loader's shutdown and multiprocessing's exit handler
    terminate a worker still alive and then wait for it (a trainer leaving on an error would wait forever).
    Python's handlers do not see the sender, so the signals are blocked and a thread takes them with
    `sigwaitinfo`, which does."""
    signums = set(preemption_signals())
    signal.pthread_sigmask(signal.SIG_BLOCK, signums)  # this thread and every one started after it
    parent = os.getppid()

    def take() -> None:
        while True:
            info = signal.sigwaitinfo(signums)
            if info.si_signo == signal.SIGTERM and info.si_pid == parent:
                os._exit(0)

    threading.Thread(target=take, name="data-worker-signals", daemon=True).start()


class Preempted(Exception):
    """Raised after the checkpoint on SIGTERM/SIGUSR1 has been written."""


class PreemptionSignals:
    """Records the first preemption signal this process receives; the ranks agree on it after each step
    (`agree`, collective), so that every rank checkpoints at the same step and names the signal."""

    def __init__(self, device: torch.device, world_size: int):
        self.device, self.world_size = device, world_size
        self.received: int | None = None
        self._previous_handlers: dict[int, Any] = {}

    def install(self) -> None:
        signums = preemption_signals()

        def handler(signum, frame):
            if self.received is None:  # the first one decides
                self.received = signum

        self._previous_handlers = {signum: signal.signal(signum, handler) for signum in signums}

    def agree(self) -> int:
        """The signal a rank received since the last step (the highest number when several did; 0: none),
        the same on every rank, so that each names it (not only the rank the scheduler signalled)."""
        flag = torch.tensor([float(self.received or 0)], device=self.device)
        if self.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def hand_over(self) -> None:
        """After the checkpoint: let submitit's own handler (requeue) run, if there was one."""
        previous = self._previous_handlers.get(self.received) if self.received is not None else None
        if callable(previous):
            previous(self.received, None)

    def preempted(self, signum: int, step: int) -> Preempted:
        """The exception to raise once the checkpoint of `step` is written."""
        return Preempted(f"{signal.Signals(signum).name}: checkpoint written at step {step}")
