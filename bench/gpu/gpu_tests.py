"""Check `tests`: `make test-gpu` inside the device script, its outcome as records.

Runs `pytest -m gpu` over the files holding such tests (the packers and compiled kernels on CUDA, the
whole pipeline on one GPU in tests/gpu/test_pipeline.py, and the NCCL tests, which skip with their reason
below 2 GPUs) in a subprocess, and reads its JUnit XML: passed / failed / skipped counts, each test's
seconds, and the pipeline's stage seconds (its `record_property` values). A failed or erroring test fails
the check. `--cpu-smoke`: the same command with GPU_CHECK_CPU_SMOKE=1, which runs the pipeline test on the
CPU (the CUDA-only tests skip).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

from bench.gpu.common import Context
from bench.records import Record

TIMEOUT_S = 420  # on a GPU (the pipeline's three stages took ~80 s on an H200); the CPU smoke: 2,400


def read_junit(path: Path) -> dict[str, Any]:
    """Counts, each test's outcome and seconds, and the properties tests recorded, from a JUnit XML file."""
    root = ElementTree.parse(path).getroot()
    tests: dict[str, dict[str, Any]] = {}
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                reason = (element.get("message") or "").splitlines()
                tests.setdefault(name, {})["reason"] = reason[0][:300] if reason else ""
                break
        entry = tests.setdefault(name, {})
        entry.update(outcome=outcome, seconds=round(float(case.get("time", 0.0)), 1))
        properties = {p.get("name"): p.get("value") for p in case.iter("property")}
        if properties:
            entry["properties"] = properties
    counts = {
        k: sum(t["outcome"] == k for t in tests.values()) for k in ("passed", "failed", "error", "skipped")
    }
    return {"counts": counts, "tests": tests}


def gpu_test_files(tests: Path) -> list[str]:
    """The test files that hold tests marked gpu, relative to the repository: `pytest -m gpu` over them
    alone (a file elsewhere whose imports the GPU image lacks cannot stop the run at collection)."""
    return sorted(
        str(path.relative_to(tests.parent))
        for path in tests.rglob("test_*.py")
        if "pytest.mark.gpu" in path.read_text(encoding="utf-8")
    )


def check_tests(ctx: Context) -> list[Record]:
    from data.config import REPO_ROOT

    junit = ctx.out_dir / "gpu_logs" / "test_gpu.xml"
    junit.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-rs", "-q", "-p", "no:cacheprovider"]
    command += gpu_test_files(REPO_ROOT / "tests")
    command += [f"--junitxml={junit}", "-o", "junit_family=xunit1"]  # xunit1: the tests' properties
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if ctx.smoke:
        env["GPU_CHECK_CPU_SMOKE"] = "1"
    started = time.perf_counter()
    try:
        proc = subprocess.run(
            command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            timeout=TIMEOUT_S if not ctx.smoke else 2400,
        )  # fmt: skip
        code, output = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as error:
        out = error.stdout
        code, output = 124, (out.decode() if isinstance(out, bytes) else out or "") + "\n(timed out)"
    seconds = time.perf_counter() - started
    (ctx.out_dir / "gpu_logs" / "test_gpu.log").write_text(output)
    result = read_junit(junit) if junit.exists() else {"counts": {}, "tests": {}}
    counts = result["counts"]
    bad = counts.get("failed", 0) + counts.get("error", 0)
    # 5: no tests collected; anything else but 0 is a failure (a test's, pytest's, or the timeout)
    if code != 0 or bad or not counts.get("passed"):
        tail = "\n".join(output.strip().splitlines()[-15:])
        ctx.fail(f"tests: `pytest -m gpu` exit {code}, {counts}:\n{tail}")
    config = ctx.config(command=" ".join(command[1:]), exit_code=code, seconds=round(seconds, 1), **result)
    records = [
        Record("test_gpu_failed", float(bad), "tests", target="0", config=config),
        Record("test_gpu_passed", float(counts.get("passed", 0)), "tests", config=config),
    ]
    pipeline = next((t for name, t in result["tests"].items() if "test_pipeline" in name), None)
    for key, value in (pipeline or {}).get("properties", {}).items():
        if key.endswith("_s"):
            stage_config = ctx.config(test="tests/gpu/test_pipeline.py", outcome=pipeline["outcome"])
            name = f"pipeline_{key.removesuffix('_s')}"
            target = "exit 0, metrics written" if "finetune" in key else "exit 0, checkpoint written"
            records.append(Record(name, float(value), "s", target=target, config=stage_config))
    return records
