"""pretrain/comm/norms.py: the scales' 1-norms."""

from __future__ import annotations

import pytest
import torch

from pretrain.comm import norms as norms_module
from pretrain.comm.layout import Run, run_table
from pretrain.comm.norms import BLOCK, abs_row_sums, segment_abs_sums
from pretrain.comm.numba_support import SUM_BLOCK, numba_unavailable_reason


@pytest.fixture(params=["numba", "torch"])
def implementation(request, monkeypatch):
    """Both sums: numba's (the default where it imports) and the torch fallback's."""
    if request.param == "torch":
        monkeypatch.setattr(norms_module, "_numba_sums", lambda: None)
    else:
        assert norms_module._numba_sums() is not None, numba_unavailable_reason()
    return request.param


@pytest.mark.usefixtures("implementation")
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


@pytest.mark.usefixtures("implementation")
def test_a_long_segment_is_summed_more_accurately_than_vector_norm():
    """ATen's 1-norm accumulates a long row naively in fp32 (4 % off at 55M elements, a BERT-Large server
    chunk): the blockwise sum is the better scale as well as the faster one."""
    values = torch.randn(1, 8_000_000, generator=torch.Generator().manual_seed(0))
    exact = values.double().abs().sum()
    ours = abs_row_sums(values, torch.empty(1))[0].double()
    aten = torch.linalg.vector_norm(values, 1).double()
    assert abs(ours - exact) / exact < 1e-7 < abs(aten - exact) / exact


@pytest.mark.usefixtures("implementation")
def test_signs_and_zeros_count_by_magnitude():
    values = torch.tensor([[-1.5, 0.0, -0.0, 2.0], [0.0, 0.0, 0.0, 0.0]])
    assert abs_row_sums(values, torch.empty(2)).tolist() == [3.5, 0.0]


@pytest.mark.usefixtures("implementation")
def test_segments_of_a_layout_are_summed_like_their_rows():
    """`segment_abs_sums` over a run table (what the engine calls) gives each segment the sum
    `abs_row_sums` gives its row alone; the numba path is one call for all the runs."""
    runs = [Run(0, 3, 5), Run(15, 1, 3), Run(18, 4, 1), Run(22, 2, 2 * SUM_BLOCK + 9)]
    numel = runs[-1].end
    values = torch.randn(numel, generator=torch.Generator().manual_seed(5))
    out = segment_abs_sums(values, run_table(runs), torch.full((10,), float("nan")))
    expected = torch.cat(
        [abs_row_sums(values[r.start : r.end].view(r.rows, r.row_length), torch.empty(r.rows)) for r in runs]
    )
    assert torch.equal(out, expected)


def test_numba_and_torch_sums_agree_to_rounding():
    """The two implementations sum in different orders (a different last bit is allowed), never more."""
    values = torch.randn(40, 3000, generator=torch.Generator().manual_seed(6)) * 5
    ours = abs_row_sums(values, torch.empty(40))
    fallback = norms_module._torch_abs_row_sums(values, torch.empty(40))
    torch.testing.assert_close(ours, fallback, rtol=2e-7, atol=0)
