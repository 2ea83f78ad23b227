"""The whole pipeline on one GPU: `make pretrain BATCH=demo OPT=onebit_lamb`'s command on NCCL (world size 1,
two simulated workers so the 1-bit exchange runs, with the compiled communication kernels CUDA takes by
default) through the compression stage with a checkpoint, a resume from it, then a bf16 MRPC fine-tune.

Marked gpu: `make test-gpu` and `make gpu-check` (its `tests` step) run it. It never skips on a machine with
CUDA; without CUDA it skips with the reason, except under `make gpu-check ARGS=--cpu-smoke`
(GPU_CHECK_CPU_SMOKE=1), which runs it on the CPU (gloo, fp32, the numba kernels) so the device script is
tried end to end before a GPU is lent. Each stage's seconds go to the test's properties (`record_property`:
the JUnit XML the gpu-check reads into results/bench/gpu.json).

Data: $GPU_CHECK_DATA, else data/prepared/tiny (prepared here first when missing).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from data.config import REPO_ROOT, default_shared_data_dir

CUDA = torch.cuda.is_available()
SMOKE = os.environ.get("GPU_CHECK_CPU_SMOKE") == "1"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (CUDA or SMOKE), reason="needs CUDA (GPU_CHECK_CPU_SMOKE=1 runs it on the CPU)"),
]
# a stage took ~30 s on an H200; the CPU smoke on a shared 2-core machine took minutes
STAGE_TIMEOUT_S = 240 if CUDA else 900


def _run(command: list[str], log: Path) -> tuple[int, str, float]:
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONUNBUFFERED": "1"}
    started = time.perf_counter()
    try:
        proc = subprocess.run(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=STAGE_TIMEOUT_S,
            env=env,
        )
        code, text = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as error:
        out = error.stdout
        code, text = 124, (out.decode() if isinstance(out, bytes) else out or "") + "\n(timed out)"
    log.write_text(text)
    return code, text, time.perf_counter() - started


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


@pytest.fixture(scope="module")
def pipeline_data(tmp_path_factory) -> Path:
    data_dir = Path(os.environ.get("GPU_CHECK_DATA") or REPO_ROOT / "data" / "prepared" / "tiny")
    if not (data_dir / "seq128" / "manifest.json").exists():
        log = tmp_path_factory.mktemp("prepare") / "prepare.log"
        command = [sys.executable, "-m", "data.prepare", "data=tiny", "show_progress=false"]
        code, text, _ = _run(command, log)
        assert code == 0, f"preparing {data_dir} failed:\n{_tail(text)}"
    return data_dir


@pytest.mark.timeout(3 * STAGE_TIMEOUT_S + 60)  # three stages, each with its own limit
def test_pretrain_resume_and_finetune_on_one_device(pipeline_data, tmp_path, record_property):
    run_dir = tmp_path / "run"
    base = [
        str(REPO_ROOT / "launch" / "torchrun.sh"), "--nproc", "1", "--",
        "batch=demo", "optim=onebit_lamb", "model=bert_tiny", f"data_dir={pipeline_data}",
        "run_name=gpu-check",
        f"run_dir={run_dir}", "wandb.mode=disabled", "show_progress=false", "sim_world_size=2",
        "checkpoint.every_steps=10", "num_workers=0", "log_every=5",
    ]  # fmt: skip
    # the pre-flight lines name the backend and the precision the run took
    expected = ("nccl", "precision bf16") if CUDA else ("gloo", "precision fp32")
    stages = [
        ("pretrain_to_step_20", ["max_steps=20"], "checkpoints/step-00000020"),
        ("resume_to_step_30", ["max_steps=30"], "checkpoints/step-00000030"),
    ]
    for name, extra, checkpoint in stages:
        code, text, seconds = _run(base + extra, tmp_path / f"{name}.log")
        record_property(f"{name}_s", round(seconds, 1))
        assert code == 0, f"{name}: exit {code}:\n{_tail(text)}"
        assert (run_dir / checkpoint / "COMPLETE").exists(), f"{name}: no {checkpoint}:\n{_tail(text)}"
        missing = [word for word in expected if word not in text]
        assert not missing, f"{name}: the log does not mention {missing}:\n{_tail(text)}"
        if name.startswith("resume"):
            assert "resumed from" in text, _tail(text)
        kernels = re.search(r"1-bit compression on this machine's \w+: (.+)", text)
        assert kernels, f"{name}: the pre-flight names no compression kernels:\n{_tail(text)}"
        record_property(f"{name}_comm_kernels", kernels.group(1).strip())
        # CUDA's default: the compiled (Triton) kernels; the CPU's: numba
        assert kernels.group(1).strip() == ("compiled" if CUDA else "numba"), kernels.group(1)

    glue = default_shared_data_dir() / "glue_data"
    finetune = [
        sys.executable, "-m", "finetune", "task=mrpc", f"model_path={run_dir}",
        f"output_dir={tmp_path / 'mrpc'}", "seeds=[1]", "show_progress=false", "wandb.mode=disabled",
        "task.epochs=1",
        "task.max_train_examples=256", "task.max_eval_examples=128",
        "precision=bf16" if CUDA else "precision=fp32",
        f"data_dir={glue}" if glue.exists() else "data_dir=null",
    ]  # fmt: skip
    code, text, seconds = _run(finetune, tmp_path / "finetune.log")
    record_property("finetune_mrpc_s", round(seconds, 1))
    assert code == 0, f"fine-tune: exit {code}:\n{_tail(text)}"
    assert list((tmp_path / "mrpc").rglob("*.json")), f"fine-tune wrote no metrics:\n{_tail(text)}"
