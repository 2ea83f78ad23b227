"""kill -9 a 2-rank 1-bit LAMB pretraining job (torchrun, gloo) at chosen points of the warmup stage, at
freeze_step, in the compression stage and in phase 2; resume=auto must continue exactly: the loss
trajectory (every non-timing metric of every step) and the final checkpoint (parameters, every rank's
optimizer state with the 1-bit error buffers, RNG, data cursor) are bitwise identical to an
uninterrupted run's.

One job is interrupted again and again: each launch carries the next fault (pretrain/distributed/faults.py)
and
resumes from what the previous one left. CI runs 3 kill points on a shortened recipe (20 steps);
RELIABILITY_FULL=1 runs 10 on the whole demo recipe (50 steps). Also covered on the way: a kill while a
checkpoint is being written (the partial `.tmp` is never resumed from), SIGTERM to one rank (every rank
checkpoints, exits 75), and torchrun --max-restarts restarting a job after a rank dies.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from pretrain.checkpoint import latest_checkpoint, list_checkpoints
from tests.reliability.conftest import full_suite
from tests.reliability.harness import (
    Segment,
    check_outcome,
    checkpoint_digests,
    compare_trajectories,
    final_checkpoint,
    pretrain_overrides,
    read_metrics,
    resumed_from,
    torchrun,
)

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]


@dataclass(frozen=True)
class Plan:
    recipe: tuple[str, ...]  # overrides of the demo recipe
    total_steps: int
    freeze_step: int
    phase1_steps: int
    segments: tuple[tuple[Segment, int | None], ...]  # (launch, newest complete checkpoint it leaves)


# CI: 16 + 4 steps, freeze_step 6. Kills: warmup, at freeze_step (while its checkpoint is written), phase 2.
CI_PLAN = Plan(
    recipe=(
        "batch.phases.0.steps=16",
        "batch.phases.0.freeze_step=6",
        "batch.phases.0.schedule.warmup_steps=4",
        "batch.phases.1.steps=4",
        "batch.phases.1.schedule.warmup_steps=1",
    ),
    total_steps=20,
    freeze_step=6,
    phase1_steps=16,
    segments=(
        (Segment("warmup: kill -9 rank 1 inside step 4", "kill@4:mid_step,rank=1", expect="killed"), 3),
        (
            Segment(
                "freeze_step: kill -9 the whole job while step 6's checkpoint is written",
                "kill@6:checkpoint_write,scope=job",
                expect="job_killed",
            ),
            5,
        ),
        (Segment("compression: SIGTERM to rank 1 after step 11", "term@11,rank=1", expect="preempted"), 11),
        (
            Segment(
                "phase 2: kill -9 rank 0 inside step 18, torchrun --max-restarts 1 restarts the job",
                "kill@18:mid_step,rank=0",
                max_restarts=1,
            ),
            20,
        ),
    ),
)

# The slow suite: the whole demo recipe (40 + 10 steps, freeze_step 12), 10 kill points.
FULL_PLAN = Plan(
    recipe=(),
    total_steps=50,
    freeze_step=12,
    phase1_steps=40,
    segments=(
        (Segment("warmup: kill -9 rank 1 inside step 3", "kill@3:mid_step,rank=1", expect="killed"), 2),
        (
            Segment(
                "warmup: kill -9 the job after step 7 was logged, before its checkpoint",
                "kill@7:after_step,scope=job",
                expect="job_killed",
            ),
            6,
        ),
        (
            Segment(
                "freeze_step: kill -9 the job right after step 12's checkpoint",
                "kill@12:after_checkpoint,scope=job",
                expect="job_killed",
            ),
            12,
        ),
        (
            Segment(
                "first compression step: kill -9 rank 0 inside step 13", "kill@13:mid_step", expect="killed"
            ),
            12,
        ),
        (
            Segment(
                "compression: kill -9 the job while step 17's checkpoint is written",
                "kill@17:checkpoint_write,scope=job",
                expect="job_killed",
            ),
            16,
        ),
        (
            Segment(
                "compression: kill -9 rank 0 while step 21's checkpoint is written",
                "kill@21:checkpoint_write,rank=0",
                expect="killed",
            ),
            20,
        ),
        (Segment("compression: SIGTERM to rank 1 after step 25", "term@25,rank=1", expect="preempted"), 25),
        (
            Segment(
                "compression: kill -9 the whole job inside step 29",
                "kill@29:mid_step,scope=job",
                expect="job_killed",
            ),
            28,
        ),
        (
            Segment(
                "phase end: kill -9 rank 1 after step 40 was logged, before the phase-end checkpoint",
                "kill@40:after_step,rank=1",
                expect="killed",
            ),
            39,
        ),
        (Segment("phase 2: kill -9 rank 0 inside step 43", "kill@43:mid_step", expect="killed"), 42),
        (
            Segment(
                "phase 2: kill -9 rank 1 inside step 47, torchrun --max-restarts 1 restarts the job",
                "kill@47:mid_step,rank=1",
                max_restarts=1,
            ),
            50,
        ),
    ),
)


def _fault_step(segment: Segment) -> int:
    assert segment.fault is not None
    return int(segment.fault.split("@")[1].split(":")[0].split(",")[0])


def test_kill9_resume_is_bitwise_identical(tiny_data: Path, tmp_path: Path, record, request):
    plan = FULL_PLAN if full_suite() else CI_PLAN
    run_dir = tmp_path / "interrupted"
    # the reference checkpoints only at phase ends: checkpointing must not perturb the trajectory either
    if plan is CI_PLAN:  # the session's, shared with test_faults.py
        reference_dir = request.getfixturevalue("ci_reference_run")
    else:
        reference_dir = tmp_path / "uninterrupted"
        reference = torchrun(
            pretrain_overrides(tiny_data, reference_dir, *plan.recipe, "checkpoint.every_steps=0"),
            tmp_path / "uninterrupted.log",
        )
        assert reference.returncode == 0, reference.log[-3000:]
    previous_checkpoint: int | None = None
    kills = 0
    for index, (segment, expected_checkpoint) in enumerate(plan.segments):
        outcome = torchrun(
            pretrain_overrides(tiny_data, run_dir, *plan.recipe),
            tmp_path / f"launch-{index}.log",
            fault=segment.fault,
            fault_file=tmp_path / "fault-reached",
            max_restarts=segment.max_restarts,
        )
        check_outcome(segment, outcome)
        # the launch continued from the previous one's checkpoint; after a torchrun restart, from its own
        resumes = {previous_checkpoint} if previous_checkpoint is not None else set()
        if segment.max_restarts:
            resumes.add(_fault_step(segment) - 1)
        assert set(resumed_from(outcome.log)) == resumes, segment.name
        newest = latest_checkpoint(run_dir / "checkpoints")
        assert newest is not None and newest.name == f"step-{expected_checkpoint:08d}", (segment.name, newest)
        if "checkpoint_write" in (segment.fault or ""):  # the partial checkpoint is there and ignored
            partial = run_dir / "checkpoints" / f"step-{_fault_step(segment):08d}.tmp"
            assert partial.is_dir() and not (partial / "COMPLETE").exists(), segment.name
            assert partial not in list_checkpoints(run_dir / "checkpoints")
        kills += segment.fault is not None and segment.fault.startswith("kill")
        record(
            "interruption",
            name=segment.name,
            fault=segment.fault,
            kill9=segment.fault is not None and segment.fault.startswith("kill"),
            resumed_from=expected_checkpoint,
            seconds=round(outcome.seconds, 1),
        )
        previous_checkpoint = expected_checkpoint
    assert kills == (10 if plan is FULL_PLAN else 3)

    steps, records = compare_trajectories(read_metrics(reference_dir), read_metrics(run_dir))
    assert steps == plan.total_steps
    stages = [m["onebit_stage"] for m in read_metrics(reference_dir)]
    assert stages[plan.freeze_step - 1] == 1.0 and stages[plan.freeze_step - 2] == 0.0  # crossed freeze_step
    assert [m["phase"] for m in read_metrics(reference_dir)][plan.phase1_steps] == 2
    expected, got = final_checkpoint(reference_dir), final_checkpoint(run_dir)
    assert expected.name == got.name == f"step-{plan.total_steps:08d}"
    digests, resumed_digests = checkpoint_digests(expected), checkpoint_digests(got)
    files = {"model.safetensors", "train_state.pt", "replicated.pt", "rank-00000.pt", "rank-00001.pt"}
    assert set(digests) == files
    for name in digests:
        assert resumed_digests[name] == digests[name], f"{name} differs from the uninterrupted run"
    record(
        "bitwise",
        kills=kills,
        steps=steps,
        metric_records=records,
        checkpoint_files=len(digests),
        total_steps=plan.total_steps,
        full=plan is FULL_PLAN,
    )
