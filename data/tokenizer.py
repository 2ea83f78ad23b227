"""WordPiece tokenizer: load a BERT vocab or train one on the corpus; saved as `tokenizer.json`.

The saved folder loads with `transformers.AutoTokenizer.from_pretrained(folder)` (or
`BertTokenizerFast(tokenizer_file=...)`), which is how the trainer and fine-tuning get it back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from transformers import BertTokenizerFast, PreTrainedTokenizerBase  # type: ignore[attr-defined]

from data.config import TokenizerConfig
from data.documents import DataError
from data.shards import file_sha256

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def load_vocab_file(path: str | Path) -> dict[str, int]:
    """One token per line, id = line number. Errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data.tokenizer.vocab_file: {path} does not exist")
    vocab: dict[str, int] = {}
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            try:
                token = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError:
                raise DataError(f"{path}:{line_number}: vocab line is not UTF-8") from None
            if not token:
                raise DataError(f"{path}:{line_number}: empty vocab line")
            if token in vocab:
                raise DataError(f"{path}:{line_number}: duplicate vocab token {token!r}")
            vocab[token] = line_number - 1
    missing = [t for t in SPECIAL_TOKENS if t not in vocab]
    if missing:
        raise DataError(f"{path}: vocab lacks the special tokens {missing}")
    return vocab


def canonical_vocab(tokens: Iterable[str]) -> dict[str, int]:
    """Ids in an order that depends only on the set of tokens: the special tokens first (ids 0-4), then
    the single characters, then their `##` forms, then every longer piece, each block by code point.

    HF tokenizers' WordPiece trainer learns the same set of tokens on every run but numbers them in its
    hash maps' order, which is seeded per process (tokenizers#1794): two preparations of one corpus would
    otherwise give different ids, different shards and checkpoints that cannot share an embedding."""
    rest = set(tokens) - set(SPECIAL_TOKENS)

    def block(token: str) -> int:  # 0: a character, 1: `##` and a character, 2: anything longer
        if len(token) == 1:
            return 0
        return 1 if len(token) == 3 and token.startswith("##") else 2

    ordered = SPECIAL_TOKENS + sorted(rest, key=lambda token: (block(token), token))
    return {token: index for index, token in enumerate(ordered)}


def continuation_tokens(texts: Iterable[str], lowercase: bool) -> list[str]:
    """`##c` for every character c of the normalized corpus (whitespace aside), sorted."""
    from tokenizers import normalizers

    normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    alphabet: set[str] = set()
    for text in texts:
        alphabet.update(normalizer.normalize_str(text))
    return [f"##{c}" for c in sorted(alphabet) if not c.isspace()]


def train_vocab(texts: Callable[[], Iterable[str]], cfg: TokenizerConfig) -> dict[str, int]:
    """Train a BERT-style WordPiece vocab (same normalizer and pre-tokenizer as BERT's) on the texts that
    `texts()` yields (called twice), numbered in the canonical order (`canonical_vocab`).

    The same corpus gives the same vocabulary and ids on every run. HF's trainer numbers the `##`
    continuation pieces in hash-map order as it meets them and breaks ties between equally frequent merges
    by those numbers, so even the set of tokens varies between runs (tokenizers#1794, fixed upstream by the
    open PR #2066). A first pass over the corpus collects its alphabet, and every `##c` is handed to the
    trainer up front with a fixed number; the trainer then meets no new token in hash order. The price is
    that pass and a `##` form for every character, used or not (BERT's own vocabulary has them too)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=cfg.lowercase)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=SPECIAL_TOKENS + continuation_tokens(texts(), cfg.lowercase),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts(), trainer=trainer)
    # the trained Tokenizer (which would treat the `##c` as added special tokens) is dropped: only the
    # vocabulary is kept, and `make_tokenizer` builds BERT's tokenizer from it
    return canonical_vocab(tokenizer.get_vocab())


def make_tokenizer(vocab: dict[str, int], lowercase: bool) -> BertTokenizerFast:
    return BertTokenizerFast(vocab=vocab, do_lower_case=lowercase)


def build_tokenizer(
    cfg: TokenizerConfig, texts: Callable[[], Iterable[str]] | None = None
) -> BertTokenizerFast:
    """Load `cfg.vocab_file`, or train on the corpus `texts()` yields when it is null."""
    if cfg.vocab_file is not None:
        return make_tokenizer(load_vocab_file(cfg.vocab_file), cfg.lowercase)
    if texts is None:
        raise ValueError("data.tokenizer.vocab_file is null, so a corpus is needed to train the vocab")
    return make_tokenizer(train_vocab(texts, cfg), cfg.lowercase)


def tokenizer_info(tokenizer: PreTrainedTokenizerBase, tokenizer_file: Path) -> dict:
    """The manifest's `tokenizer` section."""
    return {
        "file": tokenizer_file.name,
        "sha256": file_sha256(tokenizer_file),
        "vocab_size": len(tokenizer),
        "pad_id": tokenizer.pad_token_id,
        "unk_id": tokenizer.unk_token_id,
        "cls_id": tokenizer.cls_token_id,
        "sep_id": tokenizer.sep_token_id,
        "mask_id": tokenizer.mask_token_id,
        "lowercase": bool(getattr(tokenizer, "do_lower_case", True)),
    }


def load_prepared_tokenizer(folder: str | Path) -> BertTokenizerFast:
    """The tokenizer saved beside prepared shards (what the trainer uses)."""
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise DataError(f"{folder}: no tokenizer.json (is this a prepared data folder?)")
    return BertTokenizerFast(tokenizer_file=str(path))
