"""How noisy the rung's final MLM loss is, and what pairing by seed removes.

A run's final MLM loss (the records' measure) is the mean of its last 10 logged records, each one step's
loss on that step's batch. The seed sets the batches, so records of runs with one seed rise and fall together
whatever the arm or worker count, and records of different seeds do not (the correlations printed first).
These follow from the kept runs:

- the final's batch noise: the spread of its 10 records over sqrt(10), shared by every run with the seed;
- the spread of siblings: runs of one rule with one seed that differ in arithmetic only (LAMB at 2
  processes, 8 and 32 simulated workers, LAMB and the default run again at 32 on another machine, and
  sibling.sh's runs of LAMB or the default at 32 with the attention's sums in another order), over the
  last 400 steps (80 records) and at the final;
- the default's cost paired by seed with LAMB at its own worker count, on the same two measures;
- one run's realization spread at 32 simulated workers from the sibling pairs there, the standard error it
  puts on the default's three pairs, and the chance that three pairs with that noise agree as closely as
  they do;
- the default's cost with each sibling in place of its run.

    .venv/bin/python results/cpu-study-m/noise.py   # reads results/cpu-study/runs/cpu-rung-m-*
"""

from __future__ import annotations

import importlib.util
import statistics
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from scipy import stats

from bench.fidelity_rungs import FINAL_WINDOW  # logged records: the rung's final MLM loss

_spec = importlib.util.spec_from_file_location("steps_behind", Path(__file__).with_name("steps_behind.py"))
assert _spec and _spec.loader
steps_behind = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(steps_behind)

RUNS = steps_behind.RUNS
SCREENS = Path(__file__).with_name("screens")
AGAIN = {  # runs at 32 simulated workers run again on another machine (folder in SCREENS -> rule, seed)
    "lamb-again": ("lamb", 1),
    "onebit_lamb-again-s1": ("default", 1),  # run again for its fine-tunes
}
SIBLINGS = "sibling-*-eager-s*"  # sibling.sh's runs at 32 simulated (lamb or onebit_lamb), kept in SCREENS
LAST = 400  # steps: the window before the end
SEEDS = (1, 2, 3)
LAMB = {"n2": "lamb-lr1e-2-n2", "sim8": "abl-lamb-lr1e-2-sim8", "sim32": "abl-lamb-lr1e-2-sim32"}
DEFAULT = {workers: f"onebit_lamb-lr1e-2-{workers}" for workers in LAMB}


def run_folder(arm: str, seed: int) -> Path:
    return RUNS / f"cpu-rung-m-{arm}-s{seed}"


def final(records: dict[int, float]) -> tuple[float, float]:
    """The final MLM loss (the mean of the last FINAL_WINDOW records) and its batch noise (their standard
    deviation over sqrt(FINAL_WINDOW))."""
    last = [records[step] for step in sorted(records)[-FINAL_WINDOW:]]
    return statistics.fmean(last), statistics.stdev(last) / len(last) ** 0.5


def last_mean(records: dict[int, float], steps: int = LAST) -> float:
    """The mean record over the last `steps` steps."""
    end = max(records)
    return statistics.fmean(loss for step, loss in records.items() if step > end - steps)


def correlation(a: dict[int, float], b: dict[int, float], steps: int = LAST) -> float:
    """The correlation of two runs' records over the last `steps` steps both logged."""
    common = sorted(set(a) & set(b))
    common = [step for step in common if step > common[-1] - steps]
    return float(np.corrcoef([a[s] for s in common], [b[s] for s in common])[0, 1])


def relative(arm: dict[int, float], peer: dict[int, float]) -> tuple[float, float]:
    """The arm's last-LAST-steps mean and final over the peer's, minus 1."""
    return last_mean(arm) / last_mean(peer) - 1, final(arm)[0] / final(peer)[0] - 1


def sibling_of(name: str) -> tuple[str, int]:
    """A sibling folder's rule (`lamb` or `default`) and seed: sibling-OPTIM-eager-sSEED."""
    optim, seed = name.removeprefix("sibling-").rsplit("-eager-s", 1)
    return ("default" if optim == "onebit_lamb" else optim), int(seed)


def again_label(rule: str, seed: int) -> str:
    """A run again's row label: its rule and seed, so each run again of one rule keeps its own row."""
    return f"{rule} sim32 s{seed} run again"


def realization_spread(differences: Sequence[float]) -> float:
    """One run's spread from pairs of realizations (each pair's difference carries two runs' noise): the
    pairs' root mean square over sqrt(2)."""
    return float(np.sqrt(np.mean(np.square(differences)) / 2))


def spread_chance(values: Sequence[float], pair_spread: float) -> float:
    """The chance that pairs whose every value carries `pair_spread` of noise agree at least as closely as
    `values` do: the chi-square distribution's cdf at (n - 1) s^2 / sigma^2."""
    dof = len(values) - 1
    return float(stats.chi2.cdf(dof * statistics.variance(values) / pair_spread**2, dof))


def mean_se(values: Sequence[float]) -> str:
    mean = statistics.fmean(values)
    se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")
    return f"{100 * mean:+.2f} % ± {100 * se:.2f}"


def main() -> None:
    lamb = {(w, s): steps_behind.mlm_records(run_folder(arm, s)) for w, arm in LAMB.items() for s in SEEDS}
    default = {(w, s): steps_behind.mlm_records(run_folder(a, s)) for w, a in DEFAULT.items() for s in SEEDS}
    siblings = {  # label -> (rule, seed, records): each run again, then sibling.sh's runs (by folder name)
        again_label(rule, seed): (rule, seed, steps_behind.mlm_records(SCREENS / folder))
        for folder, (rule, seed) in AGAIN.items()
    }
    siblings.update(
        (folder.name, (*sibling_of(folder.name), steps_behind.mlm_records(folder)))
        for folder in sorted(SCREENS.glob(SIBLINGS))
    )
    runs = {**{("lamb", *k): v for k, v in lamb.items()}, **{("default", *k): v for k, v in default.items()}}
    same: list[float] = []
    other: list[float] = []
    keys = sorted(runs)
    for i, a in enumerate(keys):
        for b in keys[i + 1 :]:
            (same if a[2] == b[2] else other).append(correlation(runs[a], runs[b]))
    print(
        f"two runs' records over the last {LAST} steps, correlated (LAMB and the default, 3 worker counts):"
    )
    print(f"  same seed   {min(same):.2f}-{max(same):.2f} ({len(same)} pairs)")
    print(f"  other seeds {min(other):.2f}-{max(other):.2f} ({len(other)} pairs)\n")

    print(f"| run | seed | final | its batch noise | mean over the last {LAST} steps |")
    print("|---|---|---|---|---|")
    for (optimizer, workers, seed), records in sorted(runs.items()):
        value, noise = final(records)
        print(f"| {optimizer} {workers} | {seed} | {value:.4f} | {noise:.4f} | {last_mean(records):.4f} |")
    for name, (_, seed, records) in siblings.items():
        value, noise = final(records)
        print(f"| {name} | {seed} | {value:.4f} | {noise:.4f} | {last_mean(records):.4f} |")
    print()

    print(
        f"| pair, one seed | last {LAST} steps, by seed | final, by seed | mean ± SE: last {LAST} | final |"
    )
    print("|---|---|---|---|---|")
    sibling_pairs = []  # a seed's run again, or its sibling (attention eager), over its run there
    for name, (rule, seed, records) in siblings.items():
        run = lamb if rule == "lamb" else default
        sibling_pairs.append((f"{name} / {rule} sim32", relative(records, run["sim32", seed])))
    pairs = [
        (f"LAMB {w} / LAMB n2", [relative(lamb[w, s], lamb["n2", s]) for s in SEEDS])
        for w in ("sim8", "sim32")
    ]
    pairs += [(name, [rel]) for name, rel in sibling_pairs]
    costs = {w: [relative(default[w, s], lamb[w, s]) for s in SEEDS] for w in LAMB}
    pairs += [(f"default {w} / LAMB {w}", rel) for w, rel in costs.items()]

    for name, rel in pairs:
        windows = ", ".join(f"{100 * r[0]:+.2f}" for r in rel)
        finals = ", ".join(f"{100 * r[1]:+.2f}" for r in rel)
        means = f"{mean_se([r[0] for r in rel])} | {mean_se([r[1] for r in rel])}" if len(rel) > 1 else " | "
        print(f"| {name} | {windows} % | {finals} % | {means} |")
    print()

    sims = len(sibling_pairs)
    print(f"one run's realization spread at 32 simulated workers, from {sims} sibling pairs, and what it")
    print("makes of the default's three seed-matched pairs there:\n")
    print("| measure | one run | one pair | the pairs' mean ± SE on it | chance of the pairs' agreement |")
    print("|---|---|---|---|---|")
    for index, measure in enumerate((f"last {LAST} steps", "final")):
        one_run = realization_spread([rel[index] for _, rel in sibling_pairs])
        values = [rel[index] for rel in costs["sim32"]]
        pair = one_run * 2**0.5
        print(
            f"| {measure} | {100 * one_run:.2f} % | {100 * pair:.2f} % |"
            f" {100 * statistics.fmean(values):+.2f} % ± {100 * pair / len(values) ** 0.5:.2f} |"
            f" {spread_chance(values, pair):.2f} |"
        )
    print()

    realizations = {  # (rule, seed) -> {name: records}: each run at 32 simulated workers and its siblings
        (rule, seed): {f"{rule} sim32": (lamb if rule == "lamb" else default)["sim32", seed]}
        for rule in ("lamb", "default")
        for seed in SEEDS
    }
    for name, (rule, seed, records) in siblings.items():
        realizations[rule, seed][name] = records
    print("the default's cost at 32 simulated workers, every realization of each rule paired by seed:\n")
    print(f"| seed | the default | LAMB | last {LAST} steps | final |")
    print("|---|---|---|---|---|")
    for seed in SEEDS:
        for arm, arm_records in realizations["default", seed].items():
            for peer, peer_records in realizations["lamb", seed].items():
                window, last = relative(arm_records, peer_records)
                print(f"| {seed} | {arm} | {peer} | {100 * window:+.2f} % | {100 * last:+.2f} % |")


if __name__ == "__main__":
    main()
