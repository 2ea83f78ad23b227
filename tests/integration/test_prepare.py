"""`python -m data.prepare` end to end on ../shared/data: outputs, determinism, resume, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data.config import REPO_ROOT

pytestmark = pytest.mark.integration


def run_prepare(*overrides: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "data.prepare", "show_progress=false", *overrides]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def shard_checksums(folder: Path) -> list[str]:
    manifest = json.loads((folder / "manifest.json").read_text())
    return [s["sha256"] for s in manifest["shards"]]


@pytest.fixture(scope="module")
def sample_output(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "sample"
    run_prepare("data=sample", f"data.shards.output_dir={out}")
    return out


def test_sample_end_to_end(sample_output: Path):
    from transformers import AutoTokenizer

    from data.dataset import PretrainingDataset
    from data.shards import load_manifest, verify_shards

    for length in (128, 512):
        folder = sample_output / f"seq{length}"
        manifest = load_manifest(folder)
        verify_shards(folder, manifest)
        assert manifest["max_seq_length"] == length
        # 106 dump articles + 103 extracted docs + 6 books, minus the counted short ones
        assert 180 <= manifest["num_documents"] <= 215
        assert manifest["num_documents"] + manifest["skipped"].get("too_few_sentences", 0) == 215
        assert manifest["skipped"].get("redirect") == 100
        assert manifest["num_instances"] == sum(s["num_instances"] for s in manifest["shards"])
        assert 0.40 <= manifest["num_random_next"] / manifest["num_instances"] <= 0.60
        tokenizer = AutoTokenizer.from_pretrained(folder)
        assert len(tokenizer) == manifest["tokenizer"]["vocab_size"] == 30522
        dataset = PretrainingDataset(folder, verify=True, expected_vocab_size=30522)
        assert len(dataset) == manifest["num_instances"]
        sample = dataset[len(dataset) - 1]
        ids = list(sample["input_ids"])
        assert ids[0] == tokenizer.cls_token_id and ids[-1] == tokenizer.sep_token_id
        assert len(ids) <= length
        text = tokenizer.decode(ids)
        assert "[CLS]" in text and text.count("[SEP]") == 2
    # phase 2 sequences are longer and there are fewer of them
    m128 = json.loads((sample_output / "seq128/manifest.json").read_text())
    m512 = json.loads((sample_output / "seq512/manifest.json").read_text())
    assert m512["num_instances"] < m128["num_instances"]
    assert m512["num_tokens"] / m512["num_instances"] > 2 * m128["num_tokens"] / m128["num_instances"]


def test_rerun_reuses_finished_shards_and_is_identical(sample_output: Path, tmp_path: Path):
    before = shard_checksums(sample_output / "seq128")
    proc = run_prepare("data=sample", f"data.shards.output_dir={sample_output}")
    assert "reused" in proc.stdout + proc.stderr
    assert shard_checksums(sample_output / "seq128") == before


@pytest.mark.slow
def test_output_independent_of_worker_count(tmp_path: Path):
    outputs = []
    for workers in (0, 2):
        out = tmp_path / f"w{workers}"
        run_prepare(
            "data=tiny",
            f"data.shards.output_dir={out}",
            f"data.shards.num_workers={workers}",
            "data.shards.chunk_mb=0.1",
        )
        outputs.append(shard_checksums(out / "seq128"))
    assert len(outputs[0]) >= 3
    assert outputs[0] == outputs[1]


@pytest.mark.slow
def test_resume_after_kill(tmp_path: Path):
    """kill -9 after the first chunk is written: the re-run reuses it and ends identical to a clean run."""
    overrides = ["data=tiny", "data.shards.num_workers=0", "data.shards.chunk_mb=0.05"]
    clean = tmp_path / "clean"
    run_prepare(*overrides, f"data.shards.output_dir={clean}")
    killed = tmp_path / "killed"
    cmd = [
        sys.executable,
        "-m",
        "data.prepare",
        "show_progress=false",
        *overrides,
        f"data.shards.output_dir={killed}",
    ]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not list((killed / "seq128").glob("shard-00001.json")):
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / "seq128/manifest.json").exists(), "a killed run must not leave a manifest"
    resumed = run_prepare(*overrides, f"data.shards.output_dir={killed}")
    assert "reused" in resumed.stdout + resumed.stderr
    assert shard_checksums(killed / "seq128") == shard_checksums(clean / "seq128")


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["data=tiny", "data.sources=[{kind:books,path:/nonexistent/books}]"], "/nonexistent/books"),
        (["data=tiny", "data.tokenizer.vocab_file=/nonexistent/vocab.txt"], "/nonexistent/vocab.txt"),
        # each case is a `python -m data.prepare` process: `make test` runs the two above
        *(
            pytest.param(overrides, expected, marks=pytest.mark.slow)
            for overrides, expected in [
                (["data=tiny", "data.instances.short_seq_prob=2.0"], "short_seq_prob"),
                (["data=tiny", "data.instances.short_seq_draw=book"], "short_seq_draw"),
                (["data=tiny", "data.shards.chunk_mb=0"], "chunk_mb"),
                (["data=tiny", "data.sources=[]"], "data.sources"),
                (["data=tiny", "data.instances.max_seq_lenghts=[128]"], "max_seq_lenghts"),
            ]
        ),
    ],
)
def test_bad_input_is_one_clear_line(tmp_path: Path, overrides: list[str], expected: str):
    out = tmp_path / "out"
    proc = run_prepare(*overrides, f"data.shards.output_dir={out}", check=False)
    assert proc.returncode != 0
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list(out.rglob("manifest.json"))


def test_empty_corpus_folder_is_an_error(tmp_path: Path):
    empty = tmp_path / "empty_books"
    empty.mkdir()
    out = tmp_path / "out"
    proc = run_prepare(
        "data=tiny",
        f"data.sources=[{{kind:books,path:'{empty}'}}]",
        f"data.shards.output_dir={out}",
        check=False,
    )
    assert proc.returncode != 0
    assert str(empty) in proc.stderr or "no usable documents" in proc.stderr
    assert not list(out.rglob("manifest.json"))


@pytest.mark.slow
def test_trained_vocab_is_the_same_on_every_run(tmp_path: Path):
    """Two preparations (two processes, so two hash seeds inside HF tokenizers' trainer) give the same
    vocabulary with the same ids, hence the same shards (#17 item 5)."""
    outputs = [tmp_path / "trained1", tmp_path / "trained2"]
    for out in outputs:
        run_prepare(
            "data=tiny",
            f"data.shards.output_dir={out}",
            "data.tokenizer.vocab_file=null",
            "data.tokenizer.vocab_size=2000",
        )
    manifests = [json.loads((out / "seq128/manifest.json").read_text()) for out in outputs]
    assert 500 <= manifests[0]["tokenizer"]["vocab_size"] <= 2000
    assert manifests[0]["num_instances"] > 0
    vocabs = [json.loads((out / "seq128/tokenizer.json").read_text())["model"]["vocab"] for out in outputs]
    assert vocabs[0] == vocabs[1]
    assert [vocabs[0][t] for t in ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]] == [0, 1, 2, 3, 4]
    assert manifests[0]["tokenizer"]["sha256"] == manifests[1]["tokenizer"]["sha256"]
    assert shard_checksums(outputs[0] / "seq128") == shard_checksums(outputs[1] / "seq128")


def test_canonical_vocab_order():
    from data.tokenizer import canonical_vocab

    tokens = ["##ing", "the", "[MASK]", "b", "##a", "[PAD]", "a", "[UNK]", "[CLS]", "[SEP]", "##", "th"]
    vocab = canonical_vocab(reversed(tokens))
    assert list(vocab) == [
        "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b", "##a", "##", "##ing", "th", "the",
    ]  # fmt: skip
    assert list(vocab.values()) == list(range(len(tokens)))


@pytest.mark.slow
def test_static_masking(tmp_path: Path):
    from data.dataset import PretrainingDataset

    out = tmp_path / "static"
    run_prepare("data=tiny", f"data.shards.output_dir={out}", "data.instances.static_masking=true")
    dataset = PretrainingDataset(out / "seq128")
    sample = dataset[0]
    assert len(sample["masked_lm_positions"]) >= 1
    assert len(sample["masked_lm_positions"]) <= 20
