"""report.md from the summary (results.compare.analysis.summarize): per-run, per-group and gap tables."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from results.compare.analysis import FINAL_LOSS_TARGET_PCT


def number(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "–"
    return f"{value:.{digits}f}"


def integer(value: float | None) -> str:
    return "–" if value is None else f"{round(value):,}"


def nbytes(value: float | None) -> str:
    if not value:
        return "–"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} B"


def seconds(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:.1f} s" if value < 600 else f"{value / 60:.1f} min"


def score_formatter(values: list[float]):
    """Two decimals for scores in points (SQuAD 0-100), four for fractions (GLUE 0-1)."""
    digits = 2 if any(abs(v) > 1.5 for v in values) else 4
    return lambda v: f"{v:.{digits}f}"


def plus_minus(stats: dict[str, Any], formatter=number) -> str:
    if stats.get("mean") is None:
        return "–"
    text = formatter(stats["mean"])
    if stats.get("n", 0) > 1:
        text += f" ± {formatter(stats['std'])}"
    return text


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _tasks(summary: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """(task, main metric, score formatter) of every task some run was fine-tuned on."""
    found: dict[str, str] = {}
    scores: dict[str, list[float]] = {}
    for run in summary["runs"]:
        for task, result in run["finetune"].items():
            found.setdefault(task, result["metric"])
            scores.setdefault(task, []).extend(result["scores"].values())
    return [(task, found[task], score_formatter(scores[task])) for task in sorted(found)]


def render(
    summary: dict[str, Any],
    *,
    study: str,
    invocation: str,
    figures: list[str],
    figure_key: Sequence[tuple[str, str]] = (),
) -> str:
    """The report; `figure_key`: (short name or code in the figures, the arm's full name in the tables)."""
    tasks = _tasks(summary)
    target = summary["target_loss"]
    parts = [
        f"# Comparison: {study}",
        "",
        f"Written by `{invocation}`.",
        "",
        f"- **Target MLM loss** {target['value']:.4f} ({target['how']}). *Samples to target*: `samples_seen` "
        f"of the first logged record whose EMA-smoothed MLM loss (weight {summary['smoothing']:g}: "
        "s_i = w·s_(i−1) + (1−w)·x_i) is at or below it.",
        f"- **Final** losses: mean of the raw values of the last {summary['final_window']} logged records "
        "of the run's last phase.",
        "- **Train time**: Σ step_seconds × steps since the previous logged record (start-up, checkpoints "
        "and evaluation not counted; W&B's run time for W&B runs); samples/s = samples seen / train time.",
        "- **Bytes**: gradient/momentum bytes sent per rank (`bytes_cumulative`); volume reduction vs LAMB = "
        "`bytes_lamb_cumulative` / `bytes_cumulative` (what an fp32 ring allreduce would have sent).",
        "- **Groups**: runs that differ only by seed; mean ± sample std over their runs. Downstream scores: "
        "the main metric at each run's last fine-tuned checkpoint.",
        "",
        "## Runs",
        "",
        table(
            [
                "run",
                "optimizer",
                "global batch",
                "model",
                "seed",
                "steps",
                "samples",
                "freeze_step",
                "source",
            ],
            [
                [
                    r["name"],
                    r["optimizer"],
                    str(r["global_batch"]),
                    r["model"] or "–",
                    "–" if r["seed"] is None else str(r["seed"]),
                    str(r["steps"]),
                    integer(r["samples_seen"]),
                    "–" if r["freeze_step"] is None else str(r["freeze_step"]),
                    f"`{r['source']}`",
                ]
                for r in summary["runs"]
            ],
        ),
        "",
    ]
    commands = [(r["name"], r["command"]) for r in summary["runs"] if r["command"]]
    if commands:
        parts += ["Pretraining commands (from each run's `config.yaml`):", "", "```bash"]
        parts += [command for _, command in commands] + ["```", ""]
    parts += ["## Per run", "", _run_table(summary, tasks), ""]
    parts += ["## Per group (mean ± std over pretraining seeds)", "", _group_table(summary, tasks), ""]
    if tasks:
        parts += [
            "Downstream cells: mean ± std over pretraining seeds of each run's mean over fine-tune seeds; "
            "[pooled std over every (pretraining seed, fine-tune seed) score, n].",
            "",
        ]
    parts += _gaps(summary, {task: score for task, _, score in tasks})
    if figures:
        parts += ["## Plots", ""] + [f"![{name}]({name})" for name in figures] + [""]
        parts += [
            "Curves: mean over a group's seeds of the EMA-smoothed curves (band: min–max over seeds; faint: "
            "raw mean); dashed verticals: where the 1-bit compression stage starts (after `freeze_step` "
            "steps; the first record with onebit_stage = 1 when the config is unknown); dotted: phase ends.",
            "",
        ]
        if figure_key:
            parts += _figure_key(figure_key)
    notes = [f"- {r['name']}: {r['config_note']}" for r in summary["runs"] if r["config_note"]]
    notes += [f"- {r['name']}: {note}" for r in summary["runs"] for note in r.get("finetune_notes", [])]
    notes += [f"- {g['label']}: {note}" for g in summary["groups"] for note in g["notes"]]
    if notes:
        parts += ["## Notes", "", *notes, ""]
    return "\n".join(parts)


def _figure_key(key: Sequence[tuple[str, str]]) -> list[str]:
    return [
        "Names in the figures: the main comparison (LAMB, 1-bit LAMB's shipped default, DeepSpeed's "
        "1-bit LAMB, AdamW) by short name, every other arm by a code (its figures: "
        "`pretrain_loss_ablations.png`, each ablation against the main arms at its workers, and the "
        "`*_ablations.png` diagnostics); then the workers (`n2`: 2 processes, `sim32`: 32 workers, some "
        "simulated) and, where the study has several, the global batch and the model.",
        "",
        table(["in the figures", "arm (as in the tables)"], [[short, f"`{full}`"] for short, full in key]),
        "",
    ]


def _run_table(summary: dict[str, Any], tasks: list[tuple[str, str, Any]]) -> str:
    header = ["run", "samples to target", "final MLM", "final NSP"]
    header += [f"{task} {metric}" for task, metric, _ in tasks]
    header += ["samples/s", "bytes sent", "vol. reduction vs LAMB", "train time"]
    rows = []
    for r in summary["runs"]:
        row = [
            r["name"],
            integer(r["samples_to_target"]) if r["samples_to_target"] is not None else "not reached",
            "diverged" if r.get("diverged") else number(r["final_mlm_loss"]),
            number(r["final_nsp_loss"]),
        ]
        for task, _, score in tasks:
            result = r["finetune"].get(task)
            row.append(plus_minus(result, score) + f" (n={result['n']})" if result else "–")
        row += [
            number(r["samples_per_s"], 1) if r["samples_per_s"] else "–",
            nbytes(r["bytes_cumulative"]),
            f"{r['volume_reduction_vs_lamb']:.2f}×" if r["volume_reduction_vs_lamb"] else "–",
            seconds(r["train_seconds"]),
        ]
        rows.append(row)
    return table(header, rows)


def _group_table(summary: dict[str, Any], tasks: list[tuple[str, str, Any]]) -> str:
    header = ["group", "runs", "samples to target", "final MLM", "final NSP"]
    header += [f"{task} {metric}" for task, metric, _ in tasks]
    header += ["samples/s", "bytes sent", "vol. reduction vs LAMB", "train time"]
    rows = []
    for g in summary["groups"]:
        target = g["samples_to_target"]
        reached = plus_minus(target, integer) if target["reached"] else "not reached"
        if target["reached"] != target["of"]:
            reached += f" ({target['reached']}/{target['of']} reached)"
        row = [
            g["label"],
            str(len(g["runs"])),
            reached,
            plus_minus(g["final_mlm_loss"]),
            plus_minus(g["final_nsp_loss"]),
        ]
        for task, _, score in tasks:
            result = g["finetune"].get(task)
            if result is None:
                row.append("–")
                continue
            pooled = result["pooled"]
            row.append(
                plus_minus(result["over_pretraining_seeds"], score)
                + f" [{score(pooled['std'])}, n={pooled['n']}]"
            )
        row += [
            plus_minus(g["samples_per_s"], lambda v: f"{v:.1f}"),
            plus_minus(g["bytes_cumulative"], nbytes),
            plus_minus(g["volume_reduction_vs_lamb"], lambda v: f"{v:.2f}×"),
            plus_minus(g["train_seconds"], seconds),
        ]
        rows.append(row)
    return table(header, rows)


def _gaps(summary: dict[str, Any], scores: dict[str, Any]) -> list[str]:
    reference = summary["reference_optimizer"]
    parts = [f"## Gap to {reference} at equal samples", ""]
    if not summary["gaps"]:
        return [
            *parts,
            f"No group has a {reference} group with the same batch and model to compare with.",
            "",
        ]
    rows = []
    for gap in summary["gaps"]:
        loss_gap = gap["final_mlm_loss_gap_pct"]
        verdict = "–" if gap["within_1pct"] is None else ("yes" if gap["within_1pct"] else "no")
        if gap.get("diverged"):
            verdict = f"no: {gap['diverged']} of {gap['runs']} runs diverged"
        downstream = []
        for task, d in sorted(gap["finetune"].items()):
            within = {None: "one score per side", True: "within noise", False: "outside noise"}[
                d["within_noise"]
            ]
            score = scores.get(task, lambda v: f"{v:.4f}")
            downstream.append(
                f"{task} {d['metric']}: {'+' if d['gap'] >= 0 else ''}{score(d['gap'])} "
                f"vs std {score(d['pooled_std'])} ({within})"
            )
        samples = (
            integer(gap["samples_seen"][0])
            if gap["equal_samples"]
            else (f"unequal: {gap['samples_seen']} vs {gap['reference_samples_seen']}")
        )
        rows.append(
            [
                gap["group"],
                gap["reference"],
                samples,
                "–" if loss_gap is None else f"{loss_gap:+.2f}%",
                verdict,
                "; ".join(downstream) or "–",
            ]
        )
    parts.append(
        table(
            [
                "group",
                "vs",
                "samples",
                "final MLM loss gap",
                f"within {FINAL_LOSS_TARGET_PCT:g}%",
                "downstream gap",
            ],
            rows,
        )
    )
    parts += [
        "",
        "Loss gap: (group − reference) / reference of the groups' mean final MLM loss. Downstream gap: "
        "group − reference mean score, compared with the pooled std sqrt((s_a² + s_b²)/2) of every "
        "(pretraining seed, fine-tune seed) score of the two groups.",
        "",
    ]
    return parts
