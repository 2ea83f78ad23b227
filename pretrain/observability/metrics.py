"""One metrics path: a small logger protocol fanned out to console, metrics.jsonl and (optionally) W&B.

Only the main rank builds real loggers; other ranks get `NullLogger`. W&B is imported lazily, and its
mode is online when an API key is configured, offline otherwise, disabled on request.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

SECRET_KEY_PATTERN = re.compile(r"(api[_-]?key|token|secret|password|passwd)", re.IGNORECASE)
WANDB_KEY_PATTERN = re.compile(r"\b[0-9a-f]{40}\b|\bwandb_v1_[A-Za-z0-9_]{20,}\b")


def scrub_secrets(value: Any) -> Any:
    """A copy of a config tree with secret-looking keys and W&B-key-looking strings redacted."""
    if isinstance(value, Mapping):
        return {
            k: "<redacted>" if SECRET_KEY_PATTERN.search(str(k)) else scrub_secrets(v)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [scrub_secrets(v) for v in value]
    if isinstance(value, str):
        return WANDB_KEY_PATTERN.sub("<redacted>", value)
    return value


class MetricsLogger(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class NullLogger:
    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlLogger:
    """Appends one JSON object per log call; line-buffered so a killed run keeps what it logged."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "a", buffering=1)  # noqa: SIM115 - closed in close()

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        record = {"step": step, **{k: _json_number(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self.file.close()


def _json_number(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class ConsoleLogger:
    def __init__(self, keys: tuple[str, ...] = ("loss", "lr", "samples_per_s")):
        self.keys = keys

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        shown = " ".join(f"{k}={metrics[k]:.4g}" for k in self.keys if k in metrics)
        print(f"step {step}: {shown}", flush=True)

    def close(self) -> None:
        pass


def wandb_mode(requested: str) -> str:
    """'auto' -> online with an API key (env or netrc login), offline otherwise."""
    if requested != "auto":
        return requested
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return "online" if netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore") else "offline"


class WandbLogger:
    def __init__(
        self,
        *,
        project: str,
        group: str | None,
        name: str | None,
        tags: list[str],
        mode: str,
        config: Mapping[str, Any],
        directory: str | Path,
        job_type: str = "pretrain",
    ):
        import wandb

        # W&B records the command line with the run: an override carrying a key would go with it
        argv, sys.argv = sys.argv, scrub_secrets(list(sys.argv))
        try:
            self.run = wandb.init(
                project=project,
                group=scrub_secrets(group),
                name=scrub_secrets(name),
                tags=scrub_secrets(list(tags)),
                mode=wandb_mode(mode),  # type: ignore[arg-type]
                config=scrub_secrets(dict(config)),
                dir=str(directory),
                job_type=job_type,
                reinit="finish_previous",
            )
        finally:
            sys.argv = argv

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class FanoutLogger:
    def __init__(self, *loggers: MetricsLogger):
        self.loggers = loggers

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for logger in self.loggers:
            logger.log(step, metrics)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()
