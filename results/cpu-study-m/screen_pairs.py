"""Paired windows of two screens (screen.sh) or runs: the mean logged MLM loss of A over each window of
steps, divided by B's over the same steps (the same batches and masks; below 1: A ahead); and A's lag behind
B in steps (steps_behind.py's measure: the centred 200-step moving averages, B's running best).

    .venv/bin/python results/cpu-study-m/screen_pairs.py A B [WIDTH] [--before RUN]

A, B: run folders (results/runs/screen-NAME, or a kept run's results/cpu-study/runs/...). WIDTH: steps per
window (100 unless given). --before RUN: a screen's steps before its first logged one are RUN's (the rung run
whose checkpoint it continued), so that the moving average has its whole window from the screen's start on;
the lag is printed every 100 steps where both smoothed curves reach. Where A and B end at the same step, the
final MLM losses too: each the mean of its last 10 logged records, as the rung's records take it
(bench/fidelity_rungs.py, FINAL_WINDOW).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np

from bench.fidelity_rungs import FINAL_WINDOW  # logged records: the rung's final MLM loss

_spec = importlib.util.spec_from_file_location("steps_behind", Path(__file__).with_name("steps_behind.py"))
assert _spec and _spec.loader
steps_behind = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(steps_behind)


def mlm_losses(run: Path) -> dict[int, float]:
    """step → logged MLM loss, from the run's metrics.jsonl (or .gz)."""
    return steps_behind.mlm_records(run)


def windows(a: dict[int, float], b: dict[int, float], width: int) -> list[tuple[int, int, float, float]]:
    """(first step, last step, A's mean, B's mean) over each `width` steps both logged, from the first."""
    steps = sorted(set(a) & set(b))
    rows, start = [], steps[0] - 1
    while start < steps[-1]:
        inside = [step for step in steps if start < step <= start + width]
        if inside:
            mean_a = sum(a[step] for step in inside) / len(inside)
            mean_b = sum(b[step] for step in inside) / len(inside)
            rows.append((inside[0], inside[-1], mean_a, mean_b))
        start += width
    return rows


def with_before(screen: dict[int, float], before: dict[int, float]) -> dict[int, float]:
    """The screen's records, after `before`'s up to the screen's first logged step."""
    first = min(screen)
    return {**{step: loss for step, loss in before.items() if step < first}, **screen}


def lags(a: dict[int, float], b: dict[int, float], every: int = 100) -> list[tuple[int, float]]:
    """(step, A's lag behind B in steps) at each multiple of `every` that both smoothed curves reach, from
    the first step after which both have records of their own (the screens' start)."""
    curves = []
    for records in (a, b):
        steps = np.array(sorted(records))
        curves.append(steps_behind.smoothed(steps, np.array([records[s] for s in steps])))
    (a_steps, a_loss), (b_steps, b_loss) = curves
    first, last = max(a_steps[0], b_steps[0]), min(a_steps[-1], b_steps[-1])
    rows = []
    for t in range(int(np.ceil(first / every)) * every, int(last) + 1, every):
        level = float(np.interp(t, a_steps, a_loss))
        rows.append((t, t - steps_behind.reached_at(b_steps, b_loss, level)))
    return rows


def finals(a: dict[int, float], b: dict[int, float], window: int = FINAL_WINDOW) -> list[float] | None:
    """(A's, B's) mean over their last `window` logged records, where both end at the same step; else None."""
    if max(a) != max(b):
        return None
    return [float(np.mean([r[s] for s in sorted(r)[-window:]])) for r in (a, b)]


def main(argv: list[str]) -> None:
    before = None
    if "--before" in argv:
        at = argv.index("--before")
        if at + 1 >= len(argv):
            raise SystemExit(__doc__)
        before = mlm_losses(Path(argv[at + 1]))
        argv = argv[:at] + argv[at + 2 :]
    if len(argv) not in (2, 3):
        raise SystemExit(__doc__)
    a, b = mlm_losses(Path(argv[0])), mlm_losses(Path(argv[1]))
    for first, last, mean_a, mean_b in windows(a, b, int(argv[2]) if len(argv) == 3 else 100):
        print(f"steps {first}-{last}: {mean_a:.4f} / {mean_b:.4f} = {mean_a / mean_b:.4f}")
    if before is not None:
        start = max(min(a), min(b))
        a, b = with_before(a, before), with_before(b, before)
        for t, lag in lags(a, b):
            if t >= start:
                print(f"step {t}: A {lag:.0f} steps behind B")
    final = finals(a, b)
    if final is not None:
        final_a, final_b = final
        print(f"final (last {FINAL_WINDOW} records): {final_a:.4f} / {final_b:.4f} = {final_a / final_b:.4f}")


if __name__ == "__main__":
    main(sys.argv[1:])
