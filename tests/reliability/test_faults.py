"""Faults beyond kill -9 at step boundaries, on a 2-rank 1-bit LAMB job (torchrun, gloo; issue #18):

- a rank dies inside a collective (DDP's gradient allreduce in the warmup stage; the compressed exchange
  between its all-to-all and its all-gather in the compression stage): the survivor does not hang, names
  the rank in one line and exits 76; torchrun --max-restarts resumes and the run ends bitwise equal to an
  uninterrupted one;
- a rank stalls (SIGSTOP): the collective times out after dist.timeout_s, the survivor names the stalled
  rank and the step, the job exits with 76 in torchrun's report; a relaunch resumes bitwise;
- the disk fills during checkpoint saves (a tmpfs, skipped where mounting is not allowed): the previous
  checkpoint stays, the error gives the space needed and free, checkpoint.on_error decides between a clean
  stop and training on; nothing half-written counts as a checkpoint;
- resume at another world size (2 -> 4 in warmup, 4 -> 2 in the compression stage): the final loss lies
  within seed noise of the uninterrupted run; a world size the batch does not split over is refused in
  one line.

Each case records a row of the report's faults table (tests/reliability/report.py): the fault, where it
was injected, the outcome, the time to a clear state and the steps lost. The stall, the full disk's
stop/continue and the world-size cases run in the slow suite (`make reliability`); CI runs the others.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import pytest
import torch

from pretrain.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
from tests.reliability.conftest import full_suite
from tests.reliability.harness import (
    checkpoint_digests,
    compare_trajectories,
    final_checkpoint,
    hash_tree,
    pretrain_overrides,
    read_metrics,
    resumed_from,
    torchrun,
)
from tests.reliability.test_kill_resume import CI_PLAN

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]

RECIPE = CI_PLAN.recipe  # 16 + 4 steps, freeze_step 6
TOTAL_STEPS = CI_PLAN.total_steps
FAST_DIAGNOSIS = ("dist.heartbeat_s=1",)
slow_suite = pytest.mark.skipif(
    not full_suite(), reason="slow suite only: make reliability (RELIABILITY_FULL=1)"
)


@pytest.fixture
def reference(ci_reference_run: Path) -> Path:
    """The uninterrupted run of CI's kill plan recipe (tests/reliability/conftest.py)."""
    return ci_reference_run


def assert_bitwise(reference: Path, run_dir: Path) -> int:
    """Every step's metrics and the final checkpoint equal the uninterrupted run's; -> replayed records."""
    steps, records = compare_trajectories(read_metrics(reference), read_metrics(run_dir))
    assert steps == TOTAL_STEPS
    expected, got = (
        checkpoint_digests(final_checkpoint(reference)),
        checkpoint_digests(final_checkpoint(run_dir)),
    )
    assert got == expected, "the final checkpoint differs from the uninterrupted run's"
    return records - steps


def error_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("pretrain: error:")]


class LineClock:
    """First time (s since launch) each pattern shows up in a growing log: the harness polls it."""

    def __init__(self, log_path: Path, patterns: dict[str, str]):
        self.log_path, self.patterns, self.seen = log_path, patterns, {}

    def __call__(self, seconds: float) -> None:
        if len(self.seen) == len(self.patterns) or not self.log_path.exists():
            return
        text = self.log_path.read_text(errors="replace")
        for name, pattern in self.patterns.items():
            if name not in self.seen and re.search(pattern, text):
                self.seen[name] = seconds


# -- a rank dies inside a collective -----------------------------------------------------------------------
def test_rank_dying_inside_collectives_is_survived_and_resumed_bitwise(
    tiny_data: Path, reference: Path, tmp_path: Path, record
):
    run_dir, log_path = tmp_path / "run", tmp_path / "run.log"
    # attempt 0: rank 1 dies in step 4's gradient allreduce (warmup); torchrun restarts from step 3;
    # attempt 1: rank 0 dies in step 9's compressed exchange, after the all-to-all; restart from step 8
    fault = "kill@4:grad_allreduce,rank=1;kill@9:exchange,rank=0,attempt=1"
    clock = LineClock(
        log_path,
        {
            "fault1": r"fault: kill rank 1 at step 4",
            "error1": r"pretrain: error: step 4:",
            "fault2": r"fault: kill rank 0 at step 9",
            "error2": r"pretrain: error: step 9:",
        },
    )
    outcome = torchrun(
        pretrain_overrides(tiny_data, run_dir, *RECIPE, *FAST_DIAGNOSIS),
        log_path,
        fault=fault,
        max_restarts=2,
        on_poll=clock,
    )
    assert outcome.returncode == 0, outcome.log[-3000:]
    assert set(resumed_from(outcome.log)) == {3, 8}
    errors = error_lines(outcome.log)
    assert any("step 4: a peer is gone: rank 1 died or stalled" in line for line in errors), errors
    assert any("step 9: a peer is gone: rank 0 died or stalled" in line for line in errors), errors
    assert all("exiting 76" in line for line in errors), errors
    replayed = assert_bitwise(reference, run_dir)
    assert replayed == 0  # each rank died inside a step that had not been logged: no finished step lost
    for n, (where, step) in enumerate((("DDP gradient allreduce, warmup", 4), ("1-bit exchange", 9)), 1):
        record(
            "fault",
            fault=f"rank {2 - n} SIGKILLed",
            injected=f"step {step}, {where}"
            + (" (after the all-to-all, before the all-gather)" if n == 2 else ""),
            outcome="survivor: one line naming the rank, exit 76; torchrun restart resumed, bitwise equal",
            seconds=round(clock.seen[f"error{n}"] - clock.seen[f"fault{n}"], 1),
            steps_lost=0,
        )


# -- a rank stalls ---------------------------------------------------------------------------------------
@slow_suite
def test_stalled_rank_times_out_with_its_name_and_the_relaunch_resumes_bitwise(
    tiny_data: Path, reference: Path, tmp_path: Path, record
):
    run_dir, log_path = tmp_path / "run", tmp_path / "stall.log"
    timeout_s = 10
    clock = LineClock(
        log_path, {"stop": r"fault: stop rank 1 at step 5", "error": r"pretrain: error: step 5:"}
    )
    overrides = pretrain_overrides(
        tiny_data, run_dir, *RECIPE, *FAST_DIAGNOSIS, f"dist.timeout_s={timeout_s}"
    )
    stalled = torchrun(overrides, log_path, fault="stop@5,rank=1", on_poll=clock, timeout=240)
    assert stalled.returncode != 0, stalled.log[-3000:]
    # torchrun's report: the survivor exited with the requeue code, the stopped rank was killed by the agent
    assert "exitcode  : 76" in stalled.log, stalled.log[-3000:]
    (line,) = error_lines(stalled.log)
    assert f"step 5: a collective timed out after {timeout_s} s (dist.timeout_s): rank 1 stalled" in line
    assert "newest checkpoint step-00000004" in line
    waited = clock.seen["error"] - clock.seen["stop"]
    assert timeout_s <= waited <= timeout_s + 15, waited
    assert latest_checkpoint(run_dir / "checkpoints").name == "step-00000004"
    resumed = torchrun(overrides, tmp_path / "resume.log")
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert set(resumed_from(resumed.log)) == {4}
    assert_bitwise(reference, run_dir)
    record(
        "fault",
        fault="rank 1 stalled (SIGSTOP)",
        injected="step 5, after backward",
        outcome=f"survivor after dist.timeout_s={timeout_s}: one line naming rank 1 and step 5, exit 76; "
        f"torchrun killed the stalled rank, job ended in {stalled.seconds:.0f} s; relaunch resumed bitwise",
        seconds=round(waited, 1),
        steps_lost=0,
    )


# -- the disk fills during checkpoint saves ------------------------------------------------------------------
@contextlib.contextmanager
def small_disk(folder: Path, size_bytes: int):
    """A tmpfs of `size_bytes` at `folder`; skipped where mounting is not allowed (not root)."""
    folder.mkdir(parents=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(folder)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or 'mount failed'}): run as root")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def checkpoint_bytes(reference: Path) -> int:
    folder = final_checkpoint(reference)
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


class Ballast:
    """Fills the disk once the run has logged `fill_at`, frees it again after `free_at` (None: never).

    While filled it keeps the disk full: space the run frees (`checkpoint.keep_last` pruning an old
    checkpoint after a save that was under way when the disk filled) is taken again at the next poll.
    Filled once only, that pruning left 1.5 checkpoints free and every later save succeeded (a race: seen
    once in `make reliability`, the on_error=stop leg then exited 0)."""

    def __init__(self, run_dir: Path, disk: Path, leave_free: int, fill_at: int, free_at: int | None):
        self.run_dir, self.path, self.leave_free = run_dir, disk / "ballast", leave_free
        self.fill_at, self.free_at, self.filled_at_step, self.freed = fill_at, free_at, None, False
        self.filled_at_seconds = 0.0

    def last_step(self) -> int:
        metrics = self.run_dir / "metrics.jsonl"
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        for line in reversed(lines):  # the last line may be half-written right now
            with contextlib.suppress(ValueError):
                return json.loads(line)["step"]
        return 0

    def _top_up(self) -> None:
        size = shutil.disk_usage(self.path.parent).free - self.leave_free
        if size > 0:
            with open(self.path, "ab") as file, contextlib.suppress(OSError):
                file.write(b"\0" * size)

    def __call__(self, seconds: float) -> None:
        step = self.last_step()
        if self.filled_at_step is None and step >= self.fill_at:
            self._top_up()
            self.filled_at_step, self.filled_at_seconds = step, seconds
        elif self.filled_at_step is not None and not self.freed:
            if self.free_at is not None and step >= self.free_at:
                self.path.unlink(missing_ok=True)
                self.freed = True
            else:
                self._top_up()


@slow_suite
def test_full_disk_during_saves_stops_cleanly_or_trains_on(
    tiny_data: Path, reference: Path, tmp_path: Path, record
):
    size = checkpoint_bytes(reference)
    with small_disk(tmp_path / "disk", int(size * 4.5)) as disk:
        # on_error=continue: saves fail while the disk is full and training goes on; later saves succeed
        run_dir = disk / "continue"
        ballast = Ballast(run_dir, disk, leave_free=size // 2, fill_at=6, free_at=10)
        extra = ("checkpoint.keep_last=2", "checkpoint.on_error=continue")
        outcome = torchrun(
            pretrain_overrides(tiny_data, run_dir, *RECIPE, *extra), tmp_path / "c.log", on_poll=ballast
        )
        assert outcome.returncode == 0, outcome.log[-3000:]
        assert ballast.freed
        warnings = [line for line in outcome.log.splitlines() if "checkpoint not saved" in line]
        assert warnings and all("training goes on" in line for line in warnings), outcome.log[-3000:]
        # the cause, as the rank that met it saw it: the space check before writing, or ENOSPC while writing
        assert all(re.search(r"MiB needed \(the size of step-\d{8}\)", line) for line in warnings), warnings
        skipped = sorted(set(re.findall(r"(step-\d{8}): checkpoint not saved", "\n".join(warnings))))
        assert not list((run_dir / "checkpoints").glob("*.tmp"))
        assert_bitwise(reference, run_dir)  # failed saves do not touch the trajectory
        record(
            "fault",
            fault="disk full during checkpoint saves, checkpoint.on_error=continue",
            injected=f"tmpfs filled after step {ballast.filled_at_step}, freed after step {ballast.free_at}",
            outcome=f"{len(skipped)} saves skipped with a warning naming space needed and free; "
            "training went on, later saves succeeded, trajectory bitwise equal",
            seconds=0.0,
            steps_lost=0,
        )
        shutil.rmtree(run_dir)

        # on_error=stop (default): the job stops with one line; the previous checkpoint loads; freeing the
        # space and relaunching finishes the run bitwise
        run_dir = disk / "stop"
        ballast = Ballast(run_dir, disk, leave_free=size // 2, fill_at=6, free_at=None)
        overrides = pretrain_overrides(tiny_data, run_dir, *RECIPE, "checkpoint.keep_last=2")
        clock = LineClock(tmp_path / "s.log", {"error": r"pretrain: error: "})

        def poll(seconds: float) -> None:
            ballast(seconds)
            clock(seconds)

        stopped = torchrun(overrides, tmp_path / "s.log", on_poll=poll)
        assert stopped.returncode != 0
        lines = error_lines(stopped.log)
        assert lines and all("checkpoint not saved" in line and "is intact" in line for line in lines), lines
        newest = latest_checkpoint(run_dir / "checkpoints")
        assert newest is not None and not list((run_dir / "checkpoints").glob("*.tmp"))
        assert int(newest.name.split("-")[1]) >= ballast.filled_at_step - 1
        from tests.reliability.harness import read_metrics as metrics_of

        lost = metrics_of(run_dir)[-1]["step"] - int(newest.name.split("-")[1])
        load_checkpoint(newest, 0, _tiny_model(tiny_data))  # loadable: checksums and shapes
        (disk / "ballast").unlink()
        resumed = torchrun(overrides, tmp_path / "s2.log")
        assert resumed.returncode == 0, resumed.log[-3000:]
        assert_bitwise(reference, run_dir)
        record(
            "fault",
            fault="disk full during a checkpoint save, checkpoint.on_error=stop",
            injected=f"tmpfs filled after step {ballast.filled_at_step}",
            outcome="one line naming space needed and free and the intact checkpoint; exit 2; after freeing "
            "space the relaunch resumed bitwise",
            seconds=round(clock.seen["error"] - ballast.filled_at_seconds, 1),
            steps_lost=lost,
        )
        shutil.rmtree(run_dir)


def test_full_disk_at_the_first_save_stops_every_rank_in_one_line(
    tiny_data: Path, reference: Path, tmp_path: Path, record
):
    """No previous checkpoint to size the save by: the first save runs into ENOSPC itself."""
    size = checkpoint_bytes(reference)
    with small_disk(tmp_path / "tiny-disk", size // 3) as disk:
        run_dir = disk / "first"
        outcome = torchrun(pretrain_overrides(tiny_data, run_dir, *RECIPE), tmp_path / "f.log")
        assert outcome.returncode != 0
        lines = error_lines(outcome.log)
        assert lines and all(
            re.search(r"not saved: (rank \d: )?disk full at .*MiB needed", x) for x in lines
        ), lines
        assert "no earlier checkpoint" in lines[0]
        assert list_checkpoints(run_dir / "checkpoints") == [] and not list(
            (run_dir / "checkpoints").glob("*.tmp")
        )
        record(
            "fault",
            fault="disk full at the first checkpoint (no earlier one to size it by)",
            injected="tmpfs a third of a checkpoint's size",
            outcome="ENOSPC caught on the writing rank, every rank stops in one line, partial folder removed",
            seconds=0.0,
            steps_lost=1,
        )


def _tiny_model(tiny_data: Path) -> torch.nn.Module:
    from pretrain.model import build_model
    from tests.integration.pretrain_helpers import compose_train_config

    cfg = compose_train_config(pretrain_overrides(tiny_data, Path("/nonexistent"), *RECIPE))
    vocab_size = json.loads((tiny_data / "seq128" / "manifest.json").read_text())["tokenizer"]["vocab_size"]
    return build_model(cfg.model, vocab_size, torch.device("cpu"))


# -- resume at another world size -------------------------------------------------------------------------
def final_loss(run_dir: Path, last: int = 4) -> float:
    """Mean loss of the last `last` steps (phase 2), one record per step (the last of replayed ones)."""
    by_step = {record["step"]: record["loss"] for record in read_metrics(run_dir)}
    return statistics.fmean(by_step[step] for step in sorted(by_step)[-last:])


@slow_suite
def test_resume_at_another_world_size(tiny_data: Path, reference: Path, tmp_path: Path, record):
    # seed noise: the uninterrupted run at two more seeds
    losses = [final_loss(reference)]
    for seed in (1, 2):
        run_dir = tmp_path / f"seed{seed}"
        overrides = pretrain_overrides(
            tiny_data, run_dir, *RECIPE, f"seed={seed}", "checkpoint.every_steps=0"
        )
        done = torchrun(overrides, tmp_path / f"seed{seed}.log")
        assert done.returncode == 0, done.log[-3000:]
        losses.append(final_loss(run_dir))
    noise = max(losses) - min(losses)
    for before, after, stop_at, stage in ((2, 4, 3, "warmup"), (4, 2, 10, "compression")):
        run_dir = tmp_path / f"{before}to{after}"
        overrides = pretrain_overrides(tiny_data, run_dir, *RECIPE, "checkpoint.every_steps=0")
        first = torchrun([*overrides, f"max_steps={stop_at}"], tmp_path / f"{before}.log", nproc=before)
        assert first.returncode == 0, first.log[-3000:]
        started = time.monotonic()
        second = torchrun(overrides, tmp_path / f"{before}to{after}.log", nproc=after)
        assert second.returncode == 0, second.log[-3000:]
        assert f"world size changed ({before} -> {after})" in second.log
        if stage == "compression":
            assert "error-feedback buffers and the momentum pad start from zero" in second.log
        assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, TOTAL_STEPS + 1))
        loss, gap = final_loss(run_dir), abs(final_loss(run_dir) - losses[0])
        assert gap <= noise, (
            f"{before} -> {after}: final loss {loss:.4f} vs {losses[0]:.4f}, seed noise {noise:.4f}"
        )
        record(
            "fault",
            fault=f"resume at world size {after} from a {before}-rank checkpoint",
            injected=f"step {stop_at} ({stage} stage)",
            outcome="resumed with a warning (rank 0's optimizer state, error feedback reset, data re-split); "
            f"final loss {loss:.3f} vs {losses[0]:.3f} uninterrupted (gap {gap:.3f}, seed noise {noise:.3f})",
            seconds=round(time.monotonic() - started, 1),
            steps_lost=0,
        )
    # refused: a world size the global batch does not split over, before anything is touched
    run_dir = tmp_path / "2to4"
    before = hash_tree(run_dir)
    refused = torchrun(pretrain_overrides(tiny_data, run_dir, *RECIPE), tmp_path / "3.log", nproc=3)
    assert refused.returncode != 0
    lines = error_lines(refused.log)
    assert lines and "world" in lines[0] and "global_batch" in lines[0], lines
    assert hash_tree(run_dir) == before
    record(
        "fault",
        fault="resume at world size 3 (the global batch does not split)",
        injected="relaunch",
        outcome="refused in one line naming the batch key, nothing written",
        seconds=round(refused.seconds, 1),
        steps_lost=0,
    )


def test_heartbeat_store_is_private_to_the_attempt():
    """The liveness keys of a torchrun restart attempt never see the previous attempt's (dead) ranks."""
    from pretrain.distributed.liveness import _client_store
    from pretrain.distributed.process_group import DistributedEnv

    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = DistributedEnv(0, 2, 0, torch.device("cpu"), "gloo")
    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE",
                                              "TORCHELASTIC_RESTART_COUNT")}  # fmt: skip
    try:
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True"
        )
        os.environ["TORCHELASTIC_RESTART_COUNT"] = "0"
        _client_store(env).set("beat/1", "1.0 3")
        os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"
        assert not _client_store(env).check(["beat/1"])
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
