"""The shard format: the documented boundary between data preparation and training.

A prepared folder (one per max_seq_length) holds:

    shard-00000.arrow ...  Arrow IPC *files*, uncompressed so they can be memory-mapped, one record
                           batch each. Columns, one row per instance:
                             input_ids            list<uint16> (list<int32> when vocab_size > 65535):
                                                  [CLS] A [SEP] B [SEP], unpadded; with static masking
                                                  the tokens are already masked
                             num_a_tokens         int16: len(A) + 2, the tokens of segment 0
                             next_sentence_label  int8: 0 = true continuation, 1 = random B
                           with static masking also
                             masked_lm_positions  list<int16>: ascending masked positions
                             masked_lm_ids        list<same as input_ids>: original ids there
    tokenizer.json         the WordPiece tokenizer the ids come from
    manifest.json          written last: a folder with a manifest is complete. Keys read here:
                           format ("bert-lamb-shards"), version (1), max_seq_length, static_masking,
                           tokenizer {file, sha256, vocab_size, pad_id, cls_id, sep_id, mask_id,
                           unk_id}, shards [{file, num_instances, num_tokens, sha256, bytes}],
                           num_instances. The preparation step adds counts, the config and skips.

Every file is written atomically (temp name in the same folder, fsync, `os.replace`), so a crash
never leaves a partial file under its final name.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from data.documents import DataError

MANIFEST_FORMAT = "bert-lamb-shards"
MANIFEST_VERSION = 1
MANIFEST_NAME = "manifest.json"
SHARD_NAME = "shard-{index:05d}.arrow"
UINT16_MAX_VOCAB = 65535  # vocabularies up to this size store ids as uint16

REQUIRED_KEYS = (
    "format",
    "version",
    "max_seq_length",
    "static_masking",
    "tokenizer",
    "shards",
    "num_instances",
)
TOKENIZER_KEYS = ("file", "sha256", "vocab_size", "pad_id", "cls_id", "sep_id", "mask_id", "unk_id")
SHARD_KEYS = ("file", "num_instances", "num_tokens", "sha256", "bytes")


@dataclass(frozen=True)
class ShardInfo:
    """One shard as listed in the manifest. `file` is the name relative to the folder."""

    file: str
    num_instances: int
    num_tokens: int
    sha256: str
    bytes: int


def shard_name(index: int) -> str:
    return SHARD_NAME.format(index=index)


def token_type(vocab_size: int) -> pa.DataType:
    return pa.uint16() if vocab_size <= UINT16_MAX_VOCAB else pa.int32()


def shard_schema(vocab_size: int, static_masking: bool) -> pa.Schema:
    ids = pa.list_(token_type(vocab_size))
    fields = [
        pa.field("input_ids", ids, nullable=False),
        pa.field("num_a_tokens", pa.int16(), nullable=False),
        pa.field("next_sentence_label", pa.int8(), nullable=False),
    ]
    if static_masking:
        fields += [
            pa.field("masked_lm_positions", pa.list_(pa.int16()), nullable=False),
            pa.field("masked_lm_ids", ids, nullable=False),
        ]
    metadata = {"format": MANIFEST_FORMAT, "version": str(MANIFEST_VERSION)}
    return pa.schema(fields, metadata=metadata)


def _list_array(
    path: Path, column: str, rows: Sequence[Any], value_type: pa.DataType, upper: int
) -> pa.Array:
    """Rows of ints (lists or arrays) -> list<value_type>, checking every value is in [0, upper)."""
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] > np.iinfo(np.int32).max:
        raise DataError(f"{path}: column {column} holds {offsets[-1]} values, more than a shard can")
    if rows and isinstance(rows[0], np.ndarray):
        values = np.concatenate(rows).astype(np.int64, copy=False)
    else:
        values = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=int(offsets[-1]))
    if len(values) and (values.min() < 0 or values.max() >= upper):
        raise DataError(
            f"{path}: column {column} has values outside [0, {upper}): {values.min()}..{values.max()}"
        )
    return pa.ListArray.from_arrays(
        pa.array(offsets.astype(np.int32)),
        pa.array(values.astype(value_type.to_pandas_dtype())),
        type=pa.list_(value_type),
    )


def _int_column(path: Path, column: str, values: np.ndarray, dtype: type) -> pa.Array:
    info = np.iinfo(dtype)
    if len(values) and (values.min() < info.min or values.max() > info.max):
        raise DataError(f"{path}: column {column} has values outside the {np.dtype(dtype).name} range")
    return pa.array(values.astype(dtype))


def _fsync_folder(folder: Path) -> None:
    """Make a rename durable (POSIX: the directory entry lives in the folder)."""
    if os.name != "posix":
        return
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_bytes_atomic(path: Path, payload: bytes | memoryview | pa.Buffer) -> None:
    """Write to a temp name in the same folder, fsync, rename; the temp file goes on any error."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)


def write_shard(
    path: str | Path,
    instances: Sequence[Any],
    vocab_size: int,
    static_masks: Sequence[Any] | None = None,
) -> ShardInfo:
    """Write `instances` (objects with `input_ids`, `num_a_tokens`, `next_sentence_label`) as one shard.

    static_masks: optional, aligned with `instances`, each a `data.masking.MaskedTokens`
    (masked_input_ids, positions, original_ids); the shard then stores the masked ids as input_ids.
    Returns the manifest entry. Ids must lie in [0, vocab_size); otherwise DataError and no file.
    """
    path = Path(path)
    num_instances = len(instances)
    if static_masks is not None and len(static_masks) != num_instances:
        raise ValueError(f"{path}: {len(static_masks)} static masks for {num_instances} instances")
    schema = shard_schema(vocab_size, static_masks is not None)
    ids_type = token_type(vocab_size)
    if static_masks is None:
        sequences: Sequence[Any] = [instance.input_ids for instance in instances]
    else:
        sequences = [np.asarray(mask[0]) for mask in static_masks]
    columns = [
        _list_array(path, "input_ids", sequences, ids_type, vocab_size),
        _int_column(
            path,
            "num_a_tokens",
            np.fromiter((i.num_a_tokens for i in instances), dtype=np.int64, count=num_instances),
            np.int16,
        ),
        _int_column(
            path,
            "next_sentence_label",
            np.fromiter((i.next_sentence_label for i in instances), dtype=np.int64, count=num_instances),
            np.int8,
        ),
    ]
    if static_masks is not None:
        positions = [np.asarray(mask[1]) for mask in static_masks]
        columns.append(
            _list_array(path, "masked_lm_positions", positions, pa.int16(), np.iinfo(np.int16).max)
        )
        originals = [np.asarray(mask[2]) for mask in static_masks]
        columns.append(_list_array(path, "masked_lm_ids", originals, ids_type, vocab_size))
    batch = pa.record_batch(columns, schema=schema)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema) as writer:
        writer.write_batch(batch)
    buffer = sink.getvalue()
    sha256 = hashlib.sha256(memoryview(buffer)).hexdigest()
    write_bytes_atomic(path, buffer)
    num_tokens = int(sum(len(sequence) for sequence in sequences))
    return ShardInfo(path.name, num_instances, num_tokens, sha256, buffer.size)


def validate_manifest(manifest: Any, source: str | Path) -> None:
    """Raise a one-line DataError naming `source` and the key when `manifest` is not a valid one."""
    if not isinstance(manifest, dict):
        raise DataError(f"{source}: manifest is not a JSON object")
    for key in REQUIRED_KEYS:
        if key not in manifest:
            raise DataError(f"{source}: manifest lacks the key '{key}'")
    if manifest["format"] != MANIFEST_FORMAT:
        raise DataError(f"{source}: key 'format' is {manifest['format']!r}, expected {MANIFEST_FORMAT!r}")
    if manifest["version"] != MANIFEST_VERSION:
        raise DataError(
            f"{source}: key 'version' is {manifest['version']!r}; this code reads version {MANIFEST_VERSION}"
        )
    if not isinstance(manifest["max_seq_length"], int) or manifest["max_seq_length"] < 5:
        raise DataError(f"{source}: key 'max_seq_length' must be an integer >= 5")
    tokenizer = manifest["tokenizer"]
    if not isinstance(tokenizer, dict):
        raise DataError(f"{source}: key 'tokenizer' is not an object")
    for key in TOKENIZER_KEYS:
        if key not in tokenizer:
            raise DataError(f"{source}: manifest lacks the key 'tokenizer.{key}'")
    if Path(tokenizer["file"]).name != tokenizer["file"]:
        raise DataError(f"{source}: key 'tokenizer.file' must be a file name in the folder")
    shards = manifest["shards"]
    if not isinstance(shards, list):
        raise DataError(f"{source}: key 'shards' is not a list")
    for position, shard in enumerate(shards):
        for key in SHARD_KEYS:
            if not isinstance(shard, dict) or key not in shard:
                raise DataError(f"{source}: manifest lacks the key 'shards[{position}].{key}'")
        if Path(shard["file"]).name != shard["file"]:
            raise DataError(f"{source}: key 'shards[{position}].file' must be a file name in the folder")
    total = sum(shard["num_instances"] for shard in shards)
    if manifest["num_instances"] != total:
        raise DataError(
            f"{source}: key 'num_instances' is {manifest['num_instances']}, the shards hold {total}"
        )


def write_manifest(folder: str | Path, manifest: Mapping[str, Any]) -> Path:
    """Validate and write `folder/manifest.json` atomically; returns its path."""
    path = Path(folder) / MANIFEST_NAME
    manifest = dict(manifest)
    validate_manifest(manifest, path)
    write_bytes_atomic(path, (json.dumps(manifest, indent=1) + "\n").encode("utf-8"))
    return path


def load_manifest(folder: str | Path) -> dict[str, Any]:
    """Read and validate `folder/manifest.json`; one-line DataError naming the file on any problem."""
    path = Path(folder) / MANIFEST_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(
            f"{path}: missing (not a prepared folder, or its preparation did not finish)"
        ) from None
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"{path}: cannot read ({type(error).__name__}: {error})") from None
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as error:
        raise DataError(f"{path}:{error.lineno}: invalid JSON ({error.msg})") from None
    validate_manifest(manifest, path)
    return manifest


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_shard_file(path: Path, expected_bytes: int) -> None:
    """DataError naming the shard when it is missing or its size differs from the manifest's."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise DataError(f"{path}: shard listed in the manifest is missing") from None
    if size != expected_bytes:
        raise DataError(
            f"{path}: shard is {size} bytes, the manifest says {expected_bytes} (truncated or replaced)"
        )


ShardStamp = tuple[int, int, int, int, int]  # (device, inode, size, mtime_ns, ctime_ns)


def shard_stamp(path: str | Path) -> ShardStamp:
    """A file's identity and last change as `os.stat` gives them, one system call. A write in place, a
    truncation, a replacement by rename, a touch or a chmod all change it (the ctime cannot be set back
    by a user), so an equal stamp means the bytes are as they were when the stamp was taken (up to the
    file system's timestamp resolution)."""
    status = os.stat(path)
    return (status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns)


def verify_shards(folder: str | Path, manifest: Mapping[str, Any]) -> None:
    """Recompute every shard's size and sha256 against the manifest; DataError naming the first bad one."""
    folder = Path(folder)
    for shard in manifest["shards"]:
        path = folder / shard["file"]
        check_shard_file(path, shard["bytes"])
        if file_sha256(path) != shard["sha256"]:
            raise DataError(f"{path}: sha256 differs from the manifest (corrupted or replaced shard)")


class ShardReader:
    """One memory-mapped shard; rows come back as numpy views into the mapping (no copy).

    Open it in the process that reads it: a mapping is not picklable.
    """

    def __init__(self, path: str | Path, expected_bytes: int | None = None, expected_rows: int | None = None):
        self.path = Path(path)
        if expected_bytes is not None:
            check_shard_file(self.path, expected_bytes)
        try:
            self._source = pa.memory_map(str(self.path), "r")
            reader = pa.ipc.open_file(self._source)
            batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        except FileNotFoundError:
            raise DataError(f"{self.path}: shard is missing") from None
        except (pa.ArrowException, OSError) as error:
            raise DataError(f"{self.path}: not a readable Arrow shard ({error})") from None
        names = set(reader.schema.names)
        missing = {"input_ids", "num_a_tokens", "next_sentence_label"} - names
        if missing:
            raise DataError(f"{self.path}: shard lacks the columns {sorted(missing)}")
        self.static_masking = "masked_lm_positions" in names
        self._batch_starts = np.cumsum([0] + [batch.num_rows for batch in batches])
        self._columns = [self._numpy_columns(batch) for batch in batches]
        if expected_rows is not None and self.num_rows != expected_rows:
            raise DataError(f"{self.path}: shard has {self.num_rows} rows, the manifest says {expected_rows}")

    def _numpy_columns(self, batch: pa.RecordBatch) -> dict[str, Any]:
        def list_column(name: str) -> tuple[np.ndarray, np.ndarray]:
            column = batch.column(name)
            offsets = column.offsets.to_numpy(zero_copy_only=True)
            return offsets, column.values.to_numpy(zero_copy_only=True)

        columns: dict[str, Any] = {
            "input_ids": list_column("input_ids"),
            "num_a_tokens": batch.column("num_a_tokens").to_numpy(zero_copy_only=True),
            "next_sentence_label": batch.column("next_sentence_label").to_numpy(zero_copy_only=True),
        }
        if self.static_masking:
            columns["masked_lm_positions"] = list_column("masked_lm_positions")
            columns["masked_lm_ids"] = list_column("masked_lm_ids")
        return columns

    @property
    def num_rows(self) -> int:
        return int(self._batch_starts[-1])

    def __len__(self) -> int:
        return self.num_rows

    def row(self, row: int) -> dict[str, Any]:
        """{input_ids: 1-D uint16/int32 view, num_a_tokens: int, next_sentence_label: int} plus
        masked_lm_positions (int16 view) and masked_lm_ids with static masking."""
        if not 0 <= row < self.num_rows:
            raise IndexError(f"{self.path}: row {row} out of range [0, {self.num_rows})")
        batch = int(np.searchsorted(self._batch_starts, row, side="right")) - 1
        local = row - int(self._batch_starts[batch])
        columns = self._columns[batch]
        offsets, values = columns["input_ids"]
        sample: dict[str, Any] = {
            "input_ids": values[offsets[local] : offsets[local + 1]],
            "num_a_tokens": int(columns["num_a_tokens"][local]),
            "next_sentence_label": int(columns["next_sentence_label"][local]),
        }
        if self.static_masking:
            for name in ("masked_lm_positions", "masked_lm_ids"):
                offsets, values = columns[name]
                sample[name] = values[offsets[local] : offsets[local + 1]]
        return sample
