"""SQuAD v1.1 and v2.0: examples from the official JSON (local, optionally gzipped) or the hub,
feature creation with a document stride, and n-best span post-processing (v2.0: against the null
answer at [CLS])."""

from __future__ import annotations

import collections
import gzip
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from data.documents import DataError
from data.hub_access import load_from_hub
from finetune.tasks.spec import FINETUNE_WAYS_FORWARD, TaskSpec

_HUB_SPLITS = {"train": "train", "dev": "validation"}


@dataclass(frozen=True)
class SquadExample:
    """One question. `answers` are `{"text": str, "answer_start": int}` (character offset into
    `context`); training uses the first, evaluation takes the best over all. Empty for an
    unanswerable (SQuAD v2.0) question."""

    qid: str
    question: str
    context: str
    answers: list[dict[str, Any]] = field(hash=False)
    title: str = ""


def squad_file(data_dir: str | Path, split: str, version: str = "1.1") -> Path:
    """`<data_dir>/<split>-v<version>.json`, or the `.json.gz` beside it when only that exists."""
    plain = Path(data_dir) / f"{split}-v{version}.json"
    gzipped = plain.with_name(plain.name + ".gz")
    if plain.is_file() or not gzipped.is_file():
        return plain
    return gzipped


def load_examples(
    task: TaskSpec, split: str, *, data_dir: str | Path | None, max_examples: int | None = None
) -> tuple[list[SquadExample], dict[str, int]]:
    """The first `max_examples` (all if None) questions of `split` ("train" or "dev") and skips.

    With `data_dir`, reads `squad_file(data_dir, split, task.squad_version)`; otherwise
    `datasets.load_dataset(*task.hub)` ("dev" → "validation"). Malformed JSON or a missing key raises
    `DataError` naming the file and the line or key path. An answer whose text is not at
    `answer_start` in its context is skipped (counted as `answer_not_in_context`) when
    `split == "train"`, where it would teach a wrong span, and kept otherwise, because evaluation
    compares text only. A question without answers (`is_impossible` in v2.0 files) is kept with
    `answers == []` for v2.0 and, in a v1.1 train split, skipped as `no_answer`.
    """
    if data_dir is None:
        records = _hub_records(task, split)
    else:
        path = squad_file(data_dir, split, task.squad_version or "1.1")
        records = _json_records(path)
    training = split == "train"
    skips: collections.Counter[str] = collections.Counter()
    examples: list[SquadExample] = []
    for record in records:
        if max_examples is not None and len(examples) >= max_examples:
            break
        answers, context = record["answers"], record["context"]
        if training and not answers and not task.has_unanswerable:
            skips["no_answer"] += 1
            continue
        if training and answers and not _answer_in_context(answers[0], context):
            skips["answer_not_in_context"] += 1
            continue
        examples.append(SquadExample(record["id"], record["question"], context, answers, record["title"]))
    return examples, dict(skips)


def _answer_in_context(answer: dict[str, Any], context: str) -> bool:
    start = answer["answer_start"]
    return context[start : start + len(answer["text"])] == answer["text"]


def _json_records(path: Path):
    """Yields `{"id", "title", "context", "question", "answers"}` per question."""
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as file:
            document = json.load(file)
    except json.JSONDecodeError as error:
        raise DataError(
            f"{path}:{error.lineno}: malformed JSON ({error.msg}, column {error.colno})"
        ) from None
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"{path}: unreadable ({error})") from None

    def need(mapping: Any, key: str, where: str, kind: type) -> Any:
        if not isinstance(mapping, dict) or key not in mapping:
            raise DataError(f"{path}: missing key {where}.{key}")
        value = mapping[key]
        if not isinstance(value, kind):
            raise DataError(f"{path}: {where}.{key} is {type(value).__name__}, expected {kind.__name__}")
        return value

    for article_index, article in enumerate(need(document, "data", "$", list)):
        article_path = f"$.data[{article_index}]"
        title = article.get("title", "") if isinstance(article, dict) else ""
        for paragraph_index, paragraph in enumerate(need(article, "paragraphs", article_path, list)):
            paragraph_path = f"{article_path}.paragraphs[{paragraph_index}]"
            context = need(paragraph, "context", paragraph_path, str)
            for question_index, question in enumerate(need(paragraph, "qas", paragraph_path, list)):
                question_path = f"{paragraph_path}.qas[{question_index}]"
                answers = []
                # v2.0: an unanswerable question has `is_impossible: true` and no answers (its
                # `plausible_answers` are distractors, never gold)
                if isinstance(question, dict) and "is_impossible" in question:
                    impossible = need(question, "is_impossible", question_path, bool)
                else:
                    impossible = False
                for answer_index, answer in enumerate(need(question, "answers", question_path, list)):
                    answer_path = f"{question_path}.answers[{answer_index}]"
                    answers.append(
                        {
                            "text": need(answer, "text", answer_path, str),
                            "answer_start": need(answer, "answer_start", answer_path, int),
                        }
                    )
                if impossible and answers:
                    raise DataError(f"{path}: {question_path} has is_impossible=true and answers")
                yield {
                    "id": need(question, "id", question_path, str),
                    "title": title,
                    "context": context,
                    "question": need(question, "question", question_path, str),
                    "answers": answers,
                }


def _hub_records(task: TaskSpec, split: str):
    import datasets  # lazily: slow to import, needed only for hub runs

    hub_split = _HUB_SPLITS.get(split, split)
    name = f"{task.hub[0]}/{task.hub[1]}:{hub_split}" if task.hub[1] else f"{task.hub[0]}:{hub_split}"
    dataset = load_from_hub(
        lambda: datasets.load_dataset(task.hub[0], task.hub[1], split=hub_split), name, FINETUNE_WAYS_FORWARD
    )
    for row_number, row in enumerate(dataset):
        try:
            answers = [
                {"text": text, "answer_start": int(start)}
                for text, start in zip(row["answers"]["text"], row["answers"]["answer_start"], strict=True)
            ]
            record = {key: row[key] for key in ("id", "context", "question")}
        except (KeyError, TypeError, ValueError) as error:
            raise DataError(f"{task.hub[0]}:{hub_split}: row {row_number} malformed ({error})") from None
        yield {**record, "title": row.get("title", ""), "answers": answers}


def prepare_squad_features(
    examples: list[SquadExample],
    tokenizer: Any,
    *,
    max_length: int = 384,
    doc_stride: int = 128,
    train: bool,
    pad_to_max_length: bool = True,
) -> dict[str, list]:
    """Split each `[CLS] question [SEP] context [SEP]` into windows of `max_length` tokens whose
    contexts overlap by `doc_stride` tokens (only the context is truncated; questions are
    left-stripped, as some start with spaces). `tokenizer` must be a fast tokenizer (offsets).

    Returns one entry per window (feature) in each list: `input_ids`, `token_type_ids`,
    `attention_mask` (padded to `max_length` unless `pad_to_max_length=False`), and
      - train: `start_positions`, `end_positions` — token indices of the first answer, both 0
        (the [CLS] index) when the answer is not wholly inside the window;
      - eval: `example_id` (the question's qid) and `offset_mapping` — per token a
        `(start_char, end_char)` into the context, or None for question, special and pad tokens.
    Windows and tokenization are identical for `train=True` and `False` on the same examples.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("prepare_squad_features needs a fast tokenizer (for offset mapping)")
    if tokenizer.padding_side != "right":
        raise ValueError("prepare_squad_features assumes right padding (context as the second sequence)")
    encoded = tokenizer(
        [example.question.lstrip() for example in examples],
        [example.context for example in examples],
        truncation="only_second",
        max_length=max_length,
        stride=doc_stride,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
        return_token_type_ids=True,
        padding="max_length" if pad_to_max_length else False,
    )
    example_of_feature = encoded["overflow_to_sample_mapping"]
    features: dict[str, list] = {
        "input_ids": list(encoded["input_ids"]),
        "token_type_ids": list(encoded["token_type_ids"]),
        "attention_mask": list(encoded["attention_mask"]),
    }
    if train:
        features["start_positions"], features["end_positions"] = [], []
    else:
        features["example_id"], features["offset_mapping"] = [], []
    for feature_index, example_index in enumerate(example_of_feature):
        example = examples[example_index]
        sequence_ids = encoded.sequence_ids(feature_index)
        offsets = encoded["offset_mapping"][feature_index]
        if not train:
            features["example_id"].append(example.qid)
            features["offset_mapping"].append(
                [tuple(offset) if sequence_ids[i] == 1 else None for i, offset in enumerate(offsets)]
            )
            continue
        start, end = _answer_token_span(example, sequence_ids, offsets)
        features["start_positions"].append(start)
        features["end_positions"].append(end)
    return features


def _answer_token_span(example: SquadExample, sequence_ids: list, offsets: list) -> tuple[int, int]:
    """Token indices of the first answer in this window, or (0, 0) (the [CLS] token) if the answer
    is missing or not wholly inside it."""
    if not example.answers:
        return 0, 0
    start_char = example.answers[0]["answer_start"]
    end_char = start_char + len(example.answers[0]["text"])
    context_tokens = [i for i, sequence_id in enumerate(sequence_ids) if sequence_id == 1]
    if not context_tokens:  # a question that fills the whole window
        return 0, 0
    first, last = context_tokens[0], context_tokens[-1]
    if offsets[first][0] > start_char or offsets[last][1] < end_char:
        return 0, 0
    start_token = first
    while start_token <= last and offsets[start_token][0] <= start_char:
        start_token += 1
    end_token = last
    while end_token >= first and offsets[end_token][1] >= end_char:
        end_token -= 1
    return start_token - 1, end_token + 1


def postprocess_squad(
    examples: list[SquadExample],
    features: dict[str, list],
    start_logits: Any,
    end_logits: Any,
    *,
    n_best: int = 20,
    max_answer_length: int = 30,
) -> dict[str, str]:
    """The best answer text per question id from per-feature logits (BERT's n-best search).

    `features` are the eval features of `examples` (`example_id`, `offset_mapping`);
    `start_logits`/`end_logits` are `[num_features, sequence_length]` (arrays or nested lists).
    For each feature the `n_best` highest start and end logits are paired; a pair counts if both
    tokens are context tokens, end ≥ start and the span is at most `max_answer_length` tokens.
    The highest start+end logit over all windows of a question wins; its text is the context
    slice between the tokens' character offsets. A question with no valid span gets "".
    """
    best, _ = _search_spans(examples, features, start_logits, end_logits, n_best, max_answer_length)
    return {example.qid: best[example.qid][1] if example.qid in best else "" for example in examples}


def postprocess_squad_v2(
    examples: list[SquadExample],
    features: dict[str, list],
    start_logits: Any,
    end_logits: Any,
    *,
    n_best: int = 20,
    max_answer_length: int = 30,
    null_score_diff_threshold: float = 0.0,
) -> tuple[dict[str, str], dict[str, float]]:
    """SQuAD v2.0 answers: the best span (as `postprocess_squad`) or "" for no answer.

    The null score of a question is the smallest [CLS] start+end logit (token 0) over its windows
    (google-research/bert run_squad.py). The question gets "" when null score − best span score >
    `null_score_diff_threshold`, or when no window has a valid span.

    -> (`{qid: answer text or ""}`, `{qid: null score − best span score}`); the second is the
    official evaluation script's `--na-prob-file` (higher = more likely unanswerable; +inf without
    a valid span), from which it derives `best_exact`/`best_f1` and their thresholds.
    """
    best, null_scores = _search_spans(examples, features, start_logits, end_logits, n_best, max_answer_length)
    predictions: dict[str, str] = {}
    null_score_diffs: dict[str, float] = {}
    for example in examples:
        qid = example.qid
        if qid not in best:
            predictions[qid], null_score_diffs[qid] = "", math.inf
            continue
        score, text = best[qid]
        null_score_diffs[qid] = null_scores[qid] - score
        predictions[qid] = "" if null_score_diffs[qid] > null_score_diff_threshold else text
    return predictions, null_score_diffs


def _search_spans(
    examples: list[SquadExample],
    features: dict[str, list],
    start_logits: Any,
    end_logits: Any,
    n_best: int,
    max_answer_length: int,
) -> tuple[dict[str, tuple[float, str]], dict[str, float]]:
    """-> ({qid: (best span score, its text)} for questions with a valid span, {qid: the smallest
    [CLS] start+end logit over the question's windows})."""
    start_logits = np.asarray(start_logits, dtype=np.float64)
    end_logits = np.asarray(end_logits, dtype=np.float64)
    num_features = len(features["example_id"])
    if start_logits.shape[0] != num_features or end_logits.shape != start_logits.shape:
        raise ValueError(
            f"logits {start_logits.shape}/{end_logits.shape} do not match {num_features} features"
        )
    best: dict[str, tuple[float, str]] = {}
    null_scores: dict[str, float] = {}
    context_of = {example.qid: example.context for example in examples}
    for feature_index in range(num_features):
        qid = features["example_id"][feature_index]
        offsets = features["offset_mapping"][feature_index]
        feature_start, feature_end = start_logits[feature_index], end_logits[feature_index]
        # [CLS] is token 0: the tokenizer puts it first and pads on the right
        null_score = float(feature_start[0] + feature_end[0])
        null_scores[qid] = min(null_score, null_scores.get(qid, math.inf))
        num_tokens = min(len(offsets), feature_start.shape[0])
        # argsort is stable on the negated logits, so ties go to the earlier token
        start_candidates = np.argsort(-feature_start[:num_tokens], kind="stable")[:n_best]
        end_candidates = np.argsort(-feature_end[:num_tokens], kind="stable")[:n_best]
        for start_index in start_candidates:
            if offsets[start_index] is None:
                continue
            for end_index in end_candidates:
                if offsets[end_index] is None or end_index < start_index:
                    continue
                if end_index - start_index + 1 > max_answer_length:
                    continue
                score = float(feature_start[start_index] + feature_end[end_index])
                if qid not in best or score > best[qid][0]:
                    text = context_of[qid][offsets[start_index][0] : offsets[end_index][1]]
                    best[qid] = (score, text)
    return best, null_scores
