"""Where one 1-bit scale applies: the scale layout of a flat buffer in the compressed allreduce.

The compressed allreduce sends, for every *segment* of the buffer, one sign per element and one fp32
scale (DeepSpeed uses one scale per worker buffer and one per server chunk). A layout lists the
segments as *runs*: ``rows`` consecutive segments of ``row_length`` elements each, so that an
embedding matrix with one scale per row is one run, and a tensor with one scale is a run of one row.
Runs are what the engine loops over, so a layout costs a few vector operations per run, never a
Python step per element or per row.

Two kinds:

- :meth:`ScaleLayout.single`: DeepSpeed's layout (docs/onebit-lamb.md). The worker compresses its whole buffer
  with ONE scale, and every server chunk is re-compressed with one scale. Every chunk's payload then
  carries that one worker scale.
- :meth:`ScaleLayout.from_blocks`: one scale per *block* (a tensor, or one row of a row-scaled
  matrix), for workers and servers alike. Server chunks are equal slices of the buffer and ignore
  tensor boundaries, so a block that crosses a chunk boundary is cut there: each piece gets its own
  scale (a row of an embedding split by a chunk boundary travels as two segments). A worker's
  segments are therefore exactly the union of the chunks' segments, and chunk j's payload carries the
  worker scales of chunk j's segments.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Run:
    """``rows`` consecutive segments of ``row_length`` elements each, starting at element ``start``."""

    start: int
    rows: int
    row_length: int

    @property
    def numel(self) -> int:
        return self.rows * self.row_length

    @property
    def end(self) -> int:
        return self.start + self.numel

    def shifted(self, offset: int) -> Run:
        return Run(self.start + offset, self.rows, self.row_length)


def run_table(runs: list[Run]) -> np.ndarray:
    """[runs, 4] int64, what the numba kernels loop over: start, rows, row_length, and the index of the
    run's first segment (its first scale) among all the runs' segments."""
    table, position = [], 0
    for run in runs:
        table.append((run.start, run.rows, run.row_length, position))
        position += run.rows
    return np.asarray(table, dtype=np.int64).reshape(-1, 4)


def segment_bounds(runs: list[Run]) -> np.ndarray:
    """Every segment's first element and every run's end, ascending and unique (int64)."""
    if not runs:
        return np.zeros(0, dtype=np.int64)
    starts = [run.start + np.arange(run.rows + 1, dtype=np.int64) * run.row_length for run in runs]
    return np.unique(np.concatenate(starts))


@dataclass(frozen=True)
class Block:
    """A region of the flat buffer whose elements share scales row by row: ``numel`` elements in rows
    of ``row_length`` (``row_length == numel``: one scale for the whole region)."""

    numel: int
    row_length: int

    def __post_init__(self) -> None:
        if self.numel < 1 or self.row_length < 1 or self.numel % self.row_length:
            raise ValueError(f"a block of {self.numel} elements cannot have rows of {self.row_length}")


def _cut(start: int, block: Block, low: int, high: int) -> list[Run]:
    """The runs of ``block`` (at ``start``) inside [low, high): a partial first row, whole rows, a
    partial last row; offsets relative to ``low``."""
    end = start + block.numel
    first, last = max(start, low), min(end, high)
    if first >= last:
        return []
    length = block.row_length
    runs: list[Run] = []
    # rows are aligned at start + i·length; a boundary inside a row cuts it into pieces
    row_begin = start + (first - start) // length * length
    if row_begin < first:  # the chunk starts inside a row
        piece_end = min(row_begin + length, last)
        runs.append(Run(first - low, 1, piece_end - first))
        first = piece_end
    whole_rows = (last - first) // length
    if whole_rows:
        runs.append(Run(first - low, whole_rows, length))
        first += whole_rows * length
    if first < last:  # the chunk ends inside a row
        runs.append(Run(first - low, 1, last - first))
    return runs


class ScaleLayout:
    """Segments of a flat buffer of ``numel`` elements cut into ``world_size`` equal chunks.

    Attributes:
        chunk_runs: per chunk, its runs with offsets relative to the chunk's start; chunk j has
            ``chunk_segments[j]`` segments (the server compresses chunk j with that many scales).
        worker_runs: the runs a worker compresses its whole buffer with (global offsets).
        payload_offsets: chunk j's payload carries the worker scales
            ``[payload_offsets[j], payload_offsets[j] + chunk_segments[j])``.
        single: True for DeepSpeed's layout (one worker scale, one server scale per chunk).
    """

    def __init__(self, numel: int, world_size: int, chunk_runs: list[list[Run]], *, single: bool) -> None:
        if world_size < 1 or numel % world_size:
            raise ValueError(f"{numel} elements do not split into {world_size} equal chunks")
        chunk_numel = numel // world_size
        if len(chunk_runs) != world_size:
            raise ValueError(f"expected runs for {world_size} chunks, got {len(chunk_runs)}")
        for index, runs in enumerate(chunk_runs):
            position = 0
            for run in runs:
                if run.start != position or run.rows < 1 or run.row_length < 1:
                    raise ValueError(f"chunk {index}: runs must tile the chunk in order, got {runs}")
                position = run.end
            if position != chunk_numel:
                raise ValueError(f"chunk {index}: runs cover {position} of {chunk_numel} elements")
        self.numel, self.world_size, self.chunk_numel = numel, world_size, chunk_numel
        self.single = single
        self.chunk_runs = chunk_runs
        self.chunk_segments = [sum(run.rows for run in runs) for runs in chunk_runs]
        if single:
            self.worker_runs = [Run(0, 1, numel)]
            self.payload_offsets = [0] * world_size
        else:
            self.worker_runs = [
                run.shifted(index * chunk_numel) for index, runs in enumerate(chunk_runs) for run in runs
            ]
            offsets, total = [], 0
            for count in self.chunk_segments:
                offsets.append(total)
                total += count
            self.payload_offsets = offsets

    @property
    def worker_segments(self) -> int:
        """Scales one worker computes per call."""
        return sum(run.rows for run in self.worker_runs)

    @property
    def total_chunk_segments(self) -> int:
        """Scales over all chunks (= what one call's two phases carry per worker, summed over chunks)."""
        return sum(self.chunk_segments)

    @classmethod
    def single_scale(cls, numel: int, world_size: int) -> ScaleLayout:
        """DeepSpeed's layout (docs/onebit-lamb.md)."""
        chunk_numel = numel // world_size if world_size else 0
        return cls(numel, world_size, [[Run(0, 1, chunk_numel)] for _ in range(world_size)], single=True)

    @classmethod
    def from_blocks(cls, blocks: list[Block], numel: int, world_size: int) -> ScaleLayout:
        """One scale per block row, cut at chunk boundaries. ``blocks`` tile [0, numel) in order."""
        if sum(block.numel for block in blocks) != numel:
            raise ValueError(f"blocks cover {sum(b.numel for b in blocks)} of {numel} elements")
        if world_size < 1 or numel % world_size:
            raise ValueError(f"{numel} elements do not split into {world_size} equal chunks")
        chunk_numel = numel // world_size
        starts, position = [], 0
        for block in blocks:
            starts.append(position)
            position += block.numel
        chunk_runs: list[list[Run]] = []
        first_block = 0
        for chunk in range(world_size):
            low, high = chunk * chunk_numel, (chunk + 1) * chunk_numel
            runs: list[Run] = []
            while first_block < len(blocks) and starts[first_block] + blocks[first_block].numel <= low:
                first_block += 1
            index = first_block
            while index < len(blocks) and starts[index] < high:
                runs.extend(_cut(starts[index], blocks[index], low, high))
                index += 1
            chunk_runs.append(runs)
        return cls(numel, world_size, chunk_runs, single=False)

    def segments(self, chunk: int) -> list[tuple[int, int]]:
        """(start, length) of chunk ``chunk``'s segments, global offsets (for the reference model)."""
        base = chunk * self.chunk_numel
        return [
            (base + run.start + row * run.row_length, run.row_length)
            for run in self.chunk_runs[chunk]
            for row in range(run.rows)
        ]

    def __repr__(self) -> str:
        kind = "single" if self.single else f"{self.total_chunk_segments} segments"
        return f"ScaleLayout(numel={self.numel}, world_size={self.world_size}, {kind})"


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
