"""Evaluation metrics: GLUE (scikit-learn / scipy) and SQuAD v1.1 (the official definition)."""

from __future__ import annotations

import collections
import json
import os
import re
import string
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np


def glue_metrics(task_name: str, predictions: Sequence, labels: Sequence) -> dict[str, float]:
    """GLUE metrics of `predictions` against `labels` (class ids, or floats for STS-B).

    cola: `matthews_correlation`; stsb: `pearson`, `spearman`; mrpc, qqp: `accuracy`, `f1` (of
    class 1); every other task (mnli, mnli_matched, mnli_mismatched, qnli, rte, sst2, wnli):
    `accuracy`. Values are fractions in [0, 1] (correlations in [-1, 1]), as Python floats.
    """
    from scipy.stats import pearsonr, spearmanr  # lazily: slow imports, not needed for SQuAD
    from sklearn.metrics import f1_score, matthews_corrcoef

    predicted, gold = np.asarray(predictions), np.asarray(labels)
    if predicted.shape != gold.shape or predicted.ndim != 1 or len(gold) == 0:
        raise ValueError(f"predictions {predicted.shape} and labels {gold.shape}: need equal, non-empty 1-D")
    if task_name == "stsb":
        return {
            "pearson": float(pearsonr(predicted, gold)[0]),
            "spearman": float(spearmanr(predicted, gold)[0]),
        }
    if task_name == "cola":
        return {"matthews_correlation": float(matthews_corrcoef(gold, predicted))}
    accuracy = float(np.mean(predicted == gold))
    if task_name in ("mrpc", "qqp"):
        return {
            "accuracy": accuracy,
            "f1": float(f1_score(gold, predicted, pos_label=1, zero_division=0)),
        }
    return {"accuracy": accuracy}


def normalize_answer(text: str) -> str:
    """SQuAD v1.1 answer normalization: lower case, drop `string.punctuation`, drop the articles
    a/an/the as whole words, collapse whitespace (in this order, as the official script)."""
    text = text.lower()
    punctuation = set(string.punctuation)
    text = "".join(character for character in text if character not in punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match_score(prediction: str, ground_truth: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(ground_truth))


def f1_score_tokens(prediction: str, ground_truth: str) -> float:
    """Token-overlap F1 of normalized answers; 0 when nothing overlaps (even if both are empty,
    as in the official script)."""
    prediction_tokens = normalize_answer(prediction).split()
    ground_truth_tokens = normalize_answer(ground_truth).split()
    common = collections.Counter(prediction_tokens) & collections.Counter(ground_truth_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction_tokens)
    recall = num_same / len(ground_truth_tokens)
    return 2 * precision * recall / (precision + recall)


def squad_v1_metrics(predictions: Mapping[str, str], examples: Iterable[Any]) -> dict[str, float]:
    """`{"exact_match", "f1"}` in percent over all `examples` (objects with `qid` and `answers`,
    each answer a dict with "text"), each question scored by its best gold answer. A question
    missing from `predictions` scores 0; predictions for unknown ids are ignored."""
    total = exact_match = f1 = 0.0
    for example in examples:
        total += 1
        if example.qid not in predictions:
            continue
        prediction = predictions[example.qid]
        ground_truths = [answer["text"] for answer in example.answers]
        exact_match += max(exact_match_score(prediction, truth) for truth in ground_truths)
        f1 += max(f1_score_tokens(prediction, truth) for truth in ground_truths)
    if total == 0:
        raise ValueError("squad_v1_metrics: no examples")
    return {"exact_match": 100.0 * exact_match / total, "f1": 100.0 * f1 / total}


def write_squad_predictions(path: str | Path, predictions: Mapping[str, str]) -> Path:
    """Write `{qid: answer_text}` as JSON (the official `predictions.json` format) atomically: a
    temporary file in the same folder, then a rename, so a reader never sees a partial file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            json.dump(dict(predictions), file, ensure_ascii=False, indent=1)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path
