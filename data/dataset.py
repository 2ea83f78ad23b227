"""Training-side reading of prepared shards: a map-style dataset and a resumable distributed sampler.

    dataset = PretrainingDataset(folder, expected_vocab_size=len(tokenizer))
    sampler = ResumableDistributedSampler(len(dataset), rank=rank, world_size=world_size, seed=seed)
    collator = MaskingCollator.from_manifest(folder, dataset.manifest, seed=seed)
    loader = DataLoader(dataset, batch_size=micro_batch, sampler=sampler, collate_fn=collator,
                        num_workers=2, drop_last=True)
    for epoch in range(state.epoch, num_epochs):
        sampler.set_epoch(epoch)              # keeps a restored mid-epoch cursor for that epoch
        for batch in loader:
            ...                               # one optimizer step on world_size x micro_batch samples
            sampler.record_consumed(world_size * micro_batch)
    checkpoint["dataloader"] = sampler.state_dict()

The sampler yields `(epoch, index)` keys, so every sample knows its epoch for the collator's
dynamic-mask seed, also in DataLoader workers (persistent or not) that never see `set_epoch`.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset, Sampler

from data.documents import DataError
from data.shards import (
    ShardReader,
    ShardStamp,
    check_shard_file,
    file_sha256,
    load_manifest,
    shard_stamp,
    verify_shards,
)

SampleKey = tuple[int, int]  # (epoch, global sample index)
# How often, at most, a process re-reads the stamp of a shard it reads from: an os.stat costs about half
# a sample read, once a second per shard is nothing.
SHARD_CHECK_INTERVAL_S = 1.0
# The stamps of shards whose sha256 this process computed (absolute path -> stamp before hashing): a
# dataset built later here, without `verify` (the trainer's, at each phase start), re-hashes the shards
# changed since, so the start-up verification also covers phases that begin hours later.
_verified_stamps: dict[str, ShardStamp] = {}


class PretrainingDataset(Dataset):
    """All shards of a prepared folder, indexed globally in manifest order.

    `dataset[index]` or `dataset[(epoch, index)]` returns
        {input_ids: 1-D np.ndarray (uint16, or int32 for vocabularies > 65535; a read-only view into
         the memory-mapped shard, unpadded), num_a_tokens: int, next_sentence_label: int,
         index: int, epoch: int}
    plus masked_lm_positions (int16) and masked_lm_ids with static masking. A plain int key has
    epoch 0.

    Shards are memory-mapped lazily, per process and per shard, so the dataset pickles cheaply to
    DataLoader workers (fork or spawn). The constructor checks the manifest, the tokenizer hash and
    every shard's size; `verify=True` also recomputes every shard's sha256.

    A shard changed on disk later (re-prepared into the same folder, a partial copy, a flipped byte) is
    caught on read: the constructor stamps every shard (`data.shards.shard_stamp`), and each process
    compares the stamp of a shard it reads from at its first read and then at most once every
    `check_interval_s`, before returning the row. A changed stamp means re-hashing the shard: a
    mismatch with the manifest raises a one-line DataError naming it, a match (a touch, a copy of
    the same bytes) is adopted and the shard re-mapped. Samples read between a change and the next
    check (at most `check_interval_s`) cannot be told apart; every later read raises.
    """

    def __init__(
        self,
        folder: str | Path,
        *,
        verify: bool = False,
        expected_vocab_size: int | None = None,
        check_interval_s: float = SHARD_CHECK_INTERVAL_S,
    ):
        self.folder = Path(folder)
        self.manifest = load_manifest(self.folder)
        tokenizer = self.manifest["tokenizer"]
        if expected_vocab_size is not None and expected_vocab_size != tokenizer["vocab_size"]:
            raise DataError(
                f"{self.folder}: shards were made with a vocab of {tokenizer['vocab_size']} tokens, "
                f"the model expects {expected_vocab_size} (tokenizer mismatch)"
            )
        tokenizer_path = self.folder / tokenizer["file"]
        if not tokenizer_path.is_file():
            raise DataError(f"{self.folder}: {tokenizer['file']} listed in the manifest is missing")
        if file_sha256(tokenizer_path) != tokenizer["sha256"]:
            raise DataError(
                f"{self.folder}: {tokenizer['file']} differs from the tokenizer the shards were made with "
                "(sha256 mismatch)"
            )
        self.shards = self.manifest["shards"]
        paths = [self.folder / shard["file"] for shard in self.shards]
        for path, shard in zip(paths, self.shards):
            check_shard_file(path, shard["bytes"])
        # stamped before hashing, so that a change during or after the hash shows as a changed stamp
        self._stamps: list[ShardStamp] = [shard_stamp(path) for path in paths]
        if verify:
            verify_shards(self.folder, self.manifest)
            _verified_stamps.update((str(path.absolute()), s) for path, s in zip(paths, self._stamps))
        else:
            for shard, path in enumerate(paths):
                verified = _verified_stamps.get(str(path.absolute()))
                if verified is not None and verified != self._stamps[shard]:
                    self._confirm_unchanged(shard, self._stamps[shard])
        self.check_interval_s = check_interval_s
        self.max_seq_length: int = self.manifest["max_seq_length"]
        self.static_masking: bool = bool(self.manifest["static_masking"])
        # shard s holds the global indices [ends[s] - num_instances[s], ends[s])
        self._shard_ends = np.cumsum([shard["num_instances"] for shard in self.shards], dtype=np.int64)
        self._readers: list[ShardReader | None] = []
        self._next_check: list[float] = []  # time.monotonic() from which a read re-checks the shard
        self._owner_pid = -1

    def __len__(self) -> int:
        return int(self.manifest["num_instances"])

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_readers"] = []  # memory maps stay in the process that opened them
        state["_next_check"] = []  # the stamps travel; a worker checks each shard at its first read
        state["_owner_pid"] = -1
        return state

    def _reader(self, shard: int) -> ShardReader:
        """The shard's reader in this process, once its stamp is found unchanged (or re-verified)."""
        if self._owner_pid != os.getpid():  # first use in this process (or after a fork)
            self._readers = [None] * len(self.shards)
            self._next_check = [0.0] * len(self.shards)
            self._owner_pid = os.getpid()
        now = time.monotonic()
        if now >= self._next_check[shard]:
            self._check_stamp(shard)  # raising, it leaves the deadline: every later read checks again
            self._next_check[shard] = now + self.check_interval_s
        reader = self._readers[shard]
        if reader is None:
            info = self.shards[shard]
            reader = ShardReader(self.folder / info["file"], info["bytes"], info["num_instances"])
            self._readers[shard] = reader
        return reader

    def _check_stamp(self, shard: int) -> None:
        path = self.folder / self.shards[shard]["file"]
        try:
            stamp = shard_stamp(path)
        except FileNotFoundError:
            raise DataError(
                f"{path}: shard disappeared during training; restore it or re-prepare it, then resume"
            ) from None
        if stamp != self._stamps[shard]:
            self._readers[shard] = None  # nothing more from the old mapping, whatever the hash says
            self._confirm_unchanged(shard, stamp)

    def _confirm_unchanged(self, shard: int, stamp: ShardStamp) -> None:
        """The shard's stamp changed: DataError unless its bytes still match the manifest; then the
        new stamp is the one to compare with."""
        info = self.shards[shard]
        path = self.folder / info["file"]
        try:
            unchanged = stamp[2] == info["bytes"] and file_sha256(path) == info["sha256"]
        except OSError as error:
            raise DataError(
                f"{path}: changed on disk during training and cannot be re-read ({error})"
            ) from None
        if not unchanged:
            raise DataError(
                f"{path}: changed on disk during training and no longer matches the manifest's sha256 "
                "(corrupted or replaced shard); re-prepare it or restore the file, then resume"
            )
        self._stamps[shard] = stamp
        _verified_stamps[str(path.absolute())] = stamp

    def __getitem__(self, key: int | SampleKey) -> dict[str, Any]:
        epoch, index = (0, key) if isinstance(key, (int, np.integer)) else key
        index = int(index)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"{self.folder}: index {index} out of range [0, {len(self)})")
        shard = int(np.searchsorted(self._shard_ends, index, side="right"))
        row = index - (int(self._shard_ends[shard - 1]) if shard else 0)
        sample = self._reader(shard).row(row)
        sample["index"] = index
        sample["epoch"] = int(epoch)
        return sample


class ResumableDistributedSampler(Sampler[SampleKey]):
    """Deterministic, resumable sharding of `dataset_len` samples over `world_size` ranks.

    Each epoch has a global order: a permutation seeded by (seed, epoch) (or 0..n-1 without
    shuffle), cut to a multiple of world_size (drop_last) or padded by wrapping around. Global
    position p goes to rank p % world_size, so a global step of world_size x micro_batch samples
    takes a contiguous run of the global order whatever the world size. The rank yields
    `(epoch, index)` keys from the global cursor on.

    The cursor counts samples consumed by all ranks this epoch. The trainer advances it with
    `record_consumed` after each step (DataLoader prefetching means the sampler cannot know what
    was consumed); `state_dict`/`load_state_dict` carry it, and a resumed run, with the same or
    another world size dividing the cursor, sees exactly the remaining samples of the uninterrupted
    run (with drop_last, the epoch's tail may differ by < world_size samples across world sizes).
    """

    def __init__(
        self,
        dataset_len: int,
        *,
        rank: int,
        world_size: int,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = True,
    ):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"ResumableDistributedSampler: rank {rank} not in a world of size {world_size}")
        if dataset_len < world_size and drop_last:
            raise ValueError(f"ResumableDistributedSampler: {dataset_len} samples for {world_size} ranks")
        self.dataset_len = dataset_len
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.num_samples_consumed = 0

    @property
    def num_global_samples(self) -> int:
        """Samples per epoch over all ranks: a multiple of world_size."""
        if self.drop_last:
            return self.dataset_len - self.dataset_len % self.world_size
        return -(-self.dataset_len // self.world_size) * self.world_size

    def global_order(self, epoch: int) -> np.ndarray:
        """int64[num_global_samples]: the epoch's global order of dataset indices."""
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.dataset_len)
        else:
            order = np.arange(self.dataset_len, dtype=np.int64)
        total = self.num_global_samples
        if total <= self.dataset_len:
            return order[:total]
        return np.resize(order, total)  # wraps around to pad, like torch's DistributedSampler

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its beginning; the same epoch again keeps the cursor (a resumed epoch)."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.num_samples_consumed = 0

    def record_consumed(self, num_global_samples: int) -> None:
        """Advance the cursor by the samples one step consumed over all ranks."""
        if num_global_samples % self.world_size:
            raise ValueError(
                f"record_consumed({num_global_samples}): not a multiple of world_size {self.world_size}"
            )
        self.num_samples_consumed = min(
            self.num_samples_consumed + num_global_samples, self.num_global_samples
        )

    def __len__(self) -> int:
        return (self.num_global_samples - self.num_samples_consumed) // self.world_size

    def __iter__(self) -> Iterator[SampleKey]:
        epoch = self.epoch
        order = self.global_order(epoch)[self.num_samples_consumed + self.rank :: self.world_size]
        for index in order.tolist():
            yield epoch, index

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "num_samples_consumed": self.num_samples_consumed,
            "seed": self.seed,
            "dataset_len": self.dataset_len,
        }

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue where `state` left off. DataError when the cursor does not split over this world
        size or the dataset length changed."""
        consumed = int(state["num_samples_consumed"])
        if consumed % self.world_size:
            raise DataError(
                f"sampler state: {consumed} samples consumed is not a multiple of world_size "
                f"{self.world_size}; resume with a world size that divides it"
            )
        if "dataset_len" in state and int(state["dataset_len"]) != self.dataset_len:
            raise DataError(
                f"sampler state: saved for {state['dataset_len']} samples, the dataset has {self.dataset_len}"
            )
        if int(state["seed"]) != self.seed:
            warnings.warn(
                f"sampler: resuming with the saved seed {state['seed']}, not the configured {self.seed}",
                stacklevel=2,
            )
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.num_samples_consumed = min(consumed, self.num_global_samples)
