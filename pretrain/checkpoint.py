"""Atomic, keep-last-K checkpoints with fixed keys, loadable without pickle of user data.

Layout of one checkpoint (`<run>/checkpoints/step-00000100/`):
    model.safetensors            model weights (main rank)
    rank-00000.pt ...            per rank: {"optimizer", "rng"} (1-bit error buffers are per rank)
    train_state.pt               {"lr_scheduler", "grad_scaler", "dataloader", "train_state"} (main rank)
    hf/                          `save_pretrained` export (safetensors + tokenizer), loads with
                                 transformers.AutoModelForPreTraining as is
    COMPLETE                     written last; a folder without it is never resumed from

Every rank writes into `step-N.tmp/`, a barrier, then the main rank writes COMPLETE and renames the
folder: a kill at any point leaves either the previous checkpoint or a `.tmp` folder that is ignored
(and removed by the next save). Loading uses safetensors and `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_model, save_model
from torch import nn

STEP_DIR = re.compile(r"^step-(\d{8})$")


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": _numpy_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _numpy_state() -> dict[str, Any]:
    # as tensors and numbers, so weights_only loading accepts it
    _, key, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)  # type: ignore[misc]
    return {
        "key": torch.from_numpy(np.asarray(key, dtype=np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached_gaussian),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            numpy_state["key"].numpy().astype(np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if STEP_DIR.match(p.name) and (p / "COMPLETE").is_file()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))  # type: ignore[union-attr]


def latest_checkpoint(directory: str | Path) -> Path | None:
    found = list_checkpoints(directory)
    return found[-1] if found else None


def save_checkpoint(
    directory: str | Path,
    step: int,
    *,
    rank: int,
    model: nn.Module | None,
    rank_state: dict[str, Any],
    shared_state: dict[str, Any] | None,
    export_hf: Callable[[Path], None] | None = None,
    keep_last: int = 3,
) -> Path:
    """Collective: every rank calls it. `model`, `shared_state` and `export_hf` matter on rank 0."""
    directory = Path(directory)
    final = directory / f"step-{step:08d}"
    tmp = directory / f"step-{step:08d}.tmp"
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier()
    torch.save(rank_state, tmp / f"rank-{rank:05d}.pt")
    if rank == 0:
        assert model is not None and shared_state is not None
        save_model(model, str(tmp / "model.safetensors"))  # handles BERT's tied decoder weights
        torch.save(shared_state, tmp / "train_state.pt")
        if export_hf is not None:
            export_hf(tmp / "hf")
    _barrier()
    if rank == 0:
        _fsync_tree(tmp)
        (tmp / "COMPLETE").write_text(f"{step}\n")
        if final.exists():  # re-saving the same step (e.g. final save right after a periodic one)
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(directory)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        for stale in directory.glob("step-*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
    _barrier()
    return final


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: the message names the folder or file."""


def load_checkpoint(path: str | Path, rank: int, model: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load the weights into `model`; -> (rank_state, shared_state). Errors name the folder or file."""
    path = Path(path)
    if not (path / "COMPLETE").is_file():
        raise CheckpointError(f"{path}: not a complete checkpoint (no COMPLETE marker)")
    rank_file = path / f"rank-{rank:05d}.pt"
    if not rank_file.is_file():
        raise CheckpointError(f"{rank_file}: missing (was the checkpoint written with fewer ranks?)")
    try:
        missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=False)
        if missing or unexpected:
            raise CheckpointError(
                f"{path / 'model.safetensors'}: does not match the model (missing {list(missing)[:3]}, "
                f"unexpected {list(unexpected)[:3]}): another model size?"
            )
        rank_state = torch.load(rank_file, map_location="cpu", weights_only=True)
        shared_state = torch.load(path / "train_state.pt", map_location="cpu", weights_only=True)
    except CheckpointError:
        raise
    except Exception as error:  # corrupt or mismatched files: name them, one line
        message = str(error).splitlines()[0] if str(error) else ""
        raise CheckpointError(f"{path}: cannot load checkpoint ({type(error).__name__}: {message})") from None
    return rank_state, shared_state
