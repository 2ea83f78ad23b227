"""The per_column exchange layout: `MomentumSegment.to_exchange_layout_` / `from_exchange_layout_` move
each matrix without row scales into [columns, rows] order (divided by the preconditioner's √v+ε) and back,
through the optimizer's workspace (no temporary per matrix: pretrain/optim/onebit.py)."""

from __future__ import annotations

import pytest
import torch

from pretrain.comm import TrafficCounter
from pretrain.optim.base import Workspace
from pretrain.optim.onebit import Compression, ExchangeOptions, MomentumSegment


def _segment() -> tuple[MomentumSegment, list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    shapes = [(5, 3), (4,), (2, 7), (6, 3), (1, 9)]
    params = [torch.randn(shape, generator=generator) for shape in shapes]
    row_scaled = {id(params[3])}  # an embedding: row scales, not transposed
    options = ExchangeOptions(Compression.per_column, exact_vectors=True)
    segment = MomentumSegment.build(params, 1, None, TrafficCounter(), options, row_scaled)
    return segment, params


def _expected(values: list[torch.Tensor], transposed: list[bool]) -> torch.Tensor:
    return torch.cat([(v.t() if t else v).reshape(-1) for v, t in zip(values, transposed)])


@pytest.mark.parametrize("precondition", [False, True])
@pytest.mark.parametrize("workers", [1, 3])
def test_the_exchange_layout_transposes_and_divides_and_comes_back(precondition: bool, workers: int):
    segment, params = _segment()
    assert segment.transposed == [True, False, True, False, True]
    generator = torch.Generator().manual_seed(1)
    numel = segment.buffer.numel()
    flat = torch.randn(workers, numel, generator=generator)
    divisors = [torch.rand(p.shape, generator=generator) + 0.5 for p in params] if precondition else None
    workspace = Workspace()
    moved = flat.clone()
    segment.to_exchange_layout_(moved if workers > 1 else moved[0], divisors, workspace)
    for row, original in zip(moved, flat):
        values = segment.views_of(original)
        if divisors is not None:
            values = [v / d for v, d in zip(values, divisors)]
        size = sum(p.numel() for p in params)
        assert torch.equal(row[:size], _expected(values, segment.transposed))  # bitwise: one IEEE division
        assert torch.equal(row[size:], original[size:])  # the pad stays
        # a transposed matrix's exchange view is [columns, rows]
        assert segment.exchange_views(row)[0].shape == (3, 5)
    back = moved[0].clone()
    segment.from_exchange_layout_(back, divisors, workspace)
    for i, (view, t) in enumerate(zip(segment.exchange_views(moved[0]), segment.transposed)):
        expected = view.t() if t else view
        if divisors is not None:
            expected = expected * divisors[i]
        assert torch.equal(segment.views_of(back)[i], expected), i
    if divisors is None:  # without division the round trip is exact
        assert torch.equal(back, flat[0])
    else:
        assert torch.allclose(back, flat[0], rtol=1e-6, atol=0)
    # the only scratch: the workspace, as large as the largest transposed matrix (5 x 3)
    assert workspace._buffer is not None and workspace._buffer.numel() == 15
