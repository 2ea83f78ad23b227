"""Chunk processing: documents -> sentences -> token ids -> NSP instances -> one shard per length.

Runs in worker processes, so it imports only what a worker needs (tokenizers, numpy, pyarrow; not
transformers). Every random choice is seeded from (seed, chunk index, sequence length), so the output
does not depend on the number of workers or on which chunks a resumed run skips.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from data.config import InstanceConfig
from data.documents import Document, SkipCounter
from data.instances import create_instances
from data.segment import clean_text, split_sentences
from data.shards import write_shard

SHARD_PATTERN = "shard-{index:05d}"


@dataclass(frozen=True)
class WorkerContext:
    """What every worker needs, picklable."""

    tokenizer_file: str
    folders: dict[int, str]  # max_seq_length -> output folder
    instances: InstanceConfig
    config_hash: str
    vocab_size: int
    special_ids: dict[str, int]  # pad/unk/cls/sep/mask
    random_token_ids: list[int] = field(default_factory=list)  # for static masking
    batch_size: int = 1000


@dataclass
class ChunkResult:
    """Counts of one chunk, stored beside its shards so a resumed run can skip it."""

    index: int
    config_hash: str
    num_documents: int = 0
    num_sentences: int = 0
    num_text_tokens: int = 0
    text_bytes: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    # per max_seq_length (as str for JSON): shard info + instance statistics
    shards: dict[str, dict] = field(default_factory=dict)


_tokenizer = None  # one per worker process


def _get_tokenizer(path: str):
    global _tokenizer
    if _tokenizer is None:
        from tokenizers import Tokenizer

        _tokenizer = Tokenizer.from_file(path)
        _tokenizer.no_truncation()
        _tokenizer.no_padding()
    return _tokenizer


def sidecar_path(folder: Path, index: int) -> Path:
    return folder / (SHARD_PATTERN.format(index=index) + ".json")


def shard_path(folder: Path, index: int) -> Path:
    return folder / (SHARD_PATTERN.format(index=index) + ".arrow")


def load_finished(context: WorkerContext, index: int) -> ChunkResult | None:
    """The chunk's result when every length's shard was finished by an earlier run with this config."""
    results = []
    for folder in map(Path, context.folders.values()):
        sidecar, shard = sidecar_path(folder, index), shard_path(folder, index)
        if not (sidecar.is_file() and shard.is_file()):
            return None
        try:
            result = ChunkResult(**json.loads(sidecar.read_text()))
        except (ValueError, TypeError):
            return None
        length_key = folder.name.removeprefix("seq")
        info = result.shards.get(length_key)
        if result.config_hash != context.config_hash or info is None:
            return None
        if shard.stat().st_size != info["bytes"]:
            return None
        results.append(result)
    return results[0]


def _write_json_atomic(path: Path, payload: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, path)


def tokenize_documents(
    documents: list[Document], context: WorkerContext, skips: SkipCounter
) -> tuple[list[list[list[int]]], int]:
    """-> (documents as lists of sentences of token ids, bytes of plain text); documents that are
    empty (after wikitext conversion) or too short are skipped and counted."""
    tokenizer = _get_tokenizer(context.tokenizer_file)
    sentences: list[str] = []
    boundaries: list[int] = []  # sentence count per kept document
    text_bytes = 0
    for document in documents:
        text = document.plain_text()
        if not text:
            skips.skip("empty")
            continue
        text_bytes += len(text.encode("utf-8"))
        doc_sentences = split_sentences(clean_text(text))
        if len(doc_sentences) < context.instances.min_sentences_per_document:
            skips.skip("too_few_sentences")
            continue
        sentences.extend(doc_sentences)
        boundaries.append(len(doc_sentences))
    encoded: list[list[int]] = []
    for start in range(0, len(sentences), context.batch_size):
        # encode_batch_fast skips the offset tracking we never use (~20% faster than encode_batch)
        batch = tokenizer.encode_batch_fast(
            sentences[start : start + context.batch_size], add_special_tokens=False
        )
        encoded.extend(e.ids for e in batch)
    tokenized: list[list[list[int]]] = []
    position = 0
    for count in boundaries:
        doc = [ids for ids in encoded[position : position + count] if ids]
        position += count
        if len(doc) < context.instances.min_sentences_per_document:
            skips.skip("too_few_sentences")
            continue
        tokenized.append(doc)
    return tokenized, text_bytes


def _static_masks(instances, context: WorkerContext, max_seq_length: int, index: int):
    from data.masking import load_vocab_tokens, mask_instance_static, word_start_table

    word_starts = None
    if context.instances.whole_word_masking:
        word_starts = word_start_table(load_vocab_tokens(context.tokenizer_file))
    return mask_instance_static(
        instances,
        seed=(context.instances.seed, index, max_seq_length),
        special_ids=context.special_ids,
        vocab_size=context.vocab_size,
        random_token_ids=np.asarray(context.random_token_ids, dtype=np.int64),
        masked_lm_prob=context.instances.masked_lm_prob,
        max_predictions=context.instances.max_predictions(max_seq_length),
        word_starts_table=word_starts,
    )


def process_chunk(index: int, documents: list[Document], context: WorkerContext) -> ChunkResult:
    """Tokenize one chunk of documents and write its shard for every sequence length."""
    skips = SkipCounter()
    tokenized, text_bytes = tokenize_documents(documents, context, skips)
    result = ChunkResult(
        index=index,
        config_hash=context.config_hash,
        num_documents=len(tokenized),
        num_sentences=sum(len(d) for d in tokenized),
        num_text_tokens=sum(len(s) for d in tokenized for s in d),
        text_bytes=text_bytes,
    )
    cfg = context.instances
    for max_seq_length, folder in context.folders.items():
        rng = random.Random(f"{cfg.seed}-{index}-{max_seq_length}")
        instances = create_instances(
            tokenized,
            max_seq_length,
            cfg.short_seq_prob,
            rng,
            cls_id=context.special_ids["cls_id"],
            sep_id=context.special_ids["sep_id"],
            duplicate_factor=cfg.duplicate_factor,
            short_per_chunk=cfg.short_seq_draw == "chunk",
        )
        static = _static_masks(instances, context, max_seq_length, index) if cfg.static_masking else None
        info = write_shard(
            shard_path(Path(folder), index), instances, context.vocab_size, static_masks=static
        )
        lengths = np.fromiter((len(i.input_ids) for i in instances), dtype=np.int64, count=len(instances))
        result.shards[str(max_seq_length)] = {
            **asdict(info),
            "num_random_next": int(sum(i.next_sentence_label for i in instances)),
            "sum_fill_fraction": float((lengths / max_seq_length).sum()),
        }
    result.skipped = skips.as_dict()
    for folder in context.folders.values():
        _write_json_atomic(sidecar_path(Path(folder), index), asdict(result))
    return result
