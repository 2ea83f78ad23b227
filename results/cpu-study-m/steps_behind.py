"""Steps behind the peer: how many steps earlier the peer's smoothed MLM loss reached the arm's.

The paired loss ratio over a window (the report's tables) shrinks as the loss curve flattens even while an
arm falls further behind; the lag in steps does not. For an arm and its peer with the same seed (the same
batches and masks), each curve is the centred 200-step moving average of the logged MLM loss; the lag at
step t is t minus the step at which the peer's running best first reached the arm's loss at t (negative: the
arm is ahead). At the end, where the arm may be below anything the peer reached, the lag is taken from
whichever is ahead.

    .venv/bin/python results/cpu-study-m/steps_behind.py   # reads results/cpu-study/runs/cpu-rung-m-*
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np

RUNS = Path(__file__).resolve().parents[1] / "cpu-study" / "runs"
WINDOW = 200  # steps
STEPS = (1000, 1200, 1400, 1600, 2000, 2400, 2800)
FREEZE = 640  # the recipe's freeze_step: the compression stage starts after it


def mlm_records(folder: Path) -> dict[int, float]:
    """step → logged MLM loss of the run in `folder` (its metrics.jsonl.gz, else metrics.jsonl), one record
    per step (the last written)."""
    packed = folder / "metrics.jsonl.gz"
    records: dict[int, float] = {}
    with gzip.open(packed, "rt") if packed.exists() else open(folder / "metrics.jsonl") as lines:
        for line in lines:
            record = json.loads(line)
            if "mlm_loss" in record and record.get("step") is not None:
                records[int(record["step"])] = float(record["mlm_loss"])
    return records


def mlm_curve(run: str) -> tuple[np.ndarray, np.ndarray]:
    """The kept run's logged (step, MLM loss), in step order (`mlm_records`)."""
    records = mlm_records(RUNS / run)
    steps = np.array(sorted(records))
    return steps, np.array([records[s] for s in steps])


def smoothed(steps: np.ndarray, losses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The centred moving average over WINDOW steps."""
    every = float(np.median(np.diff(steps)))
    k = max(1, round(WINDOW / every))
    mean = np.convolve(losses, np.ones(k) / k, mode="valid")
    return steps[k - 1 :] - (k - 1) * every / 2, mean


def reached_at(steps: np.ndarray, losses: np.ndarray, level: float) -> float:
    """The step at which the running best of `losses` first reaches `level` (nan: never)."""
    best = np.minimum.accumulate(losses)
    i = int(np.searchsorted(-best, -level))
    if i >= len(best):
        return float("nan")
    if i == 0 or best[i - 1] == best[i]:
        return float(steps[i])
    return float(steps[i - 1] + (steps[i] - steps[i - 1]) * (best[i - 1] - level) / (best[i - 1] - best[i]))


def steps_behind(peer: str, arm: str) -> list[float]:
    """The arm's lag behind the peer at each of STEPS, then at the end (module docstring)."""
    peer_steps, peer_loss = smoothed(*mlm_curve(peer))
    arm_steps, arm_loss = smoothed(*mlm_curve(arm))
    lags = [
        t - reached_at(peer_steps, peer_loss, float(np.interp(t, arm_steps, arm_loss)))
        if t <= arm_steps[-1]
        else float("nan")  # a run stopped before t
        for t in STEPS
    ]
    end = float(min(peer_steps[-1], arm_steps[-1]))
    arm_end, peer_end = (
        float(np.interp(end, arm_steps, arm_loss)),
        float(np.interp(end, peer_steps, peer_loss)),
    )
    if arm_end >= peer_end:
        lags.append(end - reached_at(peer_steps, peer_loss, arm_end))
    else:
        lags.append(reached_at(arm_steps, arm_loss, peer_end) - end)
    return lags


def pairs(peer: str, arm: str, seeds: tuple[int, ...] = (1, 2, 3)) -> list[tuple[str, str]]:
    return [(peer.format(seed=s), arm.format(seed=s)) for s in seeds]


COMPARISONS = {
    "the default - LAMB, 2 processes": pairs(
        "cpu-rung-m-lamb-lr1e-2-n2-s{seed}", "cpu-rung-m-onebit_lamb-lr1e-2-n2-s{seed}"
    ),
    "the default - LAMB, 8 simulated": pairs(
        "cpu-rung-m-abl-lamb-lr1e-2-sim8-s{seed}", "cpu-rung-m-onebit_lamb-lr1e-2-sim8-s{seed}"
    ),
    "the default - LAMB, 32 simulated": pairs(
        "cpu-rung-m-abl-lamb-lr1e-2-sim32-s{seed}", "cpu-rung-m-onebit_lamb-lr1e-2-sim32-s{seed}"
    ),
    "LAMB 8 simulated - LAMB 2 processes": pairs(
        "cpu-rung-m-lamb-lr1e-2-n2-s{seed}", "cpu-rung-m-abl-lamb-lr1e-2-sim8-s{seed}"
    ),
    "LAMB 32 simulated - LAMB 2 processes": pairs(
        "cpu-rung-m-lamb-lr1e-2-n2-s{seed}", "cpu-rung-m-abl-lamb-lr1e-2-sim32-s{seed}"
    ),
    "the default - LAMB, 3e-3, 2 processes": pairs(
        "cpu-rung-m-lamb-lr3e-3-n2-s{seed}", "cpu-rung-m-onebit_lamb-lr3e-3-n2-s{seed}", (1,)
    ),
    "freeze_step 1,280 - LAMB, 32 simulated": pairs(
        "cpu-rung-m-abl-lamb-lr1e-2-sim32-s{seed}",
        "cpu-rung-m-abl-freeze1280-onebit_lamb-lr1e-2-sim32-s{seed}",
        (1,),
    ),
    "DeepSpeed's - LAMB, 2 processes": pairs(
        "cpu-rung-m-lamb-lr1e-2-n2-s{seed}", "cpu-rung-m-onebit_lamb_deepspeed-lr1e-2-n2-s{seed}", (1,)
    ),
    "the default - LAMB, 8 simulated, seed 1": pairs(
        "cpu-rung-m-abl-lamb-lr1e-2-sim8-s{seed}", "cpu-rung-m-onebit_lamb-lr1e-2-sim8-s{seed}", (1,)
    ),
    "abl-fp32server - LAMB, 8 simulated": pairs(
        "cpu-rung-m-abl-lamb-lr1e-2-sim8-s{seed}",
        "cpu-rung-m-abl-fp32server-onebit_lamb-lr1e-2-sim8-s{seed}",
        (1,),
    ),
    "abl-fp32worker - LAMB, 8 simulated": pairs(
        "cpu-rung-m-abl-lamb-lr1e-2-sim8-s{seed}",
        "cpu-rung-m-abl-fp32worker-onebit_lamb-lr1e-2-sim8-s{seed}",
        (1,),
    ),
    "abl-2bitworker - LAMB, 8 simulated": pairs(
        "cpu-rung-m-abl-lamb-lr1e-2-sim8-s{seed}",
        "cpu-rung-m-abl-2bitworker-onebit_lamb-lr1e-2-sim8-s{seed}",
        (1,),
    ),
    "the default - LAMB, 32 simulated, seed 1": pairs(
        "cpu-rung-m-abl-lamb-lr1e-2-sim32-s{seed}", "cpu-rung-m-onebit_lamb-lr1e-2-sim32-s{seed}", (1,)
    ),
    "abl-2bitworker - LAMB, 32 simulated": pairs(
        "cpu-rung-m-abl-lamb-lr1e-2-sim32-s{seed}",
        "cpu-rung-m-abl-2bitworker-onebit_lamb-lr1e-2-sim32-s{seed}",
        (1,),
    ),
    "AdamW 1e-3 - LAMB, 2 processes": pairs(
        "cpu-rung-m-lamb-lr1e-2-n2-s{seed}", "cpu-rung-m-adamw-lr1e-3-n2-s{seed}"
    ),
}


def main() -> None:
    columns = [f"{t:,}" for t in STEPS] + ["end"]
    print("| arm - peer (same seeds) | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    means = {}
    for name, comparison in COMPARISONS.items():
        try:
            lags = np.array([steps_behind(peer, arm) for peer, arm in comparison])
        except FileNotFoundError:  # a run not kept yet
            continue
        means[name] = lags.mean(0)
        if len(lags) > 1:
            cells = [f"{m:.0f} ± {s:.0f}" for m, s in zip(means[name], lags.std(0, ddof=1))]
        else:
            cells = [f"{m:.0f}" for m in means[name]]
        print(f"| {name} ({len(lags)}) | " + " | ".join(cells) + " |")
    print(f"\nper step of the compression stage (lag / (t - {FREEZE})), the same rows:")
    for name, mean in means.items():
        print(f"{name}: " + " ".join(f"{m / (t - FREEZE):.3f}" for m, t in zip(mean, STEPS)))


if __name__ == "__main__":
    main()
