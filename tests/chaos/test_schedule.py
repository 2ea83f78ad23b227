"""The chaos schedule is a pure function of its seed, and it covers what the soak promises (fast tier)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

from data.config import REPO_ROOT
from tests.chaos.schedule import (
    BOUNDARY_REACH,
    DEMO,
    KIND_POINTS,
    KINDS,
    SHORT,
    Placement,
    Planner,
    Recipe,
    ends_launch,
    make_schedule,
)


def test_the_schedule_is_a_pure_function_of_the_seed():
    first = make_schedule(7, 50)
    assert make_schedule(7, 50) == first
    assert make_schedule(8, 50) != first
    # the same in a fresh interpreter (no hash randomisation or global random state leaks in)
    code = (
        "import json; from tests.chaos.schedule import make_schedule; "
        "print(json.dumps([f.as_dict() for f in make_schedule(7, 50)]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True,
        env={"PYTHONHASHSEED": "123", "PATH": ""},
    )  # fmt: skip
    assert json.loads(out.stdout) == [f.as_dict() for f in first]


def test_a_soak_of_fifty_faults_draws_every_kind_and_spreads_over_the_run():
    for seed in range(1, 6):
        faults = make_schedule(seed, 50, recipe=DEMO)
        assert len(faults) == 50
        assert {f.kind for f in faults} == set(KINDS), seed
        assert all(f.point in KIND_POINTS[f.kind] for f in faults)
        targets = [f.target for f in faults]
        assert min(targets) <= 2 and max(targets) >= DEMO.total_steps - 2
        assert any(f.boundary for f in faults)
        links = [f for f in faults if f.kind == "link"]
        assert all(f.hold_s < 20 / 2 or f.hold_s > 20 for f in links)  # never near the timeout


def test_kinds_can_be_left_out_and_unknown_ones_are_refused():
    faults = make_schedule(1, 30, kinds=("kill", "term"))
    assert {f.kind for f in faults} == {"kill", "term"}
    try:
        make_schedule(1, 5, kinds=("kill", "meteor"))
    except ValueError as error:
        assert "meteor" in str(error)
    else:
        raise AssertionError("an unknown kind was accepted")


def test_collective_points_follow_the_stage():
    recipe = Recipe()
    assert recipe.collective_point("onebit_lamb", recipe.freeze_step) == "grad_allreduce"
    assert recipe.collective_point("onebit_lamb", recipe.freeze_step + 1) == "exchange"
    assert recipe.collective_point("lamb", recipe.total_steps) == "grad_allreduce"


def stand_after(placements: list[Placement], stand: int, recipe: Recipe, timeout_s: float = 20.0) -> int:
    """Where a launch leaves the run (its newest checkpoint), as the soaks recorded it (results/chaos/):
    a fault that ends the launch inside step t leaves t - 1; after t's checkpoint, t; a SIGTERM checkpoints
    t (t + 1 when it came during t's save: the signal is acted on after the next step); a flipped byte
    struck at t is found by t + 1's read; a restart kill leaves the stand; a launch that nothing ends
    finishes the run."""
    for placement in placements:
        fault, step, point = placement.fault, placement.step, placement.point
        if not ends_launch(fault, timeout_s):
            continue
        if step is None:
            return stand
        if fault.kind == "term":
            return min(step + (point in ("checkpoint_write", "after_checkpoint")), recipe.total_steps)
        if fault.kind == "flip" or point == "after_checkpoint":
            return step
        return step - 1
    return recipe.total_steps


def soak_plan(planner: Planner) -> tuple[int, int]:
    """Play a whole soak against `stand_after`: -> (faults struck, launches)."""
    stand, struck, launches = 0, 0, 0
    while stand < planner.recipe.total_steps:
        launches += 1
        assert launches <= 3 * planner.count, "the soak does not end"
        placements = planner.arm(stand)
        for placement in placements[:-1]:  # only the last fault of a launch may end it
            assert not ends_launch(placement.fault, planner.timeout_s)
        steps = [p.step for p in placements if p.step is not None]
        assert steps == sorted(set(steps)) and all(s > stand for s in steps)
        struck += len(placements)
        stand = max(stand, stand_after(placements, stand, planner.recipe))
    return struck, launches


def test_fifty_faults_strike_before_the_run_gets_to_its_end():
    """The 50-fault soaks on the previous schedule struck 37-46 faults: the run got to its end first. Now
    a fault that would end the run waits to be the last, targets move onto a boundary only when near, and
    the reserve replaces what finds no step."""
    for recipe in (SHORT, DEMO):
        for optim in ("onebit_lamb", "lamb"):
            for seed in range(1, 13):
                planner = Planner(seed, 50, recipe=recipe, optim=optim)
                struck, launches = soak_plan(planner)
                assert struck == 50, (recipe.total_steps, optim, seed, planner.left())
                assert planner.drawn - 50 == len(planner.left())
                # the demo run (`make chaos`) holds the schedule itself; the 16 + 4 step run needs the reserve
                assert len(planner.left()) <= (0 if recipe is DEMO else 25), (seed, planner.left())
                assert launches <= 52
    # the slow tier's 5-fault schedule strikes all five from the schedule itself
    planner = Planner(8, 5, recipe=SHORT)
    assert soak_plan(planner)[0] == 5 and planner.drawn == 5


def test_targets_stay_near_their_place_in_the_run():
    """An early fault is not moved onto a far boundary (the previous schedule moved step 1's to 12, and the
    run trained 10 steps in one launch)."""
    for recipe in (SHORT, DEMO):
        for seed in range(1, 21):
            faults = make_schedule(seed, 50, recipe=recipe)
            for fault in faults:
                spot = 1 + fault.index * (recipe.total_steps - 1) // 50
                assert abs(fault.target - spot) <= BOUNDARY_REACH + 1, (seed, fault)
                assert not fault.boundary or fault.target in recipe.boundaries


def test_the_reserve_extends_the_schedule_without_changing_it():
    faults = make_schedule(3, 50, recipe=DEMO, extra=20)
    assert faults[:50] == make_schedule(3, 50, recipe=DEMO)
    assert faults[:60] == make_schedule(3, 50, recipe=DEMO, extra=10)
    reserve = faults[50:]
    assert [f.index for f in reserve] == list(range(50, 70))
    assert all(f.reserve and f.target == 1 and not f.boundary for f in reserve)
    assert not any(f.reserve for f in faults[:50])


def test_a_fault_that_would_end_the_run_waits_to_be_the_last():
    planner = Planner(1, 3, recipe=SHORT, reserve_size=5)
    total = SHORT.total_steps
    term = next(f for f in make_schedule(1, 50, recipe=SHORT) if f.kind == "term")
    term = replace(term, target=total, point="mid_step")
    kill = replace(term, kind="kill", index=98)
    planner.queue = [term, kill]
    planner.placed = 1
    # the SIGTERM at the last step would end the run: the kill strikes first
    assert [p.fault.kind for p in planner.arm(total - 1)] == ["kill"]
    # then it is the last fault needed
    assert [(p.fault.kind, p.step) for p in planner.arm(total - 1)] == [("term", total)]
    assert planner.arm(total - 1) == [] and planner.left() == []
    # a SIGTERM during the save of the step before the last ends the run as well (the next step trains)
    assert planner.finishes_run(term, total - 1, "checkpoint_write")
    assert not planner.finishes_run(term, total - 1, "mid_step")
    # no step left for a flip (found by the next step's read) at the last step: the reserve draws
    planner = Planner(2, 2, recipe=SHORT, reserve_size=10)
    flip = replace(term, kind="flip", point="after_step", index=99)
    planner.queue = [flip]
    armed = planner.arm(total - 1)
    assert len(armed) == 1 and armed[0].fault.reserve
    assert planner.drawn > 2 and any(f["index"] == 99 and "no step" in f["reason"] for f in planner.left())
