"""One fine-tuning loop for every task (GLUE classification/regression and SQuAD spans).

    results = run_finetune(cfg, env)   # every rank calls it; rank 0 writes the outputs

Per seed: a fresh model from `model_path` (or `task.init_from`), AdamW with linear warmup/decay,
data parallel under torchrun (DistributedSampler + DDP; gloo on CPU), evaluation with the task's
metrics after every epoch on rank 0. Outputs in `output_dir` (by default
`results/runs/<run>/finetune/<checkpoint>/<task>`): `metrics.jsonl` (every log step and evaluation,
all seeds), `predictions.json` (SQuAD, last seed, official format: id -> answer text, "" = no answer),
`null_odds.json` (SQuAD v2.0: id -> null score − best span score, the official script's na-prob
file) and `all_results.json` (per-seed final metrics, mean / std / median over seeds, skipped rows,
and the pretraining run, checkpoint and samples seen the model comes from).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from tqdm import tqdm

from finetune.config import FinetuneConfig
from launch import cli
from pretrain.config import Precision
from pretrain.distributed.process_group import DistributedEnv, autocast_context
from pretrain.observability.metrics import (
    ConsoleLogger,
    FanoutLogger,
    JsonlLogger,
    MetricsLogger,
    NullLogger,
    WandbLogger,
    scrub_secrets,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger("finetune")

MODEL_INPUTS = ("input_ids", "token_type_ids", "attention_mask")
TARGETS = {
    "span": ("start_positions", "end_positions"),
    "classification": ("labels",),
    "regression": ("labels",),
}
PRETRAINING_STATE_FILE = "pretraining_state.json"


# -- data ------------------------------------------------------------------------------------------------
class ColumnDataset(Dataset):
    """Rows of a dict of equal-length columns, restricted to `keys`."""

    def __init__(self, columns: dict[str, list[Any]], keys: Sequence[str]):
        missing = [k for k in keys if k not in columns]
        assert not missing, f"features lack the columns {missing}"
        self.columns = {k: columns[k] for k in keys}
        self.length = len(columns[keys[0]])

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {k: column[index] for k, column in self.columns.items()}


@dataclass
class Collator:
    """Pads token columns to the longest row of the batch (dynamic padding: GLUE rows are short)."""

    pad_token_id: int
    label_dtype: torch.dtype = torch.long

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch: dict[str, torch.Tensor] = {}
        for key in rows[0]:
            values = [row[key] for row in rows]
            if isinstance(values[0], list | tuple | np.ndarray):
                width = max(len(v) for v in values)
                pad = self.pad_token_id if key == "input_ids" else 0
                batch[key] = torch.tensor(
                    [list(v) + [pad] * (width - len(v)) for v in values], dtype=torch.long
                )
            else:
                dtype = self.label_dtype if key == "labels" else torch.long
                batch[key] = torch.tensor(values, dtype=dtype)
        return batch


@dataclass
class EvalSet:
    """One evaluation split: model features plus what the metric needs (labels, or SQuAD examples)."""

    split: str
    features: dict[str, list[Any]]
    examples: list[Any] = field(default_factory=list)


@dataclass
class TaskData:
    train: dict[str, list[Any]]
    evals: list[EvalSet]
    skips: dict[str, Any]
    notes: list[str]
    num_train_examples: int
    num_eval_examples: dict[str, int]


def _limit(items: list[Any], limit: int | None) -> list[Any]:
    return items if limit is None else items[:limit]


def split_by_article(examples: list[Any], fraction: float) -> tuple[list[Any], list[Any]]:
    """First `fraction` of the articles (in file order, at least one on each side) -> train; the rest ->
    eval. Deterministic; questions of one article never land on both sides."""
    titles = list(dict.fromkeys(_field(example, "title") for example in examples))  # first-seen order
    if len(titles) < 2:
        raise ValueError(f"task.train_fraction: the data has {len(titles)} article(s); need 2 to split")
    cut = min(max(1, round(len(titles) * fraction)), len(titles) - 1)
    train_titles = set(titles[:cut])
    train = [e for e in examples if _field(e, "title") in train_titles]
    held_out = [e for e in examples if _field(e, "title") not in train_titles]
    return train, held_out


def _field(example: Any, key: str) -> Any:
    return example[key] if isinstance(example, Mapping) else getattr(example, key)


def load_task_data(cfg: FinetuneConfig, spec: Any, tokenizer: Any) -> TaskData:
    """Read, split and featurize the train and eval splits of `cfg.task` (every rank does the same)."""
    from finetune.tasks import encode_glue, load_examples, prepare_squad_features

    task = cfg.task
    eval_splits = list(task.eval_splits or spec.eval_splits)
    skips: dict[str, Any] = {}
    notes: list[str] = []

    def read(split: str, limit: int | None) -> list[Any]:
        examples, skipped = load_examples(spec, split, data_dir=cfg.data_dir, max_examples=limit)
        skips[split] = skipped
        return list(examples)

    carve_squad_train = spec.kind == "span" and task.train_split in eval_splits
    if carve_squad_train:
        every = read(task.train_split, None)
        train_part, held_out = split_by_article(every, task.train_fraction)
        train_examples = _limit(train_part, task.max_train_examples)
        eval_examples = {task.train_split: _limit(held_out, task.max_eval_examples)}
        notes.append(
            f"no separate train set: trained on {len(train_examples)} of the {len(train_part)} questions "
            f"of the first {task.train_fraction:.0%} of the articles of '{task.train_split}' and evaluated "
            f"on {len(eval_examples[task.train_split])} of the {len(held_out)} questions of the other "
            "articles; scores are not comparable to the official dev set"
        )
        for split in eval_splits:
            if split != task.train_split:
                eval_examples[split] = read(split, task.max_eval_examples)
    else:
        train_examples = read(task.train_split, task.max_train_examples)
        eval_examples = {split: read(split, task.max_eval_examples) for split in eval_splits}
    if not train_examples:
        raise ValueError(f"task.train_split={task.train_split}: no training examples")

    if spec.kind == "span":
        train = prepare_squad_features(
            train_examples, tokenizer, max_length=task.max_length, doc_stride=task.doc_stride, train=True
        )
        evals = [
            EvalSet(
                split,
                prepare_squad_features(
                    examples, tokenizer, max_length=task.max_length, doc_stride=task.doc_stride, train=False
                ),
                examples,
            )
            for split, examples in eval_examples.items()
        ]
    else:
        train = encode_glue(train_examples, tokenizer, task.max_length)
        evals = [
            EvalSet(split, encode_glue(examples, tokenizer, task.max_length), examples)
            for split, examples in eval_examples.items()
        ]
    return TaskData(
        train=train,
        evals=evals,
        skips=skips,
        notes=notes,
        num_train_examples=len(train_examples),
        num_eval_examples={split: len(examples) for split, examples in eval_examples.items()},
    )


# -- model -----------------------------------------------------------------------------------------------
def check_model_folder(path: str, what: str = "model_path") -> Path:
    """A local Hugging Face BERT folder, or a one-line ValueError naming it.

    A pretraining run folder (`<run>/checkpoints/step-N/`) stands for its newest complete
    checkpoint's `hf/` export."""
    from pretrain.checkpoint import latest_checkpoint

    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ValueError(f"{what}={folder}: no such folder")
    if not (folder / "config.json").is_file() and (folder / "checkpoints").is_dir():
        newest = latest_checkpoint(folder / "checkpoints")
        if newest is None or not (newest / "hf").is_dir():
            raise ValueError(
                f"{what}={folder}: a run folder without a complete checkpoint with an hf/ export"
            )
        folder = newest / "hf"
        log.info("%s: newest checkpoint %s", what, folder)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{what}={folder}: not a Hugging Face model folder (no config.json)")
    try:
        model_type = json.loads(config_file.read_text()).get("model_type")
    except (json.JSONDecodeError, AttributeError) as error:
        raise ValueError(f"{what}={folder}: config.json is not a JSON object ({error})") from None
    if model_type != "bert":
        raise ValueError(f"{what}={folder}: model_type is {model_type!r}, not 'bert'")
    return folder


def load_tokenizer(model_path: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    except (OSError, ValueError) as error:
        raise ValueError(
            f"model_path={model_path}: no loadable tokenizer ({str(error).splitlines()[0]})"
        ) from None
    if not tokenizer.is_fast:  # SQuAD features need offset mappings
        raise ValueError(f"model_path={model_path}: the tokenizer is not a fast (tokenizers) tokenizer")
    return tokenizer


def load_model(weights: Path, spec: Any, *, reinit_mismatched: bool) -> PreTrainedModel:
    """A task head on the encoder in `weights`; heads absent from the checkpoint start random."""
    from transformers import AutoModelForQuestionAnswering, AutoModelForSequenceClassification

    if spec.kind == "span":
        return AutoModelForQuestionAnswering.from_pretrained(str(weights))
    labels: dict[str, Any] = {}
    if spec.label_names:  # readable labels in the saved config.json
        labels = {
            "id2label": dict(enumerate(spec.label_names)),
            "label2id": {name: i for i, name in enumerate(spec.label_names)},
        }
    return AutoModelForSequenceClassification.from_pretrained(
        str(weights),
        num_labels=spec.num_labels,
        # explicit: an init_from checkpoint carries its own task's problem type
        problem_type="regression" if spec.kind == "regression" else "single_label_classification",
        **labels,
        # an MNLI head (3 labels) under RTE (2) or STS-B (1): drop it, keep the encoder
        ignore_mismatched_sizes=reinit_mismatched,
    )


@dataclass(frozen=True)
class PretrainingInfo:
    """Where a model comes from, for the results and W&B: the pretraining run's name and W&B group
    (None for a model that is not one of our checkpoints, or an export that predates the key), and
    the samples the checkpoint had seen."""

    run: str | None = None
    wandb_group: str | None = None
    samples_seen: int | None = None
    optimizer: str | None = None  # the pretraining optimizer and global batch: W&B groups by them
    global_batch: int | None = None


def read_pretraining_info(model_path: Path) -> PretrainingInfo:
    """From `<model_path>/pretraining_state.json` (our checkpoints' HF exports: the trainer's state plus
    `run_name` and `wandb_group`); the run's name also from a `<run>/checkpoints/step-N/hf` path."""
    from finetune.config import STEP_FOLDER, run_name_of

    state: dict[str, Any] = {}
    state_file = model_path / PRETRAINING_STATE_FILE
    if state_file.is_file():
        try:
            loaded = json.loads(state_file.read_text())
        except json.JSONDecodeError:
            loaded = None
        if isinstance(loaded, dict):
            state = loaded
        else:
            log.warning("%s is not a JSON object; the pretraining run is unknown", state_file)
    checkpoint = model_path.parent if model_path.name == "hf" else model_path
    in_run_folder = checkpoint.parent.name == "checkpoints" and STEP_FOLDER.fullmatch(checkpoint.name)
    run = state.get("run_name") or (run_name_of(str(model_path)) if in_run_folder else None)
    samples_seen = state.get("samples_seen")
    return PretrainingInfo(
        run=str(run) if run is not None else None,
        wandb_group=state.get("wandb_group"),
        samples_seen=int(samples_seen) if samples_seen is not None else None,
        optimizer=state.get("optimizer"),
        global_batch=state.get("global_batch"),
    )


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, device: torch.device):
    """AdamW; no weight decay on biases and LayerNorm weights (BERT's recipe); fused kernels on CUDA."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            (no_decay if parameter.ndim < 2 or "LayerNorm" in name else decay).append(parameter)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, fused=device.type == "cuda")


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# -- evaluation ------------------------------------------------------------------------------------------
@torch.inference_mode()
def predict(model, features, batch_size: int, collator: Collator, device, precision: str) -> list[np.ndarray]:
    """Model outputs over `features` in order: [logits] or [start_logits, end_logits], float32 numpy."""
    model.eval()
    loader = DataLoader(ColumnDataset(features, MODEL_INPUTS), batch_size=batch_size, collate_fn=collator)
    outputs: list[list[np.ndarray]] = []
    for batch in loader:
        with autocast_context(device, precision):
            out = model(**{k: v.to(device) for k, v in batch.items()})
        heads = [out.start_logits, out.end_logits] if hasattr(out, "start_logits") else [out.logits]
        outputs.append([h.float().cpu().numpy() for h in heads])
    return [np.concatenate([o[i] for o in outputs]) for i in range(len(outputs[0]))]


def evaluate(
    model, eval_set: EvalSet, spec, cfg: FinetuneConfig, collator, device, precision
) -> tuple[dict[str, float], dict[str, Any]]:
    """-> (metrics, the split's output files by name: SQuAD's `predictions.json`, v2.0's
    `null_odds.json`; none for GLUE)."""
    from finetune.metrics import glue_metrics, squad_v1_metrics, squad_v2_metrics
    from finetune.tasks import postprocess_squad, postprocess_squad_v2

    heads = predict(model, eval_set.features, cfg.task.batch_size, collator, device, precision)
    task = cfg.task
    if spec.kind == "span" and spec.has_unanswerable:
        predictions, null_odds = postprocess_squad_v2(
            eval_set.examples,
            eval_set.features,
            heads[0],
            heads[1],
            n_best=task.n_best,
            max_answer_length=task.max_answer_length,
            null_score_diff_threshold=task.null_score_diff_threshold,
        )
        metrics = squad_v2_metrics(predictions, eval_set.examples, null_odds)
        return metrics, {"predictions.json": predictions, "null_odds.json": null_odds}
    if spec.kind == "span":
        predictions = postprocess_squad(
            eval_set.examples,
            eval_set.features,
            heads[0],
            heads[1],
            n_best=task.n_best,
            max_answer_length=task.max_answer_length,
        )
        return dict(squad_v1_metrics(predictions, eval_set.examples)), {"predictions.json": predictions}
    logits = heads[0]
    predicted = logits[:, 0] if spec.kind == "regression" else logits.argmax(axis=-1)
    return dict(glue_metrics(spec.name, predicted.tolist(), eval_set.features["labels"])), {}


# -- the loop --------------------------------------------------------------------------------------------
def _precision(cfg: FinetuneConfig, device: torch.device) -> str:
    if cfg.precision == Precision.auto:
        return "bf16" if device.type == "cuda" else "fp32"
    return cfg.precision.value


def wandb_group(cfg: FinetuneConfig, pretraining: PretrainingInfo) -> str:
    """`wandb.group` if set, else the pretraining run's group, else its name (the run name for a model
    that is not one of our checkpoints): fine-tunes of a run's checkpoints land beside it."""
    return cfg.wandb.group or pretraining.wandb_group or pretraining.run or cfg.run_name


def wandb_init_kwargs(cfg: FinetuneConfig, seed: int, pretraining: PretrainingInfo) -> dict[str, Any]:
    """The keyword arguments of `WandbLogger` (so of `wandb.init`) for one seed's run."""
    tags = [*cfg.wandb.tags, "finetune", cfg.task.name, f"seed-{seed}", f"checkpoint-{cfg.checkpoint}"]
    if pretraining.samples_seen is not None:
        tags.append(f"pretraining_samples_seen={pretraining.samples_seen}")
    config = dict(OmegaConf.to_container(OmegaConf.structured(cfg)))  # type: ignore[arg-type]
    config.update(
        seed=seed,
        pretraining_samples_seen=pretraining.samples_seen,
        pretraining_run=pretraining.run,
        optimizer=pretraining.optimizer,
        global_batch=pretraining.global_batch,
    )
    return {
        "project": cfg.wandb.project,
        "group": wandb_group(cfg, pretraining),
        "name": f"{cfg.run_name}-{cfg.checkpoint}-{cfg.task.name}-seed{seed}",
        "tags": tags,
        "mode": cfg.wandb.mode.value,
        "config": config,
        "directory": cfg.output_dir,
        "job_type": "finetune",
    }


def _build_logger(
    cfg: FinetuneConfig, env: DistributedEnv, seed: int, pretraining: PretrainingInfo
) -> MetricsLogger:
    if not env.is_main:
        return NullLogger()
    # the console shows training records only; evaluations are printed above the progress bar
    loggers: list[MetricsLogger] = [JsonlLogger(Path(cfg.output_dir) / "metrics.jsonl")]
    if cfg.wandb.mode.value != "disabled":
        loggers.append(WandbLogger(**wandb_init_kwargs(cfg, seed, pretraining)))
    return FanoutLogger(*loggers)


def _prefixed(metrics: Mapping[str, float], split: str, single: bool) -> dict[str, float]:
    return {(name if single else f"{split}_{name}"): float(value) for name, value in metrics.items()}


def train_one_seed(
    cfg: FinetuneConfig,
    spec: Any,
    env: DistributedEnv,
    data: TaskData,
    tokenizer: Any,
    seed: int,
    pretraining: PretrainingInfo,
    model_path: Path,
    save_to: Path | None = None,
) -> tuple[dict[str, float], dict[str, Any]]:
    """Fine-tune one fresh model with `seed` from `model_path` (resolved, see `check_model_folder`) or
    `task.init_from`. -> (final metrics, the first eval split's output files by name, see `evaluate`).

    Collective: every rank calls it. Metrics are computed on rank 0 (other ranks get {}); `save_to`
    (rank 0 only) receives the fine-tuned model and tokenizer as an HF folder."""
    task, device = cfg.task, env.device
    precision = _precision(cfg, device)
    if task.batch_size % env.world_size:
        raise ValueError(
            f"task.batch_size={task.batch_size} is not divisible by the world size {env.world_size}"
        )
    set_seed(seed)
    weights = check_model_folder(task.init_from, "task.init_from") if task.init_from else model_path
    model = load_model(weights, spec, reinit_mismatched=task.init_from is not None)
    # nn.Module.to moves in place; transformers types its wrapped .to too narrowly for mypy
    model.to(device)  # type: ignore[arg-type]
    train_model: torch.nn.Module = model
    if env.world_size > 1:
        train_model = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )

    collator = Collator(tokenizer.pad_token_id, torch.float if spec.kind == "regression" else torch.long)
    train_set = ColumnDataset(data.train, MODEL_INPUTS + TARGETS[spec.kind])
    # DistributedSampler also for a world of one: the same seeded shuffle for every world size
    sampler: DistributedSampler = DistributedSampler(
        train_set, num_replicas=env.world_size, rank=env.rank, shuffle=True, seed=seed
    )
    loader = DataLoader(
        train_set,
        batch_size=task.batch_size // env.world_size,
        sampler=sampler,
        collate_fn=collator,
        num_workers=cfg.num_workers,
        pin_memory=device.type == "cuda",
    )
    total_steps = len(loader) * task.epochs
    optimizer = build_optimizer(model, task.lr, task.weight_decay, device)
    from transformers import get_linear_schedule_with_warmup

    scheduler = get_linear_schedule_with_warmup(
        optimizer, math.ceil(task.warmup_ratio * total_steps), total_steps
    )

    logger = _build_logger(cfg, env, seed, pretraining)
    samples_seen = pretraining.samples_seen
    console: MetricsLogger = ConsoleLogger(("loss", "lr")) if env.is_main else NullLogger()
    bar = tqdm(
        total=total_steps,
        disable=not (env.is_main and cfg.show_progress),
        desc=f"{task.name} seed {seed}",
        unit="step",
    )
    single = len(data.evals) == 1
    final: dict[str, float] = {}
    files: dict[str, Any] = {}
    step = 0
    try:
        for epoch in range(task.epochs):
            # -- train one epoch
            train_model.train()
            sampler.set_epoch(epoch)
            for batch in loader:
                batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
                with autocast_context(device, precision):
                    loss = train_model(**batch).loss
                loss.backward()
                # BERT's recipe clips the global gradient norm at 1.0
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                bar.update()
                if step % cfg.log_every == 0 or step == total_steps:
                    record = {"loss": loss.item(), "lr": scheduler.get_last_lr()[0], "epoch": epoch + 1}
                    logger.log(step, {**record, "seed": seed})
                    console.log(step, record)
            # -- evaluate (rank 0; the eval sets are small next to training, and it keeps order simple)
            if cfg.eval_every_epoch or epoch == task.epochs - 1:
                if env.is_main:
                    final = {}
                    for index, eval_set in enumerate(data.evals):
                        metrics, split_files = evaluate(
                            model, eval_set, spec, cfg, collator, device, precision
                        )
                        final.update(_prefixed(metrics, eval_set.split, single))
                        if index == 0:
                            files = split_files
                    record = {f"eval/{k}": v for k, v in final.items()}
                    record.update(epoch=epoch + 1, seed=seed)
                    if samples_seen is not None:
                        record["pretraining_samples_seen"] = samples_seen
                    logger.log(step, record)
                    bar.write(f"{task.name} seed {seed} epoch {epoch + 1}: " + _format(final))
                if env.world_size > 1:
                    dist.barrier()
        if save_to is not None:
            save_model_folder(model, tokenizer, save_to)
    finally:
        bar.close()
        logger.close()
    return final, files


def save_model_folder(model: Any, tokenizer: Any, folder: Path) -> None:
    """`save_model=true`: the fine-tuned model and its tokenizer as a Hugging Face folder, written under a
    temporary name and renamed at the end, so that a folder named `folder` is always whole. A failed write
    (a full disk: safetensors' SafetensorError, an OSError) removes the temporary folder, keeps an earlier
    `folder` and is one ValueError line."""
    from pretrain.checkpoint import WRITE_ERRORS

    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    except WRITE_ERRORS as error:
        shutil.rmtree(tmp, ignore_errors=True)
        kept = "the earlier one is kept" if folder.exists() else "nothing written"
        raise ValueError(f"save_model: {folder} not saved ({cli.first_line(error)}); {kept}") from None
    displaced = folder.with_name(f".{folder.name}.replaced-{os.getpid()}")
    if folder.exists():  # a fine-tune into the same output_dir: the new model replaces the old one
        os.replace(folder, displaced)
    os.replace(tmp, folder)
    shutil.rmtree(displaced, ignore_errors=True)


def _format(metrics: Mapping[str, float]) -> str:
    return " ".join(f"{k}={v:.4f}" for k, v in metrics.items())


def summarize(per_seed: Mapping[int, Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """{metric: {mean, std, median, min, max}} over seeds; std is the sample std (n-1), 0 for one seed."""
    names = list(next(iter(per_seed.values())))
    summary = {}
    for name in names:
        values = [float(metrics[name]) for metrics in per_seed.values()]
        summary[name] = {
            "mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "median": statistics.median(values),
            "min": min(values),
            "max": max(values),
        }
    return summary


def write_json_atomic(path: Path, payload: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(payload, indent=2, default=_json_default) + "\n")
    os.replace(tmp, path)


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if hasattr(value, "_asdict"):
        return value._asdict()
    if hasattr(value, "__dict__"):
        return vars(value)
    return str(value)


def run_finetune(cfg: FinetuneConfig, env: DistributedEnv) -> dict[str, Any]:
    """Fine-tune `cfg.model_path` on `cfg.task` once per seed. Collective: every rank calls it.

    -> the all_results.json payload (rank 0; other ranks get the same minus metrics). Raises ValueError
    (or data.documents.DataError) with a one-line message for a bad model folder, config or data."""
    from finetune.tasks import TASKS

    if cfg.task.name not in TASKS:
        raise ValueError(f"task.name={cfg.task.name}: unknown task; known: {', '.join(sorted(TASKS))}")
    spec = TASKS[cfg.task.name]
    model_path = check_model_folder(cfg.model_path)
    tokenizer = load_tokenizer(model_path)
    pretraining = read_pretraining_info(model_path)
    if not spec.has_unanswerable and cfg.task.null_score_diff_threshold != 0.0:
        log.warning("task.null_score_diff_threshold is ignored: %s has no unanswerable questions", spec.name)
    data = load_task_data(cfg, spec, tokenizer)
    output_dir = Path(cfg.output_dir)
    if env.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        # a re-run replaces the previous run's outputs rather than appending to its metrics
        (output_dir / "metrics.jsonl").unlink(missing_ok=True)

    per_seed: dict[int, dict[str, float]] = {}
    for index, seed in enumerate(cfg.seeds):
        save_to = output_dir / "model" if cfg.save_model and index == 0 and env.is_main else None
        metrics, files = train_one_seed(
            cfg, spec, env, data, tokenizer, seed, pretraining, model_path, save_to
        )
        per_seed[seed] = metrics
        if env.is_main:
            from finetune.metrics import write_squad_predictions

            for name, payload in files.items():
                write_squad_predictions(output_dir / name, payload)

    results: dict[str, Any] = {
        "task": spec.name,
        "main_metric": spec.main_metric,
        # per-split names when a task has several eval splits (MNLI: dev_matched_accuracy, ...)
        "main_metric_key": spec.main_metric
        if len(data.evals) == 1
        else f"{data.evals[0].split}_{spec.main_metric}",
        "model_path": str(model_path),
        "init_from": cfg.task.init_from,
        # issue #6's comparison finds a fine-tune's place on the sample-to-accuracy curve by these
        "pretraining_run": pretraining.run,
        "checkpoint": cfg.checkpoint,
        "pretraining_samples_seen": pretraining.samples_seen,
        "wandb_group": scrub_secrets(wandb_group(cfg, pretraining)),
        "data": {
            "source": cfg.data_dir or "hub",
            "train_split": cfg.task.train_split,
            "num_train_examples": data.num_train_examples,
            "num_train_features": len(data.train["input_ids"]),
            "num_eval_examples": data.num_eval_examples,
            "notes": data.notes,
        },
        "skips": data.skips,
        "seeds": list(cfg.seeds),
        "per_seed": {str(seed): metrics for seed, metrics in per_seed.items()},
        "summary": summarize(per_seed) if env.is_main else {},
        "world_size": env.world_size,
        "config": scrub_secrets(OmegaConf.to_container(OmegaConf.structured(cfg))),
    }
    if env.is_main:
        write_json_atomic(output_dir / "all_results.json", results)
        main = results["summary"].get(results["main_metric_key"])
        if main is not None:
            print(
                f"{spec.name}: {results['main_metric_key']} = {main['mean']:.4f} ± {main['std']:.4f} "
                f"(median {main['median']:.4f}, {len(cfg.seeds)} seed(s)) -> "
                f"{output_dir / 'all_results.json'}",
                flush=True,
            )
    return results
