"""Loading pretraining runs and their fine-tune results, from run folders or from W&B.

A run folder `results/runs/<run>/` (pretrain/train/run_records.py) holds `metrics.jsonl` (one JSON object per
logged step), `config.yaml` (the resolved config plus the flat keys `optimizer`, `global_batch`,
`world_size`, `command`) and fine-tune results `finetune/**/all_results.json` (finetune/runner.py:
per-seed metrics, `main_metric_key`, `pretraining_samples_seen`). Every problem is a `CompareError`
with a one-line message naming the file (and line).
"""

from __future__ import annotations

import fnmatch
import glob
import gzip
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from data.config import REPO_ROOT

REQUIRED_METRICS = ("samples_seen", "mlm_loss")
GLOB_CHARACTERS = set("*?[")
NON_FINITE = ("nan", "inf", "-inf", "infinity", "-infinity")


class CompareError(Exception):
    """A bad input of the comparison step (one line: file, line, config key)."""


@dataclass
class FinetuneResult:
    """One fine-tune of one checkpoint on one task: the main metric per fine-tune seed."""

    task: str
    metric: str  # the main metric's key, e.g. f1, exact_match, dev_matched_accuracy
    samples_seen: int | None  # the checkpoint's pretraining samples (None: unknown)
    scores: dict[str, float]  # fine-tune seed -> main metric
    checkpoint: str | None = None
    source: str = ""
    recipe: str = ""  # its hyperparameters when recorded, e.g. "lr 0.001, epochs 1, length 32, batch 32"


@dataclass
class Run:
    """One pretraining run: its identity (optimizer, batch, seed) and logged records."""

    name: str
    source: str  # the folder, or the W&B run path
    optimizer: str
    batch_name: str
    global_batch: int  # phase 1's global batch (sequences per optimizer step)
    records: list[dict[str, float]]  # sorted by step, one per step
    seed: int | None = None
    model: str | None = None
    freeze_step: int | None = None
    phases: list[tuple[int, int]] = field(default_factory=list)  # (global batch, steps) per phase
    command: str | None = None
    config_note: str | None = None  # set when the config was inferred rather than read
    wall_seconds: float | None = None  # W&B's run time, when known
    finetunes: list[FinetuneResult] = field(default_factory=list)
    variant: str = ""  # what differs from the optimizer's preset, e.g. "variance_refresh=0" (`_identity`)
    workers: int | None = None  # data-parallel workers (processes x simulated workers per process)
    simulated: bool = False  # some of the workers were simulated (sim_world_size > 1)
    finetune_notes: list[str] = field(default_factory=list)  # e.g. one checkpoint fine-tuned with two recipes

    @property
    def arm(self) -> str:
        """The preset, what the run changed against it and the workers, e.g. `onebit_lamb[a=b] n32 sim`."""
        label = self.optimizer + (f"[{self.variant}]" if self.variant else "")
        if self.workers is not None:
            label += f" n{self.workers}" + (" sim" if self.simulated else "")
        return label

    @property
    def group_key(self) -> tuple[str, str, int, str]:
        """Runs that differ only by seed share this key."""
        return (self.arm, self.batch_name, self.global_batch, self.model or "")


# -- local run folders -----------------------------------------------------------------------------------
def resolve_run_folders(patterns: Iterable[str], root: Path = REPO_ROOT) -> list[Path]:
    """Folders named by `patterns` (paths or globs, relative to `root` or absolute), deduplicated."""
    folders: list[Path] = []
    for pattern in patterns:
        path = Path(pattern).expanduser()
        full = path if path.is_absolute() else root / path
        if GLOB_CHARACTERS & set(pattern):
            matches = sorted(Path(m) for m in glob.glob(str(full)) if Path(m).is_dir())
            if not matches:
                raise CompareError(f"runs: no run folder matches {pattern!r} (looked in {root})")
        else:
            if not full.is_dir():
                raise CompareError(f"runs: {full} is not a folder")
            matches = [full]
        for match in matches:
            if match.resolve() not in {f.resolve() for f in folders}:
                folders.append(match)
    return folders


def load_local_runs(patterns: Iterable[str], root: Path = REPO_ROOT) -> list[Run]:
    folders = resolve_run_folders(patterns, root)
    runs = [load_run_folder(folder) for folder in folders]
    names = [run.name for run in runs]
    for run in runs:
        if names.count(run.name) > 1:  # same folder name under different parents
            run.name = _relative(Path(run.source), root)
    return runs


def load_run_folder(folder: Path) -> Run:
    metrics = folder / "metrics.jsonl"
    if not metrics.is_file() and (folder / "metrics.jsonl.gz").is_file():  # a committed copy, compressed
        metrics = folder / "metrics.jsonl.gz"
    if not metrics.is_file():
        raise CompareError(f"{folder}: no metrics.jsonl (not a pretraining run folder)")
    records = read_metrics(metrics)
    config, note = _read_config(folder, records)
    phases = _get(config, "batch", "phases") or []
    run = Run(
        name=folder.name,
        source=str(folder),
        optimizer=str(config["optimizer"]),
        batch_name=str(config["batch_name"]),
        global_batch=int(config["global_batch"]),
        records=records,
        seed=config.get("seed"),
        model=config.get("model"),
        freeze_step=_first_freeze_step(phases),
        phases=_phase_shapes(phases),
        command=config.get("command"),
        config_note=note,
        variant=config.get("variant", ""),
        workers=config.get("workers"),
        simulated=bool(config.get("simulated", False)),
    )
    run.finetunes = load_finetune_results(folder, notes=run.finetune_notes)
    return run


# 1-bit options as DeepSpeed's algorithm has them: also what a key missing from an older run's config meant
# (the option did not exist yet). `optim=onebit_lamb_deepspeed` is this algorithm.
_DEEPSPEED = {
    "compression": "deepspeed",
    "exact_vectors": False,
    "exact_output_bias": False,
    "precondition": False,
    "local_momentum": False,
    "vector_block": 0,
    "scale_dtype": "float32",
    "sign_scale": "rms",
    "coeff_bias_correction": False,
    "trust_ratio": "frozen",
    "factor_min": 0.5,
    "factor_max": 4.0,
    "block_size": 2048,
    "min_coeff": 0.01,
    "eps": 1e-8,
    "warmup": "deepspeed",
    "max_grad_norm": 1.0,
    "live_vector_variance": False,
    "variance_refresh": 0,
    "refresh_from": "exact",
    "refresh_block": 128,
    "ffn_row_scales": False,  # optim.ffn_row_scales (an ablation; absent from runs before it: off)
}
# `optim=onebit_lamb`: this project's 1-bit LAMB (pretrain/optim/onebit_lamb.py ONEBIT_LAMB_ALGORITHM)
_ONEBIT_LAMB = {
    **_DEEPSPEED,
    "compression": "per_column",
    "exact_vectors": True,
    "precondition": True,
    "scale_dtype": "bfloat16",
    "sign_scale": "mean_abs",
    "trust_ratio": "live",
    "eps": 1e-6,
    "warmup": "nvlamb",
    "live_vector_variance": True,
    "variance_refresh": 64,
    "refresh_from": "rank1",
}
ONEBIT_LAMB_PRESETS = {"onebit_lamb": _ONEBIT_LAMB, "onebit_lamb_deepspeed": _DEEPSPEED}


def _with_deepspeed_defaults(optim: dict[str, Any]) -> dict[str, Any]:
    """A 1-bit run's `optim` config over DeepSpeed's options: a missing key is DeepSpeed's value."""
    return {**_DEEPSPEED, **{k: v for k, v in optim.items() if k in _DEEPSPEED}}


def _deviations(values: dict[str, Any], reference: dict[str, Any]) -> list[str]:
    """The keys where `values` differ from `reference`, as "key" (a flag turned on) or "key=value", leaving
    out keys that do nothing with the other values (e.g. a refresh's source without a refresh)."""
    inert = set()
    if not values["variance_refresh"]:
        inert |= {"refresh_from", "refresh_block"}
    if values["refresh_from"] != "blocks":
        inert.add("refresh_block")
    if values["compression"] != "per_block":
        inert.add("block_size")
    if values["trust_ratio"] != "frozen":
        inert |= {"factor_min", "factor_max"}
    parts = []
    for key, default in reference.items():
        value = values[key]
        if key not in inert and value != default:
            parts.append(key if value is True else f"{key}={str(value).lower() if value is False else value}")
    return parts


def onebit_lamb_identity(optim: dict[str, Any]) -> tuple[str, str]:
    """(optimizer, variant) of a 1-bit LAMB run's `optim` config: the preset it is (`onebit_lamb` or
    `onebit_lamb_deepspeed`) and what differs from it ("" for the preset itself). A preset's config holds
    its tunable keys only; an older run's holds every option, and names the nearer preset."""
    if "compression" not in optim:
        name = str(optim.get("name", "onebit_lamb"))
        reference = ONEBIT_LAMB_PRESETS.get(name, _ONEBIT_LAMB)
        values = {**reference, **{k: v for k, v in optim.items() if k in reference}}
        return name, "+".join(_deviations(values, reference))
    values = _with_deepspeed_defaults(optim)
    if optim.get("eps") is None:  # null: the warmup's default
        values["eps"] = 1e-6 if values["warmup"] == "nvlamb" else 1e-8
    named = [(name, _deviations(values, reference)) for name, reference in ONEBIT_LAMB_PRESETS.items()]
    name, parts = min(named, key=lambda item: len(item[1]))
    return name, "+".join(parts)


def _identity(optim: dict[str, Any]) -> tuple[str | None, str]:
    """(optimizer when the config renames it, variant): e.g. "deepspeed" for LAMB's DeepSpeed variant, the
    1-bit Adam exchange where it is not DeepSpeed's, a 1-bit LAMB run's preset and deviations
    (`onebit_lamb_identity`); "+grad_allreduce=<dtype>" for a 16-bit gradient allreduce."""
    gradients = optim.get("grad_allreduce", "float32")
    averaged = [] if gradients == "float32" else [f"grad_allreduce={gradients}"]  # 16-bit gradient allreduce
    if optim.get("name") in ONEBIT_LAMB_PRESETS:
        name, variant = onebit_lamb_identity(optim)
        return name, "+".join(([variant] if variant else []) + averaged)
    if "compression" not in optim:
        parts = [] if optim.get("variant") in (None, "nvlamb") else [str(optim["variant"])]
        if parts and not optim.get("bias_correction", True):
            parts.append("no_bias_correction")
        return None, "+".join(parts + averaged)
    values = _with_deepspeed_defaults(optim)
    parts = _deviations(values, _DEEPSPEED)
    return None, "+".join(parts + averaged)


def read_metrics(path: Path) -> list[dict[str, float]]:
    """metrics.jsonl (or metrics.jsonl.gz) -> records sorted by step. A resumed run re-logs the steps
    after its last checkpoint: the later record of a step wins. Non-finite values (logged as strings)
    become floats."""
    by_step: dict[int, dict[str, float]] = {}
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as file:
        for line_number, line in enumerate(file, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise CompareError(f"{path}:{line_number}: malformed JSON line ({error.msg})") from None
            if not isinstance(record, dict):
                raise CompareError(f"{path}:{line_number}: expected a JSON object")
            by_step[_step(record, path, line_number)] = _numbers(record, path, line_number)
    if not by_step:
        raise CompareError(f"{path}: no records")
    return [by_step[step] for step in sorted(by_step)]


def _step(record: dict[str, Any], path: Path, line_number: int) -> int:
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        raise CompareError(f"{path}:{line_number}: 'step' missing or not an integer")
    return step


def _numbers(record: dict[str, Any], path: Path, line_number: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in record.items():
        if isinstance(value, bool):
            continue
        # JsonlLogger writes non-finite floats as strings ("nan", "inf")
        if isinstance(value, int | float) or (isinstance(value, str) and value.lower() in NON_FINITE):
            out[key] = float(value)
    for key in REQUIRED_METRICS:
        if key not in out:
            raise CompareError(f"{path}:{line_number}: '{key}' missing or not a number")
    return out


def _read_config(folder: Path, records: list[dict[str, float]]) -> tuple[dict[str, Any], str | None]:
    """The identity of a run: optimizer, batch name, phase-1 global batch, seed, model, phases, command.

    From `<folder>/config.yaml` (written by the trainer); runs from before it existed: inferred from
    the folder name (`<batch>-<optim>-<model>`, `demo-lamb`) and the records (samples per step)."""
    path = folder / "config.yaml"
    if path.is_file():
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
            raise CompareError(f"{where}: malformed YAML") from None
        if not isinstance(raw, dict):
            raise CompareError(f"{path}: expected a mapping")
        renamed, variant = _identity(raw.get("optim") or {})
        optimizer = renamed or raw.get("optimizer") or _get(raw, "optim", "name")
        phases = _get(raw, "batch", "phases") or []
        global_batch = raw.get("global_batch") or (phases[0].get("global_batch") if phases else None)
        if not optimizer or not global_batch:
            raise CompareError(f"{path}: no optimizer (optim.name) or global batch (batch.phases[0])")
        simulated = int(raw.get("sim_world_size") or 1)
        config = {
            "optimizer": optimizer,
            "global_batch": global_batch,
            "batch_name": _get(raw, "batch", "name") or f"b{global_batch}",
            "seed": raw.get("seed"),
            "model": _get(raw, "model", "size"),
            "batch": {"phases": phases},
            "command": raw.get("command"),
            "variant": variant,
            "workers": int(raw["world_size"]) * simulated if raw.get("world_size") else None,
            "simulated": simulated > 1,
        }
        return config, None
    optimizer = _optimizer_from_name(folder.name)
    if optimizer is None:
        raise CompareError(
            f"{folder}: no config.yaml, and the folder name names no optimizer; re-run with the current "
            "trainer or rename the folder <batch>-<optimizer>-<model>"
        )
    first = records[0]
    global_batch = round(first["samples_seen"] / max(first.get("step", 1.0), 1.0))
    batch_name = folder.name.split(f"-{optimizer}")[0] if f"-{optimizer}" in folder.name else ""
    config = {
        "optimizer": optimizer,
        "global_batch": global_batch,
        "batch_name": batch_name or f"b{global_batch}",
        "seed": None,
        "model": None,
        "batch": {"phases": []},
        "command": None,
    }
    return config, "no config.yaml: optimizer and batch inferred from the folder name and samples per step"


def _optimizer_from_name(name: str) -> str | None:
    from pretrain.optim import OPTIMIZERS  # torch: only for folders without config.yaml

    tokens = name.split("-")
    found = [optimizer for optimizer in OPTIMIZERS if optimizer in tokens]
    return max(found, key=len) if found else None


def _get(mapping: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(mapping, Mapping):
            return None
        mapping = mapping.get(key)
    return mapping


def _first_freeze_step(phases: list[dict[str, Any]]) -> int | None:
    values = [p["freeze_step"] for p in phases if isinstance(p, dict) and p.get("freeze_step") is not None]
    return int(values[0]) if values else None


def _phase_shapes(phases: list[dict[str, Any]]) -> list[tuple[int, int]]:
    try:
        return [(int(phase["global_batch"]), int(phase["steps"])) for phase in phases]
    except (KeyError, TypeError, ValueError):
        return []


def display_path(source: str, root: Path) -> str:
    """A local run folder relative to `root` when inside it (reports stay valid in clones); W&B ones as is."""
    path = Path(source)
    return _relative(path, root) if path.is_absolute() else source


def _relative(path: Path, root: Path) -> str:
    try:
        return str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)


# -- fine-tune results -----------------------------------------------------------------------------------
def load_finetune_results(folder: Path, notes: list[str] | None = None) -> list[FinetuneResult]:
    """Every `<folder>/finetune/**/all_results.json` (old layout `<task>/`, new `<checkpoint>/<task>/`).
    Several files for one (task, checkpoint samples): the newest file's recipe (LR, epochs, length, batch)
    is reported, with the fine-tune seeds of every file of that recipe (one file per seed, as the rungs'
    fine-tunes write them; a seed in two files: the newer file's score). When other files used another
    recipe, a line saying which one is reported goes to `notes`, since the report would otherwise mix
    recipes without a word."""
    found: dict[tuple[str, int | None], list[tuple[float, FinetuneResult]]] = {}
    for path in sorted((folder / "finetune").rglob("all_results.json")):
        result = read_finetune_result(path)
        found.setdefault((result.task, result.samples_seen), []).append((path.stat().st_mtime, result))
    chosen = []
    for candidates in found.values():
        # oldest to newest; on equal times in path order (the last is the newest, as before)
        order = sorted(range(len(candidates)), key=lambda i: (candidates[i][0], i))
        result = candidates[order[-1]][1]
        scores: dict[str, float] = {}
        for i in order:
            if candidates[i][1].recipe == result.recipe:
                scores.update(candidates[i][1].scores)
        result = replace(result, scores=scores)
        chosen.append(result)
        others = [other for _, other in candidates if other.recipe != result.recipe]
        if others and notes is not None:
            left_out = "; ".join(f"{o.source} ({o.recipe or 'recipe not recorded'})" for o in others)
            notes.append(
                f"{result.task} fine-tuned from one checkpoint with different recipes: reported "
                f"{result.source} ({result.recipe or 'recipe not recorded'}), not {left_out}"
            )
    return chosen


def _recipe(payload: dict[str, Any]) -> str:
    """The fine-tune's hyperparameters from its `config.task` (finetune/runner.py), or "" when absent."""
    config = payload.get("config")
    task = config.get("task") if isinstance(config, dict) else None
    if not isinstance(task, dict):
        return ""
    labels = {"lr": "lr", "epochs": "epochs", "max_length": "length", "batch_size": "batch"}
    parts = [
        f"{label} {task[key]:g}" if isinstance(task[key], float) else f"{label} {task[key]}"
        for key, label in labels.items()
        if key in task
    ]
    return ", ".join(parts)


def read_finetune_result(path: Path) -> FinetuneResult:
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise CompareError(f"{path}:{error.lineno}: malformed JSON ({error.msg})") from None
    if not isinstance(payload, dict):
        raise CompareError(f"{path}: expected a JSON object")
    for key in ("task", "per_seed"):
        if key not in payload:
            raise CompareError(f"{path}: no '{key}' key")
    metric = payload.get("main_metric_key") or payload.get("main_metric")
    if not metric:
        raise CompareError(f"{path}: no 'main_metric_key' key")
    per_seed = payload["per_seed"]
    if not isinstance(per_seed, dict) or not per_seed:
        raise CompareError(f"{path}: 'per_seed' is empty or not an object")
    scores: dict[str, float] = {}
    for seed, metrics in per_seed.items():
        value = metrics.get(metric) if isinstance(metrics, dict) else None
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise CompareError(f"{path}: per_seed.{seed}.{metric} missing or not a number")
        scores[str(seed)] = float(value)
    samples = payload.get("pretraining_samples_seen")
    return FinetuneResult(
        task=str(payload["task"]),
        metric=str(metric),
        samples_seen=int(samples) if isinstance(samples, int | float) and math.isfinite(samples) else None,
        scores=scores,
        checkpoint=payload.get("checkpoint"),
        source=str(path),
        recipe=_recipe(payload),
    )


# -- W&B runs --------------------------------------------------------------------------------------------
def load_wandb_runs(
    project: str,
    entity: str | None,
    group: str | None,
    patterns: list[str],
    api: Any = None,
) -> list[Run]:
    """Pretraining runs (job_type "pretrain") of `entity/project` (and `group`) whose name matches one
    of `patterns` (all when empty), with their fine-tune runs (job_type "finetune", joined by the
    pretraining run name in their config's `run_name`). `api`: a `wandb.Api()` (made when None)."""
    if api is None:
        import wandb

        try:
            api = wandb.Api(timeout=60)
        except Exception as error:  # no API key, no network: one line
            raise CompareError(f"wandb.source=wandb: cannot reach W&B ({error})") from None
    path = f"{entity}/{project}" if entity else project
    filters = {"group": group} if group else {}
    try:
        every = list(api.runs(path, filters=filters))
    except Exception as error:
        raise CompareError(f"wandb.project={path}: cannot list runs ({error})") from None
    pretrain = [r for r in every if getattr(r, "job_type", None) == "pretrain" and _matches(r.name, patterns)]
    if not pretrain:
        raise CompareError(f"wandb: no pretraining run in {path} (group={group}) matches runs={patterns}")
    finetunes = _wandb_finetunes([r for r in every if getattr(r, "job_type", None) == "finetune"])
    runs = [_wandb_run(run, path) for run in pretrain]
    for run in runs:
        run.finetunes = finetunes.get(run.name, [])
    return runs


def _matches(name: str, patterns: list[str]) -> bool:
    return not patterns or any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def _wandb_run(run: Any, path: str) -> Run:
    config = dict(run.config)
    source = f"wandb:{path}/{run.id}"
    records: dict[int, dict[str, float]] = {}
    for row in run.scan_history():
        if all(isinstance(row.get(k), int | float) for k in REQUIRED_METRICS):
            step = int(row.get("_step", row.get("step", len(records))))
            records[step] = {
                k: float(v) for k, v in row.items() if isinstance(v, int | float) and not isinstance(v, bool)
            }
            records[step]["step"] = float(step)
    if not records:
        raise CompareError(f"{source} ({run.name}): no history rows with {', '.join(REQUIRED_METRICS)}")
    phases = _get(config, "batch", "phases") or []
    optimizer = config.get("optimizer") or _get(config, "optim", "name")
    global_batch = config.get("global_batch") or (phases[0].get("global_batch") if phases else None)
    if not optimizer or not global_batch:
        raise CompareError(f"{source} ({run.name}): config has no optimizer or global_batch")
    runtime = (run.summary or {}).get("_runtime")
    return Run(
        name=run.name,
        source=source,
        optimizer=str(optimizer),
        batch_name=str(_get(config, "batch", "name") or f"b{global_batch}"),
        global_batch=int(global_batch),
        records=[records[s] for s in sorted(records)],
        seed=config.get("seed"),
        model=_get(config, "model", "size"),
        freeze_step=_first_freeze_step(phases),
        phases=_phase_shapes(phases),
        command=config.get("command"),
        wall_seconds=float(runtime) if isinstance(runtime, int | float) else None,
    )


def main_metric_key(task: str) -> str:
    """A fine-tune's logged main metric (finetune/runner.py): eval/<metric>, or eval/<first split>_<metric>
    for tasks with several eval splits (MNLI)."""
    from finetune.tasks import TASKS

    spec = TASKS[task]
    metric = spec.main_metric if len(spec.eval_splits) == 1 else f"{spec.eval_splits[0]}_{spec.main_metric}"
    return f"eval/{metric}"


def _wandb_finetunes(runs: list[Any]) -> dict[str, list[FinetuneResult]]:
    """Fine-tune W&B runs (one per seed) -> {pretraining run name: results per (task, samples)}."""
    from finetune.tasks import TASKS

    grouped: dict[tuple[str, str, int | None], FinetuneResult] = {}
    for run in runs:
        config = dict(run.config)
        task = _get(config, "task", "name")
        pretraining_run = config.get("pretraining_run") or config.get("run_name")
        if task not in TASKS or not pretraining_run:
            continue
        summary = dict(run.summary or {})
        key = main_metric_key(task)
        if not isinstance(summary.get(key), int | float):
            continue
        samples = config.get("pretraining_samples_seen")
        samples = int(samples) if isinstance(samples, int | float) else None
        result = grouped.setdefault(
            (pretraining_run, task, samples),
            FinetuneResult(task=task, metric=key.removeprefix("eval/"), samples_seen=samples, scores={}),
        )
        result.scores[str(config.get("seed", run.id))] = float(summary[key])
        result.source = f"wandb:{run.id}"
    by_run: dict[str, list[FinetuneResult]] = {}
    for (pretraining_run, _, _), result in grouped.items():
        by_run.setdefault(pretraining_run, []).append(result)
    return by_run
