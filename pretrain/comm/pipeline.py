"""The compressed allreduce with its wire time overlapped (issue #15, item 2): signs travel in pieces.

One call of :class:`~pretrain.comm.compressed_allreduce.CompressedAllreduce` computes, then sends,
then computes, then sends: on a slow link the compression waits for nothing and the wire waits for all
of it. Here every chunk is cut into P byte-aligned *pieces* and the two phases run piece by piece:

1. worker: y = x + e and the scales over the whole buffer (they need every element); the scales go out;
   then for piece b: pack piece b of every chunk (and update the error there) into its send buffer and
   start its ``all_to_all`` (``async_op=True``), so piece b is on the wire while piece b + 1 is packed;
2. server: as piece b of every worker arrives, accumulate it into the server error; then the server's
   scales (whole chunk) go out; then for piece b: pack it and start its ``all_gather``;
3. as piece b of every chunk arrives, decode it into the output.

The arithmetic per element is the unpipelined call's, in the same order (the pieces only change when an
element is processed, never what is computed from what), so the result and the error buffers are
bitwise those of the plain call, and of the reference model (tested). The bytes are the same too. Used
for one worker per process over the native collectives; ``pieces=1`` is the plain call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from pretrain import faults
from pretrain.comm.layout import Run

# Auto: about this many bytes of signs per piece and destination; at most MAX_PIECES pieces.
PIECE_BYTES = 1 << 20
MAX_PIECES = 8


def auto_pieces(chunk_bytes: int) -> int:
    """Pieces for a chunk of ``chunk_bytes`` packed bytes: 1 below 2 MiB (nothing worth hiding), up to 8."""
    return max(1, min(MAX_PIECES, chunk_bytes // PIECE_BYTES))


def cut_runs(runs: list[Run], low: int, high: int) -> tuple[list[Run], int]:
    """The runs (which tile [0, end) in order, segment i after segment i−1) restricted to [low, high),
    with starts relative to ``low``, and the index of their first segment."""
    pieces: list[Run] = []
    first_segment: int | None = None
    segment = 0
    for run in runs:
        if run.end <= low or run.start >= high:
            segment += run.rows
            continue
        length = run.row_length
        first_row = max(0, (low - run.start) // length)
        last_row = min(run.rows, -(-(high - run.start) // length))  # rows touching [low, high)
        if first_segment is None:
            first_segment = segment + first_row
        row = first_row
        while row < last_row:
            row_start = run.start + row * length
            begin, end = max(row_start, low), min(row_start + length, high)
            if begin == row_start and end == row_start + length:  # whole rows: one run for all of them
                whole = min(last_row, row + (high - row_start) // length) - row
                pieces.append(Run(row_start - low, whole, length))
                row += whole
                continue
            pieces.append(Run(begin - low, 1, end - begin))
            row += 1
        segment += run.rows
    return pieces, first_segment or 0


@dataclass
class _Piece:
    """Piece b: bytes [byte_low, byte_high) of every chunk."""

    byte_low: int
    byte_high: int

    @property
    def low(self) -> int:
        return self.byte_low * 8

    @property
    def high(self) -> int:
        return self.byte_high * 8


class PipelinedExchange:
    """Runs one engine call piece by piece (module docstring). Built by the engine, which it reads."""

    def __init__(self, engine, pieces: int) -> None:
        # (imported here: compressed_allreduce imports this module)
        from pretrain.comm.compressed_allreduce import _all_gather_flat, _RunPlan

        self.engine = engine
        self._all_gather_flat = _all_gather_flat
        n, chunk_bytes = engine.world_size, engine.chunk_numel // 8
        self.pieces = [
            _Piece(b * chunk_bytes // pieces, (b + 1) * chunk_bytes // pieces) for b in range(pieces)
        ]
        device, sign_scale = engine.device, engine.sign_scale
        layout = engine.layout

        def plan(runs: list[Run], low: int, high: int) -> tuple[_RunPlan, int]:
            cut, first = cut_runs(runs, low, high)
            return _RunPlan(cut, sign_scale, device), first

        chunk = engine.chunk_numel
        worker_runs = layout.worker_runs
        # per piece and chunk: the worker plan of that stretch of the buffer; per piece and chunk j: the
        # server plan of chunk j's stretch (this process serves chunk `rank`, decodes all of them)
        self.worker_plans = [
            [plan(worker_runs, j * chunk + p.low, j * chunk + p.high) for j in range(n)] for p in self.pieces
        ]
        self.chunk_plans = [
            [plan(layout.chunk_runs[j], p.low, p.high) for j in range(n)] for p in self.pieces
        ]
        # The pieces' sign buffers are carved out of the engine's own (same total sizes): no extra memory.
        sizes = [p.byte_high - p.byte_low for p in self.pieces]
        self.send = _carve(engine._worker_packed, sizes, n)
        self.received = _carve(engine._recv_signs, sizes, n)
        self.server_send = _carve(engine._server_packed, sizes, None)
        self.gathered = _carve(engine._gathered_server_packed, sizes, n)

    def __call__(self, values: torch.Tensor, out: torch.Tensor, source=None) -> None:
        engine = self.engine
        kernels, group, n, rank = engine.kernels, engine.group, engine.world_size, engine.rank
        chunk = engine.chunk_numel
        # 1. worker: y = x + e, the scales over the whole buffer, sent ahead of the signs
        error = engine._worker_errors[0]
        scales = engine._round(
            kernels.add_scales_(
                error, values, engine._worker_plan, out=engine._worker_scales[0], source=source
            )
        )
        torch.index_select(scales, 0, engine._send_scale_index, out=engine._send_scales)
        engine._exchange_worker_scales()
        phase_one = []
        for piece, plans, send, received in zip(self.pieces, self.worker_plans, self.send, self.received):
            for j, (worker_plan, first) in enumerate(plans):
                low, high = j * chunk + piece.low, j * chunk + piece.high
                kernels.compress_(
                    error[low:high],
                    scales[first : first + worker_plan.num_segments],
                    worker_plan,
                    send[j],
                    scratch=values[low:high],
                )
            phase_one.append(dist.all_to_all_single(received, send, group=group, async_op=True))
        # 2. server: accumulate each piece as it arrives, then the scales, then the signs piece by piece
        server_error = engine._server_errors[0]
        worker_scales = engine._recv_scales.view(n, engine._local_segments)
        scratch = values[: n * chunk]
        for work, piece, plans, received in zip(phase_one, self.pieces, self.chunk_plans, self.received):
            work.wait()
            server_plan, first = plans[rank]
            kernels.accumulate_(
                server_error[piece.low : piece.high],
                received,
                worker_scales[:, first : first + server_plan.num_segments],
                server_plan,
                scratch=scratch[: n * (piece.high - piece.low)],
            )
        faults.inside("exchange")  # test-only (pretrain/faults.py): between the all-to-all and the all-gather
        chunk_plan = engine._chunk_plans[engine._local_chunks[0]]
        server_scales = engine._round(chunk_plan.scales(server_error, out=engine._server_scales))
        engine._exchange_server_scales()
        phase_two = []
        for piece, plans, server_send, gathered in zip(
            self.pieces, self.chunk_plans, self.server_send, self.gathered
        ):
            server_plan, first = plans[rank]
            kernels.compress_(
                server_error[piece.low : piece.high],
                server_scales[first : first + server_plan.num_segments],
                server_plan,
                server_send,
                scratch=scratch[: piece.high - piece.low],
            )
            phase_two.append(
                self._all_gather_flat(gathered.view(-1), server_send, group=group, async_op=True)
            )
        # 3. decode each piece of every chunk as it arrives
        all_scales, offsets = engine._all_server_scales, engine._chunk_scale_offsets
        for work, piece, plans, gathered in zip(phase_two, self.pieces, self.chunk_plans, self.gathered):
            work.wait()
            for j, (chunk_plan, first) in enumerate(plans):
                start = offsets[j] + first
                kernels.decode_(
                    gathered[j],
                    all_scales[start : start + chunk_plan.num_segments],
                    chunk_plan,
                    out[j * chunk + piece.low : j * chunk + piece.high],
                )


def _carve(storage: torch.Tensor, sizes: list[int], rows: int | None) -> list[torch.Tensor]:
    """Consecutive views of ``storage`` (flat uint8): [rows, size] (or [size]) for each size."""
    flat, views, offset = storage.view(-1), [], 0
    for size in sizes:
        count = size * (rows or 1)
        piece = flat[offset : offset + count]
        views.append(piece.view(rows, size) if rows else piece)
        offset += count
    if offset != flat.numel():
        raise AssertionError(f"pieces cover {offset} of {flat.numel()} bytes")
    return views


def pieces_for(engine, requested: int | None) -> int:
    """How many pieces a call of ``engine`` runs in: ``requested`` (0 or 1 = off), or auto (None)."""
    if requested is not None and requested < 0:
        raise ValueError(f"pipeline must be >= 0 (0 = off) or None (auto), got {requested}")
    chunk_bytes = engine.chunk_numel // 8
    pieces = auto_pieces(chunk_bytes) if requested is None else max(1, requested)
    return max(1, min(pieces, chunk_bytes))
