"""data/vocab_subset.py: a smaller vocabulary cut by frequency, keeping specials and characters."""

from __future__ import annotations

import numpy as np
import pytest

from data.tokenizer import SPECIAL_TOKENS
from data.vocab_subset import subset_vocabulary

VOCAB = [*SPECIAL_TOKENS, "a", "b", "c", "##a", "##b", "##c", "the", "cab", "##ab", "bad", "zebra"]


def _counts(**by_token: int) -> np.ndarray:
    return np.array([by_token.get(token, 0) for token in VOCAB])


def test_keeps_specials_characters_then_the_most_frequent_in_original_order():
    counts = _counts(the=50, cab=9, **{"##ab": 30}, bad=9, c=1)
    size = len(SPECIAL_TOKENS) + 6 + 2
    kept = subset_vocabulary(VOCAB, counts, size)
    assert kept[: len(SPECIAL_TOKENS)] == list(SPECIAL_TOKENS)
    # every character of a seen token in both forms, then `the` and `##ab` (cab and bad tie below)
    assert set(kept) == {*SPECIAL_TOKENS, "a", "b", "c", "##a", "##b", "##c", "the", "##ab"}
    assert kept == [token for token in VOCAB if token in set(kept)]  # original order kept
    assert "zebra" not in kept  # never seen


def test_ties_break_by_original_order_and_unseen_tokens_never_fill():
    counts = _counts(cab=9, bad=9)
    kept = subset_vocabulary(VOCAB, counts, len(SPECIAL_TOKENS) + 6 + 1)
    assert "cab" in kept and "bad" not in kept
    assert len(subset_vocabulary(VOCAB, counts, 100)) == len(SPECIAL_TOKENS) + 6 + 2


def test_too_small_sizes_are_errors():
    with pytest.raises(ValueError, match="at least"):
        subset_vocabulary(VOCAB, _counts(), 2)
    with pytest.raises(ValueError, match="do not fit"):
        subset_vocabulary(VOCAB, _counts(cab=1), len(SPECIAL_TOKENS) + 2)
