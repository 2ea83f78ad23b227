"""The pretrainer's step as the throughput, profile and arms checks time it, and its kernel profile."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from bench.gpu.common import Context, sync, time_once


def pretraining_batch(micro: int, seq: int, masked: int, vocab: int, device: torch.device) -> dict[str, Any]:
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


def training_step(
    ctx: Context, objective: Any, batch: dict[str, Any], cuda_graphs: bool = False
) -> Callable[[], None]:
    """The pretrainer's micro-step (pretrain/train/trainer.py `_micro_step`) without the loss scaler: forward
    under bf16 autocast, backward; gradients accumulate. ``cuda_graphs`` (an objective compiled with
    mode="reduce-overhead"): the trainer's `model.cuda_graphs` path, `pretrain.model.StaticGradients` (every
    step marked as a new graph replay, the gradients allocated before the first so that accumulation adds
    the graphs' outputs into them); on the CPU (smoke) the same path without the replay marks."""
    from pretrain.distributed.process_group import autocast_context
    from pretrain.model import StaticGradients

    gradients = None
    if cuda_graphs:
        parameters = [p for p in objective.parameters() if p.requires_grad]
        gradients = StaticGradients(parameters, mark_replays=ctx.device.type == "cuda")

    def step() -> None:
        if gradients is not None:
            gradients.begin_micro_step()
        with autocast_context(ctx.device, "bf16"):
            mlm, nsp, _, _ = objective(**batch)
        (mlm + nsp).backward()

    return step


def measure_samples_per_s(
    ctx: Context,
    model: torch.nn.Module,
    objective: Any,
    batch: dict[str, Any],
    reps: int,
    cuda_graphs: bool = False,
) -> tuple[float, float]:
    """(samples/s over `reps` timed steps, seconds of the first step: the compile, if any)."""
    step = training_step(ctx, objective, batch, cuda_graphs)
    started = time.perf_counter()
    step()
    sync(ctx.device)
    first_s = time.perf_counter() - started
    step()
    seconds = time_once(lambda: [step() for _ in range(reps)], ctx.device) / reps
    model.zero_grad(set_to_none=True)
    return len(batch["input_ids"]) / seconds, first_s


KERNEL_CLASSES = (
    ("attention", ("flash", "fmha", "attention", "efficient")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_")),
    ("fused (triton)", ("triton",)),
)


def kernel_class(name: str) -> str:
    lowered = name.lower()
    for label, keys in KERNEL_CLASSES:
        if any(key in lowered for key in keys):
            return label
    return "other"


def kernel_profile(ctx: Context, step: Callable[[], None], steps: int) -> tuple[dict[str, float], str]:
    """Device seconds per step by kernel class, and a table of the 25 costliest kernels."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync(ctx.device)
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
        classes[kernel_class(name)] = classes.get(kernel_class(name), 0.0) + seconds
    lines = [f"{'ms/step':>9s} {'calls':>6s}  {'class':15s} kernel"]
    lines += [f"{s * 1e3:9.3f} {c:6d}  {kernel_class(n):15s} {n[:110]}" for s, c, n in kernels[:25]]
    return classes, "\n".join(lines)


def kernel_breakdown(
    ctx: Context,
    label: str,
    objective: Any,
    batch: dict[str, Any],
    step_seconds: float,
    cuda_graphs: bool = False,
) -> dict[str, Any]:
    """The step's device seconds by kernel class (config fields), its share of the timed step and the share
    no kernel ran (launch gaps, host syncs); the costliest kernels go to `ctx.kernel_tables[label]`."""
    classes, table = kernel_profile(ctx, training_step(ctx, objective, batch, cuda_graphs), steps=3)
    ctx.kernel_tables[label] = table
    busy = sum(classes.values())
    return {
        "kernel_seconds_per_step": classes,
        "step_seconds": step_seconds,
        "kernel_share": {k: round(v / step_seconds, 3) for k, v in classes.items()},
        "idle_share": round(max(0.0, 1 - busy / step_seconds), 3),
    }


def host_syncs(ctx: Context, step: Callable[[], None]) -> int:
    """Synchronizing CUDA calls in one step (`torch.cuda.set_sync_debug_mode("warn")`); 0 off CUDA."""
    if ctx.device.type != "cuda":
        return 0
    import warnings

    sync(ctx.device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)
