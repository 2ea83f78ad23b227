"""What every check shares: the run's `Context`, CUDA-event timing, the peak table and the FLOP formula."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

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
    arms: list[Any] = field(default_factory=list)  # the `arms` check's (bench.gpu.arms.Arm), --arms

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


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_once(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds of one call: CUDA events around it on a GPU (work queued before is finished first)."""
    sync(device)
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


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


BERT_LARGE_NUMEL = 336_000_000  # bench.comm's figure for BERT-Large's flat buffer (≈335.2M parameters)


def error_line(error: Exception) -> str:
    """An exception as one line for a failure message: its type and its message's first line (any message,
    an empty one too), at most 300 characters."""
    return f"{type(error).__name__}: {error}".splitlines()[0][:300]
