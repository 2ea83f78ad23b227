"""Fine-tuning tasks: an explicit registry of specs plus the GLUE and SQuAD data code.

Adding a task is one `TaskSpec` line here (and, for a GLUE-format task, one column layout in
`glue.py`), one YAML under `conf/task/` and its tests.
"""

from __future__ import annotations

from finetune.tasks.glue import GlueExample, encode_glue
from finetune.tasks.glue import load_examples as load_glue_examples
from finetune.tasks.spec import TaskSpec
from finetune.tasks.squad import SquadExample, postprocess_squad, prepare_squad_features
from finetune.tasks.squad import load_examples as load_squad_examples

_GLUE = "nyu-mll/glue"
_DEV = ("dev",)
_BINARY_ENTAILMENT = ("entailment", "not_entailment")

TASKS: dict[str, TaskSpec] = {
    "cola": TaskSpec(
        "cola", "classification", 2, "CoLA", (_GLUE, "cola"), _DEV, "matthews_correlation",
        ("unacceptable", "acceptable"),
    ),
    "sst2": TaskSpec(
        "sst2", "classification", 2, "SST-2", (_GLUE, "sst2"), _DEV, "accuracy", ("negative", "positive")
    ),
    "mrpc": TaskSpec(
        "mrpc", "classification", 2, "MRPC", (_GLUE, "mrpc"), _DEV, "f1", ("not_equivalent", "equivalent")
    ),
    "stsb": TaskSpec("stsb", "regression", 1, "STS-B", (_GLUE, "stsb"), _DEV, "pearson"),
    "qqp": TaskSpec(
        "qqp", "classification", 2, "QQP", (_GLUE, "qqp"), _DEV, "f1", ("not_duplicate", "duplicate")
    ),
    # The order of the original GLUE processors (google-research/bert, HF's pre-`datasets` run_glue);
    # the hub's ClassLabel order differs and is remapped by name when loading.
    "mnli": TaskSpec(
        "mnli", "classification", 3, "MNLI", (_GLUE, "mnli"), ("dev_matched", "dev_mismatched"),
        "accuracy", ("contradiction", "entailment", "neutral"),
    ),
    "qnli": TaskSpec("qnli", "classification", 2, "QNLI", (_GLUE, "qnli"), _DEV, "accuracy", _BINARY_ENTAILMENT),
    "rte": TaskSpec("rte", "classification", 2, "RTE", (_GLUE, "rte"), _DEV, "accuracy", _BINARY_ENTAILMENT),
    # WNLI's files say 1 for entailment, so id 1 must be "entailment" (as in the hub's ClassLabel).
    "wnli": TaskSpec(
        "wnli", "classification", 2, "WNLI", (_GLUE, "wnli"), _DEV, "accuracy", ("not_entailment", "entailment")
    ),
    "squad": TaskSpec("squad", "span", 0, None, ("rajpurkar/squad", None), _DEV, "exact_match"),
}  # fmt: skip

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
    "prepare_squad_features",
]
