"""Parameter digests of short 2-rank pretraining runs: the bit-for-bit behaviour a refactor must keep.

Each run is `make pretrain`'s command (torchrun, 2 gloo ranks, `python -m pretrain`) on the tiny BERT and
`data=tiny` prepared with the BERT uncased vocabulary (deterministic, unlike a trained vocabulary), 20
steps of the demo recipe: 12 warmup steps, then the 1-bit compression stage (for the default with a
variance refresh every 4 steps, at steps 16 and 20). The digest is the SHA-256 over the final
checkpoint's tensors, by name.

`tests/fixtures/behaviour_digests.json` holds the digests the baseline commit's code gave on one kind of
machine (its `machine` record). On the same kind of machine the test compares against them; elsewhere
(float reductions differ between CPU instruction sets) it re-runs the baseline commit's code, taken from
git, on this machine and compares against that. Record anew (only for an intended change of behaviour):

    .venv/bin/python -m tests.integration.behaviour_digests --record [--baseline COMMIT]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
FIXTURE = REPO_ROOT / "tests" / "fixtures" / "behaviour_digests.json"
COMMON = [
    "batch=demo",
    "model=bert_tiny",
    "max_steps=20",
    "seed=1",
    "wandb.mode=disabled",
    "show_progress=false",
    "checkpoint.export_hf=false",
]
# each run's overrides on the current code (the fixture keeps the baseline code's own)
RUNS = {
    "lamb": ["optim=lamb"],
    "onebit_lamb": ["optim=onebit_lamb", "optim.variance_refresh=4"],
    "onebit_lamb_deepspeed": ["optim=onebit_lamb_deepspeed"],
}


def machine() -> dict[str, str]:
    """What the digests depend on besides the code: the vector instructions torch and numba compile for."""
    import llvmlite.binding
    import numba
    import torch

    return {
        "torch": torch.__version__,
        "numba": numba.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "llvm_host_cpu": llvmlite.binding.get_host_cpu_name(),
    }


def _environment(code_root: Path) -> dict[str, str]:
    """`code_root`'s packages first on the path (before the editable install's), one thread per rank."""
    from data.config import SHARED_DATA_ENV, default_shared_data_dir

    return {
        **os.environ,
        "PYTHONPATH": str(code_root),
        SHARED_DATA_ENV: str(default_shared_data_dir()),
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "disabled",
    }


def prepare_data(folder: Path, code_root: Path = REPO_ROOT) -> Path:
    """`data=tiny` with the BERT uncased vocabulary into `folder` (deterministic)."""
    command = [sys.executable, "-m", "data.prepare", "data=tiny", f"data.shards.output_dir={folder}"]
    command.append("show_progress=false")
    subprocess.run(command, cwd=code_root, env=_environment(code_root), check=True, capture_output=True)
    return folder


def tensor_digest(checkpoint: Path) -> str:
    from safetensors.torch import load_file

    tensors = load_file(checkpoint / "model.safetensors")
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().numpy().tobytes())
    return digest.hexdigest()


def run_digest(code_root: Path, data: Path, run_dir: Path, overrides: list[str]) -> str:
    """Train 2 ranks with `code_root`'s code; -> the digest of its last checkpoint."""
    env = _environment(code_root)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["-m", "pretrain", *COMMON, f"data_dir={data}", f"run_dir={run_dir}", *overrides]
    result = subprocess.run(command, cwd=code_root, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(overrides)}: exit {result.returncode}\n{result.stdout[-3000:]}")
    (last,) = sorted((run_dir / "checkpoints").glob("step-*"))[-1:]
    return tensor_digest(last)


def baseline_tree(commit: str, folder: Path) -> Path:
    """The baseline commit's files (from git) in `folder`."""
    archive = subprocess.run(["git", "archive", commit], cwd=REPO_ROOT, check=True, capture_output=True)
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(folder, filter="data")
    return folder


def baseline_digests(fixture: dict, work: Path) -> dict[str, str]:
    """The fixture's digests where this machine is the fixture's kind, else the baseline code re-run here."""
    if fixture["machine"] == machine():
        return {name: run["digest"] for name, run in fixture["runs"].items()}
    code = baseline_tree(fixture["baseline_commit"], work / "baseline")
    data = prepare_data(work / "baseline-data", code)
    return {
        name: run_digest(code, data, work / f"baseline-{name}", run["baseline_overrides"])
        for name, run in fixture["runs"].items()
    }


def record(commit: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        code = baseline_tree(commit, work / "code")
        data = prepare_data(work / "data", code)
        runs = {
            name: {"baseline_overrides": overrides, "digest": run_digest(code, data, work / name, overrides)}
            for name, overrides in RUNS.items()
        }
    full = subprocess.run(["git", "rev-parse", commit], cwd=REPO_ROOT, check=True, capture_output=True)
    fixture = {"baseline_commit": full.stdout.decode().strip(), "machine": machine(), "runs": runs}
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(json.dumps(fixture, indent=2) + "\n")
    print(json.dumps(fixture, indent=2))


if __name__ == "__main__":
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--record", action="store_true", help="write tests/fixtures/behaviour_digests.json")
    parser.add_argument("--baseline", default="HEAD", help="the commit whose code gives the digests")
    args = parser.parse_args()
    if args.record:
        record(args.baseline)
