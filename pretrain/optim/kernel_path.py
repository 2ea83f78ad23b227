"""Which implementation runs the optimizers' eager steps: the one place that chooses.

- `cpu`: the numba loops where they can run (`lamb_loops`, `live_step`, `marginals`: CPU fp32 tensors,
  numba importable), else the torch reference (`functional`) in chunks of about a million elements
  (`base.CPU_CHUNK_NUMEL`), the chunk's passes in cache. What the digests and the CPU study run.
- `multi_tensor`: the torch functions over whole parameter groups in multi-tensor (foreach) ops, so that
  one step issues a number of ops that does not grow with the number of tensors (BERT-Large: 398): a
  per-tensor value (a trust ratio, a factor) is expanded to the elements of its tensor
  (`functional.per_tensor`) instead of entering a foreach op as a 0-dim tensor, which sends the op to its
  per-tensor path on CUDA; the square marginals are summed per shape (`marginals.multi_tensor_marginals`).
  The update functions' arithmetic is the reference's, op for op, so they give its bits; a whole step
  differs from the CPU path's in summation order only (its numba loops and BLAS norms; the marginals
  summed per shape): tests/unit/test_optim_multi_tensor.py. On every device but the CPU.

`torch.compile`d steps (`optim.compile`, `pretrain.optim.compiled`) are chosen by the config, not here.
`forced` runs the multi-tensor path on the CPU, for its tests.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator

import torch


class KernelPath(str, enum.Enum):
    cpu = "cpu"
    multi_tensor = "multi_tensor"


_forced: KernelPath | None = None


def kernel_path(device: torch.device) -> KernelPath:
    """The path for tensors on `device` (module docstring)."""
    if _forced is not None:
        return _forced
    return KernelPath.cpu if device.type == "cpu" else KernelPath.multi_tensor


def multi_tensor(device: torch.device) -> bool:
    return kernel_path(device) is KernelPath.multi_tensor


@contextlib.contextmanager
def forced(path: KernelPath | str) -> Iterator[None]:
    """Every device takes `path` inside the block (tests: the multi-tensor path on the CPU)."""
    global _forced
    previous, _forced = _forced, KernelPath(path)
    try:
        yield
    finally:
        _forced = previous
