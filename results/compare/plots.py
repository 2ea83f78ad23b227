"""The comparison's figures (matplotlib, Agg; no pyplot state). Each function returns a Figure or None.

Curves of a group (runs that differ only by seed) are its runs' EMA-smoothed curves interpolated on the
samples they share; the line is their mean, the band their min-max, the faint line the raw mean. Runs
that diverged (`analysis.diverged`) stay out of their group's curves, as they stay out of its means; the
loss figure draws each as a thin dotted line, clipped at the top of the other curves.

Names (`naming`): the main comparison — LAMB, 1-bit LAMB's shipped default, DeepSpeed's 1-bit LAMB, AdamW
— goes by short names (`lamb`, `onebit_lamb`, `onebit_lamb_deepspeed`, `adamw`), every other arm (an
ablation) by a code `A1`, `A2`, …; each followed by its workers (`n2`: 2 processes, `sim32`: 32 workers,
some simulated) and, where the study has several, the global batch and the model. The key from these names
to the arms' full names is printed in the report. Headline figures show the main comparison;
`pretrain_loss_ablations.png` draws each ablation in its own panel against the main arms at its workers,
and every diagnostics figure has an `_ablations` twin with every group (a metric that only ablations
logged gets one figure, under the plain name, with every group). Legends sit under the axes, inside
the figure, in as many columns as its width holds.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.legend import Legend
from matplotlib.lines import Line2D
from matplotlib.ticker import EngFormatter, MaxNLocator

from pretrain.observability.diagnostics import BUCKETS, FAMILIES
from results.compare.analysis import (
    diverged,
    ema,
    group_runs,
    onebit_start_samples,
    phase_boundaries,
)
from results.compare.runs import Run

GroupKey = tuple[str, str, int, str]

MAIN_NAMES = ("lamb", "onebit_lamb", "onebit_lamb_deepspeed", "adamw")  # the headline's order
MAIN_COLORS = {
    "lamb": "#1f77b4",
    "onebit_lamb": "#d62728",
    "onebit_lamb_deepspeed": "#2ca02c",
    "adamw": "#ff7f0e",
}
# ablations: colors apart from the main names' (tab10's other six, then tab20b)
ABLATION_COLORS = [
    "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
    "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#5254a3", "#8ca252", "#bd9e39", "#ad494a",
    "#a55194", "#6b6ecf", "#b5cf6b", "#e7ba52", "#d6616b", "#ce6dbd",
]  # fmt: skip
# one per workers setting; dotted stays for diverged runs and companion curves
LINESTYLES: list[Any] = ["-", "--", "-.", (0, (5, 1, 1, 1, 1, 1)), (0, (8, 2)), (0, (3, 1, 1, 1))]
LEGEND_FONTSIZE = 8
ABLATION_ZOOM_FROM = 0.25  # ablation panels: the y-axis spans the curves from this fraction of the samples on


# -- names -----------------------------------------------------------------------------------------------
def arm_name(run: Run) -> str:
    """The arm without its workers, as the report's tables name it: `optimizer[variant]`."""
    return run.optimizer + (f"[{run.variant}]" if run.variant else "")


def main_name(run: Run) -> str | None:
    """The run's short name in the main comparison (`lamb`, `onebit_lamb`, `onebit_lamb_deepspeed`,
    `adamw`), or None for an ablation."""
    # runs.py names a 1-bit LAMB run by its preset and what it changed (`onebit_lamb_identity`)
    return run.optimizer if not run.variant and run.optimizer in MAIN_NAMES else None


def workers_name(run: Run) -> str:
    """`n2` (2 real workers), `sim32` (32 workers, some simulated); "" when unknown."""
    if run.workers is None:
        return ""
    return f"{'sim' if run.simulated else 'n'}{run.workers}"


@dataclass(frozen=True)
class Naming:
    """Short names of a study's groups (group keys as `analysis.group_runs`)."""

    labels: dict[GroupKey, str]  # e.g. "onebit_lamb sim32", "A3 n2", "lamb n2 b32" (batch: the study has two)
    bases: dict[GroupKey, str]  # the label's name part: "onebit_lamb", "A3"
    settings: dict[GroupKey, str]  # its workers (and batch, model) part: "sim32", "n2 b32"
    main: list[GroupKey]  # the main comparison, in MAIN_NAMES order, then by workers
    ablations: list[GroupKey]  # every other group, by code, then by workers
    key: list[tuple[str, str]]  # (short name or code, the arm's full name), main names first


def naming(runs: list[Run]) -> Naming:
    groups = group_runs(runs)
    firsts = {key: members[0] for key, members in groups.items()}
    several_batches = len({run.global_batch for run in firsts.values()}) > 1
    several_models = len({run.model for run in firsts.values()}) > 1
    settings = {}
    for key, run in firsts.items():
        parts = [workers_name(run)]
        parts += [f"b{run.global_batch}"] if several_batches else []
        parts += [run.model or "–"] if several_models else []
        settings[key] = " ".join(part for part in parts if part)
    mains = {key: main_name(run) for key, run in firsts.items()}
    codes: dict[str, str] = {}
    for key, run in firsts.items():
        if mains[key] is None:
            codes.setdefault(arm_name(run), f"A{len(codes) + 1}")
    bases = {key: mains[key] or codes[arm_name(firsts[key])] for key in firsts}

    def order(key: GroupKey) -> tuple:
        run = firsts[key]
        base = bases[key]
        rank = MAIN_NAMES.index(base) if base in MAIN_NAMES else len(MAIN_NAMES) + int(base[1:])
        return (rank, run.workers is None, run.simulated, run.workers or 0, run.global_batch, run.model or "")

    ordered = sorted(firsts, key=order)
    full_names: dict[str, list[str]] = {}  # a main name can stand for two spellings of one arm
    for k in ordered:
        arms = full_names.setdefault(bases[k], [])
        arms += [arm_name(firsts[k])] if arm_name(firsts[k]) not in arms else []
    return Naming(
        labels={k: f"{bases[k]} {settings[k]}".strip() for k in firsts},
        bases=bases,
        settings=settings,
        main=[k for k in ordered if mains[k] is not None],
        ablations=[k for k in ordered if mains[k] is None],
        key=[(base, "; ".join(arms)) for base, arms in full_names.items()],
    )


def figure_key(runs: list[Run]) -> list[tuple[str, str]]:
    """(short name or code, the arm's full name) of every arm in the figures: the report prints it."""
    return naming(runs).key


def _styles(names: Naming) -> dict[GroupKey, dict[str, Any]]:
    """A color per name (main) or code (ablation), a line style per workers setting."""
    settings = sorted(
        set(names.settings.values()), key=[names.settings[k] for k in names.main + names.ablations].index
    )
    codes = list(dict.fromkeys(names.bases[k] for k in names.ablations))
    styles = {}
    for key, base in names.bases.items():
        color = MAIN_COLORS.get(base) or ABLATION_COLORS[codes.index(base) % len(ABLATION_COLORS)]
        styles[key] = {
            "color": color,
            "linestyle": LINESTYLES[settings.index(names.settings[key]) % len(LINESTYLES)],
        }
    return styles


# -- layout ----------------------------------------------------------------------------------------------
def _figure(width: float, height: float) -> Figure:
    """A constrained-layout figure with an Agg canvas (legends are measured before saving)."""
    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _suptitle(figure: Figure, text: str, fontsize: float = 12) -> None:
    """The title, wrapped to the figure's width (about 0.55 em per character)."""
    characters = max(20, int(figure.get_figwidth() * 72 / (0.55 * fontsize)))
    figure.suptitle(textwrap.fill(text, characters), fontsize=fontsize)


def _samples_axis(axis: Axes) -> None:
    axis.xaxis.set_major_formatter(EngFormatter(sep=""))  # 400k, not 400000 run into its neighbour
    axis.xaxis.set_major_locator(MaxNLocator(nbins=5))


def legend_below(figure: Figure, handles: Sequence[Artist], labels: Sequence[str]) -> Legend | None:
    """A figure legend under the axes and inside the figure, in as many columns as its width holds (rows
    balanced); the figure widens when one entry alone is wider."""
    if not handles:
        return None
    canvas = figure.canvas if isinstance(figure.canvas, FigureCanvasAgg) else FigureCanvasAgg(figure)
    renderer = canvas.get_renderer()
    room = 0.97 * figure.bbox.width
    legend = None
    for columns in range(len(labels), 0, -1):
        legend = figure.legend(
            handles, labels, loc="outside lower center", ncols=columns, fontsize=LEGEND_FONTSIZE
        )
        width = legend.get_window_extent(renderer).width
        if width <= room or columns == 1:
            rows = math.ceil(len(labels) / columns)
            balanced = math.ceil(len(labels) / rows)
            if balanced != columns:
                legend.remove()
                legend = figure.legend(
                    handles, labels, loc="outside lower center", ncols=balanced, fontsize=LEGEND_FONTSIZE
                )
            if width > room:
                figure.set_figwidth((width / 0.97 + 1) / figure.dpi)
            return legend
        legend.remove()
    return legend


# -- curves ----------------------------------------------------------------------------------------------
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


def _markers(
    axis: Axes, groups: dict[GroupKey, list[Run]], names: Naming, styles: dict[GroupKey, dict[str, Any]]
) -> None:
    """Dotted verticals at phase ends, dashed ones where a group's 1-bit stage starts."""
    runs = [run for members in groups.values() for run in members]
    boundaries = sorted({b for run in runs for b in phase_boundaries(run)})
    for index, boundary in enumerate(boundaries):
        axis.axvline(
            boundary, color="0.5", linestyle=":", linewidth=1, label="phase end" if index == 0 else None
        )
    starts: dict[float, list[GroupKey]] = {}
    for key, members in groups.items():
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
            label="1-bit stage starts" + (f" ({names.labels[keys[0]]})" if alone else ""),
        )


def _split(members: list[Run]) -> tuple[list[Run], list[Run]]:
    """(runs that did not diverge, runs that did)."""
    failed = [run for run in members if diverged(run)]
    return [run for run in members if run not in failed], failed


def _select(runs: list[Run], keys: list[GroupKey]) -> dict[GroupKey, list[Run]]:
    groups = group_runs(runs)
    return {key: groups[key] for key in keys}


def _headline(names: Naming) -> list[GroupKey]:
    """The main comparison; every group when the study has none of it."""
    return names.main or names.ablations


def _figure_legend(figure: Figure, axes: Sequence[Axes]) -> Legend | None:
    """One legend for the figure: every labelled artist of `axes`, each label once."""
    entries: dict[str, Artist] = {}
    for axis in axes:
        for handle, label in zip(*axis.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    return legend_below(figure, list(entries.values()), list(entries))


# -- figures ---------------------------------------------------------------------------------------------
def pretrain_loss_figure(
    runs: list[Run], smoothing: float, target: float | None, names: Naming | None = None
) -> Figure:
    """MLM and NSP loss vs samples of the main comparison (every group when the study has none of it)."""
    names = names or naming(runs)
    styles = _styles(names)
    groups = _select(runs, _headline(names))
    figure = _figure(12, 5)
    axes = figure.subplots(1, 2)
    for axis, key, title in ((axes[0], "mlm_loss", "MLM loss"), (axes[1], "nsp_loss", "NSP loss")):
        top, bottom = -math.inf, math.inf
        for group_key, members in groups.items():
            kept, failed = _split(members)
            style = styles[group_key]
            seeds = f"{len(members)} seed{'s' if len(members) > 1 else ''}"
            label = f"{names.labels[group_key]} ({seeds}" + (
                f"; {len(failed)} diverged, dotted)" if failed else ")"
            )
            curve = group_curve(kept, key, smoothing) if kept else None
            if curve is not None:
                grid, mean, low, high, raw = curve
                axis.plot(
                    grid, raw, color=style["color"], linestyle=style["linestyle"], alpha=0.2, linewidth=1
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
        _markers(axis, groups, names, styles)
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
        _samples_axis(axis)
    _figure_legend(figure, [axes[0]])
    return figure


def _references(key: GroupKey, names: Naming, firsts: dict[GroupKey, Run]) -> list[GroupKey]:
    """The main groups an ablation panel draws: same batch and model, same workers; LAMB and AdamW at any
    workers when not run at these (their arithmetic does not depend on the number of workers)."""
    run = firsts[key]

    def same(other: GroupKey) -> bool:
        return firsts[other].global_batch == run.global_batch and firsts[other].model == run.model

    chosen = [k for k in names.main if same(k) and names.settings[k] == names.settings[key]]
    for exact in ("lamb", "adamw"):
        if not any(names.bases[k] == exact for k in chosen):
            chosen += [k for k in names.main if same(k) and names.bases[k] == exact][:1]
    return chosen


def ablation_loss_figure(runs: list[Run], smoothing: float, names: Naming | None = None) -> Figure | None:
    """MLM loss of each ablation group (black, its own panel) against the main groups at its workers."""
    names = names or naming(runs)
    if not names.main or not names.ablations:
        return None
    groups = group_runs(runs)
    firsts = {key: members[0] for key, members in groups.items()}
    styles = _styles(names)
    columns = min(4, len(names.ablations))
    rows = math.ceil(len(names.ablations) / columns)
    figure = _figure(max(3.5 * columns + 0.3, 7.5), 2.7 * rows + 1.4)
    axes = np.atleast_1d(figure.subplots(rows, columns, squeeze=False)).reshape(-1)
    ablation = "ablation (panel title; key in report.md)"
    handles: dict[str, Artist] = {ablation: Line2D([], [], color="k", linewidth=2.0)}
    any_start = False
    for axis, key in zip(axes, names.ablations):
        tails: list[np.ndarray] = []
        drawn = [(k, styles[k]["color"], 1.2) for k in _references(key, names, firsts)] + [(key, "k", 2.0)]
        for group_key, color, width in drawn:
            kept, failed = _split(groups[group_key])
            curve = group_curve(kept, "mlm_loss", smoothing) if kept else None
            name = names.bases[group_key]
            if curve is not None:
                grid, mean, low, high, _ = curve
                (line,) = axis.plot(grid, mean, color=color, linewidth=width)
                if group_key != key:
                    handles.setdefault(name, line)
                if group_key == key and len(kept) > 1:
                    axis.fill_between(grid, low, high, color=color, alpha=0.15, linewidth=0)
                tails.append(np.concatenate([low, high])[np.tile(grid, 2) >= ABLATION_ZOOM_FROM * grid[-1]])
            for run in failed if group_key == key else []:  # the references' diverged runs: in the headline
                lone = group_curve([run], "mlm_loss", smoothing)
                if lone is not None:
                    axis.plot(lone[0], lone[1], color=color, linestyle=":", linewidth=1)
        starts = {s for r in groups[key] if (s := onebit_start_samples(r)) is not None}
        any_start = any_start or bool(starts)
        for start in starts:
            axis.axvline(start, color="0.4", linestyle="--", linewidth=0.8, alpha=0.7)
        values = np.concatenate(tails) if tails else np.array([])
        if values.size:
            lowest, highest = float(values.min()), float(values.max())
            margin = 0.05 * (highest - lowest) or 0.05 * abs(highest) or 0.05
            axis.set_ylim(lowest - margin, highest + margin)
        failed_runs = sum(diverged(r) for r in groups[key])
        title = names.labels[key] + (f" ({failed_runs} diverged, dotted)" if failed_runs else "")
        axis.set_title(title, fontsize=10)
        axis.set_xlabel("samples seen", fontsize=8)
        axis.grid(alpha=0.3)
        axis.tick_params(labelsize=8)
        _samples_axis(axis)
    for axis in axes[len(names.ablations) :]:
        axis.set_visible(False)
    if any_start:
        handles["1-bit stage starts"] = Line2D([], [], color="0.4", linestyle="--", linewidth=0.8)
    figure.supylabel(f"MLM loss (EMA {smoothing:g})", fontsize=10)
    _suptitle(
        figure,
        f"Ablations: MLM loss against the main comparison at the same workers (y from "
        f"{ABLATION_ZOOM_FROM:.0%} of the samples on)",
    )
    order = sorted(
        handles, key=lambda n: MAIN_NAMES.index(n) if n in MAIN_NAMES else -1 if n == ablation else 9
    )
    legend_below(figure, [handles[n] for n in order], order)
    return figure


def sample_to_accuracy_figure(runs: list[Run], task: str, names: Naming | None = None) -> Figure | None:
    """Fine-tune score vs the checkpoint's pretraining samples: group mean ± pooled std per checkpoint."""
    names = names or naming(runs)
    styles = _styles(names)
    figure = _figure(7, 5)
    axis = figure.subplots()
    metric = None
    groups = {
        key: members
        for key, members in _select(runs, names.main + names.ablations).items()
        if any(r.task == task and r.samples_seen is not None for run in members for r in run.finetunes)
    }
    if not groups:
        return None
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
            label=names.labels[group_key],
            linewidth=2,
            **style,
        )
    axis.set_xlabel("pretraining samples seen (sequences; groups offset slightly)")
    axis.set_ylabel(f"{task} {metric} (mean ± std over seeds)")
    axis.set_title(f"{task}: fine-tune score vs pretraining samples")
    axis.grid(alpha=0.3)
    _samples_axis(axis)
    _figure_legend(figure, [axis])
    return figure


def bytes_figure(runs: list[Run], names: Naming | None = None) -> Figure | None:
    """Cumulative bytes sent per rank vs samples (main comparison), and what LAMB's fp32 allreduce would
    have sent."""
    if not any(r.records[-1].get("bytes_cumulative") for r in runs):
        return None
    names = names or naming(runs)
    styles = _styles(names)
    groups = _select(runs, _headline(names))
    figure = _figure(7, 5)
    axis = figure.subplots()
    lamb_drawn: set[int] = set()
    for group_key, members in groups.items():
        curve = group_curve(members, "bytes_cumulative", 0.0)
        if curve is None:
            continue
        style = styles[group_key]
        axis.plot(curve[0], curve[1] / 1e9, label=names.labels[group_key], linewidth=2, **style)
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
    _markers(axis, groups, names, styles)
    axis.set_xlabel("samples seen (sequences)")
    axis.set_ylabel("bytes sent per rank, cumulative (GB)")
    axis.set_title("communication volume")
    axis.grid(alpha=0.3)
    _samples_axis(axis)
    _figure_legend(figure, [axis])
    return figure


# `diagnostics=true` runs (pretrain/observability/diagnostics.py): one figure per metric, one panel per
# family or
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
        "‖Δp‖/‖p‖ per step (dotted: LAMB's trust-ratio rule on the same m, v)",
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
    runs: list[Run],
    prefix: str,
    companion: str | None,
    title: str,
    smoothing: float,
    names: Naming | None = None,
    keys: list[GroupKey] | None = None,
) -> Figure | None:
    """One panel per family or bucket, one line per group of `keys` (default: the main comparison)."""
    names = names or naming(runs)
    groups = _select(runs, _headline(names) if keys is None else keys)
    members_runs = [run for members in groups.values() for run in members]
    panels = {
        key[len(prefix) :] for run in members_runs for r in run.records for key in r if key.startswith(prefix)
    }
    if not panels:
        return None
    ordered = sorted(
        panels, key=lambda p: (PANEL_ORDER.index(p) if p in PANEL_ORDER else len(PANEL_ORDER), p)
    )
    columns = min(4, len(ordered))
    rows = math.ceil(len(ordered) / columns)
    figure = _figure(4.2 * columns, 3.2 * rows + 1.0)
    axes = np.atleast_1d(figure.subplots(rows, columns, squeeze=False)).reshape(-1)
    styles = _styles(names)
    for axis, panel in zip(axes, ordered):
        for group_key, members in groups.items():
            kept, _ = _split(members)
            curve = group_curve(kept, prefix + panel, smoothing) if kept else None
            if curve is None:
                continue
            style = styles[group_key]
            axis.plot(curve[0], curve[1], label=names.labels[group_key], linewidth=1.6, **style)
            twin = group_curve(kept, companion + panel, smoothing) if companion else None
            if twin is not None:
                axis.plot(twin[0], twin[1], color=style["color"], linestyle=":", linewidth=1.2, alpha=0.8)
        axis.set_title(panel, fontsize=10)
        axis.set_xlabel("samples seen")
        axis.grid(alpha=0.3)
        _samples_axis(axis)
        if "ratio" in prefix or "rms" in prefix:
            axis.set_yscale("log")
    for axis in axes[len(ordered) :]:
        axis.set_visible(False)
    _suptitle(figure, f"{title} (EMA {smoothing:g}; runs that diverged left out)")
    _figure_legend(figure, list(axes))
    return figure


def figures(runs: list[Run], summary: dict[str, Any]) -> dict[str, Figure]:
    """{file name: figure} for every plot that has data."""
    names = naming(runs)
    smoothing = summary["smoothing"]
    out: dict[str, Figure] = {
        "pretrain_loss.png": pretrain_loss_figure(runs, smoothing, summary["target_loss"]["value"], names)
    }
    figure = ablation_loss_figure(runs, smoothing, names)
    if figure is not None:
        out["pretrain_loss_ablations.png"] = figure
    tasks = sorted({result.task for run in runs for result in run.finetunes})
    for task in tasks:
        figure = sample_to_accuracy_figure(runs, task, names)
        if figure is not None:
            out[f"sample_to_accuracy_{task}.png"] = figure
    figure = bytes_figure(runs, names)
    if figure is not None:
        out["bytes.png"] = figure
    every = names.main + names.ablations
    for name, prefix, companion, title in DIAGNOSTIC_FIGURES:
        main = diagnostics_figure(runs, prefix, companion, title, smoothing, names)
        everything = None
        if names.main and names.ablations:
            everything = diagnostics_figure(
                runs, prefix, companion, f"{title}, every arm", smoothing, names, every
            )
        if main is not None:
            out[name] = main
            if everything is not None:
                out[name.replace(".png", "_ablations.png")] = everything
        elif everything is not None:  # only ablations logged this metric: they take the plain name
            out[name] = everything
    return out
