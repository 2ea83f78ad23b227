"""The compressed allreduce's elementwise passes, fused (issue #15): one pass over memory per step.

Four operations make up the engine's arithmetic besides the scales' norms (which every implementation
takes from :mod:`pretrain.comm.norms`, so the scales, and with them every result, are the same):

- ``add_scales_(error, values, plan, out)``: ``error ← error + values`` (the worker's y = x + e) and ``out ←``
  the scales of its segments (``plan.scales``). Numba fuses the 1-norms of ``mean_abs`` into the addition
  (each block summed from L1 right after it is added, in the norms' order); the others run the two passes.
- ``compress_(values, scales, plan, packed)``: packed ← the signs of ``values`` (bit 1 for ``>= 0``,
  MSB first, :mod:`pretrain.comm.packing`), and ``values ← values − s·sign(values)`` with s the scale of
  each element's segment: a worker's (or a server's) pack-and-error-feedback step.
- ``accumulate_(error, signs, scales, plan)``: ``error ← error + (Σ_i s_i·sign_i) / n`` over the n
  sources in worker order (the server's average of the decoded worker chunks, plus its error).
- ``decode_(packed, scales, plan, out)``: ``out ← s·sign``.
- ``worker_pass(error, values, plan, scales, source)``: ``add_scales_``, the scales' rounding to the wire's
  dtype and ``compress_`` in one pass, segment by segment (``numba_kernels.WorkerPass``); numba only,
  ``mean_abs`` only (None elsewhere: the caller runs the three). A segment's signs need its scale, its
  scale every element: the separate passes write y to memory and read it back for the signs (8 of 28
  bytes per element); here a segment's signs are taken right after its 1-norm, from cache (one scale per
  row or column: 768–4096 elements). It runs stretch by stretch so that the pipeline can send each as it
  is done.
- ``server_pass(error, signs, scales, plan, out_scales)``: ``accumulate_``, the scales, their rounding and
  ``compress_`` the same way (``numba_kernels.ServerPass``): the server's error is read once instead of
  three times.

``add_scales_`` may take the worker's values as a :class:`~pretrain.comm.plan.MomentumSource` instead of a
filled buffer (issue #15): the numba kernels then form x = (β1·m + (1−β1)·s·g)/d inside their pass (and a
matrix's square marginals) with the loops the source brings (the optimizer's,
:mod:`pretrain.optim.numba_loops`), the others form x into the buffer first (``MomentumSource.fill``); the
bits are the same.

The interface, :class:`~pretrain.comm.plan.CompressionKernels`, is defined below its implementations
(:mod:`pretrain.comm.plan`); this module holds the reference and the choice.

Three implementations compute identical bits (tested on random buffers, layouts, 2–4 workers):

- :class:`TorchKernels`: torch ops, any device; the reference. Each operation is several passes
  (compare, eight shift-or passes, a table gather, multiply, subtract).
- :class:`~pretrain.comm.numba_kernels.NumbaKernels`: CPU only, one loop per operation over the layout's
  runs (:mod:`pretrain.comm.numba_loops`), compiled by numba (LLVM, no C++ compiler needed; IEEE float32
  arithmetic in the reference's order, no fast-math but for the norms' float64 block sums, which
  `reassoc` lets LLVM vectorise in an order fixed by the compiled code).
  ``compress_`` reads and writes the buffer once (8 bytes per element plus 1/8 written) where the torch
  path makes about a dozen passes (compare, eight strided shift-or passes, gather, subtract). Inside, a
  block of 4,096 elements at a time, the signs go to one flag byte per element in the same contiguous
  loop as the error feedback, and eight flags become a byte in one 64-bit multiplication; the
  accumulation expands bytes to flags the same way before it applies the scales (issue #15: both loops
  vectorise, where one loop that packed or unpacked eight strided elements per byte ran at about half the
  speed).
- :class:`~pretrain.comm.compiled_kernels.CompiledKernels`: one ``torch.compile``'d kernel per operation,
  any device (Triton on CUDA; that module's docstring).

:func:`get_kernels` is the one place that chooses: numba for CPU buffers when it imports, the compiled
kernels for CUDA buffers when Triton is there, torch otherwise (the fallback needs nothing beyond torch).
``BERT_LAMB_COMM_KERNELS=torch`` forces the reference, e.g. to rule the fused path out when debugging;
``=compiled`` the compiled kernels. :func:`describe_kernels` names the choice for a device (the run's
pre-flight header and its config.yaml say it).
"""

from __future__ import annotations

import os

import torch

from pretrain.comm import compiled_kernels
from pretrain.comm.numba_kernels import NumbaKernels
from pretrain.comm.numba_support import numba_unavailable_reason
from pretrain.comm.packing import SignPacker, get_packer
from pretrain.comm.plan import CompressionKernels, MomentumSource, RunPlan

# Also imported from here: the interface and the source (`pretrain.comm.plan`), the numba kernels and
# whether they can run (`numba_kernels`, `numba_support`)
__all__ = [
    "KERNELS_ENV",
    "KERNEL_CHOICES",
    "CompressionKernels",
    "MomentumSource",
    "NumbaKernels",
    "TorchKernels",
    "describe_kernels",
    "get_kernels",
    "numba_unavailable_reason",
]

KERNELS_ENV = "BERT_LAMB_COMM_KERNELS"
KERNEL_CHOICES = ("auto", "torch", "numba", "compiled")


class TorchKernels(CompressionKernels):
    """The reference: torch ops through a :class:`~pretrain.comm.packing.SignPacker` (any device)."""

    name = "torch"

    def __init__(self, packer: SignPacker) -> None:
        self.packer = packer

    def decode_(self, packed: torch.Tensor, scales: torch.Tensor, plan: RunPlan, out: torch.Tensor) -> None:
        if plan.one_segment:
            self.packer.unpack_scaled(packed.view(1, -1), scales.reshape(1), out=out)
            return
        self.packer.unpack(packed.reshape(-1), out=out)
        plan.apply(out, scales)

    def compress_(
        self,
        values: torch.Tensor,
        scales: torch.Tensor,
        plan: RunPlan,
        packed: torch.Tensor,
        scratch: torch.Tensor,
    ) -> None:
        self.packer.pack(values, out=packed)
        self.decode_(packed, scales, plan, scratch)
        values.sub_(scratch)

    def accumulate_(
        self,
        error: torch.Tensor,
        signs: torch.Tensor,
        scales: torch.Tensor,
        plan: RunPlan,
        scratch: torch.Tensor,
    ) -> None:
        n, length = signs.shape[0], error.numel()
        contributions = scratch[: n * length].view(n, length)
        if plan.one_segment:
            self.packer.unpack_scaled(signs, scales.reshape(n), out=contributions)
        else:
            self.packer.unpack(signs.reshape(-1), out=contributions.view(-1))
            plan.apply_rows(contributions, scales)
        total = contributions[0]
        for source in range(1, n):
            total.add_(contributions[source])
        # by a tensor on the buffer's device: CUDA divides by a Python number as a multiplication by its
        # reciprocal, 1 ulp off the reference's quotient for n = 3 (seen on an H200); a 0-dim device tensor
        # takes the IEEE division (the CPU's path either way)
        error.add_(total.div_(torch.full((), n, dtype=total.dtype, device=total.device)))

    def decode_chunks_(
        self,
        signs: torch.Tensor,
        scales: torch.Tensor,
        plans: list[RunPlan],
        offsets: list[int],
        out: torch.Tensor,
    ) -> None:
        if all(plan.one_segment for plan in plans):  # one gather for all chunks (one scale each)
            self.packer.unpack_scaled(signs, scales, out=out)
            return
        self.packer.unpack(signs.reshape(-1), out=out)
        chunks = out.view(len(plans), -1)
        for chunk, plan in enumerate(plans):
            offset = offsets[chunk]
            plan.apply(chunks[chunk], scales[offset : offset + plan.num_segments])


def get_kernels(
    device: torch.device | str, packer: SignPacker, choice: str | None = None
) -> CompressionKernels:
    """The one place that picks the kernels: ``choice`` (or $BERT_LAMB_COMM_KERNELS, default ``auto``):
    ``auto`` = numba for CPU buffers when it imports, the compiled kernels for CUDA buffers when Triton is
    there (an H200: 0.42x the torch kernels' time with the default exchange at 8 workers, 0.33x with one scale
    per chunk, and bitwise the CPU reference's results, `make gpu-check`), torch otherwise; ``torch``;
    ``numba`` (CPU only: raises ValueError elsewhere or without numba); ``compiled``
    (:mod:`pretrain.comm.compiled_kernels`, any device with ``torch.compile``: raises ValueError where it
    cannot generate code)."""
    choice = choice or os.environ.get(KERNELS_ENV) or "auto"
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"{KERNELS_ENV}/kernels must be one of {', '.join(KERNEL_CHOICES)}, got {choice!r}")
    device_type = torch.device(device).type
    if choice == "compiled" or (choice == "auto" and device_type == "cuda"):
        reason = compiled_kernels.compiled_unavailable_reason(device)
        if reason is None:
            return compiled_kernels.CompiledKernels(device)
        if choice == "compiled":
            raise ValueError(f"kernels=compiled: {reason}")
        return TorchKernels(packer)
    on_cpu = device_type == "cpu"
    if choice == "torch" or (choice == "auto" and not on_cpu):
        return TorchKernels(packer)
    reason = numba_unavailable_reason() if on_cpu else "the numba kernels run on CPU buffers only"
    if reason is None:
        return NumbaKernels()
    if choice == "numba":
        raise ValueError(f"kernels=numba: {reason}")
    return TorchKernels(packer)


def describe_kernels(device: torch.device | str, choice: str | None = None) -> str:
    """What the compressed allreduce on ``device`` runs, as :func:`get_kernels` picks it (``choice`` or
    $BERT_LAMB_COMM_KERNELS): ``numba`` or ``compiled`` (each packs the signs itself), or ``torch ops, <name>
    packer`` (the cupy packer on CUDA where it imports). ValueError as :func:`get_kernels` for a choice the
    device cannot run."""
    packer = get_packer(device)
    kernels = get_kernels(device, packer, choice)
    return kernels.name if kernels.name != "torch" else f"torch ops, {packer.name} packer"
