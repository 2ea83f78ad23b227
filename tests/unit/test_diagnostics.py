"""Optimizer diagnostics (pretrain/observability/diagnostics.py) on a tiny BERT in one process, and the vocab
subset."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertForPreTraining

from data.vocab_subset import subset_vocabulary
from pretrain.observability.diagnostics import BUCKETS, FAMILIES, Diagnostics, family_of
from pretrain.optim import Lamb, OnebitLamb, param_groups
from pretrain.optim.onebit_lamb import DEEPSPEED_ALGORITHM

VOCAB = 50


def _model() -> BertForPreTraining:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    return BertForPreTraining(config)


def _backward(model: BertForPreTraining, step: int) -> None:
    generator = torch.Generator().manual_seed(step)
    ids = torch.randint(5, 25, (4, 12), generator=generator)  # tokens 25+ never occur
    labels = torch.full_like(ids, -100)
    labels[:, 3] = ids[:, 3]
    model.zero_grad(set_to_none=True)
    output = model(input_ids=ids, labels=labels, next_sentence_label=torch.zeros(4, dtype=torch.long))
    output.loss.backward()


@pytest.mark.parametrize(
    ("name", "family"),
    [
        ("bert.embeddings.word_embeddings.weight", "word_embeddings"),
        ("bert.embeddings.token_type_embeddings.weight", "position_type_embeddings"),
        ("bert.embeddings.LayerNorm.weight", "layernorm_bias"),
        ("bert.encoder.layer.3.attention.self.query.weight", "attention"),
        ("bert.encoder.layer.3.attention.output.dense.weight", "attention"),
        ("bert.encoder.layer.3.attention.self.query.bias", "layernorm_bias"),
        ("bert.encoder.layer.3.intermediate.dense.weight", "ffn"),
        ("bert.encoder.layer.3.output.dense.weight", "ffn"),
        ("cls.predictions.bias", "mlm_head"),
        ("cls.predictions.transform.LayerNorm.bias", "mlm_head"),
        ("bert.pooler.dense.weight", "pooler_nsp"),
        ("cls.seq_relationship.weight", "pooler_nsp"),
    ],
)
def test_families(name: str, family: str):
    assert family_of(name) == family


def test_every_bert_parameter_has_a_listed_family():
    assert {family_of(name) for name, _ in _model().named_parameters()} == set(FAMILIES)


def test_lamb_update_sizes_and_vocabulary_buckets():
    model = _model()
    optimizer = Lamb(param_groups(model, 0.01), lr=0.01)
    counts = torch.zeros(VOCAB, dtype=torch.int64)
    counts[5:25] = torch.tensor([2000] * 3 + [500] * 7 + [50] * 5 + [3] * 5)
    diagnostics = Diagnostics(model, optimizer, counts)
    for step in range(3):
        diagnostics.begin_step(active=step == 2)
        _backward(model, step)
        optimizer.step()
        metrics = diagnostics.end_step(skipped=False)
        assert bool(metrics) == (step == 2)
    # LAMB's rule: ‖Δp‖ = η‖p‖ on decayed matrices, so both ratios equal the LR there
    for family in ("attention", "ffn"):
        assert metrics[f"diag/update_ratio/{family}"] == pytest.approx(0.01, rel=1e-3)
        assert metrics[f"diag/lamb_update_ratio/{family}"] == pytest.approx(0.01, rel=1e-3)
    assert metrics["diag/vocab_rows/unseen"] == VOCAB - 20 and metrics["diag/vocab_rows/1000+"] == 3
    assert sum(metrics[f"diag/vocab_rows/{name}"] for name, _, _ in BUCKETS) == VOCAB
    # the decoder is tied to the embedding: even rows of tokens that never occur get gradients (softmax)
    assert all(metrics[f"diag/vocab_update_rms/{name}"] > 0 for name, _, _ in BUCKETS)
    assert all(metrics[f"diag/tiny_variance_rows/{name}"] == 0 for name, _, _ in BUCKETS)
    assert "diag/fidelity_cos/attention" not in metrics  # no 1-bit exchange in LAMB


def test_fidelity_of_an_exact_exchange_is_perfect():
    """One process, one worker: the exchange is the identity, so cosine 1 and error 0 — and the probe
    sees it through the same hooks as on many ranks."""
    model = _model()
    optimizer = OnebitLamb(param_groups(model, 0.01), lr=0.01, freeze_step=1, virtual_workers=2)
    diagnostics = Diagnostics(model, optimizer, None)
    _backward(model, 0)
    optimizer.step()  # warmup
    # compression stage: both virtual workers get the same gradient, so the exact average is it
    _backward(model, 1)
    grads = [p.grad.clone() for group in optimizer.param_groups for p in group["params"]]
    for worker in range(2):
        torch._foreach_copy_(optimizer.worker_gradient_views(worker), grads)
    diagnostics.begin_step(active=True)
    optimizer.step()
    metrics = diagnostics.end_step(skipped=False)
    for family in ("attention", "ffn", "word_embeddings"):
        assert -1.0 <= metrics[f"diag/fidelity_cos/{family}"] <= 1.0
        assert metrics[f"diag/fidelity_rel_error/{family}"] >= 0.0
        assert -1.0 <= metrics[f"diag/step_fidelity_cos/{family}"] <= 1.0
    # 1-bit LAMB's step in the compression stage: c̄·f·η·‖u‖, not LAMB's η‖p‖
    assert metrics["diag/update_ratio/attention"] != pytest.approx(
        metrics["diag/lamb_update_ratio/attention"]
    )
    assert metrics["diag/lamb_update_ratio/attention"] == pytest.approx(0.01, rel=1e-3)  # LAMB's: η


def test_skipped_steps_report_nothing():
    model = _model()
    optimizer = Lamb(param_groups(model, 0.01), lr=0.01)
    diagnostics = Diagnostics(model, optimizer, None)
    diagnostics.begin_step(active=True)
    assert diagnostics.end_step(skipped=True) == {}


def test_vocabulary_subset_keeps_characters_and_frequent_tokens():
    vocab = [
        "[PAD]",
        "[UNK]",
        "[CLS]",
        "[SEP]",
        "[MASK]",
        "the",
        "a",
        "##s",
        "cat",
        "##at",
        "c",
        "t",
        "##t",
        "zz",
    ]
    counts = np.array([0, 0, 0, 0, 0, 100, 50, 40, 30, 5, 0, 0, 0, 0])
    kept = subset_vocabulary(vocab, counts, 14)
    assert kept[:5] == vocab[:5]  # special tokens, original order
    # every character of a seen token, in both forms where the vocab has them
    assert {"c", "t", "##t", "a", "##s"} <= set(kept)
    assert "zz" not in kept  # never seen
    # 5 special + 5 character tokens; then by count: "the", "cat" fit in 12, "##at" (count 5) does not
    smaller = subset_vocabulary(vocab, counts, 12)
    assert "cat" in smaller and "##at" not in smaller and len(smaller) == 12
    with pytest.raises(ValueError, match="do not fit"):
        subset_vocabulary(vocab, counts, 8)


def test_live_trust_ratio_steps_as_lamb_would():
    """`trust_ratio=live`: the compression step's update ratio is LAMB's rule's, η on weight matrices."""
    model = _model()
    optimizer = OnebitLamb(
        param_groups(model, 0.01),
        lr=0.01,
        freeze_step=1,
        algorithm=DEEPSPEED_ALGORITHM.replace(trust_ratio="live"),
    )
    diagnostics = Diagnostics(model, optimizer, None)
    _backward(model, 0)
    optimizer.step()  # warmup
    _backward(model, 1)
    diagnostics.begin_step(active=True)
    optimizer.step()
    metrics = diagnostics.end_step(skipped=False)
    for family in ("attention", "ffn"):
        assert metrics[f"diag/update_ratio/{family}"] == pytest.approx(0.01, rel=1e-3)
        assert metrics[f"diag/lamb_update_ratio/{family}"] == pytest.approx(0.01, rel=1e-3)


def test_step_fidelity_weighs_by_the_variance():
    """In step units m/(√v+ε): with one variance everywhere the figures equal the momentum-unit ones; with a
    variance 10⁶ times larger on half of a tensor, that half stops counting."""
    model = _model()
    optimizer = OnebitLamb(param_groups(model, 0.01), lr=0.01, freeze_step=1, virtual_workers=2)
    diagnostics = Diagnostics(model, optimizer, None)
    _backward(model, 0)
    optimizer.step()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
        optimizer.state[p]["exp_avg_sq"].fill_(0.09)
    results = []
    for uneven in (False, True):
        if uneven:
            for p in params:
                optimizer.state[p]["exp_avg_sq"].view(-1)[: p.numel() // 2] = 0.09e6
        for worker in range(2):
            _backward(model, 2 + worker)
            torch._foreach_copy_(optimizer.worker_gradient_views(worker), [p.grad for p in params])
        diagnostics.begin_step(active=True)
        optimizer.step()
        results.append(diagnostics.end_step(skipped=False))
    even, uneven_metrics = results
    for family in ("attention", "ffn"):
        assert even[f"diag/step_fidelity_cos/{family}"] == pytest.approx(even[f"diag/fidelity_cos/{family}"])
        assert even[f"diag/step_fidelity_rel_error/{family}"] == pytest.approx(
            even[f"diag/fidelity_rel_error/{family}"]
        )
        assert uneven_metrics[f"diag/step_fidelity_cos/{family}"] != pytest.approx(
            uneven_metrics[f"diag/fidelity_cos/{family}"], abs=1e-3
        )
