"""Fine-tuning tasks: an explicit registry of specs plus the GLUE and SQuAD data code.

Adding a task is one `TaskSpec` line here (and, for a GLUE-format task, one column layout in
`glue.py`), one YAML under `conf/task/` and its tests.
"""

from __future__ import annotations

from finetune.tasks.glue import GlueExample, encode_glue
from finetune.tasks.glue import load_examples as load_glue_examples
from finetune.tasks.spec import TaskSpec
from finetune.tasks.squad import (
    SquadExample,
    postprocess_squad,
    postprocess_squad_v2,
    prepare_squad_features,
)
from finetune.tasks.squad import load_examples as load_squad_examples


def _glue(
    name: str,
    folder: str,
    main_metric: str,
    label_names: tuple[str, ...],
    eval_splits: tuple[str, ...] = ("dev",),
) -> TaskSpec:
    """A GLUE classification task (hub: `nyu-mll/glue`, config = the task name)."""
    return TaskSpec(
        name=name,
        kind="classification",
        num_labels=len(label_names),
        glue_dir=folder,
        hub=("nyu-mll/glue", name),
        eval_splits=eval_splits,
        main_metric=main_metric,
        label_names=label_names,
    )


_ENTAILMENT = ("entailment", "not_entailment")

TASKS: dict[str, TaskSpec] = {
    "cola": _glue("cola", "CoLA", "matthews_correlation", ("unacceptable", "acceptable")),
    "sst2": _glue("sst2", "SST-2", "accuracy", ("negative", "positive")),
    "mrpc": _glue("mrpc", "MRPC", "f1", ("not_equivalent", "equivalent")),
    "stsb": TaskSpec(
        name="stsb",
        kind="regression",
        num_labels=1,
        glue_dir="STS-B",
        hub=("nyu-mll/glue", "stsb"),
        eval_splits=("dev",),
        main_metric="pearson",
    ),
    "qqp": _glue("qqp", "QQP", "f1", ("not_duplicate", "duplicate")),
    # The order of the original GLUE processors (google-research/bert, HF's pre-`datasets` run_glue);
    # the hub's ClassLabel order differs and is remapped by name when loading.
    "mnli": _glue(
        "mnli",
        "MNLI",
        "accuracy",
        ("contradiction", "entailment", "neutral"),
        ("dev_matched", "dev_mismatched"),
    ),
    "qnli": _glue("qnli", "QNLI", "accuracy", _ENTAILMENT),
    "rte": _glue("rte", "RTE", "accuracy", _ENTAILMENT),
    # WNLI's files write 1 for entailment, so id 1 must be "entailment" (as in the hub's ClassLabel).
    "wnli": _glue("wnli", "WNLI", "accuracy", ("not_entailment", "entailment")),
    "squad": TaskSpec(
        name="squad",
        kind="span",
        num_labels=0,
        glue_dir=None,
        hub=("rajpurkar/squad", None),
        eval_splits=("dev",),
        main_metric="exact_match",
        squad_version="1.1",
    ),
    # SQuAD v2.0: v1.1's questions plus unanswerable ones; the official v2.0 metric names
    "squad_v2": TaskSpec(
        name="squad_v2",
        kind="span",
        num_labels=0,
        glue_dir=None,
        hub=("rajpurkar/squad_v2", None),
        eval_splits=("dev",),
        main_metric="exact",
        squad_version="2.0",
    ),
}

GLUE_TASKS: list[str] = [name for name, spec in TASKS.items() if spec.glue_dir is not None]


def load_examples(task: TaskSpec, split: str, *, data_dir: str | None, max_examples: int | None = None):
    """Examples of `task`'s `split` and the skips counted by reason; dispatches on `task.kind`.

    See `finetune.tasks.glue.load_examples` and `finetune.tasks.squad.load_examples`.
    """
    if task.kind == "span":
        return load_squad_examples(task, split, data_dir=data_dir, max_examples=max_examples)
    return load_glue_examples(task, split, data_dir=data_dir, max_examples=max_examples)


__all__ = [
    "GLUE_TASKS",
    "TASKS",
    "GlueExample",
    "SquadExample",
    "TaskSpec",
    "encode_glue",
    "load_examples",
    "postprocess_squad",
    "postprocess_squad_v2",
    "prepare_squad_features",
]
