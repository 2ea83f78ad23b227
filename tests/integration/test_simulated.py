"""`sim_world_size=k`: k simulated data-parallel workers in one process against k real gloo processes.

The demo recipe on the tiny BERT with dropout on (so every worker's dropout stream matters), 1-bit LAMB
with per-row scales, crossing freeze_step. At k = 2 the simulated run equals the real one bitwise:
parameters, and every logged loss. At k = 4 the warmup's gradient averages differ in fp32 rounding (the
simulated sum runs in worker order, gloo's ring sums each chunk from another rank), so the two agree
to a tolerance: losses within 1e-4 relative while the rounding has not grown; the same for 2 processes
of 2 simulated workers each. A simulated run stopped in the compression stage resumes bitwise.
"""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest

from launch.local import run_local
from tests.integration.pretrain_helpers import read_metrics, tiny_run_overrides, train_worker

pytestmark = [pytest.mark.integration, pytest.mark.distributed]


def overrides(data: Path, run_dir: Path, *extra: str) -> list[str]:
    return tiny_run_overrides(
        data,
        run_dir,
        "onebit_lamb",
        "model.hidden_dropout_prob=0.1",
        "model.attention_probs_dropout_prob=0.1",
        "batch.phases.0.lr=5e-3",
        *extra,
    )


def _losses(run_dir: Path) -> list[float]:
    return [m["loss"] for m in read_metrics(run_dir)]


@pytest.mark.slow  # `make test` trains once, in tests/integration/test_pretrain.py
def test_two_simulated_workers_equal_two_processes(tiny_data: Path, tmp_path: Path):
    real = run_local(train_worker, 2, (overrides(tiny_data, tmp_path / "real", "max_steps=20"),))
    simulated = run_local(
        train_worker, 1, (overrides(tiny_data, tmp_path / "sim", "max_steps=20", "sim_world_size=2"),)
    )
    assert simulated[0]["digest"] == real[0]["digest"] == real[1]["digest"]
    assert _losses(tmp_path / "sim") == _losses(tmp_path / "real")
    sim_metrics, real_metrics = read_metrics(tmp_path / "sim"), read_metrics(tmp_path / "real")
    assert [m["onebit_stage"] for m in sim_metrics] == [m["onebit_stage"] for m in real_metrics]
    assert sim_metrics[-1]["bytes_cumulative"] == real_metrics[-1]["bytes_cumulative"]


@pytest.mark.slow
def test_variance_refresh_steps_in_real_and_simulated_runs(tiny_data: Path, tmp_path: Path):
    """`optim.variance_refresh=3` (freeze_step 12): at steps 15 and 18 the 1-bit momentum plus one fp32
    allreduce of the workers' row and column sums of g² (a few thousand floats); the other compression
    steps send the 1-bit momentum alone, and no compression step averages gradients. 2 simulated workers
    equal 2 processes, bytes included."""
    extra = ("max_steps=20", "optim.variance_refresh=3")
    real = run_local(train_worker, 2, (overrides(tiny_data, tmp_path / "real", *extra),))
    simulated = run_local(
        train_worker, 1, (overrides(tiny_data, tmp_path / "sim", *extra, "sim_world_size=2"),)
    )
    assert simulated[0]["digest"] == real[0]["digest"] == real[1]["digest"]
    assert _losses(tmp_path / "sim") == _losses(tmp_path / "real")
    for run in ("real", "sim"):
        metrics = read_metrics(tmp_path / run)
        sent = [m["bytes_cumulative"] for m in metrics]
        per_step = [sent[0]] + [b - a for a, b in pairwise(sent)]
        lamb_step = metrics[0]["bytes_lamb_cumulative"]
        exact = [step for step, size in enumerate(per_step, start=1) if size == pytest.approx(lamb_step)]
        compressed = per_step[12]  # step 13
        assert 0 < compressed < lamb_step / 10
        assert exact == list(range(1, 13)), run
        for step in (15, 18):
            assert compressed < per_step[step - 1] < compressed + lamb_step / 50, (run, step)
        assert [s for s, size in enumerate(per_step, 1) if size == compressed] == [13, 14, 16, 17, 19, 20]
    assert (
        read_metrics(tmp_path / "sim")[-1]["bytes_cumulative"]
        == read_metrics(tmp_path / "real")[-1]["bytes_cumulative"]
    )


def pipelined_train_worker(rank: int, world_size: int, overrides: list[str]) -> dict:
    """`train_worker` with the compressed allreduce's signs in up to 8 pieces however small the model (auto
    pipelines only chunks of 2 MiB of signs and up), counting the calls that took the fused path (and those
    with the momentum and its square marginals formed inside it)."""
    from pretrain.comm import pipeline

    pipeline.PIECE_BYTES = 1
    calls = {"fused": 0, "pieces": 0, "sourced": 0, "marginals": 0}
    fused_call = pipeline.PipelinedExchange._fused_call

    def counted(self, values, out, source):
        calls["fused"] += 1
        calls["sourced"] += source is not None
        calls["marginals"] += source is not None and bool(source.marginals)
        calls["pieces"] = max(calls["pieces"], len(self.stretches[0]))
        return fused_call(self, values, out, source)

    pipeline.PipelinedExchange._fused_call = counted  # type: ignore[method-assign]
    return {**train_worker(rank, world_size, overrides), **calls}


@pytest.mark.slow
def test_pipelined_fused_ranks_equal_simulated_workers(tiny_data: Path, tmp_path: Path):
    """The optim=onebit_lamb defaults (per-column scales, the momentum formed inside the exchange's first
    pass, rank-1 variance refreshes, whose square marginals that pass sums) with the exchange pipelined
    and both compressions fused (`pretrain.comm.pipeline`: stretches sent point to point as each pass
    leaves them) on 2 real ranks: bitwise the run of 2 simulated workers (no pipeline there)."""
    extra = ("max_steps=20", "optim.variance_refresh=3")  # freeze_step 12: refreshes at 15 and 18
    common = ("model.hidden_dropout_prob=0.1", "batch.phases.0.lr=5e-3", *extra)
    real = run_local(
        pipelined_train_worker, 2, (tiny_run_overrides(tiny_data, tmp_path / "real", "onebit_lamb", *common),)
    )
    simulated = run_local(
        train_worker,
        1,
        (tiny_run_overrides(tiny_data, tmp_path / "sim", "onebit_lamb", *common, "sim_world_size=2"),),
    )
    # steps 13–20 fused, in 8 pieces, x formed inside; the square marginals there but on the refreshes
    for rank in real:
        assert (rank["fused"], rank["sourced"], rank["marginals"], rank["pieces"]) == (8, 8, 6, 8), rank
    assert simulated[0]["digest"] == real[0]["digest"] == real[1]["digest"]
    assert _losses(tmp_path / "sim") == _losses(tmp_path / "real")


@pytest.mark.slow
def test_four_simulated_workers_track_four_processes(tiny_data: Path, tmp_path: Path):
    extra = ("max_steps=20", "batch.phases.0.micro_batch=8")
    real = run_local(train_worker, 4, (overrides(tiny_data, tmp_path / "real", *extra),))
    run_local(train_worker, 1, (overrides(tiny_data, tmp_path / "sim", *extra, "sim_world_size=4"),))
    # 2 processes of 2 workers: the averages also cross processes (an allreduce of the local sums)
    mixed = run_local(
        train_worker, 2, (overrides(tiny_data, tmp_path / "mixed", *extra, "sim_world_size=2"),)
    )
    assert len({result["digest"] for result in real}) == 1 and mixed[0]["digest"] == mixed[1]["digest"]
    for run in ("sim", "mixed"):
        losses = _losses(tmp_path / run)
        assert len(losses) == 20
        for simulated, actual in zip(losses, _losses(tmp_path / "real")):
            assert simulated == pytest.approx(actual, rel=1e-4), run


@pytest.mark.slow
def test_simulated_run_resumes_bitwise(tiny_data: Path, tmp_path: Path):
    extra = ("max_steps=20", "sim_world_size=2", "deterministic=true")
    straight = run_local(train_worker, 1, (overrides(tiny_data, tmp_path / "straight", *extra),))
    stopped = tmp_path / "stopped"
    stop = ("max_steps=16", "sim_world_size=2", "deterministic=true")
    run_local(train_worker, 1, (overrides(tiny_data, stopped, *stop),))
    resumed = run_local(train_worker, 1, (overrides(tiny_data, stopped, *extra),))
    assert resumed[0]["digest"] == straight[0]["digest"]
    losses = {m["step"]: m["loss"] for m in read_metrics(tmp_path / "straight")}
    assert all(m["loss"] == losses[m["step"]] for m in read_metrics(stopped) if m["step"] > 16)


def test_simulated_world_is_checked(tiny_data: Path, tmp_path: Path):
    from tests.integration.pretrain_helpers import compose_train_config

    with pytest.raises(ValueError, match="sim_world_size"):
        compose_train_config(overrides(tiny_data, tmp_path, "sim_world_size=0"))
    with pytest.raises(ValueError, match="fp16"):
        compose_train_config(overrides(tiny_data, tmp_path, "sim_world_size=2", "precision=fp16"))
