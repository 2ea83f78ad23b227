"""Trainer overhead: `Trainer.train_step` vs a bare loop over the same model, data and optimizer.

The bare loop fetches the same micro-batches, runs the same objective forward/backward and
optimizer step, and nothing else (no DDP wrapper and hook, no loss scaler, no counters, no metrics).
Both run in one process (a gloo world of one), alternating blocks of steps so drift hits both.
Records (results/bench/trainer.json): trainer samples/s with the bare loop as the peer (target: the
trainer within 5%, ratio >= 0.95), for bert_tiny and bert_base at seq 128.

    python -m bench trainer [--quick]
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.records import Record, results_name, write_records
from data.config import REPO_ROOT
from data.prepare import prepare_in_subprocess


def _measure(
    model: str, data: Path, run_dir: Path, micro_batch: int, blocks: int, steps_per_block: int
) -> Record:
    from hydra import compose, initialize_config_dir

    from pretrain.config import to_object
    from pretrain.distributed.process_group import init_distributed
    from pretrain.model import PretrainingObjective
    from pretrain.train.trainer import Trainer

    overrides = [
        "batch=demo",
        "optim=lamb",
        f"model={model}",
        f"data_dir={data}",
        f"run_dir={run_dir}",
        "wandb.mode=disabled",
        "num_workers=0",
        "log_every=10",
        "show_progress=false",
        f"batch.phases.0.global_batch={micro_batch}",
        f"batch.phases.0.micro_batch={micro_batch}",
        "batch.phases.0.steps=100000",
    ]
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        cfg = to_object(compose(config_name="pretrain", overrides=overrides))
    trainer = Trainer(cfg, init_distributed())
    phase = trainer._enter_phase(0)
    objective = PretrainingObjective(trainer.model)

    def bare_step() -> None:
        for batch in trainer.data.next_step(1):
            mlm, nsp, _, _ = objective(**batch)
            (mlm + nsp).backward()
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)

    def timed(step) -> float:
        started = time.perf_counter()
        for _ in range(steps_per_block):
            step()
        return (time.perf_counter() - started) / steps_per_block

    for _ in range(2):  # warm-up both paths
        bare_step()
        trainer.train_step(phase)
    trainer_times, bare_times = [], []
    for _ in range(blocks):
        trainer_times.append(timed(lambda: trainer.train_step(phase)))
        bare_times.append(timed(bare_step))
    trainer_rate = micro_batch / statistics.median(trainer_times)
    bare_rate = micro_batch / statistics.median(bare_times)
    return Record(
        f"trainer_samples_per_s_{model}",
        trainer_rate,
        "samples/s",
        peer="bare loop (same model, data, optimizer)",
        peer_value=bare_rate,
        target="ratio >= 0.95 (overhead <= 5%)",
        config={
            "model": model,
            "seq": 128,
            "micro_batch": micro_batch,
            "optimizer": "lamb",
            "world_size": 1,
            "blocks": blocks,
            "steps_per_block": steps_per_block,
            "threads": torch.get_num_threads(),
        },
    )


def main(argv: list[str]) -> None:
    quick = "--quick" in argv
    os.environ.setdefault("WANDB_MODE", "disabled")
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "tiny"
        prepare_in_subprocess(data, "data=tiny")
        records.append(
            _measure("bert_tiny", data, Path(tmp) / "tiny_run", 16, 3 if quick else 5, 5 if quick else 10)
        )
        if not quick:
            records.append(_measure("bert_base", data, Path(tmp) / "base_run", 8, 3, 3))
    write_records(results_name("trainer", quick), records)


if __name__ == "__main__":
    main(sys.argv[1:])
