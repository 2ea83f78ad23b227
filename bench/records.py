"""The benchmark record format of the design guide and an atomic writer for results/bench/<name>.json."""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pretrain.observability.machine import cpu_model

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results" / "bench"


@dataclass
class Record:
    """One figure. `ratio` is value / peer_value: the number that counts on a noisy machine."""

    name: str
    value: float
    unit: str
    peer: str | None = None
    peer_value: float | None = None
    target: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    ratio: float | None = None

    def __post_init__(self) -> None:
        if self.ratio is None and self.peer_value not in (None, 0):
            self.ratio = self.value / self.peer_value  # type: ignore[operator]


def machine_info() -> dict[str, Any]:
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "machine": platform.machine(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def results_name(name: str, quick: bool) -> str:
    """`<name>_quick` for a reduced run: a quick check never replaces the full-scale records (the committed
    `<name>.json` whose figures the README quotes)."""
    return f"{name}_quick" if quick else name


def publish(tmp: str | Path, path: Path) -> None:
    """Rename the finished temporary file ``tmp`` onto ``path`` with the mode a plain ``open()`` gives (0666
    less the umask): ``mkstemp`` makes 0600 files, which others sharing a results folder cannot read."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    os.replace(tmp, path)


def _machines_of_unchanged(path: Path) -> dict[str, Any]:
    """The machine of each record in `path`, keyed by the record without it (JSON): none when unreadable."""
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    machines: dict[str, Any] = {}
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, dict) or not isinstance(entry.get("config"), dict):
            continue
        config = {k: v for k, v in entry["config"].items() if k != "machine"}
        if "machine" in entry["config"]:
            machines[json.dumps({**entry, "config": config}, sort_keys=True)] = entry["config"]["machine"]
    return machines


def write_records(name: str, records: list[Record], out_dir: Path | None = None, quiet: bool = False) -> Path:
    """Write `<out_dir>/<name>.json` atomically (temp file + rename) and print a one-line summary each
    (unless `quiet`). A record equal to the file's one of that name but for its machine keeps the file's
    machine: a record computed again from stored runs (`bench fidelity`) names where it was first made."""
    out_dir = Path(out_dir or RESULTS_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    path = out_dir / f"{name}.json"
    earlier = _machines_of_unchanged(path)
    payload = []
    for r in records:
        entry = asdict(r)
        kept = earlier.get(json.dumps(entry, sort_keys=True))
        payload.append({**entry, "config": {**r.config, "machine": kept or machine}})
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")
    publish(tmp, path)
    for r in [] if quiet else records:
        peer = f"  vs {r.peer}={r.peer_value:.4g} ratio={r.ratio:.3g}" if r.peer_value is not None else ""
        target = f"  target {r.target}" if r.target else ""
        print(f"[bench {name}] {r.name}: {r.value:.4g} {r.unit}{peer}{target}")
    return path
