"""The chaos schedule is a pure function of its seed, and it covers what the soak promises (fast tier)."""

from __future__ import annotations

import json
import subprocess
import sys

from data.config import REPO_ROOT
from tests.chaos.schedule import DEMO, KIND_POINTS, KINDS, Recipe, make_schedule


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
