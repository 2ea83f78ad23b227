"""Linear probe of pretrained checkpoints on SST-2: whether the frozen encoder's features separate a
pretrained BERT-mini from the random-init floor better than fine-tuning does.

For each checkpoint (an HF export, `<run>/checkpoints/step-*/hf`) the encoder is frozen and each sentence
(length 32, as the rung's fine-tunes) becomes the concatenation of its [CLS] vector and the mean of its
tokens' last hidden states; a logistic regression (scikit-learn, features standardised on the training
subset) is fitted on `--train` sentences of SST-2's training set (a fixed random subset, seed 0) at each
`--c` and scored on the 872 dev sentences.

    .venv/bin/python results/cpu-study-m/sst2_linear_probe.py \
        results/runs/cpu-rung-floor-bert_mini/checkpoints/step-00000000/hf \
        results/runs/cpu-rung-m-lamb-lr1e-2-n2-s3/checkpoints/step-00003200/hf
"""

from __future__ import annotations

import argparse
import csv
import os
from pathlib import Path

import numpy as np
import torch
from sklearn.linear_model import LogisticRegression
from transformers import AutoTokenizer, BertModel

SST2 = Path(os.environ.get("BERT_SHARED_DATA", "../shared/data")) / "glue_data" / "SST-2"


def read_tsv(path: Path) -> tuple[list[str], np.ndarray]:
    with path.open(newline="") as file:
        rows = list(csv.DictReader(file, delimiter="\t", quoting=csv.QUOTE_NONE))
    return [row["sentence"] for row in rows], np.array([int(row["label"]) for row in rows])


@torch.no_grad()
def features(checkpoint: Path, sentences: list[str], max_length: int) -> np.ndarray:
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = BertModel.from_pretrained(checkpoint, add_pooling_layer=False).eval()
    out = []
    for start in range(0, len(sentences), 256):
        batch = tokenizer(
            sentences[start : start + 256], truncation=True, max_length=max_length, padding=True,
            return_tensors="pt",
        )  # fmt: skip
        hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        out.append(torch.cat([hidden[:, 0], (hidden * mask).sum(1) / mask.sum(1)], dim=1).numpy())
    return np.concatenate(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="+", type=Path, help="HF exports (<run>/checkpoints/step-*/hf)")
    parser.add_argument("--train", type=int, default=20_000, help="training sentences (a random subset)")
    parser.add_argument("--c", type=float, nargs="+", default=[0.01, 0.1, 1.0], help="inverse L2 strengths")
    parser.add_argument("--max-length", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    train_text, train_labels = read_tsv(SST2 / "train.tsv")
    keep = np.random.default_rng(0).permutation(len(train_text))[: args.train]
    train_text, train_labels = [train_text[i] for i in keep], train_labels[keep]
    dev_text, dev_labels = read_tsv(SST2 / "dev.tsv")
    print("checkpoint | " + " | ".join(f"dev accuracy, C={c:g}" for c in args.c))
    for checkpoint in args.checkpoints:
        train_x = features(checkpoint, train_text, args.max_length)
        dev_x = features(checkpoint, dev_text, args.max_length)
        mean, std = train_x.mean(0), train_x.std(0) + 1e-6
        train_x, dev_x = (train_x - mean) / std, (dev_x - mean) / std
        scores = [
            LogisticRegression(C=c, max_iter=2000).fit(train_x, train_labels).score(dev_x, dev_labels)
            for c in args.c
        ]
        print(f"{checkpoint} | " + " | ".join(f"{100 * s:.2f}" for s in scores))


if __name__ == "__main__":
    main()
