"""A smaller WordPiece vocabulary cut from a prepared folder's vocabulary by token frequency.

    python -m data.vocab_subset data/prepared/sample/seq128 8192 data/prepared/vocab/sample-8192.txt

Keeps, in the original vocabulary's order: the special tokens; both forms (`c`, `##c`) of every
character that occurs in the folder's tokens, so every word still tokenizes (WordPiece falls back to
characters); then the tokens that occur most often in the folder's shards, ties broken by the original
order, up to the size. Deterministic: the same folder gives the same file, so a preparation with it
(`data.tokenizer.vocab_file=...`) is reproducible, unlike a trained vocabulary (HF tokenizers' trainer
assigns ids in hash-map order, tokenizers#1794).

Used by the CPU study (results/cpu-study/) to keep a small BERT's vocabulary in proportion to its size:
the decoder and the embedding gradient of a 30K vocabulary dominate a 2-layer model's step.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

from data.dataset import PretrainingDataset
from data.documents import DataError
from data.tokenizer import SPECIAL_TOKENS, load_prepared_tokenizer

CONTINUATION = "##"


def token_frequencies(folder: Path, vocab_size: int) -> np.ndarray:
    """Occurrences of every token id over all instances of a prepared folder."""
    dataset = PretrainingDataset(folder)
    counts = np.zeros(vocab_size, dtype=np.int64)
    for index in range(len(dataset)):
        counts += np.bincount(dataset[index]["input_ids"].astype(np.int64), minlength=vocab_size)
    return counts


def subset_vocabulary(vocab: list[str], counts: np.ndarray, size: int) -> list[str]:
    """The kept tokens in their original order (module docstring)."""
    if size < len(SPECIAL_TOKENS) + 2:
        raise ValueError(f"size must be at least {len(SPECIAL_TOKENS) + 2}, got {size}")
    keep = {token for token in SPECIAL_TOKENS if token in vocab}
    seen = [token for token, count in zip(vocab, counts) if count > 0]
    characters = {ch for token in seen for ch in token.removeprefix(CONTINUATION) if token not in keep}
    index = {token: i for i, token in enumerate(vocab)}
    for ch in sorted(characters):
        keep.update(form for form in (ch, CONTINUATION + ch) if form in index)
    if len(keep) > size:
        raise ValueError(f"{len(keep)} special and character tokens do not fit in {size}")
    by_frequency = sorted(range(len(vocab)), key=lambda i: (-int(counts[i]), i))
    for i in by_frequency:
        if len(keep) >= size or counts[i] == 0:
            break
        keep.add(vocab[i])
    return [token for token in vocab if token in keep]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m data.vocab_subset", description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path, help="a prepared folder (data/prepared/<name>/seq<L>)")
    parser.add_argument("size", type=int, help="tokens to keep")
    parser.add_argument("output", type=Path, help="the vocab file to write (one token per line)")
    args = parser.parse_args(argv)
    try:
        tokenizer = load_prepared_tokenizer(args.folder)
        vocab = sorted(tokenizer.get_vocab(), key=tokenizer.get_vocab().get)
        tokens = subset_vocabulary(vocab, token_frequencies(args.folder, len(vocab)), args.size)
    except (DataError, ValueError) as error:
        print(f"vocab_subset: error: {error}", file=sys.stderr)
        return 2
    args.output.parent.mkdir(parents=True, exist_ok=True)
    temporary = args.output.with_name(f".{args.output.name}.tmp-{os.getpid()}")
    temporary.write_text("".join(token + "\n" for token in tokens), encoding="utf-8")
    os.replace(temporary, args.output)
    print(f"vocab_subset: {len(tokens)} of {len(vocab)} tokens -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
