"""Pre-flight report: what a pretraining run will do and whether it can, before a GPU hour is spent.

    make preflight BATCH=64k OPT=onebit_lamb MODEL=bert_large NPROC=64
    python -m pretrain.tools.preflight batch=64k optim=onebit_lamb model=bert_large dry_run_world_size=64

One screen from the composed config alone (no data read, no model built beyond shapes on the meta device):
devices seen, world size, per phase the micro batch, accumulation, samples and steps, the 1-bit
`freeze_step` and the bytes per rank and step before and after it, an estimate of peak device memory per
rank, checkpoint size against free disk at `run_dir`, whether the prepared data is there, the W&B mode.
Impossible configurations are one line each and exit 2; suspicious ones are notes. `python -m pretrain`
prints the same report's first lines as its header (`Report.as_header`). The launchers run it once before
torchrun starts the workers (`python -m pretrain.tools.preflight --header`, launch/common.sh) and tell the
workers, which then skip it (`CHECKED_WORLD_SIZE`).

The memory figure is an estimate (parameters, gradients and optimizer state exactly; activations by the
usual transformer formula, Korthikanti et al. 2022, without recomputation; allocator slack not counted);
trust a real step's `torch.cuda.max_memory_allocated` over it.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig

from launch import cli
from pretrain.comm.counter import FP32_BYTES, CallTraffic, compressed_call_traffic, ring_allreduce_bytes
from pretrain.comm.kernels import describe_kernels
from pretrain.config import Precision, TrainConfig, WandbMode, to_object

ONEBIT = ("onebit_lamb", "onebit_lamb_deepspeed", "onebit_adam")
LARGE_RECIPE_SAMPLES = 1_000_000  # more samples than this on CPU is a cluster recipe run by mistake
# Set by a launcher (launch/common.sh) in the workers' environment: the world size its pre-flight passed for;
# the header is printed and the errors are decided already.
CHECKED_WORLD_SIZE = "BERT_LAMB_PREFLIGHT_WORLD_SIZE"
# `python -m pretrain.tools.preflight --header`: the run's header, as `python -m pretrain`
HEADER_FLAG = "--header"


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # each one line naming the key and the fix

    def as_header(self) -> None:
        """A run's header: the lines and notes from the launcher's rank 0; the first problem raised as
        ValueError on every rank (each computes the same report), so every rank stops with the one line."""
        if int(os.environ.get("RANK", "0")) == 0:
            print("\n".join(self.lines + [f"  note: {note}" for note in self.notes]), flush=True)
        if self.problems:
            raise ValueError(self.problems[0])

    def text(self) -> str:
        out = list(self.lines)
        out += [f"  note: {note}" for note in self.notes]
        out += [f"  error: {problem}" for problem in self.problems]
        return "\n".join(out)


def checked_by_launcher() -> bool:
    """Whether this worker's launcher ran the pre-flight for its world size (WORLD_SIZE, as `build`)."""
    return os.environ.get(CHECKED_WORLD_SIZE) == os.environ.get("WORLD_SIZE", "1")


def devices() -> tuple[str, str]:
    """(kind, description) of what this process sees: cuda with names, memory and NCCL, or CPU/gloo."""
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        props = torch.cuda.get_device_properties(0)
        nccl = ".".join(str(v) for v in torch.cuda.nccl.version()) if hasattr(torch.cuda, "nccl") else "?"
        return "cuda", f"{count} x {props.name} ({props.total_memory / 2**30:.0f} GiB), nccl {nccl}"
    return "cpu", "no GPU: CPU, gloo backend"


def model_shapes(cfg: TrainConfig, vocab_size: int) -> tuple[Any, torch.nn.Module]:
    """The HF BertConfig and a meta-device model (shapes only, no memory)."""
    from transformers import BertForPreTraining

    from pretrain.model import bert_config

    config = bert_config(cfg.model, vocab_size)
    with torch.device("meta"):
        model = BertForPreTraining(config)
    return config, model


def activation_bytes(config: Any, seq: int, micro: int, bytes_per_value: int) -> float:
    """Activations one forward/backward keeps for a micro batch: per layer s·b·h·(34 + 5·a·s/h) at 2 bytes
    (scaled to `bytes_per_value`), plus the MLM logits and their gradient (s·b·V, fp32)."""
    h, a, layers = config.hidden_size, config.num_attention_heads, config.num_hidden_layers
    per_layer = seq * micro * h * (34 + 5 * a * seq / h) * bytes_per_value / 2
    logits = 2 * seq * micro * config.vocab_size * FP32_BYTES
    return layers * per_layer + logits


def state_bytes(cfg: TrainConfig, numel: int, world: int) -> dict[str, float]:
    """Per rank: fp32 parameters, gradients, optimizer state (1-bit: error buffers and the exchange's
    scratch too)."""
    parts = {"parameters": 4.0 * numel, "gradients": 4.0 * numel, "optimizer (m, v)": 8.0 * numel}
    if cfg.optim.name in ONEBIT:
        parts["1-bit: fresh v, worker error, scratch"] = 12.0 * numel
        parts["1-bit: server error"] = 4.0 * numel / max(1, world)
    return parts


def checkpoint_bytes(cfg: TrainConfig, numel: int, processes: int) -> float:
    """One checkpoint: the weights and the optimizer state every rank holds alike (m, v; 1-bit LAMB's fresh
    v), written once by rank 0, plus each rank's own state (the 1-bit error feedback: a worker error as
    large as the model and a server error for its chunk); the HF export comes on top."""
    fresh_variance = cfg.optim.name in ("onebit_lamb", "onebit_lamb_deepspeed")
    replicated = 8.0 * numel + (4.0 * numel if fresh_variance else 0.0)
    own = 4.0 * numel + 4.0 * numel / max(1, processes) if cfg.optim.name in ONEBIT else 0.0
    return 4.0 * numel + replicated + processes * own


def compression_traffic(
    model: torch.nn.Module,
    options: dict[str, Any],
    world_size: int,
    max_seq_length: int,
    ffn_row_scales: bool = False,
) -> CallTraffic:
    """One compression-stage exchange's bytes per rank for `model`'s parameters with the 1-bit options
    (`compression`, `exact_vectors`, `scale_dtype`; `ffn_row_scales`: `optim.ffn_row_scales`' groups), by
    the counter formulas the byte tests check against the real collectives (also `bench fidelity`'s
    BERT-Large costs)."""
    from pretrain.comm import padded_numel
    from pretrain.comm.compressed_allreduce import ScaleDtype
    from pretrain.optim.onebit import Compression, ExchangeOptions
    from pretrain.optim.params import param_groups

    exchange = ExchangeOptions(Compression(options["compression"]), bool(options.get("exact_vectors", False)))
    row_scales = exchange.compression.row_scales
    groups = param_groups(
        model,
        0.01,
        max_seq_length=max_seq_length,
        row_scales=row_scales,
        ffn_row_scales=row_scales and ffn_row_scales,
    )
    params = [p for group in groups for p in group["params"]]
    row_scaled = {id(p) for group in groups if group.get("row_scales") for p in group["params"]}
    padded = padded_numel(sum(p.numel() for p in params), world_size)
    layout = exchange.layout(params, row_scaled, padded, world_size)
    segments = None if layout is None else layout.total_chunk_segments
    scale_bytes = ScaleDtype(options.get("scale_dtype", "float32")).bytes
    return compressed_call_traffic(padded, world_size, segments=segments, scale_bytes=scale_bytes)


def refresh_traffic(model: torch.nn.Module, every: int, world_size: int, max_seq_length: int = 128) -> float:
    """1-bit LAMB's `variance_refresh` (every `every` compression steps): the exact fp32 allreduce of the
    decayed matrices' row and column sums it adds on top of the exchange (`TrafficCounter.record_exact`'s
    ring cost), per rank, averaged over the K steps."""
    from pretrain.optim.params import param_groups

    groups = param_groups(model, 0.01, max_seq_length=max_seq_length, row_scales=True)
    decayed = [p for g in groups if g["weight_decay"] != 0.0 for p in g["params"]]
    marginals = sum(sum(p.shape) for p in decayed if p.dim() == 2)
    return ring_allreduce_bytes(marginals, FP32_BYTES, world_size) / every


def step_traffic(cfg: TrainConfig, model: torch.nn.Module, world: int) -> tuple[float, float | None]:
    """Bytes one rank sends per optimizer step: the gradient allreduce, and (1-bit) the compression
    stage's exchange with the configured layout plus a variance refresh's average (`refresh_traffic`)."""
    from pretrain.optim.config import GradAllreduce

    optim = cfg.optim
    grad_dtype = GradAllreduce(getattr(optim, "grad_allreduce", GradAllreduce.float32))
    element = FP32_BYTES if grad_dtype is GradAllreduce.float32 else 2
    numel = sum(p.numel() for p in model.parameters())
    before = ring_allreduce_bytes(numel, element, world)
    if optim.name not in ONEBIT or world < 2:
        return before, None
    options = {key: _plain(value) for key, value in optim.exchange_kwargs().items()}
    seq = cfg.batch.phases[0].max_seq_length
    call = compression_traffic(model, options, world, seq, bool(getattr(optim, "ffn_rows", False)))
    refresh = 0.0
    if getattr(optim, "variance_refresh", 0):
        refresh = refresh_traffic(model, optim.variance_refresh, world, seq)
    return before, call.compressed_bytes + refresh


def _plain(value: Any) -> Any:
    return getattr(value, "value", value)  # enums as their config strings


def _gib(value: float) -> str:
    return f"{value / 2**30:.1f} GiB" if value >= 2**30 else f"{value / 2**20:.0f} MiB"


def _free_disk(run_dir: Path) -> float | None:
    folder = run_dir
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return float(shutil.disk_usage(folder).free)
    except OSError:
        return None


def _vocab_size(cfg: TrainConfig) -> tuple[int, bool]:
    """The prepared data's vocabulary and True, or BERT's 30,522 and False when it is not prepared yet."""
    from data.shards import load_manifest

    folder = Path(cfg.data_dir) / f"seq{cfg.batch.phases[0].max_seq_length}"
    if (folder / "manifest.json").is_file():  # a damaged one is a one-line error naming the file
        return int(load_manifest(folder)["tokenizer"]["vocab_size"]), True
    return 30522, False


def build(cfg: TrainConfig, world_size: int | None = None) -> Report:
    """The report for `cfg` at `world_size` processes (default: `dry_run_world_size`, else the
    launcher's WORLD_SIZE, else 1)."""
    report = Report()
    kind, description = devices()
    processes = world_size or cfg.dry_run_world_size or int(os.environ.get("WORLD_SIZE", "1"))
    world = processes * cfg.sim_world_size
    precision = cfg.precision
    if precision is Precision.auto:
        precision = Precision.bf16 if kind == "cuda" else Precision.fp32
    value_bytes = 4 if precision is Precision.fp32 else 2
    vocab_size, prepared = _vocab_size(cfg)
    config, model = model_shapes(cfg, vocab_size)
    numel = sum(p.numel() for p in model.parameters())
    workers = f" ({processes} processes x {cfg.sim_world_size} simulated)" if cfg.sim_world_size > 1 else ""
    report.lines += [
        f"pre-flight: {cfg.model.size.value} ({numel / 1e6:.1f}M parameters), optim={cfg.optim.name}, "
        f"batch={cfg.batch.name}, precision {precision.value}",
        f"  devices: {description}; world size {world}{workers}",
    ]
    total_samples, peak_activations = 0, 0.0
    steps_left = cfg.max_steps  # a smoke run (max_steps) trains only that many steps of the recipe
    for phase in cfg.batch.phases:
        per_step = world * phase.micro_batch
        if phase.global_batch % per_step:
            report.problems.append(
                f"batch.phases[{phase.name}].global_batch={phase.global_batch} is not divisible by world "
                f"size ({world}) x micro_batch ({phase.micro_batch}) = {per_step}: set "
                "batch.phases.N.micro_batch or the number of processes so that it is"
            )
            accumulation = "?"
        else:
            accumulation = str(phase.global_batch // per_step)
        samples = phase.global_batch * phase.steps
        run_steps = phase.steps if steps_left is None else min(phase.steps, steps_left)
        steps_left = None if steps_left is None else steps_left - run_steps
        total_samples += phase.global_batch * run_steps
        activations = activation_bytes(config, phase.max_seq_length, phase.micro_batch, value_bytes)
        peak_activations = max(peak_activations, activations)
        report.lines.append(
            f"  {phase.name}: seq {phase.max_seq_length}, global batch {phase.global_batch} = {world} x "
            f"micro {phase.micro_batch} x {accumulation} accumulation, {phase.steps} steps, "
            f"{samples:,} samples, lr {phase.lr}"
        )
    before, after = step_traffic(cfg, model, world)
    if cfg.optim.name in ONEBIT:
        freeze = cfg.batch.phases[0].freeze_step
        freeze = freeze if freeze is not None else getattr(cfg.optim, "freeze_step", None)
        if after is None:
            report.notes.append(
                f"optim={cfg.optim.name} with world size {world}: nothing to compress, the run is "
                "LAMB with a frozen variance after freeze_step"
            )
            report.lines.append(f"  1-bit: freeze_step {freeze}; no exchange at world size {world}")
        else:
            report.lines.append(
                f"  1-bit: freeze_step {freeze}; per rank per step {before / 2**20:,.1f} MiB before it "
                f"(gradient allreduce), {after / 2**20:,.1f} MiB after ({before / after:.1f}x less)"
            )
            try:
                report.lines.append(
                    f"  1-bit compression on this machine's {kind.upper()}: {describe_kernels(kind)}"
                )
            except ValueError as error:  # $BERT_LAMB_COMM_KERNELS names kernels this device cannot run
                report.problems.append(str(error))
    else:
        report.lines.append(f"  traffic: {before / 2**20:,.1f} MiB per rank per step (gradient allreduce)")
    states = state_bytes(cfg, numel, world)
    peak = sum(states.values()) + peak_activations
    parts = ", ".join(f"{name} {_gib(value)}" for name, value in states.items())
    report.lines.append(
        f"  memory per rank (estimate): {_gib(peak)} = {parts}, activations {_gib(peak_activations)} "
        "at the largest micro batch"
    )
    if kind == "cuda":
        available = torch.cuda.get_device_properties(0).total_memory
        if peak > available:
            report.problems.append(
                f"the estimate {_gib(peak)} exceeds the GPU's {_gib(available)}: lower "
                "batch.phases.N.micro_batch (accumulation keeps the global batch)"
            )
    checkpoint = checkpoint_bytes(cfg, numel, processes)
    run_dir = Path(cfg.run_dir)
    free = _free_disk(run_dir)
    kept = checkpoint * cfg.checkpoint.keep_last
    free_text = "unknown" if free is None else _gib(free)
    report.lines.append(
        f"  checkpoints: ~{_gib(checkpoint)} each (+ HF export {_gib(4.0 * numel)}), keep_last "
        f"{cfg.checkpoint.keep_last}: {_gib(kept)}; free at {run_dir}: {free_text}"
    )
    if free is not None and free < kept:
        report.notes.append(
            f"{run_dir} has {_gib(free)} free, less than the {_gib(kept)} that keep_last="
            f"{cfg.checkpoint.keep_last} checkpoints take: point run_dir elsewhere or lower "
            "checkpoint.keep_last"
        )
    report.lines.append(
        "  data: "
        + (
            f"prepared at {cfg.data_dir}"
            if prepared
            else f"not prepared at {cfg.data_dir}: `make pretrain` prepares it first (make prepare DATA=...)"
        )
    )
    report.lines.append(f"  W&B: {wandb_mode(cfg.wandb.mode, cfg.wandb.project)}")
    if kind == "cuda" and getattr(cfg.optim, "compile", False):
        report.notes.append(
            "optim.compile=true on a GPU: its per-tensor compiled kernels measured slower there than the "
            "eager multi-tensor step (bench gpu on an H200: LAMB 13x fused AdamW compiled, 3.8x eager); "
            "it is meant for CPUs: leave it off on GPUs"
        )
    if kind == "cpu" and not cfg.dry_run and total_samples > LARGE_RECIPE_SAMPLES:
        report.problems.append(
            f"batch={cfg.batch.name} trains {total_samples:,} samples, a cluster recipe, and this machine "
            "has no GPU: run it on GPUs, or check the config here with dry_run=true dry_run_world_size=<GPUs>"
        )
    return report


def wandb_mode(requested: WandbMode, project: str) -> str:
    """What `wandb.mode` means here (auto: online with an API key, else offline) and the project."""
    mode = requested.value
    if mode == "auto":
        online = bool(os.environ.get("WANDB_API_KEY")) or (Path.home() / ".netrc").is_file()
        mode = "auto: online (an API key is configured)" if online else "auto: offline (no API key)"
    return f"{mode}, project {project}"


@hydra.main(config_path="../../conf", config_name="pretrain", version_base="1.3")
def main(dict_cfg: DictConfig) -> None:
    try:
        cfg = to_object(dict_cfg)
    except ValueError as error:
        cli.fail("preflight", error)
    report = build(cfg)
    print(report.text())
    if report.problems:
        sys.exit(2)


@hydra.main(config_path="../../conf", config_name="pretrain", version_base="1.3")
def header(dict_cfg: DictConfig) -> None:
    """What `python -m pretrain` prints before it builds anything: the header (from RANK 0) and the first
    error as `pretrain: error: <one line>`, exit 2; for a launcher to run once before torchrun starts the
    workers (WORLD_SIZE: the world size it will start)."""
    try:
        build(to_object(dict_cfg)).as_header()
    except ValueError as error:
        cli.fail("pretrain", error)


if __name__ == "__main__":
    if HEADER_FLAG in sys.argv[1:]:
        sys.argv.remove(HEADER_FLAG)
        cli.run(header, "pretrain")
    else:
        cli.run(main, "preflight")
