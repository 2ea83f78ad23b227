"""Typed configuration of `python -m finetune`, registered in Hydra's ConfigStore.

Root: conf/finetune.yaml composes one `conf/task/<name>.yaml`. A misspelt key fails at composition;
cross-field checks raise ValueError naming the key. The runner converts the DictConfig once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

import data.config  # noqa: F401 - registers the repo_root/shared_data resolvers
from pretrain.config import Precision, WandbMode

STEP_FOLDER = re.compile(r"step-\d+")  # pretrain.checkpoint's step-NNNNNNNN folders


def run_name_of(model_path: str) -> str:
    """The results folder name for a model: `<run>` for `.../<run>/checkpoints/step-N/hf` and for a
    run folder `.../<run>`, else the folder's own name (its parent's for a bare `hf/`)."""
    path = Path(str(model_path)).expanduser()
    parts = path.parts
    if "checkpoints" in parts:
        index = len(parts) - 1 - parts[::-1].index("checkpoints")
        if index > 0:
            return parts[index - 1]
    if path.name == "hf" and path.parent.name:
        return path.parent.name
    return path.name or "model"


def checkpoint_tag_of(model_path: str) -> str:
    """The checkpoint's folder under `<run>/finetune/`: `step-NNNNNNNN` for our checkpoints
    (`.../checkpoints/step-N[/hf]`; a pretraining run folder stands for its newest complete
    checkpoint, as in `finetune.runner.check_model_folder`), `final` for any other model folder
    (and for a run folder without a complete checkpoint, which the runner then rejects)."""
    path = Path(str(model_path)).expanduser()
    if path.name == "hf":
        path = path.parent
    if path.parent.name == "checkpoints" and STEP_FOLDER.fullmatch(path.name):
        return path.name
    if not (path / "config.json").is_file() and (path / "checkpoints").is_dir():
        from pretrain.checkpoint import latest_checkpoint  # lazily: imports torch

        newest = latest_checkpoint(path / "checkpoints")
        if newest is not None:
            return newest.name
    return "final"


if not OmegaConf.has_resolver("finetune_run"):
    OmegaConf.register_new_resolver("finetune_run", run_name_of)
if not OmegaConf.has_resolver("finetune_checkpoint"):
    OmegaConf.register_new_resolver("finetune_checkpoint", checkpoint_tag_of)


@dataclass
class TaskConfig:
    """One task's recipe. `name` must be a key of `finetune.tasks.TASKS`."""

    name: str = MISSING
    lr: float = 2e-5
    epochs: int = 3
    batch_size: int = 32  # global: split over the data-parallel ranks
    warmup_ratio: float = 0.1  # of the total optimizer steps
    weight_decay: float = 0.01  # not applied to biases and LayerNorm weights
    max_length: int = 128
    doc_stride: int = 128  # SQuAD only: overlap between the windows of a long context
    n_best: int = 20  # SQuAD only: candidate starts/ends considered per feature
    max_answer_length: int = 30  # SQuAD only: in tokens
    # SQuAD v2.0 only: predict "" when the null ([CLS]) score exceeds the best span's by more than this
    # (google-research/bert suggests tuning it on dev between -1 and -5; see best_f1_thresh)
    null_score_diff_threshold: float = 0.0
    train_split: str = "train"
    eval_splits: list[str] | None = None  # null: the task spec's (MNLI: matched and mismatched)
    # SQuAD with train_split=dev (no local train set): train on the first train_fraction of dev's
    # articles, evaluate on the rest. Ignored otherwise.
    train_fraction: float = 0.5
    max_train_examples: int | None = None  # smoke runs and CPU tests
    max_eval_examples: int | None = None
    # Start from these weights instead of model_path's (e.g. an MNLI fine-tune for RTE/MRPC/STS-B);
    # a classifier head of another size is re-initialized. The tokenizer still comes from model_path.
    init_from: str | None = None
    # Where this task's files live in the shared-data layout; the root data_dir defaults to it.
    local_data_dir: str | None = None

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError("task.lr must be > 0")
        if self.epochs < 1 or self.batch_size < 1:
            raise ValueError("task.epochs and task.batch_size must be >= 1")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError("task.warmup_ratio must be in [0, 1)")
        if self.weight_decay < 0:
            raise ValueError("task.weight_decay must be >= 0")
        if self.max_length < 8:
            raise ValueError("task.max_length must be >= 8")
        if self.doc_stride < 1 or self.n_best < 1 or self.max_answer_length < 1:
            raise ValueError("task.doc_stride, task.n_best and task.max_answer_length must be >= 1")
        if self.eval_splits is not None and not self.eval_splits:
            raise ValueError("task.eval_splits is empty (null = the task's own splits)")
        if not 0.0 < self.train_fraction < 1.0:
            raise ValueError("task.train_fraction must be in (0, 1)")
        for key in ("max_train_examples", "max_eval_examples"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"task.{key} must be >= 1 or null")


@dataclass
class FinetuneWandbConfig:
    mode: WandbMode = WandbMode.auto
    project: str = "bert-lamb"
    # null: the pretraining run's group (pretraining_state.json of our checkpoints' hf/ exports), else
    # the pretraining run's name (run_name), so fine-tunes sit beside the pretraining curves
    group: str | None = None
    tags: list[str] = field(default_factory=list)


@dataclass
class FinetuneConfig:
    task: TaskConfig = MISSING
    model_path: str = MISSING  # an HF folder: `<run>/checkpoints/step-N/hf` or any BERT checkpoint
    data_dir: str | None = None  # local data root (layout of ../shared/data); null = the HF hub
    run_name: str = MISSING
    checkpoint: str = MISSING  # the checkpoint's tag (step-NNNNNNNN or final): a level of output_dir
    output_dir: str = MISSING
    seeds: list[int] = field(default_factory=lambda: [42])
    precision: Precision = Precision.auto
    wandb: FinetuneWandbConfig = field(default_factory=FinetuneWandbConfig)
    num_workers: int = 0  # DataLoader workers per rank; the features are in memory already
    log_every: int = 50
    eval_every_epoch: bool = True  # false: evaluate after the last epoch only
    # Save the first seed's fine-tuned model (+ tokenizer) to <output_dir>/model: the folder to give
    # another task as task.init_from (an MNLI fine-tune for RTE/MRPC/STS-B).
    save_model: bool = False
    show_progress: bool = True

    def __post_init__(self) -> None:
        if not self.seeds:
            raise ValueError("seeds is empty")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds has duplicates: {self.seeds}")
        if self.log_every < 1:
            raise ValueError("log_every must be >= 1")
        if self.num_workers < 0:
            raise ValueError("num_workers must be >= 0")
        if self.precision == Precision.fp16:
            raise ValueError("precision=fp16 is not supported for fine-tuning: use auto, bf16 or fp32")


def register_configs() -> None:
    store = ConfigStore.instance()
    store.store(name="finetune_schema", node=FinetuneConfig)
    store.store(group="task", name="task_schema", node=TaskConfig)


register_configs()


def to_object(cfg: Any) -> FinetuneConfig:
    """DictConfig -> dataclasses, once; runs every `__post_init__` check."""
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, FinetuneConfig)
    return obj
