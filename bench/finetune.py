"""SQuAD v1.1 dev preprocessing and post-processing (10,570 questions, BERT uncased vocab).

Records (results/bench/finetune.json):
- feature creation (windows with doc stride, offsets, example ids) features/s; peer: the bare fast
  tokenizer call with the same truncation and stride (the floor any windowing pays), so the ratio is
  what our bookkeeping keeps of the tokenizer's speed;
- post-processing (n-best spans over every window -> answer texts) seconds for the whole dev set,
  peer: the feature creation time of the same run.

    python -m bench finetune
"""

from __future__ import annotations

import sys
import time

import numpy as np

from bench.records import Record, write_records
from data.config import default_shared_data_dir


def main(argv: list[str]) -> None:
    from transformers import BertTokenizerFast  # type: ignore[attr-defined]

    from finetune.tasks import TASKS, load_examples, postprocess_squad, prepare_squad_features

    shared = default_shared_data_dir()
    tokenizer = BertTokenizerFast(vocab=str(shared / "vocab/bert-base-uncased-vocab.txt"))
    examples, _ = load_examples(TASKS["squad"], "dev", data_dir=str(shared / "squad"))

    started = time.perf_counter()
    features = prepare_squad_features(examples, tokenizer, max_length=384, doc_stride=128, train=False)
    ours = time.perf_counter() - started
    num_features = len(features["input_ids"])

    started = time.perf_counter()
    bare = tokenizer(
        [e.question.lstrip() for e in examples],
        [e.context for e in examples],
        truncation="only_second",
        max_length=384,
        stride=128,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
        padding="max_length",
    )
    peer = time.perf_counter() - started
    assert len(bare["input_ids"]) == num_features

    rng = np.random.default_rng(0)
    start_logits = rng.standard_normal((num_features, 384)).astype(np.float32)
    end_logits = rng.standard_normal((num_features, 384)).astype(np.float32)
    started = time.perf_counter()
    predictions = postprocess_squad(
        examples, features, start_logits, end_logits, n_best=20, max_answer_length=30
    )
    post = time.perf_counter() - started
    assert len(predictions) == len(examples)

    config = {"questions": len(examples), "features": num_features, "max_length": 384, "doc_stride": 128}
    write_records(
        "finetune",
        [
            Record(
                "squad_dev_features_per_s",
                num_features / ours,
                "features/s",
                peer="bare fast-tokenizer call, same windows",
                peer_value=num_features / peer,
                config=config,
            ),
            Record(
                "squad_dev_postprocess_seconds",
                post,
                "s",
                peer="feature creation of the same run",
                peer_value=ours,
                config={**config, "n_best": 20, "max_answer_length": 30},
            ),
        ],
    )


if __name__ == "__main__":
    main(sys.argv[1:])
