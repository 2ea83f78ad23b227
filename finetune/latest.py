"""`python -m finetune.latest [RUNS_DIR]`: the most recent pretraining run, for `make finetune` without CKPT.

Prints the run folder whose newest complete checkpoint (with its `hf/` export) was written last, and says on
stderr which one and why; with none, one line naming the folder searched and how to name a model instead,
exit code 2. The fine-tuner then takes that run's newest checkpoint, as for any run folder given as CKPT.
"""

from __future__ import annotations

import sys
from pathlib import Path

DEFAULT_RUNS_DIR = Path(__file__).resolve().parents[1] / "results" / "runs"
NO_RUN = (
    "make finetune: no pretraining run with a complete checkpoint under {runs_dir}; name a model with "
    "CKPT=<pretraining run folder or HF BERT folder> (or run make pretrain / make demo)"
)


def latest_run(runs_dir: Path) -> tuple[Path, Path] | None:
    """(run folder, its newest complete checkpoint) of the run whose checkpoint was completed last."""
    from pretrain.checkpoint import latest_checkpoint  # imports torch: only when asked

    candidates = []
    for run in sorted(runs_dir.iterdir()) if runs_dir.is_dir() else []:
        checkpoint = latest_checkpoint(run / "checkpoints") if (run / "checkpoints").is_dir() else None
        if checkpoint is not None and (checkpoint / "hf" / "config.json").is_file():
            candidates.append(((checkpoint / "COMPLETE").stat().st_mtime_ns, run, checkpoint))
    if not candidates:
        return None
    _, run, checkpoint = max(candidates, key=lambda candidate: candidate[0])
    return run, checkpoint


def main(argv: list[str]) -> int:
    runs_dir = Path(argv[0]) if argv else DEFAULT_RUNS_DIR
    found = latest_run(runs_dir)
    if found is None:
        print(NO_RUN.format(runs_dir=runs_dir), file=sys.stderr)
        return 2
    run, checkpoint = found
    message = f"make finetune: CKPT not set, using the most recent run {run} ({checkpoint.name})"
    print(message, file=sys.stderr)
    print(run)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
