"""Hugging Face `datasets` sources: the users' path to the real corpora, kept thin.

`datasets` is imported inside the readers: it is slow to import and only these two sources need it.
With `cfg.path` set, a local copy with the hub schema is read instead of asking the hub: a folder
written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`, or data files (parquet, json/jsonl,
arrow, csv; a file, a folder of them or a glob) read through `datasets.load_dataset`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from data.config import SourceConfig
from data.documents import DataError, Document, SkipCounter
from data.hub_access import load_from_hub
from data.sources.books import join_paragraphs
from data.sources.files import one_line

# Required columns: wikimedia/wikipedia has id, url, title, text; the open BookCorpus
# (lucadiliello/bookcorpusopen) has title, text.
WIKIPEDIA_COLUMNS = ("title", "text")
BOOKCORPUS_COLUMNS = ("title", "text")
_BUILDER_OF_SUFFIX = {
    ".parquet": "parquet",
    ".json": "json",
    ".jsonl": "json",
    ".arrow": "arrow",
    ".csv": "csv",
}
_SAVED_DATASET_FILES = ("state.json", "dataset_dict.json")
PREPARE_WAYS_FORWARD = (
    "either prepare on a machine with network access into a shared folder (make prepare "
    "DATA=<config> ARGS='data.shards.output_dir=<shared>/prepared') and pretrain from it "
    "(ARGS='data_dir=<shared>/prepared'), or read a local copy: this source's 'path:' (a save_to_disk "
    "folder or parquet/json files with the hub's columns) or raw dumps (source kind wiki_dump, books)"
)


def read_hub_wikipedia(cfg: SourceConfig, skips: SkipCounter) -> Iterator[Document]:
    """Articles of a `wikimedia/wikipedia`-schema dataset (columns title, text; id used when present).

    The article text has one paragraph per line already; blank lines are dropped. Counts "empty".
    Raises DataError when the dataset cannot be found or lacks a required column.
    """
    yield from _read(cfg, skips, WIKIPEDIA_COLUMNS, _lines_as_paragraphs)


def read_hub_bookcorpus(cfg: SourceConfig, skips: SkipCounter) -> Iterator[Document]:
    """Books of an open-BookCorpus-schema dataset (one row per book: title, text).

    Hard-wrapped lines are joined into paragraphs as for local books. Counts "empty". Raises
    DataError when the dataset cannot be found or lacks a required column.
    """
    yield from _read(cfg, skips, BOOKCORPUS_COLUMNS, join_paragraphs)


def _lines_as_paragraphs(text: str) -> str:
    return "\n".join(line for line in (raw.strip() for raw in text.splitlines()) if line)


def _read(
    cfg: SourceConfig, skips: SkipCounter, columns: tuple[str, ...], to_paragraphs: Callable[[str], str]
) -> Iterator[Document]:
    name, records = _load(cfg)
    _check_columns(name, getattr(records, "column_names", None), columns)
    for index, record in enumerate(records):
        if index == 0:
            _check_columns(name, record.keys(), columns)
        text = record["text"]
        if text is not None and not isinstance(text, str):
            raise DataError(f"{name}: column 'text' holds {type(text).__name__}, not str (row {index})")
        paragraphs = to_paragraphs(text or "")
        if not paragraphs:
            skips.skip("empty")
            continue
        identifier = record.get("id", index)
        yield Document(title=str(record["title"] or ""), text=paragraphs, source=f"{name}#{identifier}")


def _check_columns(name: str, present: Iterable[str] | None, required: tuple[str, ...]) -> None:
    if present is None:  # a streaming dataset whose features are only known from its rows
        return
    present = set(present)
    for column in required:
        if column not in present:
            raise DataError(f"{name}: no column '{column}' (has: {', '.join(sorted(present))})")


def _load(cfg: SourceConfig) -> tuple[str, Iterable[Mapping[str, Any]]]:
    """(name for messages, the rows) of the configured split, from the hub or the local copy."""
    import datasets

    if cfg.path:
        return cfg.path, _load_local(cfg, datasets)
    if not cfg.hub_name:
        raise DataError(f"a '{cfg.kind.value}' source needs 'hub_name' or 'path'")
    name = cfg.hub_name if cfg.hub_config is None else f"{cfg.hub_name}/{cfg.hub_config}"
    try:
        records = load_from_hub(
            lambda: datasets.load_dataset(
                cfg.hub_name, cfg.hub_config, split=cfg.split, streaming=cfg.streaming
            ),
            name,
            PREPARE_WAYS_FORWARD,
        )
    except DataError:
        raise
    except (FileNotFoundError, ValueError) as error:
        raise DataError(f"{name}: cannot load split '{cfg.split}': {one_line(error)}") from error
    return name, records


def _load_local(cfg: SourceConfig, datasets: Any) -> Iterable[Mapping[str, Any]]:
    assert cfg.path is not None
    location = Path(cfg.path).expanduser()
    is_glob = any(character in cfg.path for character in "*?[")
    if not location.exists() and not is_glob:
        raise DataError(f"{location} does not exist")
    try:
        if location.is_dir() and any((location / marker).is_file() for marker in _SAVED_DATASET_FILES):
            loaded = datasets.load_from_disk(str(location))
            if isinstance(loaded, datasets.DatasetDict):
                if cfg.split not in loaded:
                    raise DataError(f"{location}: no split '{cfg.split}' (has: {', '.join(loaded)})")
                loaded = loaded[cfg.split]
            return loaded
        if location.is_dir():
            return datasets.load_dataset(str(location), split=cfg.split, streaming=cfg.streaming)
        builder = _BUILDER_OF_SUFFIX.get(_data_suffix(location))
        if builder is None:
            raise DataError(f"{cfg.path}: unknown data file type (expected {', '.join(_BUILDER_OF_SUFFIX)})")
        return datasets.load_dataset(
            builder, data_files={cfg.split: str(location)}, split=cfg.split, streaming=cfg.streaming
        )
    except DataError:
        raise
    except (FileNotFoundError, ValueError) as error:
        raise DataError(f"{cfg.path}: cannot load split '{cfg.split}': {one_line(error)}") from error


def _data_suffix(path: Path) -> str:
    """`part-0.jsonl.gz` -> `.jsonl`: compressed data files are read by the same builder."""
    suffixes = [suffix for suffix in path.suffixes if suffix not in (".gz", ".bz2", ".zst", ".xz")]
    return suffixes[-1] if suffixes else ""
