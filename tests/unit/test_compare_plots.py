"""The comparison's figures stay readable with many long-named arms: short names for the main comparison,
codes for ablations (keyed in the report), every legend inside its figure and off the axes."""

from __future__ import annotations

import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from matplotlib.figure import Figure
from matplotlib.text import Text

from data.config import REPO_ROOT
from results.compare import build
from results.compare.analysis import summarize
from results.compare.plots import figures, naming
from results.compare.runs import FinetuneResult, Run, load_local_runs

BATCH = 8
STEPS = 8
FREEZE_STEP = 2
PANELS = ("word_embeddings", "attention", "ffn")
# exchange variants as long as the committed studies' (150-200 characters with the optimizer and workers)
STEM = (
    "per_column+exact_vectors+precondition+scale_dtype=bfloat16+sign_scale=mean_abs+trust_ratio=live"
    "+warmup=nvlamb"
)
ABLATIONS = [
    f"{STEM}+{tail}"
    for tail in (
        "live_vector_variance",
        "live_vector_variance+variance_refresh=64+refresh_from=blocks",
        "live_vector_variance+variance_refresh=64+refresh_from=factored",
        "live_vector_variance+variance_refresh=16+refresh_from=local",
        "live_vector_variance+variance_refresh=64+refresh_from=local",
        "live_vector_variance+variance_refresh=16",
        "coeff_bias_correction+factor_max=8.0+factor_min=0.25+min_coeff=0.05",
        "exact_output_bias+vector_block=16+block_size=1024",
        "local_momentum+variance_refresh=64+refresh_from=exact",
        "eps=1e-08+max_grad_norm=0.0+grad_allreduce=bfloat16",
        "live_vector_variance+variance_refresh=64+refresh_from=rank1+refresh_block=64",
        "trust_ratio=live_clamped+live_vector_variance+variance_refresh=32",
    )
]


def synthetic_run(optimizer: str, variant: str, workers: str, seed: int) -> Run:
    """A run as runs.py loads it, with diagnostics and one fine-tune; `workers`: n2 or sim32."""
    onebit = optimizer.startswith("onebit")
    tag = zlib.crc32(variant.encode())
    offset = 0.01 * (tag % 7) + 0.02 * seed
    records = []
    for step in range(1, STEPS + 1):
        compressed = onebit and step > FREEZE_STEP
        record = {
            "step": float(step),
            "mlm_loss": 10.0 - 0.6 * step + offset,
            "nsp_loss": 0.7 - 0.01 * step,
            "phase": 1.0,
            "samples_seen": float(BATCH * step),
            "step_seconds": 0.5,
            "bytes_cumulative": 100.0 * step if not compressed else 100.0 * FREEZE_STEP + 3.0 * step,
            "bytes_lamb_cumulative": 100.0 * step,
        }
        if onebit:
            record["onebit_stage"] = float(compressed)
            if compressed:
                record.update({f"diag/fidelity_cos/{panel}": 0.5 + offset for panel in PANELS})
        records.append(record)
    name = f"{optimizer}-{tag}-{workers}-s{seed}"
    return Run(
        name=name,
        source=f"/runs/{name}",
        optimizer=optimizer,
        batch_name="synthetic",
        global_batch=BATCH,
        records=records,
        seed=seed,
        model="bert_tiny",
        freeze_step=FREEZE_STEP if onebit else None,
        phases=[(BATCH, STEPS)],
        variant=variant,
        workers=int(workers.removeprefix("sim").removeprefix("n")),
        simulated=workers.startswith("sim"),
        finetunes=[FinetuneResult("sst2", "accuracy", BATCH * STEPS, {"1": 0.8 + offset})],
    )


@pytest.fixture(scope="module")
def crowded() -> list[Run]:
    """LAMB, AdamW and 1-bit LAMB (their plain names: main under any naming) at 2 processes and 32 workers,
    two seeds, and 12 long-named ablations at both."""
    arms = [("lamb", ""), ("adamw", ""), ("onebit_lamb", "")] + [("onebit_lamb", v) for v in ABLATIONS]
    return [
        synthetic_run(optimizer, variant, workers, seed)
        for optimizer, variant in arms
        for workers in ("n2", "sim32")
        for seed in ((1, 2) if not variant else (1,))
    ]


def summary_of(runs: list[Run]) -> dict:
    return summarize(
        runs, target_loss=None, reference_optimizer="lamb", target_margin=0.02, smoothing=0.0, final_window=2
    )


def assert_readable(drawn: dict[str, Figure]) -> None:
    """One legend per figure, under the axes and none on a plot; every title, label and legend entry
    inside the figure."""
    for name, figure in drawn.items():
        figure.canvas.draw()
        bounds = figure.bbox
        assert figure.get_figwidth() <= 16, name  # the legend fits by its columns, not by a wider figure
        assert not [axis for axis in figure.axes if axis.get_legend() is not None], name
        assert len(figure.legends) == 1, name
        (legend,) = figure.legends
        ticks = {  # tick labels keep Text objects outside the view limits that are never drawn
            id(label)
            for axis in figure.axes
            for label in (*axis.get_xticklabels(which="both"), *axis.get_yticklabels(which="both"))
        }
        texts = [t for t in figure.findobj(Text) if t.get_visible() and t.get_text() and id(t) not in ticks]
        for extent in (legend.get_window_extent(), *(text.get_window_extent() for text in texts)):
            assert bounds.x0 - 0.5 <= extent.x0 and extent.x1 <= bounds.x1 + 0.5, (name, extent, bounds)
            assert bounds.y0 - 0.5 <= extent.y0 and extent.y1 <= bounds.y1 + 0.5, (name, extent, bounds)
        for axis in figure.axes:
            if axis.get_visible():
                assert not legend.get_window_extent().overlaps(axis.get_window_extent()), name


def test_every_legend_lies_inside_its_figure_and_off_the_axes(crowded: list[Run]):
    drawn = figures(crowded, summary_of(crowded))
    expected = {
        "pretrain_loss.png",
        "pretrain_loss_ablations.png",
        "bytes.png",
        "sample_to_accuracy_sst2.png",
    }
    assert expected | {"diagnostics_fidelity.png", "diagnostics_fidelity_ablations.png"} <= set(drawn)
    assert_readable(drawn)
    headline = [text.get_text() for text in drawn["pretrain_loss.png"].legends[0].get_texts()]
    assert not any(label.startswith("A") for label in headline)  # the ablations have their own figure
    assert "adamw sim32 (2 seeds)" in headline and "lamb n2 (2 seeds)" in headline
    assert max(len(label) for label in headline) < 50
    ablations = [
        text.get_text() for text in drawn["diagnostics_fidelity_ablations.png"].legends[0].get_texts()
    ]
    assert {"A1 n2", "A12 sim32"} <= set(ablations)


def test_one_ablation_gets_a_figure_wide_enough_for_its_title(crowded: list[Run]):
    """Also: a diagnostic only the ablation logged (the main comparison here is LAMB alone) keeps its plain
    file name, with every group in it."""
    runs = [
        run
        for run in crowded
        if run.workers == 2 and (run.optimizer == "lamb" or run.variant == ABLATIONS[0])
    ]
    drawn = figures(runs, summary_of(runs))
    assert len(drawn["pretrain_loss_ablations.png"].axes) == 1
    assert "diagnostics_fidelity_ablations.png" not in drawn
    assert "A1 n2" in [text.get_text() for text in drawn["diagnostics_fidelity.png"].legends[0].get_texts()]
    assert_readable(drawn)


def test_the_report_keys_the_short_names_to_the_full_ones(crowded: list[Run]):
    runs = [run for run in crowded if not run.variant or run.variant in ABLATIONS[:2]]
    cfg = SimpleNamespace(
        study="crowded",
        target_loss=None,
        target_margin=0.02,
        reference_optimizer="lamb",
        smoothing=0.0,
        final_window=2,
    )
    report = build(runs, cfg, "python -m results.compare study=crowded")["report.md"].decode()
    assert "![pretrain_loss_ablations.png](pretrain_loss_ablations.png)" in report
    key = naming(runs).key
    assert [short for short, _ in key][-2:] == ["A1", "A2"]
    assert dict(key)["A2"] == f"onebit_lamb[{ABLATIONS[1]}]"
    for short, full in key:
        assert f"| {short} | `{full}` |" in report


def shipped(name: str) -> dict:
    """conf/optim/<name>.yaml as the trainer records it in config.yaml (eps resolved for its warmup)."""
    optim = yaml.safe_load((REPO_ROOT / "conf" / "optim" / f"{name}.yaml").read_text(encoding="utf-8"))
    optim.pop("defaults", None)
    if optim.get("eps", 0) is None:
        optim["eps"] = 1e-6 if optim.get("warmup") == "nvlamb" else 1e-8
    return optim


def write_run(root: Path, name: str, optim: dict) -> None:
    folder = root / name
    folder.mkdir()
    phase = {"name": "phase1", "global_batch": BATCH, "steps": 2, "freeze_step": 1}
    config = {"optim": optim, "batch": {"name": "b", "phases": [phase]}, "seed": 1}
    config |= {"optimizer": optim["name"], "global_batch": BATCH, "world_size": 2, "sim_world_size": 1}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    lines = [f'{{"step": {s}, "samples_seen": {BATCH * s}, "mlm_loss": {9.0 - s}}}' for s in (1, 2)]
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_the_shipped_configs_are_the_main_comparison(tmp_path: Path):
    """LAMB, AdamW, 1-bit LAMB's default and DeepSpeed's algorithm, each as the shipped config runs it, get
    their short names; one changed option makes an ablation."""
    deepspeed = shipped("onebit_lamb_deepspeed")
    for name, optim in {
        "lamb": shipped("lamb"),
        "adamw": shipped("adamw"),
        "default": shipped("onebit_lamb"),
        "deepspeed": deepspeed,
        "changed": {**shipped("onebit_lamb"), "grad_allreduce": "bfloat16"},
    }.items():
        write_run(tmp_path, name, optim)
    names = naming(load_local_runs(["*"], root=tmp_path))
    assert sorted(names.labels[key] for key in names.main) == [
        "adamw n2",
        "lamb n2",
        "onebit_lamb n2",
        "onebit_lamb_deepspeed n2",
    ]
    (ablation,) = names.ablations
    assert names.labels[ablation] == "A1 n2" and "grad_allreduce=bfloat16" in dict(names.key)["A1"]
