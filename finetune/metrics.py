"""Evaluation metrics: GLUE (scikit-learn / scipy) and SQuAD v1.1 and v2.0 (the official definitions)."""

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


def squad_v2_f1(prediction: str, ground_truth: str) -> float:
    """SQuAD v2.0 token F1: as `f1_score_tokens`, except that when either side normalizes to no
    tokens the score is 1 if both do and 0 otherwise (a correct "no answer" scores 1)."""
    prediction_tokens = normalize_answer(prediction).split()
    ground_truth_tokens = normalize_answer(ground_truth).split()
    if not prediction_tokens or not ground_truth_tokens:
        return float(prediction_tokens == ground_truth_tokens)
    return f1_score_tokens(prediction, ground_truth)


def squad_v2_metrics(
    predictions: Mapping[str, str],
    examples: Iterable[Any],
    null_score_diffs: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """The official SQuAD v2.0 evaluation (evaluate-v2.0.py) of `predictions` ({qid: text, "" = no
    answer}) over `examples` (objects with `qid` and `answers`, [] for an unanswerable question).

    Gold answers are those that normalize to something, or [""] when none does; each question
    scores its best gold answer. -> percentages `exact`, `f1` and the count `total`;
    `HasAns_exact`/`HasAns_f1`/`HasAns_total` over the answerable questions and
    `NoAns_exact`/`NoAns_f1`/`NoAns_total` over the unanswerable ones, each group present only if
    it is non-empty (as in the official script). With `null_score_diffs` (the script's na_probs:
    higher = more likely unanswerable) also `best_exact`/`best_f1`: the scores had "" been
    predicted for every question whose value exceeds the best threshold, and those thresholds
    (`best_exact_thresh`, `best_f1_thresh`). A question missing from `predictions` scores as "".
    """
    exact: dict[str, float] = {}
    f1: dict[str, float] = {}
    has_answer: dict[str, bool] = {}
    for example in examples:
        has_answer[example.qid] = bool(example.answers)
        gold = [a["text"] for a in example.answers if normalize_answer(a["text"])] or [""]
        prediction = predictions.get(example.qid, "")
        exact[example.qid] = max(exact_match_score(prediction, truth) for truth in gold)
        f1[example.qid] = max(squad_v2_f1(prediction, truth) for truth in gold)
    if not has_answer:
        raise ValueError("squad_v2_metrics: no examples")

    def percent(scores: Mapping[str, float], qids: list[str]) -> float:
        return 100.0 * sum(scores[qid] for qid in qids) / len(qids)

    every = list(has_answer)
    result = {"exact": percent(exact, every), "f1": percent(f1, every), "total": float(len(every))}
    for prefix, qids in (
        ("HasAns", [qid for qid in every if has_answer[qid]]),
        ("NoAns", [qid for qid in every if not has_answer[qid]]),
    ):
        if qids:
            result[f"{prefix}_exact"] = percent(exact, qids)
            result[f"{prefix}_f1"] = percent(f1, qids)
            result[f"{prefix}_total"] = float(len(qids))
    if null_score_diffs is not None:
        for name, scores in (("exact", exact), ("f1", f1)):
            best, threshold = _best_null_threshold(predictions, scores, null_score_diffs, has_answer)
            result[f"best_{name}"], result[f"best_{name}_thresh"] = best, threshold
    return result


def _best_null_threshold(
    predictions: Mapping[str, str],
    scores: Mapping[str, float],
    null_score_diffs: Mapping[str, float],
    has_answer: Mapping[str, bool],
) -> tuple[float, float]:
    """evaluate-v2.0.py's find_best_thresh: start from "no answer" everywhere (every unanswerable
    question right), then give questions their predictions in increasing `null_score_diffs` order;
    -> (best score in percent, the value at which it was reached; 0.0 if never improved)."""
    score = best_score = float(sum(not answerable for answerable in has_answer.values()))
    best_threshold = 0.0
    for qid in sorted(has_answer, key=lambda qid: null_score_diffs[qid]):
        if has_answer[qid]:
            score += scores[qid]
        elif predictions.get(qid, ""):
            score -= 1.0
        if score > best_score:
            best_score, best_threshold = score, float(null_score_diffs[qid])
    return 100.0 * best_score / len(has_answer), best_threshold


def write_squad_predictions(path: str | Path, predictions: Mapping[str, str | float]) -> Path:
    """Write `{qid: answer_text}` as JSON (the official `predictions.json` format; also v2.0's
    `{qid: null score difference}` na-prob file) atomically: a temporary file in the same folder,
    then a rename, so a reader never sees a partial file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            json.dump(dict(predictions), file, ensure_ascii=False, indent=1)
        umask = os.umask(0)  # mkstemp made it 0600: give it the mode a plain open() gives
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path
