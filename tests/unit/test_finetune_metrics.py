"""GLUE, SQuAD v1.1 and SQuAD v2.0 metrics against hand-computed values."""

from __future__ import annotations

import json
import math
import os

import pytest

from finetune.metrics import (
    exact_match_score,
    f1_score_tokens,
    glue_metrics,
    normalize_answer,
    squad_v1_metrics,
    squad_v2_f1,
    squad_v2_metrics,
    write_squad_predictions,
)
from finetune.tasks import SquadExample

# labels [1,1,0,0], predictions [1,1,1,0]: TP 2, FP 1, TN 1, FN 0
LABELS, PREDICTIONS = [1, 1, 0, 0], [1, 1, 1, 0]


def test_cola_matthews():
    # (TP·TN − FP·FN) / sqrt((TP+FP)(TP+FN)(TN+FP)(TN+FN)) = 2 / sqrt(3·2·2·1)
    result = glue_metrics("cola", PREDICTIONS, LABELS)
    assert result == {"matthews_correlation": pytest.approx(2 / math.sqrt(12))}


@pytest.mark.parametrize("task_name", ["mrpc", "qqp"])
def test_f1_and_accuracy(task_name):
    # precision 2/3, recall 1 → F1 0.8; 3 of 4 right
    assert glue_metrics(task_name, PREDICTIONS, LABELS) == {"accuracy": 0.75, "f1": pytest.approx(0.8)}


@pytest.mark.parametrize("task_name", ["sst2", "mnli", "mnli_mismatched", "qnli", "rte", "wnli"])
def test_accuracy_only(task_name):
    assert glue_metrics(task_name, [0, 2, 1, 1, 0], [0, 2, 2, 1, 1]) == {"accuracy": pytest.approx(0.6)}


def test_stsb_pearson_spearman():
    # x − x̄ = (−1.5, −.5, .5, 1.5), y − ȳ = (−1.75, −.75, .25, 2.25): r = 6.5 / sqrt(5 · 8.75); ranks agree
    result = glue_metrics("stsb", [1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 5.0])
    assert result == {"pearson": pytest.approx(6.5 / math.sqrt(43.75)), "spearman": pytest.approx(1.0)}


def test_glue_metrics_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="equal"):
        glue_metrics("sst2", [1, 0], [1])


@pytest.mark.parametrize(
    ("text", "normalized"),
    [
        ("The  Quick, brown fox!", "quick brown fox"),
        ("an apple", "apple"),
        ("A theater", "theater"),  # "the" inside a word stays
        ("U.S.", "us"),
        ("1,000 (approx.)", "1000 approx"),
        ("the-the", "thethe"),  # punctuation goes before articles, as in the official order
        ("\tAn\nanswer ", "answer"),
    ],
)
def test_normalize_answer(text, normalized):
    assert normalize_answer(text) == normalized


def test_exact_match_and_f1_by_hand():
    assert exact_match_score("The Denver Broncos!", "denver broncos") == 1.0
    # "cat sat" vs "cat sat on mat": precision 1, recall 1/2
    assert f1_score_tokens("the cat sat", "a cat sat on the mat") == pytest.approx(2 / 3)
    # overlap counts tokens with multiplicity: common {x, y} of 3 and 3 tokens
    assert f1_score_tokens("x x y", "x y y") == pytest.approx(2 / 3)
    assert f1_score_tokens("", "") == 0.0 and exact_match_score("", "the") == 1.0


def test_squad_metrics_max_over_answers_and_missing_predictions():
    examples = [
        SquadExample(
            "q1",
            "?",
            "ctx",
            [{"text": "Paris", "answer_start": 0}, {"text": "the city of Paris", "answer_start": 0}],
        ),
        SquadExample("q2", "?", "ctx", [{"text": "1990", "answer_start": 0}]),
        SquadExample("q3", "?", "ctx", [{"text": "blue whale", "answer_start": 0}]),
    ]
    predictions = {"q1": "city of paris.", "q3": "whale", "unknown": "ignored"}
    # q1: EM 1 (second answer), F1 1; q2 missing: 0; q3: EM 0, F1 2·(1·½)/(1+½) = 2/3
    result = squad_v1_metrics(predictions, examples)
    assert result == {"exact_match": pytest.approx(100 / 3), "f1": pytest.approx(100 * (1 + 2 / 3) / 3)}


def test_write_squad_predictions_is_official_format(tmp_path):
    predictions = {"56be4db0acb8001400a502ec": "Denver Broncos", "q2": "café"}
    path = write_squad_predictions(tmp_path / "out" / "predictions.json", predictions)
    assert json.loads(path.read_text(encoding="utf-8")) == predictions
    assert [entry.name for entry in path.parent.iterdir()] == ["predictions.json"]  # no temp file left
    umask = os.umask(0o022)
    try:  # the mode a plain open() gives, not mkstemp's 0600
        assert write_squad_predictions(path, predictions).stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(umask)


def test_squad_v2_f1_scores_empty_answers():
    assert squad_v2_f1("", "") == 1.0 and f1_score_tokens("", "") == 0.0  # v2.0 differs from v1.1 here
    assert squad_v2_f1("The.", "") == 1.0  # normalizes to nothing: a "no answer"
    assert squad_v2_f1("", "Paris") == 0.0 and squad_v2_f1("Paris", "") == 0.0
    assert squad_v2_f1("the cat sat", "a cat sat on the mat") == pytest.approx(2 / 3)


def _answers(*texts: str) -> list[dict]:
    return [{"text": text, "answer_start": 0} for text in texts]


V2_EXAMPLES = [
    SquadExample("q1", "?", "ctx", _answers("Paris", "the city of Paris")),
    SquadExample("q2", "?", "ctx", _answers("blue whale")),
    SquadExample("q3", "?", "ctx", []),
    SquadExample("q4", "?", "ctx", []),
    SquadExample("q5", "?", "ctx", _answers("The", "1990")),  # "The" normalizes to "": not a gold answer
    SquadExample("q6", "?", "ctx", _answers("x")),
]
# q1 EM 1 F1 1; q2 "whale": EM 0, F1 2/3; q3 "" right: 1, 1; q4 answered: 0, 0; q5 "" against "1990"
# (not against "The"): 0, 0; q6 missing: scored as "": 0, 0
V2_PREDICTIONS = {"q1": "city of paris.", "q2": "whale", "q3": "", "q4": "somewhere", "q5": "", "x": "?"}


def test_squad_v2_metrics_by_hand():
    result = squad_v2_metrics(V2_PREDICTIONS, V2_EXAMPLES)
    assert result == {
        "exact": pytest.approx(100 * 2 / 6),
        "f1": pytest.approx(100 * (1 + 2 / 3 + 1) / 6),
        "total": 6.0,
        "HasAns_exact": pytest.approx(100 * 1 / 4),
        "HasAns_f1": pytest.approx(100 * (1 + 2 / 3) / 4),
        "HasAns_total": 4.0,
        "NoAns_exact": 50.0,
        "NoAns_f1": 50.0,
        "NoAns_total": 2.0,
    }


def test_squad_v2_best_thresholds_by_hand():
    """Start with "no answer" everywhere (q3, q4 right: 2), then give questions their predictions in
    increasing null-score-difference order: q1 (−3) +1 → 3, q2 (−1) +0 or +2/3, q5 (0.5) +0,
    q4 (1) −1, q3 (2) 0, q6 (4) 0. Best EM 3/6 at −3, best F1 (3 + 2/3)/6 at −1."""
    diffs = {"q1": -3.0, "q2": -1.0, "q3": 2.0, "q4": 1.0, "q5": 0.5, "q6": 4.0}
    result = squad_v2_metrics(V2_PREDICTIONS, V2_EXAMPLES, diffs)
    assert result["best_exact"] == pytest.approx(50.0) and result["best_exact_thresh"] == -3.0
    assert result["best_f1"] == pytest.approx(100 * (3 + 2 / 3) / 6) and result["best_f1_thresh"] == -1.0
    # never better than answering nothing: threshold 0.0, as in the official script
    nothing = squad_v2_metrics({"q3": "x", "q4": "y"}, V2_EXAMPLES[2:4], {"q3": 1.0, "q4": 2.0})
    assert nothing["best_exact"] == 100.0 and nothing["best_exact_thresh"] == 0.0
    assert nothing["exact"] == 0.0


def test_squad_v2_groups_only_when_present():
    answerable_only = squad_v2_metrics({"q1": "Paris"}, V2_EXAMPLES[:1])
    assert answerable_only == {
        "exact": 100.0,
        "f1": 100.0,
        "total": 1.0,
        "HasAns_exact": 100.0,
        "HasAns_f1": 100.0,
        "HasAns_total": 1.0,
    }
    with pytest.raises(ValueError, match="no examples"):
        squad_v2_metrics({}, [])
