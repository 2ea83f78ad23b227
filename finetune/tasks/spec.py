"""The task spec: everything the fine-tuning loop needs to know about a task, as data."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TaskSpec:
    """One fine-tuning task.

    `kind` is "classification" (`num_labels` classes, labels are ints in `label_names` order),
    "regression" (`num_labels` 1, float labels) or "span" (`num_labels` 0, SQuAD-style extraction).
    `glue_dir` is the folder under a local `glue_data/` (None for SQuAD); `hub` is the
    `(path, config)` pair for `datasets.load_dataset`. `eval_splits` are local split names
    ("dev", or "dev_matched"/"dev_mismatched" for MNLI). `label_names[i]` is the name of class id
    `i` (empty for regression and span tasks); the runner can use it for the model's `id2label`.
    """

    name: str
    kind: str
    num_labels: int
    glue_dir: str | None
    hub: tuple[str, str | None]
    eval_splits: tuple[str, ...]
    main_metric: str
    label_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("classification", "regression", "span"):
            raise ValueError(
                f"task {self.name}: kind must be classification/regression/span, not {self.kind}"
            )
        if self.kind == "classification" and len(self.label_names) != self.num_labels:
            raise ValueError(f"task {self.name}: {self.num_labels} labels but names {self.label_names}")
