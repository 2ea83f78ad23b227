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

    return make_tokenizer(
        load_vocab_file(shared_data / "vocab" / "bert-base-uncased-vocab.txt"), lowercase=True
    )


@pytest.fixture(scope="module")
def dev_examples(shared_data):
    examples, skips = load_examples(SQUAD, "dev", data_dir=str(shared_data / "squad"))
    assert skips == {}
    return examples


@pytest.fixture(scope="module")
def round_trip(dev_examples, tokenizer):
    """Train and eval features of every dev question (first answer; the windows are the same in
    both modes) and the qids whose labelled span is exactly the gold answer (normalized).
    About 10 s on one core: the issue asks for the whole dev set."""
    examples = dev_examples
    train = prepare_squad_features(examples, tokenizer, train=True, pad_to_max_length=False)
    evaluation = prepare_squad_features(examples, tokenizer, train=False, pad_to_max_length=False)
    assert train["input_ids"] == evaluation["input_ids"]
    example_by_id = {example.qid: example for example in examples}
    exact, inside_token, labelled = set(), set(), set()
    for index, qid in enumerate(evaluation["example_id"]):
        start, end = train["start_positions"][index], train["end_positions"][index]
        assert len(train["input_ids"][index]) <= 384
        if start == 0:
            assert end == 0
            continue
        example, offsets = example_by_id[qid], evaluation["offset_mapping"][index]
        answer_start = example.answers[0]["answer_start"]
        answer_end = answer_start + len(example.answers[0]["text"])
        # the labelled tokens always cover the answer's characters...
        assert offsets[start][0] <= answer_start and offsets[end][1] >= answer_end, qid
        labelled.add(qid)
        span = example.context[offsets[start][0] : offsets[end][1]]
        if normalize_answer(span) == normalize_answer(example.answers[0]["text"]):
            exact.add(qid)
        else:
            # ...and are wider only when the answer starts or ends inside a word piece
            # ("8" of "20–18", "gold" of "golden"): then no token span can match it exactly
            assert answer_start > offsets[start][0] or answer_end < offsets[end][1], qid
            inside_token.add(qid)
    return examples, train, evaluation, {"exact": exact, "inside_token": inside_token, "labelled": labelled}


def test_feature_round_trip_on_dev(round_trip):
    """Labelled spans decode (through the context offsets) to the normalized gold answer, except
    answers that begin or end inside a word piece and answers no window holds; both are counted
    and rare."""
    examples, _, evaluation, qids = round_trip
    num_truncated = len(examples) - len(qids["labelled"])
    assert len(evaluation["example_id"]) > len(examples)  # long contexts give several windows
    assert num_truncated <= 5, num_truncated
    assert len(qids["inside_token"]) < 0.01 * len(examples), sorted(qids["inside_token"])
    assert len(qids["exact"] - qids["inside_token"]) >= 0.98 * len(examples)


def test_postprocess_recovers_gold_spans_from_one_hot_logits(round_trip):
    examples, train, evaluation, qids = round_trip
    length = max(len(ids) for ids in evaluation["input_ids"])
    num_features = len(evaluation["input_ids"])
    start_logits, end_logits = np.full((num_features, length), -5.0), np.full((num_features, length), -5.0)
    rows = np.arange(num_features)
    start_logits[rows, train["start_positions"]] = 10.0
    end_logits[rows, train["end_positions"]] = 10.0
    # some gold answers are longer than the default 30 tokens: lift the limit to see them all
    predictions = postprocess_squad(examples, evaluation, start_logits, end_logits, max_answer_length=length)
    assert set(predictions) == {example.qid for example in examples}
    scored = [example for example in examples if example.qid in qids["exact"] - qids["inside_token"]]
    assert squad_v1_metrics(predictions, scored) == {"exact_match": 100.0, "f1": 100.0}


def test_postprocess_respects_max_length_and_context_tokens(tokenizer):
    example = SquadExample(
        "q", "Who?", "Alice met Bob in Paris yesterday", [{"text": "Bob", "answer_start": 10}]
    )
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
    example = SquadExample(
        "q", "Where?", context, [{"text": "target", "answer_start": context.index("target")}]
    )
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
                            {
                                "id": "a",
                                "question": "What?",
                                "answers": [{"text": "Paris", "answer_start": answer_start}],
                            },
                            {"id": "b", "question": "Size?", "answers": [{"text": "big", "answer_start": 9}]},
                        ],
                    }
                ],
            }
        ],
    }


def test_plain_json_and_answer_not_in_context(tmp_path):
    (tmp_path / "train-v1.1.json").write_text(json.dumps(_squad_json(answer_start=3)), encoding="utf-8")
    with gzip.open(tmp_path / "dev-v1.1.json.gz", "wt", encoding="utf-8") as file:
        json.dump(_squad_json(answer_start=3), file)
    train, train_skips = load_examples(SQUAD, "train", data_dir=str(tmp_path))
    assert [example.qid for example in train] == ["b"] and train_skips == {"answer_not_in_context": 1}
    dev, dev_skips = load_examples(SQUAD, "dev", data_dir=str(tmp_path))
    assert [example.qid for example in dev] == ["a", "b"] and dev_skips == {}


def test_malformed_json_names_file_and_line(tmp_path):
    (tmp_path / "dev-v1.1.json").write_text(
        '{"data": [\n{"title": "x",\n "paragraphs": [}\n', encoding="utf-8"
    )
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
        "answers": [
            {"text": ["Paris", "Paris"], "answer_start": [0, 0]},
            {"text": ["big"], "answer_start": [9]},
        ],
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
