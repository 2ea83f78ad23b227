"""Test-only fault injection for the reliability suite (tests/reliability/): kill, signal or poison the
gradients of a training process at a chosen step. No effect unless BERT_LAMB_TEST_FAULT is set.

    BERT_LAMB_TEST_FAULT="kill@13:mid_step,rank=1"                  # SIGKILL rank 1 inside step 13
    BERT_LAMB_TEST_FAULT="kill@12:checkpoint_write,scope=job"       # stop there; the harness kills the job
    BERT_LAMB_TEST_FAULT="term@22,rank=1;nan@30,rank=0"             # several faults: ';'-separated
    BERT_LAMB_TEST_FAULT="kill@9:exchange,rank=1"                   # die inside the 1-bit exchange
    BERT_LAMB_TEST_FAULT="stop@5,rank=1"                            # SIGSTOP: a stalled rank
    BERT_LAMB_TEST_FAULT="hold@7:exchange,rank=1"                   # wait there for the harness to act

A fault is `<action>@<step>[:<point>]` followed by `,key=value` options:

    action   kill        SIGKILL this process (scope=process), or, with scope=job, create the file named
                         by BERT_LAMB_TEST_FAULT_FILE and wait there to be killed with the whole job
             term, usr1  send this process SIGTERM / SIGUSR1 (the preemption path)
             stop        SIGSTOP this process (a stalled rank: alive, holding its sockets, silent)
             nan, inf    after backward, set one gradient element of this rank to NaN / +Inf
             hold        write `<pid> <rank> <point> <step>` to the file named by BERT_LAMB_TEST_FAULT_FILE
                         and wait until the harness removes it: the harness acts from outside at that
                         exact point (SIGSTOP the rank, take the link down, fill the disk, flip a shard
                         byte; tests/chaos/), then lets the rank go on
    step     the global optimizer step (1-based, all phases) the point belongs to
    point    mid_step (after forward/backward, before the optimizer step; the default for kill),
             after_step (after the step's metrics, before its checkpoint; the default for signals),
             after_checkpoint (the checkpoint of that step is complete),
             checkpoint_write (every file of that step's checkpoint written, COMPLETE not yet),
             exchange (inside the 1-bit compressed allreduce: after the all-to-all of the workers'
             chunks, before the all-gather of the served chunks; the first call of the step),
             grad_allreduce (inside backward: DDP's first gradient bucket of the step, before its
             allreduce is issued)
    rank     the rank that acts (default 0)
    attempt  torchrun's TORCHELASTIC_RESTART_COUNT in which the fault fires (default 0), so a job that
             torchrun restarts does not fire it again
    scope    process (default) or job (kill only)
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pretrain.comm.compressed_allreduce import CompressedAllreduce

ENV = "BERT_LAMB_TEST_FAULT"
FILE_ENV = "BERT_LAMB_TEST_FAULT_FILE"
ACTIONS = ("kill", "term", "usr1", "stop", "nan", "inf", "hold")
POINTS = ("mid_step", "after_step", "after_checkpoint", "checkpoint_write", "exchange", "grad_allreduce")
_SIGNALS = {"term": signal.SIGTERM, "usr1": signal.SIGUSR1, "stop": signal.SIGSTOP}
# points inside the communication layer: the 1-bit exchange's, reached through the hook this module sets
# on it (`CompressedAllreduce.hook`), and the gradient allreduce's, through `inside` (pretrain/gradient_sync)
_INNER_POINTS = ("exchange", "grad_allreduce")
_active: FaultInjector | None = None


@dataclass(frozen=True)
class Fault:
    action: str
    step: int
    point: str
    rank: int = 0
    attempt: int = 0
    scope: str = "process"


def parse(spec: str) -> list[Fault]:
    """`BERT_LAMB_TEST_FAULT`'s value -> faults; ValueError naming the variable on a bad spec."""
    faults = []
    for text in filter(None, (part.strip() for part in spec.split(";"))):
        head, *options = text.split(",")
        try:
            action, _, where = head.partition("@")
            step_text, _, point = where.partition(":")
            values = dict(option.split("=", 1) for option in options)
            default_point = "mid_step" if action in ("kill", "stop", "nan", "inf", "hold") else "after_step"
            fault = Fault(
                action=action,
                step=int(step_text),
                point=point or default_point,
                rank=int(values.pop("rank", 0)),
                attempt=int(values.pop("attempt", 0)),
                scope=values.pop("scope", "process"),
            )
        except ValueError as error:
            raise ValueError(f"{ENV}: cannot parse {text!r} ({error})") from None
        known = action in ACTIONS and fault.point in POINTS and fault.scope in ("process", "job")
        if values or not known:
            raise ValueError(f"{ENV}: bad fault {text!r} (actions {ACTIONS}, points {POINTS})")
        faults.append(fault)
    return faults


class FaultInjector:
    """The faults of one rank in this attempt; every method is a no-op when there are none."""

    def __init__(self, faults: list[Fault], rank: int, attempt: int):
        self.faults = [f for f in faults if f.rank == rank and f.attempt == attempt]
        self.step = 0  # the step being trained (the communication layer's points belong to it)
        self._fired: set[Fault] = set()
        global _active
        _active = self if any(f.point in _INNER_POINTS for f in self.faults) else None
        # the exchanges the optimizers build call `inside` between their phases (one attribute check
        # per call when no such fault is set)
        exchange = any(f.point == "exchange" for f in self.faults)
        CompressedAllreduce.hook = self.inside if exchange else None

    @classmethod
    def from_env(cls, rank: int) -> FaultInjector:
        spec = os.environ.get(ENV, "")
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        return cls(parse(spec) if spec else [], rank, attempt)

    def at(self, point: str, step: int) -> None:
        """Kill or signal this process if a fault is set for (point, step)."""
        for fault in self.faults:
            if fault.point != point or fault.step != step or fault in self._fired:
                continue
            self._fired.add(fault)  # an inner point is reached several times per step; act on the first
            print(f"fault: {fault.action} rank {fault.rank} at step {step} ({point})", flush=True)
            if fault.action in _SIGNALS:
                os.kill(os.getpid(), _SIGNALS[fault.action])
            elif fault.action == "kill":
                _kill(fault)
            elif fault.action == "hold":
                _hold(fault, step)

    def inside(self, point: str) -> None:
        """A point of the communication layer was reached: act if a fault is set for it at the step being
        trained (`step`)."""
        self.at(point, self.step)

    def poison(self, step: int, params: list[torch.Tensor]) -> None:
        """Overwrite one gradient element with NaN/Inf if a fault is set for this step."""
        for fault in self.faults:
            if fault.step == step and fault.action in ("nan", "inf"):
                grad = next(p.grad for p in params if p.grad is not None)
                grad[(0,) * grad.dim()] = float("nan") if fault.action == "nan" else float("inf")


def inside(point: str) -> None:
    """A point of the gradient allreduce (`grad_allreduce`) was reached: act if a fault is set for it at
    the step being trained. One global check when no such fault is set."""
    if _active is not None:
        _active.inside(point)


def _hold(fault: Fault, step: int) -> None:
    """Announce the point in the fault file and wait (in 10 ms polls) until the harness removes it."""
    marker = os.environ.get(FILE_ENV)
    if not marker:
        raise RuntimeError(f"{ENV}: hold needs {FILE_ENV} (the file the harness waits for)")
    path = Path(marker)
    temporary = path.with_name(path.name + f".{os.getpid()}.tmp")
    temporary.write_text(f"{os.getpid()} {fault.rank} {fault.point} {step}\n")
    os.replace(temporary, path)  # the harness never reads a half-written line
    while path.exists():
        time.sleep(0.01)


def _kill(fault: Fault) -> None:
    if fault.scope == "process":
        os.kill(os.getpid(), signal.SIGKILL)
    marker = os.environ.get(FILE_ENV)
    if not marker:
        raise RuntimeError(f"{ENV}: scope=job needs {FILE_ENV} (the file the harness waits for)")
    Path(marker).write_text(f"{os.getpid()} {fault.point} {fault.step}\n")
    while True:  # the harness SIGKILLs every process of the job now
        time.sleep(1)
