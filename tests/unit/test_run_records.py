"""pretrain/train/run_records.py: the run's config names the machine it ran on (its CPU, its GPU on CUDA),
so that two runs of one seed whose floats differ can be told apart by where they ran."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml
from hydra import compose, initialize_config_dir

import pretrain.config
from data.config import REPO_ROOT
from pretrain.distributed.process_group import DistributedEnv
from pretrain.observability import machine
from pretrain.train.run_records import RunRecords


def test_config_yaml_names_the_cpu_and_no_gpu_on_the_cpu(tmp_path: Path, monkeypatch):
    monkeypatch.setattr("pretrain.train.run_records.cpu_model", lambda: "Test CPU 9000")
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        composed = compose(config_name="pretrain", overrides=[f"run_dir={tmp_path}", "wandb.mode=disabled"])
    cfg = pretrain.config.to_object(composed)
    env = DistributedEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    RunRecords(cfg, env, compressed_exchange=False).logger().close()
    config = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert config["cpu_model"] == "Test CPU 9000"
    assert config["gpu_model"] is None


def test_cpu_model_reads_proc_cpuinfo():
    model = machine.cpu_model()
    with open("/proc/cpuinfo") as f:
        names = {line.split(":", 1)[1].strip() for line in f if line.startswith("model name")}
    assert model in names
