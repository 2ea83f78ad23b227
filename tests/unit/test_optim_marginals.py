"""The row and column sums of g² behind 1-bit LAMB's factored/rank1 variance refresh: the numba loop
against the torch reference, row- and column-major, accumulating, deterministic; the torch fallback."""

from __future__ import annotations

import pytest
import torch

from pretrain.comm.numba_support import numba_unavailable_reason
from pretrain.optim import marginals
from pretrain.optim.base import Workspace

needs_numba = pytest.mark.skipif(numba_unavailable_reason() is not None, reason="numba unavailable")


def _matrix(rows: int, cols: int, column_major: bool, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if column_major:
        return torch.randn(cols, rows, generator=generator).t()
    return torch.randn(rows, cols, generator=generator)


def _reference(matrix: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> None:
    """float64 sums of the fp32 squares, added to fp32 `rows`/`cols`."""
    square = (matrix * matrix).double()
    rows += square.sum(1).float()
    cols += square.sum(0).float()


@needs_numba
@pytest.mark.parametrize("column_major", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (300, 768), (2500, 9)])
def test_numba_marginals_match_the_float64_sums_and_accumulate(shape, column_major):
    matrix = _matrix(*shape, column_major)
    start_rows, start_cols = torch.rand(shape[0]), torch.rand(shape[1])
    rows, cols = start_rows.clone(), start_cols.clone()
    marginals.add_square_marginals(matrix, rows, cols, Workspace())
    want_rows, want_cols = start_rows.clone(), start_cols.clone()
    _reference(matrix, want_rows, want_cols)
    # fp32 sums (a row's in vector lanes, a column's over MARGINAL_FLUSH rows at a time): a few units in the
    # last place of the rounded float64 sums (a relative 2.3e-7 and 4.1e-7 at most here; 2e-7 is one)
    torch.testing.assert_close(rows, want_rows, rtol=1e-6, atol=0)
    torch.testing.assert_close(cols, want_cols, rtol=1e-6, atol=0)
    again_rows, again_cols = start_rows.clone(), start_cols.clone()
    marginals.add_square_marginals(
        matrix.clone(memory_format=torch.preserve_format), again_rows, again_cols, Workspace()
    )
    assert torch.equal(again_rows, rows) and torch.equal(again_cols, cols)  # the same bits every call


@pytest.mark.parametrize("column_major", [False, True])
def test_torch_fallback_agrees_with_numba_to_rounding(monkeypatch, column_major):
    matrix = _matrix(3000, 70, column_major, seed=1)  # blocks of CPU_CHUNK_NUMEL // 70 rows: several
    rows, cols = torch.zeros(3000), torch.zeros(70)
    monkeypatch.setattr(marginals, "_numba_marginals", lambda: None)
    marginals.add_square_marginals(matrix, rows, cols, Workspace())
    want_rows, want_cols = torch.zeros(3000), torch.zeros(70)
    _reference(matrix, want_rows, want_cols)
    torch.testing.assert_close(rows, want_rows, rtol=1e-5, atol=0)
    torch.testing.assert_close(cols, want_cols, rtol=1e-5, atol=0)


@needs_numba
def test_numba_is_used_for_cpu_fp32_and_not_for_other_dtypes(monkeypatch):
    used = []
    real = marginals.torch_add_square_marginals
    monkeypatch.setattr(marginals, "torch_add_square_marginals", lambda *a: used.append(1) or real(*a))
    marginals.add_square_marginals(torch.ones(4, 3), torch.zeros(4), torch.zeros(3), Workspace())
    assert used == []
    half = torch.ones(4, 3, dtype=torch.float64)
    rows, cols = torch.zeros(4, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    marginals.add_square_marginals(half, rows, cols, Workspace())
    assert used == [1] and rows.tolist() == [3.0] * 4 and cols.tolist() == [4.0] * 3


def test_bench_times_both_implementations_over_a_models_matrices():
    from bench.optim import marginal_sums

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    times = marginal_sums(model, warmup=0, reps=1)
    assert set(times) == {"numba", "torch"} and all(0 < t < 10 for t in times.values())


@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_multi_tensor_marginals_match_the_torch_path(scale: float):
    """The multi-tensor path (run here on CPU tensors): the torch path's row and column sums up to fp32
    summation order, for row-major and column-major matrices, in chunks smaller than some matrices."""
    generator = torch.Generator().manual_seed(3)
    matrices = [torch.randn(rows, cols, generator=generator) for rows, cols in ((7, 5), (3, 11), (16, 4))]
    matrices.append(torch.randn(6, 9, generator=generator).t())  # column-major 9 x 6
    start = [
        (torch.rand(m.shape[0], generator=generator), torch.rand(m.shape[1], generator=generator))
        for m in matrices
    ]
    expected = [(r.clone(), c.clone()) for r, c in start]
    for matrix, (rows, cols) in zip(matrices, expected):
        marginals.torch_add_square_marginals(matrix, rows, cols, Workspace(), scale)
    got = [(r.clone(), c.clone()) for r, c in start]
    marginals.multi_tensor_marginals(matrices, got, Workspace(), scale, chunk_numel=40)
    for (rows, cols), (want_rows, want_cols) in zip(got, expected):
        torch.testing.assert_close(rows, want_rows, rtol=1e-6, atol=0)
        torch.testing.assert_close(cols, want_cols, rtol=1e-6, atol=0)
