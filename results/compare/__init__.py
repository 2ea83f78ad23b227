"""The comparison step: pretraining runs (and their fine-tunes) -> results/<study>/ report, plots, summary.

    python -m results.compare study=demo runs='[results/runs/demo-lamb,results/runs/demo-onebit_lamb]'
    outputs = run_compare(cfg)          # cfg: results.compare.config.CompareConfig

Outputs in `cfg.output_dir`: report.md, summary.json (the tables' numbers), pretrain_loss.png (the main
comparison), pretrain_loss_ablations.png, sample_to_accuracy_<task>.png, bytes.png, diagnostics_*.png.
Everything is computed before anything is written; each file is written to a temporary name and renamed.
Bad input raises `CompareError` (one line).
"""

from __future__ import annotations

import io
import json
import math
import os
from pathlib import Path
from typing import Any

from results.compare.runs import CompareError, Run, load_local_runs, load_wandb_runs

__all__ = ["CompareError", "build", "load_runs", "run_compare", "write_outputs"]


def load_runs(cfg: Any) -> list[Run]:
    from results.compare.config import RunSource

    if cfg.wandb.source is RunSource.wandb:
        return load_wandb_runs(cfg.wandb.project, cfg.wandb.entity, cfg.wandb.group, list(cfg.runs))
    return load_local_runs(cfg.runs)


def build(runs: list[Run], cfg: Any, invocation: str) -> dict[str, bytes]:
    """{file name: content} of every output (nothing written yet)."""
    import matplotlib

    matplotlib.use("Agg")
    from results.compare.analysis import summarize
    from results.compare.plots import figure_key, figures
    from results.compare.report import render

    summary = summarize(
        runs,
        target_loss=cfg.target_loss,
        reference_optimizer=cfg.reference_optimizer,
        target_margin=cfg.target_margin,
        smoothing=cfg.smoothing,
        final_window=cfg.final_window,
    )
    outputs: dict[str, bytes] = {}
    for name, figure in figures(runs, summary).items():
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=120)
        outputs[name] = buffer.getvalue()
    report = render(
        summary, study=cfg.study, invocation=invocation, figures=list(outputs), figure_key=figure_key(runs)
    )
    payload = {"study": cfg.study, "invocation": invocation, "figures": list(outputs), **summary}
    outputs["summary.json"] = (json.dumps(_finite(payload), indent=1, allow_nan=False) + "\n").encode()
    outputs["report.md"] = report.encode()
    return outputs


def write_outputs(output_dir: Path, outputs: dict[str, bytes]) -> None:
    """Each file to a temporary name in `output_dir`, then renamed over the old one (report.md last)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    order = sorted(outputs, key=lambda name: name == "report.md")
    for name in order:
        tmp = output_dir / f".{name}.tmp-{os.getpid()}"
        try:
            tmp.write_bytes(outputs[name])
            os.replace(tmp, output_dir / name)
        finally:
            tmp.unlink(missing_ok=True)


def run_compare(cfg: Any, invocation: str | None = None) -> Path:
    """Load, summarize, plot and write; -> the report's path."""
    runs = load_runs(cfg)
    outputs = build(runs, cfg, invocation or f"python -m results.compare study={cfg.study}")
    output_dir = Path(cfg.output_dir)
    write_outputs(output_dir, outputs)
    return output_dir / "report.md"


def _finite(value: Any) -> Any:
    """NaN/inf -> None so summary.json is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
