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
  dtype and ``compress_`` in one pass, segment by segment (:class:`WorkerPass`); numba only, ``mean_abs``
  only (None elsewhere: the caller runs the three). A segment's signs need its scale, its scale every
  element: the separate passes write y to memory and read it back for the signs (8 of 28 bytes per
  element); here a segment's signs are taken right after its 1-norm, from cache (one scale per row or
  column: 768–4096 elements). It runs stretch by stretch so that the pipeline can send each as it is done.
- ``server_pass(error, signs, scales, plan, out_scales)``: ``accumulate_``, the scales, their rounding and
  ``compress_`` the same way (:class:`ServerPass`): the server's error is read once instead of three times.

``add_scales_`` may take the worker's values as a :class:`MomentumSource` instead of a filled buffer (issue
#15): the numba kernels then form x = (β1·m + (1−β1)·s·g)/d inside their pass (and a matrix's square
marginals), the others form x into the buffer first (``MomentumSource.fill``); the bits are the same.

Three implementations compute identical bits (tested on random buffers, layouts, 2–4 workers):

- :class:`TorchKernels`: torch ops, any device; the reference. Each operation is several passes
  (compare, eight shift-or passes, a table gather, multiply, subtract).
- :class:`NumbaKernels`: CPU only, one loop per operation over the layout's runs, compiled by numba
  (LLVM, no C++ compiler needed; IEEE float32 arithmetic in the reference's order, no fast-math but for
  the norms' float64 block sums, which `reassoc` lets LLVM vectorise in an order fixed by the compiled code).
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

import abc
import functools
import os
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pretrain.comm.layout import run_table, segment_bounds
from pretrain.comm.packing import SignPacker, _sign_table, get_packer
from pretrain.comm.pipeline import cut_runs

if TYPE_CHECKING:
    from pretrain.comm.compressed_allreduce import _RunPlan

KERNELS_ENV = "BERT_LAMB_COMM_KERNELS"
KERNEL_CHOICES = ("auto", "torch", "numba", "compiled")
# Elements `accumulate_` sums over all sources at a time (a multiple of 8: 16 KiB of running sums, in L1).
ACCUMULATE_BLOCK = 4096
# Elements per float64 partial sum of the `mean_abs` scales' 1-norms (:mod:`pretrain.comm.norms`): a
# segment's norm is the sum, in order, of the partial sums of its blocks of this many elements from its
# start. 16 KiB: the fused worker pass adds a block and sums it while it is in L1.
SUM_BLOCK = 4096
# Rows of a matrix whose column squares `square_marginal_rows` sums in fp32 before adding them to its
# float64 column sums.
MARGINAL_FLUSH = 32


@dataclass(frozen=True)
class MomentumSource:
    """A worker's values not formed yet (issue #15): x = (β1·m + (1−β1)·(s·g))/d, tensor by tensor, for
    ``add_scales_`` to form inside its own pass instead of reading them from a buffer the caller filled
    (the write and the read of x, 8 of 28 bytes per element, never happen).

    Tensor k's momentum, gradient and divisor (``exp_avgs[k]``, ``grads[k]``, ``divisors[k]``: 1-D fp32
    CPU views in the buffer's element order) are elements [offsets[k], offsets[k] + len) of the buffer; the
    buffer's other elements (its pad) are the call's ``values`` as they are. ``fill(values)`` writes the
    same x into ``values`` in the same arithmetic (one fused multiply-add, then the division), for the
    kernels that do not fuse. ``marginals``: the square marginals of some of the (scaled) gradients are
    summed in the same pass (1-bit LAMB's ``refresh_from=factored``/``rank1``)."""

    offsets: tuple[int, ...]
    exp_avgs: list[torch.Tensor]
    grads: list[torch.Tensor]
    divisors: list[torch.Tensor]
    beta1: float
    grad_scale: float
    fill: Callable[[torch.Tensor], None]
    # per tensor, None or the (outer, inner) sums its s·g's squares are added to, rows and columns in memory
    # order (`pretrain.optim.marginals`); `fill` adds them too
    marginals: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(g.shape[0] for g in self.grads)


class CompressionKernels(abc.ABC):
    """The engine's elementwise passes (module docstring). ``plan`` describes where each scale applies."""

    name: str

    def add_scales_(
        self,
        error: torch.Tensor,
        values: torch.Tensor,
        plan: _RunPlan,
        out: torch.Tensor,
        source: MomentumSource | None = None,
    ) -> torch.Tensor:
        """The worker's first step: error ← error + values (y = x + e), then out ← the scales of its
        segments (``plan.scales``); returns ``out``. Implementations may fuse the two passes. With a
        ``source``, x is the source's (:class:`MomentumSource`; the buffer's pad still from ``values``):
        here formed into ``values`` first."""
        if source is not None:
            source.fill(values)
        error.add_(values)
        return plan.scales(error, out=out)

    def worker_pass(
        self,
        error: torch.Tensor,
        values: torch.Tensor,
        plan: _RunPlan,
        scales: torch.Tensor,
        source: MomentumSource | None = None,
        *,
        bfloat16: bool = False,
    ) -> WorkerPass | None:
        """The worker's whole step (``add_scales_``, the scales' rounding, ``compress_``) fused segment by
        segment, run stretch by stretch (:class:`WorkerPass`); None where these kernels do not fuse it
        (`fuses_worker_pass`: the caller runs the separate passes, same bits)."""
        return None

    def fuses_worker_pass(self, plan: _RunPlan, numel: int) -> bool:
        """Whether `worker_pass` (and `server_pass`) fuse the step for ``numel`` elements under ``plan``."""
        return False

    def server_pass(
        self,
        error: torch.Tensor,
        signs: torch.Tensor,
        scales: torch.Tensor,
        plan: _RunPlan,
        out_scales: torch.Tensor,
        *,
        bfloat16: bool = False,
    ) -> ServerPass | None:
        """The server's whole step (``accumulate_``, the scales, their rounding, ``compress_``) fused
        segment by segment, run stretch by stretch (:class:`ServerPass`); None where `worker_pass` is."""
        return None

    @abc.abstractmethod
    def compress_(
        self,
        values: torch.Tensor,
        scales: torch.Tensor,
        plan: _RunPlan,
        packed: torch.Tensor,
        scratch: torch.Tensor,
    ) -> None:
        """packed ← signs(values); values ← values − scale·sign(values). ``values`` 1-D fp32; ``scratch``:
        fp32 the length of ``values`` that may be overwritten."""

    @abc.abstractmethod
    def accumulate_(
        self,
        error: torch.Tensor,
        signs: torch.Tensor,
        scales: torch.Tensor,
        plan: _RunPlan,
        scratch: torch.Tensor,
    ) -> None:
        """error ← error + (Σ_i decode(signs[i], scales[i])) / n. signs [n, bytes], scales [n, segments];
        ``scratch``: n · len(error) fp32 that may be overwritten."""

    @abc.abstractmethod
    def decode_(self, packed: torch.Tensor, scales: torch.Tensor, plan: _RunPlan, out: torch.Tensor) -> None:
        """out ← decode(packed, scales) under ``plan``."""

    def decode_chunks_(
        self,
        signs: torch.Tensor,
        scales: torch.Tensor,
        plans: list[_RunPlan],
        offsets: list[int],
        out: torch.Tensor,
    ) -> None:
        """out (n chunks of equal length) ← chunk j decoded from signs[j] and its scales
        ``scales[offsets[j] : offsets[j] + plans[j].num_segments]``."""
        chunks = out.view(len(plans), -1)
        for chunk, plan in enumerate(plans):
            offset = offsets[chunk]
            self.decode_(signs[chunk], scales[offset : offset + plan.num_segments], plan, chunks[chunk])


class TorchKernels(CompressionKernels):
    """The reference: torch ops through a :class:`~pretrain.comm.packing.SignPacker` (any device)."""

    name = "torch"

    def __init__(self, packer: SignPacker) -> None:
        self.packer = packer

    def decode_(self, packed: torch.Tensor, scales: torch.Tensor, plan: _RunPlan, out: torch.Tensor) -> None:
        if plan.one_segment:
            self.packer.unpack_scaled(packed.view(1, -1), scales.reshape(1), out=out)
            return
        self.packer.unpack(packed.reshape(-1), out=out)
        plan.apply(out, scales)

    def compress_(
        self,
        values: torch.Tensor,
        scales: torch.Tensor,
        plan: _RunPlan,
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
        plan: _RunPlan,
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
        plans: list[_RunPlan],
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


@functools.cache
def fma_intrinsic() -> Any:
    """``fma(a, b, c)``: a·b + c in float32 rounded once, for numba code (``llvm.fma``: one instruction
    where the CPU has FMA, libm's fmaf elsewhere), as ATen's vectorised ``add(alpha=)`` computes it on x86."""
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def fma(typingctx: Any, a: Any, b: Any, c: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.fma(*args)

        return types.float32(types.float32, types.float32, types.float32), codegen

    return fma


@functools.cache
def _numba_functions() -> dict[str, Any]:
    """The numba kernels, compiled on first use (cached on disk by numba where it can write)."""
    import numba

    jit = functools.partial(numba.njit, cache=True, boundscheck=False, nogil=True)

    @jit
    def _signs_and_feedback(values, flags, s):
        # flags[i] ← values[i] >= 0; values[i] ← values[i] ∓ s: contiguous views counted from 0, vectorised
        # by LLVM (the sign bits packed eight to a byte in the same loop were not: strided loads, 0.43 ns
        # per element against 0.28 for this and `_pack_flags`, one thread, 64M elements)
        for i in range(values.shape[0]):
            v = values[i]
            positive = v >= 0
            flags[i] = positive
            values[i] = v - s if positive else v + s

    @jit
    def _pack_flags(words, packed):
        # eight 0/1 flag bytes (one little-endian uint64) → one byte, the first flag in the MSB: the
        # multiplication moves flag k to bit 63 − k with no carries (the other products land below bit 56
        # or above bit 63)
        for b in range(packed.shape[0]):
            packed[b] = np.uint8((words[b] * np.uint64(0x8040201008040201)) >> np.uint64(56))

    @jit
    def _compress_stretch(values, packed, first, end, s, flags, words, acc):
        # Elements [first, end) (at most SUM_BLOCK past first & ~7) under one scale; flags[k] holds the sign
        # of element (first & ~7) + k. A byte that the stretch does not complete is carried in `acc`.
        base = first & ~7
        _signs_and_feedback(values[first:end], flags[first - base : end - base], s)
        i = first
        while i < end and (i & 7) != 0:  # up to the next byte boundary
            acc = ((acc << 1) | flags[i - base]) & 0xFF
            if (i & 7) == 7:
                packed[i >> 3] = acc
            i += 1
        whole = (end - i) >> 3
        if whole > 0:
            word = (i - base) >> 3
            _pack_flags(words[word : word + whole], packed[i >> 3 : (i >> 3) + whole])
            i += 8 * whole
        while i < end:  # the rest
            acc = ((acc << 1) | flags[i - base]) & 0xFF
            if (i & 7) == 7:
                packed[i >> 3] = acc
            i += 1
        return acc

    @jit
    def _compress_row(values, packed, i, end, s, flags, words, acc):
        # One segment [i, end) under scale s, in stretches of up to SUM_BLOCK elements: signs and feedback
        # first, then the flags packed (a byte is written once its 8th sign is in; `acc` carries a byte the
        # segment does not complete). Segments shorter than 8 elements (the exact vectors' one-element
        # segments) go element by element. Returns the carried byte.
        if end - i < 8:
            while i < end:
                v = values[i]
                positive = v >= 0
                acc = ((acc << 1) | positive) & 0xFF
                values[i] = v - s if positive else v + s
                if (i & 7) == 7:
                    packed[i >> 3] = acc
                i += 1
            return acc
        while i < end:
            stop = min(end, (i & ~7) + SUM_BLOCK)
            acc = _compress_stretch(values, packed, i, stop, s, flags, words, acc)
            i = stop
        return acc

    @jit
    def compress(values, packed, runs, scales, flags):
        # Elements in buffer order (the runs tile it), segment by segment (`_compress_row`)
        words = flags.view(np.uint64)
        acc = 0
        for r in range(runs.shape[0]):
            start, rows, length, first = runs[r, 0], runs[r, 1], runs[r, 2], runs[r, 3]
            for row in range(rows):
                i = start + row * length
                acc = _compress_row(values, packed, i, i + length, scales[first + row], flags, words, acc)

    @jit
    def _expand(packed, words):
        # each byte → eight 0/1 flag bytes (one little-endian uint64), its MSB first: the byte copied into
        # every lane, each lane masked to its bit, any set bit carried up to the lane's top, shifted down
        for b in range(packed.shape[0]):
            lanes = (np.uint64(packed[b]) * np.uint64(0x0101010101010101)) & np.uint64(0x0102040810204080)
            carried = (lanes + np.uint64(0x7F7F7F7F7F7F7F7F)) & np.uint64(0x8080808080808080)
            words[b] = carried >> np.uint64(7)

    @jit
    def _apply_flags(out_bits, flags, s_bits):
        for i in range(out_bits.shape[0]):
            out_bits[i] = s_bits ^ (np.uint32(flags[i] ^ 1) << 31)

    @jit
    def _signed_direct(out_bits, packed, s_bits):
        # out[8b + j] = s where bit j of packed[b] (MSB first) is 1, else −s: the sign bit of s flipped, which
        # is exactly s·(−1). On uint32 views, a loop counted from 0: LLVM vectorises it (eight strided
        # outputs per byte: 0.22 ns per element in L1, enough where the output goes to memory: `decode`).
        for b in range(packed.shape[0]):
            byte = np.uint32(packed[b])
            for j in range(8):
                out_bits[8 * b + j] = s_bits ^ ((((byte >> (7 - j)) & 1) ^ 1) << 31)

    @jit
    def _signed(out_bits, packed, s_bits, flags, words):
        # `_signed_direct` for `accumulate`, whose terms stay in L1 and so are bound by this loop: the bits
        # are expanded to flag bytes first, a block at a time (words: the flags' uint64 view), then applied
        # in a contiguous loop (0.10 ns per element in L1, against 0.22).
        width = words.shape[0]
        for low in range(0, packed.shape[0], width):
            block = min(width, packed.shape[0] - low)
            _expand(packed[low : low + block], words[:block])
            _apply_flags(out_bits[8 * low : 8 * (low + block)], flags[: 8 * block], s_bits)

    @jit
    def _finish(error, total, count):
        # error ← error + total / n over a view counted from 0 (offset indexing into the whole buffer is
        # left scalar by LLVM: 1.2 against 0.6 ns per element for the whole accumulation at n = 2)
        for i in range(error.shape[0]):
            error[i] = error[i] + total[i] / count

    @jit
    def _accumulate_bytes(
        error, signs, first_byte, count_bytes, scale_bits, segment, count, total, term, flags, words
    ):
        # Bytes [first_byte, first_byte + count_bytes) of one segment (error: the view of their elements), in
        # blocks whose sums stay in L1: total = c_0, then total + c_i source by source (worker order), then
        # error + total / n (the reference's order). `signs` C-contiguous: its row slices vectorise.
        sources, width = signs.shape[0], total.shape[0] // 8
        total_bits, term_bits = total.view(np.uint32), term.view(np.uint32)
        for low in range(0, count_bytes, width):
            block = min(width, count_bytes - low)
            begin, elements = first_byte + low, 8 * block
            _signed(
                total_bits[:elements], signs[0, begin : begin + block], scale_bits[0, segment], flags, words
            )
            for source in range(1, sources):
                _signed(
                    term_bits[:elements],
                    signs[source, begin : begin + block],
                    scale_bits[source, segment],
                    flags,
                    words,
                )
                for i in range(elements):
                    total[i] = total[i] + term[i]
            _finish(error[8 * low : 8 * low + elements], total, count)

    @jit
    def _accumulate_one(error, signs, scales, segment, count, table, i):
        # One element: c_0 + c_1 + … (worker order), c_i = s_i · (±1) from the sign table; then e + total / n.
        byte, j = i >> 3, i & 7
        value = scales[0, segment] * table[signs[0, byte], j]
        for source in range(1, signs.shape[0]):
            value = value + scales[source, segment] * table[signs[source, byte], j]
        error[i] = error[i] + value / count

    @jit
    def _accumulate_row(
        error, signs, scales, scale_bits, segment, i, end, count, table, total, term, flags, words
    ):
        # One segment [i, end): its ends element by element, its whole bytes through `_accumulate_bytes`
        while i < end and ((i & 7) != 0 or end - i < 8):  # up to a byte boundary (or the row's end)
            _accumulate_one(error, signs, scales, segment, count, table, i)
            i += 1
        whole = (end - i) >> 3
        if whole > 0:
            _accumulate_bytes(
                error[i : i + 8 * whole],
                signs,
                i >> 3,
                whole,
                scale_bits,
                segment,
                count,
                total,
                term,
                flags,
                words,
            )
            i += 8 * whole
        while i < end:  # the rest of the row
            _accumulate_one(error, signs, scales, segment, count, table, i)
            i += 1

    @jit
    def accumulate(error, signs, runs, scales, scale_bits, count, table, total, term, flags):
        words = flags.view(np.uint64)[: SUM_BLOCK // 8]
        # Per element: total = c_0 + c_1 + … (worker order), then error + total / n, the reference's order;
        # c_i = s_i · (±1) from the sign table. A row's whole bytes go to `_accumulate_bytes` (0.6 against
        # 0.85 ns per element at n = 2 with the table in registers; equal at n = 4).
        for r in range(runs.shape[0]):
            start, rows, length, first = runs[r, 0], runs[r, 1], runs[r, 2], runs[r, 3]
            for row in range(rows):
                i = start + row * length
                _accumulate_row(
                    error,
                    signs,
                    scales,
                    scale_bits,
                    first + row,
                    i,
                    i + length,
                    count,
                    table,
                    total,
                    term,
                    flags,
                    words,
                )

    @jit
    def server_pass(
        error,
        signs,
        runs,
        scales,
        scale_bits,
        count,
        table,
        total,
        term,
        flags,
        segment_divisors,
        bfloat16,
        out_scales,
        packed,
        packed_base,
        acc,
        cell,
        cell_bits,
    ):
        # The server's whole step segment by segment (`ServerPass`): z = e + (Σ s_i·sign_i)/n (`accumulate`),
        # its 1-norm from cache (the norms' blocks and order), the scale (rounded where asked), the signs
        # and e ← z − s·sign(z) (`_compress_row`). `runs`: the stretch's whole segments (chunk positions,
        # chunk segment indices); `scales`/`scale_bits` [n, chunk segments]; `signs` [n, chunk bytes].
        words = flags.view(np.uint64)[: SUM_BLOCK // 8]
        signs_of = error[packed_base:]
        for r in range(runs.shape[0]):
            start, rows, length, first = runs[r, 0], runs[r, 1], runs[r, 2], runs[r, 3]
            for row in range(rows):
                segment = first + row
                low, end = start + row * length, start + (row + 1) * length
                _accumulate_row(
                    error,
                    signs,
                    scales,
                    scale_bits,
                    segment,
                    low,
                    end,
                    count,
                    table,
                    total,
                    term,
                    flags,
                    words,
                )
                norm = 0.0
                for i in range(low, end, SUM_BLOCK):
                    norm += _abs_sum(error[i : min(i + SUM_BLOCK, end)])
                s = np.float32(norm) / segment_divisors[segment]
                if bfloat16:
                    s = _to_bfloat16(s, cell, cell_bits)
                out_scales[segment] = s
                acc = _compress_row(
                    signs_of, packed, low - packed_base, end - packed_base, s, flags, words, acc
                )
        return acc

    @jit
    def decode(packed, runs, scales, scale_bits, out, out_bits, table):
        # A row's whole bytes through `_signed_direct` over views counted from 0 (vectorised: 0.26 against
        # 0.35 ns per element with the sign table, one thread, 64M elements; issue #15), its ends from the
        # table.
        for r in range(runs.shape[0]):
            start, rows, length, first = runs[r, 0], runs[r, 1], runs[r, 2], runs[r, 3]
            for row in range(rows):
                s = scales[first + row]
                i, end = start + row * length, start + (row + 1) * length
                while i < end and ((i & 7) != 0 or end - i < 8):  # up to a byte boundary (or the row's end)
                    out[i] = s * table[packed[i >> 3], i & 7]
                    i += 1
                whole = (end - i) >> 3
                if whole > 0:
                    _signed_direct(
                        out_bits[i : i + 8 * whole],
                        packed[i >> 3 : (i >> 3) + whole],
                        scale_bits[first + row],
                    )
                    i += 8 * whole
                while i < end:  # the rest of the row
                    out[i] = s * table[packed[i >> 3], i & 7]
                    i += 1

    @functools.partial(numba.njit, cache=True, boundscheck=False, nogil=True, fastmath={"reassoc"})
    def _abs_sum(x):
        # Σ|x| in float64 over one block (a view counted from 0). `reassoc` (this function only) lets LLVM
        # vectorise the sum: lanes, then a fixed tree, an order fixed by the compiled code and so the same
        # wherever it is called (0.08 ns per element in L1 against 0.32 for the strict scalar loop).
        total = 0.0
        for i in range(x.shape[0]):
            total += abs(np.float64(x[i]))
        return total

    @jit
    def segment_abs_sums(values, runs, out):
        # out[segment] ← Σ|values| over it: its blocks' partial sums added in order, rounded to fp32 once
        for r in range(runs.shape[0]):
            start, rows, length, first = runs[r, 0], runs[r, 1], runs[r, 2], runs[r, 3]
            for row in range(rows):
                base = start + row * length
                total = 0.0
                for low in range(0, length, SUM_BLOCK):
                    total += _abs_sum(values[base + low : base + min(low + SUM_BLOCK, length)])
                out[first + row] = np.float32(total)

    @jit
    def _add(error, values):
        for i in range(error.shape[0]):
            error[i] = error[i] + values[i]

    @jit
    def _sum_block(error, low, high, segment, count, last, out, total):
        # A block of `sum_blocks` after its addition: `count` whole segments each summed into `out`, or a part
        # of one added to the running float64 `total` (rounded into `out` at its last block); returns the
        # running total. Each segment's sum: its blocks' partial sums added in order (`norms`).
        if count > 0:
            length = (high - low) // count
            for q in range(count):
                out[segment + q] = np.float32(_abs_sum(error[low + q * length : low + (q + 1) * length]))
            return 0.0
        total += _abs_sum(error[low:high])
        if last:
            out[segment] = np.float32(total)
            return 0.0
        return total

    @jit
    def add_segment_abs_sums(error, values, blocks, out):
        # error ← error + values and `segment_abs_sums(error)` in one pass: each block (`sum_blocks`) is
        # summed right after it is added, from L1 (the same blocks and order, so the same bits)
        total = 0.0
        for b in range(blocks.shape[0]):
            low, high = blocks[b, 0], blocks[b, 1]
            _add(error[low:high], values[low:high])
            total = _sum_block(error, low, high, blocks[b, 2], blocks[b, 3], blocks[b, 4], out, total)

    fma = fma_intrinsic()

    @functools.partial(numba.njit, cache=True, boundscheck=False, nogil=True, fastmath={"reassoc"})
    def _square_row(row, scale, partial):
        # Σ (s·row)² in fp32 (vectorised: `reassoc` on this loop only, an order fixed by the compiled code),
        # and partial += (s·row)², the column squares of a block of rows in fp32
        total = np.float32(0.0)
        for j in range(row.shape[0]):
            value = row[j] * scale
            square = value * value
            total += square
            partial[j] += square
        return total

    @jit
    def _flush_columns(columns, partial):
        for j in range(columns.shape[0]):
            columns[j] += np.float64(partial[j])
            partial[j] = np.float32(0.0)

    @jit
    def square_marginal_rows(flat, stop, done, inner, scale, outer_sums, columns, partial):
        # The rows of `inner` elements of the row-major matrix `flat` (1-D) that end by `stop`, from row
        # `done` on: outer_sums[row] += Σ (s·g)² over it (in fp32), the columns' (s·g)² summed in fp32 over
        # MARGINAL_FLUSH rows at a time (counted from the matrix's first: `partial`, fp32, zeroed where such
        # a block starts) and each block's sums added into `columns` (float64); returns the rows done.
        # `pretrain.optim.marginals` and the fused worker pass both run this.
        rows = flat.shape[0] // inner
        if done % MARGINAL_FLUSH == 0:
            partial[:inner] = np.float32(0.0)
        while (done + 1) * inner <= stop:
            outer_sums[done] += _square_row(flat[done * inner : (done + 1) * inner], scale, partial)
            done += 1
            if done % MARGINAL_FLUSH == 0 or done == rows:
                _flush_columns(columns, partial)
        return done

    @numba.njit(cache=True, boundscheck=False, nogil=True, error_model="numpy")
    def _add_momentum(error, exp_avg, grad, divisor, beta1, weight, scale):
        # error ← error + (β1·m + weight·(s·g))/d, x as `live_step.preconditioned_momentum_` forms it
        # (error_model="numpy": the division vectorises)
        for i in range(error.shape[0]):
            error[i] = error[i] + fma(weight, grad[i] * scale, beta1 * exp_avg[i]) / divisor[i]

    @jit
    def add_momentum_abs_sums(
        error,
        exp_avg,
        grad,
        divisor,
        blocks,
        out,
        beta1,
        weight,
        scale,
        inner,
        outer_sums,
        inner_sums,
        scratch,
    ):
        # `add_segment_abs_sums` over one tensor's elements with x formed from (m, g, d): the same blocks
        # summed in the same order after the same additions, so the same bits. inner > 0: the square
        # marginals of s·g as well (`square_marginal_rows`, rows of `inner` elements in memory order), each
        # row right after its elements were added, while they are in cache
        columns = np.zeros(inner, dtype=np.float64)
        done, total = 0, 0.0
        for b in range(blocks.shape[0]):
            low, high = blocks[b, 0], blocks[b, 1]
            _add_momentum(
                error[low:high], exp_avg[low:high], grad[low:high], divisor[low:high], beta1, weight, scale
            )
            if inner > 0:
                done = square_marginal_rows(grad, high, done, inner, scale, outer_sums, columns, scratch)
            total = _sum_block(error, low, high, blocks[b, 2], blocks[b, 3], blocks[b, 4], out, total)
        for j in range(inner):
            inner_sums[j] += np.float32(columns[j])

    @jit
    def _to_bfloat16(s, cell, cell_bits):
        # s rounded to bfloat16 (and back to fp32) as torch rounds it (c10's round_to_nearest_even: ties to
        # even, a NaN to the quiet NaN 0x7FC0), through a one-element fp32 array and its uint32 view
        if s != s:
            cell_bits[0] = np.uint32(0x7FC00000)
            return cell[0]
        cell[0] = s
        bits = np.int64(cell_bits[0])
        cell_bits[0] = np.uint32((((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16) & 0xFFFFFFFF)
        return cell[0]

    @jit
    def worker_pass(
        error,
        values,
        exp_avg,
        grad,
        divisor,
        offset,
        runs,
        segment_divisors,
        bfloat16,
        scales,
        packed,
        packed_base,
        acc,
        beta1,
        weight,
        scale,
        inner,
        outer_sums,
        columns,
        done,
        partials,
        flags,
        cell,
        cell_bits,
    ):
        # The worker's whole step segment by segment (`WorkerPass`): y = e + x into `error` a SUM_BLOCK block
        # at a time, each block's 1-norm summed from L1 right after (the norms' blocks and order), the
        # scale (÷ the segment's length, rounded to bfloat16 where asked), then the signs and the feedback
        # while the segment is still in cache (`_compress_row`). x from `values` where `exp_avg` is empty,
        # else formed from (m, g, d) elements [i − offset] as `_add_momentum` forms it, with the square
        # marginals of s·g (`square_marginal_rows`, rows of `inner` elements) as `add_momentum_abs_sums`
        # takes them. `runs`: absolute starts and segment indices, whole segments; `packed[0]` holds the
        # signs of elements packed_base … packed_base + 7. Returns (the carried byte, the marginal rows done).
        words = flags.view(np.uint64)
        from_source = exp_avg.shape[0] > 0
        signs_of = error[packed_base:]
        for r in range(runs.shape[0]):
            start, rows, length, first = runs[r, 0], runs[r, 1], runs[r, 2], runs[r, 3]
            for row in range(rows):
                low, end = start + row * length, start + (row + 1) * length
                total = 0.0
                i = low
                while i < end:
                    high = min(i + SUM_BLOCK, end)
                    if from_source:
                        a, b = i - offset, high - offset
                        _add_momentum(
                            error[i:high], exp_avg[a:b], grad[a:b], divisor[a:b], beta1, weight, scale
                        )
                        if inner > 0:
                            done = square_marginal_rows(
                                grad, b, done, inner, scale, outer_sums, columns, partials
                            )
                    else:
                        _add(error[i:high], values[i:high])
                    total += _abs_sum(error[i:high])
                    i = high
                s = np.float32(total) / segment_divisors[first + row]
                if bfloat16:
                    s = _to_bfloat16(s, cell, cell_bits)
                scales[first + row] = s
                acc = _compress_row(
                    signs_of, packed, low - packed_base, end - packed_base, s, flags, words, acc
                )
        return acc, done

    return {
        "square_marginal_rows": square_marginal_rows,
        "add_momentum_abs_sums": add_momentum_abs_sums,
        "compress": compress,
        "worker_pass": worker_pass,
        "server_pass": server_pass,
        "accumulate": accumulate,
        "decode": decode,
        "segment_abs_sums": segment_abs_sums,
        "add_segment_abs_sums": add_segment_abs_sums,
    }


class NumbaKernels(CompressionKernels):
    """Fused CPU loops (numba), bitwise equal to :class:`TorchKernels`. CPU tensors only."""

    name = "numba"

    def __init__(self) -> None:
        self._functions = _numba_functions()
        # row b: the ±1 that byte b decodes to, MSB first (the torch packer's table)
        self._signs = _sign_table(torch.float32, torch.device("cpu")).numpy()
        # accumulate's running sum and one source's term, a block of ACCUMULATE_BLOCK elements each (L1)
        self._total = np.empty(ACCUMULATE_BLOCK, dtype=np.float32)
        self._term = np.empty(ACCUMULATE_BLOCK, dtype=np.float32)
        # compress's sign flags, one byte per element of a stretch (+ 8 for its first, partial byte)
        self._flags = np.zeros(SUM_BLOCK + 8, dtype=np.uint8)
        # a source's marginals: none, and the fp32 column partials of `square_marginal_rows`
        self._no_sums = np.zeros(0, dtype=np.float32)
        self._partials = np.empty(0, dtype=np.float32)
        # `_source_tables`, per plan and source layout
        self._tables: weakref.WeakKeyDictionary[_RunPlan, dict[tuple[Any, ...], Any]] = (
            weakref.WeakKeyDictionary()
        )

    def add_scales_(
        self,
        error: torch.Tensor,
        values: torch.Tensor,
        plan: _RunPlan,
        out: torch.Tensor,
        source: MomentumSource | None = None,
    ) -> torch.Tensor:
        if plan.root or not plan.tiles(error.numel()):
            return super().add_scales_(error, values, plan, out, source)
        # the 1-norms of `plan.scales` (pretrain.comm.norms), fused with the addition: same bits
        if source is None:
            blocks = self._blocks_of(plan)
            self._functions["add_segment_abs_sums"](error.numpy(), values.numpy(), blocks, out.numpy())
        else:
            self._add_source(error.numpy(), values.numpy(), plan, out.numpy(), source)
        return out.div_(plan.segment_divisors)

    def _add_source(
        self, error: np.ndarray, values: np.ndarray, plan: _RunPlan, out: np.ndarray, source: MomentumSource
    ) -> None:
        """`add_segment_abs_sums` with x formed from ``source`` tensor by tensor (one loop each), the rest
        of the buffer from ``values``."""
        tensors, rest = self._source_tables(plan, source)
        fused = self._functions["add_momentum_abs_sums"]
        beta1, weight = np.float32(source.beta1), np.float32(1.0 - source.beta1)  # fp32, as torch rounds them
        scale = np.float32(source.grad_scale)
        marginals = source.marginals or [None] * len(tensors)
        for k, (low, high, table) in enumerate(tensors):
            sums = marginals[k]
            outer, inner = (self._no_sums, self._no_sums) if sums is None else (s.numpy() for s in sums)
            if inner.shape[0] > self._partials.shape[0]:
                self._partials = np.empty(inner.shape[0], dtype=np.float32)
            fused(
                error[low:high],
                source.exp_avgs[k].numpy(),
                source.grads[k].numpy(),
                source.divisors[k].numpy(),
                table,
                out,
                beta1,
                weight,
                scale,
                inner.shape[0],
                outer,
                inner,
                self._partials[: inner.shape[0]],
            )
        for low, high, table in rest:
            self._functions["add_segment_abs_sums"](error[low:high], values[low:high], table, out)

    def worker_pass(
        self,
        error: torch.Tensor,
        values: torch.Tensor,
        plan: _RunPlan,
        scales: torch.Tensor,
        source: MomentumSource | None = None,
        *,
        bfloat16: bool = False,
    ) -> WorkerPass | None:
        if not self.fuses_worker_pass(plan, error.numel()):
            return None
        return WorkerPass(self, error, values, plan, scales, source, bfloat16)

    def fuses_worker_pass(self, plan: _RunPlan, numel: int) -> bool:
        return not plan.root and plan.tiles(numel)  # mean_abs: the 1-norms summed as the pass goes

    def server_pass(
        self,
        error: torch.Tensor,
        signs: torch.Tensor,
        scales: torch.Tensor,
        plan: _RunPlan,
        out_scales: torch.Tensor,
        *,
        bfloat16: bool = False,
    ) -> ServerPass | None:
        if not self.fuses_worker_pass(plan, error.numel()):
            return None
        return ServerPass(self, error, signs, scales, plan, out_scales, bfloat16)

    def _segment_starts(self, plan: _RunPlan) -> np.ndarray:
        """Every segment's first element, and the end of the last one, ascending; once per plan."""
        tables = self._tables.setdefault(plan, {})
        if ("starts",) not in tables:
            tables[("starts",)] = segment_bounds(plan.runs)
        return tables[("starts",)]

    def _pass_parts(
        self, plan: _RunPlan, source: MomentumSource | None, low: int, high: int
    ) -> list[tuple[int, int, np.ndarray]]:
        """(tensor index or −1 for `values`, the part's end, its runs: absolute starts and segment indices)
        for the parts of elements [low, high) that one `worker_pass` call each takes (the source's tensors
        and the stretches between them), once per plan, source layout and stretch. Raises ValueError where
        a bound would cut a segment."""
        key = ("pass", low, high) if source is None else ("pass", low, high, source.offsets, source.lengths)
        tables = self._tables.setdefault(plan, {})
        if key in tables:
            return tables[key]
        starts = self._segment_starts(plan)
        bounds = [(low, high, -1)]
        if source is not None:
            bounds, position = [], low
            for k, (begin, length) in enumerate(zip(source.offsets, source.lengths)):
                begin, end = max(begin, low), min(begin + length, high)
                if begin >= end:
                    continue
                if begin < position:
                    raise ValueError("the source's tensors must come in buffer order, without overlaps")
                if begin > position:
                    bounds.append((position, begin, -1))
                bounds.append((begin, end, k))
                position = end
            if position < high:
                bounds.append((position, high, -1))
        parts = []
        for begin, end, k in bounds:
            for bound in (begin, end):
                found = int(np.searchsorted(starts, bound))
                if found == len(starts) or starts[found] != bound:
                    raise ValueError(f"element {bound} is inside a segment of the plan")
            runs, first = cut_runs(plan.runs, begin, end)
            rows = run_table(runs)
            rows[:, 0] += begin
            rows[:, 3] += first
            parts.append((k, end, rows))
        tables[key] = parts
        return parts

    def _blocks_of(self, plan: _RunPlan) -> np.ndarray:
        """`sum_blocks` of the plan's runs, computed once per plan."""
        tables = self._tables.setdefault(plan, {})
        if ("blocks",) not in tables:
            tables[("blocks",)] = sum_blocks(plan.table)
        return tables[("blocks",)]

    def _source_tables(
        self, plan: _RunPlan, source: MomentumSource
    ) -> tuple[list[tuple[int, int, np.ndarray]], list[tuple[int, int, np.ndarray]]]:
        """(low, high, `sum_blocks` relative to low with absolute segment indices) per source tensor, and
        for the stretches between them (the pad); computed once per plan and source layout. Raises ValueError
        where a tensor would cut a segment (the sums would differ)."""
        lengths = source.lengths
        key = (source.offsets, lengths)
        cached = self._tables.setdefault(plan, {}).get(key)
        if cached is not None:
            return cached

        def table(low: int, high: int) -> tuple[int, int, np.ndarray]:
            runs, first = cut_runs(plan.runs, low, high)
            if sum(run.numel for run in runs) != high - low:
                raise ValueError(f"elements [{low}, {high}) are not tiled by the plan's runs")
            rows = run_table(runs)
            rows[:, 3] += first
            return low, high, sum_blocks(rows)

        bounds = sorted(zip(source.offsets, (o + n for o, n in zip(source.offsets, lengths))))
        if list(bounds) != [(o, o + n) for o, n in zip(source.offsets, lengths)]:
            raise ValueError("the source's tensors must come in buffer order")
        tensors = [table(low, high) for low, high in bounds]
        gaps, position = [], 0
        for low, high in [*bounds, (plan.runs[-1].end, plan.runs[-1].end)]:
            if low < position:
                raise ValueError("the source's tensors overlap")
            if low > position:
                gaps.append(table(position, low))
            position = high
        blocks = [rows for _, _, rows in tensors + gaps]
        segments = sum(int(np.maximum(rows[:, 3], rows[:, 4]).sum()) for rows in blocks)  # each ends once
        if segments != plan.num_segments:  # a tensor boundary inside a segment would split it
            raise ValueError("a source tensor starts or ends inside a segment of the plan")
        self._tables[plan][key] = (tensors, gaps)
        return tensors, gaps

    def compress_(
        self,
        values: torch.Tensor,
        scales: torch.Tensor,
        plan: _RunPlan,
        packed: torch.Tensor,
        scratch: torch.Tensor,
    ) -> None:
        self._functions["compress"](
            values.numpy(), packed.reshape(-1).numpy(), plan.table, scales.reshape(-1).numpy(), self._flags
        )

    def accumulate_(
        self,
        error: torch.Tensor,
        signs: torch.Tensor,
        scales: torch.Tensor,
        plan: _RunPlan,
        scratch: torch.Tensor,
    ) -> None:
        n = signs.shape[0]
        scales = scales.reshape(n, -1)
        self._functions["accumulate"](
            error.numpy(),
            # with k virtual workers the sources' rows are strided views: one copy of n·C/8 bytes makes them
            # C-contiguous, which the vectorised loop needs
            signs.reshape(n, -1).contiguous().numpy(),
            plan.table,
            scales.numpy(),
            scales.view(torch.int32).numpy().view(np.uint32),  # the scales' bits (a view, any strides)
            np.float32(n),
            self._signs,
            self._total,
            self._term,
            self._flags,
        )

    def decode_(self, packed: torch.Tensor, scales: torch.Tensor, plan: _RunPlan, out: torch.Tensor) -> None:
        scales = scales.reshape(-1)
        self._functions["decode"](
            packed.reshape(-1).numpy(),
            plan.table,
            scales.numpy(),
            scales.view(torch.int32).numpy().view(np.uint32),
            out.numpy(),
            out.numpy().view(np.uint32),
            self._signs,
        )


def _check_stretch(who: str, low: int, high: int, base: int, stopped: int) -> None:
    """A worker or server pass's next stretch [low, high): it continues where the last one stopped or starts
    on a whole byte, and ``base`` (the element of its signs' byte 0) is a multiple of 8 not after ``low``."""
    if base % 8 or not base <= low <= high or (low != stopped and low % 8):
        raise ValueError(
            f"a {who} pass continues where it stopped ({stopped}) or starts on a whole byte, and its "
            f"signs' byte 0 is element {base} (a multiple of 8, not after {low}): got [{low}, {high})"
        )


class WorkerPass:
    """One call's worker step in one pass over memory (issue #15): per segment, y = e + x, its 1-norm, the
    scale (rounded to bfloat16 where the wire carries that), then the signs and e ← y − s·sign(y) while the
    segment is still in cache; the separate passes (``add_scales_``, the rounding, ``compress_``) read y
    back from memory for the signs. The same arithmetic in the same order, so the same bits (tested).

    ``run(low, high, packed, base)`` takes elements [low, high) (segment bounds), writing their signs into
    ``packed`` (byte 0: elements base … base + 7, base a multiple of 8) and their scales into ``scales``
    (the plan's segment order); calls go in buffer order within each of the pipeline's chunks, the chunks
    in any order (the pipeline sends each stretch as it is done: :mod:`pretrain.comm.pipeline`), and
    together cover the buffer once. A call that ends inside a byte leaves that byte to the next call, which
    continues where it stopped (into the same ``packed``): after ``run(low, high, …)`` the bytes of
    elements up to high & ~7 are complete. With a :class:`MomentumSource`, x is formed from it tensor by
    tensor, and a matrix's square marginals are summed as its rows go by (a call also sums the rows before
    its stretch still undone: always in row order, so the same bits), its column sums rounded and added
    once its last stretch is done (which sums every row left)."""

    def __init__(
        self,
        kernels: NumbaKernels,
        error: torch.Tensor,
        values: torch.Tensor,
        plan: _RunPlan,
        scales: torch.Tensor,
        source: MomentumSource | None,
        bfloat16: bool,
    ) -> None:
        self._kernels, self._plan, self._source, self._bfloat16 = kernels, plan, source, bfloat16
        self._error, self._values, self._scales = error.numpy(), values.numpy(), scales.numpy()
        self._divisors = plan.segment_divisors.numpy()
        self._cell = np.zeros(1, dtype=np.float32)
        self._acc, self._next = 0, 0  # the signs of elements [high & ~7, high) of the last call, and high
        empty = np.zeros(0, dtype=np.float32)
        self._empty, self._no_columns = empty, np.zeros(0, dtype=np.float64)
        self._tensors: list[tuple[np.ndarray, ...]] = []
        self._marginals: list[list[Any] | None] = []
        if source is not None:
            beta1 = np.float32(source.beta1)  # fp32, as torch rounds them
            self._coefficients = (beta1, np.float32(1.0 - source.beta1), np.float32(source.grad_scale))
            self._tensors = [
                (m.numpy(), g.numpy(), d.numpy())
                for m, g, d in zip(source.exp_avgs, source.grads, source.divisors)
            ]
            for sums in source.marginals or [None] * len(self._tensors):
                if sums is None:
                    self._marginals.append(None)
                    continue
                outer, inner = (t.numpy() for t in sums)
                # [outer sums, inner sums, float64 column sums, rows done, fp32 column partials]
                self._marginals.append(
                    [outer, inner, np.zeros(inner.shape[0]), 0, np.empty(inner.shape[0], dtype=np.float32)]
                )
        else:
            self._coefficients = (np.float32(0.0), np.float32(0.0), np.float32(1.0))

    def run(self, low: int, high: int, packed: torch.Tensor, base: int) -> None:
        _check_stretch("worker", low, high, base, self._next)
        function = self._kernels._functions["worker_pass"]
        packed_bytes = packed.reshape(-1).numpy()
        beta1, weight, scale = self._coefficients
        acc = self._acc if low == self._next else 0
        for k, end, runs in self._kernels._pass_parts(self._plan, self._source, low, high):
            if k < 0:
                exp_avg = grad = divisor = self._empty
                offset, marginal = 0, None
            else:
                exp_avg, grad, divisor = self._tensors[k]
                offset, marginal = self._source.offsets[k], self._marginals[k]  # type: ignore[union-attr]
            if marginal is None:
                inner, outer_sums, inner_sums, columns, done, row = (
                    0,
                    self._empty,
                    self._empty,
                    self._no_columns,
                    0,
                    self._empty,
                )
            else:
                outer_sums, inner_sums, columns, done, row = marginal
                inner = inner_sums.shape[0]
            acc, done = function(
                self._error,
                self._values,
                exp_avg,
                grad,
                divisor,
                offset,
                runs,
                self._divisors,
                self._bfloat16,
                self._scales,
                packed_bytes,
                base,
                acc,
                beta1,
                weight,
                scale,
                inner,
                outer_sums,
                columns,
                done,
                row,
                self._kernels._flags,
                self._cell,
                self._cell.view(np.uint32),
            )
            if marginal is not None:
                marginal[3] = done
                if end == offset + exp_avg.shape[0]:  # the matrix's last stretch: its column sums, once
                    inner_sums += columns.astype(np.float32)
        self._acc, self._next = acc, high


class ServerPass:
    """One call's server step in one pass over memory (issue #15): per segment, z = e + (Σ_i s_i·sign_i)/n
    (``accumulate_``'s arithmetic and order), its 1-norm, the scale (rounded where the wire carries
    bfloat16), the signs and e ← z − s·sign(z), while the segment is in cache; the separate passes read e
    back twice (the norms, then the signs). The same bits (tested). ``signs`` [n, chunk bytes] and ``scales``
    [n, chunk segments] are the workers' (C-contiguous); ``run(low, high, packed, base)`` as
    :meth:`WorkerPass.run`, over the chunk's elements, writing ``out_scales`` (the chunk's segments)."""

    def __init__(
        self,
        kernels: NumbaKernels,
        error: torch.Tensor,
        signs: torch.Tensor,
        scales: torch.Tensor,
        plan: _RunPlan,
        out_scales: torch.Tensor,
        bfloat16: bool,
    ) -> None:
        if not (signs.is_contiguous() and scales.is_contiguous()):
            raise ValueError("the server pass reads the workers' signs and scales C-contiguous")
        self._kernels, self._plan, self._bfloat16 = kernels, plan, bfloat16
        self._error, self._signs, self._out_scales = error.numpy(), signs.numpy(), out_scales.numpy()
        self._scales = scales.numpy()
        self._scale_bits = self._scales.view(np.uint32)
        self._count = np.float32(signs.shape[0])
        self._divisors = plan.segment_divisors.numpy()
        self._cell = np.zeros(1, dtype=np.float32)
        self._acc, self._next = 0, 0

    def run(self, low: int, high: int, packed: torch.Tensor, base: int) -> None:
        _check_stretch("server", low, high, base, self._next)
        kernels = self._kernels
        acc = self._acc if low == self._next else 0
        ((_, _, runs),) = kernels._pass_parts(self._plan, None, low, high)
        acc = kernels._functions["server_pass"](
            self._error,
            self._signs,
            runs,
            self._scales,
            self._scale_bits,
            self._count,
            kernels._signs,
            kernels._total,
            kernels._term,
            kernels._flags,
            self._divisors,
            self._bfloat16,
            self._out_scales,
            packed.reshape(-1).numpy(),
            base,
            acc,
            self._cell,
            self._cell.view(np.uint32),
        )
        self._acc, self._next = acc, high


def sum_blocks(runs: np.ndarray) -> np.ndarray:
    """The blocks the fused worker pass adds and sums, for a run table (`layout.run_table`): [B, 5] int64 rows
    (low, high, segment, count, last). count > 0: ``count`` whole segments of (high − low)/count elements from
    segment ``segment`` on, each summed on its own; count == 0: elements [low, high) of segment ``segment``,
    which ends with this block where last == 1. Segments shorter than `SUM_BLOCK` go `SUM_BLOCK` // length
    to a block, longer ones in blocks of `SUM_BLOCK` from their start (the norms' order,
    `pretrain.comm.norms`)."""
    blocks = []
    for start, rows, length, first in runs.tolist():
        if length < SUM_BLOCK:
            group = SUM_BLOCK // length
            for row in range(0, rows, group):
                count, base = min(group, rows - row), start + row * length
                blocks.append((base, base + count * length, first + row, count, 1))
            continue
        for row in range(rows):
            base = start + row * length
            for offset in range(0, length, SUM_BLOCK):
                end = min(offset + SUM_BLOCK, length)
                blocks.append((base + offset, base + end, first + row, 0, int(end == length)))
    return np.asarray(blocks, dtype=np.int64).reshape(-1, 5)


def numba_unavailable_reason() -> str | None:
    """Why the numba kernels cannot be used here, or None."""
    if sys.byteorder != "little":  # `_pack_flags` and `_expand` read eight flag bytes as one uint64
        return "the numba kernels need a little-endian CPU"
    try:
        _numba_functions()
    except ImportError as error:
        return f"numba is not installed ({error})"
    except Exception as error:  # e.g. no writable cache location for the compiled code
        return f"numba cannot be used here ({type(error).__name__}: {error})"
    return None


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
        from pretrain.comm.compiled_kernels import CompiledKernels, compiled_unavailable_reason

        reason = compiled_unavailable_reason(device)
        if reason is None:
            return CompiledKernels(device)
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
