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

Where the kernels fuse the worker's step (:class:`~pretrain.comm.kernels.WorkerPass`: numba, ``mean_abs``
scales; issue #15) and the layout's segments are short enough to cut every chunk into its pieces at segment
bounds (:func:`fused_stretches`: per-row and per-column scales, the exact vectors; not one scale per tensor
or DeepSpeed's single scale), step 1 is one pass instead of two: y = x + e, each segment's scale, its signs
and the error feedback, segment by segment while the segment is in cache, stretch by stretch in buffer
order within a chunk. A stretch's scales are known only once the pass has left it, so each stretch (signs
and scales) goes to the process serving its chunk as soon as it is done, point to point
(``isend``/``irecv``: chunk j's stretches are ready at a different time for each destination, which an
``all_to_all`` per piece would wait for). Process r takes the other chunks first, r + 1, r + 2, … (wrapping
round), and its own last: its outgoing stretches are on the wire while it works, and as it goes through its
own chunk it serves each server stretch as soon as every worker's stretches under it are in (the others'
came early) and sends it on at once, so phase 2 runs on the wire while the pass goes on too. (In buffer
order, process 0's outgoing stretches were its second half's: its server waited for them, and phase 2
started only after the whole pass: 0.033 s of waiting per step at BERT-Base, 2 ranks, 1 Gbit/s.)

The arithmetic per element is the unpipelined call's, in the same order (the pieces only change when an
element is processed, never what is computed from what), so the result and the error buffers are
bitwise those of the plain call, and of the reference model (tested). The bytes are the same too. Used
for one worker per process over the native collectives; ``pieces=1`` is the plain call.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pretrain.comm.collectives import all_gather_flat
from pretrain.comm.layout import Run, cut_runs, segment_bounds
from pretrain.comm.plan import RunPlan

# Auto: about this many bytes of signs per piece and destination; at most MAX_PIECES pieces.
PIECE_BYTES = 1 << 20
MAX_PIECES = 8


def auto_pieces(chunk_bytes: int) -> int:
    """Pieces for a chunk of ``chunk_bytes`` packed bytes: 1 below 2 MiB (nothing worth hiding), up to 8."""
    return max(1, min(MAX_PIECES, chunk_bytes // PIECE_BYTES))


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
    """Runs one engine call piece by piece (module docstring). Built by the engine, whose public buffers,
    plans and steps it uses (the set-up of `CompressedAllreduce`)."""

    def __init__(self, engine, pieces: int) -> None:
        self.engine = engine
        n, chunk_bytes = engine.world_size, engine.chunk_numel // 8
        self.pieces = [
            _Piece(b * chunk_bytes // pieces, (b + 1) * chunk_bytes // pieces) for b in range(pieces)
        ]
        device, sign_scale = engine.device, engine.sign_scale
        layout = engine.layout

        def plan(runs: list[Run], low: int, high: int) -> tuple[RunPlan, int]:
            cut, first = cut_runs(runs, low, high)
            return RunPlan(cut, sign_scale, device), first

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
        self.send = _carve(engine.worker_packed, sizes, n)
        self.received = _carve(engine.recv_signs, sizes, n)
        self.server_send = _carve(engine.server_packed, sizes, None)
        self.gathered = _carve(engine.gathered_server_packed, sizes, n)
        # Phase one fused where the kernels fuse the worker's step and the layout's segments allow pieces
        self.stretches = fused_stretches(engine, pieces)
        self._fused = _Fused(engine, self.stretches, plan) if self.stretches is not None else None

    def __call__(self, values: torch.Tensor, out: torch.Tensor, source=None) -> None:
        if self._fused is not None:
            self._fused_call(values, out, source)
            return
        self._phase_one(values, source)
        if self.engine.hook is not None:  # between the all-to-all and the all-gather (the engine's ``hook``)
            self.engine.hook("exchange")
        self._phase_two(values, out)

    def _phase_one(self, values: torch.Tensor, source) -> None:
        """1. and the server's accumulation (module docstring), the worker's passes separate."""
        engine = self.engine
        kernels, group, n, rank = engine.kernels, engine.group, engine.world_size, engine.rank
        chunk = engine.chunk_numel
        # 1. worker: y = x + e, the scales over the whole buffer, sent ahead of the signs
        error = engine.worker_errors[0]
        scales = engine.round_scales(
            kernels.add_scales_(error, values, engine.worker_plan, out=engine.worker_scales[0], source=source)
        )
        torch.index_select(scales, 0, engine.send_scale_index, out=engine.send_scales)
        engine.exchange_worker_scales()
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
        # 2. server: accumulate each piece as it arrives
        server_error = engine.server_errors[0]
        worker_scales = engine.recv_scales.view(n, engine.local_segments)
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

    def _fused_call(self, values: torch.Tensor, out: torch.Tensor, source) -> None:
        """The call with both compressions fused (module docstring), stretch by stretch, point to point."""
        engine, fused = self.engine, self._fused
        assert fused is not None and self.stretches is not None
        group, n, rank, chunk = engine.group, engine.world_size, engine.rank, engine.chunk_numel
        peers, others = fused.peers, [i for i in range(n) if i != rank]
        error, scales = engine.worker_errors[0], engine.worker_scales[0]
        bfloat16 = engine.wire_dtype is not None
        worker = engine.kernels.worker_pass(
            error, values, engine.worker_plan, scales, source, bfloat16=bfloat16
        )
        signs = engine.recv_signs.view(n, chunk // 8)
        received_scales = engine.recv_scales.view(n, engine.local_segments)
        scales_in, scales_out = fused.scales_in, fused.scales_out
        local, origin = engine.layout.payload_offsets[rank], rank * chunk // 8
        # 1. every worker stretch of this process's chunk, posted first
        receives: list[list] = []
        for b, stretch in enumerate(self.stretches[rank]):
            low, high = stretch.bytes_low - origin, stretch.bytes_high - origin
            first, last = stretch.first - local, stretch.last - local
            receives.append(
                [
                    work
                    for i in others
                    for work in (
                        dist.irecv(signs[i, low:high], src=peers[i], group=group, tag=2 * b),
                        dist.irecv(scales_in[i, first:last], src=peers[i], group=group, tag=2 * b + 1),
                    )
                ]
            )
        # 2. the other servers' stretches, posted before any is sent
        gathered = engine.gathered_server_packed.view(n, chunk // 8)
        all_scales, offsets = engine.all_server_scales, engine.chunk_scale_offsets
        server_in = fused.server_scales_in
        gathers: dict[tuple[int, int], list[Any]] = {
            (j, t): [
                dist.irecv(gathered[j, part.bytes_low : part.bytes_high], src=peers[j], group=group, tag=tag),
                dist.irecv(
                    server_in[offsets[j] + part.first : offsets[j] + part.last],
                    src=peers[j],
                    group=group,
                    tag=tag + 1,
                ),
            ]
            for j in others
            for t, part in enumerate(fused.server_stretches[j])
            for tag in (fused.phase_two_tag + 2 * t,)
        }
        # the worker's pass over the other chunks, stretch by stretch, each sent when done: the chunks
        # after this process's first (rank + 1, …, wrapping round), so that every chunk's server gets the
        # stretches of some worker early
        sends: list[Any] = []
        packed = engine.worker_packed[0]
        for j in ((rank + k) % n for k in range(1, n)):
            for b, stretch in enumerate(self.stretches[j]):
                first, last = stretch.first, stretch.last
                worker.run(stretch.low, stretch.high, packed, 0)  # type: ignore[union-attr]
                if fused.wire:  # the wire's dtype: exact, the scales are rounded to it
                    scales_out[first:last].copy_(scales[first:last])
                piece = packed[stretch.bytes_low : stretch.bytes_high]
                sends.append(dist.isend(piece, dst=peers[j], group=group, tag=2 * b))
                sends.append(dist.isend(scales_out[first:last], dst=peers[j], group=group, tag=2 * b + 1))
        if engine.hook is not None:  # between the workers' signs and the servers' (the engine's ``hook``)
            engine.hook("exchange")
        # then this process's chunk, straight into its row of the chunk's signs, each server stretch served
        # and sent as soon as the workers' stretches it needs are in (phase 2 on the wire while the pass
        # goes on)
        own = slice(offsets[rank], offsets[rank] + engine.local_segments)
        server = engine.kernels.server_pass(
            engine.server_errors[0],
            signs,
            received_scales,
            engine.chunk_plans[rank],
            all_scales[own],
            bfloat16=bfloat16,
        )
        parts, served = fused.server_stretches[rank], 0
        for b, stretch in enumerate(self.stretches[rank]):
            worker.run(stretch.low, stretch.high, signs[rank], rank * chunk)  # type: ignore[union-attr]
            scales_in[rank, stretch.first - local : stretch.last - local].copy_(
                scales[stretch.first : stretch.last]
            )
            for work in receives[b]:  # the other workers' stretch b (and its scales)
                work.wait()
            if fused.wire:
                arrived = slice(stretch.first - local, stretch.last - local)
                received_scales[:, arrived].copy_(scales_in[:, arrived])
            while served < len(parts) and parts[served].piece <= b:
                t, part = served, parts[served]
                served += 1
                server.run(part.low, part.high, gathered[rank], 0)  # type: ignore[union-attr]
                mine = all_scales[own][part.first : part.last]
                if fused.wire:
                    fused.server_scales_out[part.first : part.last].copy_(mine)
                    mine = fused.server_scales_out[part.first : part.last]
                tag = fused.phase_two_tag + 2 * t
                for j in others:
                    sends.append(
                        dist.isend(
                            gathered[rank, part.bytes_low : part.bytes_high],
                            dst=peers[j],
                            group=group,
                            tag=tag,
                        )
                    )
                    sends.append(dist.isend(mine, dst=peers[j], group=group, tag=tag + 1))
        assert served == len(parts), "every server stretch is served by the worker's last stretch"
        # 3. this chunk decoded at once; the others' stretch by stretch as they arrive
        kernels = engine.kernels
        kernels.decode_(
            gathered[rank], all_scales[own], engine.chunk_plans[rank], out[rank * chunk : (rank + 1) * chunk]
        )
        for j in others:
            for t, (part, (plan, first)) in enumerate(zip(fused.server_stretches[j], fused.decode_plans[j])):
                for work in gathers[(j, t)]:
                    work.wait()
                start = offsets[j] + first
                if fused.wire:
                    arrived = slice(offsets[j] + part.first, offsets[j] + part.last)
                    all_scales[arrived].copy_(server_in[arrived])
                kernels.decode_(
                    gathered[j, part.bytes_low : part.bytes_high],
                    all_scales[start : start + plan.num_segments],
                    plan,
                    out[j * chunk + 8 * part.bytes_low : j * chunk + 8 * part.bytes_high],
                )
        for work in sends:
            work.wait()

    def _phase_two(self, values: torch.Tensor, out: torch.Tensor) -> None:
        """The server's scales and signs (piece by piece), and 3."""
        engine = self.engine
        kernels, group, rank = engine.kernels, engine.group, engine.rank
        chunk = engine.chunk_numel
        server_error = engine.server_errors[0]
        scratch = values[:chunk]
        chunk_plan = engine.chunk_plans[engine.local_chunks[0]]
        server_scales = engine.round_scales(chunk_plan.scales(server_error, out=engine.server_scales))
        engine.exchange_server_scales()
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
            phase_two.append(all_gather_flat(gathered.view(-1), server_send, group=group, async_op=True))
        # 3. decode each piece of every chunk as it arrives
        all_scales, offsets = engine.all_server_scales, engine.chunk_scale_offsets
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


@dataclass(frozen=True)
class _Stretch:
    """The fused call's unit: elements [low, high) (segment bounds; a worker's: buffer positions, a server's:
    chunk positions), its segments [first, last) (the worker's scale order, or the chunk's). It sends the
    signs of elements [low & ~7, high & ~7) (whole bytes: a byte that straddles ``high`` goes with the next
    stretch). A server's stretch is served once the workers' stretches up to ``piece`` have arrived."""

    low: int
    high: int
    first: int
    last: int
    piece: int = -1

    @property
    def bytes_low(self) -> int:
        return self.low // 8

    @property
    def bytes_high(self) -> int:
        return self.high // 8


def fused_stretches(engine, pieces: int) -> list[list[_Stretch]] | None:
    """Per chunk, its ``pieces`` stretches for the fused phase one: cut at the segment bounds nearest to an
    equal split (each stretch at least one byte of signs). None where the kernels do not fuse the worker's
    step, or the segments are too long to cut (a stretch over twice its share: e.g. one scale per
    tensor), or a chunk's payload is not its own segments."""
    plan, chunk, layout = engine.worker_plan, engine.chunk_numel, engine.layout
    if not (engine.fuse_worker_pass and engine.kernels.fuses_worker_pass(plan, engine.numel)):
        return None
    bounds = segment_bounds(layout.worker_runs)
    stretches = []
    for j in range(engine.world_size):
        low, high = j * chunk, (j + 1) * chunk
        first = int(np.searchsorted(bounds, low))
        if first == len(bounds) or bounds[first] != low or layout.payload_offsets[j] != first:
            return None
        inside = bounds[(bounds > low) & (bounds < high)]
        cuts = [low]
        for b in range(1, pieces):
            if not len(inside):
                break
            target = low + b * chunk // pieces
            k = int(np.searchsorted(inside, target))
            near = [int(inside[i]) for i in (k - 1, k) if 0 <= i < len(inside)]
            cut = min(near, key=lambda c: abs(c - target))
            if cut // 8 > cuts[-1] // 8:
                cuts.append(cut)
        cuts.append(high)
        if max(b - a for a, b in itertools.pairwise(cuts)) > 2 * chunk / pieces:
            return None
        segments = np.searchsorted(bounds, cuts)
        stretches.append(
            [_Stretch(a, b, int(s), int(t)) for a, b, s, t in zip(cuts, cuts[1:], segments, segments[1:])]
        )
    return stretches


def server_stretches(
    stretches: list[_Stretch], chunk_runs: list[Run], origin: int, chunk: int
) -> list[_Stretch]:
    """A chunk's server stretches: after worker stretch b has arrived, the chunk's whole segments up to
    the last byte it completes (a stretch per piece that adds at least a byte; the last one to the end)."""
    bounds = segment_bounds(chunk_runs)
    parts: list[_Stretch] = []
    low = 0
    for b, stretch in enumerate(stretches):
        if b == len(stretches) - 1:
            high = chunk
        else:
            complete = 8 * stretch.bytes_high - origin  # elements whose signs have all arrived
            high = int(bounds[np.searchsorted(bounds, complete, side="right") - 1])
            if high // 8 <= low // 8:
                continue
        first, last = (int(i) for i in np.searchsorted(bounds, [low, high]))
        parts.append(_Stretch(low, high, first, last, piece=b))
        low = high
    return parts


class _Fused:
    """What the fused call needs besides the engine's buffers: the peers' global ranks, the scales' wire
    buffers (the engine's own where they travel in fp32), every chunk's server stretches and the decode's
    plan for each."""

    def __init__(self, engine, stretches: list[list[_Stretch]], plan) -> None:
        n, group, chunk = engine.world_size, engine.group, engine.chunk_numel
        self.peers = [dist.get_global_rank(group, i) if group is not None else i for i in range(n)]
        self.wire = engine.wire_dtype is not None

        def wire_like(tensor: torch.Tensor) -> torch.Tensor:
            return torch.empty_like(tensor, dtype=engine.wire_dtype) if self.wire else tensor

        self.scales_in = wire_like(engine.recv_scales.view(n, engine.local_segments))
        self.scales_out = wire_like(engine.worker_scales[0])
        self.server_scales_in = wire_like(engine.all_server_scales)
        self.server_scales_out = wire_like(engine.server_scales)
        runs = engine.layout.chunk_runs
        self.server_stretches = [server_stretches(stretches[j], runs[j], j * chunk, chunk) for j in range(n)]
        # phase 1 tags its messages 0 … 2·pieces − 1 (signs, scales per stretch); phase 2 from here on
        self.phase_two_tag = 2 * max(len(parts) for parts in stretches)
        self.decode_plans = [
            [plan(runs[j], 8 * part.bytes_low, 8 * part.bytes_high) for part in self.server_stretches[j]]
            for j in range(n)
        ]


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
