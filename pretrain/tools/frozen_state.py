"""What a 1-bit LAMB checkpoint's frozen variance does to each tensor's step.

    python -m pretrain.tools.frozen_state results/runs/<run>            # latest checkpoint of the run
    python -m pretrain.tools.frozen_state results/runs/<run>/checkpoints/step-00000400 --rank 1

One row per parameter (optimizer order): its family, the median of √v (v frozen at `freeze_step`), the share
of elements with √v below `--tiny` and of ‖u‖² they carry, u = m/(√v+ε) + λp (m the rank's momentum), and
‖u‖/‖p‖. LAMB's step moves every tensor by lr·‖p‖; a step whose coefficient is clamped at `min_coeff` moves
it by lr·min_coeff·‖u‖, so a tensor with ‖u‖/‖p‖ above 1/min_coeff moves faster than LAMB would move it
(results/cpu-study/README.md: the query and key matrices, whose gradients grow after an early freeze).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from torch import Tensor, nn

from pretrain.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint
from pretrain.observability.diagnostics import family_of
from pretrain.optim.onebit import Compression
from pretrain.optim.onebit_lamb import DEEPSPEED_ALGORITHM, ONEBIT_LAMB_ALGORITHM
from pretrain.optim.params import param_groups


@dataclass(frozen=True)
class TensorRow:
    name: str
    family: str
    sqrt_v_median: float
    tiny_fraction: float  # elements with √v < tiny
    tiny_share: float  # their share of ‖u‖²
    update_to_weight: float  # ‖u‖/‖p‖


def frozen_state_rows(
    named: list[tuple[str, Tensor]],
    states: list[dict[str, Tensor]],
    group_of: list[dict[str, Any]],
    tiny: float,
) -> list[TensorRow]:
    """Rows for parameters `named` (optimizer order) with their optimizer `states` and groups."""
    rows = []
    for (name, weight), state, group in zip(named, states, group_of, strict=True):
        sqrt_v = state["exp_avg_sq"].float().sqrt()
        update = state["exp_avg"].float() / (sqrt_v + group.get("eps", 1e-8)) + group["weight_decay"] * weight
        small = sqrt_v < tiny
        energy = update.square()
        total = float(energy.sum())
        weight_norm = float(weight.norm())
        rows.append(
            TensorRow(
                name=name,
                family=family_of(name),
                sqrt_v_median=float(sqrt_v.median()),
                tiny_fraction=float(small.float().mean()),
                tiny_share=float(energy[small].sum()) / total if total > 0 else 0.0,
                update_to_weight=float(update.norm()) / weight_norm if weight_norm > 0 else float("nan"),
            )
        )
    return rows


def _ordered(model: nn.Module, config: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(name, group) in the optimizer's order, as the trainer groups them (pretrain/train/train_setup.py)."""
    optim = config["optim"]
    masks = bool(optim.get("mask_unused_position_embeddings", False)) and optim["name"].startswith("onebit")
    # a preset's config has no `compression` key (its algorithm's); a 1-bit Adam's and older runs' do
    preset = ONEBIT_LAMB_ALGORITHM if optim["name"] == "onebit_lamb" else DEEPSPEED_ALGORITHM
    compression = Compression(optim.get("compression", preset.exchange.compression))
    row_scales = optim["name"].startswith("onebit") and compression.row_scales
    ffn_row_scales = row_scales and bool(optim.get("ffn_row_scales", False))  # absent in older runs
    length = config["batch"]["phases"][0]["max_seq_length"] if masks else None
    groups = param_groups(
        model,
        optim["weight_decay"],
        max_seq_length=length,
        row_scales=row_scales,
        ffn_row_scales=ffn_row_scales,
    )
    names = {id(param): name for name, param in model.named_parameters()}
    return [(names[id(param)], group) for group in groups for param in group["params"]]


def inspect(path: Path, rank: int, tiny: float) -> list[TensorRow]:
    from transformers import BertConfig, BertForPreTraining

    if (path / "checkpoints").is_dir():  # a run folder: its latest checkpoint
        run, checkpoint = path, latest_checkpoint(path / "checkpoints")
        if checkpoint is None:
            raise CheckpointError(f"{path / 'checkpoints'}: no complete checkpoint")
    else:  # <run>/checkpoints/step-N
        run, checkpoint = path.parent.parent, path
    if not (checkpoint / "COMPLETE").is_file():
        raise CheckpointError(f"{checkpoint}: not a complete checkpoint (no COMPLETE marker)")
    config_file = run / "config.yaml"
    if not config_file.is_file():
        raise CheckpointError(f"{config_file}: missing (the run's config names the optimizer layout)")
    config = yaml.safe_load(config_file.read_text())
    model = BertForPreTraining(BertConfig.from_pretrained(checkpoint / "hf"))
    rank_state, _ = load_checkpoint(checkpoint, rank, model)
    optimizer = rank_state["optimizer"]
    ordered = _ordered(model, config)
    if len(ordered) != len(optimizer["state"]):
        raise CheckpointError(
            f"{checkpoint}: {len(optimizer['state'])} optimizer states for {len(ordered)} tensors"
        )
    if "exp_avg_sq" not in optimizer["state"][0]:
        raise CheckpointError(f"{checkpoint}: the optimizer state has no exp_avg_sq (not LAMB or 1-bit LAMB)")
    params = dict(model.named_parameters())
    eps = optimizer["param_groups"][0].get("eps", 1e-8)
    named = [(name, params[name].detach()) for name, _ in ordered]
    groups = [{**group, "eps": eps} for _, group in ordered]
    return frozen_state_rows(named, [optimizer["state"][i] for i in range(len(ordered))], groups, tiny)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pretrain.tools.frozen_state", description=__doc__.splitlines()[0]
    )
    parser.add_argument("path", type=Path, help="a run folder (its latest checkpoint) or a checkpoint folder")
    parser.add_argument("--rank", type=int, default=0, help="whose momentum (default 0)")
    parser.add_argument("--tiny", type=float, default=1e-6, help="√v threshold (default 1e-6)")
    args = parser.parse_args(argv)
    try:
        rows = inspect(args.path, args.rank, args.tiny)
    except (CheckpointError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"{'tensor':58} {'family':24} {'median sqrt(v)':>14} {'tiny':>6} {'|u|^2':>6} {'|u|/|p|':>9}")
    for row in rows:
        print(
            f"{row.name:58} {row.family:24} {row.sqrt_v_median:14.2e} {row.tiny_fraction:6.1%} "
            f"{row.tiny_share:6.1%} {row.update_to_weight:9.3g}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
