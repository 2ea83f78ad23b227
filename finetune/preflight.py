"""Pre-flight report of a fine-tuning run: the header of `python -m finetune` (and `make finetune`).

    report = build(cfg)          # from the config and a few stat() calls: no data read, no model built

A few lines: the task and its splits, the model folder actually used (a pretraining run folder means its
newest complete checkpoint's hf/ export) and what it was pretrained with, devices, world size and the
batch split over the ranks, epochs, seeds and precision, where the data comes from, the output folder,
the W&B mode. Problems are one line each naming the key and the fix (the runner's own wording where the
runner checks the same thing later); `python -m finetune` stops on them with exit code 2 before anything
is built. The report type and the device probe are the pretraining pre-flight's
(`pretrain/tools/preflight.py`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from data.hub_access import offline_variable
from finetune.config import FinetuneConfig
from finetune.runner import PRETRAINING_STATE_FILE, check_model_folder, read_pretraining_info
from finetune.tasks import TASKS, TaskSpec
from finetune.tasks.squad import squad_file
from pretrain.config import Precision
from pretrain.tools.preflight import Report, devices, wandb_mode

OUTPUT_FILES = ("all_results.json", "metrics.jsonl")  # what a finished or interrupted run leaves behind


def build(cfg: FinetuneConfig, world_size: int | None = None) -> Report:
    """The report for `cfg` at `world_size` processes (default: the launcher's WORLD_SIZE, else 1)."""
    report = Report()
    kind, description = devices()
    world = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    task = cfg.task
    precision = cfg.precision
    if precision is Precision.auto:  # as the runner decides it
        precision = Precision.bf16 if kind == "cuda" else Precision.fp32
    spec = TASKS.get(task.name)
    if spec is None:
        report.problems.append(f"task.name={task.name}: unknown task; known: {', '.join(sorted(TASKS))}")
    report.lines.append(f"pre-flight: finetune {task.name}, {_splits(cfg, spec)}")
    report.lines += _model_lines(cfg, report)
    per_rank = "?" if task.batch_size % world else str(task.batch_size // world)
    epochs = f"{task.epochs} epoch{'s' if task.epochs != 1 else ''}"
    report.lines += [
        f"  devices: {description}; world size {world}",
        f"  batch: global {task.batch_size} = {world} x {per_rank} per rank, {epochs}, "
        f"lr {task.lr}, max length {task.max_length}, seeds {list(cfg.seeds)}, precision {precision.value}",
    ]
    if task.batch_size % world:
        report.problems.append(
            f"task.batch_size={task.batch_size} is not divisible by the world size {world}: set "
            "task.batch_size to a multiple of it or change the number of processes"
        )
    if spec is not None:
        report.lines.append(f"  data: {_data_source(cfg, spec, report)}")
    output_dir = Path(cfg.output_dir)
    earlier = [name for name in OUTPUT_FILES if (output_dir / name).is_file()]
    replaced = f" (holds an earlier run's {', '.join(earlier)}: this run replaces them)" if earlier else ""
    report.lines += [
        f"  output: {output_dir}{replaced}",
        f"  W&B: {wandb_mode(cfg.wandb.mode, cfg.wandb.project)}",
    ]
    return report


def _splits(cfg: FinetuneConfig, spec: TaskSpec | None) -> str:
    """'train on 'train', evaluate on 'dev'', or how SQuAD without a train set splits dev (as the runner)."""
    task = cfg.task
    eval_splits = list(task.eval_splits or (spec.eval_splits if spec else ()))
    limit = f" (first {task.max_train_examples} examples)" if task.max_train_examples else ""
    evaluate = ", ".join(f"'{split}'" for split in eval_splits) or "?"
    if spec is not None and spec.kind == "span" and task.train_split in eval_splits:
        return (
            f"train on the first {task.train_fraction:.0%} of the articles of '{task.train_split}'{limit}, "
            "evaluate on the rest (no separate train set: not comparable to the official dev scores)"
        )
    return f"train on '{task.train_split}'{limit}, evaluate on {evaluate}"


def _model_lines(cfg: FinetuneConfig, report: Report) -> list[str]:
    """The model folder the runner will load (its own check, so a problem reads the same) and what the
    pretraining that wrote it did; task.init_from likewise."""
    try:
        folder = _quietly(check_model_folder, cfg.model_path)
    except ValueError as error:
        report.problems.append(str(error))
        return [f"  model: {cfg.model_path} (unusable, see the error)"]
    given = Path(cfg.model_path).expanduser()
    resolved = f" (newest complete checkpoint of {given})" if folder != given else ""
    lines = [f"  model: {folder}{resolved}"]
    if (folder / PRETRAINING_STATE_FILE).is_file():
        info = read_pretraining_info(folder)
        facts = [
            f"run {info.run}" if info.run else None,
            f"optimizer {info.optimizer}" if info.optimizer else None,
            f"global batch {info.global_batch}" if info.global_batch else None,
            f"{info.samples_seen:,} samples seen" if info.samples_seen is not None else None,
        ]
        lines.append("  pretraining: " + (", ".join(fact for fact in facts if fact) or "no details recorded"))
    if cfg.task.init_from:
        try:
            lines.append(f"  init_from: {_quietly(check_model_folder, cfg.task.init_from, 'task.init_from')}")
        except ValueError as error:
            report.problems.append(str(error))
    return lines


def _quietly(check: Callable[..., Path], *args: str) -> Path:
    """`check` without its INFO line on the resolved folder: the header says it, the runner logs it later."""
    runner_log = logging.getLogger("finetune")
    level = runner_log.level
    runner_log.setLevel(logging.WARNING)
    try:
        return check(*args)
    finally:
        runner_log.setLevel(level)


def _data_source(cfg: FinetuneConfig, spec: TaskSpec, report: Report) -> str:
    """Local files the task loaders will open (`finetune.tasks.glue`/`squad`: the same paths), each one
    checked for existence; or the hub dataset, and whether offline mode restricts it to the cache."""
    task = cfg.task
    splits = list(dict.fromkeys([task.train_split, *(task.eval_splits or spec.eval_splits)]))
    if cfg.data_dir is None:
        name = f"{spec.hub[0]} ({spec.hub[1]})" if spec.hub[1] else spec.hub[0]
        offline = offline_variable()
        mode = f"offline mode ({offline}=1): only the local cache is read" if offline else "online"
        return f"Hugging Face hub: {name}, {mode}"
    if spec.kind == "span":
        files = [squad_file(cfg.data_dir, split, spec.squad_version or "1.1") for split in splits]
    else:
        files = [Path(cfg.data_dir) / str(spec.glue_dir) / f"{split}.tsv" for split in splits]
    for path, split in zip(files, splits):
        if not path.is_file():
            report.problems.append(
                f"data_dir={cfg.data_dir}: {path} not found (task {spec.name}, split {split}): point "
                "data_dir at a folder in the shared-data layout, or set data_dir=null to read the Hugging "
                "Face hub"
            )
    folders = {path.parent for path in files}
    where = str(files[0].parent) if len(folders) == 1 else str(cfg.data_dir)
    return f"local files in {where}: " + ", ".join(
        path.name if len(folders) == 1 else str(path) for path in files
    )
