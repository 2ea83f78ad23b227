"""GPU validation on one CUDA device: `python -m bench gpu` (`make gpu-check`), under 10 minutes.

Five checks, each against a peer measured in the same run (issue #16):

1. `packer`: the cupy sign packer, the torch packer on the GPU and the CPU reference give identical bytes
   (random fp32/bf16 inputs with ±0, ±Inf and NaN planted, lengths around byte, chunk and pad boundaries,
   and the BERT-Large buffer itself), and decode alike; pack/unpack GB/s over the BERT-Large buffer (fp32,
   padded for 64 workers), the torch packer the peer of cupy's and a device-to-device copy the ceiling.
2. `allreduce`: the compressed allreduce with simulated workers in this one process on the GPU equals the
   CPU reference model (`pretrain.comm.reference`) at n = 8 and 64, DeepSpeed's exchange and the
   project's default; its compute time per call, per worker, for BERT-Large with the default exchange
   at n = 8, and with one scale at n = 8 and 64 on a share of the buffer that fits k workers' state in
   memory, scaled to BERT-Large (`config` gives both). Peer: one fp32 copy of the buffer (memory speed).
   The same at n = 8 with the `torch.compile`d kernels (`kernels=compiled`, Triton), their peer the torch
   kernels' time in the same run, and their outputs against the torch kernels' (bitwise expected; a
   failure only when they are off the CPU reference as well).
3. `optim`: step times over BERT-Large's parameters on the GPU of LAMB eager and compiled and of 1-bit
   LAMB's compression-stage update (the project's default exchange with one process: compute only),
   eager and compiled; peer `torch.optim.AdamW(fused=True)`, interleaved.
4. `throughput`: BERT-Large pretraining forward+backward (the pretrainer's objective: MLM on the masked
   positions, NSP), bf16 autocast, SDPA attention, seq 128 (micro-batch 64) and 512 (16), eager and
   `torch.compile`d: samples/s and MFU, against NVIDIA DeepLearningExamples' published per-GPU figures
   (A100 80 GB: 580 samples/s at seq 128, 210 at 512) scaled by the ratio of peak bf16 FLOP/s. The LAMB
   step of check 3 is amortised over NVIDIA's accumulation (8 GPUs, global batch 65536 / 32768).
5. `pipeline`: `make pretrain BATCH=demo OPT=onebit_lamb`'s command on this GPU (NCCL, world size 1, two
   simulated workers so the 1-bit exchange runs) through the compression stage with a checkpoint, a
   resume from it, then a bf16 MRPC fine-tune of the result.

FLOPs per sequence (`training_flops`): 3 x the forward's matrix products, the encoder on every token,
attention's two T x T products, the MLM head on the masked positions (20 per 128 tokens, 80 per 512,
NVIDIA's max_predictions) and the pooler/NSP head; embeddings' lookups count zero. The same formula
gives NVIDIA's MFU, so the MFU ratio equals the samples/s ratio after the peak scaling.

Records: results/bench/gpu.json (the device's name in every record's `config`). Exit status 1 when a
check fails (different bytes, an allreduce off the reference, a pipeline stage's error); performance
figures are reported with their targets, not enforced. Without CUDA it says so and exits 0 (nothing to
check); `--cpu-smoke` runs every check at toy sizes on the CPU instead (what the tests run).

    python -m bench gpu [--steps packer,allreduce,optim,throughput,pipeline] [--budget-s 570]
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.records import RESULTS_DIR, Record, write_records

# in the order they run: the quick correctness checks first, the compiles last
STEPS = ("packer", "allreduce", "pipeline", "optim", "throughput")
# seconds a check may take (an H200 took 2, 18, 78, 25, 142 and ~140 s, compiles included; allreduce's
# compiled-kernel arms, added since, not yet timed on a GPU): a check is
# skipped, and says so, when less than this is left of --budget-s
STEP_SECONDS = {
    "packer": 10,
    "allreduce": 120,
    "pipeline": 100,
    "optim": 60,
    "throughput": 170,
    "profile": 30,  # each of its arms checks the budget itself (a compiled arm needs 90 s)
}

# NVIDIA DeepLearningExamples, PyTorch BERT-Large pretraining, DGX A100 80 GB, per GPU (issue #16)
NVIDIA_SAMPLES_PER_S = {128: 580.0, 512: 210.0}
NVIDIA_PEAK_TFLOPS = 312.0  # A100 bf16 dense
NVIDIA_GLOBAL_BATCH = {128: 65536, 512: 32768}
NVIDIA_GPUS = 8
MICRO_BATCH = {128: 64, 512: 16}  # conf/batch/64k.yaml's micro-batches
MASKED_PER_SEQUENCE = {128: 20, 512: 80}  # NVIDIA's max_predictions_per_seq

# peak dense bf16 TFLOP/s by device name (longest match first); --peak-tflops overrides
PEAK_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("H800", 989.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10", 125.0),
)


def peak_tflops(device_name: str) -> float | None:
    """Datasheet dense bf16 TFLOP/s of a device by its name, or None when unknown."""
    for key, value in PEAK_TFLOPS:
        if key in device_name:
            return value
    return None


def training_flops(
    seq: int, masked: int, layers: int = 24, hidden: int = 1024, intermediate: int = 4096, vocab: int = 30522
) -> float:
    """FLOPs of one training sequence (forward + backward = 3 x forward) under the module's formula."""
    per_token = layers * (8 * hidden * hidden + 4 * hidden * intermediate + 4 * seq * hidden)
    mlm_head = masked * 2 * (hidden * hidden + hidden * vocab)
    pooler_nsp = 2 * hidden * hidden + 4 * hidden
    return 3.0 * (seq * per_token + mlm_head + pooler_nsp)


@dataclass
class Context:
    device: torch.device
    smoke: bool
    deadline: float
    peak: float | None
    out_dir: Path
    device_name: str
    results: dict[str, float] = field(default_factory=dict)  # figures later checks reuse
    failures: list[str] = field(default_factory=list)
    kernel_tables: dict[str, str] = field(default_factory=dict)  # costliest kernels by step (*_kernels.txt)

    def config(self, **extra: Any) -> dict[str, Any]:
        info: dict[str, Any] = {"device": self.device_name}
        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(self.device)
            info.update(
                gpu_memory_gib=round(props.total_memory / 2**30, 1),
                multiprocessors=props.multi_processor_count,
                cuda=torch.version.cuda,
            )
        return {**info, "smoke": self.smoke, **extra}

    def left(self) -> float:
        """Seconds left of --budget-s."""
        return self.deadline - time.perf_counter()

    def fail(self, message: str) -> None:
        self.failures.append(message)
        print(f"[bench gpu] FAILED: {message}", flush=True)


# ------------------------------------------------------------------------------------------ timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_once(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds of one call: CUDA events around it on a GPU (work queued before is finished first)."""
    _sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def interleaved(
    steps: Mapping[str, Callable[[], Any]],
    device: torch.device,
    warmup: int,
    reps: int,
    before: Callable[[], Any] | None = None,
) -> dict[str, float]:
    """Median seconds per call of each function, calls interleaved round-robin after `warmup`; `before`
    runs untimed ahead of every call (e.g. to refill a buffer the call consumes)."""
    for _ in range(warmup):
        for fn in steps.values():
            if before:
                before()
            fn()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(reps):
        for name, fn in steps.items():
            if before:
                before()
            times[name].append(time_once(fn, device))
    return {name: statistics.median(values) for name, values in times.items()}


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------- 1. packer


def _planted(length: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values with ±0, ±Inf, NaN and subnormals planted at random positions."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(length, generator=generator)
    specials = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-42, -1e-42])
    count = min(length, max(len(specials), length // 50))
    positions = torch.randperm(length, generator=generator)[:count]
    values[positions] = specials[torch.arange(count) % len(specials)]
    return values.to(dtype)


def packer_lengths(smoke: bool) -> list[int]:
    from pretrain.comm import padded_numel

    lengths = [8, 16, 24, 8 * 127, 8 * 128, 8 * 129, 8 * 4095, 8 * 4096, 8 * 4097]
    # buffers padded for n workers, and one pad unit beyond
    lengths += [padded_numel(1000, n) for n in (2, 8, 64)] + [padded_numel(1000, 64) + 8]
    if not smoke:
        lengths += [padded_numel(1_000_003, 64), padded_numel(1_000_003, 64) - 8]
    return lengths


def check_packer(ctx: Context) -> list[Record]:
    from pretrain.comm import padded_numel
    from pretrain.comm.packing import CupySignPacker, TorchSignPacker, _import_cupy, pack_signs, unpack_signs

    device = ctx.device
    packers: dict[str, Any] = {"torch": TorchSignPacker()}
    cupy_module = _import_cupy() if device.type == "cuda" else None
    if cupy_module is not None:
        packers["cupy"] = CupySignPacker(cupy_module)
    elif device.type == "cuda":
        ctx.fail("packer: cupy does not import on this CUDA machine (pip install '.[gpu]')")
    differing: list[str] = []
    cases = 0
    for dtype in (torch.float32, torch.bfloat16):
        for index, length in enumerate(packer_lengths(ctx.smoke)):
            values = _planted(length, dtype, seed=index)
            expected = pack_signs(values)
            expected_unpacked = unpack_signs(expected)
            rows = 8 if (length // 8) % 8 == 0 else 1
            scales = torch.rand(rows, generator=torch.Generator().manual_seed(index)) + 0.5
            expected_scaled = unpack_signs(expected).view(rows, -1).mul(scales.view(-1, 1)).view(-1)
            on_device = values.to(device)
            for name, packer in packers.items():
                cases += 1
                packed = packer.pack(on_device)
                if not torch.equal(packed.cpu(), expected):
                    differing.append(f"{name} pack {dtype} n={length}")
                if not torch.equal(packer.unpack(packed).cpu(), expected_unpacked):
                    differing.append(f"{name} unpack {dtype} n={length}")
                got = packer.unpack_scaled(packed.view(rows, -1), scales.to(device)).cpu()
                if not torch.equal(got, expected_scaled):
                    differing.append(f"{name} unpack_scaled {dtype} n={length}")
    # the BERT-Large buffer itself (padded for 64 workers), every packer against the torch one on this device
    numel = padded_numel(BERT_LARGE_NUMEL, 64) if not ctx.smoke else padded_numel(200_000, 64)
    values = torch.randn(numel, device=device)
    values[:: 1 << 16] = 0.0
    values[1 :: 1 << 16] = -0.0
    values[2 :: 1 << 16] = math.nan
    reference = packers["torch"].pack(values).clone()
    for name, packer in packers.items():
        if name != "torch" and not torch.equal(packer.pack(values), reference):
            differing.append(f"{name} pack of the full buffer ({numel})")
    if device.type == "cuda" and not torch.equal(
        reference[:4096].cpu(), pack_signs(values[: 4096 * 8].cpu())
    ):
        differing.append("torch pack on the GPU vs the CPU")
    if differing:
        ctx.fail(f"packer: bytes differ in {len(differing)} cases: {differing[:6]}")
    config = ctx.config(
        packers=sorted(packers),
        lengths=packer_lengths(ctx.smoke),
        dtypes=["float32", "bfloat16"],
        planted="±0, ±Inf, NaN, ±1e-42 (subnormal)",
        differing=differing,
        cases=cases,
    )
    records = [Record("packer_cases_differing", float(len(differing)), "cases", target="0", config=config)]

    # throughput over the BERT-Large buffer
    packed = reference
    decoded = torch.empty(numel, device=device)
    copy_target = torch.empty_like(values)
    reps = 3 if ctx.smoke else 20
    funcs: dict[str, Callable[[], Any]] = {"copy": lambda: copy_target.copy_(values)}
    for name, packer in packers.items():
        funcs[f"pack_{name}"] = lambda p=packer: p.pack(values, out=packed)
        funcs[f"unpack_{name}"] = lambda p=packer: p.unpack(packed, out=decoded)
    seconds = interleaved(funcs, device, warmup=2, reps=reps)
    moved = {"pack": 4 * numel + numel // 8, "unpack": numel // 8 + 4 * numel, "copy": 8 * numel}
    gbps = {name: moved[name.split("_")[0]] / t / 1e9 for name, t in seconds.items()}
    timing = ctx.config(numel=numel, reps=reps, statistic="median", bytes="read + written, fp32 values")
    for op in ("pack", "unpack"):
        records.append(
            Record(
                f"{op}_torch_gbps",
                gbps[f"{op}_torch"],
                "GB/s",
                "device-to-device copy",
                gbps["copy"],
                config=timing,
            )
        )
        if "cupy" in packers:
            records.append(
                Record(
                    f"{op}_cupy_gbps",
                    gbps[f"{op}_cupy"],
                    "GB/s",
                    "torch packer",
                    gbps[f"{op}_torch"],
                    config=timing,
                )
            )
    return records


# ------------------------------------------------------------------------------------ 2. allreduce

BERT_LARGE_NUMEL = 336_000_000  # bench.comm's figure for BERT-Large's flat buffer (≈335.2M parameters)


def _toy_layout(numel: int, world_size: int):
    """Blocks like BERT's: an embedding of 37 rows of 16 (a scale per row), a vector with a scale per
    element, a matrix, and the rest (as tests/distributed/test_compressed_layouts.py)."""
    from pretrain.comm.layout import Block, ScaleLayout

    used = 37 * 16 + 13 + 64
    blocks = [Block(37 * 16, 16), Block(13, 1), Block(64, 64), Block(numel - used, numel - used)]
    return ScaleLayout.from_blocks(blocks, numel, world_size)


def _allreduce_matches(
    ctx: Context, world_size: int, exchange: str, calls: int = 3, kernels: str | None = None
) -> dict[str, Any]:
    """The engine on `ctx.device` against the CPU reference over `calls` calls: the fraction of output
    elements off by more than rounding (1e-5 relative), the largest relative L2 difference, and how many
    calls were bitwise equal. The GPU's reductions sum in another order than the CPU's, so scales may differ
    in the last bit, and an error-fed value that rounding puts on the other side of zero flips its sign:
    such elements are counted, and must stay rare (`check_allreduce`). ``kernels``: the engine's elementwise
    passes (None: the device's default). ``outputs``: the engine's output of every call (on the CPU)."""
    from pretrain.comm import CompressedAllreduce, padded_numel
    from pretrain.comm.reference import ReferenceCompressedAllreduce

    numel = padded_numel(5000, world_size)
    layout = _toy_layout(numel, world_size) if exchange == "default" else None
    sign_scale, scale_dtype = ("mean_abs", "bfloat16") if exchange == "default" else ("rms", "float32")
    engine = CompressedAllreduce(
        numel,
        device=ctx.device,
        virtual_workers=world_size,
        layout=layout,
        sign_scale=sign_scale,
        scale_dtype=scale_dtype,
        kernels=kernels,
    )
    reference = ReferenceCompressedAllreduce(numel, world_size, layout, sign_scale, scale_dtype)
    worst, equal, off, outputs = 0.0, 0, 0, []
    for call in range(calls):
        generator = torch.Generator().manual_seed(call)
        inputs = [torch.randn(numel, generator=generator) * (1 + w / world_size) for w in range(world_size)]
        out = torch.empty(numel, device=ctx.device)
        engine(torch.stack(inputs).to(ctx.device), out)
        expected = reference(inputs)
        got = out.cpu()
        outputs.append(got)
        if not torch.isfinite(got).all():
            return {
                "off_fraction": math.inf,
                "relative_l2": math.inf,
                "bitwise_equal_calls": equal,
                "outputs": [],
            }
        worst = max(worst, float((got - expected).norm() / expected.norm()))
        equal += int(torch.equal(got, expected))
        off += int(((got - expected).abs() > 1e-5 * expected.abs() + 1e-30).sum())
    return {
        "off_fraction": off / (calls * numel),
        "relative_l2": worst,
        "bitwise_equal_calls": equal,
        "outputs": outputs,
    }


def _fitting_share(world_size: int, numel: int, smoke: bool) -> float:
    """The largest share 1, 1/2, 1/4, ... of `numel` whose k-worker state (input and worker errors,
    2·4·k·N bytes, plus a fifth more) fits in 80 % of the GPU's free memory."""
    if smoke or not torch.cuda.is_available():
        return 1.0
    _free_memory()  # what earlier measurements left in the caching allocator counts as free
    free, _ = torch.cuda.mem_get_info()
    share = 1.0
    while 2 * 4 * world_size * numel * share * 1.2 > 0.8 * free and share > 1 / 64:
        share /= 2
    return share


def _time_allreduce(ctx: Context, world_size: int, numel: int, options: dict[str, Any]) -> float:
    """Median seconds of one call of `world_size` simulated workers over `numel` elements."""
    from pretrain.comm import CompressedAllreduce

    engine = CompressedAllreduce(numel, device=ctx.device, virtual_workers=world_size, **options)
    local = torch.empty(world_size, numel, device=ctx.device)
    out = torch.empty(numel, device=ctx.device)
    seconds = interleaved(
        {"call": lambda: engine(local, out)},
        ctx.device,
        warmup=1,
        reps=2 if ctx.smoke else 5,
        before=lambda: local.normal_(),  # the call uses its input as scratch: fresh values every time
    )["call"]
    return seconds


def _error_line(error: Exception) -> str:
    """An exception as one line for a failure message: its type and its message's first line (any message,
    an empty one too), at most 300 characters."""
    return f"{type(error).__name__}: {error}".splitlines()[0][:300]


def _guarded(ctx: Context, what: str, function: Callable[..., Any], *args: Any) -> Any:
    """`function(ctx, *args)`, or None with the failure recorded: the compiled kernels' arms must not take
    the torch kernels' figures of the same check down with them."""
    try:
        return function(ctx, *args)
    except Exception as error:
        traceback.print_exc()
        ctx.fail(f"allreduce: {what}: {_error_line(error)}")
        return None


def _compiled_against_torch(ctx: Context, exchange: str, torch_outputs: list[torch.Tensor]) -> Record:
    """The engine with the compiled kernels (`pretrain.comm.compiled_kernels`) at n = 8: off the CPU reference
    as the torch kernels may be (a failure otherwise), and the fraction of output elements that differ from
    the torch kernels' on this device (0: bitwise, what the kernels promise)."""
    match = _allreduce_matches(ctx, 8, exchange, kernels="compiled")
    outputs = match.pop("outputs")
    if not match["off_fraction"] <= 1e-3:
        ctx.fail(
            f"allreduce: n=8 {exchange} exchange with the compiled kernels is off the reference: {match}"
        )
    compared = sum(o.numel() for o in torch_outputs)
    differing = sum(int((a != b).sum()) for a, b in zip(torch_outputs, outputs, strict=False))
    # a missing or non-finite call on either side (no outputs to compare) counts as everything differing
    fraction = differing / compared if compared and len(outputs) == len(torch_outputs) else math.inf
    config = ctx.config(world_size=8, exchange=exchange, calls=3, compiled_vs_reference=match)
    return Record(
        f"allreduce_n8_{exchange}_compiled_vs_torch_kernels",
        fraction,
        "fraction of elements differing",
        target="0 (bitwise: the same arithmetic in the same order)",
        config=config,
    )


def check_allreduce(ctx: Context) -> list[Record]:
    from bench.comm import default_layout_options
    from pretrain.comm import padded_numel

    records: list[Record] = []
    for world_size in (8, 64):
        for exchange in ("deepspeed", "default"):
            match = _allreduce_matches(ctx, world_size, exchange, kernels="torch")
            outputs = match.pop("outputs")
            if not match["off_fraction"] <= 1e-3:
                ctx.fail(f"allreduce: n={world_size} {exchange} exchange is off the reference: {match}")
            config = ctx.config(
                world_size=world_size,
                exchange=exchange,
                calls=3,
                kernels="torch",
                **match,
                reference="pretrain.comm.reference.ReferenceCompressedAllreduce on the CPU",
                off="elements differing by more than 1e-5 relative (rounding-level sign flips at zero)",
            )
            records.append(
                Record(
                    f"allreduce_n{world_size}_{exchange}_vs_reference",
                    match["off_fraction"],
                    "fraction of elements off",
                    target="<= 1e-3",
                    config=config,
                )
            )
            if world_size == 8:
                compared = _guarded(
                    ctx, f"n=8 {exchange} compiled kernels", _compiled_against_torch, exchange, outputs
                )
                records += [compared] if compared is not None else []

    full = BERT_LARGE_NUMEL if not ctx.smoke else 2_000_000
    copy_source = torch.randn(padded_numel(full, 64), device=ctx.device)
    copy_target = torch.empty_like(copy_source)
    copy = interleaved({"copy": lambda: copy_target.copy_(copy_source)}, ctx.device, warmup=1, reps=5)["copy"]

    _free_memory()
    peer = "one fp32 copy of the BERT-Large buffer (read + write)"
    compiled_peer = "the same call with the torch kernels (kernels=torch), same process"
    if not ctx.smoke:
        padded, options = default_layout_options(BERT_LARGE_NUMEL, 8)
        share = _fitting_share(8, padded, ctx.smoke)
        if share == 1.0:
            per_call = {"torch": _time_allreduce(ctx, 8, padded, {**options, "kernels": "torch"})}
            compiled = _guarded(
                ctx,
                "n=8 default compiled timing",
                _time_allreduce,
                8,
                padded,
                {**options, "kernels": "compiled"},
            )
            per_call["compiled"] = math.nan if compiled is None else compiled
            config = ctx.config(
                world_size=8,
                numel=padded,
                exchange="default (per-column, mean_abs, bf16 scales)",
                per_call_s=per_call,
                copy_s=copy,
                statistic="median of 5",
            )
            torch_worker, compiled_worker = per_call["torch"] / 8, per_call["compiled"] / 8
            records.append(
                Record("allreduce_n8_default_per_worker", torch_worker, "s", peer, copy, config=config)
            )
            records.append(
                Record(
                    "allreduce_n8_default_per_worker_compiled",
                    compiled_worker,
                    "s",
                    compiled_peer,
                    torch_worker,
                    target="< 1 (issue #15: the passes at memory speed; the copy in config is the ceiling)",
                    config=config,
                )
            )
    for world_size in (8, 64):
        padded = padded_numel(full, world_size)
        share = _fitting_share(world_size, padded, ctx.smoke)
        numel = padded_numel(int(full * share), world_size)
        per_call = {"torch": _time_allreduce(ctx, world_size, numel, {"kernels": "torch"})}
        if world_size == 8:
            compiled = _guarded(
                ctx, "n=8 single compiled timing", _time_allreduce, world_size, numel, {"kernels": "compiled"}
            )
            per_call["compiled"] = math.nan if compiled is None else compiled
        # per worker: the call's time / n, scaled to the whole buffer
        per_worker = {kernels: seconds / world_size * padded / numel for kernels, seconds in per_call.items()}
        config = ctx.config(
            world_size=world_size,
            numel_measured=numel,
            share_of_bert_large=share,
            per_call_s=per_call,
            copy_s=copy,
            exchange="DeepSpeed (one rms scale per chunk, fp32)",
            statistic="median of 5",
            note="per worker: the call's time / n, scaled by the share when the k workers' state did not fit",
        )
        name = f"allreduce_n{world_size}_single_per_worker"
        records.append(Record(name, per_worker["torch"], "s", peer, copy, config=config))
        if "compiled" in per_worker:
            records.append(
                Record(
                    f"{name}_compiled",
                    per_worker["compiled"],
                    "s",
                    compiled_peer,
                    per_worker["torch"],
                    config=config,
                )
            )
    return records


# ---------------------------------------------------------------------------------------- 3. optim


def _param_holder(ctx: Context) -> torch.nn.Module:
    from transformers import BertConfig

    from bench.optim import bert_parameters

    if ctx.smoke:
        config = BertConfig(
            vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256
        )
        return bert_parameters(False, config).to(ctx.device)
    return bert_parameters(True).to(ctx.device)


def check_optim(ctx: Context) -> list[Record]:
    from bench.optim import PEER_ADAMW, Contenders

    holder = _param_holder(ctx)
    numel = sum(p.numel() for p in holder.parameters())
    contenders = Contenders(holder)
    names = ("adamw", "lamb", "compiled", "onebit_default", "onebit_compiled")
    optimizers: dict[str, Any] = {}
    compile_seconds: dict[str, float] = {}
    for name in names:
        started = time.perf_counter()
        optimizers[name] = contenders.build(name)  # the compiled ones step (and compile) once here
        _sync(ctx.device)
        compile_seconds[name] = round(time.perf_counter() - started, 1)
    reps = 3 if ctx.smoke else 10
    medians = interleaved({n: optimizers[n].step for n in names}, ctx.device, warmup=2, reps=reps)
    config = ctx.config(
        shapes="BERT-Large" if not ctx.smoke else "toy",
        num_params=numel,
        dtype="float32",
        reps=reps,
        statistic="median step seconds, the five interleaved",
        build_and_first_steps_s=compile_seconds,
        onebit="the project's default exchange (conf/optim/onebit_lamb.yaml), compression stage, one process",
    )
    labels = {
        "lamb": "lamb_eager_step",
        "compiled": "lamb_compiled_step",
        "onebit_default": "onebit_lamb_compression_step",
        "onebit_compiled": "onebit_lamb_compiled_compression_step",
    }
    records = [
        Record(labels[n], medians[n], "s", PEER_ADAMW, medians["adamw"], config=config) for n in labels
    ]
    ctx.results["lamb_step_s"] = medians["compiled"]
    del optimizers, contenders, holder
    _free_memory()
    return records


# ----------------------------------------------------------------------------------- 4. throughput


def _pretraining_batch(micro: int, seq: int, masked: int, vocab: int, device: torch.device) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seq)
    labels = torch.full((micro, seq), -100, dtype=torch.long)
    mlm_positions = torch.zeros(micro, masked, dtype=torch.long)  # as the collator gives them
    for row in range(micro):
        positions = torch.randperm(seq - 2, generator=generator)[:masked] + 1
        labels[row, positions] = torch.randint(vocab, (masked,), generator=generator)
        mlm_positions[row] = positions.sort().values
    token_type_ids = torch.zeros(micro, seq, dtype=torch.long)
    token_type_ids[:, seq // 2 :] = 1
    batch = {
        "input_ids": torch.randint(vocab, (micro, seq), generator=generator),
        "token_type_ids": token_type_ids,
        "attention_mask": torch.ones(micro, seq, dtype=torch.long),
        "labels": labels,
        "next_sentence_label": torch.randint(2, (micro,), generator=generator),
        "mlm_positions": mlm_positions,
    }
    return {k: v.to(device) for k, v in batch.items()}


def _training_step(
    ctx: Context, objective: Any, batch: dict[str, Any], cuda_graphs: bool = False
) -> Callable[[], None]:
    """The pretrainer's micro-step (pretrain/train/trainer.py `_micro_step`) without the loss scaler: forward
    under bf16 autocast, backward; gradients accumulate. ``cuda_graphs`` (an objective compiled with
    mode="reduce-overhead"): every step marked as a new graph replay, and the gradients allocated before the
    first, so that accumulation adds the graph's outputs into them instead of keeping the graph's own memory
    as ``.grad`` (which the next replay overwrites: "accessing tensor output of CUDAGraphs that has been
    overwritten", seen on an H200)."""
    from pretrain.distributed.process_group import autocast_context

    parameters = [p for p in objective.parameters() if p.requires_grad] if cuda_graphs else []

    def step() -> None:
        if cuda_graphs:
            for parameter in parameters:
                if parameter.grad is None:
                    parameter.grad = torch.zeros_like(parameter)
            torch.compiler.cudagraph_mark_step_begin()
        with autocast_context(ctx.device, "bf16"):
            mlm, nsp, _, _ = objective(**batch)
        (mlm + nsp).backward()

    return step


def _samples_per_s(
    ctx: Context,
    model: torch.nn.Module,
    objective: Any,
    batch: dict[str, Any],
    reps: int,
    cuda_graphs: bool = False,
) -> tuple[float, float]:
    """(samples/s over `reps` timed steps, seconds of the first step: the compile, if any)."""
    step = _training_step(ctx, objective, batch, cuda_graphs)
    started = time.perf_counter()
    step()
    _sync(ctx.device)
    first_s = time.perf_counter() - started
    step()
    seconds = time_once(lambda: [step() for _ in range(reps)], ctx.device) / reps
    model.zero_grad(set_to_none=True)
    return len(batch["input_ids"]) / seconds, first_s


def check_throughput(ctx: Context) -> list[Record]:
    from pretrain.model import SIZES, ModelConfig, ModelSize, PretrainingObjective, build_model

    size = ModelSize.bert_tiny if ctx.smoke else ModelSize.bert_large
    vocab = 30522
    model = build_model(ModelConfig(size=size), vocab, ctx.device)
    model.train()
    eager = PretrainingObjective(model)
    layers, hidden, _, intermediate = SIZES[size]
    records: list[Record] = []
    seqs = (128, 512) if not ctx.smoke else (32,)
    for seq in seqs:
        micro = MICRO_BATCH.get(seq, 4) if not ctx.smoke else 4
        masked = MASKED_PER_SEQUENCE.get(seq, max(1, seq * 15 // 100))
        batch = _pretraining_batch(micro, seq, masked, vocab, ctx.device)
        flops = training_flops(seq, masked, layers, hidden, intermediate, vocab)
        # one static graph per sequence length (dynamic=False): a second length would otherwise recompile
        # with dynamic shapes, slower kernels than either length gets alone
        torch._dynamo.reset()  # a fresh cache per compile: past its recompile limit Dynamo runs eager
        compiled = torch.compile(eager, dynamic=False)
        for mode, objective in (("eager", eager), ("compiled", compiled)):
            needs = 20 if mode == "eager" else 110
            if ctx.left() < needs and not ctx.smoke:
                ctx.fail(f"throughput: seq {seq} {mode} not run, {ctx.left():.0f} s of --budget-s left")
                continue

            reps = 2 if ctx.smoke else 10
            samples_per_s, first_s = _samples_per_s(ctx, model, objective, batch, reps)
            seconds = micro / samples_per_s
            ctx.results[f"seq{seq}_{mode}_samples_per_s"] = samples_per_s
            kernels: dict[str, Any] = {}
            if mode == "compiled":  # where the step goes, from 3 more steps (~1 s)
                kernels = _kernel_breakdown(ctx, f"seq {seq} compiled", objective, batch, seconds)
                model.zero_grad(set_to_none=True)
            config = ctx.config(
                model=size.value,
                seq=seq,
                micro_batch=micro,
                masked_per_sequence=masked,
                precision="bf16 autocast",
                attention="sdpa",
                mode=mode,
                first_step_s=round(first_s, 1),
                reps=reps,
                flops_per_sequence=flops,
                flops_formula="bench.gpu.training_flops",
                peak_tflops=ctx.peak,
                **kernels,
            )
            nvidia = NVIDIA_SAMPLES_PER_S.get(seq)
            scaled = nvidia * ctx.peak / NVIDIA_PEAK_TFLOPS if (nvidia and ctx.peak) else None
            peer = (
                f"NVIDIA DLE A100-80GB {nvidia:g} samples/s x peak {ctx.peak:g}/{NVIDIA_PEAK_TFLOPS:g}"
                if scaled
                else None
            )
            name = f"bert_large_seq{seq}_{mode}" if not ctx.smoke else f"toy_seq{seq}_{mode}"
            records.append(
                Record(
                    f"{name}_samples_per_s", samples_per_s, "samples/s", peer, scaled, ">= 1.0", config=config
                )
            )
            if ctx.peak:
                mfu = samples_per_s * flops / (ctx.peak * 1e12)
                nvidia_mfu = nvidia * flops / (NVIDIA_PEAK_TFLOPS * 1e12) if nvidia else None
                records.append(
                    Record(
                        f"{name}_mfu",
                        mfu,
                        "fraction of peak",
                        "NVIDIA DLE MFU on A100 (same formula)",
                        nvidia_mfu,
                        ">= 1.0",
                        config=config,
                    )
                )
            lamb = ctx.results.get("lamb_step_s")
            if lamb and seq in NVIDIA_GLOBAL_BATCH:
                accumulation = NVIDIA_GLOBAL_BATCH[seq] // (NVIDIA_GPUS * micro)
                with_step = accumulation * micro / (accumulation * seconds + lamb)
                step_config = {**config, "accumulation": accumulation, "lamb_compiled_step_s": lamb}
                records.append(
                    Record(
                        f"{name}_samples_per_s_with_lamb_step",
                        with_step,
                        "samples/s",
                        peer,
                        scaled,
                        ">= 1.0",
                        config=step_config,
                    )
                )
    del model, eager
    _free_memory()
    return records


KERNEL_CLASSES = (
    ("attention", ("flash", "fmha", "attention", "efficient")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_")),
    ("fused (triton)", ("triton",)),
)


def _kernel_class(name: str) -> str:
    lowered = name.lower()
    for label, keys in KERNEL_CLASSES:
        if any(key in lowered for key in keys):
            return label
    return "other"


def _kernel_profile(ctx: Context, step: Callable[[], None], steps: int) -> tuple[dict[str, float], str]:
    """Device seconds per step by kernel class, and a table of the 25 costliest kernels."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        _sync(ctx.device)
    kernels = []
    for event in prof.key_averages():
        if ctx.device.type == "cuda" and event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        total = getattr(event, "self_device_time_total", None)
        if total is None or ctx.device.type != "cuda":
            total = event.self_cpu_time_total
        kernels.append((total / 1e6 / steps, event.count // steps, event.key))
    kernels.sort(reverse=True)
    classes: dict[str, float] = {}
    for seconds, _, name in kernels:
        classes[_kernel_class(name)] = classes.get(_kernel_class(name), 0.0) + seconds
    lines = [f"{'ms/step':>9s} {'calls':>6s}  {'class':15s} kernel"]
    lines += [f"{s * 1e3:9.3f} {c:6d}  {_kernel_class(n):15s} {n[:110]}" for s, c, n in kernels[:25]]
    return classes, "\n".join(lines)


def _kernel_breakdown(
    ctx: Context,
    label: str,
    objective: Any,
    batch: dict[str, Any],
    step_seconds: float,
    cuda_graphs: bool = False,
) -> dict[str, Any]:
    """The step's device seconds by kernel class (config fields), its share of the timed step and the share
    no kernel ran (launch gaps, host syncs); the costliest kernels go to `ctx.kernel_tables[label]`."""
    classes, table = _kernel_profile(ctx, _training_step(ctx, objective, batch, cuda_graphs), steps=3)
    ctx.kernel_tables[label] = table
    busy = sum(classes.values())
    return {
        "kernel_seconds_per_step": classes,
        "step_seconds": step_seconds,
        "kernel_share": {k: round(v / step_seconds, 3) for k, v in classes.items()},
        "idle_share": round(max(0.0, 1 - busy / step_seconds), 3),
    }


def _host_syncs(ctx: Context, step: Callable[[], None]) -> int:
    """Synchronizing CUDA calls in one step (`torch.cuda.set_sync_debug_mode("warn")`); 0 off CUDA."""
    if ctx.device.type != "cuda":
        return 0
    import warnings

    _sync(ctx.device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


# check_profile's arms, by mode, in the order they run (the costliest last: a compile each, ~1 min)
PROFILE_ARMS = {
    "eager": ("baseline", "no_mask", "no_dropout", "column_major", "boolean_index"),
    "compiled": (
        "baseline",
        "layers4",
        "cuda_graphs",
        "micro128",
        "column_major",
        "no_mask",
        "coordinate_descent",
    ),
}


def check_profile(ctx: Context) -> list[Record]:
    """Where BERT-Large's seq-128 step spends its time (opt-in: `--steps=profile`), against the baseline step
    of `throughput` (compiled here only when that check did not run): arms that each change one thing.
    `no_mask` drops the all-ones attention mask (SDPA without a mask), `no_dropout` dropout,
    `column_major` stores the linear weights as 1-bit LAMB's per-column exchange does
    (`pretrain.model.column_major_linear_weights_`: what `make pretrain OPT=onebit_lamb` trains),
    `boolean_index` gathers the masked positions with a boolean index (as before the collator's static
    `mlm_positions`), `layers4` keeps 4 of the 24 layers (the GPU's idle time per layer, and the host syncs
    of one compiled step, `host_syncs`), `cuda_graphs` compiles with `mode="reduce-overhead"` (the step
    replayed as CUDA graphs: no launch gaps), `micro128` doubles the micro-batch (half the launches per
    sample), `coordinate_descent` compiles with Inductor's coordinate-descent tuning of its generated
    kernels. Eager: every arm; compiled: each only while 90 s of the budget are left. An arm that fails is
    reported and the others run. Every compiled arm's kernels by class in its config, the costliest in
    gpu_kernels.txt."""
    from pretrain.model import (
        ModelConfig,
        ModelSize,
        PretrainingObjective,
        build_model,
        column_major_linear_weights_,
    )

    size = ModelSize.bert_tiny if ctx.smoke else ModelSize.bert_large
    seq = 32 if ctx.smoke else 128
    micro = 4 if ctx.smoke else MICRO_BATCH[128]
    masked = MASKED_PER_SEQUENCE.get(seq, 5)
    reps = 2 if ctx.smoke else 10
    batch = _pretraining_batch(micro, seq, masked, 30522, ctx.device)
    inputs = {
        "baseline": batch,
        "no_mask": {**batch, "attention_mask": None},
        # a data-dependent shape: a host sync on the GPU and a graph break
        "boolean_index": {k: v for k, v in batch.items() if k != "mlm_positions"},
        "micro128": _pretraining_batch(2 * micro, seq, masked, 30522, ctx.device),
    }

    def model_for(arm: str) -> torch.nn.Module:
        dropout = 0.0 if arm == "no_dropout" else 0.1
        config = ModelConfig(size=size, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
        model = build_model(config, 30522, ctx.device).train()
        if arm == "column_major":
            column_major_linear_weights_(model)
        if arm == "layers4":
            model.bert.encoder.layer = model.bert.encoder.layer[:4]
        return model

    def run_arm(mode: str, label: str, config: dict[str, Any]) -> float:
        model = model_for(label)
        objective: Any = PretrainingObjective(model)
        how: dict[str, Any] = {}
        if mode == "compiled":
            torch._dynamo.reset()
            how = {  # torch.compile takes a mode or options, not both
                "cuda_graphs": {"mode": "reduce-overhead"},
                "coordinate_descent": {"options": {"coordinate_descent_tuning": True}},
            }.get(label, {})
            objective = torch.compile(objective, dynamic=False, **how)
        arm_inputs = inputs.get(label, batch)
        graphs = label == "cuda_graphs" and ctx.device.type == "cuda"
        rate, first_s = _samples_per_s(ctx, model, objective, arm_inputs, reps, graphs)
        config["first_step_s"] = round(first_s, 1)
        if mode == "compiled":
            sample_count = len(arm_inputs["input_ids"])
            label_of = f"seq {seq} compiled {label}"
            config.update(
                _kernel_breakdown(ctx, label_of, objective, arm_inputs, sample_count / rate, graphs)
            )
            if label == "layers4":
                config["host_syncs"] = _host_syncs(ctx, _training_step(ctx, objective, arm_inputs))
        model.zero_grad(set_to_none=True)
        return rate

    records: list[Record] = []
    for mode, labels in PROFILE_ARMS.items():
        baseline = None
        for label in labels:
            config = ctx.config(seq=seq, micro_batch=2 * micro if label == "micro128" else micro, mode=mode)
            config["variant"] = label
            reused = ctx.results.get(f"seq{seq}_{mode}_samples_per_s") if label == "baseline" else None
            if reused is not None:  # throughput's step: the same model, batch and compile
                rate = reused
                config["from"] = "throughput"
            elif ctx.left() < (15 if mode == "eager" else 90) and not ctx.smoke:
                ctx.fail(f"profile: {mode} {label} not run, {ctx.left():.0f} s of --budget-s left")
                continue
            else:
                try:
                    rate = run_arm(mode, label, config)
                except Exception as error:  # one arm's failure must not take the others' figures down
                    traceback.print_exc()
                    ctx.fail(f"profile: {mode} {label}: {_error_line(error)}")
                    continue
                finally:
                    torch._dynamo.reset()
                    _free_memory()
            baseline = rate if label == "baseline" else baseline
            records.append(
                Record(
                    f"profile_seq{seq}_{mode}_{label}_samples_per_s",
                    rate,
                    "samples/s",
                    f"{mode} baseline",
                    baseline,
                    config=config,
                )
            )
    return records


# ------------------------------------------------------------------------------------- 5. pipeline


def _run(cmd: list[str], log: Path, timeout: float, env: dict[str, str]) -> tuple[int, str, float]:
    started = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout, env=env
        )
        code, text = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as error:
        out = error.stdout
        code, text = 124, (out.decode() if isinstance(out, bytes) else out or "") + "\n(timed out)"
    log.write_text(text)
    return code, text, time.perf_counter() - started


def _tail(text: str, lines: int = 12) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def check_pipeline(ctx: Context) -> list[Record]:
    from data.config import REPO_ROOT, default_shared_data_dir

    data_dir = Path(os.environ.get("GPU_CHECK_DATA", REPO_ROOT / "data" / "prepared" / "tiny"))
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONUNBUFFERED": "1"}
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    logs = ctx.out_dir / "gpu_logs"
    logs.mkdir(parents=True, exist_ok=True)
    records: list[Record] = []
    if not (data_dir / "seq128" / "manifest.json").exists():
        code, text, _ = _run(
            [sys.executable, "-m", "data.prepare", "data=tiny", "show_progress=false"],
            logs / "prepare.log",
            300,
            env,
        )
        if code != 0:
            ctx.fail(f"pipeline: preparing {data_dir} failed:\n{_tail(text)}")
            return records
    run_dir = work / "run"
    base = [
        str(REPO_ROOT / "launch" / "torchrun.sh"),
        "--nproc",
        "1",
        "--",
        "batch=demo",
        "optim=onebit_lamb",
        "model=bert_tiny",
        f"data_dir={data_dir}",
        "run_name=gpu-check",
        f"run_dir={run_dir}",
        "wandb.mode=disabled",
        "show_progress=false",
        "sim_world_size=2",
        "checkpoint.every_steps=10",
        "num_workers=0",
        "log_every=5",
    ]
    if ctx.peak:
        base.append(f"peak_tflops={ctx.peak}")
    backend = "nccl" if ctx.device.type == "cuda" else "gloo"
    stages = [
        ("pretrain_to_step_20", ["max_steps=20"], "checkpoints/step-00000020"),
        ("resume_to_step_30", ["max_steps=30"], "checkpoints/step-00000030"),
    ]
    for name, extra, checkpoint in stages:
        code, text, seconds = _run(base + extra, logs / f"{name}.log", 240, env)
        ok = code == 0 and (run_dir / checkpoint / "COMPLETE").exists()
        if name.startswith("resume") and "resumed from" not in text:
            ok = False
        # the pre-flight lines name the backend and the precision the run took
        expected = ("nccl", "precision bf16") if ctx.device.type == "cuda" else ("gloo", "precision fp32")
        missing = [word for word in expected if word not in text]
        if missing:
            ok = False
            text += f"\n(the log does not mention {missing})"
        if not ok:
            ctx.fail(f"pipeline: {name} (exit {code}):\n{_tail(text)}")
        kernels = re.search(r"1-bit compression on this machine's \w+: (.+)", text)
        config = ctx.config(
            command=" ".join(base + extra),
            exit_code=code,
            checkpoint=checkpoint,
            backend=backend,
            comm_kernels=kernels.group(1).strip() if kernels else None,  # what the trainer's exchange ran
            log_tail=_tail(text, 4),
        )
        records.append(
            Record(f"pipeline_{name}", seconds, "s", target="exit 0, checkpoint written", config=config)
        )
        if not ok:
            return records
    glue = default_shared_data_dir() / "glue_data"
    finetune = [
        sys.executable,
        "-m",
        "finetune",
        "task=mrpc",
        f"model_path={run_dir}",
        f"output_dir={work / 'mrpc'}",
        "seeds=[1]",
        "show_progress=false",
        "wandb.mode=disabled",
        "task.epochs=1",
        "task.max_train_examples=256",
        "task.max_eval_examples=128",
        "precision=bf16" if ctx.device.type == "cuda" else "precision=fp32",
        f"data_dir={glue}" if glue.exists() else "data_dir=null",
    ]
    code, text, seconds = _run(finetune, logs / "finetune.log", 240, env)
    results = list((work / "mrpc").rglob("*.json"))
    if code != 0 or not results:
        ctx.fail(f"pipeline: bf16 fine-tune (exit {code}):\n{_tail(text)}")
    config = ctx.config(
        command=" ".join(finetune), exit_code=code, outputs=[p.name for p in results], log_tail=_tail(text, 4)
    )
    records.append(
        Record("pipeline_finetune_mrpc", seconds, "s", target="exit 0, metrics written", config=config)
    )
    if not ctx.failures:
        shutil.rmtree(work, ignore_errors=True)
    return records


CHECKS: dict[str, Callable[[Context], list[Record]]] = {
    "packer": check_packer,
    "allreduce": check_allreduce,
    "optim": check_optim,
    "throughput": check_throughput,
    "pipeline": check_pipeline,
    "profile": check_profile,
}


def _write_kernel_tables(ctx: Context, result_name: str) -> None:
    """The costliest kernels of every profiled step to <out>/<result>_kernels.txt (temp name, then rename)."""
    if not ctx.kernel_tables:
        return
    tables = ctx.kernel_tables.items()
    text = "\n\n".join(f"## {label} ({ctx.device_name})\n{table}" for label, table in tables)
    path = ctx.out_dir / f"{result_name}_kernels.txt"
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text + "\n")
    temporary.replace(path)


def _summary(records: list[Record]) -> str:
    lines = [f"{'record':58s} {'value':>12s} {'peer':>12s} {'ratio':>7s}"]
    for r in records:
        peer = f"{r.peer_value:12.4g}" if r.peer_value is not None else " " * 12
        ratio = f"{r.ratio:7.3f}" if r.ratio is not None else ""
        lines.append(f"{r.name:58s} {r.value:12.4g} {peer} {ratio}")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench gpu", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", default=",".join(STEPS), help=f"comma-separated subset of {','.join(STEPS)}"
    )
    parser.add_argument("--budget-s", type=float, default=570.0, help="skip checks that would end after this")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak")
    parser.add_argument("--cpu-smoke", action="store_true", help="every check at toy sizes on the CPU")
    parser.add_argument("--out", type=Path, default=None, help="folder for gpu.json (default results/bench)")
    args = parser.parse_args(argv)
    steps = [s for s in args.steps.split(",") if s]
    unknown = [s for s in steps if s not in CHECKS]
    if unknown:
        raise SystemExit(f"bench gpu: unknown --steps {unknown}; known: {','.join(STEPS)}")
    if args.cpu_smoke:
        device, name = torch.device("cpu"), "cpu (smoke)"
    elif not torch.cuda.is_available():
        print(
            "bench gpu: no CUDA device (torch.cuda.is_available() is False): nothing to check here; run "
            "`make gpu-check` on a GPU machine (`--cpu-smoke` runs the checks at toy sizes on the CPU)"
        )
        return
    else:
        device = torch.device("cuda", torch.cuda.current_device())
        name = torch.cuda.get_device_name(device)
    started = time.perf_counter()
    ctx = Context(
        device=device,
        smoke=args.cpu_smoke,
        deadline=started + args.budget_s,
        peak=args.peak_tflops or (peak_tflops(name) if device.type == "cuda" else None),
        out_dir=Path(args.out or RESULTS_DIR),
        device_name=name,
    )
    result_name = "gpu_smoke" if args.cpu_smoke else "gpu"
    print(
        f"[bench gpu] {name}, peak bf16 {ctx.peak} TFLOP/s, torch {torch.__version__}, checks {steps}",
        flush=True,
    )
    records: list[Record] = []
    for step in steps:
        left = ctx.deadline - time.perf_counter()
        if left < STEP_SECONDS[step] and not args.cpu_smoke:
            ctx.fail(f"{step}: not run, {left:.0f} s of --budget-s left (needs up to {STEP_SECONDS[step]} s)")
            continue
        step_started = time.perf_counter()
        try:
            records += CHECKS[step](ctx)
        except Exception as error:  # one check's failure must not hide the others' results
            traceback.print_exc()
            message = _error_line(error)
            ctx.fail(f"{step}: {message}")
            records.append(Record(f"{step}_error", math.nan, "", config=ctx.config(error=message)))
        _free_memory()
        print(f"[bench gpu] {step}: {time.perf_counter() - step_started:.1f} s", flush=True)
        # after every check: a cut-off run keeps what it did
        write_records(result_name, records, ctx.out_dir, quiet=step != steps[-1])
        _write_kernel_tables(ctx, result_name)
    print(_summary(records))
    print(f"[bench gpu] {time.perf_counter() - started:.0f} s; ", end="")
    if ctx.failures:
        print(f"{len(ctx.failures)} failed:\n  " + "\n  ".join(m.splitlines()[0] for m in ctx.failures))
        raise SystemExit(1)
    print("every check passed")
