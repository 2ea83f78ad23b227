"""Typed configuration of the data step, registered in Hydra's ConfigStore.

`conf/prepare.yaml` composes one `conf/data/<name>.yaml`; a misspelt key fails at composition and
cross-field errors raise `ValueError` naming the key. Components get their own section only.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA_ENV = "BERT_SHARED_DATA"


def default_shared_data_dir() -> Path:
    """The shared sample data: $BERT_SHARED_DATA, else `../shared/data` beside the checkout."""
    return Path(os.environ.get(SHARED_DATA_ENV, REPO_ROOT.parent / "shared" / "data"))


if not OmegaConf.has_resolver("repo_root"):
    OmegaConf.register_new_resolver("repo_root", lambda: str(REPO_ROOT))
if not OmegaConf.has_resolver("shared_data"):
    OmegaConf.register_new_resolver("shared_data", lambda: str(default_shared_data_dir()))


class SourceKind(str, enum.Enum):
    hub_wikipedia = "hub_wikipedia"  # datasets.load_dataset("wikimedia/wikipedia", "<date>.en")
    hub_bookcorpus = "hub_bookcorpus"  # datasets.load_dataset of an open BookCorpus (title + text)
    wiki_dump = "wiki_dump"  # *pages-articles*.xml.bz2
    wiki_extracted = "wiki_extracted"  # WikiExtractor output folders (<doc ...> blocks)
    books = "books"  # local plain-text books (.txt / .gz), Project Gutenberg boilerplate stripped


@dataclass
class SourceConfig:
    kind: SourceKind = MISSING
    # Local sources: a file, a folder or a glob. Hub sources: optional local dataset folder/files with
    # the hub schema (offline path); when unset the hub is asked.
    path: str | None = None
    hub_name: str | None = None  # e.g. wikimedia/wikipedia
    hub_config: str | None = None  # e.g. 20231101.en
    split: str = "train"
    streaming: bool = True
    max_documents: int | None = None  # cap for smoke runs; None = all

    def __post_init__(self) -> None:
        local = {SourceKind.wiki_dump, SourceKind.wiki_extracted, SourceKind.books}
        if self.kind in local and not self.path:
            raise ValueError(f"data.sources: a '{self.kind.value}' source needs 'path'")
        if self.max_documents is not None and self.max_documents < 1:
            raise ValueError("data.sources.max_documents must be >= 1 or null")


@dataclass
class TokenizerConfig:
    # Load this WordPiece vocab (one token per line). When null, train one on the corpus.
    vocab_file: str | None = None
    vocab_size: int = 30522  # when training
    min_frequency: int = 2  # when training
    lowercase: bool = True
    batch_size: int = 1000  # sentences per encode_batch call

    def __post_init__(self) -> None:
        if self.vocab_file is None and self.vocab_size < 200:
            raise ValueError("data.tokenizer.vocab_size must be >= 200 to hold the special tokens")


@dataclass
class InstanceConfig:
    """The original BERT `create_pretraining_data` algorithm, one output per sequence length."""

    max_seq_lengths: list[int] = field(default_factory=lambda: [128, 512])
    short_seq_prob: float = 0.1
    # Where the short target is drawn: "chunk" (each chunk of sentences, the default for new preparations)
    # or "document" (once per document, as the original create_pretraining_data does: one draw can make a
    # whole book short, all its pairs random-next; kept for parity and for the committed study's data).
    short_seq_draw: str = "chunk"
    duplicate_factor: int = 1  # passes over each document with different random choices
    min_sentences_per_document: int = 2  # shorter documents are skipped and counted
    seed: int = 12345
    # Static masking writes masked positions into the shards (NVIDIA/DeepSpeed parity); the default
    # is dynamic masking in the training collator.
    static_masking: bool = False
    masked_lm_prob: float = 0.15
    # Max predictions per sequence, as {seq_len: n}; lengths not listed use round(seq_len * prob).
    max_predictions_per_seq: dict[int, int] = field(default_factory=lambda: {128: 20, 512: 80})
    whole_word_masking: bool = False

    def __post_init__(self) -> None:
        if not self.max_seq_lengths or any(n < 8 for n in self.max_seq_lengths):
            raise ValueError("data.instances.max_seq_lengths must be a non-empty list of lengths >= 8")
        if not 0.0 <= self.short_seq_prob <= 1.0:
            raise ValueError("data.instances.short_seq_prob must be in [0, 1]")
        if self.short_seq_draw not in ("chunk", "document"):
            raise ValueError(
                f"data.instances.short_seq_draw must be chunk or document, not {self.short_seq_draw!r}"
            )
        if self.duplicate_factor < 1:
            raise ValueError("data.instances.duplicate_factor must be >= 1")
        if not 0.0 < self.masked_lm_prob < 1.0:
            raise ValueError("data.instances.masked_lm_prob must be in (0, 1)")

    def max_predictions(self, seq_len: int) -> int:
        return int(self.max_predictions_per_seq.get(seq_len, round(seq_len * self.masked_lm_prob)))


@dataclass
class ShardConfig:
    # Documents are grouped into chunks of about this many MB of text; each chunk becomes one shard per
    # sequence length, so memory is bounded by this, not by the corpus. Random NSP B segments come from
    # another document of the same chunk.
    chunk_mb: float = 16.0
    num_workers: int = 2
    output_dir: str = "${repo_root:}/data/prepared/${data.name}"

    def __post_init__(self) -> None:
        if self.chunk_mb <= 0:
            raise ValueError("data.shards.chunk_mb must be > 0")
        if self.num_workers < 0:
            raise ValueError("data.shards.num_workers must be >= 0 (0 = in the main process)")


@dataclass
class DataConfig:
    name: str = MISSING
    sources: list[SourceConfig] = field(default_factory=list)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    instances: InstanceConfig = field(default_factory=InstanceConfig)
    shards: ShardConfig = field(default_factory=ShardConfig)

    def __post_init__(self) -> None:
        if not self.sources:
            raise ValueError("data.sources is empty: name at least one corpus")


@dataclass
class PrepareConfig:
    data: DataConfig = MISSING
    shared_data: str = "${shared_data:}"
    show_progress: bool = True


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="prepare_schema", node=PrepareConfig)
    cs.store(group="data", name="data_schema", node=DataConfig)


register_configs()


def to_object(cfg) -> PrepareConfig:
    """DictConfig -> dataclasses, once; runs every `__post_init__` check."""
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, PrepareConfig)
    return obj
