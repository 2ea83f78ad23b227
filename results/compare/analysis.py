"""The numbers of a comparison: per run, per group of seeds, and the gap of each optimizer to the reference.

Definitions (also stated in the report):
- smoothing: EMA over logged records, s_0 = x_0, s_i = w s_(i-1) + (1 - w) x_i (w = `smoothing`);
- samples to target: `samples_seen` of the first record whose smoothed MLM loss is <= the target;
- final loss: mean of the raw values of the last `final_window` records of the run's last phase;
- train time: sum over records of step_seconds x the steps since the previous record (logged steps
  stand for the steps between them; start-up, checkpoints and evaluation are not counted);
- volume reduction vs LAMB: bytes_lamb_cumulative / bytes_cumulative of the last record;
- a group: runs that differ only by seed (same arm — optimizer, 1-bit exchange variant and number of
  data-parallel workers, simulated or not — batch recipe, global batch and model); its values are
  mean ± sample std over its runs;
- a group's reference: the reference optimizer's group (default settings, no variant) with the same
  batch recipe, global batch and model, with the same number of workers if there is one, else any
  (LAMB's arithmetic does not depend on the number of workers: the same global batch gives the same
  averaged gradient);
- fine-tune scores at a run's last fine-tuned checkpoint; a group's downstream std pools every
  (pretraining seed, fine-tune seed) score; the gap is within noise when |gap| <= the pooled std
  of the two groups, sqrt((s_a^2 + s_b^2) / 2).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from data.config import REPO_ROOT
from results.compare.runs import CompareError, FinetuneResult, Run, display_path

FINAL_LOSS_TARGET_PCT = 1.0  # the target for the final MLM loss gap


def ema(values: Sequence[float], weight: float) -> list[float]:
    out: list[float] = []
    for value in values:
        out.append(value if not out else weight * out[-1] + (1.0 - weight) * value)
    return out


def mean_std(values: Sequence[float]) -> dict[str, Any]:
    """{mean, std (sample, n-1; 0 for one value), n}; None values when empty."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return {"mean": None, "std": None, "n": 0}
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "n": len(values),
    }


def last_phase_records(run: Run) -> list[dict[str, float]]:
    last = run.records[-1].get("phase")
    return [r for r in run.records if r.get("phase") == last] if last is not None else run.records


def diverged(run: Run) -> bool:
    """The run ended with a non-finite MLM loss (every later step skipped:
    docs/pretraining.md), or above the loss
    it started from (a blown-up run can stay finite: 1e8 is no final loss either)."""
    losses = [r["mlm_loss"] for r in run.records if "mlm_loss" in r]
    if not losses:
        return False
    if not math.isfinite(losses[-1]):
        return True
    return math.isfinite(losses[0]) and losses[-1] > losses[0]


def final_value(run: Run, key: str, window: int) -> float | None:
    """Mean of the last `window` records' values; None for a diverged run (its last finite values would
    pass for a final loss)."""
    if diverged(run):
        return None
    values = [r[key] for r in last_phase_records(run) if key in r and math.isfinite(r[key])]
    return statistics.fmean(values[-window:]) if values else None


def samples_to_target(run: Run, target: float, smoothing: float) -> int | None:
    records = [r for r in run.records if math.isfinite(r["mlm_loss"])]
    smoothed = ema([r["mlm_loss"] for r in records], smoothing)
    for record, value in zip(records, smoothed):
        if value <= target:
            return int(record["samples_seen"])
    return None


def samples_after_steps(run: Run, steps: int) -> int | None:
    """Samples seen after `steps` optimizer steps (counted over all phases), from the config's phases."""
    total = 0
    for global_batch, phase_steps in run.phases:
        taken = min(steps, phase_steps)
        total += taken * global_batch
        steps -= taken
        if steps == 0:
            return total
    return None


def onebit_start_samples(run: Run) -> int | None:
    """Samples seen when the 1-bit compression stage starts (None: not a 1-bit run, or never started):
    after `freeze_step` steps when the config is known, else the first record with onebit_stage = 1."""
    first = next((r for r in run.records if r.get("onebit_stage") == 1.0), None)
    if first is None:
        return None
    exact = samples_after_steps(run, run.freeze_step) if run.freeze_step is not None else None
    return exact if exact is not None else int(first["samples_seen"])


def phase_boundaries(run: Run) -> list[int]:
    """Samples at each phase end but the last: from the config when known, else the records."""
    if len(run.phases) > 1:
        ends = [
            samples_after_steps(run, sum(steps for _, steps in run.phases[: i + 1]))
            for i in range(len(run.phases) - 1)
        ]
        return [end for end in ends if end is not None]
    bounds, previous = [], None
    for index, record in enumerate(run.records):
        phase = record.get("phase")
        if previous is not None and phase != previous and index > 0:
            bounds.append(int(run.records[index - 1]["samples_seen"]))
        previous = phase
    return bounds


def train_seconds(run: Run) -> float | None:
    if run.wall_seconds is not None:
        return run.wall_seconds
    total, previous_step = 0.0, 0.0
    for record in run.records:
        if "step_seconds" not in record:
            return None
        total += record["step_seconds"] * (record["step"] - previous_step)
        previous_step = record["step"]
    return total


def final_finetunes(run: Run) -> dict[str, FinetuneResult]:
    """Per task, the fine-tune of the run's last fine-tuned checkpoint (most pretraining samples)."""
    best: dict[str, FinetuneResult] = {}
    for result in run.finetunes:
        current = best.get(result.task)
        if current is None or (result.samples_seen or -1) > (current.samples_seen or -1):
            best[result.task] = result
    return best


@dataclass
class Target:
    value: float
    how: str


def choose_target(
    runs: list[Run], target_loss: float | None, reference: str, margin: float, window: int
) -> Target:
    if target_loss is not None:
        return Target(target_loss, "set with target_loss")
    chosen = [r for r in runs if r.optimizer == reference] or runs
    finals = [(final_value(r, "mlm_loss", window), r.name) for r in chosen]
    known = [(v, name) for v, name in finals if v is not None]
    if not known:
        raise CompareError("target_loss: no run has a finite final MLM loss; set target_loss=<value>")
    worst, name = max(known)
    whose = f"{reference} runs" if chosen is not runs else f"runs (no {reference} run)"
    return Target(
        worst * (1 + margin),
        f"auto: the worst final MLM loss of the {whose} ({worst:.4f}, {name}) + {margin:.0%}",
    )


def run_summary(run: Run, target: Target, smoothing: float, window: int) -> dict[str, Any]:
    last = run.records[-1]
    bytes_sent = last.get("bytes_cumulative")
    bytes_lamb = last.get("bytes_lamb_cumulative")
    seconds = train_seconds(run)
    samples = int(last["samples_seen"])
    return {
        "name": run.name,
        "source": display_path(run.source, REPO_ROOT),
        "group": group_label(run),
        "optimizer": run.optimizer,
        "batch": run.batch_name,
        "global_batch": run.global_batch,
        "model": run.model,
        "seed": run.seed,
        "freeze_step": run.freeze_step,
        "command": run.command,
        "config_note": run.config_note,
        "finetune_notes": list(run.finetune_notes),
        "steps": int(last["step"]),
        "diverged": diverged(run),
        "samples_seen": samples,
        "samples_to_target": samples_to_target(run, target.value, smoothing),
        "final_mlm_loss": final_value(run, "mlm_loss", window),
        "final_nsp_loss": final_value(run, "nsp_loss", window),
        "final_mlm_accuracy": final_value(run, "mlm_accuracy", window),
        "onebit_start_samples": onebit_start_samples(run),
        "phase_boundaries": phase_boundaries(run),
        "train_seconds": seconds,
        "samples_per_s": samples / seconds if seconds else None,
        "bytes_cumulative": bytes_sent,
        "bytes_lamb_cumulative": bytes_lamb,
        "volume_reduction_vs_lamb": bytes_lamb / bytes_sent if bytes_sent and bytes_lamb else None,
        "finetune": {
            task: {
                "metric": result.metric,
                "pretraining_samples_seen": result.samples_seen,
                "checkpoint": result.checkpoint,
                "scores": result.scores,
                **mean_std(list(result.scores.values())),
            }
            for task, result in sorted(final_finetunes(run).items())
        },
    }


def group_label(run: Run) -> str:
    return f"{run.arm} b{run.global_batch}" + (f" {run.model}" if run.model else "")


def group_runs(runs: list[Run]) -> dict[tuple[str, str, int, str], list[Run]]:
    groups: dict[tuple[str, str, int, str], list[Run]] = {}
    for run in runs:
        groups.setdefault(run.group_key, []).append(run)
    return groups


def group_summary(members: list[Run], per_run: dict[str, dict[str, Any]]) -> dict[str, Any]:
    rows = [per_run[r.name] for r in members]
    first = members[0]
    seeds = [r.seed for r in members]
    notes = []
    if len(set(seeds)) < len(seeds) and None not in seeds:
        notes.append(f"runs share a seed ({seeds}): not independent replicates")
    failed = [r.name for r in members if diverged(r)]
    if failed:
        notes.append(
            f"{len(failed)} of {len(members)} runs diverged (a non-finite final loss or one above the first: "
            f"{', '.join(failed)}); the final-loss means are over the others"
        )
    reached = [row["samples_to_target"] for row in rows if row["samples_to_target"] is not None]
    summary: dict[str, Any] = {
        "label": group_label(first),
        "optimizer": first.optimizer,
        "arm": first.arm,
        "variant": first.variant,
        "workers": first.workers,
        "simulated": first.simulated,
        "batch": first.batch_name,
        "global_batch": first.global_batch,
        "model": first.model,
        "runs": [r.name for r in members],
        "seeds": seeds,
        "diverged": sum(diverged(r) for r in members),
        "notes": notes,
        "samples_seen": sorted({row["samples_seen"] for row in rows}),
        "samples_to_target": {**mean_std(reached), "reached": len(reached), "of": len(rows)},
    }
    for key in (
        "final_mlm_loss",
        "final_nsp_loss",
        "final_mlm_accuracy",
        "samples_per_s",
        "train_seconds",
        "bytes_cumulative",
        "volume_reduction_vs_lamb",
    ):
        summary[key] = mean_std([row[key] for row in rows if row[key] is not None])
    tasks = sorted({task for row in rows for task in row["finetune"]})
    summary["finetune"] = {}
    for task in tasks:
        results = [row["finetune"][task] for row in rows if task in row["finetune"]]
        pooled = [score for result in results for score in result["scores"].values()]
        summary["finetune"][task] = {
            "metric": results[0]["metric"],
            # mean over pretraining seeds of each run's mean over fine-tune seeds, and their std
            "over_pretraining_seeds": mean_std([result["mean"] for result in results]),
            # every (pretraining seed, fine-tune seed) score
            "pooled": mean_std(pooled),
            "pretraining_samples_seen": sorted(
                {r["pretraining_samples_seen"] for r in results if r["pretraining_samples_seen"] is not None}
            ),
        }
    return summary


def gap_summary(group: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """`group` vs `reference` at the same batch: final MLM loss gap in % and downstream gaps vs noise."""
    loss, reference_loss = group["final_mlm_loss"]["mean"], reference["final_mlm_loss"]["mean"]
    gap_pct = (
        100.0 * (loss - reference_loss) / reference_loss if loss is not None and reference_loss else None
    )
    equal = group["samples_seen"] == reference["samples_seen"] and len(group["samples_seen"]) == 1
    downstream = {}
    for task, scores in group["finetune"].items():
        if task not in reference["finetune"]:
            continue
        ours, theirs = scores["pooled"], reference["finetune"][task]["pooled"]
        if ours["mean"] is None or theirs["mean"] is None:
            continue
        noise = math.sqrt((ours["std"] ** 2 + theirs["std"] ** 2) / 2)
        gap = ours["mean"] - theirs["mean"]
        downstream[task] = {
            "metric": scores["metric"],
            "gap": gap,
            "std": ours["std"],
            "reference_std": theirs["std"],
            "pooled_std": noise,
            "n": ours["n"],
            "reference_n": theirs["n"],
            # one score per side has no noise estimate
            "within_noise": abs(gap) <= noise if ours["n"] > 1 and theirs["n"] > 1 else None,
        }
    return {
        "group": group["label"],
        "reference": reference["label"],
        "samples_seen": group["samples_seen"],
        "reference_samples_seen": reference["samples_seen"],
        "equal_samples": equal,
        "final_mlm_loss_gap_pct": gap_pct,
        "within_1pct": abs(gap_pct) <= FINAL_LOSS_TARGET_PCT if gap_pct is not None else None,
        "diverged": group["diverged"],
        "runs": len(group["runs"]),
        "finetune": downstream,
    }


def summarize(
    runs: list[Run],
    *,
    target_loss: float | None,
    reference_optimizer: str,
    target_margin: float,
    smoothing: float,
    final_window: int,
) -> dict[str, Any]:
    """Everything the report, the plots and summary.json show."""
    if not runs:
        raise CompareError("runs: nothing to compare")
    target = choose_target(runs, target_loss, reference_optimizer, target_margin, final_window)
    per_run = {run.name: run_summary(run, target, smoothing, final_window) for run in runs}
    groups = {key: group_summary(members, per_run) for key, members in group_runs(runs).items()}
    gaps = []

    def is_reference(group: dict[str, Any]) -> bool:  # the reference optimizer with its default settings
        return group["optimizer"] == reference_optimizer and not group["variant"]

    for (_, batch, global_batch, model), group in groups.items():
        if is_reference(group):
            continue
        candidates = [
            other
            for (_, other_batch, other_global, other_model), other in groups.items()
            if is_reference(other)
            and (other_batch, other_global, other_model) == (batch, global_batch, model)
        ]
        same_workers = [other for other in candidates if other["workers"] == group["workers"]]
        if same_workers or candidates:
            gaps.append(gap_summary(group, (same_workers or candidates)[0]))
    return {
        "target_loss": {"value": target.value, "how": target.how},
        "reference_optimizer": reference_optimizer,
        "smoothing": smoothing,
        "final_window": final_window,
        "runs": list(per_run.values()),
        "groups": list(groups.values()),
        "gaps": gaps,
    }
