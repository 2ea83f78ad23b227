"""The W&B dashboard in code: a workspace (saved view) comparing LAMB and 1-bit LAMB runs.

    python -m results.compare.dashboard spec_file=/tmp/workspace.json        # offline: build the spec only
    python -m results.compare.dashboard save=true entity=<team> group=64k    # create it on W&B (online)

Panels against `samples_seen` (MLM/NSP loss and accuracy, cumulative bytes vs the fp32-allreduce
equivalent, volume reduction vs LAMB, 1-bit stage, samples/s, step time) and, per fine-tune task, the
score against the checkpoint's pretraining samples. Runs are grouped by the config keys `optimizer`
and `global_batch` (flat keys the pretraining trainer logs next to its full config; a W&B group
cannot reach a list element like batch.phases[0].global_batch), with the mean and a min-max band.
Built with `wandb-workspaces` (the `dashboard` extra). Exit codes: 0 done, 2 bad config or W&B error.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from launch import cli
from results.compare.config import DashboardConfig, to_object
from results.compare.runs import main_metric_key

X_AXIS = "samples_seen"
GROUP_BY = ("optimizer", "global_batch")
ENTITY_PLACEHOLDER = "your-entity"  # offline specs without entity=...
PRETRAINING_PANELS: dict[str, list[tuple[str, list[str]]]] = {
    "Pretraining loss": [
        ("MLM loss", ["mlm_loss"]),
        ("NSP loss", ["nsp_loss"]),
        ("MLM accuracy", ["mlm_accuracy"]),
    ],
    "Communication": [
        (
            "Bytes sent per rank (cumulative) vs fp32-allreduce equivalent",
            ["bytes_cumulative", "bytes_lamb_cumulative"],
        ),
        ("Volume reduction vs LAMB", ["volume_reduction_vs_lamb"]),
        ("1-bit stage (0 warmup, 1 compression)", ["onebit_stage"]),
    ],
    "Throughput": [
        ("Samples/s", ["samples_per_s"]),
        ("Step time split (s)", ["time_forward_backward", "time_communication", "time_optimizer"]),
    ],
}
SMOOTHED = {"mlm_loss", "nsp_loss", "mlm_accuracy"}


def build_workspace(
    project: str,
    entity: str | None = None,
    name: str = "LAMB vs 1-bit LAMB",
    group: str | None = None,
    tasks: Sequence[str] = ("mrpc", "sst2", "rte", "squad"),
):
    """The workspace spec (a `wandb_workspaces.workspaces.Workspace`); builds offline, saves nothing."""
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws

    sections = []
    for title, panels in PRETRAINING_PANELS.items():
        plots: list[Any] = [
            wr.LinePlot(
                title=panel_title,
                x=X_AXIS,
                y=list(keys),
                title_x="samples seen (sequences)",
                groupby_aggfunc="mean",
                groupby_rangefunc="minmax",
                smoothing_type="exponential" if set(keys) & SMOOTHED else None,
                smoothing_factor=0.6 if set(keys) & SMOOTHED else None,
            )
            for panel_title, keys in panels
        ]
        sections.append(ws.Section(name=title, panels=plots, is_open=True))
    finetune_panels: list[Any] = []
    for task in tasks:
        key = main_metric_key(task)
        # mean and min-max band over the fine-tune runs of each group (eval records carry the x value)
        finetune_panels.append(
            wr.LinePlot(
                title=f"{task}: {key} vs pretraining samples (grouped)",
                x="pretraining_samples_seen",
                y=[key],
                title_x="pretraining samples seen (sequences)",
                groupby_aggfunc="mean",
                groupby_rangefunc="minmax",
            )
        )
        # one point per fine-tune run (its final evaluation)
        finetune_panels.append(
            wr.ScatterPlot(
                title=f"{task}: {key} per fine-tune run",
                x=wr.Config("pretraining_samples_seen"),
                y=wr.SummaryMetric(key),
            )
        )
    if finetune_panels:
        sections.append(
            ws.Section(name="Fine-tuning: sample to accuracy", panels=finetune_panels, is_open=True)
        )
    filters = ws.And(ws.Metric("Group") == group) if group else ""
    return ws.Workspace(
        entity=entity or ENTITY_PLACEHOLDER,
        project=project,
        name=name,
        sections=sections,
        settings=ws.WorkspaceSettings(x_axis=X_AXIS),
        runset_settings=ws.RunsetSettings(groupby=[ws.Config(key) for key in GROUP_BY], filters=filters),
    )


def workspace_spec(workspace: Any) -> dict[str, Any]:
    """The view JSON that `Workspace.save()` would upload (the library's own serialization)."""
    return workspace._to_model().model_dump(by_alias=True, mode="json")


def save_workspace(workspace: Any) -> str:
    """Create the view on W&B (network, API key); -> its URL."""
    if workspace.entity == ENTITY_PLACEHOLDER:
        import wandb

        workspace.entity = wandb.Api().default_entity
    workspace.save()
    return str(workspace.url)


def describe(workspace: Any) -> str:
    lines = [f"workspace '{workspace.name}' for {workspace.entity}/{workspace.project}"]
    groupby = ", ".join(f"config.{g.name}" for g in workspace.runset_settings.groupby)
    lines.append(f"  runs grouped by {groupby}")
    for section in workspace.sections:
        lines.append(f"  {section.name}: {len(section.panels)} panels")
        for panel in section.panels:
            lines.append(f"    - {panel.title}")
    return "\n".join(lines)


@hydra.main(config_path="../../conf", config_name="dashboard", version_base="1.3")
def main(dict_cfg: DictConfig) -> None:
    try:
        cfg: DashboardConfig = to_object(dict_cfg)
        workspace = build_workspace(cfg.project, cfg.entity, cfg.name, cfg.group, cfg.tasks)
    except ValueError as error:  # pydantic's ValidationError too
        cli.fail("dashboard", error)
    print(describe(workspace))
    if cfg.spec_file:
        path = Path(cfg.spec_file)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(workspace_spec(workspace), indent=1) + "\n")
        tmp.replace(path)
        print(f"dashboard: spec written to {path}")
    if not cfg.save:
        print("dashboard: built offline; save=true creates the workspace on W&B")
        return
    try:
        url = save_workspace(workspace)
    except Exception as error:  # no API key, no network, no permission: one line
        if cli.debug_enabled():
            raise
        print(f"dashboard: error: saving to W&B failed ({type(error).__name__}: {error})", file=sys.stderr)
        sys.exit(2)
    print(f"dashboard: saved {url}")


if __name__ == "__main__":
    cli.run(main, "dashboard")
