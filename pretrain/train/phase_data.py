"""The training data of one phase: prepared shards -> rank-local micro-batches, resumable exactly.

A step takes `accumulation` micro-batches per rank, i.e. exactly `global_batch` samples over all
ranks, from one epoch (an epoch's tail shorter than a global batch is skipped), so the sampler's cursor
always sits on a step boundary and a checkpoint needs nothing but `state_dict()`.

With `length_bins` (`batch.phases[*].length_bins`), a step's micro-batches are regrouped by length and
each cut to a bin (`bin_by_length`): the step trains on the same samples and tokens, with less padding.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from data.dataset import PretrainingDataset, ResumableDistributedSampler
from data.documents import DataError
from data.masking import MaskingCollator
from data.shards import load_manifest
from pretrain.distributed.preemption import ignore_in_data_worker

log = logging.getLogger(__name__)


def phase_folder(data_dir: str | Path, max_seq_length: int) -> Path:
    folder = Path(data_dir) / f"seq{max_seq_length}"
    if not (folder / "manifest.json").is_file():
        raise DataError(
            f"data_dir: {folder} has no manifest.json; prepare it first "
            f"(make prepare DATA=<name>, with {max_seq_length} in data.instances.max_seq_lengths)"
        )
    return folder


class PhaseData:
    def __init__(
        self,
        folder: Path,
        *,
        global_batch: int,
        micro_batch: int,
        rank: int,
        world_size: int,
        seed: int,
        num_workers: int,
        vocab_size: int | None,
        pin_memory: bool = False,
        dry_run: bool = False,
        length_bins: list[int] | None = None,
    ):
        self.length_bins = list(length_bins) if length_bins else None
        self.manifest = load_manifest(folder)
        self.dataset = PretrainingDataset(folder, expected_vocab_size=vocab_size)
        if len(self.dataset) < global_batch:
            message = f"{folder}: {len(self.dataset)} instances, fewer than one global batch ({global_batch})"
            if not dry_run:
                raise DataError(message)
            log.warning("dry run: %s", message)  # a laptop validating a cluster config has a sample only
        self.global_batch = global_batch
        self.sampler = ResumableDistributedSampler(
            len(self.dataset), rank=rank, world_size=world_size, seed=seed
        )
        self.loader = DataLoader(
            self.dataset,
            batch_size=micro_batch,
            sampler=self.sampler,
            collate_fn=MaskingCollator.from_manifest(folder, self.manifest, seed=seed),
            num_workers=num_workers,
            drop_last=True,
            pin_memory=pin_memory,
            # its own generator: creating an iterator must not draw from the global torch RNG, or a
            # resumed run's dropout masks would differ from the uninterrupted run's
            generator=torch.Generator().manual_seed(seed),
            persistent_workers=False,
            worker_init_fn=ignore_in_data_worker,  # a signal to the process group is the trainer's to act on
        )
        self._iterator: Iterator[dict[str, torch.Tensor]] | None = None

    @property
    def max_seq_length(self) -> int:
        return int(self.manifest["max_seq_length"])

    def next_step(self, accumulation: int) -> list[dict[str, torch.Tensor]]:
        """The micro-batches of one optimizer step on this rank."""
        if self.sampler.num_global_samples - self.sampler.num_samples_consumed < self.global_batch:
            self.sampler.set_epoch(self.sampler.epoch + 1)
            self._iterator = None
        if self._iterator is None:
            self._iterator = iter(self.loader)
        batches = [next(self._iterator) for _ in range(accumulation)]
        self.sampler.record_consumed(self.global_batch)
        if self.length_bins is not None:
            return bin_by_length(batches, self.length_bins)
        return batches

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
        self._iterator = None

    def close(self) -> None:
        self._iterator = None


SEQUENCE_KEYS = ("input_ids", "token_type_ids", "attention_mask", "labels")  # [B, L]; the rest per sample


def bin_by_length(batches: list[dict[str, torch.Tensor]], bins: list[int]) -> list[dict[str, torch.Tensor]]:
    """One step's micro-batches (each padded to the phase's length L) regrouped by length: the step's
    samples ordered by their token count (stable), cut into micro-batches of the same size, each cut to the
    shortest of `bins` (ascending, the last L) that holds its longest sample. Only padding is removed: every
    sample keeps its tokens, token types, masked positions (`mlm_positions`, all below its length) and
    labels. The micro-batches' composition changes, so each one's mean loss weighs its tokens as its own
    samples give them (as any regrouping of a step's samples does)."""
    micro = len(batches[0]["input_ids"])
    merged = {key: torch.cat([batch[key] for batch in batches]) for key in batches[0]}
    lengths = merged["attention_mask"].sum(dim=1)
    order = torch.sort(lengths, stable=True).indices
    binned = []
    for start in range(0, len(order), micro):
        rows = order[start : start + micro]
        longest = int(lengths[rows].max())
        width = next(b for b in bins if b >= longest)
        binned.append(
            {
                key: (value[rows, :width] if key in SEQUENCE_KEYS else value[rows]).contiguous()
                for key, value in merged.items()
            }
        )
    return binned
