"""The comparison step on synthetic run folders with known numbers: tables, gaps, plots, errors."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from data.config import REPO_ROOT
from results.compare import build, write_outputs
from results.compare.analysis import ema, samples_to_target, summarize
from results.compare.runs import CompareError, display_path, load_local_runs, load_wandb_runs, read_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
BATCH = 8
STEP_SECONDS = 0.5
LAMB_BYTES_PER_STEP = 100.0
FREEZE_STEP = 2


def write_run(
    root: Path,
    name: str,
    optimizer: str,
    seed: int,
    mlm: list[float],
    *,
    config: bool = True,
    finetunes: dict[str, tuple[int, dict[str, float]]] | None = None,
    optim: dict | None = None,
    world_size: int = 2,
    sim_world_size: int = 1,
) -> Path:
    """A run folder: config.yaml as the trainer writes it (the keys the comparison reads), one
    metrics.jsonl record per step, and fine-tune all_results.json files {relative folder: (samples,
    per-seed f1)}."""
    folder = root / name
    folder.mkdir(parents=True)
    onebit = optimizer.startswith("onebit")
    if config:
        phase = {"name": "phase1", "global_batch": BATCH, "steps": len(mlm), "freeze_step": FREEZE_STEP}
        payload = {
            "model": {"size": "bert_tiny"},
            "optim": {"name": optimizer, **(optim or {})},
            "batch": {"name": "synthetic", "phases": [phase]},
            "seed": seed,
            "optimizer": optimizer,
            "global_batch": BATCH,
            "world_size": world_size,
            "sim_world_size": sim_world_size,
            "command": f"python -m pretrain optim={optimizer} seed={seed}",
        }
        (folder / "config.yaml").write_text(yaml.safe_dump(payload))
    lines, sent = [], 0.0
    for index, loss in enumerate(mlm):
        step = index + 1
        compressed = onebit and step > FREEZE_STEP
        sent += LAMB_BYTES_PER_STEP / 32 if compressed else LAMB_BYTES_PER_STEP
        record = {
            "step": step,
            "loss": loss + 0.7,
            "mlm_loss": loss,
            "nsp_loss": 0.7 - 0.01 * step,
            "phase": 1,
            "samples_seen": BATCH * step,
            "step_seconds": STEP_SECONDS,
            "samples_per_s": BATCH / STEP_SECONDS,
            "bytes_cumulative": sent,
            "bytes_lamb_cumulative": LAMB_BYTES_PER_STEP * step,
        }
        if onebit:
            record["onebit_stage"] = float(compressed)
        lines.append(json.dumps(record))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    for relative, (samples, scores) in (finetunes or {}).items():
        target = folder / "finetune" / relative / "all_results.json"
        target.parent.mkdir(parents=True)
        per_seed = {seed: {"f1": value, "accuracy": value - 0.1} for seed, value in scores.items()}
        target.write_text(
            json.dumps(
                {
                    "task": "mrpc",
                    "main_metric": "f1",
                    "main_metric_key": "f1",
                    "pretraining_samples_seen": samples,
                    "per_seed": per_seed,
                }
            )
        )
    return folder


LAMB_1 = [10.0, 9.0, 8.0, 7.0, 6.0, 5.0]
LAMB_2 = [10.0, 9.0, 8.0, 7.0, 6.0, 7.0]
ONEBIT_1 = [10.0, 9.5, 8.5, 7.5, 6.6, 5.9]
ONEBIT_2 = [10.0, 9.6, 8.7, 7.7, 7.0, 6.5]
FT_LAMB_1 = {"1": 0.80, "2": 0.84}
FT_LAMB_2 = {"1": 0.82, "2": 0.86}
FT_ONEBIT_1 = {"1": 0.81, "2": 0.83}
FT_ONEBIT_2 = {"1": 0.79, "2": 0.85}


@pytest.fixture
def study(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    final = BATCH * len(LAMB_1)
    # new layout (<checkpoint>/<task>) with an earlier checkpoint too, and the old layout (<task>)
    write_run(
        root,
        "syn-lamb-s1",
        "lamb",
        1,
        LAMB_1,
        finetunes={
            "step-00000003/mrpc": (BATCH * 3, {"1": 0.70, "2": 0.72}),
            "step-00000006/mrpc": (final, FT_LAMB_1),
        },
    )
    write_run(root, "syn-lamb-s2", "lamb", 2, LAMB_2, finetunes={"mrpc": (final, FT_LAMB_2)})
    write_run(root, "syn-onebit-s1", "onebit_lamb", 1, ONEBIT_1, finetunes={"mrpc": (final, FT_ONEBIT_1)})
    write_run(root, "syn-onebit-s2", "onebit_lamb", 2, ONEBIT_2, finetunes={"mrpc": (final, FT_ONEBIT_2)})
    return root


def compare_cfg(output_dir: Path, **overrides):
    values = {
        "study": "syn",
        "output_dir": str(output_dir),
        "target_loss": None,
        "target_margin": 0.02,
        "reference_optimizer": "lamb",
        "smoothing": 0.0,
        "final_window": 2,
    }
    values.update(overrides)
    return SimpleNamespace(**values)


def summary_of(runs, **overrides):
    cfg = compare_cfg(Path("unused"), **overrides)
    return summarize(
        runs,
        target_loss=cfg.target_loss,
        reference_optimizer=cfg.reference_optimizer,
        target_margin=cfg.target_margin,
        smoothing=cfg.smoothing,
        final_window=cfg.final_window,
    )


def test_per_run_numbers(study: Path):
    summary = summary_of(load_local_runs(["syn-*"], root=study))
    # auto target: the worst final MLM loss of the LAMB runs, (6 + 7) / 2 for seed 2, plus 2%
    assert summary["target_loss"]["value"] == pytest.approx(6.5 * 1.02)
    runs = {r["name"]: r for r in summary["runs"]}
    assert sorted(runs) == ["syn-lamb-s1", "syn-lamb-s2", "syn-onebit-s1", "syn-onebit-s2"]
    lamb, onebit = runs["syn-lamb-s1"], runs["syn-onebit-s2"]
    assert lamb["final_mlm_loss"] == pytest.approx(5.5)
    assert lamb["final_nsp_loss"] == pytest.approx(((0.7 - 0.05) + (0.7 - 0.06)) / 2)
    # first loss at or below 6.63: step 5 (6.0) for LAMB seed 1; step 6 (6.5) for 1-bit seed 2
    assert lamb["samples_to_target"] == 5 * BATCH
    assert onebit["samples_to_target"] == 6 * BATCH
    assert runs["syn-onebit-s1"]["samples_to_target"] == 5 * BATCH  # 6.6 <= 6.63
    assert lamb["volume_reduction_vs_lamb"] == pytest.approx(1.0)
    onebit_bytes = 2 * LAMB_BYTES_PER_STEP + 4 * LAMB_BYTES_PER_STEP / 32
    assert onebit["bytes_cumulative"] == pytest.approx(onebit_bytes)
    assert onebit["volume_reduction_vs_lamb"] == pytest.approx(6 * LAMB_BYTES_PER_STEP / onebit_bytes)
    assert onebit["onebit_start_samples"] == FREEZE_STEP * BATCH
    assert lamb["onebit_start_samples"] is None
    assert lamb["train_seconds"] == pytest.approx(6 * STEP_SECONDS)
    assert lamb["samples_per_s"] == pytest.approx(6 * BATCH / (6 * STEP_SECONDS))
    # the last fine-tuned checkpoint's scores, not the earlier one's
    mrpc = lamb["finetune"]["mrpc"]
    assert mrpc["pretraining_samples_seen"] == 6 * BATCH
    assert mrpc["mean"] == pytest.approx(0.82)
    assert mrpc["std"] == pytest.approx(statistics.stdev([0.80, 0.84]))
    assert lamb["command"] == "python -m pretrain optim=lamb seed=1"


def test_groups_and_gap(study: Path):
    summary = summary_of(load_local_runs(["syn-*"], root=study))
    groups = {g["optimizer"]: g for g in summary["groups"]}
    assert set(groups) == {"lamb", "onebit_lamb"}
    lamb, onebit = groups["lamb"], groups["onebit_lamb"]
    assert lamb["runs"] == ["syn-lamb-s1", "syn-lamb-s2"] and lamb["seeds"] == [1, 2]
    assert lamb["final_mlm_loss"]["mean"] == pytest.approx(6.0)
    assert lamb["final_mlm_loss"]["std"] == pytest.approx(math.sqrt(0.5))  # stdev of 5.5, 6.5
    assert onebit["final_mlm_loss"]["mean"] == pytest.approx(6.5)  # (6.25 + 6.75) / 2
    assert onebit["samples_to_target"]["mean"] == pytest.approx(44.0)
    assert onebit["samples_to_target"]["std"] == pytest.approx(statistics.stdev([40, 48]))
    assert onebit["samples_to_target"]["reached"] == 2
    mrpc = lamb["finetune"]["mrpc"]
    assert mrpc["over_pretraining_seeds"]["mean"] == pytest.approx(0.83)  # run means 0.82, 0.84
    assert mrpc["over_pretraining_seeds"]["std"] == pytest.approx(statistics.stdev([0.82, 0.84]))
    assert mrpc["pooled"]["n"] == 4
    assert mrpc["pooled"]["std"] == pytest.approx(statistics.stdev([0.80, 0.84, 0.82, 0.86]))

    (gap,) = summary["gaps"]
    assert gap["group"].startswith("onebit_lamb") and gap["reference"].startswith("lamb")
    assert gap["equal_samples"] is True
    assert gap["final_mlm_loss_gap_pct"] == pytest.approx(100 * (6.5 - 6.0) / 6.0)
    assert gap["within_1pct"] is False
    downstream = gap["finetune"]["mrpc"]
    assert downstream["gap"] == pytest.approx(0.82 - 0.83)
    pooled = math.sqrt(
        (statistics.stdev([0.81, 0.83, 0.79, 0.85]) ** 2 + statistics.stdev([0.80, 0.84, 0.82, 0.86]) ** 2)
        / 2
    )
    assert downstream["pooled_std"] == pytest.approx(pooled)
    assert downstream["within_noise"] is True


def test_outputs_report_plots_and_summary(study: Path, tmp_path: Path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")  # a user's file stays
    runs = load_local_runs([str(study / "syn-*")])
    cfg = compare_cfg(out)
    outputs = build(runs, cfg, "python -m results.compare study=syn")
    write_outputs(out, outputs)
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "bytes.png",
        "notes.txt",
        "pretrain_loss.png",
        "report.md",
        "sample_to_accuracy_mrpc.png",
        "summary.json",
    ]
    from matplotlib.image import imread

    for png in ("pretrain_loss.png", "sample_to_accuracy_mrpc.png", "bytes.png"):
        assert (out / png).read_bytes().startswith(PNG_SIGNATURE)
        height, width = imread(out / png).shape[:2]
        assert height > 200 and width > 300
    summary = json.loads((out / "summary.json").read_text())
    assert summary["study"] == "syn"
    assert summary["gaps"][0]["final_mlm_loss_gap_pct"] == pytest.approx(100 * 0.5 / 6.0)
    report = (out / "report.md").read_text()
    assert "| syn-lamb-s1 | 40 | 5.5000 |" in report
    assert "+8.33%" in report
    assert "python -m pretrain optim=onebit_lamb seed=2" in report
    assert "![pretrain_loss.png](pretrain_loss.png)" in report


def test_smoothing_and_explicit_target(tmp_path: Path):
    assert ema([4.0, 2.0, 2.0, 1.0], 0.5) == [4.0, 3.0, 2.5, 1.75]
    write_run(tmp_path, "r-lamb", "lamb", 1, [4.0, 2.0, 2.0, 1.0])
    (run,) = load_local_runs(["r-lamb"], root=tmp_path)
    assert samples_to_target(run, 2.6, 0.5) == 3 * BATCH  # smoothed 2.5 at step 3
    assert samples_to_target(run, 2.6, 0.0) == 2 * BATCH  # raw 2.0 at step 2
    assert samples_to_target(run, 0.5, 0.5) is None
    summary = summary_of([run], target_loss=2.6, smoothing=0.5)
    assert summary["target_loss"] == {"value": 2.6, "how": "set with target_loss"}
    assert summary["runs"][0]["samples_to_target"] == 3 * BATCH


def test_resumed_run_keeps_the_later_record_and_nonfinite_values(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    records = [
        {"step": 1, "samples_seen": 8, "mlm_loss": 5.0},
        {"step": 2, "samples_seen": 16, "mlm_loss": 4.0},
        {"step": 2, "samples_seen": 16, "mlm_loss": 3.5},  # re-logged after a resume
        {"step": 3, "samples_seen": 24, "mlm_loss": "nan"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    loaded = read_metrics(path)
    assert [r["step"] for r in loaded] == [1, 2, 3]
    assert loaded[1]["mlm_loss"] == 3.5
    assert math.isnan(loaded[2]["mlm_loss"])


def test_a_compressed_metrics_file_loads_like_the_plain_one(tmp_path: Path):
    import gzip

    folder = write_run(tmp_path, "r-lamb", "lamb", 1, LAMB_1)
    (plain,) = load_local_runs(["r-lamb"], root=tmp_path)
    metrics = folder / "metrics.jsonl"
    (folder / "metrics.jsonl.gz").write_bytes(gzip.compress(metrics.read_bytes()))
    metrics.unlink()
    (compressed,) = load_local_runs(["r-lamb"], root=tmp_path)
    assert compressed.records == plain.records and len(plain.records) == len(LAMB_1)


def test_globs_deduplicate_and_missing_config_is_inferred(tmp_path: Path):
    write_run(tmp_path, "a-lamb", "lamb", 1, LAMB_1)
    write_run(tmp_path, "b8-onebit_lamb-bert_tiny", "onebit_lamb", 1, ONEBIT_1, config=False)
    runs = load_local_runs(["*-lamb", "a-lamb", "b8-*"], root=tmp_path)
    assert [r.name for r in runs] == ["a-lamb", "b8-onebit_lamb-bert_tiny"]
    inferred = runs[1]
    assert (inferred.optimizer, inferred.global_batch, inferred.batch_name) == ("onebit_lamb", BATCH, "b8")
    assert inferred.config_note and "inferred" in inferred.config_note


def test_bad_inputs_name_the_file_and_line(tmp_path: Path):
    folder = write_run(tmp_path, "r-lamb", "lamb", 1, LAMB_1)
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    lines[2] = lines[2][:-5]  # truncated JSON on line 3
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(CompareError, match=rf"{folder / 'metrics.jsonl'}:3: malformed JSON"):
        load_local_runs(["r-lamb"], root=tmp_path)

    lines[2] = json.dumps({"step": 3, "samples_seen": 24})
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(CompareError, match=r"metrics.jsonl:3: 'mlm_loss' missing"):
        load_local_runs(["r-lamb"], root=tmp_path)

    with pytest.raises(CompareError, match=r"no run folder matches 'nothing-\*'"):
        load_local_runs(["nothing-*"], root=tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CompareError, match=r"empty: no metrics.jsonl"):
        load_local_runs(["empty"], root=tmp_path)

    good = write_run(tmp_path, "g-lamb", "lamb", 1, LAMB_1, finetunes={"mrpc": (48, {"1": 0.8})})
    results = good / "finetune" / "mrpc" / "all_results.json"
    results.write_text('{"task": "mrpc",\n "per_seed": }')
    with pytest.raises(CompareError, match=rf"{results}:2: malformed JSON"):
        load_local_runs(["g-lamb"], root=tmp_path)
    results.write_text(json.dumps({"task": "mrpc", "main_metric_key": "f1", "per_seed": {"1": {"acc": 1}}}))
    with pytest.raises(CompareError, match=r"per_seed.1.f1 missing"):
        load_local_runs(["g-lamb"], root=tmp_path)


def test_command_line_errors_write_nothing(tmp_path: Path):
    out = tmp_path / "out"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "results.compare",
            "study=syn",
            f"runs=[{tmp_path}/nothing-*]",
            f"output_dir={out}",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"compare: error: runs: no run folder matches '{tmp_path}/nothing-*' (looked in {REPO_ROOT})"
    ]
    assert not out.exists()


def test_command_line_writes_the_study(study: Path, tmp_path: Path):
    out = tmp_path / "study-out"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "results.compare",
            "study=syn",
            f"runs=[{study}/syn-lamb-*,{study}/syn-onebit-*]",
            f"output_dir={out}",
            "final_window=2",
            "smoothing=0",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert [r["name"] for r in summary["runs"]] == [
        "syn-lamb-s1",
        "syn-lamb-s2",
        "syn-onebit-s1",
        "syn-onebit-s2",
    ]
    assert summary["gaps"][0]["final_mlm_loss_gap_pct"] == pytest.approx(100 * 0.5 / 6.0)
    assert not [p for p in out.iterdir() if ".tmp" in p.name]


class FakeWandbRun:
    def __init__(self, name, job_type, config, history=(), summary=None):
        self.name, self.id, self.job_type = name, f"id-{name}", job_type
        self.config, self.summary, self.history = config, summary or {}, list(history)

    def scan_history(self):
        return iter(self.history)


class FakeWandbApi:
    def __init__(self, runs):
        self.runs_, self.calls = runs, []

    def runs(self, path, filters):
        self.calls.append((path, filters))
        return self.runs_


def test_wandb_source_reads_history_config_and_finetunes():
    history = [
        {"_step": step, "samples_seen": 32 * step, "mlm_loss": 10.0 - step, "nsp_loss": 0.69}
        for step in (10, 20)
    ] + [{"_step": 20, "system/cpu": 3.0}]  # rows without the metrics are ignored
    pretrain = FakeWandbRun(
        "demo-onebit_lamb",
        "pretrain",
        {"optimizer": "onebit_lamb", "global_batch": 32, "seed": 7, "batch": {"name": "demo", "phases": []}},
        history,
        {"_runtime": 12.5},
    )
    finetunes = [
        FakeWandbRun(
            f"ft{seed}",
            "finetune",
            {
                "task": {"name": "mrpc"},
                "run_name": "demo-onebit_lamb",
                "seed": seed,
                "pretraining_samples_seen": 640,
            },
            summary={"eval/f1": score},
        )
        for seed, score in ((1, 0.7), (2, 0.9))
    ]
    other = FakeWandbRun("other-lamb", "pretrain", {"optimizer": "lamb", "global_batch": 32}, history)
    api = FakeWandbApi([pretrain, *finetunes, other])
    (run,) = load_wandb_runs("bert-lamb", "team", "demo", ["demo-*"], api=api)
    assert api.calls == [("team/bert-lamb", {"group": "demo"})]
    assert (run.optimizer, run.global_batch, run.seed, run.batch_name) == ("onebit_lamb", 32, 7, "demo")
    assert [(r["step"], r["mlm_loss"]) for r in run.records] == [(10.0, 0.0), (20.0, -10.0)]
    assert [r["samples_seen"] for r in run.records] == [320.0, 640.0]
    assert run.wall_seconds == 12.5
    (result,) = run.finetunes
    assert (result.task, result.metric, result.samples_seen) == ("mrpc", "f1", 640)
    assert result.scores == {"1": 0.7, "2": 0.9}
    with pytest.raises(CompareError, match="no pretraining run"):
        load_wandb_runs("bert-lamb", None, None, ["nope-*"], api=api)


def test_report_paths_are_relative_to_the_repository(tmp_path):
    root = tmp_path / "repo"
    (root / "results" / "runs" / "b32-lamb").mkdir(parents=True)
    assert display_path(str(root / "results" / "runs" / "b32-lamb"), root) == "results/runs/b32-lamb"
    assert display_path(str(tmp_path / "elsewhere"), root) == str(tmp_path / "elsewhere")
    assert display_path("team/bert/abc123", root) == "team/bert/abc123"  # a W&B run path


def test_arms_group_by_exchange_variant_and_workers(tmp_path: Path):
    """1-bit runs that differ in their preset, their options or in the number of (simulated) workers are
    separate groups; each is compared with plain LAMB at the same batch (LAMB at any number of workers),
    never with a LAMB variant, which gets its own gap."""
    write_run(tmp_path, "lamb-s1", "lamb", 1, LAMB_1)
    write_run(
        tmp_path, "lamb-ds-s1", "lamb", 1, LAMB_2, optim={"variant": "deepspeed", "bias_correction": False}
    )
    write_run(tmp_path, "lamb-bf16-s1", "lamb", 1, LAMB_2, optim={"grad_allreduce": "bfloat16"})
    write_run(tmp_path, "ds-s1", "onebit_lamb_deepspeed", 1, ONEBIT_1)
    write_run(tmp_path, "default-s1", "onebit_lamb", 1, ONEBIT_2)
    write_run(tmp_path, "default-sim-s1", "onebit_lamb", 1, ONEBIT_1, sim_world_size=16)
    write_run(tmp_path, "frozen-v-s1", "onebit_lamb", 1, ONEBIT_2, optim={"variance_refresh": 0})
    runs = {run.name: run for run in load_local_runs(["*"], root=tmp_path)}
    assert runs["ds-s1"].arm == "onebit_lamb_deepspeed n2"
    assert runs["default-s1"].arm == "onebit_lamb n2"
    assert runs["default-sim-s1"].arm == "onebit_lamb n32 sim"
    assert runs["frozen-v-s1"].arm == "onebit_lamb[variance_refresh=0] n2"
    assert runs["lamb-ds-s1"].arm == "lamb[deepspeed+no_bias_correction] n2"
    assert runs["lamb-bf16-s1"].arm == "lamb[grad_allreduce=bfloat16] n2"  # a LAMB variant: its own gap
    summary = summary_of(list(runs.values()))
    assert len(summary["groups"]) == 7
    gaps = {gap["group"]: gap for gap in summary["gaps"]}
    assert len(gaps) == 6 and all(gap["reference"] == "lamb n2 b8 bert_tiny" for gap in gaps.values())
    sim = gaps["onebit_lamb n32 sim b8 bert_tiny"]
    assert sim["final_mlm_loss_gap_pct"] == pytest.approx(100 * ((6.6 + 5.9) / 2 - 5.5) / 5.5)


# the options an older run's config.yaml held for optim=onebit_lamb (every arm of the study was a key)
OLD_DEFAULT = {
    "compression": "per_column", "exact_vectors": True, "exact_output_bias": False, "precondition": True,
    "local_momentum": False, "vector_block": 0, "scale_dtype": "bfloat16", "sign_scale": "mean_abs",
    "coeff_bias_correction": False, "trust_ratio": "live", "factor_min": 0.5, "factor_max": 4.0,
    "block_size": 2048, "min_coeff": 0.01, "eps": None, "warmup": "nvlamb", "max_grad_norm": 1.0,
    "live_vector_variance": True, "variance_refresh": 64, "refresh_from": "rank1", "refresh_block": 128,
}  # fmt: skip
OLD_DEEPSPEED = {
    **OLD_DEFAULT, "compression": "deepspeed", "exact_vectors": False, "precondition": False,
    "scale_dtype": "float32", "sign_scale": "rms", "trust_ratio": "frozen", "warmup": "deepspeed",
    "live_vector_variance": False, "variance_refresh": 0,
}  # fmt: skip


def test_older_runs_are_named_by_the_preset_they_ran(tmp_path: Path):
    """A run from before the presets holds every option: the default and DeepSpeed's algorithm are named
    `onebit_lamb` and `onebit_lamb_deepspeed`, an ablation by what it changed against the nearer one, and a
    config from before an option existed counts it as absent (DeepSpeed's value)."""
    write_run(tmp_path, "default-s1", "onebit_lamb", 1, ONEBIT_1, optim=OLD_DEFAULT)
    write_run(tmp_path, "ds-s1", "onebit_lamb", 1, ONEBIT_1, optim=OLD_DEEPSPEED)
    write_run(tmp_path, "ds-older-s1", "onebit_lamb", 1, ONEBIT_1, optim={"compression": "deepspeed"})
    local = {**OLD_DEFAULT, "refresh_from": "local"}
    write_run(tmp_path, "local-s1", "onebit_lamb", 1, ONEBIT_2, optim=local)
    rows = {**OLD_DEFAULT, "compression": "per_row", "exact_vectors": False, "variance_refresh": 0}
    write_run(tmp_path, "rows-s1", "onebit_lamb", 1, ONEBIT_2, optim=rows)
    runs = {run.name: run for run in load_local_runs(["*"], root=tmp_path)}
    assert runs["default-s1"].arm == "onebit_lamb n2"
    assert runs["ds-s1"].arm == runs["ds-older-s1"].arm == "onebit_lamb_deepspeed n2"
    assert runs["local-s1"].arm == "onebit_lamb[refresh_from=local] n2"
    assert runs["rows-s1"].arm == "onebit_lamb[compression=per_row+exact_vectors=false+variance_refresh=0] n2"
    assert runs["ds-s1"].optimizer == "onebit_lamb_deepspeed"


def test_a_diverged_run_is_named_and_left_out_of_the_means(tmp_path: Path):
    write_run(tmp_path, "lamb-s1", "lamb", 1, LAMB_1)
    write_run(tmp_path, "onebit-s1", "onebit_lamb", 1, ONEBIT_1)
    write_run(tmp_path, "onebit-s2", "onebit_lamb", 2, [*ONEBIT_2[:4], float("nan"), float("nan")])
    write_run(tmp_path, "onebit-s3", "onebit_lamb", 3, [*ONEBIT_2[:4], 3e8, 6e8])  # blown up, finite
    summary = summary_of(load_local_runs(["*"], root=tmp_path))
    runs = {r["name"]: r for r in summary["runs"]}
    assert runs["onebit-s2"]["diverged"] and runs["onebit-s2"]["final_mlm_loss"] is None
    group = next(g for g in summary["groups"] if g["optimizer"] == "onebit_lamb")
    assert runs["onebit-s3"]["diverged"] and not runs["onebit-s1"]["diverged"]
    assert group["diverged"] == 2 and group["final_mlm_loss"]["n"] == 1
    assert any("2 of 3 runs diverged" in note for note in group["notes"])
    (gap,) = summary["gaps"]
    assert gap["diverged"] == 2 and gap["runs"] == 3


def test_the_loss_figure_keeps_its_scale_when_a_run_diverges(tmp_path: Path):
    from results.compare.plots import pretrain_loss_figure

    write_run(tmp_path, "lamb-s1", "lamb", 1, LAMB_1)
    write_run(tmp_path, "onebit-s1", "onebit_lamb", 1, ONEBIT_1)
    write_run(tmp_path, "onebit-s2", "onebit_lamb", 2, [*ONEBIT_2[:4], 3e8, 6e8])
    figure = pretrain_loss_figure(load_local_runs(["*"], root=tmp_path), smoothing=0.0, target=None)
    mlm = figure.axes[0]
    low, high = mlm.get_ylim()
    assert low > 4.0 and high < 11.0  # the 1-bit group's curve is seed 1's alone; seed 2 is clipped away
    labels = [text.get_text() for text in figure.legends[0].get_texts()]
    assert any("2 seeds; 1 diverged, dotted" in label for label in labels)


def test_one_file_per_fine_tune_seed_reports_every_seed_of_the_newest_recipe(tmp_path: Path):
    """The rungs write one all_results.json per fine-tune seed of a checkpoint: all of that recipe's seeds
    are reported (not one file's, chosen by time stamps a clone does not keep); a seed in two files takes the
    newer file's score, and a file of another recipe stays out and is named."""
    finetunes = {f"final/sst2-len32-s{seed}": (240, {str(seed): 0.70 + seed / 100}) for seed in (1, 2, 3)}
    folder = write_run(tmp_path, "syn-lamb-s1", "lamb", 1, LAMB_1, finetunes=finetunes)
    files = sorted((folder / "finetune").rglob("all_results.json"))
    for when, path in zip((3_000_000, 1_000_000, 2_000_000), files, strict=True):
        os.utime(path, (when, when))
    (run,) = load_local_runs([str(folder)])
    (result,) = run.finetunes
    assert result.scores == {"1": 0.71, "2": 0.72, "3": 0.73} and run.finetune_notes == []
    rerun = folder / "finetune" / "again" / "mrpc"
    rerun.mkdir(parents=True)
    payload = json.loads(files[1].read_text())
    payload["per_seed"] = {"2": {key: 0.90 for key in payload["per_seed"]["2"]}}
    (rerun / "all_results.json").write_text(json.dumps(payload))  # seed 2 again, newest
    (run,) = load_local_runs([str(folder)])
    assert run.finetunes[0].scores == {"1": 0.71, "2": 0.90, "3": 0.73}
    payload["config"] = {"task": {"name": "mrpc", "lr": 1e-3}}  # the newest file now another recipe
    (rerun / "all_results.json").write_text(json.dumps(payload))
    (run,) = load_local_runs([str(folder)])
    assert run.finetunes[0].scores == {"2": 0.90} and len(run.finetune_notes) == 1


def test_one_checkpoint_fine_tuned_with_two_recipes_is_named_in_the_report(tmp_path: Path):
    """The newer fine-tune of a (task, checkpoint) is reported; when the two used different recipes (here the
    LR), the report says which file it took instead of silently mixing recipes across runs."""
    folder = write_run(tmp_path, "syn-lamb-s1", "lamb", 1, LAMB_1, finetunes={"a/mrpc": (240, {"1": 0.70})})
    older, newer = folder / "finetune" / "a" / "mrpc" / "all_results.json", folder / "finetune" / "b" / "mrpc"
    newer.mkdir(parents=True)
    for path, lr, score in ((older, 1e-4, 0.70), (newer / "all_results.json", 1e-3, 0.80)):
        payload = json.loads(older.read_text())
        task = {"name": "mrpc", "lr": lr, "epochs": 3, "max_length": 128, "batch_size": 32}
        payload["config"] = {"task": task}
        payload["per_seed"] = {"1": {"f1": score, "accuracy": score}}
        path.write_text(json.dumps(payload))
    os.utime(older, (1_000_000, 1_000_000))  # the older file by its time stamp, whatever the file system says
    (run,) = load_local_runs([str(folder)])
    (result,) = run.finetunes
    assert result.scores == {"1": 0.80} and result.recipe == "lr 0.001, epochs 3, length 128, batch 32"
    (note,) = run.finetune_notes
    assert f"reported {newer / 'all_results.json'}" in note and str(older) in note and "lr 0.0001" in note
    out = tmp_path / "out"
    write_outputs(out, build([run], compare_cfg(out), "python -m results.compare"))
    assert note in (out / "report.md").read_text()
    # a third recipe, between the two in time: still the newest is reported, and both others are named
    middle = folder / "finetune" / "c" / "mrpc" / "all_results.json"
    middle.parent.mkdir(parents=True)
    payload = json.loads(older.read_text())
    payload["config"]["task"]["lr"] = 3e-4
    middle.write_text(json.dumps(payload))
    os.utime(middle, (2_000_000, 2_000_000))
    (run,) = load_local_runs([str(folder)])
    assert [result.scores for result in run.finetunes] == [{"1": 0.80}]
    (note,) = run.finetune_notes
    assert f"reported {newer / 'all_results.json'} (lr 0.001" in note
    assert str(older) in note and str(middle) in note and "lr 0.0003" in note
    middle.unlink()
    # the same recipe twice (a re-run): nothing to say
    payload = json.loads((newer / "all_results.json").read_text())
    older.write_text(json.dumps(payload))
    os.utime(older, (1_000_000, 1_000_000))
    (run,) = load_local_runs([str(folder)])
    assert run.finetune_notes == []
