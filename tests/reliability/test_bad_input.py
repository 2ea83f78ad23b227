"""Bad input to the three command-line tools: corpora, shards, fine-tuning files, configs, checkpoints.

Every case runs the real entry point (`python -m data.prepare | pretrain | finetune`: its module run as
__main__ in this process, which spares the import time; `test_real_subprocess_exit_codes` runs a few as
separate processes) in a workspace that already holds outputs of earlier runs (a prepared data folder, a
pretraining run folder with checkpoints, fine-tuning results). Each must end with a non-zero exit and a
one-line error naming the file (and line) or the config key, no traceback, and leave every file written
before byte for byte as it was. Hydra's own composition errors (unknown key, wrong type; marked `hydra`)
are condensed to one line too (launch/cli.py).

The property-based tests (hypothesis) mutate checkpoints, shards, manifests, TSV rows and SQuAD JSON at
random and require either a clean load or the module's own one-line error, never anything else.
"""

from __future__ import annotations

import bz2
import contextlib
import io
import json
import os
import runpy
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data.config import REPO_ROOT
from data.documents import DataError
from data.shards import load_manifest, verify_shards
from pretrain.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint
from tests.reliability.harness import hash_tree

pytestmark = pytest.mark.integration

PROPERTY = settings(
    max_examples=20,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
QUIET_PRETRAIN = ["wandb.mode=disabled", "show_progress=false", "num_workers=0", "max_steps=2"]
QUIET_FINETUNE = ["wandb.mode=disabled", "show_progress=false", "task.epochs=1"]


@dataclass
class Result:
    code: int
    stderr: str

    @property
    def lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]


def run_cli(module: str, argv: list[str]) -> Result:
    """`python -m <module> <argv>` in this process: exit code and stderr; environment restored."""
    import torch.distributed as dist

    saved_env, saved_argv = dict(os.environ), sys.argv
    stderr = io.StringIO()
    sys.argv = [module, *argv]
    code = 0
    try:
        with contextlib.redirect_stderr(stderr):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    finally:
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
        if dist.is_initialized():
            dist.destroy_process_group()
    return Result(code, stderr.getvalue())


# -- workspaces: outputs of earlier runs that a failing run must leave alone --------------------------
@pytest.fixture(scope="module")
def base_run(tiny_data: Path, tmp_path_factory) -> Path:
    """A finished 2-step pretraining run (1 process): checkpoints step-1 and step-2, metrics, config."""
    run_dir = tmp_path_factory.mktemp("base") / "run"
    args = pretrain_args(tiny_data, run_dir, "checkpoint.every_steps=1")
    command = [sys.executable, "-m", "pretrain", *args]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert latest_checkpoint(run_dir / "checkpoints") is not None
    return run_dir


@pytest.fixture(scope="module")
def tiny_hf_model(tiny_data: Path, tmp_path_factory) -> Path:
    """A random 1-layer BERT with tiny_data's tokenizer, saved as an HF folder (fine-tuning cases)."""
    from transformers import BertConfig, BertForPreTraining, BertTokenizerFast

    folder = tmp_path_factory.mktemp("tiny_hf")
    tokenizer = BertTokenizerFast(tokenizer_file=str(tiny_data / "seq128" / "tokenizer.json"))
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    BertForPreTraining(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def pretrain_args(data: Path, run_dir: Path, *extra: str) -> list[str]:
    recipe = ["batch=demo", "optim=onebit_lamb", "model=bert_tiny"]
    return [*recipe, f"data_dir={data}", f"run_dir={run_dir}", *QUIET_PRETRAIN, *extra]


@dataclass
class Workspace:
    root: Path
    tiny_data: Path  # read-only original (session fixture)
    data: Path  # a copy the case may damage
    prepared: Path  # a complete prepared output (data.prepare cases write here)
    run_dir: Path  # a copy of base_run
    model: Path  # tiny HF model
    finetune_out: Path  # results of an earlier fine-tune
    glue: Path  # glue_data root with a valid MRPC and STS-B
    squad: Path  # folder with a valid dev-v1.1.json

    def protected(self) -> list[Path]:
        return [self.prepared, self.run_dir, self.model, self.finetune_out]


MRPC_HEADER = "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
MRPC_ROWS = "".join(f"{i % 2}\t{i}\t{i + 100}\tthe cat sat {i} .\ta cat sat {i} .\n" for i in range(12))
STSB_HEADER = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
STSB_ROWS = "".join(f"{i}\tg\tf\t2017\t{i}\ts\ts\ta dog runs {i}\ta dog ran\t{i % 5}.0\n" for i in range(12))


def squad_document(num_articles: int = 2) -> dict:
    context = "The quick brown fox jumps over the lazy dog near the river bank."
    return {
        "version": "1.1",
        "data": [
            {
                "title": f"article {a}",
                "paragraphs": [
                    {
                        "context": context,
                        "qas": [
                            {
                                "id": f"q{a}-{q}",
                                "question": "What jumps over the dog?",
                                "answers": [{"text": "quick brown fox", "answer_start": 4}],
                            }
                            for q in range(3)
                        ],
                    }
                ],
            }
            for a in range(num_articles)
        ],
    }


@pytest.fixture
def ws(tmp_path: Path, tiny_data: Path, base_run: Path, tiny_hf_model: Path) -> Workspace:
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    prepared = tmp_path / "prepared"
    shutil.copytree(tiny_data, prepared)
    run_dir = tmp_path / "run"
    shutil.copytree(base_run, run_dir)
    finetune_out = tmp_path / "finetune_out"
    finetune_out.mkdir()
    (finetune_out / "all_results.json").write_text('{"summary": {"f1": {"mean": 88.5}}}\n')
    (finetune_out / "metrics.jsonl").write_text('{"step": 10, "loss": 0.4}\n')
    glue = tmp_path / "glue"
    for task, header, rows in (("MRPC", MRPC_HEADER, MRPC_ROWS), ("STS-B", STSB_HEADER, STSB_ROWS)):
        (glue / task).mkdir(parents=True)
        for split in ("train", "dev"):
            (glue / task / f"{split}.tsv").write_text(header + rows)
    squad = tmp_path / "squad"
    squad.mkdir()
    (squad / "dev-v1.1.json").write_text(json.dumps(squad_document()))
    return Workspace(tmp_path, tiny_data, data, prepared, run_dir, tiny_hf_model, finetune_out, glue, squad)


# -- the cases ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """`run(ws)` damages the workspace's inputs, runs a tool and returns (result, what the first line
    of the error must name: a path or a config key)."""

    id: str
    run: Callable[[Workspace], tuple[Result, str]]
    hydra: bool = False  # a Hydra composition error, condensed to one line by launch/cli.py


def prepare(ws: Workspace, sources: str, *extra: str) -> Result:
    output = f"data.shards.output_dir={ws.prepared}"
    quiet = ["show_progress=false", "data.shards.num_workers=0"]
    return run_cli("data.prepare", ["data=tiny", output, f"data.sources={sources}", *quiet, *extra])


def books(path: Path) -> str:
    return f"[{{kind: books, path: '{path}'}}]"


def _binary_book(ws: Workspace) -> tuple[Result, str]:
    path = ws.root / "model.bin.txt"
    path.write_bytes(bytes(range(256)) * 40)
    return prepare(ws, books(path)), str(path)


def _latin1_book(ws: Workspace) -> tuple[Result, str]:
    path = ws.root / "latin1.txt"
    text = "Caf\xe9 au lait. Cr\xe8me br\xfbl\xe9e.\n\nUne autre phrase ici.\n"
    path.write_bytes(text.encode("latin-1") * 50)
    return prepare(ws, books(path)), str(path)


def _empty_book(ws: Workspace) -> tuple[Result, str]:
    path = ws.root / "empty.txt"
    path.write_bytes(b"")
    return prepare(ws, books(path)), str(path)


def _empty_folder(ws: Workspace) -> tuple[Result, str]:
    folder = ws.root / "no_books"
    folder.mkdir()
    (folder / "notes.md").write_text("not a book")
    return prepare(ws, books(folder)), str(folder)


def _missing_corpus(ws: Workspace) -> tuple[Result, str]:
    path = ws.root / "nowhere" / "books"
    return prepare(ws, books(path)), str(path)


def _fake_gzip_book(ws: Workspace) -> tuple[Result, str]:
    path = ws.root / "book.txt.gz"
    path.write_text("plain text pretending to be gzip\n" * 20)
    return prepare(ws, books(path)), str(path)


def _truncated_bz2_dump(ws: Workspace) -> tuple[Result, str]:
    pages = "".join(
        f"<page><title>Page {i}</title><ns>0</ns><revision><text>Sentence one of page {i}. "
        f"Sentence two is here. Sentence three ends it.</text></revision></page>"
        for i in range(200)
    )
    payload = bz2.compress(f"<mediawiki>{pages}</mediawiki>".encode())
    path = ws.root / "enwiki-pages-articles.xml.bz2"
    path.write_bytes(payload[: len(payload) // 2])
    return prepare(ws, f"[{{kind: wiki_dump, path: '{path}'}}]"), str(path)


def _malformed_xml_dump(ws: Workspace) -> tuple[Result, str]:
    path = ws.root / "broken.xml"
    page = "<page><title>A</title><ns>0</ns>\n<revision><text>Text.</text></revision>\n"
    path.write_text(f"<mediawiki>\n{page}</mediawiki>\n")  # </page> missing
    return prepare(ws, f"[{{kind: wiki_dump, path: '{path}'}}]"), f"{path}:"


def _unclosed_doc(ws: Workspace) -> tuple[Result, str]:
    folder = ws.root / "extracted" / "AA"
    folder.mkdir(parents=True)
    (folder / "wiki_00").write_text('<doc id="1" title="A">\nA\n\nSome text here. More text.\n')
    return prepare(ws, f"[{{kind: wiki_extracted, path: '{folder}'}}]"), f"{folder / 'wiki_00'}:1"


def _chunk_size_zero(ws: Workspace) -> tuple[Result, str]:
    return prepare(ws, books(ws.root / "unused.txt"), "data.shards.chunk_mb=0"), "data.shards.chunk_mb"


def _prepare_unknown_key(ws: Workspace) -> tuple[Result, str]:
    return prepare(ws, books(ws.root / "unused.txt"), "data.instances.sead=3"), "data.instances.sead"


def pretrain(ws: Workspace, *extra: str, data: Path | None = None) -> Result:
    return run_cli("pretrain", pretrain_args(data or ws.data, ws.run_dir, *extra))


def _truncated_shard(ws: Workspace) -> tuple[Result, str]:
    shard = ws.data / "seq128" / "shard-00000.arrow"
    shard.write_bytes(shard.read_bytes()[:-100])
    return pretrain(ws), str(shard)


def _flipped_shard_byte(ws: Workspace) -> tuple[Result, str]:
    shard = ws.data / "seq512" / "shard-00000.arrow"
    payload = bytearray(shard.read_bytes())
    payload[len(payload) // 2] ^= 0x01  # same size: only the checksum can tell
    shard.write_bytes(bytes(payload))
    return pretrain(ws), str(shard)


def _replaced_tokenizer(ws: Workspace) -> tuple[Result, str]:
    tokenizer = ws.data / "seq128" / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text().replace('"[MASK]"', '"[MASQ]"'))
    return pretrain(ws), "tokenizer.json"


def _phases_with_other_vocab(ws: Workspace) -> tuple[Result, str]:
    """seq512 re-tokenized with another vocab: its manifest records a different tokenizer."""
    manifest_path = ws.data / "seq512" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["tokenizer"]["sha256"] = "0" * 64
    manifest["tokenizer"]["vocab_size"] += 7
    manifest_path.write_text(json.dumps(manifest))
    return pretrain(ws), "data_dir"


def _manifest_not_json(ws: Workspace) -> tuple[Result, str]:
    manifest = ws.data / "seq128" / "manifest.json"
    manifest.write_text(manifest.read_text()[:200])
    return pretrain(ws), f"{manifest}:"


def _missing_phase_folder(ws: Workspace) -> tuple[Result, str]:
    shutil.rmtree(ws.data / "seq512")
    return pretrain(ws), "data_dir"


def _wrong_type(ws: Workspace) -> tuple[Result, str]:
    return pretrain(ws, "log_every=often"), "log_every"


def _indivisible_batch(ws: Workspace) -> tuple[Result, str]:
    return pretrain(ws, "batch.phases.0.global_batch=33"), "batch.phases[phase1].global_batch"


def _indivisible_over_ranks(ws: Workspace) -> tuple[Result, str]:
    # a laptop validating a 3-GPU config: 32 is not a multiple of 3 x 8
    return pretrain(ws, "dry_run=true", "dry_run_world_size=3"), "batch.phases[phase1].global_batch"


def _freeze_after_end(ws: Workspace) -> tuple[Result, str]:
    return pretrain(ws, "batch.phases.0.freeze_step=50"), "batch.phases[phase1].freeze_step"


def _zero_steps(ws: Workspace) -> tuple[Result, str]:
    return pretrain(ws, "batch.phases.1.steps=0"), "batch.phases[phase2].steps"


def _unknown_key(ws: Workspace) -> tuple[Result, str]:
    return pretrain(ws, "checkpoint.every_step=5"), "checkpoint.every_step"


def _sequence_too_long(ws: Workspace) -> tuple[Result, str]:
    return pretrain(ws, "model.max_position_embeddings=256"), "model.max_position_embeddings"


def _resume_missing_folder(ws: Workspace) -> tuple[Result, str]:
    folder = ws.root / "no-such-checkpoint"
    return pretrain(ws, f"resume={folder}"), str(folder)


def _newest_checkpoint(ws: Workspace) -> Path:
    folder = latest_checkpoint(ws.run_dir / "checkpoints")
    assert folder is not None
    return folder


def _corrupt_weights(ws: Workspace) -> tuple[Result, str]:
    weights = _newest_checkpoint(ws) / "model.safetensors"
    payload = bytearray(weights.read_bytes())
    payload[-5] ^= 0x10  # inside a tensor: safetensors itself cannot notice
    # written in place on purpose: the damage is the case; the run folder is protected otherwise
    weights.write_bytes(bytes(payload))
    return pretrain(ws), str(weights)


def _truncated_rank_state(ws: Workspace) -> tuple[Result, str]:
    rank_file = _newest_checkpoint(ws) / "rank-00000.pt"
    rank_file.write_bytes(rank_file.read_bytes()[:1000])
    return pretrain(ws), str(rank_file)


def _wrong_model_shape(ws: Workspace) -> tuple[Result, str]:
    return pretrain(ws, "model=bert_mini"), "model.safetensors"


def _partial_checkpoint(ws: Workspace) -> tuple[Result, str]:
    partial = ws.run_dir / "checkpoints" / "step-00000003.tmp"
    shutil.copytree(_newest_checkpoint(ws), partial)
    (partial / "COMPLETE").unlink()
    return pretrain(ws, f"resume={partial}"), str(partial)


def _bad_checksums(ws: Workspace) -> tuple[Result, str]:
    listing = _newest_checkpoint(ws) / "checksums.json"
    listing.write_text("{not json")
    return pretrain(ws), str(listing)


def finetune(ws: Workspace, task: str, data_dir: Path, *extra: str) -> Result:
    paths = [f"model_path={ws.model}", f"data_dir={data_dir}", f"output_dir={ws.finetune_out}"]
    return run_cli("finetune", [f"task={task}", *paths, *QUIET_FINETUNE, *extra])


def _tsv_case(task: str, folder: str, body: str, where: str) -> Callable[[Workspace], tuple[Result, str]]:
    def run(ws: Workspace) -> tuple[Result, str]:
        path = ws.glue / folder / "train.tsv"
        path.write_bytes(body.encode("utf-8") if isinstance(body, str) else body)
        return finetune(ws, task, ws.glue), f"{path}{where}"

    return run


def _squad_case(document: str, where: str) -> Callable[[Workspace], tuple[Result, str]]:
    def run(ws: Workspace) -> tuple[Result, str]:
        path = ws.squad / "dev-v1.1.json"
        path.write_text(document)
        return finetune(ws, "squad", ws.squad, "task.max_length=64", "task.doc_stride=32"), f"{path}{where}"

    return run


def _squad_with(change: Callable[[dict], None]) -> str:
    document = squad_document()
    change(document)
    return json.dumps(document, indent=1)


def _not_utf8_tsv(ws: Workspace) -> tuple[Result, str]:
    path = ws.glue / "MRPC" / "train.tsv"
    path.write_bytes((MRPC_HEADER + MRPC_ROWS).encode() + "0\t1\t2\tcaf\xe9\tbar\n".encode("latin-1"))
    return finetune(ws, "mrpc", ws.glue), f"{path}:14"


def _not_a_bert(ws: Workspace) -> tuple[Result, str]:
    folder = ws.root / "not_a_model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "gpt2"}')
    paths = [f"model_path={folder}", f"data_dir={ws.glue}", f"output_dir={ws.finetune_out}"]
    result = run_cli("finetune", ["task=mrpc", *paths, *QUIET_FINETUNE])
    return result, str(folder)


def _finetune_bad_value(ws: Workspace) -> tuple[Result, str]:
    return finetune(ws, "mrpc", ws.glue, "task.lr=-1"), "task.lr"


def _finetune_unknown_key(ws: Workspace) -> tuple[Result, str]:
    return finetune(ws, "mrpc", ws.glue, "task.learning_rate=1e-4"), "task.learning_rate"


MISSING_COLUMN = MRPC_HEADER.replace("#2 String", "S2") + MRPC_ROWS
STSB_OUT_OF_RANGE = STSB_HEADER + STSB_ROWS.replace("\t3.0\n", "\t7.5\n")
STSB_NOT_A_NUMBER = STSB_HEADER + "0\tg\tf\t1\t0\ts\ts\ta\tb\tn/a\n"
SQUAD_MISSING_ID = _squad_with(lambda d: d["data"][1]["paragraphs"][0]["qas"][2].pop("id"))
SQUAD_CONTEXT_NOT_TEXT = _squad_with(lambda d: d["data"][0]["paragraphs"][0].update(context=7))

CASES = [
    # corpora
    Case("corpus/binary-file", _binary_book),
    Case("corpus/not-utf8", _latin1_book),
    Case("corpus/empty-file", _empty_book),
    Case("corpus/folder-without-corpus-files", _empty_folder),
    Case("corpus/missing-path", _missing_corpus),
    Case("corpus/fake-gzip", _fake_gzip_book),
    Case("corpus/truncated-bz2", _truncated_bz2_dump),
    Case("corpus/malformed-xml", _malformed_xml_dump),
    Case("corpus/unclosed-doc-block", _unclosed_doc),
    # shards
    Case("shards/truncated", _truncated_shard),
    Case("shards/checksum-mismatch", _flipped_shard_byte),
    Case("shards/tokenizer-replaced", _replaced_tokenizer),
    Case("shards/vocab-mismatch-between-phases", _phases_with_other_vocab),
    Case("shards/manifest-not-json", _manifest_not_json),
    Case("shards/missing-phase-folder", _missing_phase_folder),
    # fine-tuning files
    Case("glue/wrong-field-count", _tsv_case("mrpc", "MRPC", MRPC_HEADER + MRPC_ROWS + "1\tonly\n", ":14")),
    Case("glue/missing-column", _tsv_case("mrpc", "MRPC", MISSING_COLUMN, ":1")),
    Case("glue/label-out-of-range", _tsv_case("mrpc", "MRPC", MRPC_HEADER + "2\t1\t2\ta\tb\n", ":2")),
    Case("glue/stsb-score-out-of-range", _tsv_case("stsb", "STS-B", STSB_OUT_OF_RANGE, ":5")),
    Case("glue/stsb-score-not-a-number", _tsv_case("stsb", "STS-B", STSB_NOT_A_NUMBER, ":2")),
    Case("glue/empty-file", _tsv_case("mrpc", "MRPC", "", ":1")),
    Case("glue/not-utf8", _not_utf8_tsv),
    Case("squad/malformed-json", _squad_case('{"version": "1.1", "data": [ {"title": "x",', ":")),
    Case("squad/missing-key", _squad_case(SQUAD_MISSING_ID, "")),
    Case("squad/wrong-type", _squad_case(SQUAD_CONTEXT_NOT_TEXT, "")),
    Case("finetune/model-folder-not-a-bert", _not_a_bert),
    # configs
    Case("config/wrong-type", _wrong_type, hydra=True),
    Case("config/unknown-key", _unknown_key, hydra=True),
    Case("config/indivisible-batch", _indivisible_batch),
    Case("config/batch-indivisible-over-ranks", _indivisible_over_ranks),
    Case("config/freeze-step-after-last-step", _freeze_after_end),
    Case("config/zero-steps", _zero_steps),
    Case("config/sequence-longer-than-positions", _sequence_too_long),
    Case("config/prepare-chunk-size-zero", _chunk_size_zero),
    Case("config/prepare-unknown-key", _prepare_unknown_key, hydra=True),
    Case("config/finetune-negative-lr", _finetune_bad_value),
    Case("config/finetune-unknown-key", _finetune_unknown_key, hydra=True),
    # checkpoints
    Case("checkpoint/corrupt-weights", _corrupt_weights),
    Case("checkpoint/truncated-rank-state", _truncated_rank_state),
    Case("checkpoint/wrong-model-shape", _wrong_model_shape),
    Case("checkpoint/partial-folder-given", _partial_checkpoint),
    Case("checkpoint/corrupt-checksum-list", _bad_checksums),
    Case("checkpoint/resume-folder-missing", _resume_missing_folder),
]

# What a case itself damages on purpose (its input); everything else written before must stay as it was.
DAMAGED_INPUTS = {
    "checkpoint/corrupt-weights": "model.safetensors",
    "checkpoint/truncated-rank-state": "rank-00000.pt",
    "checkpoint/corrupt-checksum-list": "checksums.json",
    "checkpoint/partial-folder-given": "step-00000003.tmp",
}


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input_is_one_line_naming_it_and_destroys_nothing(case: Case, ws: Workspace, record):
    before = {root: hash_tree(root) for root in ws.protected()}
    result, name = case.run(ws)
    assert result.code != 0, f"{case.id}: exit 0\n{result.stderr}"
    assert result.lines, f"{case.id}: no error message"
    assert "Traceback" not in result.stderr, result.stderr
    first = result.lines[0]
    assert name in first, f"{case.id}: {name!r} not in the first line: {first!r}"
    assert len(result.lines) == 1, f"{case.id}: more than one line:\n{result.stderr}"
    assert result.code == 2, f"{case.id}: exit {result.code}"
    damaged = DAMAGED_INPUTS.get(case.id)
    for root, digests in before.items():
        after = hash_tree(root)
        for file, digest in digests.items():
            if damaged and damaged in file:
                continue
            assert after.get(file) == digest, f"{case.id}: {root / file} was changed or removed"
        if damaged is None:
            assert set(after) == set(digests), f"{case.id}: new files in {root}: {set(after) - set(digests)}"
    record("bad_input", case=case.id, exit_code=result.code, message=first[:200])


@pytest.mark.slow
def test_accepted_input_one_huge_line(ws: Workspace, record):
    """One 4 MB line without a newline (a corpus that lost its line breaks) is not an error: it is
    prepared in bounded time into ordinary instances."""
    path = ws.root / "one_line.txt"
    sentence = "The quick brown fox jumps over the lazy dog again and again. "
    path.write_text(sentence * (4_000_000 // len(sentence)))
    out = ws.root / "huge_out"
    result = run_cli(
        "data.prepare",
        [
            "data=tiny",
            f"data.shards.output_dir={out}",
            f"data.sources={books(path)}",
            "show_progress=false",
            "data.shards.num_workers=0",
        ],
    )
    assert result.code == 0, result.stderr
    assert load_manifest(out / "seq128")["num_instances"] > 1000
    record("bad_input", case="corpus/one-huge-line (accepted)", exit_code=0, message="prepared")


def test_resume_with_more_ranks_names_the_missing_rank_file(base_run: Path, tiny_data: Path, record):
    """A 1-process checkpoint resumed by 2 processes: rank 1's state is not there."""
    from pretrain.model import build_model
    from tests.integration.pretrain_helpers import compose_train_config

    cfg = compose_train_config(pretrain_args(tiny_data, base_run))
    model = build_model(cfg.model, 2000, torch.device("cpu"))
    folder = latest_checkpoint(base_run / "checkpoints")
    assert folder is not None
    with pytest.raises(CheckpointError, match=r"rank-00001\.pt: missing") as error:
        load_checkpoint(folder, 1, model)
    assert "\n" not in str(error.value)
    record("bad_input", case="checkpoint/different-world-size", exit_code=2, message=str(error.value)[:200])


@pytest.mark.slow  # `python -m` processes; `make test` runs the cases above in process
def test_real_subprocess_exit_codes(ws: Workspace):
    """The same contract from real `python -m` processes (exit status as the shell sees it)."""
    shard = ws.data / "seq128" / "shard-00000.arrow"
    shard.write_bytes(shard.read_bytes()[:-10])
    before = hash_tree(ws.run_dir)
    done = subprocess.run(
        [sys.executable, "-m", "pretrain", *pretrain_args(ws.data, ws.run_dir)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [done.stderr.strip()], done.stderr
    assert str(shard) in done.stderr and hash_tree(ws.run_dir) == before
    path = ws.squad / "dev-v1.1.json"
    path.write_text('{"data": [}')
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "finetune",
            "task=squad",
            f"model_path={ws.model}",
            f"data_dir={ws.squad}",
            f"output_dir={ws.finetune_out}",
            *QUIET_FINETUNE,
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and f"{path}:1" in done.stderr.strip().splitlines()[-1], done.stderr


# -- property-based ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint_bytes(base_run: Path) -> dict[str, bytes]:
    folder = latest_checkpoint(base_run / "checkpoints")
    assert folder is not None
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


@PROPERTY
@given(
    name=st.sampled_from(["model.safetensors", "rank-00000.pt", "replicated.pt", "train_state.pt"]),
    position=st.floats(0, 1, exclude_max=True),
    flip=st.integers(1, 255),
    truncate=st.booleans(),
)
def test_any_damaged_checkpoint_file_is_refused(
    base_run: Path, tiny_data: Path, checkpoint_bytes, tmp_path_factory, name, position, flip, truncate
):
    from pretrain.model import build_model
    from tests.integration.pretrain_helpers import compose_train_config

    folder = tmp_path_factory.mktemp("ckpt")
    for file, payload in checkpoint_bytes.items():
        (folder / file).write_bytes(payload)
    payload = bytearray(checkpoint_bytes[name])
    index = int(position * len(payload))
    damaged = (
        bytes(payload[:index])
        if truncate
        else bytes(payload[:index] + bytes([payload[index] ^ flip]) + payload[index + 1 :])
    )
    (folder / name).write_bytes(damaged)
    cfg = compose_train_config(pretrain_args(tiny_data, base_run))
    model = build_model(cfg.model, 2000, torch.device("cpu"))
    with pytest.raises(CheckpointError, match=name):
        load_checkpoint(folder, 0, model)


@PROPERTY
@given(position=st.floats(0, 1, exclude_max=True), flip=st.integers(1, 255))
def test_any_flipped_shard_byte_is_found(tiny_data: Path, tmp_path_factory, position, flip):
    folder = tmp_path_factory.mktemp("shards")
    shutil.copytree(tiny_data / "seq128", folder, dirs_exist_ok=True)
    shard = folder / "shard-00000.arrow"
    payload = bytearray(shard.read_bytes())
    payload[int(position * len(payload))] ^= flip
    shard.write_bytes(bytes(payload))
    with pytest.raises(DataError, match=r"shard-00000\.arrow: sha256 differs"):
        verify_shards(folder, load_manifest(folder))


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10**6) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)


@PROPERTY
@given(
    key=st.sampled_from(
        ["format", "version", "max_seq_length", "tokenizer", "shards", "num_instances", "static_masking"]
    ),
    value=JSON_VALUES,
    drop=st.booleans(),
)
def test_any_damaged_manifest_is_refused_or_still_valid(tiny_data: Path, tmp_path_factory, key, value, drop):
    folder = tmp_path_factory.mktemp("manifest")
    manifest = json.loads((tiny_data / "seq128" / "manifest.json").read_text())
    if drop:
        del manifest[key]
    else:
        manifest[key] = value
    (folder / "manifest.json").write_text(json.dumps(manifest))
    try:
        load_manifest(folder)
    except DataError as error:
        assert str(folder / "manifest.json") in str(error) and "\n" not in str(error)


TSV_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30)


@PROPERTY
@given(rows=st.lists(st.lists(TSV_TEXT, min_size=1, max_size=7), max_size=5))
def test_any_tsv_rows_parse_or_fail_naming_the_line(tmp_path_factory, rows):
    from finetune.tasks import TASKS
    from finetune.tasks.glue import load_examples

    root = tmp_path_factory.mktemp("glue")
    (root / "MRPC").mkdir()
    path = root / "MRPC" / "train.tsv"
    path.write_text(MRPC_HEADER + "".join("\t".join(fields) + "\n" for fields in rows), encoding="utf-8")
    try:
        examples, _ = load_examples(TASKS["mrpc"], "train", data_dir=root)
    except DataError as error:
        assert str(error).startswith(f"{path}:") and "\n" not in str(error)
    else:
        assert all(example.label in (0, 1) for example in examples)


SQUAD_KEYS = ["data", 0, "paragraphs", "qas", "answers", "context", "id"]


@PROPERTY
@given(path=st.lists(st.sampled_from(SQUAD_KEYS), max_size=5), value=JSON_VALUES)
def test_any_squad_document_loads_or_fails_naming_the_file(tmp_path_factory, path, value):
    from finetune.tasks import TASKS
    from finetune.tasks.squad import load_examples

    document = squad_document()
    node = document
    for step in path[:-1]:  # replace one node somewhere along `path` (where it exists) with `value`
        if isinstance(node, dict) and step in node:
            node = node[step]
        elif isinstance(node, list) and isinstance(step, int) and node:
            node = node[0]
    if path and isinstance(node, dict):
        node[path[-1]] = value
    folder = tmp_path_factory.mktemp("squad")
    (folder / "dev-v1.1.json").write_text(json.dumps(document))
    try:
        load_examples(TASKS["squad"], "dev", data_dir=folder)
    except DataError as error:
        assert str(folder / "dev-v1.1.json") in str(error) and "\n" not in str(error)
