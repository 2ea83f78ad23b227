"""Data-preparation benchmark: raw text -> shards on the shared sample.

Records (results/bench/data_prep.json):
- end-to-end MB/s of document text -> shards, peer = reading/extracting the same documents only
  (ratio = how much of the read speed survives segmentation, tokenization and instance creation);
- tokenization tokens/s of our batch encoder, peer = the transformers tokenizer call on the same
  sentences;
- peak RSS (sum over the process tree) on the sample and on the sample repeated 10x (must stay flat);
- NSP random-next rate, mean non-pad fraction at 128 and 512, instances per MB.

    python -m bench data_prep [--quick]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from bench.records import Record, results_name, write_records
from data.config import REPO_ROOT, default_shared_data_dir


def _peak_rss_of(cmd: list[str]) -> tuple[float, float]:
    """Run cmd; return (seconds, peak RSS in bytes summed over it and its children)."""
    started = time.perf_counter()
    process = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    root = psutil.Process(process.pid)
    peak = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            try:
                procs = [root, *root.children(recursive=True)]
                peak = max(peak, sum(p.memory_info().rss for p in procs if p.is_running()))
            except psutil.Error:
                pass
            time.sleep(0.05)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    _, stderr = process.communicate()
    done.set()
    thread.join()
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{stderr.decode()[-2000:]}")
    return time.perf_counter() - started, float(peak)


def _prepare_cmd(out: Path, repeat: int, lengths: str, workers: int) -> list[str]:
    sources = ["wiki_dump", "wiki_extracted", "books"]
    shared = default_shared_data_dir()
    paths = {
        "wiki_dump": shared
        / "wikipedia/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2",
        "wiki_extracted": shared / "wikipedia/extracted",
        "books": shared / "books/gutenberg",
    }
    listing = ",".join(f"{{kind:{k},path:'{paths[k]}'}}" for _ in range(repeat) for k in sources)
    return [
        sys.executable,
        "-m",
        "data.prepare",
        "data=sample",
        f"data.sources=[{listing}]",
        f"data.shards.output_dir={out}",
        f"data.instances.max_seq_lengths={lengths}",
        f"data.shards.num_workers={workers}",
        "show_progress=false",
    ]


def _read_only_seconds() -> tuple[float, int]:
    from data.config import SourceConfig, SourceKind
    from data.documents import SkipCounter
    from data.sources import iter_documents

    shared = default_shared_data_dir()
    sources = [
        SourceConfig(kind=SourceKind.wiki_dump, path=str(next((shared / "wikipedia").glob("*.bz2")))),
        SourceConfig(kind=SourceKind.wiki_extracted, path=str(shared / "wikipedia/extracted")),
        SourceConfig(kind=SourceKind.books, path=str(shared / "books/gutenberg")),
    ]
    started = time.perf_counter()
    num_bytes = sum(len(d.text) for d in iter_documents(sources, SkipCounter()))
    return time.perf_counter() - started, num_bytes


def _tokenization(records: list[Record]) -> None:
    from tokenizers import Tokenizer

    from data.config import SourceConfig, SourceKind, TokenizerConfig
    from data.documents import SkipCounter
    from data.segment import clean_text, split_sentences
    from data.sources import iter_documents
    from data.tokenizer import build_tokenizer

    shared = default_shared_data_dir()
    docs = iter_documents(
        [SourceConfig(kind=SourceKind.books, path=str(shared / "books/gutenberg"))], SkipCounter()
    )
    sentences = [s for d in docs for s in split_sentences(clean_text(d.text))]
    hf = build_tokenizer(TokenizerConfig(vocab_file=str(shared / "vocab/bert-base-uncased-vocab.txt")))
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        ours = Tokenizer.from_file(str(Path(tmp) / "tokenizer.json"))
    started = time.perf_counter()
    num_tokens = 0
    for i in range(0, len(sentences), 1000):
        num_tokens += sum(
            len(e.ids) for e in ours.encode_batch_fast(sentences[i : i + 1000], add_special_tokens=False)
        )
    ours_seconds = time.perf_counter() - started
    started = time.perf_counter()
    for i in range(0, len(sentences), 1000):
        hf(sentences[i : i + 1000], add_special_tokens=False)
    peer_seconds = time.perf_counter() - started
    records.append(
        Record(
            "tokenization_tokens_per_s",
            num_tokens / ours_seconds,
            "tokens/s",
            peer="transformers BertTokenizerFast __call__",
            peer_value=num_tokens / peer_seconds,
            config={"sentences": len(sentences), "tokens": num_tokens},
        )
    )


def main(argv: list[str]) -> None:
    quick = "--quick" in argv
    records: list[Record] = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "sample"
        seconds, peak = _peak_rss_of(_prepare_cmd(out, 1, "[128,512]", 2))
        manifests = {n: json.loads((out / f"seq{n}/manifest.json").read_text()) for n in (128, 512)}
        text_mb = manifests[128]["text_bytes"] / 1e6
        read_seconds, _ = _read_only_seconds()
        records.append(
            Record(
                "prepare_end_to_end_MB_per_s",
                text_mb / seconds,
                "MB/s",
                peer="read+extract documents only",
                peer_value=text_mb / read_seconds,
                target=">= 4 MB/s on 2 cores",
                config={
                    "text_MB": text_mb,
                    "seconds": seconds,
                    "num_workers": 2,
                    "lengths": [128, 512],
                    "note": "wall time of the whole command, including interpreter and tokenizer start-up",
                },
            )
        )
        records.append(Record("prepare_peak_rss_MB", peak / 1e6, "MB", target="<= 1500 MB"))
        for n, manifest in manifests.items():
            records.append(
                Record(
                    f"nsp_random_next_rate_seq{n}",
                    manifest["num_random_next"] / manifest["num_instances"],
                    "fraction",
                    target="~0.5",
                )
            )
            records.append(
                Record(f"mean_non_pad_fraction_seq{n}", manifest["mean_fill_fraction"], "fraction")
            )
            records.append(
                Record(f"instances_per_MB_seq{n}", manifest["num_instances"] / text_mb, "instances/MB")
            )
        if not quick:
            out10 = Path(tmp) / "sample10"
            seconds10, peak10 = _peak_rss_of(_prepare_cmd(out10, 10, "[128]", 2))
            text_mb10 = json.loads((out10 / "seq128/manifest.json").read_text())["text_bytes"] / 1e6
            records.append(
                Record(
                    "prepare_end_to_end_MB_per_s_10x_corpus",
                    text_mb10 / seconds10,
                    "MB/s",
                    peer="read+extract documents only (1x corpus)",
                    peer_value=text_mb / read_seconds,
                    target=">= 4 MB/s on 2 cores",
                    config={
                        "text_MB": text_mb10,
                        "seconds": seconds10,
                        "num_workers": 2,
                        "lengths": [128],
                        "note": "steady state: start-up is amortized over 10x the sample",
                    },
                )
            )
            records.append(
                Record(
                    "prepare_peak_rss_10x_corpus_MB",
                    peak10 / 1e6,
                    "MB",
                    peer="peak RSS on the 1x corpus",
                    peer_value=peak / 1e6,
                    target="ratio ~1 (flat), <= 1500 MB",
                    config={"seconds": seconds10, "lengths": [128]},
                )
            )
    _tokenization(records)
    write_records(results_name("data_prep", quick), records)


if __name__ == "__main__":
    main(sys.argv[1:])
