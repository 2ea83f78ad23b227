"""The comparison's figures (matplotlib, Agg; no pyplot state). Each function returns a Figure or None.

Curves of a group (runs that differ only by seed) are its runs' EMA-smoothed curves interpolated on the
samples they share; the line is their mean, the band their min-max, the faint line the raw mean. Runs
that diverged (`analysis.diverged`) stay out of their group's curves, as they stay out of its means; the
loss figure draws each as a thin dotted line, clipped at the top of the other curves.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from pretrain.diagnostics import BUCKETS, FAMILIES
from results.compare.analysis import (
    diverged,
    ema,
    group_label,
    group_runs,
    onebit_start_samples,
    phase_boundaries,
)
from results.compare.runs import Run

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]
LINESTYLES = ["-", "--", ":", "-."]


def _styles(runs: list[Run]) -> dict[tuple, dict[str, Any]]:
    """One color per arm (optimizer, exchange variant, workers), one line style per global batch."""
    optimizers = sorted({r.arm for r in runs})
    batches = sorted({r.global_batch for r in runs})
    return {
        key: {
            "color": COLORS[optimizers.index(key[0]) % len(COLORS)],
            "linestyle": LINESTYLES[batches.index(key[2]) % len(LINESTYLES)],
        }
        for key in group_runs(runs)
    }


def group_curve(
    members: list[Run], key: str, smoothing: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """-> (samples, mean smoothed, min smoothed, max smoothed, mean raw) over the group's runs."""
    series = []
    for run in members:
        points = [(r["samples_seen"], r[key]) for r in run.records if key in r and math.isfinite(r[key])]
        if points:
            x = np.array([p[0] for p in points], dtype=float)
            raw = np.array([p[1] for p in points], dtype=float)
            series.append((x, np.array(ema(raw.tolist(), smoothing)), raw))
    if not series:
        return None
    shared = sorted(set.intersection(*(set(x.tolist()) for x, _, _ in series)))
    if len(shared) >= 2 or len(series) == 1:
        grid = np.array(shared) if len(series) > 1 else series[0][0]
    else:  # different logging cadences: interpolate on the first run's points inside every run's range
        low, high = max(x[0] for x, _, _ in series), min(x[-1] for x, _, _ in series)
        grid = series[0][0][(series[0][0] >= low) & (series[0][0] <= high)]
        if grid.size == 0:
            return None
    smooth = np.stack([np.interp(grid, x, s) for x, s, _ in series])
    raw = np.stack([np.interp(grid, x, r) for x, _, r in series])
    return grid, smooth.mean(axis=0), smooth.min(axis=0), smooth.max(axis=0), raw.mean(axis=0)


def _markers(axis, runs: list[Run], styles: dict[tuple, dict[str, Any]]) -> None:
    boundaries = sorted({b for run in runs for b in phase_boundaries(run)})
    for index, boundary in enumerate(boundaries):
        axis.axvline(
            boundary, color="0.5", linestyle=":", linewidth=1, label="phase end" if index == 0 else None
        )
    starts: dict[float, list[tuple]] = {}
    for key, members in group_runs(runs).items():
        found = [s for s in (onebit_start_samples(r) for r in members) if s is not None]
        if found:
            starts.setdefault(min(found), []).append(key)
    for start, keys in starts.items():  # one marker per distinct start, in the group's color if it is alone
        alone = len(keys) == 1
        axis.axvline(
            start,
            color=styles[keys[0]]["color"] if alone else "0.4",
            linestyle="--",
            linewidth=1,
            alpha=0.7,
            label="1-bit stage starts" + (f" ({group_label(group_runs(runs)[keys[0]][0])})" if alone else ""),
        )


def _split(members: list[Run]) -> tuple[list[Run], list[Run]]:
    """(runs that did not diverge, runs that did)."""
    failed = [run for run in members if diverged(run)]
    return [run for run in members if run not in failed], failed


def pretrain_loss_figure(runs: list[Run], smoothing: float, target: float | None) -> Figure:
    figure = Figure(figsize=(12, 4.5), layout="constrained")
    axes = figure.subplots(1, 2)
    styles = _styles(runs)
    for axis, key, title in ((axes[0], "mlm_loss", "MLM loss"), (axes[1], "nsp_loss", "NSP loss")):
        top, bottom = -math.inf, math.inf
        for group_key, members in group_runs(runs).items():
            kept, failed = _split(members)
            style = styles[group_key]
            seeds = f"{len(members)} seed{'s' if len(members) > 1 else ''}"
            label = f"{group_label(members[0])} ({seeds}" + (
                f"; {len(failed)} diverged, dotted)" if failed else ")"
            )
            curve = group_curve(kept, key, smoothing) if kept else None
            if curve is not None:
                grid, mean, low, high, raw = curve
                axis.plot(
                    grid, raw, color=style["color"], linestyle=style["linestyle"], alpha=0.25, linewidth=1
                )
                axis.plot(grid, mean, label=label, linewidth=2, **style)
                top, bottom = max(top, float(np.max(high))), min(bottom, float(np.min(low)))
                if len(kept) > 1:
                    axis.fill_between(grid, low, high, color=style["color"], alpha=0.15, linewidth=0)
            for index, run in enumerate(failed):
                lone = group_curve([run], key, smoothing)
                if lone is not None:
                    axis.plot(
                        lone[0],
                        lone[1],
                        color=style["color"],
                        linestyle=":",
                        linewidth=1,
                        label=label if curve is None and index == 0 else None,
                    )
        _markers(axis, runs, styles)
        if key == "mlm_loss" and target is not None:
            axis.axhline(target, color="k", linewidth=0.8, alpha=0.6, label=f"target {target:.3f}")
        if math.isfinite(top):  # diverged runs leave the axis instead of flattening the rest
            if key == "mlm_loss" and target is not None:
                bottom = min(bottom, target)
            margin = 0.03 * (top - bottom)
            axis.set_ylim(bottom - margin, top + margin)
        axis.set_xlabel("samples seen (sequences)")
        axis.set_ylabel(f"{title} (EMA {smoothing:g}; faint: raw)")
        axis.set_title(title)
        axis.grid(alpha=0.3)
    figure.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=1, fontsize=8)
    return figure


def sample_to_accuracy_figure(runs: list[Run], task: str) -> Figure | None:
    """Fine-tune score vs the checkpoint's pretraining samples: group mean ± pooled std per checkpoint."""
    styles = _styles(runs)
    figure = Figure(figsize=(6.5, 4.5), layout="constrained")
    axis = figure.subplots()
    metric = None
    plotted = False
    groups = group_runs(runs)
    every_x = [r.samples_seen for run in runs for r in run.finetunes if r.task == task and r.samples_seen]
    # groups fine-tuned at the same checkpoints would hide each other: a small offset along x each
    offset = 0.006 * max(every_x, default=0)
    for index, (group_key, members) in enumerate(groups.items()):
        by_samples: dict[int, list[float]] = {}
        for run in members:
            for result in run.finetunes:
                if result.task == task and result.samples_seen is not None:
                    by_samples.setdefault(result.samples_seen, []).extend(result.scores.values())
                    metric = result.metric
        if not by_samples:
            continue
        xs = sorted(by_samples)
        shift = (index - (len(groups) - 1) / 2) * offset
        means = [float(np.mean(by_samples[x])) for x in xs]
        stds = [float(np.std(by_samples[x], ddof=1)) if len(by_samples[x]) > 1 else 0.0 for x in xs]
        style = styles[group_key]
        for x in xs:
            axis.scatter(
                [x + shift] * len(by_samples[x]), by_samples[x], color=style["color"], alpha=0.3, s=12
            )
        axis.errorbar(
            [x + shift for x in xs],
            means,
            yerr=stds,
            marker="o",
            capsize=3,
            label=group_label(members[0]),
            linewidth=2,
            **style,
        )
        plotted = True
    if not plotted:
        return None
    axis.set_xlabel("pretraining samples seen (sequences; groups offset slightly)")
    axis.set_ylabel(f"{task} {metric} (mean ± std over seeds)")
    axis.set_title(f"{task}: fine-tune score vs pretraining samples")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    return figure


def bytes_figure(runs: list[Run]) -> Figure | None:
    """Cumulative bytes sent per rank vs samples, and what LAMB's fp32 allreduce would have sent."""
    if not any(r.records[-1].get("bytes_cumulative") for r in runs):
        return None
    styles = _styles(runs)
    figure = Figure(figsize=(6.5, 4.5), layout="constrained")
    axis = figure.subplots()
    lamb_drawn: set[int] = set()
    for group_key, members in group_runs(runs).items():
        curve = group_curve(members, "bytes_cumulative", 0.0)
        if curve is None:
            continue
        style = styles[group_key]
        axis.plot(curve[0], curve[1] / 1e9, label=group_label(members[0]), linewidth=2, **style)
        lamb = group_curve(members, "bytes_lamb_cumulative", 0.0)
        if lamb is not None and members[0].global_batch not in lamb_drawn:
            lamb_drawn.add(members[0].global_batch)
            axis.plot(
                lamb[0],
                lamb[1] / 1e9,
                color="k",
                linestyle=style["linestyle"],
                linewidth=1,
                alpha=0.6,
                label=f"fp32 allreduce equivalent (b{members[0].global_batch})",
            )
    _markers(axis, runs, styles)
    axis.set_xlabel("samples seen (sequences)")
    axis.set_ylabel("bytes sent per rank, cumulative (GB)")
    axis.set_title("communication volume")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    return figure


# `diagnostics=true` runs (pretrain/diagnostics.py): one figure per metric, one panel per family or
# token-frequency bucket, one line per group; (file, metric prefix, companion prefix drawn dashed, title)
DIAGNOSTIC_FIGURES = (
    ("diagnostics_fidelity.png", "diag/fidelity_cos/", None, "1-bit exchange: cosine to the exact average"),
    (
        "diagnostics_fidelity_error.png",
        "diag/fidelity_rel_error/",
        None,
        "1-bit exchange: relative error against the exact average",
    ),
    (
        "diagnostics_step_fidelity.png",
        "diag/step_fidelity_cos/",
        None,
        "1-bit exchange: cosine to the exact average in step units, m/(√v+ε)",
    ),
    (
        "diagnostics_update_ratio.png",
        "diag/update_ratio/",
        "diag/lamb_update_ratio/",
        "‖Δp‖/‖p‖ per step (dashed: LAMB's trust-ratio rule on the same m, v)",
    ),
    (
        "diagnostics_vocabulary.png",
        "diag/vocab_update_rms/",
        None,
        "word-embedding rows: update norm (RMS) by token count in the data",
    ),
    (
        "diagnostics_output_bias.png",
        "diag/bias_update_rms/",
        None,
        "MLM decoder bias: update (RMS) by token count in the data",
    ),
)
PANEL_ORDER = (*FAMILIES, *(name for name, _, _ in BUCKETS))


def diagnostics_figure(
    runs: list[Run], prefix: str, companion: str | None, title: str, smoothing: float
) -> Figure | None:
    panels = {key[len(prefix) :] for run in runs for r in run.records for key in r if key.startswith(prefix)}
    if not panels:
        return None
    ordered = sorted(
        panels, key=lambda p: (PANEL_ORDER.index(p) if p in PANEL_ORDER else len(PANEL_ORDER), p)
    )
    columns = min(4, len(ordered))
    rows = math.ceil(len(ordered) / columns)
    figure = Figure(figsize=(4.2 * columns, 3.2 * rows + 0.6), layout="constrained")
    axes = np.atleast_1d(figure.subplots(rows, columns, squeeze=False)).reshape(-1)
    styles = _styles(runs)
    for axis, panel in zip(axes, ordered):
        for group_key, members in group_runs(runs).items():
            kept, _ = _split(members)
            curve = group_curve(kept, prefix + panel, smoothing) if kept else None
            if curve is None:
                continue
            style = styles[group_key]
            axis.plot(curve[0], curve[1], label=group_label(members[0]), linewidth=1.6, **style)
            twin = group_curve(kept, companion + panel, smoothing) if companion else None
            if twin is not None:
                axis.plot(twin[0], twin[1], color=style["color"], linestyle=":", linewidth=1.2, alpha=0.8)
        axis.set_title(panel, fontsize=10)
        axis.set_xlabel("samples seen")
        axis.grid(alpha=0.3)
        if "ratio" in prefix or "rms" in prefix:
            axis.set_yscale("log")
    for axis in axes[len(ordered) :]:
        axis.set_visible(False)
    handles = {label: handle for axis in axes for handle, label in zip(*axis.get_legend_handles_labels())}
    figure.legend(list(handles.values()), list(handles), loc="outside lower center", ncols=2, fontsize=8)
    figure.suptitle(f"{title} (EMA {smoothing:g}; runs that diverged left out)")
    return figure


def figures(runs: list[Run], summary: dict[str, Any]) -> dict[str, Figure]:
    """{file name: figure} for every plot that has data."""
    out: dict[str, Figure] = {
        "pretrain_loss.png": pretrain_loss_figure(runs, summary["smoothing"], summary["target_loss"]["value"])
    }
    tasks = sorted({result.task for run in runs for result in run.finetunes})
    for task in tasks:
        figure = sample_to_accuracy_figure(runs, task)
        if figure is not None:
            out[f"sample_to_accuracy_{task}.png"] = figure
    figure = bytes_figure(runs)
    if figure is not None:
        out["bytes.png"] = figure
    for name, prefix, companion, title in DIAGNOSTIC_FIGURES:
        figure = diagnostics_figure(runs, prefix, companion, title, summary["smoothing"])
        if figure is not None:
            out[name] = figure
    return out
