"""Probe of the 1-bit exchange's per-segment fidelity on fresh gradients, per weight matrix, at a 1-bit LAMB
run's checkpoints: why `diag/step_fidelity_cos/ffn` falls during rung M's compression stage.

For each checkpoint the run's own model (`pretrain.model`, dropout as in the run's config) is loaded with
its weights and optimizer state (`pretrain.checkpoint.load_checkpoint`), and `--batches` micro-batches of
64 sequences (one worker's share: rank 0 of 2, the first steps of the phase-1 data stream,
`pretrain.train.phase_data.PhaseData`, the same batches at every checkpoint) each give a gradient g_b of
the trainer's loss (MLM + NSP), multiplied by the run's `frozen_grad_scale` as the compression stage does.
Per weight matrix (query, key, value, attention output, FFN intermediate and output dense of each layer,
and the word embeddings) and aggregated per tensor type and per family (attention, ffn):

- cos_v: the one-shot 1-bit fidelity of y = g_b/(√v+ε) with the checkpoint's v (`exp_avg_sq`): the cosine
  between y and σ_s·sign(y) (σ_s = mean |y| over segment s, sign +1 at 0, as the exchange's kernels) over
  the whole tensor, no error feedback; segments are the input columns W[:, j] of the matrices and the rows
  of the word embeddings, as `optim=onebit_lamb`'s `per_column` layout. Family and type figures sum the
  dot products and squared norms over their tensors, per batch; every figure is the mean over batches.
  Reference: a Gaussian segment gives √(2/π) = 0.80;
- cos_true: the same with v_true = mean over the probe's batches of g_b² (per element);
  cos_loo: with v_true leaving batch b out (g_b's own square bounds |y| by √B in cos_true);
- cos_rank1: with the rank-1 estimate of v_true, r·cᵀ/Σr from its row and column sums (the variance
  refresh's form): separates the rank-1 estimate's error from the staleness of v;
- cos_posfix: with v rescaled by one factor per position within a segment (a row of a matrix, a column
  of the embeddings), a_i = Σ_s v_true / Σ_s (√v+ε)² over the segments: v corrected only where a
  per-segment scale cannot absorb the error (a factor per segment can);
- cos_rows: cos_v with the segments running along the other dimension: one scale per row of a matrix
  (an output unit: for the FFN intermediate matrix, a neuron), per column of the word embeddings: whether
  a scale per neuron absorbs what v's staleness leaves in the column segments;
- cos_mom: the one-shot fidelity of ḡ/(√v+ε), ḡ the mean of the batches' gradients (a momentum-like
  average, one per checkpoint);
- ratio v_true/(√v+ε)² (= E_b[y²] per element; v_true/v where v ≫ ε²): median, 99th percentile, fraction
  of the entries above 10; r1_p99 and r1>10: the same for v_true against its rank-1 estimate;
  posfac and segfac: the 99th percentile over the median of the factors a_i above (per position within
  a segment) and of the same ratio per segment (types and families: of every tensor's factors over its
  median);
- zero: fraction of the entries of g_b that are exactly 0 (mean over batches); zero_pos: fraction of the
  positions within a segment (rows of a matrix: the FFN intermediate's neurons) whose gradient is 0 in
  every batch (they still get ±σ_s in a segment); stale_pos: fraction with 0 < a_i < 0.01 (v holds over
  100 times their fresh mean square);
- win_posfac, win_stale: posfac and stale_pos with the probe's v_true replaced by the mean square the
  workers' own gradients had in the training steps since the last variance refresh (the refresh's row
  and column sums in the rank files), where the checkpoint holds any (none at a refresh step: 1600 and
  3200 in rung M, refreshes every 64 steps from 640): whether the probe's batches stand for what training
  saw;
- top1: share of Σ y² (with v) in the largest 1 % of the tensor's entries; top1_seg: share of each
  segment's Σ y² in its largest 1 % (at least one entry), summed over segments; top1_row: share in the
  1 % of rows (output units; tokens for the embeddings) with the most Σ y²;
- err_w / err_s: ‖error-feedback buffer‖/‖x‖ of the workers (mean of ranks 0 and 1) and of the servers
  (both ranks' chunks), x = exp_avg/(√v+ε) at rest (the exchange's units); x_odd, a check of the
  segments and of the decoding: how many segments' |x| varies by more than 1e-4 of its mean (at rest the
  momentum is the servers' decompressed signs, one magnitude per segment; the one column cut in two by
  the boundary of the servers' chunks counts 1).

The optimizer's state is mapped to parameter names through the run's parameter groups
(`pretrain.optim.params.param_groups`, in the order of the checkpoint's `param_groups`), checked by shape.

Run from the repository root (one CPU thread; three BERT-mini checkpoints at 16 batches: ~100 s wall,
~65 s CPU, 2.8 GB memory):

    .venv/bin/python results/cpu-study-m/ffn_probe.py results/runs/cpu-rung-m-onebit_lamb-lr1e-2-n2-s1 \\
        --steps 1600 2400 3200 --batches 16

`--per-layer` adds a table per tensor; `--json PATH` writes every figure.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import Tensor
from transformers import BertForPreTraining

from data.shards import load_manifest
from pretrain.checkpoint import CheckpointError, load_checkpoint
from pretrain.model import ModelConfig, PretrainingObjective, build_model, column_major_linear_weights_
from pretrain.optim.base import views_like
from pretrain.optim.params import param_groups
from pretrain.train.phase_data import PhaseData, phase_folder

REPO = Path(__file__).resolve().parents[2]
WORD_EMBEDDINGS = "bert.embeddings.word_embeddings.weight"
# tensor type -> (family, name inside `bert.encoder.layer.{i}.`)
LAYER_TENSORS = {
    "query": ("attention", "attention.self.query.weight"),
    "key": ("attention", "attention.self.key.weight"),
    "value": ("attention", "attention.self.value.weight"),
    "attn_out": ("attention", "attention.output.dense.weight"),
    "ffn_in": ("ffn", "intermediate.dense.weight"),
    "ffn_out": ("ffn", "output.dense.weight"),
}
COSINES = ("cos_v", "cos_true", "cos_loo", "cos_rank1", "cos_posfix", "cos_rows")
SHARES = ("top1", "top1_seg", "top1_row")


@dataclass
class Probed:
    """One probed tensor: its name, type, family, and the dimension its segments run along (0: columns
    of a matrix, one segment per input column; 1: rows)."""

    name: str
    kind: str
    family: str
    layer: int | None
    along: int
    grads: list[Tensor] = field(default_factory=list)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="the run's folder (config.yaml, checkpoints/)")
    parser.add_argument("--steps", type=int, nargs="+", required=True, help="checkpoint steps to probe")
    parser.add_argument("--batches", type=int, default=16, help="micro-batches of the probe")
    parser.add_argument("--per-layer", action="store_true", help="also a table per tensor")
    parser.add_argument("--json", type=Path, default=None, help="write every figure to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    wall, cpu = time.perf_counter(), _cpu_seconds()
    cfg = yaml.safe_load((args.run / "config.yaml").read_text())
    batches = _batches(cfg, args.batches)
    results = {}
    for step in args.steps:
        results[step] = probe(args.run, cfg, step, batches)
        _print_step(step, results[step], args.per_layer)
    if args.json is not None:
        args.json.write_text(json.dumps({str(s): r for s, r in results.items()}, indent=1) + "\n")
    print(f"\nwall {time.perf_counter() - wall:.1f} s, CPU {_cpu_seconds() - cpu:.1f} s")


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _data_dir(cfg: dict[str, Any]) -> Path:
    path = Path(cfg["data_dir"])
    return path if path.is_absolute() or path.exists() else REPO / path


def _batches(cfg: dict[str, Any], count: int) -> list[dict[str, Tensor]]:
    """The first `count` micro-batches rank 0 of the run's processes trains on in phase 1."""
    phase = cfg["batch"]["phases"][0]
    folder = phase_folder(_data_dir(cfg), phase["max_seq_length"])
    data = PhaseData(
        folder,
        global_batch=phase["global_batch"],
        micro_batch=phase["micro_batch"],
        rank=0,
        world_size=int(cfg["world_size"]),
        seed=int(cfg["seed"]),  # phase index 0
        num_workers=0,
        vocab_size=_vocab_size(cfg),
    )
    accumulation = phase["global_batch"] // (phase["micro_batch"] * int(cfg["world_size"]))
    batches: list[dict[str, Tensor]] = []
    while len(batches) < count:
        batches.extend(data.next_step(accumulation))
    data.close()
    return batches[:count]


def _vocab_size(cfg: dict[str, Any]) -> int:
    phase = cfg["batch"]["phases"][0]
    manifest = load_manifest(phase_folder(_data_dir(cfg), phase["max_seq_length"]))
    return int(manifest["tokenizer"]["vocab_size"])


def _ordered_params(model: torch.nn.Module, cfg: dict[str, Any], saved: list[dict[str, Any]]) -> list[str]:
    """Parameter names in the optimizer's order (its state's indices), built as the trainer builds the
    groups of a `per_column` 1-bit optimizer, and checked against the checkpoint's groups."""
    optim = cfg["optim"]
    masks = bool(optim.get("mask_unused_position_embeddings", False))
    groups = param_groups(
        model,
        optim["weight_decay"],
        max_seq_length=cfg["batch"]["phases"][0]["max_seq_length"] if masks else None,
        row_scales=True,
    )
    names = {id(p): n for n, p in model.named_parameters()}
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in saved]:
        raise ValueError("the checkpoint's parameter groups differ from the rebuilt ones")
    ordered: list[str] = [""] * sum(len(g["params"]) for g in groups)
    for group, saved_group in zip(groups, saved):
        if bool(group.get("row_scales")) != bool(saved_group.get("row_scales")):
            raise ValueError("the checkpoint's row-scaled groups differ from the rebuilt ones")
        for param, index in zip(group["params"], saved_group["params"]):
            ordered[index] = names[id(param)]
    return ordered


def _probed(model: BertForPreTraining) -> list[Probed]:
    layers = int(model.config.num_hidden_layers)
    probed = [
        Probed(f"bert.encoder.layer.{i}.{suffix}", kind, family, i, along=0)
        for i in range(layers)
        for kind, (family, suffix) in LAYER_TENSORS.items()
    ]
    probed.append(Probed(WORD_EMBEDDINGS, "word_emb", "word_embeddings", None, along=1))
    return probed


def probe(run: Path, cfg: dict[str, Any], step: int, batches: list[dict[str, Tensor]]) -> dict[str, Any]:
    """Every figure of one checkpoint: {"tensors": {name: stats}, "types": ..., "families": ...}."""
    path = run / "checkpoints" / f"step-{step:08d}"
    model = build_model(ModelConfig(**cfg["model"]), _vocab_size(cfg), torch.device("cpu"))
    column_major_linear_weights_(model)  # the run's memory order (its error buffers are in it)
    rank_state, _ = load_checkpoint(path, 0, model)
    optimizer = rank_state["optimizer"]
    order = _ordered_params(model, cfg, optimizer["param_groups"])
    params = dict(model.named_parameters())
    for index, name in enumerate(order):
        shape = tuple(optimizer["state"][index]["exp_avg_sq"].shape)
        if shape != tuple(params[name].shape):
            raise ValueError(f"state {index} has shape {shape}, {name} {tuple(params[name].shape)}")
    state = {name: optimizer["state"][index] for index, name in enumerate(order)}
    scale = float(optimizer["param_groups"][0].get("frozen_grad_scale", 1.0))
    eps = float(optimizer["param_groups"][0]["eps"])
    extras = _rank_extras(path, optimizer["extra"])
    errors = _error_views(extras, [params[n] for n in order], order)
    decays = {i: g["weight_decay"] for g in optimizer["param_groups"] for i in g["params"]}
    decayed = [name for index, name in enumerate(order) if decays[index] != 0.0]
    shapes = {name: tuple(p.shape) for name, p in params.items()}
    window = _window(extras, cfg, step, shapes, decayed)

    probed = _probed(model)
    model.train()
    objective = PretrainingObjective(model)
    for batch in batches:
        model.zero_grad(set_to_none=True)
        mlm, nsp, _, _ = objective(**batch)
        (mlm + nsp).backward()
        for item in probed:
            grad = params[item.name].grad
            assert grad is not None
            item.grads.append(grad.detach().contiguous() * scale)

    tensors = {}
    sums: dict[str, dict[str, list[Any]]] = {}
    for item in probed:
        v = state[item.name]["exp_avg_sq"].contiguous()
        x = state[item.name]["exp_avg"].contiguous() / (v.sqrt() + eps)
        stats, parts = _tensor_stats(
            torch.stack(item.grads), v, eps, item.along, x, errors.get(item.name), window.get(item.name)
        )
        item.grads.clear()
        stats.update(kind=item.kind, family=item.family, layer=item.layer)
        tensors[item.name] = stats
        for key in (item.kind, item.family):
            into = sums.setdefault(key, {})
            for name, value in parts.items():
                into.setdefault(name, []).append(value)
    aggregates = {key: _aggregate(parts) for key, parts in sums.items()}
    return {
        "frozen_grad_scale": scale,
        "tensors": tensors,
        "types": {k: aggregates[k] for k in [*LAYER_TENSORS, "word_emb"]},
        "families": {k: aggregates[k] for k in ("attention", "ffn", "word_embeddings")},
    }


def _rank_extras(path: Path, extra: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's `optimizer.extra` (rank 0's given), in rank order."""
    extras = [extra]
    for rank in range(1, int(extra["world_size"])):
        other = torch.load(path / f"rank-{rank:05d}.pt", map_location="cpu", weights_only=True)
        extras.append(other["optimizer"]["extra"])
    for rank, saved in enumerate(extras):
        compressors = saved["compressors"]
        if len(compressors) != 1 or int(compressors[0]["rank"]) != rank:
            raise ValueError(f"{path}: rank {rank}'s file holds no single compressor of rank {rank}")
    return extras


def _error_views(
    extras: list[dict[str, Any]], params: list[Tensor], names: list[str]
) -> dict[str, dict[str, Tensor]]:
    """The error-feedback buffers per parameter name: "worker0", "worker1" (each rank's) and "server"
    (the ranks' chunks end to end), in the exchange's units, as logical [rows, cols] views."""
    compressors = [extra["compressors"][0] for extra in extras]
    if any(int(c["virtual_workers"]) != 1 for c in compressors):
        return {}
    flats = {f"worker{rank}": c["worker_error"] for rank, c in enumerate(compressors)}
    flats["server"] = torch.cat([c["server_error"] for c in compressors])
    views: dict[str, dict[str, Tensor]] = {}
    for key, flat in flats.items():
        for name, view in zip(names, views_like(flat, params)):
            views.setdefault(name, {})[key] = view
    return views


def _window(
    extras: list[dict[str, Any]],
    cfg: dict[str, Any],
    step: int,
    shapes: dict[str, tuple[int, ...]],
    decayed: list[str],
) -> dict[str, tuple[Tensor, Tensor]]:
    """The variance refresh's pending window: per matrix of the refresh (`decayed`, 2-D, in the optimizer's
    order), the (row, column) sums of g² the workers saw in the training steps since the last refresh,
    averaged over workers and steps; {} when the checkpoint sits on a refresh (an empty window)."""
    refresh = int(cfg["optim"].get("variance_refresh", 0))
    frozen_at = extras[0].get("frozen_at")
    sums = [extra.get("square_sums") for extra in extras]
    if not refresh or frozen_at is None or any(s is None for s in sums):
        return {}
    count = (step - int(frozen_at)) % refresh
    if count == 0:
        return {}
    mean = torch.cat([s for s in sums if s is not None]).mean(0) / count
    window, offset = {}, 0
    for name in (n for n in decayed if len(shapes[n]) == 2):
        rows, cols = shapes[name]
        window[name] = (mean[offset : offset + rows], mean[offset + rows : offset + rows + cols])
        offset += rows + cols
    if not 0 <= mean.numel() - offset < len(extras):  # padded to a multiple of the processes
        raise ValueError(f"square_sums hold {mean.numel()} sums, the matrices {offset}")
    return window


def _fidelity(y: Tensor, along: int) -> Tensor:
    """Per batch (y is [B, ...]): [⟨y, c⟩, ‖c‖², ‖y‖²] with c = σ_s·sign(y), σ_s the mean |y| of each
    segment (the elements along dimension `along` of a tensor)."""
    dim = along + 1
    magnitude = y.abs()
    sigma = magnitude.mean(dim, keepdim=True)
    dot = (sigma * magnitude).flatten(1).sum(1)
    compressed = sigma.square().flatten(1).sum(1) * y.shape[dim]
    return torch.stack([dot, compressed, y.square().flatten(1).sum(1)], dim=1).double()


def _cosines(sums: Tensor) -> float:
    """Mean over batches of ⟨y, c⟩/(‖c‖‖y‖) from [B, 3] sums."""
    return float((sums[:, 0] / (sums[:, 1] * sums[:, 2]).sqrt().clamp(min=1e-300)).mean())


def _shares(y: Tensor, along: int) -> Tensor:
    """Per batch: [Σ of the top 1 % of y², Σ of each segment's top 1 %, Σ of the top 1 % rows' y², Σ y²]."""
    energy = y.square()
    flat = energy.flatten(1)
    total = flat.sum(1)
    top = flat.topk(max(1, math.ceil(0.01 * flat.shape[1])), dim=1).values.sum(1)
    dim = along + 1
    per_segment = max(1, math.ceil(0.01 * energy.shape[dim]))
    top_segment = energy.topk(per_segment, dim=dim).values.flatten(1).sum(1)
    rows = energy.sum(2)
    top_rows = rows.topk(max(1, math.ceil(0.01 * rows.shape[1])), dim=1).values.sum(1)
    return torch.stack([top, top_segment, top_rows, total], dim=1).double()


def _tensor_stats(
    grads: Tensor,
    v: Tensor,
    eps: float,
    along: int,
    x: Tensor,
    errors: dict[str, Tensor] | None,
    window: tuple[Tensor, Tensor] | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One tensor's figures, and the parts its type's and family's figures are summed from."""
    count = grads.shape[0]
    squares = grads.square()
    v_true = squares.mean(0)
    v_loo = (squares.sum(0) - squares) / (count - 1)
    v_rank1 = torch.outer(v_true.sum(1), v_true.sum(0)) / v_true.sum().clamp(min=1e-30)
    divisor = (v.sqrt() + eps).square()  # the v the exchange divides by
    positions = v_true.sum(1 - along) / divisor.sum(1 - along)  # a_i: one per position in a segment
    segments = v_true.sum(along) / divisor.sum(along)
    v_posfix = divisor * positions.unsqueeze(1 - along)
    fidelity = {
        "cos_v": _fidelity(grads / (v.sqrt() + eps), along),
        "cos_true": _fidelity(grads / (v_true.sqrt() + eps), along),
        "cos_loo": _fidelity(grads / (v_loo.sqrt() + eps), along),
        "cos_rank1": _fidelity(grads / (v_rank1.sqrt() + eps), along),
        "cos_posfix": _fidelity(grads / v_posfix.sqrt().clamp(min=eps), along),
        "cos_rows": _fidelity(grads / (v.sqrt() + eps), 1 - along),
    }
    mean_grad = grads.mean(0, keepdim=True)
    momentum = _fidelity(mean_grad / (v.sqrt() + eps), along)
    shares = _shares(grads / (v.sqrt() + eps), along)
    ratio = (v_true / divisor).flatten()
    ratio_rank1 = (v_true / (v_rank1.sqrt() + eps).square()).flatten()
    stats: dict[str, Any] = {key: _cosines(sums) for key, sums in fidelity.items()}
    stats["cos_mom"] = _cosines(momentum)
    stats.update(_ratio_stats(ratio, "ratio"))
    stats.update(_ratio_stats(ratio_rank1, "r1"))
    stats["posfac"], stats["segfac"] = _factor_spread([positions]), _factor_spread([segments])
    silent = grads.abs().amax(dim=(0, 2 - along)) == 0  # per position within a segment
    zeros = torch.tensor([float((grads == 0).sum()), float(grads.numel())], dtype=torch.float64)
    stats.update(_sparsity(zeros, silent, positions))
    for index, key in enumerate(SHARES):
        stats[key] = float((shares[:, index] / shares[:, 3]).mean())
    norm_x = float(x.norm())
    stats["x_odd"] = _odd_segments(x, along)
    parts: dict[str, Any] = {**fidelity, "cos_mom": momentum, "shares": shares, "ratio": ratio}
    parts["r1"], parts["positions"], parts["segments"] = ratio_rank1, positions, segments
    parts["zeros"], parts["silent"] = zeros, silent
    if window is not None:  # the training's own last steps in place of the probe's batches
        trained = window[along] / divisor.sum(1 - along)
        stats["win_posfac"], stats["win_stale"] = _factor_spread([trained]), _stale(trained)
        parts["trained"] = trained
    if errors is not None:
        buffers = errors
        workers = [float(t.norm()) / norm_x for k, t in buffers.items() if k.startswith("worker")]
        stats["err_w"] = sum(workers) / len(workers)
        stats["err_s"] = float(buffers["server"].norm()) / norm_x
        squared = sum(float(t.norm()) ** 2 for k, t in buffers.items() if k.startswith("worker"))
        parts["errors"] = torch.tensor([squared / len(workers), float(buffers["server"].norm()) ** 2])
    parts["x"] = torch.tensor([norm_x**2, stats["x_odd"]])
    return stats, parts


def _stale(positions: Tensor) -> float:
    """Fraction of the positions with 0 < a_i < 0.01."""
    return float(((positions > 0) & (positions < 0.01)).double().mean())


def _sparsity(zeros: Tensor, silent: Tensor, positions: Tensor) -> dict[str, float]:
    return {
        "zero": float(zeros[0] / zeros[1]),
        "zero_pos": float(silent.double().mean()),
        "stale_pos": _stale(positions),
    }


def _factor_spread(factors: list[Tensor]) -> float:
    """99th percentile over median of the factors, each tensor's taken relative to its own median."""
    relative = torch.cat([f / f.median().clamp(min=1e-30) for f in factors])
    return float(torch.quantile(relative, 0.99))


def _ratio_stats(ratio: Tensor, prefix: str) -> dict[str, float]:
    if prefix == "ratio":
        median, p99 = torch.quantile(ratio, torch.tensor([0.5, 0.99], dtype=ratio.dtype)).tolist()
        return {"ratio_med": median, "ratio_p99": p99, "ratio>10": float((ratio > 10).double().mean())}
    p99 = float(torch.quantile(ratio, 0.99))
    return {f"{prefix}_p99": p99, f"{prefix}>10": float((ratio > 10).double().mean())}


def _odd_segments(x: Tensor, along: int) -> int:
    """How many segments' |x| spreads by more than 1e-4 of its mean (max − min)."""
    magnitude = x.abs()
    spread = magnitude.amax(along) - magnitude.amin(along)
    return int((spread > 1e-4 * magnitude.mean(along)).sum())


def _aggregate(parts: dict[str, list[Any]]) -> dict[str, Any]:
    """A type's or family's figures from its tensors' parts (sums over tensors per batch, then the mean
    over batches; the ratio statistics over all their entries)."""
    stats: dict[str, Any] = {key: _cosines(sum(parts[key])) for key in (*COSINES, "cos_mom")}
    stats.update(_ratio_stats(torch.cat(parts["ratio"]), "ratio"))
    stats.update(_ratio_stats(torch.cat(parts["r1"]), "r1"))
    stats["posfac"] = _factor_spread(parts["positions"])
    stats["segfac"] = _factor_spread(parts["segments"])
    stats.update(_sparsity(sum(parts["zeros"]), torch.cat(parts["silent"]), torch.cat(parts["positions"])))
    shares = sum(parts["shares"])
    for index, key in enumerate(SHARES):
        stats[key] = float((shares[:, index] / shares[:, 3]).mean())
    if "trained" in parts:
        stats["win_posfac"] = _factor_spread(parts["trained"])
        stats["win_stale"] = _stale(torch.cat(parts["trained"]))
    x = torch.stack(parts["x"])
    norm_x = float(x[:, 0].sum().sqrt())
    stats["x_odd"] = int(x[:, 1].sum())
    if "errors" in parts:
        errors = sum(parts["errors"])
        stats["err_w"] = float(errors[0].sqrt()) / norm_x
        stats["err_s"] = float(errors[1].sqrt()) / norm_x
    return stats


COLUMNS = (
    *COSINES,
    "cos_mom",
    "ratio_med",
    "ratio_p99",
    "ratio>10",
    "r1_p99",
    "r1>10",
    "posfac",
    "segfac",
    "zero",
    "zero_pos",
    "stale_pos",
    "win_posfac",
    "win_stale",
    *SHARES,
    "err_w",
    "err_s",
    "x_odd",
)


def _print_table(title: str, rows: dict[str, dict[str, Any]]) -> None:
    print(f"\n{title}")
    print("| " + " | ".join(["", *COLUMNS]) + " |")
    print("|" + "---|" * (len(COLUMNS) + 1))
    for label, stats in rows.items():
        cells = [_cell(stats.get(column)) for column in COLUMNS]
        print("| " + " | ".join([label, *cells]) + " |")


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 1 or value == 0:
        return f"{value:.2f}"
    return f"{value:.3f}" if abs(value) >= 0.01 else f"{value:.1e}"


def _print_step(step: int, result: dict[str, Any], per_layer: bool) -> None:
    print(f"\n## step {step} (frozen_grad_scale {result['frozen_grad_scale']:.4f})")
    _print_table("per family", result["families"])
    _print_table("per tensor type (all layers)", result["types"])
    if per_layer:
        rows = {
            (f"{s['layer']}.{s['kind']}" if s["layer"] is not None else s["kind"]): s
            for s in result["tensors"].values()
        }
        _print_table("per tensor", rows)


if __name__ == "__main__":
    try:
        main()
    except (CheckpointError, OSError) as error:  # a missing run, config or checkpoint: one line
        raise SystemExit(f"ffn_probe: {error}") from None
