"""`make demo`, the README's first command, end to end at smoke size.

The same Makefile target a user runs, with the pretraining phases and fine-tuning sets cut down and every
output sent to a temporary folder (DEMO_RUNS_DIR, DEMO_REPORT), so the user's own demo runs are untouched.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from finetune.latest import NO_RUN

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def user_runs_state(repo_root: Path) -> dict[str, float]:
    """Modification times of the user's own demo outputs (absent ones left out)."""
    paths = [
        repo_root / "results" / "runs" / run / "metrics.jsonl" for run in ("demo-lamb", "demo-onebit_lamb")
    ]
    paths.append(repo_root / "results" / "demo" / "report.md")
    return {str(path): path.stat().st_mtime for path in paths if path.is_file()}


@pytest.mark.timeout(900)
def test_make_demo_smoke(repo_root: Path, tmp_path: Path, shared_data: Path):
    before = user_runs_state(repo_root)
    runs_dir = tmp_path / "runs"
    report_dir = tmp_path / "report"
    command = [
        "make",
        "--no-print-directory",
        "demo",
        f"DEMO_RUNS_DIR={runs_dir}",
        f"DEMO_REPORT={report_dir}",
        # phase 1 still crosses the 1-bit freeze_step (12); phase 2 runs two steps at seq 512
        "ARGS=batch.phases.0.steps=14 batch.phases.1.steps=2 log_every=2 checkpoint.every_steps=0",
        "DEMO_FT_ARGS=task.epochs=1 task.max_train_examples=48 task.max_eval_examples=48",
    ]
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=repo_root, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"comparison report in {report_dir}/report.md" in result.stdout

    for run in ("demo-lamb", "demo-onebit_lamb"):
        records = [json.loads(line) for line in (runs_dir / run / "metrics.jsonl").read_text().splitlines()]
        assert records[-1]["phase"] == 2 and records[-1]["step"] == 16
        for task in ("mrpc", "squad"):
            results_file = runs_dir / run / "finetune" / "final" / task / "all_results.json"
            results = json.loads(results_file.read_text())
            assert results["pretraining_samples_seen"] == records[-1]["samples_seen"]
    onebit_metrics = (runs_dir / "demo-onebit_lamb" / "metrics.jsonl").read_text().splitlines()
    onebit = [json.loads(line) for line in onebit_metrics]
    assert onebit[-1]["onebit_stage"] == 1.0
    assert onebit[-1]["bytes_cumulative"] < onebit[-1]["bytes_lamb_cumulative"]

    report = (report_dir / "report.md").read_text()
    assert "demo-lamb" in report and "demo-onebit_lamb" in report
    assert (report_dir / "pretrain_loss.png").stat().st_size > 1000

    # `make finetune` as the user types it, without CKPT: the most recent run (the second demo run)
    out = tmp_path / "latest-mrpc"
    small = "task.epochs=1 task.max_train_examples=16 task.max_eval_examples=16"
    make = ["make", "--no-print-directory", "finetune"]
    command = [*make, "TASK=mrpc", f"FT_RUNS_DIR={runs_dir}", f"ARGS={small} output_dir={out}"]
    result = subprocess.run(command, cwd=repo_root, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"using the most recent run {runs_dir / 'demo-onebit_lamb'}" in result.stderr
    assert json.loads((out / "all_results.json").read_text())["pretraining_run"] == "demo-onebit_lamb"
    command = [*make, f"FT_RUNS_DIR={tmp_path / 'no-runs'}"]
    result = subprocess.run(command, cwd=repo_root, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    said = [line for line in result.stderr.splitlines() if "make finetune:" in line]
    assert said == [NO_RUN.format(runs_dir=tmp_path / "no-runs")]
    # the user's own demo folders were not touched by the smoke run
    assert user_runs_state(repo_root) == before
