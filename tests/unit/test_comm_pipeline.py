"""How the pipelined compressed allreduce cuts a layout into pieces (its results: tests/distributed)."""

from __future__ import annotations

import pytest
import torch

from pretrain.comm import CompressedAllreduce
from pretrain.comm.layout import Run, cut_runs
from pretrain.comm.pipeline import auto_pieces

RUNS = [Run(0, 5, 24), Run(120, 1, 3), Run(123, 13, 1), Run(136, 7, 9), Run(199, 1, 801)]


def _segments(runs: list[Run], offset: int = 0) -> list[tuple[int, int]]:
    return [
        (offset + run.start + row * run.row_length, run.row_length) for run in runs for row in range(run.rows)
    ]


@pytest.mark.parametrize(
    "bounds", [(0, 1000), (0, 8), (16, 128), (40, 48), (120, 136), (200, 1000), (992, 1000)]
)
def test_cut_runs_keep_every_element_and_its_segment(bounds):
    low, high = bounds
    pieces, first = cut_runs(RUNS, low, high)
    # the pieces tile [low, high) in order
    position = 0
    for run in pieces:
        assert run.start == position
        position = run.end
    assert position == high - low
    # element i of the piece lies in the same segment as element low + i of the whole, counted from `first`
    whole = _segments(RUNS)
    owner = [index for index, (start, length) in enumerate(whole) for _ in range(length)]
    cut_owner = [first + index for index, (_, length) in enumerate(_segments(pieces)) for _ in range(length)]
    assert cut_owner == owner[low:high]


def test_whole_rows_stay_one_run():
    pieces, first = cut_runs([Run(0, 100, 16)], 32, 800)
    assert pieces == [Run(0, 48, 16)] and first == 2
    pieces, first = cut_runs([Run(0, 100, 16)], 40, 808)  # cut inside rows at both ends
    assert pieces == [Run(0, 1, 8), Run(8, 47, 16), Run(760, 1, 8)] and first == 2


def test_auto_pieces_and_bad_requests():
    assert auto_pieces(100_000) == 1  # below 2 MiB of signs per chunk nothing is worth hiding
    assert auto_pieces(3 << 20) == 3
    assert auto_pieces(1 << 30) == 8
    # one process of virtual workers has no wire to hide: never pipelined
    assert CompressedAllreduce(1 << 26, virtual_workers=2, pipeline=4).pieces == 1
    with pytest.raises(ValueError, match=r"pipeline must be >= 0 \(0 = off\) or None \(auto\), got -1"):
        CompressedAllreduce(1024, virtual_workers=2, pipeline=-1)


def test_the_exchange_calls_its_hook_between_the_phases(monkeypatch):
    """The hook (`CompressedAllreduce(hook=...)`) is called once per call, after the workers' signs are
    exchanged; the fault injection of the reliability tests sets it for every engine
    (`pretrain.distributed.faults`)."""
    points: list[str] = []
    engine = CompressedAllreduce(64, virtual_workers=2, hook=points.append)
    engine(torch.randn(2, 64), torch.empty(64))
    assert points == ["exchange"]

    from pretrain.distributed import faults

    monkeypatch.setattr(CompressedAllreduce, "hook", None)  # restored after the test
    injector = faults.FaultInjector(faults.parse("usr1@3:exchange"), rank=0, attempt=0)
    reached: list[tuple[str, int]] = []
    monkeypatch.setattr(injector, "at", lambda point, step: reached.append((point, step)))
    injector.step = 3
    CompressedAllreduce(64, virtual_workers=2)(torch.randn(2, 64), torch.empty(64))
    assert reached == [("exchange", 3)]
    faults.FaultInjector(faults.parse("usr1@3:after_step"), rank=0, attempt=0)  # no exchange fault
    assert CompressedAllreduce.hook is None
