"""The W&B dashboard spec, built offline: panels, x axes, grouping and the group filter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from data.config import REPO_ROOT
from results.compare.dashboard import GROUP_BY, build_workspace, workspace_spec


def panels_by_title(workspace) -> dict[str, object]:
    return {panel.title: panel for section in workspace.sections for panel in section.panels}


def test_pretraining_panels_plot_against_samples_seen():
    workspace = build_workspace("bert-lamb", entity="team", group="64k", tasks=["mrpc", "squad", "mnli"])
    assert [s.name for s in workspace.sections] == [
        "Pretraining loss",
        "Communication",
        "Throughput",
        "Fine-tuning: sample to accuracy",
    ]
    pretraining = [p for s in workspace.sections[:3] for p in s.panels]
    assert {p.x for p in pretraining} == {"samples_seen"}
    plotted = {key for p in pretraining for key in p.y}
    assert {
        "mlm_loss",
        "nsp_loss",
        "bytes_cumulative",
        "volume_reduction_vs_lamb",
        "samples_per_s",
    } <= plotted
    mlm = panels_by_title(workspace)["MLM loss"]
    assert (mlm.groupby_aggfunc, mlm.groupby_rangefunc, mlm.smoothing_type) == (
        "mean",
        "minmax",
        "exponential",
    )


def test_finetune_panels_plot_scores_against_pretraining_samples():
    workspace = build_workspace("bert-lamb", tasks=["mrpc", "squad", "mnli"])
    finetune = workspace.sections[-1].panels
    lines = [p for p in finetune if type(p).__name__ == "LinePlot"]
    scatters = [p for p in finetune if type(p).__name__ == "ScatterPlot"]
    assert {p.x for p in lines} == {"pretraining_samples_seen"}
    assert [p.y for p in lines] == [["eval/f1"], ["eval/exact_match"], ["eval/dev_matched_accuracy"]]
    assert [(p.x.name, p.y.name) for p in scatters] == [
        ("pretraining_samples_seen", "eval/f1"),
        ("pretraining_samples_seen", "eval/exact_match"),
        ("pretraining_samples_seen", "eval/dev_matched_accuracy"),
    ]


def test_runs_grouped_by_optimizer_and_global_batch_in_the_serialized_view():
    workspace = build_workspace("bert-lamb", entity="team", group="64k", tasks=["mrpc"])
    assert (
        [g.name for g in workspace.runset_settings.groupby] == list(GROUP_BY) == ["optimizer", "global_batch"]
    )
    spec = workspace_spec(workspace)
    assert (spec["entity"], spec["project"]) == ("team", "bert-lamb")
    (runset,) = spec["spec"]["section"]["runSets"]
    assert runset["grouping"] == [
        {"section": "config", "name": "optimizer.value"},
        {"section": "config", "name": "global_batch.value"},
    ]
    (group_filter,) = runset["filters"]["filters"]
    assert (group_filter["key"]["name"], group_filter["op"], group_filter["value"]) == ("group", "=", "64k")
    sections = spec["spec"]["section"]["panelBankConfig"]["sections"]
    mlm = sections[0]["panels"][0]["config"]
    assert (mlm["xAxis"], mlm["metrics"]) == ("samples_seen", ["mlm_loss"])
    scatter = sections[-1]["panels"][1]["config"]
    assert (scatter["xAxis"], scatter["yAxis"]) == (
        "config:pretraining_samples_seen.value",
        "summary:eval/f1",
    )
    assert not build_workspace("bert-lamb").runset_settings.filters


def test_command_line_writes_the_spec_offline(tmp_path: Path):
    spec_file = tmp_path / "workspace.json"
    result = subprocess.run(
        [sys.executable, "-m", "results.compare.dashboard", f"spec_file={spec_file}", "tasks=[rte]"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"WANDB_MODE": "offline", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr
    assert "runs grouped by config.optimizer, config.global_batch" in result.stdout
    spec = json.loads(spec_file.read_text())
    assert spec["spec"]["section"]["runSets"][0]["grouping"][0]["name"] == "optimizer.value"
    bad = subprocess.run(
        [sys.executable, "-m", "results.compare.dashboard", "tasks=[nope]"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2
    assert bad.stderr.startswith("dashboard: error: tasks: unknown task(s) ['nope']")
