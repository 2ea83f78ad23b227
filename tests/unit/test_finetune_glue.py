"""GLUE loading (real local files, bad rows, hub schema) and encoding."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

from data.documents import DataError
from finetune.tasks import GLUE_TASKS, TASKS, encode_glue, load_examples

# (task, split) → (rows, {class id: count}) from PROVENANCE.md section 4.
REAL_COUNTS = {
    ("cola", "train"): (8551, {1: 6023, 0: 2528}),
    ("cola", "dev"): (1043, {1: 721, 0: 322}),
    ("sst2", "train"): (67349, {1: 37569, 0: 29780}),
    ("sst2", "dev"): (872, {1: 444, 0: 428}),
    ("mrpc", "train"): (3668, {1: 2474, 0: 1194}),
    ("mrpc", "dev"): (408, {1: 279, 0: 129}),
    ("qnli", "dev"): (5463, {0: 2702, 1: 2761}),  # entailment, not_entailment
    ("rte", "train"): (2490, {0: 1249, 1: 1241}),
    ("rte", "dev"): (277, {0: 146, 1: 131}),
    ("stsb", "train"): (5749, None),
    ("stsb", "dev"): (1500, None),
    ("wnli", "train"): (635, {1: 312, 0: 323}),
    ("wnli", "dev"): (71, {1: 31, 0: 40}),
}


@pytest.fixture(scope="module")
def tokenizer(shared_data):
    from data.tokenizer import load_vocab_file, make_tokenizer

    return make_tokenizer(
        load_vocab_file(shared_data / "vocab" / "bert-base-uncased-vocab.txt"), lowercase=True
    )


def test_registry_is_consistent():
    glue = {"cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte", "wnli"}
    assert set(TASKS) == glue | {"squad", "squad_v2"}
    assert set(GLUE_TASKS) == glue
    for name, spec in TASKS.items():
        assert spec.name == name
    assert TASKS["mnli"].eval_splits == ("dev_matched", "dev_mismatched")
    assert TASKS["stsb"].kind == "regression" and TASKS["stsb"].num_labels == 1
    assert TASKS["squad"].kind == "span" and TASKS["squad"].glue_dir is None
    assert not TASKS["squad"].has_unanswerable and TASKS["squad_v2"].has_unanswerable
    assert TASKS["squad_v2"].kind == "span" and TASKS["squad_v2"].hub == ("rajpurkar/squad_v2", None)


@pytest.mark.parametrize(("task_name", "split"), sorted(REAL_COUNTS))
def test_real_glue_file_counts(shared_data, task_name, split):
    num_rows, label_counts = REAL_COUNTS[(task_name, split)]
    examples, skips = load_examples(TASKS[task_name], split, data_dir=str(shared_data / "glue_data"))
    assert len(examples) == num_rows
    assert skips == {}
    if label_counts is not None:
        assert dict(collections.Counter(example.label for example in examples)) == label_counts
    else:
        assert all(0.0 <= example.label <= 5.0 for example in examples)
    single_sentence = task_name in ("cola", "sst2")
    assert all((example.text_b is None) == single_sentence for example in examples)


def test_mnli_samples_map_gold_labels_in_processor_order(shared_data):
    task, data_dir = TASKS["mnli"], str(shared_data / "glue_samples")
    train, _ = load_examples(task, "train", data_dir=data_dir)
    matched, _ = load_examples(task, "dev_matched", data_dir=data_dir)
    mismatched, _ = load_examples(task, "dev_mismatched", data_dir=data_dir)
    assert (len(train), len(matched), len(mismatched)) == (15, 10, 10)
    # neutral 3, contradiction 6, entailment 1 with ids contradiction 0, entailment 1, neutral 2
    assert collections.Counter(example.label for example in matched) == {0: 6, 1: 1, 2: 3}
    assert train[0].text_b == "Product and geography are what make cream skimming work. "


def test_mrpc_unbalanced_quote_and_bom(shared_data):
    examples, _ = load_examples(TASKS["mrpc"], "dev", data_dir=str(shared_data / "glue_data"))
    # the second field opens a quote it never closes: a CSV reader would swallow following lines
    assert examples[0].text_b == '"The foodservice pie business does not fit our long-term growth strategy.'
    assert examples[0].label == 1
    assert examples[1].text_a.startswith("Magnarelli said Racicot")


def test_max_examples(shared_data):
    examples, _ = load_examples(TASKS["sst2"], "dev", data_dir=str(shared_data / "glue_data"), max_examples=5)
    assert len(examples) == 5


def _write(folder: Path, task_dir: str, split: str, text: str) -> str:
    (folder / task_dir).mkdir(parents=True, exist_ok=True)
    (folder / task_dir / f"{split}.tsv").write_text(text, encoding="utf-8")
    return str(folder)


@pytest.mark.parametrize(
    ("task_name", "body", "message"),
    [
        (
            "rte",
            "index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n1\ta\tb\n",
            r"RTE/train\.tsv:3: 3 tab",
        ),
        (
            "rte",
            "index\tsentence1\tsentence2\tlabel\n0\ta\tb\tneutral\n",
            r"RTE/train\.tsv:2: label 'neutral'",
        ),
        ("cola", "src\t1\t\tok\nsrc\t2\t\tbad\n", r"CoLA/train\.tsv:2: label '2'"),
        ("stsb", "index\tsentence1\tsentence2\tscore\n0\ta\tb\thigh\n", r"STS-B/train\.tsv:2: score 'high'"),
        (
            "stsb",
            "index\tsentence1\tsentence2\tscore\n0\ta\tb\t5.5\n",
            r"STS-B/train\.tsv:2: score 5\.5 outside",
        ),
        (
            "stsb",
            "index\tsentence1\tsentence2\tscore\n0\ta\tb\tnan\n",
            r"STS-B/train\.tsv:2: score nan outside",
        ),
        ("mrpc", "Quality\t#1 String\n1\tx\n", r"MRPC/train\.tsv:1: header has no '#2 String'"),
    ],
)
def test_bad_tsv_is_one_line_error_naming_file_and_line(tmp_path, task_name, body, message):
    data_dir = _write(tmp_path, TASKS[task_name].glue_dir, "train", body)
    with pytest.raises(DataError, match=message) as raised:
        load_examples(TASKS[task_name], "train", data_dir=data_dir)
    assert "\n" not in str(raised.value)


def test_missing_file_names_path(tmp_path):
    with pytest.raises(DataError, match=r"WNLI/dev\.tsv: no such file"):
        load_examples(TASKS["wnli"], "dev", data_dir=str(tmp_path))


def test_blank_lines_counted_and_test_split_unlabelled(tmp_path):
    data_dir = _write(tmp_path, "QNLI", "test", "index\tquestion\tsentence\n0\tq?\ts.\n\n1\tq2?\ts2.\n")
    examples, skips = load_examples(TASKS["qnli"], "test", data_dir=data_dir)
    assert [(example.text_a, example.label) for example in examples] == [("q?", None), ("q2?", None)]
    assert skips == {"blank_line": 1}


def test_encode_glue_pairs_and_truncation(shared_data, tokenizer):
    examples, _ = load_examples(TASKS["rte"], "dev", data_dir=str(shared_data / "glue_data"), max_examples=8)
    encoded = encode_glue(examples, tokenizer, max_length=32)
    assert set(encoded) == {"input_ids", "token_type_ids", "attention_mask", "labels"}
    assert encoded["labels"] == [example.label for example in examples]
    for input_ids, token_type_ids, attention_mask in zip(
        encoded["input_ids"], encoded["token_type_ids"], encoded["attention_mask"]
    ):
        assert len(input_ids) <= 32 and len(input_ids) == len(token_type_ids) == len(attention_mask)
        assert input_ids[0] == tokenizer.cls_token_id and input_ids.count(tokenizer.sep_token_id) == 2
        assert 1 in token_type_ids and all(attention_mask)
    single = encode_glue([examples[0].__class__("g", "Hello world.", None, 1)], tokenizer, max_length=16)
    assert single["input_ids"][0] == tokenizer("Hello world.")["input_ids"]
    assert set(single["token_type_ids"][0]) == {0}


def _fake_hub(monkeypatch, rows: dict, features=None):
    """Replace `datasets.load_dataset` with one returning a local dataset with the hub schema."""
    import datasets

    calls = []

    def load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split))
        return datasets.Dataset.from_dict(rows, features=features)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def test_hub_mnli_remaps_labels_by_name(monkeypatch):
    import datasets

    features = datasets.Features(
        {
            "premise": datasets.Value("string"),
            "hypothesis": datasets.Value("string"),
            "label": datasets.ClassLabel(names=["entailment", "neutral", "contradiction"]),
            "idx": datasets.Value("int32"),
        }
    )
    rows = {
        "premise": ["p0", "p1", "p2", "p3"],
        "hypothesis": ["h0", "h1", "h2", "h3"],
        "label": [0, 1, 2, -1],
        "idx": [0, 1, 2, 3],
    }
    calls = _fake_hub(monkeypatch, rows, features)
    examples, skips = load_examples(TASKS["mnli"], "dev_matched", data_dir=None)
    assert calls == [("nyu-mll/glue", "mnli", "validation_matched")]
    names = TASKS["mnli"].label_names
    assert [names[example.label] for example in examples[:3]] == ["entailment", "neutral", "contradiction"]
    assert examples[3].label is None and examples[0].text_a == "p0" and examples[0].text_b == "h0"
    assert skips == {}


def test_hub_stsb_floats_and_max_examples(monkeypatch):
    rows = {
        "sentence1": ["a", "b", "c"],
        "sentence2": ["x", "y", "z"],
        "label": [4.5, 0.0, 2.25],
        "idx": [0, 1, 2],
    }
    calls = _fake_hub(monkeypatch, rows)
    examples, _ = load_examples(TASKS["stsb"], "train", data_dir=None, max_examples=2)
    assert calls == [("nyu-mll/glue", "stsb", "train")]
    assert [(example.text_a, example.text_b, example.label) for example in examples] == [
        ("a", "x", 4.5),
        ("b", "y", 0.0),
    ]


def test_qqp_layout_by_header(tmp_path):
    """No QQP file is in the shared data: a two-row file in the GLUE layout."""
    header = "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n"
    data_dir = _write(tmp_path, "QQP", "dev", header + '7\t1\t2\tHow?\tWhy?\t1\n8\t3\t4\tA "b\tc\t0\n')
    examples, _ = load_examples(TASKS["qqp"], "dev", data_dir=data_dir)
    assert [(example.text_a, example.text_b, example.label) for example in examples] == [
        ("How?", "Why?", 1),
        ('A "b', "c", 0),
    ]
