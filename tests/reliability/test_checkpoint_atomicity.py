"""Checkpoint writing interrupted at the points a kill can hit that the multi-process tests do not reach
cheaply, the fault-injection spec, and the comparator the kill tests rely on (it must be able to fail)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

from pretrain import checkpoint as ckpt
from pretrain.distributed.faults import ENV, Fault, FaultInjector, parse
from tests.reliability.harness import checkpoint_digests, compare_trajectories


class Killed(BaseException):
    """Stands in for SIGKILL: nothing after the raise point runs (no cleanup handler catches it)."""


def _save(directory: Path, step: int, model: torch.nn.Module, keep_last: int = 1, **extra) -> Path:
    return ckpt.save_checkpoint(
        directory,
        step,
        rank=0,
        model=model,
        rank_state={"optimizer": {"step": torch.tensor(float(step))}, "rng": ckpt.rng_state()},
        shared_state={"train_state": {"global_step": step}},
        keep_last=keep_last,
        **extra,
    )


@pytest.fixture
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def test_resave_killed_between_the_renames_keeps_the_step(tmp_path: Path, model, monkeypatch, record):
    """keep_last=1 and the same step saved again (a final save right after a periodic one): a kill
    after the old folder moved aside and before the new one moved in must not lose the step."""
    directory = tmp_path / "checkpoints"
    _save(directory, 5, model)
    real_replace = os.replace
    calls = []

    def replace_then_die(source, target):
        calls.append(Path(target).name)
        if len(calls) == 2:  # the new folder's rename: the process "dies" here
            raise Killed
        return real_replace(source, target)

    monkeypatch.setattr(ckpt.os, "replace", replace_then_die)
    with pytest.raises(Killed):
        _save(directory, 5, model)
    monkeypatch.setattr(ckpt.os, "replace", real_replace)
    assert calls == ["step-00000005.replaced", "step-00000005"]
    found = ckpt.latest_checkpoint(directory)
    assert found is not None and found.name == "step-00000005.replaced"
    rank_state, shared = ckpt.load_checkpoint(found, 0, model)
    assert shared["train_state"]["global_step"] == 5 and float(rank_state["optimizer"]["step"]) == 5
    _save(directory, 6, model)  # the next save cleans up
    assert sorted(p.name for p in directory.iterdir()) == ["step-00000006"]
    record("atomicity", case="re-save killed between the renames", passed=True)


def test_folder_without_complete_marker_is_never_resumed(tmp_path: Path, model, record):
    directory = tmp_path / "checkpoints"
    _save(directory, 3, model, keep_last=3)
    copy = directory / "step-00000004"  # e.g. a copy or an rsync in progress
    copy.mkdir()
    for file in (directory / "step-00000003").iterdir():
        if file.name != "COMPLETE":
            (copy / file.name).write_bytes(file.read_bytes())
    assert [p.name for p in ckpt.list_checkpoints(directory)] == ["step-00000003"]
    with pytest.raises(ckpt.CheckpointError, match="no COMPLETE marker"):
        ckpt.load_checkpoint(copy, 0, model)
    record("atomicity", case="folder without COMPLETE ignored", passed=True)


def test_kill_before_commit_leaves_the_previous_checkpoint(tmp_path: Path, model, record):
    directory = tmp_path / "checkpoints"
    _save(directory, 7, model, keep_last=2)

    def die():
        raise Killed

    with pytest.raises(Killed):
        _save(directory, 8, model, keep_last=2, before_commit=die)
    assert (directory / "step-00000008.tmp").is_dir()
    assert not (directory / "step-00000008.tmp" / "COMPLETE").exists()
    latest = ckpt.latest_checkpoint(directory)
    assert latest is not None and latest.name == "step-00000007"
    ckpt.load_checkpoint(latest, 0, model)
    record("atomicity", case="kill before COMPLETE", passed=True)


def test_checksums_cover_every_file_and_old_checkpoints_still_load(tmp_path: Path, model):
    folder = _save(tmp_path / "checkpoints", 2, model)
    sums = json.loads((folder / ckpt.CHECKSUMS).read_text())["sha256"]
    assert set(sums) == {"model.safetensors", "train_state.pt", "rank-00000.pt"}
    assert not list(folder.glob("*.sha256"))
    (folder / ckpt.CHECKSUMS).unlink()  # written before checksums existed
    ckpt.load_checkpoint(folder, 0, model)


def test_replicated_state_is_written_once_and_merged_back_on_load(tmp_path: Path, model):
    """The optimizer's moments (the same on every rank) go to replicated.pt, checksummed; loading gives the
    rank its whole state back, nested dicts merged."""
    moments = {"state": {0: {"exp_avg": torch.arange(6.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    folder = ckpt.save_checkpoint(
        tmp_path / "checkpoints",
        4,
        rank=0,
        model=model,
        rank_state={"optimizer": {"extra": {"error": torch.ones(3)}}, "rng": ckpt.rng_state()},
        shared_state={"train_state": {"global_step": 4}},
        replicated_state={"optimizer": moments},
    )
    sums = json.loads((folder / ckpt.CHECKSUMS).read_text())["sha256"]
    assert set(sums) == {"model.safetensors", "train_state.pt", "rank-00000.pt", ckpt.REPLICATED}
    rank_state, _ = ckpt.load_checkpoint(folder, 0, model)
    assert set(rank_state["optimizer"]) == {"extra", "state", "param_groups"}
    assert torch.equal(rank_state["optimizer"]["state"][0]["exp_avg"], torch.arange(6.0))
    assert torch.equal(rank_state["optimizer"]["extra"]["error"], torch.ones(3))
    # a flipped byte in the replicated file is an error naming it, like any other file
    data = bytearray((folder / ckpt.REPLICATED).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (folder / ckpt.REPLICATED).write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match=r"replicated\.pt: sha256 differs"):
        ckpt.load_checkpoint(folder, 0, model)


def test_replicated_state_repeating_a_rank_key_is_refused(tmp_path: Path, model):
    folder = ckpt.save_checkpoint(
        tmp_path / "checkpoints",
        1,
        rank=0,
        model=model,
        rank_state={"optimizer": {"state": {0: {"step": torch.ones(())}}}, "rng": ckpt.rng_state()},
        shared_state={"train_state": {"global_step": 1}},
        replicated_state={"optimizer": {"state": {0: {"step": torch.ones(())}}}},
    )
    with pytest.raises(ckpt.CheckpointError, match=r"'/optimizer/state/0/step' is in the rank file too"):
        ckpt.load_checkpoint(folder, 0, model)


def test_fault_spec_parsing():
    assert parse("kill@13:mid_step,rank=1;term@22") == [
        Fault("kill", 13, "mid_step", rank=1),
        Fault("term", 22, "after_step"),
    ]
    assert parse("kill@6:checkpoint_write,scope=job,attempt=1") == [
        Fault("kill", 6, "checkpoint_write", scope="job", attempt=1)
    ]
    for bad in ("kill@x", "boom@3", "kill@3:lunch", "kill@3,rank=1,color=red", "kill@3,scope=world"):
        with pytest.raises(ValueError, match=ENV):
            parse(bad)
    injector = FaultInjector(parse("nan@2,rank=1;kill@3,rank=1,attempt=1"), rank=1, attempt=0)
    assert injector.faults == [Fault("nan", 2, "mid_step", rank=1)]
    params = [torch.nn.Parameter(torch.ones(3))]
    params[0].grad = torch.zeros(3)
    injector.poison(1, params)
    assert torch.isfinite(params[0].grad).all()
    injector.poison(2, params)
    assert torch.isnan(params[0].grad[0]) and params[0].grad[1:].eq(0).all()
    assert FaultInjector(parse("kill@1"), rank=1, attempt=0).faults == []  # another rank's fault


def test_comparators_detect_a_difference(tmp_path: Path, model):
    reference = [
        {"step": 1, "loss": 2.5, "lr": 0.1, "samples_per_s": 10.0},
        {"step": 2, "loss": 2.25, "lr": 0.2},
    ]
    replayed = [*reference[:1], {**reference[0], "samples_per_s": 99.0}, reference[1]]  # step 1 twice
    assert compare_trajectories(reference, replayed) == (2, 3)  # timings may differ, values may not
    with pytest.raises(AssertionError, match="step 2 differs"):
        compare_trajectories(reference, [reference[0], {**reference[1], "loss": 2.2500000000000004}])
    with pytest.raises(AssertionError, match="missing"):
        compare_trajectories(reference, reference[:1])
    with pytest.raises(AssertionError, match=r"in \['mlm_loss'\]"):  # a field only one side has
        compare_trajectories(reference, [reference[0], {**reference[1], "mlm_loss": 2.0}])
    # the gradient noise scale is summed in another order after a resume: 1e-5 relative, not bitwise
    noisy = [{**r, "gradient_noise_scale": 47.87969931928377} for r in reference]
    near = [noisy[0], {**noisy[1], "gradient_noise_scale": 47.87973431542587}]
    assert compare_trajectories(noisy, near) == (2, 2)
    with pytest.raises(AssertionError, match="gradient_noise_scale"):
        compare_trajectories(noisy, [noisy[0], {**noisy[1], "gradient_noise_scale": 47.9}])
    first = checkpoint_digests(_save(tmp_path / "a", 1, model))
    with torch.no_grad():
        model.weight[0, 0] = torch.nextafter(model.weight[0, 0], torch.tensor(9.0))  # one ulp
    second = checkpoint_digests(_save(tmp_path / "b", 1, model))
    assert first["model.safetensors"] != second["model.safetensors"]


def test_too_little_free_space_refuses_the_save_before_writing(tmp_path: Path, model, monkeypatch, record):
    directory = tmp_path / "checkpoints"
    _save(directory, 7, model, keep_last=2)
    before = sorted(p.name for p in directory.iterdir())
    real = ckpt.shutil.disk_usage
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: real(path)._replace(free=100))
    with pytest.raises(ckpt.CheckpointSaveError) as error:
        _save(directory, 8, model, keep_last=2)
    message = str(error.value)
    assert (
        "step-00000008: checkpoint not saved" in message
        and "MiB needed (the size of step-00000007)" in message
    )
    assert "0.0 MiB free" in message and "step-00000007 is intact" in message and "\n" not in message
    assert sorted(p.name for p in directory.iterdir()) == before  # nothing written, no .tmp
    record("atomicity", case="too little space: refused before writing", passed=True)


@pytest.mark.parametrize("failing", ["train_state.pt", "model.safetensors"])
def test_a_failed_write_removes_the_partial_folder_and_names_the_disk(
    tmp_path: Path, model, monkeypatch, record, failing
):
    directory = tmp_path / "checkpoints"
    _save(directory, 7, model, keep_last=2)
    real_save, real_save_model = torch.save, ckpt.save_model

    def full_disk(obj, path, *args, **kwargs):
        if str(path).endswith(failing):  # torch.save's own wording for ENOSPC
            raise RuntimeError(
                "[enforce fail at inline_container.cc:672] . unexpected pos 3827008 vs 3826900"
            )
        return real_save(obj, path, *args, **kwargs)

    def full_disk_safetensors(module, path, *args, **kwargs):
        if str(path).endswith(failing):  # safetensors' own wording for ENOSPC (a reliability run met it)
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real_save_model(module, path, *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "save", full_disk)
    monkeypatch.setattr(ckpt, "save_model", full_disk_safetensors)
    real = ckpt.shutil.disk_usage
    calls = {"n": 0}

    def usage(path):  # enough space at the check before writing, none once the write failed
        calls["n"] += 1
        return real(path) if calls["n"] == 1 else real(path)._replace(free=1000)

    monkeypatch.setattr(ckpt.shutil, "disk_usage", usage)
    with pytest.raises(
        ckpt.CheckpointSaveError, match=r"checkpoint not saved: disk full at .*step-00000007 is intact"
    ):
        _save(directory, 8, model, keep_last=2)
    assert not list(directory.glob("*.tmp"))
    assert [p.name for p in ckpt.list_checkpoints(directory)] == ["step-00000007"]
    ckpt.load_checkpoint(directory / "step-00000007", 0, model)
    record(
        "atomicity",
        case=f"write of {failing} failed mid-save: partial folder removed, previous intact",
        passed=True,
    )
