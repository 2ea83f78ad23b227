"""What a pretraining run writes about itself into its run folder, from the main rank: `config.yaml`
(the resolved config, secrets redacted), the metrics loggers (`metrics.jsonl`, console, optional W&B),
`summary.json` at the end; and a dry run's description of the phases."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from data.shards import load_manifest
from pretrain.comm.kernels import describe_kernels
from pretrain.config import TrainConfig
from pretrain.distributed.process_group import DistributedEnv
from pretrain.observability.machine import cpu_model, gpu_model
from pretrain.observability.metrics import (
    ConsoleLogger,
    FanoutLogger,
    JsonlLogger,
    MetricsLogger,
    NullLogger,
    WandbLogger,
    scrub_secrets,
)
from pretrain.train.phase_data import phase_folder
from pretrain.train.step_metrics import TrainState


class RunRecords:
    """`compressed_exchange`: whether the optimizer exchanges compressed momenta (the run's config then
    names the compression kernels this device runs)."""

    def __init__(self, cfg: TrainConfig, env: DistributedEnv, *, compressed_exchange: bool):
        self.cfg, self.env, self.compressed_exchange = cfg, env, compressed_exchange
        self.run_dir = Path(cfg.run_dir)

    def run_config(self) -> dict[str, Any]:
        """The resolved config, secrets redacted, plus flat keys to group runs by (W&B cannot group by a
        list element such as batch.phases[0].global_batch); also written to <run_dir>/config.yaml."""
        cfg = self.cfg
        config = dict(OmegaConf.to_container(OmegaConf.structured(cfg)))  # type: ignore[arg-type]
        config.update(
            optimizer=cfg.optim.name,
            global_batch=cfg.batch.phases[0].global_batch,
            world_size=self.env.world_size,
            # what the compressed allreduce runs on this device (numba, compiled, or torch ops + a packer)
            comm_kernels=describe_kernels(self.env.device) if self.compressed_exchange else None,
            # the machine of this start (a resume rewrites it): its floats set which realization a seed gives
            cpu_model=cpu_model(),
            gpu_model=gpu_model(self.env.device),
            # the overrides this process was started with (None when not started as `python -m pretrain`)
            command=" ".join(["python -m pretrain", *sys.argv[1:]]) if _started_as_pretrain() else None,
        )
        return scrub_secrets(config)

    def logger(self) -> MetricsLogger:
        """The main rank's loggers (after writing config.yaml); a `NullLogger` on the others."""
        if not self.env.is_main:
            return NullLogger()
        run_config = self.run_config()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.run_dir / f".config.yaml.tmp-{os.getpid()}"
        tmp.write_text(OmegaConf.to_yaml(run_config))
        os.replace(tmp, self.run_dir / "config.yaml")
        loggers: list[MetricsLogger] = [JsonlLogger(self.run_dir / "metrics.jsonl"), ConsoleLogger()]
        cfg, wandb = self.cfg, self.cfg.wandb
        if wandb.mode.value != "disabled":
            loggers.append(
                WandbLogger(
                    project=wandb.project,
                    group=wandb.group or cfg.batch.name,
                    name=cfg.run_name,
                    tags=[*wandb.tags, cfg.optim.name, cfg.batch.name, cfg.model.size.value],
                    mode=wandb.mode.value,
                    config=run_config,
                    directory=self.run_dir,
                )
            )
        return FanoutLogger(*loggers)

    def hf_run_info(self) -> dict[str, Any]:
        """What fine-tunes read of the run from a checkpoint's HF export: its name, its W&B group (to join
        its curves; as `logger` sets it) and what the dashboard groups fine-tunes by (as `run_config`)."""
        cfg = self.cfg
        return {
            "run_name": cfg.run_name,
            "wandb_group": scrub_secrets(cfg.wandb.group or cfg.batch.name),
            "optimizer": cfg.optim.name,
            "global_batch": cfg.batch.phases[0].global_batch,
        }

    def write_summary(self, state: TrainState) -> None:
        if self.env.is_main:
            summary = {"run_name": self.cfg.run_name, **asdict(state)}
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))

    def describe_dry_run(self, num_params: int, workers: int) -> None:
        """Print the model, the optimizer and each phase's batch arithmetic (main rank)."""
        if not self.env.is_main:
            return
        cfg, env = self.cfg, self.env
        print(
            f"dry run: {cfg.model.size.value} with {num_params / 1e6:.1f}M parameters, "
            f"optim={cfg.optim.name}, world size {env.world_size}, {env.backend}"
            + (f", {workers} workers ({cfg.sim_world_size} per process)" if cfg.sim_world_size > 1 else "")
        )
        world_sizes = [workers]
        if cfg.dry_run_world_size and cfg.dry_run_world_size != workers:
            world_sizes.append(cfg.dry_run_world_size)
        for phase in cfg.batch.phases:
            folder = phase_folder(cfg.data_dir, phase.max_seq_length)
            instances = load_manifest(folder)["num_instances"]
            for world in world_sizes:
                accumulation = phase.accumulation_steps(world)
                print(
                    f"  {phase.name}: seq {phase.max_seq_length}, global batch {phase.global_batch} = "
                    f"{world} x {phase.micro_batch} x {accumulation} accumulation, {phase.steps} steps, "
                    f"lr {phase.lr}, data {instances} instances in {folder}"
                )


def _started_as_pretrain() -> bool:
    main = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path()
    return main.name == "__main__.py" and main.parent.name == "pretrain"
