"""results/cpu-study-m/screen_pairs.py: paired windows of two screens' logged MLM losses."""

from __future__ import annotations

import gzip
import importlib.util
import json
import math
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "results" / "cpu-study-m" / "screen_pairs.py"
spec = importlib.util.spec_from_file_location("screen_pairs", SCRIPT)
assert spec and spec.loader
screen_pairs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(screen_pairs)


def write(run: Path, losses: dict[int, float], *, compressed: bool = False) -> Path:
    run.mkdir()
    lines = "".join(json.dumps({"step": step, "mlm_loss": loss}) + "\n" for step, loss in losses.items())
    lines += json.dumps({"step": 999, "eval": 1.0}) + "\n"  # a record without an MLM loss: left out
    if compressed:
        with gzip.open(run / "metrics.jsonl.gz", "wt") as file:
            file.write(lines)
    else:
        (run / "metrics.jsonl").write_text(lines)
    return run


def test_windows_pair_the_steps_both_runs_logged(tmp_path: Path):
    a = write(tmp_path / "a", {5: 4.0, 10: 2.0, 15: 3.0, 20: 3.0, 25: 1.0})
    b = write(tmp_path / "b", {5: 4.0, 10: 4.0, 15: 6.0, 20: 6.0}, compressed=True)
    rows = screen_pairs.windows(screen_pairs.mlm_losses(a), screen_pairs.mlm_losses(b), 10)
    # windows of 10 steps from the first logged one; step 25 is A's only, left out
    assert rows == [(5, 10, 3.0, 4.0), (15, 20, 3.0, 6.0)]


def test_a_screen_takes_its_base_runs_steps_before_its_own():
    screen = {805: 1.0, 810: 2.0}
    base = {795: 9.0, 800: 8.0, 805: 7.0}  # the base's own step 805 is not the screen's
    assert screen_pairs.with_before(screen, base) == {795: 9.0, 800: 8.0, 805: 1.0, 810: 2.0}


def test_the_lag_of_a_run_behind_another_is_the_steps_between_equal_losses():
    steps = range(5, 2001, 5)
    b = {step: 10.0 - 0.001 * step for step in steps}
    a = {step: 10.0 - 0.001 * (step - 50) for step in steps}  # 50 steps behind B throughout
    rows = screen_pairs.lags(a, b)
    assert [t for t, _ in rows] == list(range(200, 1901, 100))
    assert all(abs(lag - 50.0) < 1e-6 for _, lag in rows)
    ahead = screen_pairs.lags(b, a)  # B ahead of A, -50, but at the end, where A never got as low
    assert all(abs(lag + 50.0) < 1e-6 for _, lag in ahead[:-1]) and math.isnan(ahead[-1][1])


def test_the_final_losses_are_the_last_ten_records_where_both_runs_end_together():
    a = {step: float(step) for step in range(5, 101, 5)}  # the last ten: 55..100, mean 77.5
    b = {step: 2.0 for step in range(5, 101, 5)}
    assert screen_pairs.finals(a, b) == [77.5, 2.0]
    assert screen_pairs.finals(a, {**b, 105: 2.0}) is None  # B ran on: no common end
