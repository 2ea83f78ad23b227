"""The trainer's checkpoints: what it writes under which key, where a resume starts, the HF export.

Fixed keys (pretrain/checkpoint.py writes the files): the model; per rank the optimizer's own state (the
1-bit error feedback, local momenta), the RNG streams and the simulated workers'; once, the optimizer's
replicated state (moments: the same on every rank); shared, the train counters (`train_state`), the
phase's `lr_scheduler`, the `dataloader` cursor, the `grad_scaler`, the world size and the optimizer's
options (a resume names what changed).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

from pretrain import checkpoint as ckpt
from pretrain.config import CheckpointConfig
from pretrain.distributed.faults import FaultInjector
from pretrain.optim.base import split_replicated
from pretrain.optim.config import OptimizerConfig
from pretrain.train.precision import NoScaler
from pretrain.train.simulated import SimulatedRanks
from pretrain.train.step_metrics import TrainState

log = logging.getLogger("pretrain")


class HfExport:
    """Writes a checkpoint's `hf/` folder: the model and tokenizer as `from_pretrained` reads them, and
    `pretraining_state.json` (the counters plus `run_info`: what fine-tunes read of the run)."""

    def __init__(self, model: Any, tokenizer: Any, run_info: dict[str, Any]):
        self.model, self.tokenizer, self.run_info = model, tokenizer, run_info

    def __call__(self, folder: Path, state: TrainState) -> None:
        transformers.utils.logging.disable_progress_bar()
        self.model.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)
        (folder / "pretraining_state.json").write_text(
            json.dumps({**asdict(state), **self.run_info}, indent=1)
        )


class Checkpointer:
    """Save and restore everything with state (module docstring). Collective: every rank calls `save`
    and `load` together. `resume`: `auto` (the newest complete checkpoint under `directory`), `none`,
    or a checkpoint folder."""

    def __init__(
        self,
        directory: Path,
        config: CheckpointConfig,
        *,
        resume: str,
        rank: int,
        world_size: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        optim_config: OptimizerConfig,
        scaler: NoScaler,
        simulated: SimulatedRanks | None,
        faults: FaultInjector,
        hf_export: HfExport | None,
    ):
        self.directory, self.config, self.resume = directory, config, resume
        self.rank, self.world_size = rank, world_size
        self.model, self.optimizer, self.optim_config = model, optimizer, optim_config
        self.scaler, self.simulated, self.faults, self.hf_export = scaler, simulated, faults, hf_export

    def resume_path(self) -> Path | None:
        if self.resume == "none":
            return None
        if self.resume == "auto":
            return ckpt.latest_checkpoint(self.directory)
        path = Path(self.resume)
        if not path.is_dir():
            raise ckpt.CheckpointError(f"resume: {path} is not a checkpoint folder")
        return path

    def save(self, state: TrainState, scheduler: Any, data: Any, periodic: bool = False) -> Path | None:
        """Write a checkpoint of step `state.global_step`. A periodic one that fails (full disk) with
        checkpoint.on_error=continue is skipped with a warning (-> None); any other failure raises."""
        try:
            return self._save(state, scheduler, data)
        except ckpt.CheckpointSaveError as error:
            if not (periodic and self.config.on_error == "continue"):
                raise
            log.warning("%s; training goes on (checkpoint.on_error=continue)", error)
            return None

    def _save(self, state: TrainState, scheduler: Any, data: Any) -> Path:
        shared = {
            "train_state": asdict(state),
            "lr_scheduler": scheduler.state_dict() if scheduler else None,
            "dataloader": data.state_dict() if data else None,
            "grad_scaler": self.scaler.state_dict(),
            "world_size": self.world_size,
            "optim_options": self.optim_config.options(),  # a resume names what changed (`load`)
        }
        replicated, own = split_replicated(self.optimizer.state_dict())  # m, v: written once, by rank 0
        rank_state = {"optimizer": own, "rng": ckpt.rng_state()}
        if self.simulated is not None:
            rank_state["simulated"] = self.simulated.state_dict()
        step = state.global_step
        hf_export = self.hf_export if self.config.export_hf else None
        path = ckpt.save_checkpoint(
            self.directory,
            step,
            rank=self.rank,
            model=self.model,
            rank_state=rank_state,
            shared_state=shared,
            replicated_state={"optimizer": replicated},
            export_hf=(lambda folder: hf_export(folder, state)) if hf_export is not None else None,
            keep_last=self.config.keep_last,
            before_commit=lambda: self.faults.at("checkpoint_write", step),
        )
        self.faults.at("after_checkpoint", step)
        return path

    def load(self, path: Path) -> tuple[TrainState, dict[str, Any]]:
        """Restore the model, optimizer, RNG streams and loss scale; -> (the counters, the shared state
        whose phase parts `restore_phase` takes once the phase is entered)."""
        rank_state, shared = ckpt.load_checkpoint(path, self.rank, self.model, self.world_size)
        try:
            self.optimizer.load_state_dict(rank_state["optimizer"])
        except (ValueError, KeyError) as error:
            raise ckpt.CheckpointError(
                f"{path}: optimizer state does not fit optim={self.optim_config.name} ({error})"
            ) from None
        state = TrainState(**shared["train_state"])
        changed = self.optim_config.changed_options(shared.get("optim_options"))
        if changed:  # e.g. a 1-bit LAMB checkpoint of an older default: its rules switch mid-run
            log.warning(
                "resume: optim options differ from the checkpoint's (%s); the run goes on with the new ones",
                ", ".join(changed),
            )
        if int(shared.get("world_size", self.world_size)) == self.world_size:
            ckpt.set_rng_state(rank_state["rng"])
            restored = self.simulated is None or self.simulated.load_state_dict(
                rank_state.get("simulated", {})
            )
            if not restored:
                log.warning("resume: the simulated workers changed; their RNG streams restart")
        else:
            log.warning(
                "resume: world size changed (%s -> %s): every rank takes rank 0's optimizer state, the "
                "data order is re-split exactly, RNG streams restart",
                shared["world_size"],
                self.world_size,
            )
        self.scaler.load_state_dict(shared["grad_scaler"])
        log.info("resumed from %s at step %d (phase %d)", path, state.global_step, state.phase_index + 1)
        return state, shared

    def restore_phase(self, shared: dict[str, Any], state: TrainState, scheduler: Any, data: Any) -> None:
        """Mid-phase resume: the scheduler (and the LRs it set), the data cursor."""
        if shared.get("lr_scheduler") is None or state.step_in_phase == 0:
            return
        scheduler.load_state_dict(shared["lr_scheduler"])
        for group, lr in zip(self.optimizer.param_groups, scheduler.get_last_lr()):
            group["lr"] = lr
        data.load_state_dict(shared["dataloader"])
