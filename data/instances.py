"""NSP sentence-pair instances: the original BERT `create_pretraining_data.py` algorithm.

Input is a list of documents, each a list of sentences, each a list of WordPiece token ids without
special tokens. Output is one `Instance` per sequence: `[CLS] A [SEP] B [SEP]`, where B is the true
continuation of A (label 0) or a span of another document (label 1), the convention of
`transformers.BertForPreTraining`.

Differences from the original, each on purpose:
- The random B document is drawn uniformly from the *other* non-empty documents, so it can never be
  the same document (the original retried ten times and could still fall back to itself).
- With a single non-empty document there is nothing to draw a random B from: a chunk of two or more
  sentences uses its true continuation, a one-sentence chunk is skipped.
- Truncation draws the number of front removals per side as one binomial sample (one
  `getrandbits`) instead of one coin flip per removed token; the distribution is the same.
- Instances are returned in creation order, not shuffled: the training sampler permutes globally.
- An instance whose A or B is empty (possible only with empty sentences in the input) is skipped.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from itertools import chain
from typing import NamedTuple

# A document is a sequence of sentences; a sentence is a sequence of token ids.
Sentence = Sequence[int]
TokenizedDocument = Sequence[Sentence]


class Instance(NamedTuple):
    """One pretraining sequence.

    input_ids: `[CLS] A [SEP] B [SEP]` as a list of ints, length <= max_seq_length (not padded).
    num_a_tokens: len(A) + 2, the number of leading tokens of segment 0 (token_type_id 0).
    next_sentence_label: 0 when B is A's true continuation, 1 when B comes from another document.
    """

    input_ids: list[int]
    num_a_tokens: int
    next_sentence_label: int


def truncate_counts(length_a: int, length_b: int, max_num_tokens: int) -> tuple[int, int]:
    """How many tokens the original loop removes from A and from B.

    The loop removes one token at a time from the longer side (B on ties) until the pair fits, so the
    counts follow from the lengths alone; only front/back is random.
    """
    excess = length_a + length_b - max_num_tokens
    if excess <= 0:
        return 0, 0
    difference = length_a - length_b
    if difference > 0:
        removed_a = min(excess, difference)
        removed_b = 0
    else:
        removed_a = 0
        removed_b = min(excess, -difference)
    # Now the sides are equal (or the pair fits): removals alternate B, A, B, ...
    remaining = excess - removed_a - removed_b
    return removed_a + remaining // 2, removed_b + remaining - remaining // 2


def _trim(tokens: list[int], num_removed: int, rng: random.Random) -> list[int]:
    """Remove `num_removed` tokens, each from the front or the back with probability 0.5."""
    if num_removed == 0:
        return tokens
    num_front = rng.getrandbits(num_removed).bit_count()
    return tokens[num_front : len(tokens) - (num_removed - num_front)]


def create_instances(
    documents: Sequence[TokenizedDocument],
    max_seq_length: int,
    short_seq_prob: float,
    rng: random.Random,
    cls_id: int,
    sep_id: int,
    duplicate_factor: int = 1,
    short_per_chunk: bool = False,
) -> list[Instance]:
    """All NSP instances of `documents`, `duplicate_factor` passes, deterministic given `rng`'s state.

    Per document (the original algorithm), or per chunk with `short_per_chunk`: the target length is
    `max_seq_length - 3`, or with probability `short_seq_prob` a uniform length in [2, max_seq_length - 3].
    Drawn once per document, one unlucky draw makes a whole long document (a book) short: every chunk one
    sentence, hence every pair random-next. Drawn per chunk, 10 % of the chunks are short wherever they
    are. Sentences accumulate into a chunk until it reaches the
    target or the document ends; A is the chunk's first `a_end` sentences (`a_end` uniform in
    [1, len - 1], 1 for a one-sentence chunk). With probability 0.5, and always for a one-sentence
    chunk, B is a run of sentences of another document from a random start, up to `target - len(A)`
    tokens, and the chunk's unused sentences are revisited; otherwise B is the rest of the chunk. The
    pair is truncated to `max_seq_length - 3` tokens by removing from the longer side.
    """
    if max_seq_length < 5:
        raise ValueError(f"max_seq_length must be >= 5 to hold [CLS] A [SEP] B [SEP], got {max_seq_length}")
    if duplicate_factor < 1:
        raise ValueError(f"duplicate_factor must be >= 1, got {duplicate_factor}")
    max_num_tokens = max_seq_length - 3
    # Random B segments are drawn among the non-empty documents other than the current one.
    non_empty = [index for index, document in enumerate(documents) if len(document) > 0]
    position_of = {document_index: position for position, document_index in enumerate(non_empty)}
    num_others = len(non_empty) - 1

    # Bound methods and locals: this loop runs once per sentence of the corpus.
    random_float = rng.random
    randint = rng.randint
    randrange = rng.randrange
    flatten = chain.from_iterable
    instances: list[Instance] = []
    append = instances.append

    for _ in range(duplicate_factor):
        for document_index in non_empty:
            document = documents[document_index]
            num_sentences = len(document)
            own_position = position_of[document_index]
            target_length = max_num_tokens
            if not short_per_chunk and random_float() < short_seq_prob:
                target_length = randint(2, max_num_tokens)
            chunk: list[Sentence] = []
            chunk_length = 0
            sentence_index = 0
            while sentence_index < num_sentences:
                if short_per_chunk and not chunk:  # a new chunk (after an emitted or a skipped one)
                    short = random_float() < short_seq_prob
                    target_length = randint(2, max_num_tokens) if short else max_num_tokens
                sentence = document[sentence_index]
                chunk.append(sentence)
                chunk_length += len(sentence)
                if sentence_index == num_sentences - 1 or chunk_length >= target_length:
                    num_chunk = len(chunk)
                    if num_others == 0 and num_chunk == 1:  # nowhere to draw a random B from: skip
                        chunk = []
                        chunk_length = 0
                        sentence_index += 1
                        continue
                    a_end = randint(1, num_chunk - 1) if num_chunk >= 2 else 1
                    tokens_a = list(flatten(chunk[:a_end]))
                    is_random_next = num_others > 0 and (num_chunk == 1 or random_float() < 0.5)
                    if is_random_next:
                        other = randrange(num_others)
                        if other >= own_position:  # skip over this document
                            other += 1
                        random_document = documents[non_empty[other]]
                        target_b_length = target_length - len(tokens_a)
                        tokens_b: list[int] = []
                        for random_sentence in random_document[randrange(len(random_document)) :]:
                            tokens_b.extend(random_sentence)
                            if len(tokens_b) >= target_b_length:
                                break
                        # The chunk's sentences after A were not used: revisit them.
                        sentence_index -= num_chunk - a_end
                    else:
                        tokens_b = list(flatten(chunk[a_end:]))
                    removed_a, removed_b = truncate_counts(len(tokens_a), len(tokens_b), max_num_tokens)
                    if removed_a:
                        tokens_a = _trim(tokens_a, removed_a, rng)
                    if removed_b:
                        tokens_b = _trim(tokens_b, removed_b, rng)
                    if tokens_a and tokens_b:
                        input_ids = [cls_id, *tokens_a, sep_id, *tokens_b, sep_id]
                        append(Instance(input_ids, len(tokens_a) + 2, int(is_random_next)))
                    chunk = []
                    chunk_length = 0
                sentence_index += 1
    return instances
