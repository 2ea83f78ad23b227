"""Check `arms`: the training step's arms of issue #51, each as the trainer runs it, side by side in one call.

Every arm is BERT-Large's compiled bf16 step (`bench.gpu.step.training_step`, the trainer's micro-step) with
one or more of: a larger micro-batch (`micro`: 128/256 at seq 128, 32/64 at seq 512; fewer launches per
sample), the vocabulary padded inside the model (`pad`: `model.pad_vocab_multiple`, 30,522 -> 30,528 rows
for the decoder's matrix products), CUDA graphs over the compiled step with gradient accumulation into
static buffers (`graphs`: `model.cuda_graphs`), phase-2 length bins (`bins`: `batch.phases[*].length_bins`,
the step's samples regrouped by length and each micro-batch cut to a bin, `pretrain.train.phase_data.
bin_by_length`; `bins2`: 256/512, `bins4`: 128/256/384/512), float8 matrix products (`float8`, torchao's
float8 training on the encoder's linear layers; only where torchao imports and the GPU has float8, else
reported as not run).

Peers, measured in the same run: the `throughput` check's step at the same length (micro-batch 64 at 128,
16 at 512, no other arm); a length-bins arm's peer is the same arm without bins on the same length mix
(lengths uniform in [32, 512]: ~47 % padding, about MLPerf's seq-512 data's share), both in the arm.

`DEFAULT_ARMS` run in `make gpu-check` (the combination expected to win first), while the budget lasts; an
arm that does not fit is listed in the `arms_not_run` record, not failed. `--arms=all` adds the arms that
attribute the combination's gain to its parts. `--cpu-smoke`: the same arms at toy sizes (BERT-tiny, seq
32/64, micro-batches 4-8, compiled with the aot_eager backend; CUDA graphs as the static-gradient path
without replays).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Any

import torch

from bench.gpu.common import (
    MASKED_PER_SEQUENCE,
    NVIDIA_PEAK_TFLOPS,
    NVIDIA_SAMPLES_PER_S,
    Context,
    error_line,
    free_memory,
    time_once,
    training_flops,
)
from bench.gpu.step import kernel_breakdown, measure_samples_per_s, pretraining_batch, training_step
from bench.records import Record

VOCAB = 30522
LENGTH_BINS = (128, 256, 384, 512)  # conf/batch/64k.yaml's and 32k.yaml's phase 2 (pending measurement)
TWO_BINS = (256, 512)  # what fits `make gpu-check`'s budget: one compile more than the padded step
BINNED_ACCUMULATION = 8  # micro-batches per step that the bins regroup


@dataclass(frozen=True)
class Arm:
    seq: int
    micro: int
    pad: bool = False
    graphs: bool = False
    bins: tuple[int, ...] = ()  # length bins at seq 512 (the last is 512)
    float8: bool = False

    @property
    def name(self) -> str:
        parts = [f"seq{self.seq}", f"micro{self.micro}"]
        parts += [label for label, on in (("pad64", self.pad), ("graphs", self.graphs)) if on]
        parts += [f"bins{len(self.bins)}"] if self.bins else []
        parts += ["float8"] if self.float8 else []
        return "_".join(parts)

    def seconds_needed(self) -> float:
        """Budget an arm needs on a GPU: a BERT-Large compile is ~55 s (H200), each further bin one more."""
        return 90.0 + 55.0 * max(0, len(self.bins) - 1)


# the expected winner first, then what separates its parts: `make gpu-check` runs these while its budget
# lasts (the targets: seq 128 >= 1,839 samples/s on an H200; seq 512 binned beside padded)
DEFAULT_ARMS = (
    Arm(128, 256, pad=True, graphs=True),
    Arm(512, 64, pad=True, bins=TWO_BINS),
)
MORE_ARMS = (
    Arm(128, 256),
    Arm(512, 64, pad=True, bins=LENGTH_BINS),
    Arm(128, 128),
    Arm(128, 256, pad=True),
    Arm(128, 64, graphs=True),
    Arm(512, 32),
    Arm(512, 64, pad=True, graphs=True),
    Arm(128, 256, pad=True, float8=True),
)
ARMS = {arm.name: arm for arm in DEFAULT_ARMS + MORE_ARMS}

SMOKE_SEQ = {128: 32, 512: 64}
SMOKE_MICRO = {32: 4, 64: 4, 128: 4, 256: 8}


def selected_arms(spec: str) -> list[Arm]:
    """`--arms`: `default`, `all`, or comma-separated arm names."""
    if spec == "default":
        return list(DEFAULT_ARMS)
    if spec == "all":
        return list(DEFAULT_ARMS + MORE_ARMS)
    names = [name for name in spec.split(",") if name]
    unknown = [name for name in names if name not in ARMS]
    if unknown:
        raise SystemExit(f"bench gpu: unknown --arms {unknown}; known: default, all, {', '.join(ARMS)}")
    return [ARMS[name] for name in names]


def length_mix(count: int, seq: int, seed: int = 0) -> torch.Tensor:
    """Sequence lengths for the bins arm: uniform in [seq/16, seq] (~47 % padding at 512)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(max(8, seq // 16), seq + 1, (count,), generator=generator)


def mixed_batches(micro: int, seq: int, masked: int, accumulation: int, device: torch.device) -> list[dict]:
    """One step's micro-batches padded to `seq`, each sample as long as `length_mix` says (padding after
    it: attention 0, label -100, masked positions inside it), as the collator gives them."""
    batches = []
    lengths = length_mix(micro * accumulation, seq)
    for index in range(accumulation):
        batch = pretraining_batch(micro, seq, masked, VOCAB, torch.device("cpu"))
        for row in range(micro):
            n = int(lengths[index * micro + row])
            batch["attention_mask"][row, n:] = 0
            batch["input_ids"][row, n:] = 0
            batch["token_type_ids"][row, n:] = 0
            batch["labels"][row, n:] = -100
            keep = max(1, min(masked, (n - 2) * 15 // 100))
            positions = (
                torch.randperm(n - 2, generator=torch.Generator().manual_seed(row))[:keep] + 1
            ).sort()
            batch["labels"][row, :] = -100
            batch["labels"][row, positions.values] = torch.randint(VOCAB, (keep,))
            batch["mlm_positions"][row] = 0
            batch["mlm_positions"][row, :keep] = positions.values
        batches.append(batch)
    return [{k: v.to(device) for k, v in batch.items()} for batch in batches]


def _float8(model: torch.nn.Module, ctx: Context) -> str | None:
    """torchao's float8 training on the encoder's linear layers; -> why not, or None when converted."""
    if ctx.device.type != "cuda" or torch.cuda.get_device_capability(ctx.device) < (8, 9):
        return "needs a CUDA GPU with float8 (compute capability >= 8.9)"
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError as error:
        return f"torchao does not import ({error})"
    convert_to_float8_training(model.bert.encoder)
    return None


def run_arm(ctx: Context, arm: Arm, config: dict[str, Any]) -> tuple[float, float | None]:
    """(samples/s of the arm, samples/s of its own peer or None): the peer is the unbinned step on the same
    length mix for a bins arm."""
    from pretrain.model import ModelConfig, ModelSize, PretrainingObjective, build_model
    from pretrain.train.phase_data import bin_by_length

    seq = SMOKE_SEQ[arm.seq] if ctx.smoke else arm.seq
    micro = SMOKE_MICRO[arm.micro] if ctx.smoke else arm.micro
    bins = [b * seq // arm.seq for b in arm.bins]
    masked = MASKED_PER_SEQUENCE.get(seq, max(1, seq * 15 // 100))
    size = ModelSize.bert_tiny if ctx.smoke else ModelSize.bert_large
    model = build_model(ModelConfig(size=size), VOCAB, ctx.device).train()
    if arm.float8:
        reason = _float8(model, ctx)
        if reason:
            raise RuntimeError(f"float8: {reason}")
    objective: Any = PretrainingObjective(model, 64 if arm.pad else 1)
    torch._dynamo.reset()
    options: dict[str, Any] = {"mode": "reduce-overhead"} if arm.graphs and ctx.device.type == "cuda" else {}
    if ctx.smoke:  # Dynamo and AOT autograd with static shapes as on the GPU, without Inductor's C++ builds
        options["backend"] = "aot_eager"
    compiled = torch.compile(objective, dynamic=False, **options)
    config["compile"] = options or "inductor"
    config.update(
        seq=seq, micro_batch=micro, masked_per_sequence=masked, pad_vocab_multiple=64 if arm.pad else 1
    )
    config.update(cuda_graphs=arm.graphs and ctx.device.type == "cuda", static_gradients=arm.graphs)
    reps = 2 if ctx.smoke else 10
    if not arm.bins:
        batch = pretraining_batch(micro, seq, masked, VOCAB, ctx.device)
        rate, first_s = measure_samples_per_s(ctx, model, compiled, batch, reps, arm.graphs)
        config["first_step_s"] = round(first_s, 1)
        config.update(kernel_breakdown(ctx, f"arm {arm.name}", compiled, batch, micro / rate, arm.graphs))
        model.zero_grad(set_to_none=True)
        return rate, None
    # length bins: one step's micro-batches, padded to seq (the peer) and binned, on the same samples
    padded = mixed_batches(micro, seq, masked, BINNED_ACCUMULATION, ctx.device)
    binned = bin_by_length(padded, bins)
    steps = {
        "padded": [training_step(ctx, compiled, b, arm.graphs) for b in padded],
        "binned": [training_step(ctx, compiled, b, arm.graphs) for b in binned],
    }
    for micro_steps in steps.values():  # compile every shape, then warm up
        for _ in range(2):
            for step in micro_steps:
                step()
    step_reps = 1 if ctx.smoke else 3
    seconds = {
        name: time_once(lambda s=micro_steps: [step() for _ in range(step_reps) for step in s], ctx.device)
        / step_reps
        for name, micro_steps in steps.items()
    }
    model.zero_grad(set_to_none=True)
    samples = micro * BINNED_ACCUMULATION
    tokens = sum(int(b["attention_mask"].sum()) for b in padded)
    config.update(
        length_bins=bins,
        accumulation=BINNED_ACCUMULATION,
        length_mix=f"uniform in [{max(8, seq // 16)}, {seq}]",
        padding_share=round(1 - tokens / (samples * seq), 3),
        binned_widths=[int(b["input_ids"].shape[1]) for b in binned],
        step_seconds=seconds,
        tokens_per_s={name: tokens / s for name, s in seconds.items()},
    )
    return samples / seconds["binned"], samples / seconds["padded"]


def check_arms(ctx: Context) -> list[Record]:
    records: list[Record] = []
    not_run: list[str] = []
    for arm in ctx.arms:
        config = ctx.config(arm=arm.name, precision="bf16 autocast", attention="sdpa", compiled=True)
        if ctx.left() < arm.seconds_needed() and not ctx.smoke:
            not_run.append(
                f"{arm.name} ({ctx.left():.0f} s of --budget-s left, needs {arm.seconds_needed():.0f})"
            )
            continue
        try:
            rate, own_peer = run_arm(ctx, arm, config)
        except Exception as error:  # one arm's failure must not take the others' figures down
            message = error_line(error)
            if arm.float8 and message.startswith("RuntimeError: float8:"):
                not_run.append(f"{arm.name} ({message.removeprefix('RuntimeError: ')})")
                continue
            traceback.print_exc()
            ctx.fail(f"arms: {arm.name}: {message}")
            continue
        finally:
            torch._dynamo.reset()
            free_memory()
        seq = config["seq"]
        baseline = ctx.results.get(f"seq{seq}_compiled_samples_per_s")
        if own_peer is not None:
            peer, peer_value = "the same step without bins on the same length mix", own_peer
        else:
            peer, peer_value = f"throughput's compiled seq-{seq} step (micro-batch 64/16, no arm)", baseline
        prefix = f"arm_{arm.name}" if not ctx.smoke else f"toy_arm_{arm.name}"
        records.append(Record(f"{prefix}_samples_per_s", rate, "samples/s", peer, peer_value, config=config))
        nvidia = NVIDIA_SAMPLES_PER_S.get(seq)
        if nvidia and ctx.peak and not arm.bins:
            scaled = nvidia * ctx.peak / NVIDIA_PEAK_TFLOPS
            target = ">= 1.0" if seq == 128 else ">= 0.6"
            peer_name = (
                f"NVIDIA DLE A100-80GB {nvidia:g} samples/s x peak {ctx.peak:g}/{NVIDIA_PEAK_TFLOPS:g}"
            )
            records.append(
                Record(f"{prefix}_vs_nvidia", rate, "samples/s", peer_name, scaled, target, config=config)
            )
            flops = training_flops(seq, config["masked_per_sequence"])
            records.append(
                Record(f"{prefix}_mfu", rate * flops / (ctx.peak * 1e12), "fraction of peak", config=config)
            )
    if not_run:
        print("[bench gpu] arms not run: " + "; ".join(not_run), flush=True)
        records.append(Record("arms_not_run", float(len(not_run)), "arms", config=ctx.config(arms=not_run)))
    return records
