"""pretrain/comm/norms.py: the scales' 1-norms."""

from __future__ import annotations

import pytest
import torch

from pretrain.comm.norms import BLOCK, abs_row_sums


@pytest.mark.parametrize(
    "rows, length",
    [(1, 5), (3, 768), (300, 1000), (86, 767), (7, BLOCK), (2, BLOCK + 1), (3, 2 * BLOCK + 17), (1, 600_000)],
)
def test_each_row_is_summed_alone_and_accurately(rows, length):
    generator = torch.Generator().manual_seed(rows * length)
    values = torch.randn(rows, length, generator=generator) * torch.rand(rows, 1, generator=generator) * 3
    sums = abs_row_sums(values, torch.empty(rows))
    # a segment's scale must not depend on which other segments share the call (the engine batches
    # them by run, the reference takes one at a time)
    alone = torch.cat([abs_row_sums(values[i : i + 1].clone(), torch.empty(1)) for i in range(rows)])
    assert torch.equal(sums, alone)
    exact = values.double().abs().sum(1)
    torch.testing.assert_close(sums.double(), exact, rtol=1e-6, atol=0)


def test_a_long_segment_is_summed_more_accurately_than_vector_norm():
    """ATen's 1-norm accumulates a long row naively in fp32 (4 % off at 55M elements, a BERT-Large server
    chunk): the blockwise sum is the better scale as well as the faster one."""
    values = torch.randn(1, 8_000_000, generator=torch.Generator().manual_seed(0))
    exact = values.double().abs().sum()
    ours = abs_row_sums(values, torch.empty(1))[0].double()
    aten = torch.linalg.vector_norm(values, 1).double()
    assert abs(ours - exact) / exact < 1e-7 < abs(aten - exact) / exact


def test_signs_and_zeros_count_by_magnitude():
    values = torch.tensor([[-1.5, 0.0, -0.0, 2.0], [0.0, 0.0, 0.0, 0.0]])
    assert abs_row_sums(values, torch.empty(2)).tolist() == [3.5, 0.0]
