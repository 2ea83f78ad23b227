"""Which machine a run's numbers come from: the same code and seed give different floats on different
CPUs (their math libraries take different code paths), and the same code measures differently (the numba
passes were 11x apart on two of this project's machines), so a run's config and each benchmark record name
the CPU, and a run's config its GPU."""

from __future__ import annotations

import platform

import torch


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def gpu_model(device: torch.device) -> str | None:
    """The accelerator's name for a CUDA device; None on the CPU."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None
