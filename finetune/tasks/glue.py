"""GLUE examples from local `glue_data/<TASK>/<split>.tsv` files or the hub, and their encoding.

The TSVs are read as plain tab-separated text with no quote handling: MRPC, SST-2 and QNLI hold
unbalanced `"` characters that a CSV reader would treat as the start of a multi-line field.
"""

from __future__ import annotations

import codecs
import collections
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data.documents import DataError
from data.hub_access import load_from_hub
from finetune.tasks.spec import FINETUNE_WAYS_FORWARD, TaskSpec


@dataclass(frozen=True)
class GlueExample:
    """One sentence or sentence pair. `label` is a class id (classification), a float in [0, 5]
    (STS-B) or None (unlabelled test split)."""

    guid: str
    text_a: str
    text_b: str | None
    label: int | float | None


@dataclass(frozen=True)
class _Layout:
    """Where a task's fields are in its TSV and on the hub.

    Files with a header are addressed by column name, which covers MNLI's train (12 columns) and
    dev (16 columns) and test files that lack the label column. CoLA has no header, so `columns`
    gives its fixed names. `raw_labels[i]` is how class id `i` is written in the file.
    """

    text_a: str
    text_b: str | None
    label: str
    raw_labels: tuple[str, ...] = ()
    columns: tuple[str, ...] | None = None  # set only for header-less files
    hub_text_a: str = "sentence"
    hub_text_b: str | None = None


_DIGITS = ("0", "1")
_LAYOUTS: dict[str, _Layout] = {
    "cola": _Layout("sentence", None, "label", _DIGITS, columns=("source", "label", "mark", "sentence")),
    "sst2": _Layout("sentence", None, "label", _DIGITS),
    "mrpc": _Layout(
        "#1 String", "#2 String", "Quality", _DIGITS, hub_text_a="sentence1", hub_text_b="sentence2"
    ),
    "qqp": _Layout(
        "question1", "question2", "is_duplicate", _DIGITS, hub_text_a="question1", hub_text_b="question2"
    ),
    "stsb": _Layout("sentence1", "sentence2", "score", hub_text_a="sentence1", hub_text_b="sentence2"),
    "mnli": _Layout(
        "sentence1",
        "sentence2",
        "gold_label",
        ("contradiction", "entailment", "neutral"),
        hub_text_a="premise",
        hub_text_b="hypothesis",
    ),
    "qnli": _Layout(
        "question",
        "sentence",
        "label",
        ("entailment", "not_entailment"),
        hub_text_a="question",
        hub_text_b="sentence",
    ),
    "rte": _Layout(
        "sentence1",
        "sentence2",
        "label",
        ("entailment", "not_entailment"),
        hub_text_a="sentence1",
        hub_text_b="sentence2",
    ),
    "wnli": _Layout(
        "sentence1", "sentence2", "label", _DIGITS, hub_text_a="sentence1", hub_text_b="sentence2"
    ),
}

# Local split names → the hub's.
_HUB_SPLITS = {
    "train": "train",
    "dev": "validation",
    "dev_matched": "validation_matched",
    "dev_mismatched": "validation_mismatched",
    "test": "test",
    "test_matched": "test_matched",
    "test_mismatched": "test_mismatched",
}

STSB_MIN_SCORE, STSB_MAX_SCORE = 0.0, 5.0


def _layout(task: TaskSpec) -> _Layout:
    if task.name not in _LAYOUTS:
        raise ValueError(f"task {task.name!r} is not a GLUE task (known: {', '.join(_LAYOUTS)})")
    return _LAYOUTS[task.name]


def load_examples(
    task: TaskSpec, split: str, *, data_dir: str | Path | None, max_examples: int | None = None
) -> tuple[list[GlueExample], dict[str, int]]:
    """The first `max_examples` (all if None) examples of `split` and skips counted by reason.

    With `data_dir`, reads `<data_dir>/<task.glue_dir>/<split>.tsv`; otherwise
    `datasets.load_dataset(*task.hub, split=...)` with "dev" → "validation" (network). Raises
    `DataError` (one line, `file:line`) for a row with the wrong number of columns, a label outside
    the task's label set, or an STS-B score that is not a number in [0, 5]. Blank lines are
    skipped and counted as `blank_line`.
    """
    if data_dir is None:
        return _load_hub(task, split, max_examples)
    if task.glue_dir is None:
        raise ValueError(f"task {task.name!r} has no GLUE folder")
    path = Path(data_dir) / task.glue_dir / f"{split}.tsv"
    if not path.is_file():
        raise DataError(f"{path}: no such file (task {task.name}, split {split})")
    return _read_tsv(task, path, max_examples)


def _read_tsv(
    task: TaskSpec, path: Path, max_examples: int | None
) -> tuple[list[GlueExample], dict[str, int]]:
    try:
        return _read_tsv_lines(task, path, max_examples)
    except UnicodeDecodeError:
        raw = path.read_bytes()
        bom = len(codecs.BOM_UTF8) if raw.startswith(codecs.BOM_UTF8) else 0
        try:
            raw[bom:].decode("utf-8")
            position = len(raw)
        except UnicodeDecodeError as error:
            position = bom + error.start
        line = raw[:position].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not UTF-8 text (byte {position})") from None


def _read_tsv_lines(
    task: TaskSpec, path: Path, max_examples: int | None
) -> tuple[list[GlueExample], dict[str, int]]:
    layout = _layout(task)
    skips: collections.Counter[str] = collections.Counter()
    examples: list[GlueExample] = []
    # utf-8-sig drops MRPC's byte-order mark; newline="" keeps a stray \r inside a field visible
    # instead of silently turning it into a line break.
    with open(path, encoding="utf-8-sig", newline="") as file:
        lines = enumerate(file, start=1)
        if layout.columns is None:
            header_line = next(lines, None)
            if header_line is None:
                raise DataError(f"{path}:1: empty file, expected a header line")
            columns = tuple(header_line[1].rstrip("\r\n").split("\t"))
        else:
            columns = layout.columns
        index = {name: position for position, name in enumerate(columns)}
        for required in (layout.text_a, layout.text_b):
            if required is not None and required not in index:
                raise DataError(f"{path}:1: header has no {required!r} column (got {list(columns)})")
        label_position = index.get(layout.label)  # None in unlabelled test files
        for line_number, line in lines:
            if max_examples is not None and len(examples) >= max_examples:
                break
            line = line.rstrip("\r\n")
            if not line:
                skips["blank_line"] += 1
                continue
            fields = line.split("\t")
            if len(fields) != len(columns):
                raise DataError(
                    f"{path}:{line_number}: {len(fields)} tab-separated fields, expected {len(columns)}"
                )
            label = None
            if label_position is not None:
                label = _parse_label(task, layout, fields[label_position], f"{path}:{line_number}")
            text_b = fields[index[layout.text_b]] if layout.text_b is not None else None
            examples.append(
                GlueExample(f"{path.stem}-{line_number}", fields[index[layout.text_a]], text_b, label)
            )
    return examples, dict(skips)


def _parse_label(task: TaskSpec, layout: _Layout, raw: str, where: str) -> int | float:
    if task.kind == "regression":
        try:
            score = float(raw)
        except ValueError:
            raise DataError(f"{where}: score {raw!r} is not a number") from None
        if not STSB_MIN_SCORE <= score <= STSB_MAX_SCORE:  # also rejects nan
            raise DataError(f"{where}: score {score} outside [{STSB_MIN_SCORE}, {STSB_MAX_SCORE}]")
        return score
    if raw not in layout.raw_labels:
        raise DataError(f"{where}: label {raw!r} not in {list(layout.raw_labels)}")
    return layout.raw_labels.index(raw)


def _load_hub(
    task: TaskSpec, split: str, max_examples: int | None
) -> tuple[list[GlueExample], dict[str, int]]:
    import datasets  # lazily: it is slow to import and only needed for hub runs

    layout = _layout(task)
    hub_split = _HUB_SPLITS.get(split, split)
    name = f"{task.hub[0]}/{task.hub[1]}:{hub_split}" if task.hub[1] else f"{task.hub[0]}:{hub_split}"
    dataset = load_from_hub(
        lambda: datasets.load_dataset(task.hub[0], task.hub[1], split=hub_split), name, FINETUNE_WAYS_FORWARD
    )
    if max_examples is not None:
        dataset = dataset.select(range(min(max_examples, len(dataset))))
    source = f"{task.hub[0]}/{task.hub[1]}:{hub_split}"
    # The hub's ClassLabel order is not always ours (MNLI), so class ids are remapped by name.
    label_feature = dataset.features.get("label")
    remap: dict[int, int] | None = None
    if task.kind == "classification":
        hub_names = getattr(label_feature, "names", None)
        if hub_names is None:
            raise DataError(f"{source}: 'label' is not a ClassLabel feature")
        unknown = set(hub_names) - set(task.label_names)
        if unknown:
            raise DataError(f"{source}: hub label names {sorted(unknown)} not in {list(task.label_names)}")
        remap = {hub_id: task.label_names.index(name) for hub_id, name in enumerate(hub_names)}
    examples = []
    for row_number, row in enumerate(dataset):
        try:
            text_a = row[layout.hub_text_a]
            text_b = row[layout.hub_text_b] if layout.hub_text_b is not None else None
            raw_label = row["label"]
        except KeyError as error:
            raise DataError(f"{source}: row {row_number} has no column {error.args[0]!r}") from None
        label: int | float | None
        if remap is not None:
            label = None if raw_label < 0 else remap[raw_label]  # -1 marks the unlabelled test split
        else:
            label = None if raw_label is None or raw_label < 0 else float(raw_label)
        guid = f"{hub_split}-{row.get('idx', row_number)}"
        examples.append(GlueExample(guid, text_a, text_b, label))
    return examples, {}


def encode_glue(examples: list[GlueExample], tokenizer: Any, max_length: int) -> dict[str, list]:
    """Tokenize `examples` (pairs as `[CLS] a [SEP] b [SEP]`), truncating the longer side first.

    Returns unpadded lists of equal length: `input_ids`, `token_type_ids`, `attention_mask` (one
    list of ints per example) and `labels` (int, float or None per example). `tokenizer` is a
    fast (Rust) Hugging Face tokenizer.
    """
    text_a = [example.text_a for example in examples]
    has_pairs = any(example.text_b is not None for example in examples)
    text_b = [example.text_b or "" for example in examples] if has_pairs else None
    encoded = tokenizer(
        text_a,
        text_b,
        truncation=True,
        max_length=max_length,
        return_token_type_ids=True,
        return_attention_mask=True,
    )
    return {
        "input_ids": list(encoded["input_ids"]),
        "token_type_ids": list(encoded["token_type_ids"]),
        "attention_mask": list(encoded["attention_mask"]),
        "labels": [example.label for example in examples],
    }
