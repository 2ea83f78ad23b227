"""SQuAD v1.1: loading (real dev, bad input, hub schema), feature round trip, post-processing.

SQuAD train is not in the shared data, so "train" features are built from dev questions here.
"""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from data.documents import DataError
from finetune.metrics import normalize_answer, squad_v1_metrics
from finetune.tasks import TASKS, SquadExample, load_examples, postprocess_squad, prepare_squad_features

SQUAD = TASKS["squad"]


@pytest.fixture(scope="module")
def tokenizer(shared_data):
    from data.tokenizer import load_vocab_file, make_tokenizer

    return make_tokenizer(load_vocab_file(shared_data / "vocab" / "bert-base-uncased-vocab.txt"), lowercase=True)


@pytest.fixture(scope="module")
def dev_examples(shared_data):
    examples, skips = load_examples(SQUAD, "dev", data_dir=str(shared_data / "squad"))
    assert skips == {}
    return examples


@pytest.fixture(scope="module")
def dev_features(dev_examples, tokenizer):
    """Train and eval features of the whole dev set: the windows are the same in both modes."""
    train = prepare_squad_features(dev_examples, tokenizer, train=True, pad_to_max_length=False)
    evaluation = prepare_squad_features(dev_examples, tokenizer, train=False, pad_to_max_length=False)
    return train, evaluation


def test_real_dev_counts(dev_examples):
    assert len(dev_examples) == 10570
    assert sum(len(example.answers) for example in dev_examples) == 34726
    assert len({example.qid for example in dev_examples}) == 10570
    assert dev_examples[0].title == "Super_Bowl_50"


def test_gold_answers_as_predictions_score_100(dev_examples):
    predictions = {example.qid: example.answers[0]["text"] for example in dev_examples}
    assert squad_v1_metrics(predictions, dev_examples) == {"exact_match": 100.0, "f1": 100.0}


def test_feature_round_trip_on_dev(dev_examples, dev_features):
    """Every labelled span decodes (through the context offsets) to the gold answer, normalized;
    questions whose answer fits in no window are the only ones labelled [CLS] everywhere."""
    train, evaluation = dev_features
    assert train["input_ids"] == evaluation["input_ids"]
    example_by_id = {example.qid: example for example in dev_examples}
    found, num_labelled = set(), 0
    for index, qid in enumerate(evaluation["example_id"]):
        start, end = train["start_positions"][index], train["end_positions"][index]
        assert len(train["input_ids"][index]) <= 384
        if start == 0:
            assert end == 0
            continue
        example, offsets = example_by_id[qid], evaluation["offset_mapping"][index]
        span = example.context[offsets[start][0] : offsets[end][1]]
        assert normalize_answer(span) == normalize_answer(example.answers[0]["text"]), qid
        found.add(qid)
        num_labelled += 1
    num_truncated = len(example_by_id) - len(found)
    # answers cut by the window are rare at 384/128 (some contexts are longer than 384 tokens)
    assert num_truncated < 10, num_truncated
    assert num_labelled >= len(found) and len(evaluation["example_id"]) > len(dev_examples)


def test_postprocess_recovers_gold_spans_from_one_hot_logits(dev_examples, dev_features):
    train, evaluation = dev_features
    length = max(len(ids) for ids in evaluation["input_ids"])
    num_features = len(evaluation["input_ids"])
    start_logits, end_logits = np.full((num_features, length), -5.0), np.full((num_features, length), -5.0)
    rows = np.arange(num_features)
    start_logits[rows, train["start_positions"]] = 10.0
    end_logits[rows, train["end_positions"]] = 10.0
    predictions = postprocess_squad(dev_examples, evaluation, start_logits, end_logits)
    assert set(predictions) == {example.qid for example in dev_examples}
    labelled = {qid for qid, start in zip(evaluation["example_id"], train["start_positions"]) if start}
    scored = [example for example in dev_examples if example.qid in labelled]
    assert squad_v1_metrics(predictions, scored) == {"exact_match": 100.0, "f1": 100.0}


def test_postprocess_respects_max_length_and_context_tokens(tokenizer):
    example = SquadExample("q", "Who?", "Alice met Bob in Paris yesterday", [{"text": "Bob", "answer_start": 10}])
    features = prepare_squad_features([example], tokenizer, max_length=32, doc_stride=8, train=False)
    offsets = features["offset_mapping"][0]
    context_positions = [index for index, offset in enumerate(offsets) if offset is not None]
    first = context_positions[0]  # "alice"
    start_logits = np.zeros((1, 32))
    end_logits = np.zeros((1, 32))
    start_logits[0, 0] = end_logits[0, 0] = 100.0  # [CLS] is not a context token
    start_logits[0, first] = 5.0
    end_logits[0, first + 4] = 9.0  # "alice … paris": 5 tokens
    end_logits[0, first + 2] = 4.0  # "alice met bob": 3 tokens
    predictions = postprocess_squad([example], features, start_logits, end_logits, max_answer_length=3)
    assert predictions == {"q": "Alice met Bob"}
    predictions = postprocess_squad([example], features, start_logits, end_logits, max_answer_length=30)
    assert predictions == {"q": "Alice met Bob in Paris"}


def test_long_context_gets_several_windows_with_cls_label(tokenizer):
    context = " ".join(f"word{index}" for index in range(200)) + " target end."
    example = SquadExample("q", "Where?", context, [{"text": "target", "answer_start": context.index("target")}])
    features = prepare_squad_features([example], tokenizer, max_length=64, doc_stride=16, train=True)
    assert len(features["input_ids"]) > 2 and all(len(ids) == 64 for ids in features["input_ids"])
    starts = features["start_positions"]
    assert starts[:-1] == [0] * (len(starts) - 1) and starts[-1] > 0  # only the last window holds it
    last = features["input_ids"][-1]
    assert tokenizer.decode(last[starts[-1] : features["end_positions"][-1] + 1]) == "target"


def _squad_json(answer_start: int = 0) -> dict:
    return {
        "version": "1.1",
        "data": [
            {
                "title": "T",
                "paragraphs": [
                    {
                        "context": "Paris is big.",
                        "qas": [
                            {"id": "a", "question": "What?", "answers": [{"text": "Paris", "answer_start": answer_start}]},
                            {"id": "b", "question": "Size?", "answers": [{"text": "big", "answer_start": 9}]},
                        ],
                    }
                ],
            }
        ],
    }  # fmt: skip


def test_plain_json_and_answer_not_in_context(tmp_path):
    (tmp_path / "train-v1.1.json").write_text(json.dumps(_squad_json(answer_start=3)), encoding="utf-8")
    with gzip.open(tmp_path / "dev-v1.1.json.gz", "wt", encoding="utf-8") as file:
        json.dump(_squad_json(answer_start=3), file)
    train, train_skips = load_examples(SQUAD, "train", data_dir=str(tmp_path))
    assert [example.qid for example in train] == ["b"] and train_skips == {"answer_not_in_context": 1}
    dev, dev_skips = load_examples(SQUAD, "dev", data_dir=str(tmp_path))
    assert [example.qid for example in dev] == ["a", "b"] and dev_skips == {}


def test_malformed_json_names_file_and_line(tmp_path):
    (tmp_path / "dev-v1.1.json").write_text('{"data": [\n{"title": "x",\n "paragraphs": [}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"dev-v1\.1\.json:3: malformed JSON") as raised:
        load_examples(SQUAD, "dev", data_dir=str(tmp_path))
    assert "\n" not in str(raised.value)


def test_missing_key_names_key_path(tmp_path):
    document = _squad_json()
    del document["data"][0]["paragraphs"][0]["qas"][1]["id"]
    (tmp_path / "dev-v1.1.json").write_text(json.dumps(document), encoding="utf-8")
    with pytest.raises(DataError, match=r"missing key \$\.data\[0\]\.paragraphs\[0\]\.qas\[1\]\.id"):
        load_examples(SQUAD, "dev", data_dir=str(tmp_path))


def test_hub_schema(monkeypatch):
    import datasets

    rows = {
        "id": ["a", "b"],
        "title": ["T", "T"],
        "context": ["Paris is big.", "Paris is big."],
        "question": ["What?", "Size?"],
        "answers": [{"text": ["Paris", "Paris"], "answer_start": [0, 0]}, {"text": ["big"], "answer_start": [9]}],
    }
    calls = []

    def load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split))
        return datasets.Dataset.from_dict(rows)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    examples, skips = load_examples(SQUAD, "dev", data_dir=None, max_examples=5)
    assert calls == [("rajpurkar/squad", None, "validation")]
    assert examples[0] == SquadExample(
        "a", "What?", "Paris is big.", [{"text": "Paris", "answer_start": 0}] * 2, "T"
    )
    assert examples[1].answers == [{"text": "big", "answer_start": 9}] and skips == {}
