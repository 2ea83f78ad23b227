"""Has a pretrained checkpoint left the unigram stage? Masked-LM accuracy by kind of masked position.

    python -m pretrain.tools.mlm_probe results/runs/<run>                 # its latest checkpoint, its data
    python -m pretrain.tools.mlm_probe <checkpoint or HF folder> --data data/prepared/<name>/seq128

BERT's masked positions are 80 % [MASK], 10 % a random token and 10 % the token itself. A model that
ignores its context copies its input at the kept positions (~90 % right there) and predicts the most
frequent tokens at [MASK]: the usual masked-LM accuracy then reads 12-15 % although the model has learnt
nothing of context. The probe splits the accuracy by kind, prints the share of the most frequent target
(what frequency alone scores at [MASK]), and repeats with the words of every segment shuffled ([CLS],
[SEP], the segments and the masks in place): a model that reads word order loses [MASK] accuracy there.
Masks are drawn as in training (dynamic masking, a fixed seed), on `--samples` instances of the data.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch import Tensor, nn

from pretrain.checkpoint import CheckpointError, latest_checkpoint

KINDS = ("mask", "random", "kept")


@dataclass(frozen=True)
class Breakdown:
    """Accuracy (a fraction) and count per kind of masked position, plus over all of them, and the loss."""

    accuracy: dict[str, float]
    count: dict[str, int]
    loss: float


def breakdown(model: nn.Module, batch: dict[str, Tensor], mask_id: int) -> Breakdown:
    """Score `model` (HF `BertForPreTraining`-like: `.prediction_logits`) on a collated batch."""
    labels = batch["labels"]
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"],
            token_type_ids=batch["token_type_ids"],
            attention_mask=batch["attention_mask"],
        ).prediction_logits
    masked = labels != -100
    logits, targets, inputs = logits[masked].float(), labels[masked], batch["input_ids"][masked]
    right = logits.argmax(dim=-1) == targets
    kinds = {"mask": inputs == mask_id, "kept": inputs == targets}
    kinds["random"] = ~(kinds["mask"] | kinds["kept"])
    accuracy = {
        kind: float(right[kinds[kind]].float().mean()) if kinds[kind].any() else 0.0 for kind in KINDS
    }
    count = {kind: int(kinds[kind].sum()) for kind in KINDS}
    accuracy["all"], count["all"] = float(right.float().mean()), int(masked.sum())
    return Breakdown(accuracy, count, float(nn.functional.cross_entropy(logits, targets)))


def shuffle_words(batch: dict[str, Tensor], special: Tensor, generator: torch.Generator) -> dict[str, Tensor]:
    """A copy of `batch` whose non-special tokens (with their labels) are permuted within each segment of
    each row: the same words and masks, no word order. `special`: a bool table over the vocabulary."""
    ids, labels = batch["input_ids"].clone(), batch["labels"].clone()
    for row in range(ids.shape[0]):
        # a [MASK] is special in the vocabulary table but is a word position here: it moves with its label
        words = ~special[batch["input_ids"][row]] | (batch["labels"][row] != -100)
        words &= batch["attention_mask"][row].bool()
        for segment in (0, 1):
            where = torch.nonzero(words & (batch["token_type_ids"][row] == segment)).flatten()
            order = where[torch.randperm(len(where), generator=generator)]
            ids[row, where], labels[row, where] = ids[row, order], labels[row, order]
    kept = {key: value for key, value in batch.items() if key != "mlm_positions"}  # the labels moved
    return {**kept, "input_ids": ids, "labels": labels}


def most_frequent_share(batch: dict[str, Tensor]) -> float:
    """The share of the masked positions whose target is the most frequent target: frequency alone."""
    targets = batch["labels"][batch["labels"] != -100]
    return float(torch.bincount(targets).max()) / max(1, len(targets))


def _resolve(path: Path, data: Path | None) -> tuple[Path, Path]:
    """(HF folder, prepared seqN folder) from a run folder, a checkpoint folder or an HF folder."""
    run = None
    if (path / "checkpoints").is_dir():
        run, checkpoint = path, latest_checkpoint(path / "checkpoints")
        if checkpoint is None:
            raise CheckpointError(f"{path / 'checkpoints'}: no complete checkpoint")
        hf = checkpoint / "hf"
    elif (path / "hf").is_dir():
        run, hf = path.parent.parent, path / "hf"
    else:
        hf = path
    if not (hf / "config.json").is_file():
        raise CheckpointError(f"{hf}: not an HF model folder (no config.json; was checkpoint.export_hf off?)")
    if data is None:
        config_file = run / "config.yaml" if run is not None else None
        if config_file is None or not config_file.is_file():
            raise CheckpointError(
                f"{path}: no run config.yaml to find the data in: pass --data <prepared>/seqN"
            )
        config = yaml.safe_load(config_file.read_text())
        data = Path(config["data_dir"]) / f"seq{config['batch']['phases'][0]['max_seq_length']}"
    if not (data / "manifest.json").is_file():
        raise CheckpointError(f"{data / 'manifest.json'}: missing (pass --data <prepared folder>/seqN)")
    return hf, data


def probe(path: Path, data: Path | None, samples: int, seed: int) -> dict[str, Any]:
    hf, data = _resolve(path, data)  # a bad path is an error before the heavy imports

    from transformers import BertForPreTraining

    from data.dataset import PretrainingDataset
    from data.masking import MaskingCollator

    manifest = json.loads((data / "manifest.json").read_text())
    dataset = PretrainingDataset(data)
    collator = MaskingCollator.from_manifest(data, manifest, seed=seed)
    model = BertForPreTraining.from_pretrained(hf).eval()
    if model.config.vocab_size < manifest["tokenizer"]["vocab_size"]:
        raise CheckpointError(f"{hf}: vocabulary of {model.config.vocab_size}, the data's is larger ({data})")
    rng = np.random.default_rng(seed)
    chosen = rng.choice(len(dataset), size=min(samples, len(dataset)), replace=False)
    batch = collator([dataset[(0, int(index))] for index in chosen])
    special = torch.from_numpy(collator.is_special)
    generator = torch.Generator().manual_seed(seed)
    mask_id = manifest["tokenizer"]["mask_id"]
    return {
        "model": str(hf),
        "data": str(data),
        "samples": len(chosen),
        "most_frequent_share": most_frequent_share(batch),
        "ordered": breakdown(model, batch, mask_id),
        "shuffled": breakdown(model, shuffle_words(batch, special, generator), mask_id),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pretrain.tools.mlm_probe", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "path", type=Path, help="a run folder (its latest checkpoint), a checkpoint or HF folder"
    )
    parser.add_argument("--data", type=Path, default=None, help="prepared seqN folder (default: the run's)")
    parser.add_argument("--samples", type=int, default=512, help="instances scored (default 512)")
    parser.add_argument("--seed", type=int, default=1, help="instances and masks drawn with it (default 1)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    try:
        result = probe(args.path, args.data, args.samples, args.seed)
    except (CheckpointError, OSError, ValueError) as error:
        print(f"error: {str(error).splitlines()[0]}", file=sys.stderr)
        return 2
    ordered, shuffled = result["ordered"], result["shuffled"]
    if args.json:
        print(json.dumps({**result, "ordered": ordered.__dict__, "shuffled": shuffled.__dict__}, indent=1))
        return 0
    print(f"{result['model']} on {result['samples']} instances of {result['data']}")
    print(f"{'masked position':16} {'count':>7} {'accuracy':>9} {'words shuffled':>15}")
    labels = {"mask": "[MASK]", "random": "random token", "kept": "kept token", "all": "all"}
    for kind, label in labels.items():
        counted, right, shuffled_right = ordered.count[kind], ordered.accuracy[kind], shuffled.accuracy[kind]
        print(f"{label:16} {counted:7d} {right:9.2%} {shuffled_right:15.2%}")
    print(f"most frequent target: {result['most_frequent_share']:.2%} of the masked positions")
    print(f"MLM loss {ordered.loss:.3f} (words shuffled {shuffled.loss:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
