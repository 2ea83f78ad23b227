"""Pre-flight report (#17 item 1): `make preflight` / `python -m pretrain.tools.preflight` and the header of
`python -m pretrain`: what the run will do, and one-line errors for what cannot work."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.tools import preflight
from tests.integration.pretrain_helpers import REPO_ROOT, compose_train_config

LARGE = ["batch=64k", "optim=onebit_lamb", "model=bert_large", "precision=bf16", "dry_run=true"]


def _report(overrides: list[str], world: int, monkeypatch, tmp_path: Path) -> preflight.Report:
    monkeypatch.setattr(preflight, "devices", lambda: ("cpu", "no GPU: CPU, gloo backend"))
    cfg = compose_train_config([*overrides, f"data_dir={tmp_path / 'absent'}", f"run_dir={tmp_path / 'run'}"])
    return preflight.build(cfg, world)


def test_the_64k_recipe_on_8_ranks(monkeypatch, tmp_path):
    report = _report(LARGE, 8, monkeypatch, tmp_path)
    text = report.text()
    assert not report.problems, text
    assert "336.2M parameters" in text and "world size 8" in text
    assert "global batch 65536 = 8 x micro 64 x 128 accumulation, 7038 steps, 461,242,368 samples" in text
    assert "global batch 32768 = 8 x micro 16 x 256 accumulation, 1563 steps" in text
    before, after, ratio = re.search(
        r"([\d,.]+) MiB before it .* ([\d,.]+) MiB after \(([\d.]+)x less\)", text
    ).groups()
    assert 30.0 < float(ratio) < 32.0  # 1 bit per element + scales against the fp32 gradient ring
    mib = [float(value.replace(",", "")) for value in (before, after)]
    assert mib[0] / mib[1] == pytest.approx(float(ratio), abs=0.05)
    assert float(before.replace(",", "")) == pytest.approx(2 * 7 / 8 * 336.2e6 * 4 / 2**20, rel=1e-3)
    memory = float(re.search(r"memory per rank \(estimate\): ([\d.]+) GiB", text).group(1))
    assert 15 < memory < 40
    assert "not prepared at" in text and "W&B:" in text and "checkpoints: ~" in text


def test_the_compression_kernels_are_named_and_a_bad_choice_is_one_line(monkeypatch, tmp_path):
    monkeypatch.delenv("BERT_LAMB_COMM_KERNELS", raising=False)
    report = _report(LARGE, 8, monkeypatch, tmp_path)
    assert "  1-bit compression on this machine's CPU: numba" in report.lines, report.text()
    monkeypatch.setenv("BERT_LAMB_COMM_KERNELS", "fastest")
    report = _report(LARGE, 8, monkeypatch, tmp_path)
    assert report.problems == [
        "BERT_LAMB_COMM_KERNELS/kernels must be one of auto, torch, numba, compiled, got 'fastest'"
    ]
    lamb = _report(["batch=64k", "optim=lamb", "model=bert_large", "dry_run=true"], 8, monkeypatch, tmp_path)
    assert not lamb.problems and "1-bit compression" not in lamb.text()  # LAMB compresses nothing


def test_compiled_optimizer_on_a_gpu_is_a_note(monkeypatch, tmp_path):
    overrides = ["batch=64k", "optim=lamb", "optim.compile=true", "model=bert_large", "dry_run=true"]
    assert not any("optim.compile" in note for note in _report(overrides, 8, monkeypatch, tmp_path).notes)
    monkeypatch.setattr(preflight, "devices", lambda: ("cuda", "8 x NVIDIA H100"))

    class H100:
        total_memory = 80 * 2**30

    monkeypatch.setattr(preflight.torch.cuda, "get_device_properties", lambda index: H100())
    cfg = compose_train_config([*overrides, f"data_dir={tmp_path / 'absent'}", f"run_dir={tmp_path / 'run'}"])
    notes = preflight.build(cfg, 8).notes
    assert any("optim.compile=true on a GPU" in note for note in notes), notes


def test_the_variance_refresh_bytes_are_in_the_step_traffic(monkeypatch, tmp_path):
    """The per-step figure after the freeze includes the refresh's allreduce (the decayed matrices' row and
    column sums) averaged over its K steps: at K = 64 almost nothing."""
    pattern = r"([\d,.]+) MiB before it .* ([\d,.]+) MiB after \(([\d.]+)x less\)"
    ratios = {}
    for refresh in (0, 64):
        text = _report([*LARGE, f"optim.variance_refresh={refresh}"], 8, monkeypatch, tmp_path).text()
        ratios[refresh] = float(re.search(pattern, text).group(3))
    assert 30.0 < ratios[0] < 32.0
    assert ratios[0] - 0.1 < ratios[64] <= ratios[0]


def test_lamb_sends_the_gradient_allreduce_only(monkeypatch, tmp_path):
    text = _report(
        ["batch=64k", "optim=lamb", "model=bert_large", "dry_run=true"], 8, monkeypatch, tmp_path
    ).text()
    assert "traffic:" in text and "1-bit" not in text


def test_indivisible_batch_is_one_line_naming_the_key(monkeypatch, tmp_path):
    report = _report(LARGE, 3, monkeypatch, tmp_path)
    assert len(report.problems) == 2  # both phases
    assert report.problems[0].startswith(
        "batch.phases[phase1].global_batch=65536 is not divisible by world size (3)"
    )
    assert all("\n" not in problem for problem in report.problems)


def test_cluster_recipe_on_cpu_without_dry_run_is_refused(monkeypatch, tmp_path):
    report = _report(["batch=64k", "optim=onebit_lamb", "model=bert_large"], 8, monkeypatch, tmp_path)
    assert (
        len(report.problems) == 1 and "no GPU" in report.problems[0] and "dry_run=true" in report.problems[0]
    )
    smoke = _report(
        ["batch=64k", "optim=onebit_lamb", "model=bert_large", "max_steps=2"], 8, monkeypatch, tmp_path
    )
    assert not smoke.problems  # two steps of the recipe are a smoke run, not a cluster run


def test_onebit_on_one_process_says_compression_is_off(monkeypatch, tmp_path):
    report = _report(["batch=demo", "optim=onebit_lamb", "model=bert_tiny"], 1, monkeypatch, tmp_path)
    assert not report.problems
    assert any("nothing to compress" in note for note in report.notes)


def test_the_command_line_finds_its_config(tmp_path):
    """`python -m pretrain.tools.preflight` as the launchers run it (fast tier): its Hydra config path is
    relative to the module, so moving the module without it made every launch stop with exit 2."""
    done = subprocess.run(
        [sys.executable, "-m", "pretrain.tools.preflight", *LARGE, "dry_run_world_size=8",
         f"data_dir={tmp_path / 'absent'}", f"run_dir={tmp_path / 'run'}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("pre-flight: bert_large")


@pytest.mark.slow  # `python -m` processes
def test_cli_exit_codes_and_the_pretrain_header(tmp_path):
    common = [f"data_dir={tmp_path / 'absent'}", f"run_dir={tmp_path / 'run'}"]
    ok = subprocess.run(
        [sys.executable, "-m", "pretrain.tools.preflight", *LARGE, "dry_run_world_size=8", *common],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("pre-flight: bert_large") and "world size 8" in ok.stdout
    refused = subprocess.run(
        [sys.executable, "-m", "pretrain", "batch=64k", "optim=onebit_lamb", "model=bert_large", *common],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert refused.returncode == 2
    errors = refused.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("pretrain: error: batch=64k trains"), refused.stderr
    assert refused.stdout.startswith("pre-flight: bert_large")  # the header came first
    assert not (tmp_path / "run").exists()  # nothing written


def test_workers_skip_the_preflight_their_launcher_ran(monkeypatch):
    """launch/common.sh ran it for the world size it starts: the workers skip it; another world size (an
    elastic restart) or none (torchrun by hand) is checked again."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv(preflight.CHECKED_WORLD_SIZE, raising=False)
    assert not preflight.checked_by_launcher()
    monkeypatch.setenv(preflight.CHECKED_WORLD_SIZE, "2")
    assert preflight.checked_by_launcher()
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert not preflight.checked_by_launcher()
