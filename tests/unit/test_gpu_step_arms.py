"""The GPU training step's arms (issue #51 item 1), checked on the CPU where the check means something:
the padded vocabulary (same loss and gradients; the HF export keeps the tokenizer's rows and loads in plain
transformers with the same logits), CUDA graphs' static gradient buffers (the same gradients as plain
accumulation; the option itself refused off CUDA in one line), and phase-2 length bins (the same tokens,
only padding removed). Their speed is measured on a GPU by `make gpu-check`'s `arms` check."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import BertForPreTraining

from data.masking import MaskingCollator
from pretrain.config import PhaseConfig
from pretrain.distributed.process_group import DistributedEnv
from pretrain.model import (
    GraphedStep,
    ModelConfig,
    ModelSize,
    PretrainingObjective,
    StaticGradients,
    build_model,
    padded_size,
)
from pretrain.train.phase_data import SEQUENCE_KEYS, bin_by_length

VOCAB = 30522  # BERT's: no multiple of 8


def _batch(micro: int, seq: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    masked = 5
    labels = torch.full((micro, seq), -100)
    positions = torch.zeros(micro, masked, dtype=torch.long)
    for row in range(micro):
        chosen = (torch.randperm(seq - 2, generator=generator)[:masked] + 1).sort().values
        labels[row, chosen] = torch.randint(vocab, (masked,), generator=generator)
        positions[row] = chosen
    return {
        "input_ids": torch.randint(vocab, (micro, seq), generator=generator),
        "token_type_ids": torch.zeros(micro, seq, dtype=torch.long),
        "attention_mask": torch.ones(micro, seq, dtype=torch.long),
        "labels": labels,
        "next_sentence_label": torch.randint(2, (micro,), generator=generator),
        "mlm_positions": positions,
    }


def _tiny(vocab: int = VOCAB, dropout: float = 0.0) -> BertForPreTraining:
    torch.manual_seed(0)
    config = ModelConfig(
        size=ModelSize.bert_tiny, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout
    )
    return build_model(config, vocab, torch.device("cpu"))


def test_padded_size_and_the_device_default():
    assert padded_size(30522, 64) == 30528 and padded_size(30522, 8) == 30528 and padded_size(64, 64) == 64
    assert ModelConfig().vocab_multiple(torch.device("cpu")) == 1  # CPU runs unchanged
    assert ModelConfig().vocab_multiple(torch.device("cuda", 0)) == 64  # the GPU default, pending measurement
    assert ModelConfig(pad_vocab_multiple=1).vocab_multiple(torch.device("cuda", 0)) == 1
    with pytest.raises(ValueError, match="pad_vocab_multiple"):
        ModelConfig(pad_vocab_multiple=0)


def test_the_padded_vocabulary_gives_the_unpadded_loss_and_gradients():
    model = _tiny()
    batch = _batch(4, 32, VOCAB)
    results = []
    for multiple in (1, 64):
        model.zero_grad(set_to_none=True)
        mlm, nsp, correct, count = PretrainingObjective(model, multiple)(**batch)
        (mlm + nsp).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((mlm.detach(), correct, count, grads))
    (loss, correct, count, grads), (padded_loss, padded_correct, padded_count, padded_grads) = results
    torch.testing.assert_close(padded_loss, loss, rtol=1e-6, atol=0)
    assert torch.equal(padded_correct, correct) and torch.equal(padded_count, count)
    assert grads.keys() == padded_grads.keys()
    for name in grads:  # the same shapes (no padding rows reach the parameters), values within rounding
        torch.testing.assert_close(padded_grads[name], grads[name], rtol=1e-5, atol=1e-7)
    assert model.cls.predictions.decoder.weight.shape[0] == VOCAB


def test_an_export_of_the_padded_model_loads_in_plain_transformers_with_the_same_logits(tmp_path):
    from pretrain.train.checkpointing import HfExport
    from pretrain.train.step_metrics import TrainState

    class Tokenizer:  # the export writes the tokenizer beside the model; here only the model matters
        def save_pretrained(self, folder):
            pass

    model = _tiny()
    padded = PretrainingObjective(model, 64)
    # one training step, so that the decoder's bias is not all zeros
    mlm, nsp, _, _ = padded(**_batch(4, 32, VOCAB))
    (mlm + nsp).backward()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter -= 0.1 * parameter.grad
    HfExport(model, Tokenizer(), {})(tmp_path, TrainState())

    plain = BertForPreTraining.from_pretrained(tmp_path).eval()
    assert plain.config.vocab_size == VOCAB and plain.cls.predictions.decoder.weight.shape[0] == VOCAB
    model.eval()
    batch = _batch(3, 32, VOCAB, seed=1)
    inputs = {k: batch[k] for k in ("input_ids", "token_type_ids", "attention_mask")}
    with torch.no_grad():
        logits = plain(**inputs).prediction_logits  # every position, plain transformers
        hidden = model.bert(**inputs, return_dict=False)[0]
        padded_logits = padded.mlm_logits(hidden.flatten(0, 1)).view_as(logits)
    assert padded_logits.shape[-1] == VOCAB
    torch.testing.assert_close(padded_logits, logits, rtol=1e-5, atol=1e-5)


def test_static_gradient_buffers_accumulate_the_plain_gradients():
    """CUDA graphs' accumulation path (every .grad allocated before the first backward, the micro-batches'
    gradients added into it), run eagerly on the CPU: the gradients of plain accumulation, bitwise."""
    model = _tiny(vocab=500)
    objective = PretrainingObjective(model)
    batches = [_batch(2, 16, 500, seed=s) for s in range(3)]
    params = [p for p in model.parameters() if p.requires_grad]

    def accumulate(step: torch.nn.Module) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        for batch in batches:
            mlm, nsp, _, _ = step(**batch)
            ((mlm + nsp) / len(batches)).backward()
        return [p.grad.clone() for p in params]

    plain = accumulate(objective)
    graphed = GraphedStep(objective, params)
    static = accumulate(graphed)
    assert all(torch.equal(a, b) for a, b in zip(plain, static, strict=True))
    again = accumulate(graphed)  # after zero_grad(set_to_none=True) the buffers come back
    assert all(torch.equal(a, b) for a, b in zip(plain, again, strict=True))
    # buffers allocated before any backward: zeros, then added into in place
    model.zero_grad(set_to_none=True)
    StaticGradients(params).begin_micro_step()
    assert all(p.grad is not None and not p.grad.any() for p in params)


def test_cuda_graphs_are_refused_off_cuda_in_one_line(tmp_path):
    from tests.integration.pretrain_helpers import compose_train_config

    with pytest.raises(ValueError, match=r"needs model\.compile=true"):
        ModelConfig(cuda_graphs=True)
    cfg = compose_train_config(
        [
            "model=bert_tiny",
            "batch=demo",
            f"data_dir={tmp_path}",
            f"run_dir={tmp_path}",
            "model.compile=true",
            "model.cuda_graphs=true",
        ]
    )
    from pretrain.train.train_setup import build_components

    env = DistributedEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    with pytest.raises(ValueError, match=r"^model\.cuda_graphs=true needs a CUDA device") as error:
        build_components(cfg, env)
    assert "\n" not in str(error.value)


# ------------------------------------------------------------------------------------------- length bins


def _collated_step(
    micro: int, accumulation: int, length: int, seed: int = 0
) -> list[dict[str, torch.Tensor]]:
    """One step's micro-batches from the training collator: samples of mixed lengths (most short, as
    MLPerf's seq-512 data, ~half of it padding), dynamically masked."""
    rng = np.random.default_rng(seed)
    vocab = 200
    collator = MaskingCollator(
        max_seq_length=length,
        vocab_size=vocab,
        pad_id=0,
        mask_id=4,
        special_ids=[0, 1, 2, 3, 4],
        random_token_ids=np.arange(5, vocab),
        max_predictions=length * 15 // 100 + 1,
        seed=seed,
    )
    batches = []
    for m in range(accumulation):
        samples = []
        for i in range(micro):
            n = int(rng.choice([rng.integers(10, length // 2), rng.integers(length // 2, length + 1)]))
            ids = rng.integers(5, vocab, size=n)
            ids[0], ids[n // 2], ids[-1] = 2, 3, 3  # [CLS] a [SEP] b [SEP]
            index = m * micro + i
            samples.append(
                {"input_ids": ids, "num_a_tokens": n // 2 + 1, "next_sentence_label": index % 2, "epoch": 0,
                 "index": index}
            )  # fmt: skip
        batches.append(collator(samples))
    return batches


def _samples(batches: list[dict[str, torch.Tensor]]) -> list[tuple]:
    """Every sample's content without its padding: tokens, token types, (position, label) pairs, its
    masked positions and NSP label; sorted, so that the order of samples does not matter."""
    out = []
    for batch in batches:
        for row in range(len(batch["input_ids"])):
            n = int(batch["attention_mask"][row].sum())
            assert bool(batch["attention_mask"][row, :n].all())  # padding only at the end
            labels = batch["labels"][row]
            masked = (labels != -100).nonzero().flatten()
            out.append(
                (
                    tuple(batch["input_ids"][row, :n].tolist()),
                    tuple(batch["token_type_ids"][row, :n].tolist()),
                    tuple(zip(masked.tolist(), labels[masked].tolist())),
                    tuple(p for p in batch["mlm_positions"][row].tolist() if p),
                    int(batch["next_sentence_label"][row]),
                )
            )
    return sorted(out)


def test_length_bins_train_the_same_tokens_with_less_padding():
    length, micro, accumulation, bins = 128, 4, 8, [32, 64, 96, 128]
    batches = _collated_step(micro, accumulation, length)
    binned = bin_by_length(batches, bins)
    assert len(binned) == accumulation
    assert all(len(b["input_ids"]) == micro for b in binned)  # the same micro-batch size
    widths = [b["input_ids"].shape[1] for b in binned]
    assert set(widths) <= set(bins) and widths == sorted(widths)
    for batch in binned:  # the static shapes the compiled step sees, the masked positions inside them
        assert all(batch[k].shape == (micro, batch["input_ids"].shape[1]) for k in SEQUENCE_KEYS)
        assert batch["mlm_positions"].shape == batches[0]["mlm_positions"].shape
        assert int(batch["mlm_positions"].max()) < batch["input_ids"].shape[1]
    # exactly the same samples, tokens, masked positions and labels; only padding gone
    assert _samples(binned) == _samples(batches)
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    assert sum(int(b["attention_mask"].sum()) for b in binned) == tokens
    assert sum(b["input_ids"].numel() for b in binned) < 0.85 * sum(b["input_ids"].numel() for b in batches)
    # the MLM loss's terms: the same (position, label) pairs, gathered through mlm_positions
    model = _tiny(vocab=200)
    objective = PretrainingObjective(model)
    counts = [sum(int(objective(**b)[3]) for b in step) for step in (batches, binned)]
    assert counts[0] == counts[1] > 0


def test_length_bins_are_validated():
    common = {
        "name": "p2",
        "max_seq_length": 512,
        "global_batch": 32,
        "micro_batch": 4,
        "steps": 1,
        "lr": 1e-3,
    }
    assert PhaseConfig(**common, length_bins=[128, 256, 384, 512]).length_bins == [128, 256, 384, 512]
    for bad in ([128, 256], [256, 128, 512], [100, 512], [], [64, 128, 192, 256, 320, 384, 448, 512]):
        with pytest.raises(ValueError, match="length_bins"):
            PhaseConfig(**common, length_bins=bad)
