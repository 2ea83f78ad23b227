"""Typed configuration of `python -m results.compare` and `python -m results.compare.dashboard`.

Roots: conf/compare.yaml and conf/dashboard.yaml. A misspelt key fails at composition; cross-field
checks raise ValueError naming the key.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

import data.config  # noqa: F401 - registers the repo_root resolver

SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class RunSource(str, enum.Enum):
    local = "local"  # run folders on disk (metrics.jsonl, config.yaml, finetune/**/all_results.json)
    wandb = "wandb"  # W&B runs through the public API (needs a network and an API key)


@dataclass
class CompareWandbConfig:
    source: RunSource = RunSource.local
    project: str = "bert-lamb"
    entity: str | None = None  # null: the API key's default entity
    group: str | None = None  # only runs of this W&B group (e.g. the batch recipe: demo, 64k)


@dataclass
class CompareConfig:
    study: str = MISSING  # the report's folder name: results/<study>/
    # source=local: run folders or globs (relative to the repo root, or absolute);
    # source=wandb: W&B run names or globs (empty: every run of the project/group)
    runs: list[str] = field(default_factory=list)
    output_dir: str = MISSING
    # MLM loss threshold for "samples to reach target"; null: the worst final MLM loss among the
    # reference optimizer's runs times (1 + target_margin)
    target_loss: float | None = None
    target_margin: float = 0.02
    reference_optimizer: str = "lamb"
    # EMA weight over logged records for curves and the target crossing: s_i = w s_(i-1) + (1 - w) x_i
    smoothing: float = 0.6
    # final losses: mean of the raw values of the last `final_window` records of the last phase
    final_window: int = 5
    wandb: CompareWandbConfig = field(default_factory=CompareWandbConfig)

    def __post_init__(self) -> None:
        if not SAFE_NAME.match(self.study):
            raise ValueError(f"study={self.study!r}: use letters, digits, '.', '_' or '-' (a folder name)")
        if self.wandb.source is RunSource.local and not self.runs:
            raise ValueError("runs is empty: give run folders or globs, e.g. runs='[results/runs/demo-*]'")
        if self.target_loss is not None and self.target_loss <= 0:
            raise ValueError("target_loss must be > 0 or null")
        if self.target_margin < 0:
            raise ValueError("target_margin must be >= 0")
        if not 0.0 <= self.smoothing < 1.0:
            raise ValueError("smoothing must be in [0, 1)")
        if self.final_window < 1:
            raise ValueError("final_window must be >= 1")


@dataclass
class DashboardConfig:
    project: str = "bert-lamb"
    entity: str | None = None  # null: the API key's default entity (needed only to save)
    name: str = "LAMB vs 1-bit LAMB"  # the workspace (saved view) name
    group: str | None = None  # show only runs of this W&B group
    # fine-tune tasks that get a score-vs-pretraining-samples panel
    tasks: list[str] = field(default_factory=lambda: ["mrpc", "sst2", "rte", "squad"])
    save: bool = False  # create the workspace on W&B (network); false: build the spec only
    spec_file: str | None = None  # write the spec (JSON) here

    def __post_init__(self) -> None:
        from finetune.tasks import TASKS

        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown:
            raise ValueError(f"tasks: unknown task(s) {unknown}; known: {', '.join(sorted(TASKS))}")


def register_configs() -> None:
    store = ConfigStore.instance()
    store.store(name="compare_schema", node=CompareConfig)
    store.store(name="dashboard_schema", node=DashboardConfig)


register_configs()


def to_object(cfg: Any) -> Any:
    """DictConfig -> dataclasses, once; runs every `__post_init__` check."""
    return OmegaConf.to_object(cfg)
