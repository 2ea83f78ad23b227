"""Every headline command answers a bad override with one line on stderr and exit code 2 (launch/cli.py);
`debug=true` or HYDRA_FULL_ERROR=1 shows the traceback instead."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from data.config import REPO_ROOT
from launch import cli

pytestmark = pytest.mark.integration


def run(module: str, *overrides: str, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k not in (cli.FULL_ERROR, cli.CONDENSED)}
    return subprocess.run(
        [sys.executable, "-m", module, *overrides],
        cwd=REPO_ROOT,
        env={**environment, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    ("module", "prog", "override", "named"),
    [  # slow tier: the entry points that import torch and the model code, the slowest to start
        # (tests/reliability/test_bad_input.py runs their Hydra errors in process)
        pytest.param(
            "pretrain",
            "pretrain",
            "optim=nosuch",
            "available options in 'optim': adamw, lamb, onebit_adam",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "finetune", "finetune", "task=nosuch", "Could not find 'task/nosuch'", marks=pytest.mark.slow
        ),
        ("data.prepare", "data.prepare", "data.shards.chunk_mb=x", "data.shards.chunk_mb=x"),
        ("results.compare", "compare", "nokey=1", "key 'nokey' not in 'CompareConfig'"),
        ("results.compare.dashboard", "dashboard", "save=maybe", "override save=maybe"),
        pytest.param(
            "pretrain.tools.preflight",
            "preflight",
            "seed",
            "Error parsing override 'seed'",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_a_bad_override_is_one_line_and_exit_2(module: str, prog: str, override: str, named: str):
    done = run(module, override)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"{prog}: error: ") and named in lines[0], lines[0]
    assert "Traceback" not in done.stderr


@pytest.mark.slow  # the debug switch itself: tests/unit/test_cli.py
def test_debug_true_shows_hydras_traceback():
    done = run("pretrain.tools.preflight", "optim=nosuch", "debug=true")
    assert done.returncode == 1
    assert "Traceback" in done.stderr and "MissingConfigException: In 'pretrain'" in done.stderr


@pytest.mark.slow
def test_hydra_full_error_shows_a_mains_user_error_with_its_traceback(tmp_path):
    done = run("finetune", f"model_path={tmp_path / 'absent'}", **{cli.FULL_ERROR: "1"})
    assert done.returncode == 1
    assert "Traceback" in done.stderr
    assert f"ValueError: model_path={tmp_path / 'absent'}: no such folder" in done.stderr


@pytest.mark.slow
def test_debug_true_is_not_an_override_hydra_sees():
    done = run("pretrain.tools.preflight", "batch=demo", "optim=lamb", "model=bert_tiny", "debug=true")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("pre-flight: bert_tiny")
