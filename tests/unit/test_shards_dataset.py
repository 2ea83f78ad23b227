"""Shard format, manifest, PretrainingDataset, ResumableDistributedSampler and the collator end to end."""

from __future__ import annotations

import copy
import json
import os
import random
import re
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
import torch
from tokenizers import Tokenizer, models
from torch.utils.data import DataLoader

import data.dataset as dataset_module
from data.dataset import PretrainingDataset, ResumableDistributedSampler
from data.documents import DataError
from data.instances import Instance, create_instances
from data.masking import IGNORE_INDEX, MaskingCollator, mask_instance_static
from data.shards import (
    ShardReader,
    file_sha256,
    load_manifest,
    shard_name,
    verify_shards,
    write_manifest,
    write_shard,
)

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
VOCAB = SPECIAL_TOKENS + [f"word{i}" for i in range(400)] + [f"##piece{i}" for i in range(95)]
VOCAB_SIZE = len(VOCAB)  # 500
SPECIAL = {"pad_id": 0, "unk_id": 1, "cls_id": 2, "sep_id": 3, "mask_id": 4}
MAX_SEQ_LENGTH = 64


def make_instances(seed: int, num_documents: int = 60) -> list[Instance]:
    rng = random.Random(seed)
    documents = [
        [[rng.randrange(5, VOCAB_SIZE) for _ in range(rng.randint(3, 25))] for _ in range(rng.randint(1, 15))]
        for _ in range(num_documents)
    ]
    return create_instances(documents, MAX_SEQ_LENGTH, 0.1, rng, SPECIAL["cls_id"], SPECIAL["sep_id"])


def make_folder(folder: Path, instances: list[Instance], num_shards: int = 3, static: bool = False) -> dict:
    """A prepared folder as the preparation step writes it: shards, tokenizer.json, manifest.json.
    Shard 1 is empty when there are at least three shards (chunks can yield no instance)."""
    folder.mkdir(parents=True, exist_ok=True)
    Tokenizer(models.WordPiece({token: i for i, token in enumerate(VOCAB)}, unk_token="[UNK]")).save(
        str(folder / "tokenizer.json")
    )
    parts = np.array_split(np.arange(len(instances)), num_shards - 1)
    if num_shards >= 3:
        parts.insert(1, np.arange(0))
    shards = []
    for index, part in enumerate(parts):
        chunk = [instances[i] for i in part]
        masks = None
        if static:
            masks = mask_instance_static(
                chunk,
                seed=(1, index),
                special_ids=SPECIAL,
                vocab_size=VOCAB_SIZE,
                random_token_ids=np.arange(5, VOCAB_SIZE),
                masked_lm_prob=0.15,
                max_predictions=10,
            )
        shards.append(asdict(write_shard(folder / shard_name(index), chunk, VOCAB_SIZE, static_masks=masks)))
    manifest = {
        "format": "bert-lamb-shards",
        "version": 1,
        "max_seq_length": MAX_SEQ_LENGTH,
        "static_masking": static,
        "max_predictions_per_seq": 10,
        "tokenizer": {
            "file": "tokenizer.json",
            "sha256": file_sha256(folder / "tokenizer.json"),
            "vocab_size": VOCAB_SIZE,
            **SPECIAL,
        },
        "shards": shards,
        "num_instances": sum(s["num_instances"] for s in shards),
    }
    write_manifest(folder, manifest)
    return manifest


@pytest.fixture(scope="module")
def instances() -> list[Instance]:
    return make_instances(seed=0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory, instances) -> Path:
    path = tmp_path_factory.mktemp("prepared") / "seq64"
    make_folder(path, instances)
    return path


# --- shards -----------------------------------------------------------------------------------------


def test_shard_round_trip(tmp_path: Path, instances: list[Instance]):
    info = write_shard(tmp_path / "shard-00000.arrow", instances, VOCAB_SIZE)
    path = tmp_path / info.file
    assert info.file == "shard-00000.arrow" and info.num_instances == len(instances)
    assert info.num_tokens == sum(len(i.input_ids) for i in instances)
    assert info.bytes == path.stat().st_size and info.sha256 == file_sha256(path)
    with pa.ipc.open_file(pa.memory_map(str(path))) as reader:
        schema = reader.schema
    assert schema.field("input_ids").type == pa.list_(pa.uint16())
    assert schema.field("num_a_tokens").type == pa.int16()
    assert schema.field("next_sentence_label").type == pa.int8()
    shard = ShardReader(path, info.bytes, info.num_instances)
    for row, instance in enumerate(instances):
        sample = shard.row(row)
        assert sample["input_ids"].tolist() == instance.input_ids
        assert sample["num_a_tokens"] == instance.num_a_tokens
        assert sample["next_sentence_label"] == instance.next_sentence_label


def test_large_vocab_uses_int32(tmp_path: Path):
    instance = Instance([2, 70000, 3, 65535, 3], 3, 1)
    write_shard(tmp_path / "shard-00000.arrow", [instance], 80000)
    shard = ShardReader(tmp_path / "shard-00000.arrow")
    assert shard.row(0)["input_ids"].dtype == np.int32
    assert shard.row(0)["input_ids"].tolist() == instance.input_ids


def test_static_mask_round_trip(tmp_path: Path, instances: list[Instance]):
    masks = mask_instance_static(
        instances,
        seed=3,
        special_ids=SPECIAL,
        vocab_size=VOCAB_SIZE,
        random_token_ids=np.arange(5, VOCAB_SIZE),
        masked_lm_prob=0.15,
        max_predictions=10,
    )
    write_shard(tmp_path / "shard-00000.arrow", instances, VOCAB_SIZE, static_masks=masks)
    shard = ShardReader(tmp_path / "shard-00000.arrow")
    assert shard.static_masking
    for row, mask in enumerate(masks):
        sample = shard.row(row)
        assert sample["input_ids"].tolist() == mask.masked_input_ids.tolist()
        assert sample["masked_lm_positions"].dtype == np.int16
        assert sample["masked_lm_positions"].tolist() == mask.positions.tolist()
        assert sample["masked_lm_ids"].tolist() == mask.original_ids.tolist()


def test_crash_mid_write_leaves_no_file(tmp_path: Path, instances: list[Instance], monkeypatch):
    def crash(descriptor):
        raise OSError("simulated crash during fsync")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="simulated crash"):
        write_shard(tmp_path / "shard-00000.arrow", instances, VOCAB_SIZE)
    assert list(tmp_path.iterdir()) == [], "neither the final file nor a temp file may remain"


def test_out_of_range_ids_are_rejected_before_writing(tmp_path: Path):
    with pytest.raises(DataError, match="input_ids"):
        write_shard(tmp_path / "shard-00000.arrow", [Instance([2, 7, 3, VOCAB_SIZE, 3], 3, 0)], VOCAB_SIZE)
    with pytest.raises(DataError, match="num_a_tokens"):
        write_shard(tmp_path / "shard-00000.arrow", [Instance([2, 7, 3, 8, 3], 40000, 0)], VOCAB_SIZE)
    assert list(tmp_path.iterdir()) == []


# --- manifest ---------------------------------------------------------------------------------------


def test_manifest_round_trip(tmp_path: Path, instances: list[Instance]):
    manifest = make_folder(tmp_path, instances[:30])
    assert load_manifest(tmp_path) == json.loads(json.dumps(manifest))
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda m: m.pop("shards"), "'shards'"),
        (lambda m: m["tokenizer"].pop("mask_id"), "'tokenizer.mask_id'"),
        (lambda m: m["shards"][0].pop("sha256"), r"'shards\[0\].sha256'"),
        (lambda m: m.update(format="something-else"), "'format'"),
        (lambda m: m.update(version=2), "'version'"),
        (lambda m: m.update(num_instances=1), "'num_instances'"),
        (lambda m: m["shards"][0].update(file="../elsewhere.arrow"), r"'shards\[0\].file'"),
    ],
)
def test_bad_manifest_is_one_line_data_error(folder: Path, tmp_path: Path, change, message: str):
    manifest = load_manifest(folder)
    change(manifest)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=message) as error:
        load_manifest(tmp_path)
    assert str(tmp_path / "manifest.json") in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(DataError, match=message):  # the writer refuses it too
        write_manifest(tmp_path / "other", manifest)


def test_missing_and_invalid_manifest(tmp_path: Path):
    with pytest.raises(DataError, match=r"manifest\.json: missing"):
        load_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{\n  not json")
    with pytest.raises(DataError, match=r"manifest\.json:2: invalid JSON"):
        load_manifest(tmp_path)


# --- integrity checks -------------------------------------------------------------------------------


def test_checksum_mismatch_names_the_shard(tmp_path: Path, instances: list[Instance]):
    manifest = make_folder(tmp_path, instances)
    path = tmp_path / manifest["shards"][2]["file"]
    payload = bytearray(path.read_bytes())
    payload[len(payload) // 2] ^= 0xFF  # same size, different bytes
    path.write_bytes(bytes(payload))
    with pytest.raises(DataError, match=f"{path.name}: sha256 differs"):
        verify_shards(tmp_path, manifest)
    with pytest.raises(DataError, match=path.name):
        PretrainingDataset(tmp_path, verify=True)
    PretrainingDataset(tmp_path)  # the size check alone cannot see it; that is what verify is for


def test_truncated_and_missing_shards_name_the_shard(tmp_path: Path, instances: list[Instance]):
    manifest = make_folder(tmp_path, instances)
    path = tmp_path / manifest["shards"][0]["file"]
    payload = path.read_bytes()
    path.write_bytes(payload[: len(payload) // 2])
    with pytest.raises(DataError, match=f"{path.name}: shard is .* bytes, the manifest says {len(payload)}"):
        PretrainingDataset(tmp_path)
    path.unlink()
    with pytest.raises(DataError, match=f"{path.name}: shard listed in the manifest is missing"):
        PretrainingDataset(tmp_path)


def test_tokenizer_mismatch_names_the_folder(folder: Path, tmp_path: Path, instances: list[Instance]):
    with pytest.raises(DataError, match=f"{folder}: .*vocab of 500 tokens, the model expects 30522"):
        PretrainingDataset(folder, expected_vocab_size=30522)
    make_folder(tmp_path, instances[:20])
    (tmp_path / "tokenizer.json").write_text(
        (tmp_path / "tokenizer.json").read_text().replace("word1", "wordX")
    )
    with pytest.raises(DataError, match=f"{tmp_path}: tokenizer.json differs"):
        PretrainingDataset(tmp_path, expected_vocab_size=VOCAB_SIZE)


# --- dataset ----------------------------------------------------------------------------------------


def test_dataset_indexes_across_shards(folder: Path, instances: list[Instance]):
    dataset = PretrainingDataset(folder, verify=True, expected_vocab_size=VOCAB_SIZE)
    assert len(dataset) == len(instances) and dataset.max_seq_length == MAX_SEQ_LENGTH
    for index, instance in enumerate(instances):
        sample = dataset[index]
        assert sample["input_ids"].tolist() == instance.input_ids
        assert sample["num_a_tokens"] == instance.num_a_tokens
        assert sample["next_sentence_label"] == instance.next_sentence_label
        assert sample["index"] == index and sample["epoch"] == 0
    assert dataset[(4, 7)]["epoch"] == 4 and dataset[(4, 7)]["index"] == 7
    assert dataset[-1]["index"] == len(instances) - 1
    with pytest.raises(IndexError):
        dataset[len(instances)]


# --- shards changed on disk during training ---------------------------------------------------------


def flip_byte_in_place(path: Path) -> None:
    """Flip a byte in the middle of `path` without replacing the file (a memory map shows the new byte)."""
    time.sleep(0.02)  # past the file system's timestamp tick, so that the write shows in the mtime
    with open(path, "r+b") as handle:
        handle.seek(path.stat().st_size // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))


def changed_shard_error(path: Path) -> str:
    return f"^{re.escape(str(path))}: changed on disk during training and no longer matches"


def test_flipped_byte_is_caught_on_the_next_read(tmp_path: Path, instances: list[Instance]):
    manifest = make_folder(tmp_path, instances)
    dataset = PretrainingDataset(tmp_path, verify=True, check_interval_s=0)
    last, first = tmp_path / manifest["shards"][2]["file"], tmp_path / manifest["shards"][0]["file"]
    before = dataset[len(instances) - 1]["input_ids"].copy()  # shard 2 is mapped now
    flip_byte_in_place(last)
    flip_byte_in_place(first)  # not mapped yet
    for index, path in ((len(instances) - 1, last), (0, first)):
        for _ in range(2):  # and again: a shard found bad never serves a row
            with pytest.raises(DataError, match=changed_shard_error(path)) as caught:
                dataset[index]
            assert "\n" not in str(caught.value)
    # put back, the shard reads again (its new stamp adopted)
    flip_byte_in_place(last)
    assert dataset[len(instances) - 1]["input_ids"].tolist() == before.tolist()


def test_changed_stamp_with_the_same_bytes_is_adopted(tmp_path: Path, instances: list[Instance]):
    manifest = make_folder(tmp_path, instances)
    dataset = PretrainingDataset(tmp_path, check_interval_s=0)
    path = tmp_path / manifest["shards"][0]["file"]
    expected = dataset[3]["input_ids"].tolist()
    stamp = dataset._stamps[0]
    os.utime(path, ns=(stamp[3] + 10**9, stamp[3] + 10**9))  # touch
    assert dataset[3]["input_ids"].tolist() == expected and dataset._stamps[0] != stamp
    duplicate = tmp_path / "duplicate.arrow"  # replaced by the same bytes: another inode, re-mapped
    duplicate.write_bytes(path.read_bytes())
    os.replace(duplicate, path)
    assert dataset[3]["input_ids"].tolist() == expected and dataset._stamps[0][1] == path.stat().st_ino
    path.unlink()
    with pytest.raises(DataError, match=f"{re.escape(str(path))}: shard disappeared during training"):
        dataset[3]


def test_the_stamp_is_checked_at_most_once_per_interval(
    tmp_path: Path, instances: list[Instance], monkeypatch
):
    manifest = make_folder(tmp_path, instances)
    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(dataset_module, "time", SimpleNamespace(monotonic=lambda: clock.now))
    dataset = PretrainingDataset(tmp_path)  # SHARD_CHECK_INTERVAL_S = 1 s
    path = tmp_path / manifest["shards"][0]["file"]
    dataset[0]
    flip_byte_in_place(path)
    clock.now += 0.5
    dataset[0]  # within the interval: the stamp is not read (what a read costs is a clock call)
    clock.now += 0.6
    with pytest.raises(DataError, match=changed_shard_error(path)):
        dataset[0]


def test_worker_copies_carry_the_stamps(tmp_path: Path, instances: list[Instance]):
    manifest = make_folder(tmp_path, instances)
    dataset = PretrainingDataset(tmp_path)
    dataset[0]
    # what a spawned DataLoader worker gets: deepcopy goes through the same __getstate__ as pickling
    # (the source tree's security scan allows no pickle.loads)
    worker = copy.deepcopy(dataset)
    assert worker._stamps == dataset._stamps and worker._readers == []
    path = tmp_path / manifest["shards"][0]["file"]
    flip_byte_in_place(path)
    with pytest.raises(DataError, match=changed_shard_error(path)):
        worker[0]  # its first read of the shard in the new process checks the stamp


def test_dataloader_worker_error_is_one_line_naming_the_shard(tmp_path: Path, instances: list[Instance]):
    manifest = make_folder(tmp_path, instances)
    dataset = PretrainingDataset(tmp_path, verify=True)
    path = tmp_path / manifest["shards"][2]["file"]
    flip_byte_in_place(path)
    loader = DataLoader(dataset, batch_size=4, num_workers=1, collate_fn=lambda samples: samples)
    with pytest.raises(DataError) as caught:
        list(loader)
    message = str(caught.value)
    assert re.match(changed_shard_error(path), message) and "\n" not in message, message
    assert f"pretrain: error: {caught.value}".count("\n") == 0  # what pretrain/__main__.py prints
    worker_traceback = caught.value.worker_traceback
    assert (
        worker_traceback is not None and "Caught DataError in DataLoader worker process 0" in worker_traceback
    )


def test_data_error_messages_are_kept_unless_a_worker_wrapped_them():
    assert str(DataError("a.txt:3: bad\nsecond line")) == "a.txt:3: bad\nsecond line"
    assert DataError("x").worker_traceback is None and DataError().args == ()
    assert str(DataError("Caught DataError in DataLoader worker process 0.")) == (
        "Caught DataError in DataLoader worker process 0."
    )  # no traceback in it: nothing to take out

    class ShardGone(DataError):
        pass

    wrapped = (
        "Caught ShardGone in DataLoader worker process 1.\nOriginal Traceback (most recent call last):\n"
        '  File "x.py", line 1, in <module>\n'
        f"{ShardGone.__module__}.{ShardGone.__qualname__}: shard-00003.arrow: gone\n"
    )
    assert str(ShardGone(wrapped)) == "shard-00003.arrow: gone"
    base = wrapped.replace(f"{ShardGone.__module__}.{ShardGone.__qualname__}", "data.documents.DataError")
    base = base.replace("Caught ShardGone", "Caught DataError")
    assert str(DataError(base)) == "shard-00003.arrow: gone"
    assert str(copy.deepcopy(DataError(base))) == "shard-00003.arrow: gone"  # rebuilt as pickling does


def test_a_verified_shard_changed_before_a_later_dataset_is_rehashed(
    tmp_path: Path, instances: list[Instance]
):
    manifest = make_folder(tmp_path, instances)
    PretrainingDataset(tmp_path, verify=True)  # the trainer's start-up check (local rank 0)
    path = tmp_path / manifest["shards"][2]["file"]
    os.utime(path)  # touched: re-hashed, same bytes, fine
    PretrainingDataset(tmp_path)
    flip_byte_in_place(path)
    with pytest.raises(DataError, match=changed_shard_error(path)):
        PretrainingDataset(tmp_path)  # a phase starting later on that process


# --- sampler ----------------------------------------------------------------------------------------


def rank_keys(sampler_args: dict, world_size: int, epoch: int = 0) -> list[list[tuple[int, int]]]:
    keys = []
    for rank in range(world_size):
        sampler = ResumableDistributedSampler(**sampler_args, rank=rank, world_size=world_size)
        sampler.set_epoch(epoch)
        keys.append(list(sampler))
    return keys


def test_rank_slices_are_disjoint_covering_and_deterministic():
    args = {"dataset_len": 103, "seed": 5}
    keys = rank_keys(args, world_size=4)
    indices = [index for rank in keys for _, index in rank]
    assert all(len(rank) == 25 for rank in keys)  # 103 -> 100 with drop_last
    assert len(set(indices)) == 100 and set(indices) <= set(range(103))
    assert keys == rank_keys(args, world_size=4)
    assert keys != rank_keys(args, world_size=4, epoch=1)
    assert all(epoch == 1 for rank in rank_keys(args, 4, epoch=1) for epoch, _ in rank)
    padded = rank_keys({**args, "drop_last": False}, world_size=4)
    assert all(len(rank) == 26 for rank in padded)
    assert {index for rank in padded for _, index in rank} == set(range(103))
    ordered = rank_keys({**args, "shuffle": False}, world_size=2)
    assert [index for _, index in ordered[1][:3]] == [1, 3, 5]


def test_resume_mid_epoch_continues_the_same_sequence():
    args = {"dataset_len": 100, "seed": 3}
    world_size, step = 2, 2 * 4  # 4 samples per rank per step
    uninterrupted = rank_keys(args, world_size, epoch=2)
    first = ResumableDistributedSampler(**args, rank=0, world_size=world_size)
    first.set_epoch(2)
    for _ in range(3):
        first.record_consumed(step)
    state = first.state_dict()
    assert state == {"epoch": 2, "num_samples_consumed": 24, "seed": 3, "dataset_len": 100}
    for rank in range(world_size):
        resumed = ResumableDistributedSampler(**args, rank=rank, world_size=world_size)
        resumed.load_state_dict(state)
        resumed.set_epoch(2)  # the training loop re-enters the epoch: the cursor must survive
        assert len(resumed) == 50 - 12
        assert list(resumed) == uninterrupted[rank][12:]
    resumed.set_epoch(3)  # the next epoch starts from its beginning
    assert list(resumed) == rank_keys(args, world_size, epoch=3)[1]


def test_resume_across_world_sizes():
    args = {"dataset_len": 100, "seed": 9}
    two = rank_keys(args, world_size=2, epoch=1)
    global_order = [key for pair in zip(*two) for key in pair]
    sampler = ResumableDistributedSampler(**args, rank=0, world_size=2)
    sampler.set_epoch(1)
    sampler.record_consumed(40)
    single = ResumableDistributedSampler(**args, rank=0, world_size=1)
    single.load_state_dict(sampler.state_dict())
    assert list(single) == global_order[40:]
    four = ResumableDistributedSampler(**args, rank=0, world_size=4)
    odd = {**sampler.state_dict(), "num_samples_consumed": 42}
    with pytest.raises(DataError, match="not a multiple of world_size 4"):
        four.load_state_dict(odd)
    with pytest.raises(DataError, match="dataset has 100"):
        four.load_state_dict({**sampler.state_dict(), "dataset_len": 99})
    with pytest.raises(ValueError, match="multiple of world_size"):
        sampler.record_consumed(3)


# --- DataLoader, collator and model -----------------------------------------------------------------


def batches(folder: Path, num_workers: int, static: bool = False) -> list[dict[str, torch.Tensor]]:
    dataset = PretrainingDataset(folder)
    sampler = ResumableDistributedSampler(len(dataset), rank=1, world_size=2, seed=4)
    sampler.set_epoch(1)
    collator = MaskingCollator.from_manifest(folder, dataset.manifest, seed=4, whole_word_masking=True)
    loader = DataLoader(
        dataset, batch_size=8, sampler=sampler, collate_fn=collator, num_workers=num_workers, drop_last=True
    )
    return list(loader)


def test_dataloader_workers_give_identical_batches(folder: Path):
    in_process = batches(folder, num_workers=0)
    with_workers = batches(folder, num_workers=2)
    assert len(in_process) == len(with_workers) > 3
    for one, other in zip(in_process, with_workers):
        assert one.keys() == other.keys()
        assert all(torch.equal(one[name], other[name]) for name in one)


def test_collated_batch_shapes_and_labels(folder: Path, instances: list[Instance]):
    batch = batches(folder, num_workers=0)[0]
    assert batch["input_ids"].shape == (8, MAX_SEQ_LENGTH) and batch["input_ids"].dtype == torch.long
    masked = batch["labels"] != IGNORE_INDEX
    assert masked.any(dim=1).all() and (masked.sum(dim=1) <= 10).all()
    # labels hold the original ids exactly at the masked positions
    sampler = ResumableDistributedSampler(len(instances), rank=1, world_size=2, seed=4)
    sampler.set_epoch(1)
    for row, (_, index) in zip(range(8), sampler):
        original = torch.tensor(instances[index].input_ids)
        positions = torch.nonzero(masked[row]).flatten()
        assert torch.equal(batch["labels"][row, positions], original[positions])


def test_static_masks_flow_through(tmp_path: Path, instances: list[Instance]):
    make_folder(tmp_path, instances, static=True)
    dataset = PretrainingDataset(tmp_path)
    assert dataset.static_masking and "masked_lm_positions" in dataset[0]
    batch = batches(tmp_path, num_workers=0)[0]
    assert batch["input_ids"].shape == (8, MAX_SEQ_LENGTH)
    sampler = ResumableDistributedSampler(len(dataset), rank=1, world_size=2, seed=4)
    sampler.set_epoch(1)
    for row, key in zip(range(8), sampler):
        sample = dataset[key]
        positions = torch.from_numpy(sample["masked_lm_positions"].astype(np.int64))
        assert torch.nonzero(batch["labels"][row] != IGNORE_INDEX).flatten().tolist() == positions.tolist()
        assert batch["input_ids"][row, : len(sample["input_ids"])].tolist() == sample["input_ids"].tolist()


def test_tiny_bert_accepts_a_collated_batch(folder: Path):
    from transformers import BertConfig, BertForPreTraining

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=MAX_SEQ_LENGTH,
    )
    model = BertForPreTraining(config)
    batch = batches(folder, num_workers=0)[0]
    output = model(**batch)
    assert torch.isfinite(output.loss) and output.loss.item() > 0
    output.loss.backward()
