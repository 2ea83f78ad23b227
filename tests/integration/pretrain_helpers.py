"""Run the pretraining trainer inside `launch.local.run_local` workers and report what tests compare."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from data.config import REPO_ROOT


def tiny_run_overrides(data: Path, run_dir: Path, optim: str, *extra: str) -> list[str]:
    """The demo recipe (both phases, crossing freeze_step) on the tiny BERT, quiet, in-process data loading,
    no HF export: the base of the trainer tests' runs; `extra` overrides come last."""
    return [
        "batch=demo",
        f"optim={optim}",
        "model=bert_tiny",
        f"data_dir={data}",
        f"run_dir={run_dir}",
        "wandb.mode=disabled",
        "num_workers=0",
        "log_every=1",
        "show_progress=false",
        "checkpoint.export_hf=false",
        *extra,
    ]


def compose_train_config(overrides: list[str]):
    from pretrain.config import to_object

    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        return to_object(compose(config_name="pretrain", overrides=overrides))


def parameter_digest(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def train_worker(rank: int, world_size: int, overrides: list[str]) -> dict:
    """fn for run_local: train with `overrides`; -> digest of the parameters, the final state and whether
    the trainer kept freed host memory in this process (pretrain/train/host_memory.py)."""
    from dataclasses import asdict

    from pretrain.distributed.process_group import init_distributed
    from pretrain.train import host_memory
    from pretrain.train.trainer import Trainer

    cfg = compose_train_config(overrides)
    trainer = Trainer(cfg, init_distributed())
    state = trainer.fit()
    return {
        "digest": parameter_digest(trainer.model),
        "state": asdict(state),
        "kept_host_memory": host_memory.kept(),
    }


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
