"""The compressed allreduce's numba loops (:class:`~pretrain.comm.numba_kernels.NumbaKernels` calls them; the
norms' :func:`segment_abs_sums` too, and the optimizer's loops in :mod:`pretrain.optim.numba_loops` build on
:func:`compress_row`, :func:`to_bfloat16` and :func:`sum_block`). Every loop runs over a run table
(:func:`~pretrain.comm.layout.run_table`: start, rows, row length, first segment) in IEEE float32 arithmetic
in the reference's order; why each is shaped as it is: the comments, and :mod:`pretrain.comm.numba_kernels`.
Imports numba: import it only where :func:`~pretrain.comm.numba_support.numba_unavailable_reason` is None.
"""

from __future__ import annotations

import numpy as np

from pretrain.comm.numba_helpers import abs_sum, jit
from pretrain.comm.numba_support import SUM_BLOCK


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
def compress_row(values, packed, i, end, s, flags, words, acc):
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
    # Elements in buffer order (the runs tile it), segment by segment (`compress_row`)
    words = flags.view(np.uint64)
    acc = 0
    for r in range(runs.shape[0]):
        start, rows, length, first = runs[r, 0], runs[r, 1], runs[r, 2], runs[r, 3]
        for row in range(rows):
            i = start + row * length
            acc = compress_row(values, packed, i, i + length, scales[first + row], flags, words, acc)


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
        _signed(total_bits[:elements], signs[0, begin : begin + block], scale_bits[0, segment], flags, words)
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
    # and e ← z − s·sign(z) (`compress_row`). `runs`: the stretch's whole segments (chunk positions,
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
            norm = segment_abs_sum(error, low, end)
            s = np.float32(norm) / segment_divisors[segment]
            if bfloat16:
                s = to_bfloat16(s, cell, cell_bits)
            out_scales[segment] = s
            acc = compress_row(signs_of, packed, low - packed_base, end - packed_base, s, flags, words, acc)
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


@jit
def segment_abs_sums(values, runs, out):
    # out[segment] ← Σ|values| over it: its blocks' partial sums added in order, rounded to fp32 once
    for r in range(runs.shape[0]):
        start, rows, length, first = runs[r, 0], runs[r, 1], runs[r, 2], runs[r, 3]
        for row in range(rows):
            base = start + row * length
            out[first + row] = np.float32(segment_abs_sum(values, base, base + length))


@jit
def add(error, values):
    for i in range(error.shape[0]):
        error[i] = error[i] + values[i]


@jit
def sum_block(error, low, high, segment, count, last, out, total):
    # A block of `sum_blocks` after its addition: `count` whole segments each summed into `out`, or a part
    # of one added to the running float64 `total` (rounded into `out` at its last block); returns the
    # running total. Each segment's sum: its blocks' partial sums added in order (`norms`).
    if count > 0:
        length = (high - low) // count
        for q in range(count):
            out[segment + q] = np.float32(abs_sum(error[low + q * length : low + (q + 1) * length]))
        return 0.0
    total += abs_sum(error[low:high])
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
        add(error[low:high], values[low:high])
        total = sum_block(error, low, high, blocks[b, 2], blocks[b, 3], blocks[b, 4], out, total)


@jit
def to_bfloat16(s, cell, cell_bits):
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
def segment_abs_sum(values, low, end):
    # Σ|values[low:end]| in float64: the partial sums of its blocks of SUM_BLOCK elements from `low`, added
    # in order (the norms' order, `pretrain.comm.norms`)
    total = 0.0
    for i in range(low, end, SUM_BLOCK):
        total += abs_sum(values[i : min(i + SUM_BLOCK, end)])
    return total


@jit
def worker_pass(
    error, values, runs, segment_divisors, bfloat16, scales, packed, packed_base, acc, flags, cell, cell_bits
):
    # The worker's whole step segment by segment (`WorkerPass`): y = e + x into `error` a SUM_BLOCK block
    # at a time, each block's 1-norm summed from L1 right after (the norms' blocks and order), then the
    # scale and the signs and the feedback while the segment is still in cache (`compress_row`). x from
    # `values` (a source's tensors: `pretrain.optim.numba_loops.worker_pass`). `runs`: absolute starts and
    # segment indices, whole segments; `packed[0]` holds the signs of elements packed_base … packed_base + 7.
    # Returns the carried byte. The segment's scale is set here, not in a helper: a call per segment
    # with nine array arguments (each passed and reference-counted) made the default layout's exchange
    # ~25% slower at BERT-mini's ~130-element segments (this pass, `server_pass` and the optimizer's).
    words = flags.view(np.uint64)
    signs_of = error[packed_base:]
    for r in range(runs.shape[0]):
        start, rows, length, first = runs[r, 0], runs[r, 1], runs[r, 2], runs[r, 3]
        for row in range(rows):
            low, end = start + row * length, start + (row + 1) * length
            total = 0.0
            i = low
            while i < end:
                high = min(i + SUM_BLOCK, end)
                add(error[i:high], values[i:high])
                total += abs_sum(error[i:high])
                i = high
            s = np.float32(total) / segment_divisors[first + row]
            if bfloat16:
                s = to_bfloat16(s, cell, cell_bits)
            scales[first + row] = s
            acc = compress_row(signs_of, packed, low - packed_base, end - packed_base, s, flags, words, acc)
    return acc
