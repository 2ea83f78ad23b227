"""`python -m data.prepare data=<name>` (or `make prepare DATA=<name>`): corpora -> shards + manifest.

Examples:
    python -m data.prepare data=sample                       # ../shared/data -> data/prepared/sample/
    python -m data.prepare data=tiny data.shards.num_workers=0
    python -m data.prepare data=wikipedia_bookcorpus         # the hub datasets (network)

Output per sequence length: data/prepared/<name>/seq<L>/{shard-*.arrow, tokenizer.json, manifest.json}.
Shards, sidecars and the manifest are written atomically; a re-run with the same config skips the
chunks that are finished, and the manifest is written last, so a folder with a manifest is complete.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from data import pipeline
from data.config import DataConfig, PrepareConfig, to_object
from data.documents import DataError, Document, SkipCounter
from data.shards import write_manifest
from data.sources import iter_documents
from data.tokenizer import build_tokenizer, tokenizer_info
from launch import cli

log = logging.getLogger("data.prepare")
FORMAT_VERSION = 1


def chunk_documents(documents: Iterable[Document], chunk_bytes: int) -> Iterator[list[Document]]:
    """Group documents into chunks of about `chunk_bytes` of text. A short last chunk (fewer than two
    documents or under half the size) is merged into the one before, so every chunk can draw random
    NSP segments from another document."""
    previous: list[Document] | None = None
    current: list[Document] = []
    size = 0
    for document in documents:
        current.append(document)
        size += len(document.text)
        if size >= chunk_bytes:
            if previous is not None:
                yield previous
            previous, current, size = current, [], 0
    if previous is not None and (len(current) < 2 or size < chunk_bytes // 2):
        yield previous + current
    else:
        if previous is not None:
            yield previous
        if current:
            yield current


def config_hash(data: DataConfig, tokenizer_sha256: str) -> str:
    """What determines the shards' bytes: everything but worker count and output folder."""
    resolved = asdict(data)
    resolved["shards"] = {"chunk_mb": data.shards.chunk_mb}
    for source in resolved["sources"]:
        source["kind"] = str(source["kind"].value if hasattr(source["kind"], "value") else source["kind"])
    payload = json.dumps(
        {"data": resolved, "tokenizer": tokenizer_sha256, "format": FORMAT_VERSION},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def _save_tokenizer(tokenizer, folder: Path) -> Path:
    """save_pretrained into a temp folder, then move the files in (never a half-written tokenizer)."""
    with tempfile.TemporaryDirectory(dir=folder, prefix=".tokenizer.") as tmp:
        tokenizer.save_pretrained(tmp)
        for file in Path(tmp).iterdir():
            file.replace(folder / file.name)
    return folder / "tokenizer.json"


def _random_token_ids(tokenizer) -> list[int]:
    special = set(tokenizer.all_special_ids)
    vocab = tokenizer.get_vocab()
    return sorted(
        i for t, i in vocab.items() if i not in special and not (t.startswith("[") and t.endswith("]"))
    )


class _Runner:
    """Feeds chunks to a pool with a bounded window (memory ~ window x chunk size) and yields results
    in chunk order. `before_first_write` runs once, before the first chunk that must be computed."""

    def __init__(
        self,
        context: pipeline.WorkerContext,
        num_workers: int,
        before_first_write: Callable[[], None] = lambda: None,
    ):
        self.context = context
        self.before_first_write = before_first_write
        self.wrote = False
        self.window = max(1, 2 * num_workers)
        self.pool = (
            ProcessPoolExecutor(num_workers, mp_context=multiprocessing.get_context("spawn"))
            if num_workers > 0
            else None
        )

    def run(self, chunks: Iterable[list[Document]]) -> Iterator[tuple[pipeline.ChunkResult, bool]]:
        """Yields (result, computed): computed is False for a chunk reused from an earlier run."""
        pending: deque[tuple[Future | pipeline.ChunkResult, bool]] = deque()
        for index, documents in enumerate(chunks):
            finished = pipeline.load_finished(self.context, index)
            if finished is not None:
                pending.append((finished, False))
            else:
                if not self.wrote:
                    self.before_first_write()
                    self.wrote = True
                if self.pool is None:
                    pending.append((pipeline.process_chunk(index, documents, self.context), True))
                else:
                    pending.append(
                        (self.pool.submit(pipeline.process_chunk, index, documents, self.context), True)
                    )
            while len(pending) >= self.window or (pending and not isinstance(pending[0][0], Future)):
                yield self._pop(pending)
        while pending:
            yield self._pop(pending)

    @staticmethod
    def _pop(pending) -> tuple[pipeline.ChunkResult, bool]:
        item, computed = pending.popleft()
        return (item.result() if isinstance(item, Future) else item), computed

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)


def _build_manifest(
    max_seq_length: int,
    results: list[pipeline.ChunkResult],
    cfg: PrepareConfig,
    tokenizer_section: dict,
    read_skips: SkipCounter,
    hash_: str,
) -> dict:
    key = str(max_seq_length)
    shards = [
        {k: r.shards[key][k] for k in ("file", "num_instances", "num_tokens", "sha256", "bytes")}
        for r in results
    ]
    num_instances = sum(s["num_instances"] for s in shards)
    skipped = SkipCounter(read_skips)
    for r in results:
        skipped.update(r.skipped)
    return {
        "format": "bert-lamb-shards",
        "version": FORMAT_VERSION,
        "max_seq_length": max_seq_length,
        "static_masking": cfg.data.instances.static_masking,
        "max_predictions_per_seq": cfg.data.instances.max_predictions(max_seq_length),
        "tokenizer": tokenizer_section,
        "shards": shards,
        "num_documents": sum(r.num_documents for r in results),
        "num_sentences": sum(r.num_sentences for r in results),
        "num_text_tokens": sum(r.num_text_tokens for r in results),
        "text_bytes": sum(r.text_bytes for r in results),
        "num_instances": num_instances,
        "num_tokens": sum(s["num_tokens"] for s in shards),
        "num_random_next": sum(r.shards[key]["num_random_next"] for r in results),
        "mean_fill_fraction": sum(r.shards[key]["sum_fill_fraction"] for r in results)
        / max(1, num_instances),
        "skipped": skipped.as_dict(),
        "config_hash": hash_,
        "config": OmegaConf.to_container(OmegaConf.structured(cfg.data), resolve=True),
    }


def _remove_stale(folder: Path, num_chunks: int) -> None:
    """Shards of an earlier, longer run with another config: ours to delete, never listed."""
    for path in folder.glob(".shard-*.tmp"):  # left by a process killed mid-write
        path.unlink()
    for path in folder.glob("shard-*.*"):
        try:
            index = int(path.name.split("-")[1].split(".")[0])
        except ValueError:
            continue
        if index >= num_chunks:
            path.unlink()


def prepare(cfg: PrepareConfig) -> dict[int, Path]:
    """Run the whole data step; returns {max_seq_length: folder}."""
    data = cfg.data
    started = time.perf_counter()
    out_root = Path(data.shards.output_dir)
    out_root.mkdir(parents=True, exist_ok=True)

    texts = None
    if data.tokenizer.vocab_file is None:  # passes over the corpus train the vocab (`train_vocab`)

        def texts() -> Iterator[str]:
            return (d.text for d in iter_documents(data.sources, SkipCounter()))

    tokenizer = build_tokenizer(data.tokenizer, texts)
    folders = {length: out_root / f"seq{length}" for length in data.instances.max_seq_lengths}
    # The tokenizer waits in a staging folder: a run that fails before writing anything (a bad corpus,
    # found while reading the first chunk) leaves an earlier complete output of another config intact.
    staging = Path(tempfile.mkdtemp(dir=out_root, prefix=".tokenizer."))
    try:
        return _prepare(cfg, tokenizer, folders, staging, started)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _commit_output(folders: dict[int, Path], staging: Path, hash_: str) -> None:
    """Before this run's first write: its tokenizer goes into every folder, and a manifest of another
    config goes (it must not outlive its shards)."""
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=True)
        stale = folder / "manifest.json"
        if stale.is_file() and json.loads(stale.read_text() or "{}").get("config_hash") != hash_:
            stale.unlink()
        for file in staging.iterdir():
            temporary = folder / f".{file.name}.tmp"
            shutil.copyfile(file, temporary)
            os.replace(temporary, folder / file.name)


def _prepare(
    cfg: PrepareConfig, tokenizer, folders: dict[int, Path], staging: Path, started: float
) -> dict[int, Path]:
    data = cfg.data
    out_root = Path(data.shards.output_dir)
    tokenizer_section = tokenizer_info(tokenizer, _save_tokenizer(tokenizer, staging))
    hash_ = config_hash(data, tokenizer_section["sha256"])

    context = pipeline.WorkerContext(
        tokenizer_file=str(staging / "tokenizer.json"),
        folders={length: str(folder) for length, folder in folders.items()},
        instances=data.instances,
        config_hash=hash_,
        vocab_size=tokenizer_section["vocab_size"],
        special_ids={k: v for k, v in tokenizer_section.items() if k.endswith("_id")},
        random_token_ids=_random_token_ids(tokenizer) if data.instances.static_masking else [],
        batch_size=data.tokenizer.batch_size,
    )
    read_skips = SkipCounter()
    documents = iter_documents(data.sources, read_skips, defer_wikitext=True)
    chunks = chunk_documents(documents, int(data.shards.chunk_mb * 1e6))
    results: list[pipeline.ChunkResult] = []
    runner = _Runner(context, data.shards.num_workers, lambda: _commit_output(folders, staging, hash_))
    bar = tqdm(unit="B", unit_scale=True, desc=f"prepare {data.name}", disable=not cfg.show_progress)
    num_reused = 0
    try:
        for result, computed in runner.run(chunks):
            results.append(result)
            num_reused += not computed
            bar.update(result.text_bytes)
            bar.set_postfix(docs=sum(r.num_documents for r in results), chunks=len(results))
    finally:
        runner.close()
        bar.close()

    if not results or sum(r.num_documents for r in results) == 0:
        skipped = SkipCounter(read_skips)
        for result in results:
            skipped.update(result.skipped)
        sources = ", ".join(f"{s.kind.value} {s.path or s.hub_name}" for s in data.sources)
        raise DataError(
            f"data '{data.name}': the sources produced no usable documents (skipped: "
            f"{skipped.as_dict()}; data.sources: {sources})"
        )
    if not runner.wrote:  # every chunk reused from an earlier run of this config
        _commit_output(folders, staging, hash_)
    for length, folder in folders.items():
        manifest = _build_manifest(length, results, cfg, tokenizer_section, read_skips, hash_)
        if manifest["num_instances"] == 0:
            raise DataError(
                f"data '{data.name}': no seq{length} instances from {manifest['num_documents']} documents"
            )
        manifest["seconds"] = round(time.perf_counter() - started, 3)
        _remove_stale(folder, len(results))
        write_manifest(folder, manifest)
    elapsed = time.perf_counter() - started
    total_bytes = sum(r.text_bytes for r in results)
    log.info(
        "prepared %s: %d documents, %.1f MB text in %.1f s (%.2f MB/s), %d chunks (%d reused) -> %s",
        data.name,
        sum(r.num_documents for r in results),
        total_bytes / 1e6,
        elapsed,
        total_bytes / 1e6 / max(elapsed, 1e-9),
        len(results),
        num_reused,
        out_root,
    )
    return folders


def prepare_in_subprocess(output_dir: str | Path, *overrides: str) -> Path:
    """Run `python -m data.prepare` with `overrides` into `output_dir` (tests and benchmarks)."""
    import subprocess

    command = [
        sys.executable,
        "-m",
        "data.prepare",
        f"data.shards.output_dir={output_dir}",
        "show_progress=false",
    ]
    subprocess.run(
        [*command, *overrides], cwd=Path(__file__).resolve().parents[1], check=True, capture_output=True
    )
    return Path(output_dir)


@hydra.main(config_path="../conf", config_name="prepare", version_base="1.3")
def main(dict_cfg: DictConfig) -> None:
    try:
        cfg = to_object(dict_cfg)
        for length, folder in prepare(cfg).items():
            manifest = json.loads((folder / "manifest.json").read_text())
            num_shards = len(manifest["shards"])
            print(f"seq{length}: {manifest['num_instances']} instances in {num_shards} shards -> {folder}")
    except (DataError, ValueError) as error:
        cli.fail("data.prepare", error)


if __name__ == "__main__":
    cli.run(main, "data.prepare")
