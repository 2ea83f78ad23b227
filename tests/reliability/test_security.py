"""Safe loading and secrets.

- Nothing in the source tree deserializes with pickle: every `torch.load` passes `weights_only=True`,
  and there is no `pickle`/`dill`/`marshal` loading, no `eval`/`exec`, no `yaml.load` without a safe
  loader, no `np.load(allow_pickle=True)` (an AST scan of every Python file, so comments and strings
  do not count and aliases do).
- A W&B API key planted in the environment and in config overrides never reaches any file a
  pretraining and a fine-tuning run produce (run folder, metrics.jsonl, config dumps, checkpoints and
  their HF export, the offline W&B run, W&B's own logs and caches, the processes' console output).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from data.config import REPO_ROOT

SKIPPED_DIRS = {
    ".venv",
    ".git",
    "prepared",
    "runs",
    "__pycache__",
    ".mypy_cache",
    ".ruff_cache",
    "node_modules",
}
# Pickle between processes the code starts itself, through a private (0700) temporary folder: the same
# trust as multiprocessing's own pickling, never a file a user hands in.
TRUSTED_IPC = {
    "launch/netns.py": "pickles its calls and results between the ranks it starts, in a TemporaryDirectory",
}
FAKE_KEY = "0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c"  # shaped like a W&B key (40 hex digits)


def python_files() -> list[Path]:
    files = []
    for path in REPO_ROOT.rglob("*.py"):
        if not SKIPPED_DIRS.intersection(path.relative_to(REPO_ROOT).parts[:-1]):
            files.append(path)
    return sorted(files)


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def unsafe_calls(source: str, filename: str) -> list[str]:
    """`file:line: what` for every unsafe deserialization or code execution in `source`."""
    tree = ast.parse(source, filename)
    aliases: dict[str, str] = {}  # local name -> module (import torch as T, from pickle import loads)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                aliases[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        head, _, rest = name.partition(".")
        resolved = f"{aliases.get(head, head)}.{rest}" if rest else aliases.get(head, head)
        where = f"{filename}:{node.lineno}"
        weights_only = _keyword(node, "weights_only")
        if resolved == "torch.load" and not (
            isinstance(weights_only, ast.Constant) and weights_only.value is True
        ):
            found.append(f"{where}: torch.load without weights_only=True")
        elif resolved.split(".")[0] in ("pickle", "dill", "cloudpickle", "marshal", "shelve") and (
            resolved.endswith(("load", "loads", "Unpickler", "open"))
        ):
            found.append(f"{where}: {resolved}")
        elif resolved in ("eval", "exec", "builtins.eval", "builtins.exec"):
            found.append(f"{where}: {resolved}()")
        elif resolved in ("yaml.load", "yaml.load_all", "yaml.unsafe_load", "yaml.full_load"):
            loader = _dotted(_keyword(node, "Loader") or ast.Constant(None))
            if resolved in ("yaml.unsafe_load", "yaml.full_load") or "Safe" not in loader:
                found.append(f"{where}: {resolved} without SafeLoader")
        elif resolved in ("numpy.load", "np.load"):
            allow = _keyword(node, "allow_pickle")
            if isinstance(allow, ast.Constant) and allow.value is True:
                found.append(f"{where}: numpy.load(allow_pickle=True)")
    return found


def test_the_scanner_finds_what_it_must():
    bad = """
import pickle, yaml, torch as T
from pickle import loads as l
import numpy as np
T.load("x")
T.load("x", weights_only=False)
pickle.load(f)
l(b"")
eval("1")
exec("x = 1")
yaml.load(s)
yaml.load(s, Loader=yaml.Loader)
np.load("x", allow_pickle=True)
"""
    good = """
import torch, yaml, numpy as np
torch.load("x", weights_only=True, map_location="cpu")
yaml.load(s, Loader=yaml.SafeLoader)
yaml.safe_load(s)
model.eval()
np.load("x")
"""
    assert len(unsafe_calls(bad, "bad.py")) == 9
    assert unsafe_calls(good, "good.py") == []


def test_no_unsafe_loading_or_code_execution_in_the_source_tree(record):
    files = python_files()
    assert len(files) > 50 and REPO_ROOT / "pretrain" / "checkpoint.py" in files
    found = []
    for path in files:
        relative = str(path.relative_to(REPO_ROOT))
        issues = unsafe_calls(path.read_text(), relative)
        if relative in TRUSTED_IPC:  # only pickle, and only there
            assert all("pickle.load" in issue for issue in issues), issues
            continue
        found += issues
    assert found == [], "\n".join(found)
    loads = sum(p.read_text().count("torch.load(") for p in files)
    record("security", check="source scan", files=len(files), torch_load_calls=loads, unsafe=0)


def _scan(roots: list[Path], secret: str) -> tuple[list[str], int]:
    """Files under `roots` that contain `secret` (raw bytes, as text or inside binary files)."""
    needle = secret.encode()
    leaks, scanned = [], 0
    for root in roots:
        for path in [root] if root.is_file() else root.rglob("*"):
            if path.is_file() and not path.is_symlink():
                scanned += 1
                if needle in path.read_bytes():
                    leaks.append(str(path))
    return leaks, scanned


@pytest.mark.integration
@pytest.mark.slow
def test_planted_wandb_key_reaches_no_output(tiny_data: Path, shared_data: Path, tmp_path: Path, record):
    work = tmp_path / "work"  # the processes' working directory: stray files land here
    work.mkdir()
    caches = {
        name: tmp_path / name.lower() for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR")
    }
    env = {
        **os.environ,
        **{name: str(path) for name, path in caches.items()},
        "XDG_CACHE_HOME": str(tmp_path / "xdg_cache"),
        "WANDB_API_KEY": FAKE_KEY,
        "WANDB_MODE": "offline",
        "PYTHONPATH": str(REPO_ROOT),
    }
    run_dir = work / "run"
    planted = [f"wandb.tags=[{FAKE_KEY}]", f"wandb.group={FAKE_KEY}"]
    pretrain = [
        sys.executable, "-m", "pretrain", "batch=demo", "optim=onebit_lamb", "model=bert_tiny",
        f"data_dir={tiny_data}", f"run_dir={run_dir}", "run_name=secret-scan", "wandb.mode=offline",
        "num_workers=0", "log_every=1", "max_steps=3", "checkpoint.every_steps=2", "show_progress=false",
        *planted,
    ]  # fmt: skip
    logs = tmp_path / "logs"
    logs.mkdir()
    done = subprocess.run(pretrain, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    (logs / "pretrain.out").write_text(done.stdout + done.stderr)
    assert done.returncode == 0, done.stderr[-3000:]
    glue = shared_data / "glue_data"
    finetune = [
        sys.executable, "-m", "finetune", "task=mrpc", f"model_path={run_dir}", f"data_dir={glue}",
        f"output_dir={run_dir / 'finetune' / 'mrpc'}", "wandb.mode=offline", "task.epochs=1",
        "task.max_train_examples=32", "task.max_eval_examples=16", "task.max_length=64",
        "show_progress=false", *planted,
    ]  # fmt: skip
    done = subprocess.run(finetune, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    (logs / "finetune.out").write_text(done.stdout + done.stderr)
    assert done.returncode == 0, done.stderr[-3000:]

    # the outputs exist, so the scan below looks at real files
    assert (run_dir / "metrics.jsonl").is_file() and (run_dir / "config.yaml").is_file()
    assert any((run_dir / "wandb").glob("offline-run-*")), "no offline W&B run to scan"
    assert list((run_dir / "checkpoints").glob("step-*/hf/config.json"))
    assert (run_dir / "finetune" / "mrpc" / "all_results.json").is_file()
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    leaks, scanned = _scan([work, logs, tmp_path / "xdg_cache", *caches.values()], FAKE_KEY)
    assert scanned > 30
    assert leaks == [], f"the planted key reached: {leaks}"
    record("security", check="planted W&B key", files_scanned=scanned, leaks=0)
