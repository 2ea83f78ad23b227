"""Check 2, `allreduce`: the compressed allreduce on the device against the CPU reference, and its time."""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable
from typing import Any

import torch

from bench.gpu.common import BERT_LARGE_NUMEL, Context, error_line, free_memory, interleaved
from bench.records import Record

# ------------------------------------------------------------------------------------ 2. allreduce


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
    free_memory()  # what earlier measurements left in the caching allocator counts as free
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


def _guarded(ctx: Context, what: str, function: Callable[..., Any], *args: Any) -> Any:
    """`function(ctx, *args)`, or None with the failure recorded: the compiled kernels' arms must not take
    the torch kernels' figures of the same check down with them."""
    try:
        return function(ctx, *args)
    except Exception as error:
        traceback.print_exc()
        ctx.fail(f"allreduce: {what}: {error_line(error)}")
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

    free_memory()
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
