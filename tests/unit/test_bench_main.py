"""`python -m bench --help` prints the usage and the benchmark names, and runs none of them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from bench.__main__ import BENCHMARKS, OPT_IN
from data.config import REPO_ROOT


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under `folder` except the git-ignored run folders: path -> (size, mtime)."""
    runs = folder / "runs"
    return {
        str(path): (stat.st_size, stat.st_mtime_ns)
        for path in folder.rglob("*")
        if path.is_file() and runs not in path.parents and (stat := path.stat())
    }


def test_help_lists_the_benchmarks_and_writes_nothing(tmp_path: Path):
    before = _files(REPO_ROOT / "results")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    # -X importtime lists every module the process imported (on stderr): no benchmark's module may be
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "bench", "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("`python -m bench [name ...]`")
    listed = proc.stdout.split("benchmarks:", 1)[1].splitlines()[0]
    for name in BENCHMARKS:
        assert name in listed
    for name in OPT_IN:
        assert f"{name} (opt-in)" in listed
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert "bench" in imported
    assert not imported & set(BENCHMARKS.values()), "a benchmark module was imported"
    assert list(tmp_path.iterdir()) == []
    assert _files(REPO_ROOT / "results") == before
