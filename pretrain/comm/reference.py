"""Slow single-process model of the compressed allreduce (docs/onebit-lamb.md) that simulates n workers.

For tests only. It keeps one worker error per simulated rank and one server error per chunk, and
spells the algorithm out with explicit loops over ranks, segments and plain ±1 sign tensors (no bit
packing, no collectives, no runs), so that it can be checked by reading. Arithmetic is done in the
same order as :class:`~pretrain.comm.compressed_allreduce.CompressedAllreduce` (sum of the n
contributions in rank order, then divide by n, then add the server error), so the two agree bitwise
on CPU with DeepSpeed's single-scale layout; with segment scales the engine computes a segment's
norm with other kernels (several segments per call), so the two agree to fp32 rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pretrain.comm.layout import ScaleLayout
from pretrain.comm.norms import abs_row_sums


@dataclass(frozen=True)
class Quantized:
    """Q(y) = scale · signs, and the error y − Q(y) it leaves behind."""

    scale: torch.Tensor  # 0-dim fp32: ‖y‖ / √len(y)
    signs: torch.Tensor  # ±1 fp32, +1 where y >= 0 (so 0 and −0.0 give +1)
    error: torch.Tensor

    @property
    def value(self) -> torch.Tensor:
        return self.scale * self.signs


def quantize(values: torch.Tensor, sign_scale: str = "rms", scale_dtype: str = "float32") -> Quantized:
    """The 1-bit quantizer with one scale for the whole tensor (DeepSpeed's); ``mean_abs``
    takes ‖y‖₁/len instead of ‖y‖₂/√len; ``scale_dtype="bfloat16"`` rounds the scale to bfloat16
    (what travels), and the error is taken against the rounded scale."""
    if sign_scale == "rms":
        scale = torch.linalg.vector_norm(values) / math.sqrt(values.numel())
    else:  # the engine's 1-norm (a sum order of its own on CPU, pretrain/comm/norms.py)
        scale = abs_row_sums(values.reshape(1, -1), torch.empty(1, dtype=values.dtype))[0] / values.numel()
    if scale_dtype == "bfloat16":
        scale = scale.to(torch.bfloat16).to(values.dtype)
    signs = torch.where(values >= 0, 1.0, -1.0).to(values.dtype)
    return Quantized(scale, signs, values - scale * signs)


def quantize_segments(
    values: torch.Tensor, segments: list[tuple[int, int]], sign_scale: str, scale_dtype: str = "float32"
) -> torch.Tensor:
    """Q(y) with one scale per (start, length) segment; ``segments`` tile ``values`` in order."""
    pieces = [
        quantize(values[start : start + length], sign_scale, scale_dtype).value for start, length in segments
    ]
    return torch.cat(pieces)


class ReferenceCompressedAllreduce:
    """n simulated ranks, each with its worker error (numel) and server error (numel / n).

    ``__call__(inputs)`` takes one flat fp32 tensor per rank and returns the single output all ranks
    would hold. The scales of the last call are kept for inspection. With n == 1 the input is
    returned unchanged, like the real implementation's shortcut.
    """

    def __init__(
        self,
        numel: int,
        world_size: int,
        layout: ScaleLayout | None = None,
        sign_scale: str = "rms",
        scale_dtype: str = "float32",
    ) -> None:
        if numel % (8 * world_size) != 0:
            raise ValueError(f"numel {numel} is not a multiple of 8 * {world_size}")
        self.layout = layout
        self.sign_scale = sign_scale
        self.scale_dtype = scale_dtype
        self.numel = numel
        self.world_size = world_size
        self.chunk_numel = numel // world_size
        self.worker_errors = [torch.zeros(numel) for _ in range(world_size)]
        self.server_errors = [torch.zeros(self.chunk_numel) for _ in range(world_size)]
        self.last_worker_scales: list[float] = []
        self.last_server_scales: list[float] = []

    def chunk(self, values: torch.Tensor, index: int) -> torch.Tensor:
        return values[index * self.chunk_numel : (index + 1) * self.chunk_numel]

    def __call__(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        if len(inputs) != self.world_size or any(x.shape != (self.numel,) for x in inputs):
            raise ValueError(f"expected {self.world_size} flat tensors of {self.numel} elements")
        if self.world_size == 1:
            return inputs[0].clone()

        if self.layout is not None and not self.layout.single:
            return self._segmented(inputs)
        # Workers: compress x + e_w with one scale each.
        worker_values = []
        for rank in range(self.world_size):
            quantized = quantize(inputs[rank] + self.worker_errors[rank], self.sign_scale, self.scale_dtype)
            self.worker_errors[rank] = quantized.error
            worker_values.append(quantized)
        self.last_worker_scales = [float(q.scale) for q in worker_values]

        # Servers: server r averages chunk r of every worker's compressed value, adds its error,
        # and compresses the result with one scale for the chunk.
        output_chunks = []
        self.last_server_scales = []
        for server in range(self.world_size):
            total = self.chunk(worker_values[0].value, server)
            for rank in range(1, self.world_size):
                total = total + self.chunk(worker_values[rank].value, server)
            quantized = quantize(
                total / self.world_size + self.server_errors[server], self.sign_scale, self.scale_dtype
            )
            self.server_errors[server] = quantized.error
            self.last_server_scales.append(float(quantized.scale))
            output_chunks.append(quantized.value)
        return torch.cat(output_chunks)

    def _segmented(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        """The same algorithm with one scale per segment of the layout, workers and servers alike."""
        assert self.layout is not None
        chunks = self.world_size
        base = [chunk * self.chunk_numel for chunk in range(chunks)]
        local = [[(s - base[c], n) for s, n in self.layout.segments(c)] for c in range(chunks)]
        worker_segments = [(s, n) for c in range(chunks) for s, n in self.layout.segments(c)]
        compressed = []
        for rank in range(self.world_size):
            y = inputs[rank] + self.worker_errors[rank]
            value = quantize_segments(y, worker_segments, self.sign_scale, self.scale_dtype)
            self.worker_errors[rank] = y - value
            compressed.append(value)
        output_chunks = []
        for server in range(chunks):
            total = self.chunk(compressed[0], server)
            for rank in range(1, self.world_size):
                total = total + self.chunk(compressed[rank], server)
            z = total / self.world_size + self.server_errors[server]
            value = quantize_segments(z, local[server], self.sign_scale, self.scale_dtype)
            self.server_errors[server] = z - value
            output_chunks.append(value)
        return torch.cat(output_chunks)
