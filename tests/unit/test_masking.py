"""MLM masking statistics, whole-word masking, static masks and the collator's output contract."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from data.masking import (
    IGNORE_INDEX,
    MaskingCollator,
    mask_instance_static,
    mask_tokens,
    num_predictions,
    random_token_table,
    word_start_table,
)

PAD, UNK, CLS, SEP, MASK = 0, 1, 2, 3, 4
SPECIAL = {"pad_id": PAD, "unk_id": UNK, "cls_id": CLS, "sep_id": SEP, "mask_id": MASK}
VOCAB_SIZE = 1000
RANDOM_IDS = np.arange(5, VOCAB_SIZE)


def pair(rng: np.random.Generator, length_a: int, length_b: int) -> np.ndarray:
    a = rng.integers(5, VOCAB_SIZE, length_a)
    b = rng.integers(5, VOCAB_SIZE, length_b)
    return np.concatenate([[CLS], a, [SEP], b, [SEP]]).astype(np.int64)


def masked(ids: np.ndarray, seed: int, **overrides):
    kwargs = dict(
        mask_id=MASK,
        random_token_ids=RANDOM_IDS,
        max_predictions=1000,
        special_ids=SPECIAL.values(),
    )
    kwargs.update(overrides)
    return mask_tokens(ids, np.random.default_rng(seed), **kwargs)


def test_num_predictions_rule():
    assert num_predictions(125, 0.15, 20) == 19  # round(18.75)
    assert num_predictions(509, 0.15, 80) == 76
    assert num_predictions(509, 0.15, 20) == 20
    assert num_predictions(2, 0.15, 20) == 1  # at least one
    assert num_predictions(0, 0.15, 20) == 0


def test_masking_rate_and_80_10_10_split():
    """Over 2000 sequences (~38k predictions) the split is within 5 binomial standard deviations."""
    rng = np.random.default_rng(0)
    num_chosen = num_candidates = num_mask = num_random = num_kept = 0
    for seed in range(2000):
        ids = pair(rng, int(rng.integers(10, 70)), int(rng.integers(10, 56)))
        result = masked(ids, seed)
        special = np.isin(ids, list(SPECIAL.values()))
        assert not special[result.positions].any(), "a special token was chosen"
        assert np.array_equal(result.masked_input_ids[special], ids[special])
        untouched = np.ones(len(ids), dtype=bool)
        untouched[result.positions] = False
        assert np.array_equal(result.masked_input_ids[untouched], ids[untouched])
        assert np.array_equal(result.original_ids, ids[result.positions])
        assert np.all(np.diff(result.positions) > 0)
        assert len(result.positions) == num_predictions(int((~special).sum()), 0.15, 1000)
        replaced = result.masked_input_ids[result.positions]
        num_chosen += len(result.positions)
        num_candidates += int((~special).sum())
        num_mask += int((replaced == MASK).sum())
        num_kept += int((replaced == result.original_ids).sum())
        num_random += int(((replaced != MASK) & (replaced != result.original_ids)).sum())
        assert np.isin(replaced[replaced != MASK], RANDOM_IDS).all()
    assert abs(num_chosen / num_candidates - 0.15) < 0.005  # rounding per sequence only
    sigma = math.sqrt(0.1 * 0.9 / num_chosen)
    assert abs(num_mask / num_chosen - 0.8) < 5 * math.sqrt(0.8 * 0.2 / num_chosen)
    # a random replacement equal to the original (p = 1/995) counts as kept
    assert abs(num_random / num_chosen - 0.1 * (1 - 1 / 995)) < 5 * sigma
    assert abs(num_kept / num_chosen - 0.1 * (1 + 1 / 995)) < 5 * sigma


def test_positions_are_uniform_over_non_special_tokens():
    ids = pair(np.random.default_rng(1), 30, 30)
    counts = np.zeros(len(ids))
    for seed in range(3000):
        counts[masked(ids, seed).positions] += 1
    candidates = counts[~np.isin(ids, list(SPECIAL.values()))]
    expected = 3000 * 9 / 60  # 9 of 60 candidates each time
    assert counts[[0, 31, 62]].sum() == 0
    assert np.all(np.abs(candidates - expected) < 5 * math.sqrt(expected))


def test_max_predictions_is_honoured():
    ids = pair(np.random.default_rng(2), 300, 200)
    result = masked(ids, 0, max_predictions=20)
    assert len(result.positions) == 20
    assert (result.masked_input_ids != ids).sum() <= 20


def test_all_special_sequence_masks_nothing_and_short_one_masks_one():
    ids = np.array([CLS, SEP, SEP])
    result = masked(ids, 0)
    assert len(result.positions) == 0 and np.array_equal(result.masked_input_ids, ids)
    assert len(masked(np.array([CLS, 7, SEP, 8, SEP]), 0).positions) == 1


def test_special_mask_and_special_ids_agree():
    ids = pair(np.random.default_rng(3), 40, 40)
    by_ids = masked(ids, 9)
    by_mask = masked(ids, 9, special_ids=None, special_mask=np.isin(ids, list(SPECIAL.values())))
    assert all(np.array_equal(x, y) for x, y in zip(by_ids, by_mask))
    with pytest.raises(ValueError, match="special"):
        masked(ids, 9, special_ids=None)


def test_whole_word_masking_masks_whole_words():
    rng = np.random.default_rng(4)
    num_b_head_without_a_tail = 0
    for seed in range(300):
        ids = pair(rng, 60, 60)
        # words of 1-3 tokens; the first token of B follows [SEP] but is marked a continuation
        starts = rng.random(len(ids)) < 0.5
        starts[62] = False
        result = masked(ids, seed, word_starts=starts, max_predictions=19)
        special = np.isin(ids, list(SPECIAL.values()))
        word = np.cumsum(starts | np.r_[True, special[:-1]] | special)
        chosen = np.zeros(len(ids), dtype=bool)
        chosen[result.positions] = True
        for position in result.positions:
            members = (word == word[position]) & ~special
            assert chosen[members].all(), "a word was masked partially"
        assert not chosen[special].any()
        assert 1 <= len(result.positions) <= num_predictions(int((~special).sum()), 0.15, 19)
        num_b_head_without_a_tail += bool(chosen[62] and not chosen[60])
    # B's leading continuation is a word of its own, not glued to A's last word across [SEP]
    assert num_b_head_without_a_tail > 0


def test_vocab_tables():
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[unused0]", "the", "##s", "cat", "##ing"]
    assert word_start_table(tokens).tolist() == [True] * 7 + [False, True, False]
    assert random_token_table(tokens, SPECIAL.values()).tolist() == [6, 7, 8, 9]


def test_static_masks_are_deterministic_per_seed():
    rng = np.random.default_rng(5)
    instances = [SimpleNamespace(input_ids=pair(rng, 50, 60).tolist()) for _ in range(20)]
    kwargs = dict(
        special_ids=SPECIAL,
        vocab_size=VOCAB_SIZE,
        random_token_ids=RANDOM_IDS,
        masked_lm_prob=0.15,
        max_predictions=20,
    )
    first = mask_instance_static(instances, seed=(1, 2, 128), **kwargs)
    again = mask_instance_static(instances, seed=(1, 2, 128), **kwargs)
    other = mask_instance_static(instances, seed=(1, 3, 128), **kwargs)
    assert len(first) == 20 and all(len(m.positions) == num_predictions(110, 0.15, 20) == 16 for m in first)
    assert all(np.array_equal(x.positions, y.positions) for x, y in zip(first, again))
    assert not all(np.array_equal(x.positions, y.positions) for x, y in zip(first, other))


def make_collator(**overrides) -> MaskingCollator:
    kwargs = dict(
        max_seq_length=128,
        vocab_size=VOCAB_SIZE,
        pad_id=PAD,
        mask_id=MASK,
        special_ids=SPECIAL.values(),
        random_token_ids=RANDOM_IDS,
        max_predictions=20,
        seed=11,
    )
    kwargs.update(overrides)
    return MaskingCollator(**kwargs)


def sample(rng: np.random.Generator, index: int, epoch: int = 0) -> dict:
    length_a, length_b = int(rng.integers(5, 60)), int(rng.integers(5, 60))
    ids = pair(rng, length_a, length_b).astype(np.uint16)
    return {
        "input_ids": ids,
        "num_a_tokens": length_a + 2,
        "next_sentence_label": index % 2,
        "index": index,
        "epoch": epoch,
    }


def test_collator_output_contract():
    rng = np.random.default_rng(6)
    samples = [sample(rng, index) for index in range(16)]
    batch = make_collator()(samples)
    assert set(batch) == {
        "input_ids", "token_type_ids", "attention_mask", "labels", "next_sentence_label", "mlm_positions"
    }  # fmt: skip
    for name in ("input_ids", "token_type_ids", "attention_mask", "labels"):
        assert batch[name].shape == (16, 128) and batch[name].dtype == torch.long
    assert batch["next_sentence_label"].shape == (16,) and batch["next_sentence_label"].dtype == torch.long
    assert batch["mlm_positions"].shape == (16, 20) and batch["mlm_positions"].dtype == torch.long
    for row, item in enumerate(samples):
        length, num_a = len(item["input_ids"]), item["num_a_tokens"]
        original = torch.from_numpy(item["input_ids"].astype(np.int64))
        labels, ids = batch["labels"][row], batch["input_ids"][row]
        assert batch["attention_mask"][row].tolist() == [1] * length + [0] * (128 - length)
        assert batch["token_type_ids"][row].tolist() == [0] * num_a + [1] * (length - num_a) + [0] * (
            128 - length
        )
        assert (ids[length:] == PAD).all()
        masked_positions = torch.nonzero(labels != IGNORE_INDEX).flatten()
        assert 1 <= len(masked_positions) <= 20
        assert torch.equal(labels[masked_positions], original[masked_positions])
        # the static list: the masked positions ascending, then 0 (label -100) up to max_predictions
        listed = batch["mlm_positions"][row]
        assert torch.equal(listed[: len(masked_positions)], masked_positions)
        assert (listed[len(masked_positions) :] == 0).all() and labels[0] == IGNORE_INDEX
        # every position that differs from the input carries a label
        changed = torch.nonzero(ids[:length] != original).flatten()
        assert set(changed.tolist()) <= set(masked_positions.tolist())
    assert batch["next_sentence_label"].tolist() == [index % 2 for index in range(16)]


def test_collator_masks_depend_only_on_seed_epoch_index():
    rng = np.random.default_rng(7)
    samples = [sample(rng, index) for index in range(12)]
    collator = make_collator()
    whole = collator(samples)
    halves = [collator(samples[6:]), collator(samples[:6])]
    assert torch.equal(whole["labels"], torch.cat([halves[1]["labels"], halves[0]["labels"]]))
    next_epoch = collator([{**s, "epoch": 1} for s in samples])
    assert not torch.equal(whole["labels"], next_epoch["labels"])
    assert not torch.equal(whole["labels"], make_collator(seed=12)(samples)["labels"])


def test_collator_uses_static_masks_when_present():
    item = {
        "input_ids": np.array([CLS, MASK, 9, SEP, 10, MASK, SEP], dtype=np.uint16),
        "num_a_tokens": 4,
        "next_sentence_label": 0,
        "index": 0,
        "epoch": 0,
        "masked_lm_positions": np.array([1, 5], dtype=np.int16),
        "masked_lm_ids": np.array([7, 11]),
    }
    batch = make_collator(max_seq_length=8)([item])
    assert batch["input_ids"][0].tolist() == [CLS, MASK, 9, SEP, 10, MASK, SEP, PAD]
    assert batch["labels"][0].tolist() == [-100, 7, -100, -100, -100, 11, -100, -100]
    assert batch["mlm_positions"][0].tolist() == [1, 5] + [0] * 18


def test_collator_rejects_more_masked_positions_than_max_predictions():
    """Static masks prepared with a larger max_predictions_per_seq than the collator's: one line naming
    the sample, not a silently dropped label."""
    item = {
        "input_ids": np.array([CLS, MASK, MASK, SEP, MASK, SEP], dtype=np.uint16),
        "num_a_tokens": 4,
        "next_sentence_label": 0,
        "index": 17,
        "epoch": 0,
        "masked_lm_positions": np.array([1, 2, 4], dtype=np.int16),
        "masked_lm_ids": np.array([7, 8, 9]),
    }
    with pytest.raises(ValueError, match=r"sample 17: 3 masked positions > max_predictions 2"):
        make_collator(max_seq_length=8, max_predictions=2)([item])


def test_collator_rejects_too_long_samples():
    item = sample(np.random.default_rng(8), 0)
    with pytest.raises(ValueError, match="max_seq_length"):
        make_collator(max_seq_length=8)([item])
