"""BERT masked-LM masking: dynamic in the training collator (default) or static at preparation time.

`mask_tokens` is the pure function; `MaskingCollator` turns dataset samples into the keyword
arguments of `transformers.BertForPreTraining.forward`; `mask_instance_static` masks a shard's
instances once at preparation time (NVIDIA/DeepSpeed parity).

Dynamic masks are seeded per sample from (seed, epoch, global sample index), so they do not depend on
the number of DataLoader workers, the batch composition or where a resumed run restarted.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from data.documents import DataError

if TYPE_CHECKING:
    import torch

IGNORE_INDEX = -100  # label of unmasked positions: ignored by torch's cross-entropy


class MaskedTokens(NamedTuple):
    """Result of `mask_tokens`.

    masked_input_ids: copy of the input (same shape and dtype) with the chosen positions replaced.
    positions: int64 indices of the chosen positions, ascending, shape (num_predictions,).
    original_ids: the input's ids at `positions` (input dtype), shape (num_predictions,).
    """

    masked_input_ids: np.ndarray
    positions: np.ndarray
    original_ids: np.ndarray


def num_predictions(num_tokens: int, masked_lm_prob: float, max_predictions: int) -> int:
    """min(max_predictions, max(1, round(num_tokens * prob))); 0 when there is nothing to mask."""
    if num_tokens == 0:
        return 0
    return min(max_predictions, max(1, round(num_tokens * masked_lm_prob)))


def _choose_whole_words(
    candidates: np.ndarray, starts: np.ndarray, num_to_predict: int, rng: np.random.Generator
) -> np.ndarray:
    """Positions of randomly ordered whole words, greedily, skipping a word that would overflow.

    candidates: ascending positions of non-special tokens; starts: for each candidate, whether it
    starts a word. At most `num_to_predict` positions come back (fewer when words do not fit exactly),
    as in the original whole-word masking.
    """
    word_bounds = np.append(np.flatnonzero(starts), len(candidates))
    num_words = len(word_bounds) - 1
    chosen: list[np.ndarray] = []
    num_chosen = 0
    for word in rng.permutation(num_words):
        begin, end = word_bounds[word], word_bounds[word + 1]
        if num_chosen + end - begin > num_to_predict:
            continue
        chosen.append(candidates[begin:end])
        num_chosen += end - begin
        if num_chosen == num_to_predict:
            break
    if not chosen:
        return np.empty(0, dtype=np.int64)
    return np.concatenate(chosen)


def mask_tokens(
    input_ids: np.ndarray,
    rng: np.random.Generator,
    *,
    mask_id: int,
    random_token_ids: np.ndarray,
    max_predictions: int,
    masked_lm_prob: float = 0.15,
    special_ids: Iterable[int] | None = None,
    special_mask: np.ndarray | None = None,
    word_starts: np.ndarray | None = None,
) -> MaskedTokens:
    """BERT MLM masking of one unpadded sequence.

    input_ids: 1-D integer array (one sequence, no padding needed but allowed when pad is special).
    special_mask: bool array shaped like input_ids, True where the token must never be masked; when
        None it is computed from `special_ids` (one of the two is required).
    word_starts: optional bool array shaped like input_ids, True where a token begins a word (its
        vocab string does not start with "##"); given, whole words are masked. A continuation right
        after a special token starts a new word (segments never share a word).
    random_token_ids: candidate ids for the 10% random replacement (the non-special vocab).

    num_to_predict = min(max_predictions, max(1, round(num_non_special * masked_lm_prob))) positions
    (whole words: at most that many) are drawn uniformly without replacement among non-special
    tokens; each becomes [MASK] with probability 0.8, a random token 0.1, stays unchanged 0.1.
    """
    input_ids = np.asarray(input_ids)
    if special_mask is None:
        if special_ids is None:
            raise ValueError("mask_tokens needs special_ids or special_mask")
        special_mask = np.isin(input_ids, np.fromiter(special_ids, dtype=np.int64))
    candidates = np.flatnonzero(~special_mask)
    num_to_predict = num_predictions(len(candidates), masked_lm_prob, max_predictions)
    if num_to_predict == 0:
        empty = np.empty(0, dtype=np.int64)
        return MaskedTokens(input_ids.copy(), empty, input_ids[empty])
    if word_starts is None:
        positions = np.sort(rng.permutation(candidates)[:num_to_predict])
    else:
        # A candidate starts a word when its token does, or when the token before it is special.
        starts = np.asarray(word_starts, dtype=bool)[candidates]
        starts[1:] |= np.diff(candidates) > 1
        starts[0] = True
        positions = np.sort(_choose_whole_words(candidates, starts, num_to_predict, rng))
    original_ids = input_ids[positions]
    masked_input_ids = input_ids.copy()
    choice = rng.random(len(positions))
    random_replacements = random_token_ids[rng.integers(len(random_token_ids), size=len(positions))]
    replacement = np.where(choice < 0.8, mask_id, np.where(choice < 0.9, random_replacements, original_ids))
    masked_input_ids[positions] = replacement
    return MaskedTokens(masked_input_ids, positions.astype(np.int64, copy=False), original_ids)


def load_vocab_tokens(tokenizer_file: str | Path) -> list[str]:
    """The vocab of a saved `tokenizer.json` as a list indexed by id (added tokens included)."""
    path = Path(tokenizer_file)
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
        vocab: dict[str, int] = dict(payload["model"]["vocab"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DataError(
            f"{path}: cannot read the tokenizer vocab ({type(error).__name__}: {error})"
        ) from None
    for added in payload.get("added_tokens", []):
        vocab.setdefault(added["content"], int(added["id"]))
    tokens = [""] * (max(vocab.values()) + 1)
    for token, index in vocab.items():
        tokens[index] = token
    return tokens


def word_start_table(vocab_tokens: Sequence[str]) -> np.ndarray:
    """bool[vocab_size]: True for tokens that begin a word (not a "##" continuation)."""
    return np.fromiter(
        (not token.startswith("##") for token in vocab_tokens), dtype=bool, count=len(vocab_tokens)
    )


def random_token_table(vocab_tokens: Sequence[str], special_ids: Iterable[int]) -> np.ndarray:
    """int64 ids eligible as random replacements: neither special nor bracketed like "[unused0]"."""
    special = set(special_ids)
    return np.array(
        [
            index
            for index, token in enumerate(vocab_tokens)
            if index not in special and token and not (token.startswith("[") and token.endswith("]"))
        ],
        dtype=np.int64,
    )


def _special_table(vocab_size: int, special_ids: Iterable[int]) -> np.ndarray:
    table = np.zeros(vocab_size, dtype=bool)
    table[np.fromiter(special_ids, dtype=np.int64)] = True
    return table


def mask_instance_static(
    instances: Sequence[Any],
    *,
    seed: int | Sequence[int],
    special_ids: Mapping[str, int],
    vocab_size: int,
    random_token_ids: np.ndarray,
    masked_lm_prob: float,
    max_predictions: int,
    word_starts_table: np.ndarray | None = None,
) -> list[MaskedTokens]:
    """Static masks for a shard's instances (objects with an `input_ids` list), one per instance.

    special_ids: the manifest's ids by name; must include "mask_id". Every id in it is never masked.
    seed: an int or a tuple of ints (e.g. (seed, chunk index, max_seq_length)); one generator masks
    the instances in order, so the result is deterministic. word_starts_table: optional
    bool[vocab_size] from `word_start_table` for whole-word masking.
    """
    if "mask_id" not in special_ids:
        raise ValueError("mask_instance_static: special_ids needs 'mask_id'")
    rng = np.random.default_rng(list(seed) if isinstance(seed, Sequence) else seed)
    is_special = _special_table(vocab_size, special_ids.values())
    random_token_ids = np.asarray(random_token_ids, dtype=np.int64)
    masks = []
    for instance in instances:
        ids = np.asarray(instance.input_ids, dtype=np.int64)
        masks.append(
            mask_tokens(
                ids,
                rng,
                mask_id=special_ids["mask_id"],
                random_token_ids=random_token_ids,
                max_predictions=max_predictions,
                masked_lm_prob=masked_lm_prob,
                special_mask=is_special[ids],
                word_starts=None if word_starts_table is None else word_starts_table[ids],
            )
        )
    return masks


class MaskingCollator:
    """Collates `PretrainingDataset` samples into `BertForPreTraining.forward` keyword arguments.

    Output (B = number of samples, L = max_seq_length, P = max_predictions, every tensor torch.long):
        input_ids (B, L), token_type_ids (B, L), attention_mask (B, L), labels (B, L),
        next_sentence_label (B,), mlm_positions (B, P).
    Padding always reaches L (static shapes for torch.compile); padding has attention 0, token type 0
    and label -100. labels hold the original id at masked positions and -100 elsewhere. mlm_positions
    lists each row's masked positions, ascending, then 0 (the [CLS] position, whose label is always
    -100) up to P: the model gathers the masked positions with this static shape instead of a boolean
    index, whose data-dependent shape syncs a GPU with the host (NVIDIA's `masked_lm_positions`).

    Samples carrying `masked_lm_positions`/`masked_lm_ids` (static masking) are used as they are;
    others are masked here with `np.random.default_rng([seed, epoch, index])`.
    """

    def __init__(
        self,
        *,
        max_seq_length: int,
        vocab_size: int,
        pad_id: int,
        mask_id: int,
        special_ids: Iterable[int],
        random_token_ids: np.ndarray,
        max_predictions: int,
        seed: int,
        masked_lm_prob: float = 0.15,
        word_starts_table: np.ndarray | None = None,
    ):
        self.max_seq_length = max_seq_length
        self.pad_id = pad_id
        self.mask_id = mask_id
        self.max_predictions = max_predictions
        self.masked_lm_prob = masked_lm_prob
        self.seed = seed
        self.random_token_ids = np.asarray(random_token_ids, dtype=np.int64)
        if len(self.random_token_ids) == 0:
            raise ValueError("MaskingCollator: random_token_ids is empty")
        # Lookup tables over the vocab, built once: per-sample work is then plain indexing.
        self.is_special = _special_table(vocab_size, [*special_ids, pad_id, mask_id])
        self.word_starts_table = word_starts_table
        if word_starts_table is not None and len(word_starts_table) != vocab_size:
            raise ValueError(
                f"MaskingCollator: word_starts_table has {len(word_starts_table)} entries, "
                f"vocab_size is {vocab_size}"
            )

    @classmethod
    def from_manifest(
        cls,
        folder: str | Path,
        manifest: Mapping[str, Any],
        *,
        seed: int,
        whole_word_masking: bool = False,
        masked_lm_prob: float = 0.15,
        max_predictions: int | None = None,
    ) -> MaskingCollator:
        """A collator for a prepared folder: length, special ids and vocab from its manifest and
        tokenizer.json. max_predictions defaults to the manifest's `max_predictions_per_seq`, else
        round(max_seq_length * masked_lm_prob)."""
        tokenizer = manifest["tokenizer"]
        vocab_tokens = load_vocab_tokens(Path(folder) / tokenizer["file"])
        special_ids = [tokenizer[key] for key in ("pad_id", "unk_id", "cls_id", "sep_id", "mask_id")]
        max_seq_length = int(manifest["max_seq_length"])
        if max_predictions is None:
            max_predictions = int(
                manifest.get("max_predictions_per_seq", round(max_seq_length * masked_lm_prob))
            )
        vocab_size = max(int(tokenizer["vocab_size"]), len(vocab_tokens))
        return cls(
            max_seq_length=max_seq_length,
            vocab_size=vocab_size,
            pad_id=tokenizer["pad_id"],
            mask_id=tokenizer["mask_id"],
            special_ids=special_ids,
            random_token_ids=random_token_table(vocab_tokens, special_ids),
            max_predictions=max_predictions,
            seed=seed,
            masked_lm_prob=masked_lm_prob,
            word_starts_table=word_start_table(vocab_tokens) if whole_word_masking else None,
        )

    def mask_sample(self, input_ids: np.ndarray, epoch: int, index: int) -> MaskedTokens:
        """Dynamic masks of one sample, a function of (seed, epoch, index) only."""
        rng = np.random.default_rng([self.seed, epoch, index])
        return mask_tokens(
            input_ids,
            rng,
            mask_id=self.mask_id,
            random_token_ids=self.random_token_ids,
            max_predictions=self.max_predictions,
            masked_lm_prob=self.masked_lm_prob,
            special_mask=self.is_special[input_ids],
            word_starts=None if self.word_starts_table is None else self.word_starts_table[input_ids],
        )

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        # Imported here: preparation workers import this module for static masking and need no torch.
        import torch

        batch_size, length = len(samples), self.max_seq_length
        input_ids = np.full((batch_size, length), self.pad_id, dtype=np.int64)
        labels = np.full((batch_size, length), IGNORE_INDEX, dtype=np.int64)
        lengths = np.empty(batch_size, dtype=np.int64)
        num_a_tokens = np.empty(batch_size, dtype=np.int64)
        next_sentence_label = np.empty(batch_size, dtype=np.int64)
        mlm_positions = np.zeros((batch_size, self.max_predictions), dtype=np.int64)
        for row, sample in enumerate(samples):
            ids = np.asarray(sample["input_ids"], dtype=np.int64)
            if len(ids) > length:
                raise DataError(f"sample {sample.get('index')}: {len(ids)} tokens > max_seq_length {length}")
            if "masked_lm_positions" in sample:
                masked_ids = ids
                positions = np.asarray(sample["masked_lm_positions"], dtype=np.int64)
                original_ids = np.asarray(sample["masked_lm_ids"], dtype=np.int64)
            else:
                masked_ids, positions, original_ids = self.mask_sample(ids, sample["epoch"], sample["index"])
            if len(positions) > self.max_predictions:
                raise DataError(
                    f"sample {sample.get('index')}: {len(positions)} masked positions > max_predictions "
                    f"{self.max_predictions} (the manifest's max_predictions_per_seq)"
                )
            input_ids[row, : len(ids)] = masked_ids
            labels[row, positions] = original_ids
            mlm_positions[row, : len(positions)] = np.sort(positions)
            lengths[row] = len(ids)
            num_a_tokens[row] = sample["num_a_tokens"]
            next_sentence_label[row] = sample["next_sentence_label"]
        position = np.arange(length)
        attention_mask = position < lengths[:, None]
        token_type_ids = (position >= num_a_tokens[:, None]) & attention_mask
        return {
            "input_ids": torch.from_numpy(input_ids),
            "token_type_ids": torch.from_numpy(token_type_ids.astype(np.int64)),
            "attention_mask": torch.from_numpy(attention_mask.astype(np.int64)),
            "labels": torch.from_numpy(labels),
            "next_sentence_label": torch.from_numpy(next_sentence_label),
            "mlm_positions": torch.from_numpy(mlm_positions),
        }
