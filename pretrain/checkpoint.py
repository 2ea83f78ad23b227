"""Atomic, keep-last-K checkpoints with fixed keys, loadable without pickle of user data.

Layout of one checkpoint (`<run>/checkpoints/step-00000100/`):
    model.safetensors            model weights (main rank)
    replicated.pt                state every rank holds the same copy of (the optimizer's moments and
                                 parameter groups), written once by the main rank
    rank-00000.pt ...            per rank: what is this rank's own ({"optimizer": the 1-bit error
                                 feedback and counters}, "rng"); loading merges replicated.pt into it
    train_state.pt               {"lr_scheduler", "grad_scaler", "dataloader", "train_state"} (main rank)
    hf/                          `save_pretrained` export (safetensors + tokenizer), loads with
                                 transformers.AutoModelForPreTraining as is
    checksums.json               {"sha256": {file: digest}} of the files above except hf/
    COMPLETE                     written last; a folder without it is never resumed from

Every rank writes into `step-N.tmp/` (and the sha256 of its file beside it), a barrier, then the main
rank writes checksums.json and COMPLETE and renames the folder: a kill at any point leaves either the
previous checkpoint or a `.tmp` folder that is ignored (and removed by the next save). Re-saving a step
moves the old folder to `step-N.replaced/` until the new one is in place, and that folder counts while
`step-N/` is missing, so no kill point loses the step. Loading checks the checksums (a flipped bit in a
tensor would otherwise load silently) and uses safetensors and `torch.load(weights_only=True)` only.

Why the split: the moments m, v are identical on every data-parallel rank, so writing them from every
rank made a checkpoint grow with the world size (BERT-Large, 1-bit LAMB, 8 ranks: 42.6 GiB, of which
7 × 3.8 GiB were copies of rank 0's m, v and fresh v; 16.3 GiB now). Checkpoints written before
`replicated.pt` existed (every rank file holding the whole optimizer state) still load.
"""

from __future__ import annotations

import hashlib
import json
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
from safetensors import SafetensorError
from safetensors.torch import load_model, save_model
from torch import nn

# what a failed write raises: torch.save reports a full disk as RuntimeError, safetensors as SafetensorError
# ("I/O error: No space left on device (os error 28)"), neither an OSError
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)

STEP_DIR = re.compile(r"^step-(\d{8})(\.replaced)?$")
CHECKSUMS = "checksums.json"
REPLICATED = "replicated.pt"


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
    """Complete checkpoints, oldest first; `step-N.replaced/` only where `step-N/` is missing."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found: dict[int, Path] = {}
    for path in directory.iterdir():
        match = STEP_DIR.match(path.name)
        if match and (path / "COMPLETE").is_file():
            step = int(match.group(1))
            if step not in found or match.group(2) is None:
                found[step] = path
    return [found[step] for step in sorted(found)]


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
    replicated_state: dict[str, Any] | None = None,
    export_hf: Callable[[Path], None] | None = None,
    keep_last: int = 3,
    before_commit: Callable[[], None] | None = None,
) -> Path:
    """Collective: every rank calls it. `model`, `shared_state`, `replicated_state` and `export_hf` matter
    on rank 0. `replicated_state` is state that is the same on every rank (nested dicts); `load_checkpoint`
    merges it back into every rank's `rank_state`, whose keys it must not repeat.
    `before_commit` runs on every rank once all files are written, before COMPLETE (fault tests)."""
    directory = Path(directory)
    final = directory / f"step-{step:08d}"
    tmp = directory / f"step-{step:08d}.tmp"
    previous = latest_checkpoint(directory)
    problem = None
    if rank == 0:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            for stale in directory.glob("step-*.tmp"):  # a killed save's leftovers take space too
                shutil.rmtree(stale, ignore_errors=True)
            problem = _space_problem(directory, previous)
            if problem is None:
                tmp.mkdir()
        except OSError as error:
            problem = _os_problem(error, directory, previous, None)
    _agree(final, problem, rank, tmp, previous)
    rank_file = tmp / f"rank-{rank:05d}.pt"
    try:
        torch.save(rank_state, rank_file)
        # each rank hashes its own file (rank 0 alone would read every rank's optimizer state)
        (tmp / f"{rank_file.name}.sha256").write_text(_sha256(rank_file))
        if rank == 0:
            assert model is not None and shared_state is not None
            save_model(model, str(tmp / "model.safetensors"))  # handles BERT's tied decoder weights
            torch.save(shared_state, tmp / "train_state.pt")
            if replicated_state is not None:
                torch.save(replicated_state, tmp / REPLICATED)
            if export_hf is not None:
                export_hf(tmp / "hf")
    except WRITE_ERRORS as error:
        estimate = (
            _state_bytes(rank_state) * _world()
            + _state_bytes(replicated_state)
            + _state_bytes(model) * (2 if export_hf else 1)
        )
        problem = _os_problem(error, directory, previous, estimate)
    _agree(final, problem, rank, tmp, previous)
    if before_commit is not None:
        before_commit()
    if rank == 0:
        _write_checksums(tmp)
        _fsync_tree(tmp)
        (tmp / "COMPLETE").write_text(f"{step}\n")
        displaced = final.with_name(final.name + ".replaced")
        if final.exists():  # re-saving the same step (e.g. final save right after a periodic one)
            if displaced.exists():
                shutil.rmtree(displaced)
            os.replace(final, displaced)  # still found by list_checkpoints until the new one is in place
        os.replace(tmp, final)
        shutil.rmtree(displaced, ignore_errors=True)
        for old in list_checkpoints(directory)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        for stale in directory.glob("step-*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        for stale in directory.glob("step-*.replaced"):  # left by a kill; its step-N is in place now
            if (directory / stale.name.removesuffix(".replaced")).is_dir():
                shutil.rmtree(stale, ignore_errors=True)
    _barrier()
    return final


class CheckpointSaveError(ValueError):
    """A checkpoint could not be written (full disk, I/O error): nothing of it was kept; the message is one
    line naming the folder, the space needed and free, and the newest checkpoint, which is intact."""


def _tree_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def _space_problem(directory: Path, previous: Path | None) -> str | None:
    """Before writing: less free space than the previous checkpoint took (+5 %) is a sure failure."""
    if previous is None:
        return None
    needed, free = int(_tree_bytes(previous) * 1.05), shutil.disk_usage(directory).free
    if free >= needed:
        return None
    return f"{_mib(needed)} needed (the size of {previous.name}), {_mib(free)} free at {directory}"


def _os_problem(error: BaseException, directory: Path, previous: Path | None, estimate: int | None) -> str:
    text = _first_line(error) if isinstance(error, Exception) else str(error)
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        free = None
    if previous is not None:
        needed = f"~{_mib(_tree_bytes(previous))} needed (the size of {previous.name})"
    elif estimate:
        needed = f"~{_mib(estimate)} needed (the state's tensors)"
    else:
        needed = "size unknown"
    space = f"{needed}, {_mib(free)} free" if free is not None else needed
    # torch.save reports ENOSPC as "PytorchStreamWriter failed writing ..." without the errno: a disk left
    # with (almost) nothing free is the cause
    full = (
        getattr(error, "errno", None) == 28 or "No space left" in text or (free is not None and free < 2**20)
    )
    if full:
        return f"disk full at {directory} ({space}; {text[:120]})"
    return f"{text} ({space})"


def _state_bytes(value: Any) -> int:
    """Bytes of the tensors in a state (nested dicts/lists) or a module's parameters and buffers."""
    if isinstance(value, nn.Module):
        return sum(t.numel() * t.element_size() for t in value.state_dict().values())
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_state_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_state_bytes(v) for v in value)
    return 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _mib(count: int) -> str:
    return f"{count / 2**20:.1f} MiB"


def _agree(final: Path, problem: str | None, rank: int, tmp: Path, previous: Path | None) -> None:
    """Collective, in place of a barrier: when any rank failed, rank 0 removes the partial folder and every
    rank raises CheckpointSaveError (so no rank waits in a barrier for one that gave up)."""
    failed, reason = problem is not None, problem
    if dist.is_initialized() and dist.get_world_size() > 1:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
        flag = torch.tensor([float(failed)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        failed = bool(flag.item())
        if failed:  # every rank tells the same first cause
            problems: list[str | None] = [None] * dist.get_world_size()
            dist.all_gather_object(problems, problem)
            first = next(r for r, p in enumerate(problems) if p is not None)
            reason = problems[first] if first == rank else f"rank {first}: {problems[first]}"
    if not failed:
        return
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    kept = f"{previous.name} is intact" if previous is not None else "no earlier checkpoint"
    raise CheckpointSaveError(f"{final}: checkpoint not saved: {reason}; {kept}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_checksums(folder: Path) -> None:
    """checksums.json from the ranks' `*.sha256` files (then removed) and rank 0's shared files."""
    sums = {"model.safetensors": _sha256(folder / "model.safetensors")}
    sums["train_state.pt"] = _sha256(folder / "train_state.pt")
    if (folder / REPLICATED).is_file():
        sums[REPLICATED] = _sha256(folder / REPLICATED)
    for sidecar in sorted(folder.glob("rank-*.pt.sha256")):
        sums[sidecar.name.removesuffix(".sha256")] = sidecar.read_text().strip()
        sidecar.unlink()
    (folder / CHECKSUMS).write_text(json.dumps({"sha256": sums}, indent=1) + "\n")


def _verify(path: Path, names: list[str]) -> None:
    """CheckpointError naming the first of `names` whose sha256 differs from checksums.json. Checkpoints
    written before checksums existed have no checksums.json and are not checked."""
    listing = path / CHECKSUMS
    if not listing.is_file():
        return
    try:
        sums = json.loads(listing.read_text())["sha256"]
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{listing}: unreadable ({type(error).__name__}: {error})") from None
    for name in names:
        if name not in sums:
            raise CheckpointError(f"{listing}: lists no checksum for {name}")
        if _sha256(path / name) != sums[name]:
            raise CheckpointError(f"{path / name}: sha256 differs from {CHECKSUMS} (corrupted file)")


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: the message names the folder or file."""


def load_checkpoint(
    path: str | Path, rank: int, model: nn.Module, world_size: int | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load the weights into `model`; -> (rank_state, shared_state). Errors name the folder or file.

    At another world size than the checkpoint's (`world_size` given), every rank loads rank 0's file:
    the optimizer's moments are the same on every rank; what is per rank (the 1-bit error feedback, the
    RNG streams) cannot be re-split and restarts (the optimizer and the trainer say so)."""
    path = Path(path)
    if not (path / "COMPLETE").is_file():
        raise CheckpointError(f"{path}: not a complete checkpoint (no COMPLETE marker)")
    for name in ("model.safetensors", "train_state.pt"):
        if not (path / name).is_file():
            raise CheckpointError(f"{path / name}: missing")
    _verify(path, ["model.safetensors", "train_state.pt"])
    try:
        shared_state = torch.load(path / "train_state.pt", map_location="cpu", weights_only=True)
    except Exception as error:  # corrupt or mismatched files: name them, one line
        raise CheckpointError(f"{path / 'train_state.pt'}: cannot load ({_first_line(error)})") from None
    saved_world = shared_state.get("world_size") if isinstance(shared_state, dict) else None
    resized = world_size is not None and saved_world is not None and int(saved_world) != world_size
    rank_file = path / f"rank-{0 if resized else rank:05d}.pt"
    if not rank_file.is_file():
        raise CheckpointError(f"{rank_file}: missing (was the checkpoint written with fewer ranks?)")
    _verify(path, [rank_file.name])
    weights = path / "model.safetensors"
    try:
        missing, unexpected = load_model(model, str(weights), strict=False)
    except Exception as error:  # shapes that differ (another model size or vocabulary), a damaged header
        raise CheckpointError(f"{weights}: does not fit the model ({_first_line(error)})") from None
    if missing or unexpected:
        raise CheckpointError(
            f"{weights}: does not match the model (missing {list(missing)[:3]}, "
            f"unexpected {list(unexpected)[:3]}): another model size?"
        )
    try:
        rank_state = torch.load(rank_file, map_location="cpu", weights_only=True)
    except Exception as error:  # corrupt or mismatched files: name them, one line
        raise CheckpointError(f"{path}: cannot load checkpoint ({_first_line(error)})") from None
    replicated = path / REPLICATED
    if replicated.is_file():  # absent in checkpoints written before it existed (and without any)
        _verify(path, [REPLICATED])
        try:
            replicated_state = torch.load(replicated, map_location="cpu", weights_only=True)
        except Exception as error:
            raise CheckpointError(f"{replicated}: cannot load ({_first_line(error)})") from None
        _merge(rank_state, replicated_state, replicated)
    return rank_state, shared_state


def _merge(into: dict[str, Any], replicated: Any, source: Path, where: str = "") -> None:
    """Put the replicated state's entries into the rank's state (nested dicts); a key both hold is an
    error: the two files were not written as a pair."""
    if not isinstance(replicated, dict) or not isinstance(into, dict):
        raise CheckpointError(f"{source}: does not fit the rank state at '{where or '/'}'")
    for key, value in replicated.items():
        if key not in into:
            into[key] = value
        elif isinstance(value, dict) and isinstance(into[key], dict):
            _merge(into[key], value, source, f"{where}/{key}")
        else:
            raise CheckpointError(f"{source}: '{where}/{key}' is in the rank file too")


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
