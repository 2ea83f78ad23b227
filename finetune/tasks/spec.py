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
    `squad_version` ("1.1" or "2.0", span tasks only) names the local file
    (`<split>-v<version>.json`) and, for "2.0", keeps unanswerable questions (labelled at [CLS]) and
    scores with the null answer and the official v2.0 metrics.
    """

    name: str
    kind: str
    num_labels: int
    glue_dir: str | None
    hub: tuple[str, str | None]
    eval_splits: tuple[str, ...]
    main_metric: str
    label_names: tuple[str, ...] = ()
    squad_version: str | None = None

    @property
    def has_unanswerable(self) -> bool:
        """SQuAD v2.0: questions may have no answer (predicted as "")."""
        return self.squad_version == "2.0"

    def __post_init__(self) -> None:
        if self.kind not in ("classification", "regression", "span"):
            raise ValueError(
                f"task {self.name}: kind must be classification/regression/span, not {self.kind}"
            )
        if self.kind == "classification" and len(self.label_names) != self.num_labels:
            raise ValueError(f"task {self.name}: {self.num_labels} labels but names {self.label_names}")
        if (self.kind == "span") != (self.squad_version is not None) or self.squad_version not in (
            None,
            "1.1",
            "2.0",
        ):
            raise ValueError(f"task {self.name}: squad_version {self.squad_version!r} for kind {self.kind}")


# How a task runs where the hub cannot be reached (`data.hub_access.load_from_hub` puts it in the error).
FINETUNE_WAYS_FORWARD = (
    "either read the task's files from a local folder in the shared-data layout (data_dir=<folder> "
    "holding squad/ or glue_data/), or load it once on a machine with network access into a shared "
    "HF_HOME and run here with HF_DATASETS_OFFLINE=1"
)
