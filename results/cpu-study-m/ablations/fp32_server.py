"""Ablation `abl-fp32server` (rung M, results/cpu-study-m/README.md, "The server's second compression"): the
compressed allreduce's server pass without its own 1-bit compression. Each server averages the workers' 1-bit
chunks, z = (1/n) Σ_i Q_i, and sends z in fp32 instead of Q(z + e_s) (no server error): the exchange's only
compression is the workers'. A study's patch, not an option: `apply` replaces three methods of the engine
class it is given; `sitecustomize.py` here applies it to `CompressedAllreduce` in every process of a run
started with this folder first on PYTHONPATH and RUNG_ABLATION=fp32_server (the rung driver's `ARM_PATCH`).
Not pipelined (virtual workers never are); the byte counters still count the 1-bit second phase.
"""

from __future__ import annotations

from typing import Any

import torch
from patching import patch

from pretrain.comm.collectives import all_gather_flat
from pretrain.comm.compressed_allreduce import CompressedAllreduce


def _serve(self: Any, local_chunk: int, scratch: torch.Tensor) -> None:
    """The server of one chunk: z = (1/n) Σ_i Q_i (worker order), kept in its server-error buffer."""
    n, chunk = self.world_size, self.local_chunks[local_chunk]
    plan, count = self.chunk_plans[chunk], self.layout.chunk_segments[chunk]
    offset = self._local_offsets[local_chunk]
    signs = self.recv_signs[:, :, local_chunk].reshape(n, -1)
    scales = self.recv_scales.view(n, self.local_segments)[:, offset : offset + count]
    average = self.server_errors[local_chunk]
    average.zero_()
    self.kernels.accumulate_(average, signs, scales, plan, scratch=scratch[: n * self.chunk_numel])


def _exchange_server_chunks(self: Any) -> None:
    """Nothing to pack: the fp32 averages travel in `_decode_output`."""


def _decode_output(self: Any, out: torch.Tensor) -> None:
    """Every process receives every chunk's fp32 average (chunk j is out's j-th slice, process-major)."""
    averages = self.server_error.view(-1)
    if self.num_processes == 1:
        out.copy_(averages)
    else:
        all_gather_flat(out, averages, group=self.group)


def apply(engine: type[CompressedAllreduce]) -> type[CompressedAllreduce]:
    """Patch `engine` (CompressedAllreduce or a subclass) in place; returns it."""
    methods = {
        "_serve": _serve,
        "_exchange_server_chunks": _exchange_server_chunks,
        "_decode_output": _decode_output,
    }
    return patch(engine, methods)
