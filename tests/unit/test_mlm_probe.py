"""pretrain/tools/mlm_probe.py: accuracy by kind of masked position, and the word-order control."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from pretrain.tools.mlm_probe import breakdown, main, most_frequent_share, shuffle_words

VOCAB, CLS, SEP, MASK = 32, 1, 2, 3
SPECIAL = torch.zeros(VOCAB, dtype=torch.bool)
SPECIAL[[0, CLS, SEP, MASK]] = True


class CopyOrFrequent(nn.Module):
    """No context: copies its input, predicts token 7 at [MASK]."""

    def forward(self, input_ids, token_type_ids, attention_mask):
        guess = torch.where(input_ids == MASK, torch.full_like(input_ids, 7), input_ids)
        return SimpleNamespace(prediction_logits=nn.functional.one_hot(guess, VOCAB).float())


class PreviousWord(nn.Module):
    """Reads word order: predicts the token before each position."""

    def forward(self, input_ids, token_type_ids, attention_mask):
        guess = torch.roll(input_ids, 1, dims=1)
        return SimpleNamespace(prediction_logits=nn.functional.one_hot(guess, VOCAB).float())


def _batch(rows: list[list[int]], targets: dict[tuple[int, int], int], segment_b: int = 0) -> dict:
    ids = torch.tensor(rows)
    labels = torch.full_like(ids, -100)
    for (row, column), target in targets.items():
        labels[row, column] = target
    types = torch.zeros_like(ids)
    if segment_b:
        types[:, segment_b:] = 1
    return {
        "input_ids": ids,
        "labels": labels,
        "token_type_ids": types,
        "attention_mask": torch.ones_like(ids),
    }


def test_kinds_split_the_accuracy():
    # row: [CLS] 7 9 [MASK] 11 [MASK] 12 [SEP]; targets: a [MASK] whose word is 7, one whose word is 8,
    # a kept 11 and a random token (12 standing for 13)
    batch = _batch([[CLS, 7, 9, MASK, 11, MASK, 12, SEP]], {(0, 3): 7, (0, 5): 8, (0, 4): 11, (0, 6): 13})
    result = breakdown(CopyOrFrequent(), batch, MASK)
    assert result.count == {"mask": 2, "random": 1, "kept": 1, "all": 4}
    assert result.accuracy == {"mask": 0.5, "random": 0.0, "kept": 1.0, "all": 0.5}
    assert most_frequent_share(batch) == 0.25


def test_shuffling_words_costs_an_order_reading_model_its_mask_accuracy():
    torch.manual_seed(0)
    rows, targets = [], {}
    for row in range(16):  # [CLS] a a b b c c ... [SEP] with the second of every pair masked
        words = torch.randperm(VOCAB - 4)[:6] + 4
        tokens = [CLS]
        for pair, word in enumerate(words.tolist()):
            tokens += [word, MASK]
            targets[(row, 2 + 2 * pair)] = word
        rows.append([*tokens, SEP])
    batch = _batch(rows, targets)
    ordered = breakdown(PreviousWord(), batch, MASK)
    shuffled = breakdown(
        PreviousWord(), shuffle_words(batch, SPECIAL, torch.Generator().manual_seed(1)), MASK
    )
    assert ordered.accuracy["mask"] == 1.0
    assert shuffled.accuracy["mask"] < 0.4
    assert breakdown(CopyOrFrequent(), batch, MASK).accuracy["mask"] == pytest.approx(
        shuffle_and_score(batch, CopyOrFrequent()), abs=1e-9
    )  # a model that ignores order scores the same either way


def shuffle_and_score(batch: dict, model: nn.Module) -> float:
    return breakdown(model, shuffle_words(batch, SPECIAL, torch.Generator().manual_seed(2)), MASK).accuracy[
        "mask"
    ]


def test_shuffle_keeps_specials_segments_and_each_word_with_its_label():
    batch = _batch([[CLS, 5, 6, MASK, SEP, 8, 9, 10, SEP]], {(0, 3): 4, (0, 6): 9, (0, 1): 5}, segment_b=5)
    shuffled = shuffle_words(batch, SPECIAL, torch.Generator().manual_seed(3))
    ids, labels = shuffled["input_ids"][0], shuffled["labels"][0]
    assert ids[[0, 4, 8]].tolist() == [CLS, SEP, SEP]
    assert sorted(ids[1:4].tolist()) == sorted([5, 6, MASK]) and sorted(ids[5:8].tolist()) == [8, 9, 10]
    pairs = {(int(i), int(t)) for i, t in zip(ids, labels) if t != -100}
    assert pairs == {(MASK, 4), (9, 9), (5, 5)}
    assert torch.equal(shuffled["token_type_ids"], batch["token_type_ids"])


def test_cli_names_a_folder_that_is_not_a_model(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and str(tmp_path) in error and len(error.strip().splitlines()) == 1
