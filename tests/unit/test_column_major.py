"""Column-major matrices for `per_column` (`pretrain.model.column_major_linear_weights_`): the model computes
the same, saves and loads ordinary tensors, and 1-bit LAMB steps it exactly as it steps the row-major model
(whose matrices it transposes into the exchange layout and back), with no transpose at all."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_model, save_model
from transformers import BertConfig, BertForPreTraining

from pretrain.model import column_major_linear_weights_
from pretrain.optim import OnebitLamb, param_groups
from pretrain.optim.base import flat_views, views_like
from pretrain.optim.config import OnebitLambConfig

VOCAB = 50


def _model(column_major: bool) -> BertForPreTraining:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32
    )
    model = BertForPreTraining(config)
    if column_major:
        column_major_linear_weights_(model)
    return model


def _batch(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    ids = torch.randint(5, VOCAB, (4, 12), generator=generator)
    labels = torch.full_like(ids, -100)
    labels[:, 3] = ids[:, 3]
    return dict(input_ids=ids, labels=labels, next_sentence_label=torch.zeros(4, dtype=torch.long))


def _groups(model: BertForPreTraining) -> list[dict]:
    """The trainer's groups for optim=onebit_lamb: row-scaled embeddings, the position table masked."""
    return param_groups(model, 0.01, max_seq_length=12, row_scales=True)


def test_linear_weights_become_column_major_and_the_rest_stays():
    model = _model(column_major=True)
    decoder = model.cls.predictions.decoder.weight
    assert decoder is model.bert.embeddings.word_embeddings.weight and decoder.is_contiguous()  # tied: kept
    linear = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight is not decoder]
    assert len(linear) == 2 * 6 + 3  # per layer q, k, v, o, in, out; pooler, MLM transform, NSP
    for weight in linear:
        assert not weight.is_contiguous() and weight.t().is_contiguous()
    assert column_major_linear_weights_(model) == 0  # idempotent
    reference = _model(column_major=False)
    for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters()):
        assert a.shape == b.shape and torch.equal(a, b), name


def test_forward_backward_agree_and_gradients_come_back_column_major(tmp_path):
    models = [_model(column_major=False), _model(column_major=True)]
    losses = []
    for model in models:
        model.eval()
        loss = model(**_batch(0)).loss
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    for (name, p), (_, q) in zip(models[0].named_parameters(), models[1].named_parameters()):
        assert q.grad.stride() == q.stride(), name  # autograd's layout contract: no copy per step
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7)
    # checkpoints hold ordinary row-major tensors and load into either layout element by element
    save_model(models[1], str(tmp_path / "model.safetensors"))
    fresh = _model(column_major=False)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    load_model(fresh, str(tmp_path / "model.safetensors"))
    for (name, p), (_, q) in zip(fresh.named_parameters(), models[1].named_parameters()):
        assert torch.equal(p, q), name
    models[1].save_pretrained(tmp_path / "hf")  # the export fine-tuning reads
    exported = BertForPreTraining.from_pretrained(tmp_path / "hf")
    for (name, p), (_, q) in zip(exported.named_parameters(), models[1].named_parameters()):
        assert p.is_contiguous() and torch.equal(p, q), name


def test_views_and_flat_views_keep_the_memory_order():
    matrix = torch.arange(6.0).view(3, 2).t().contiguous().t()  # [3, 2] column-major
    flat = torch.arange(100.0, 106.0)
    (view,) = views_like(flat, [matrix])
    assert view.shape == (3, 2) and view.stride() == matrix.stride()
    assert flat_views(view)[0].data_ptr() == flat.data_ptr()  # a view, in memory order
    with pytest.raises(ValueError, match="different memory orders"):
        flat_views(matrix, matrix.contiguous())
    with pytest.raises(ValueError, match="row-major, or column-major"):
        flat_views(torch.zeros(4, 4)[:, ::2])


def _gradients(model: BertForPreTraining, seed: int) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(**_batch(seed)).loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def test_onebit_lamb_steps_the_column_major_model_exactly_like_the_row_major_one():
    """Two virtual workers, the project's default 1-bit LAMB (per_column, preconditioned, live ratio), the
    same gradients for both models: two warmup steps, then compression steps. The row-major model's matrices
    go through the transposed exchange layout, the column-major one's through none. The parameters agree to
    the last bit or one ulp: the trust ratio's norms sum each tensor in memory order, which differs."""
    models = [_model(column_major=False), _model(column_major=True)]
    config = OnebitLambConfig(freeze_step=2, lr=0.01)
    optimizers = [
        OnebitLamb(_groups(model), virtual_workers=2, **config.optimizer_kwargs()) for model in models
    ]
    for step in range(6):
        warmup = optimizers[0].stage.value == "warmup"
        grads = [_gradients(models[0], 100 * step + worker) for worker in range(1 if warmup else 2)]
        for model, optimizer in zip(models, optimizers):
            params = [p for group in optimizer.param_groups for p in group["params"]]
            order = {id(p): i for i, p in enumerate(model.parameters())}
            for worker, worker_grads in enumerate(grads):
                ordered = [worker_grads[order[id(p)]] for p in params]
                if warmup:
                    for p, g in zip(params, ordered):
                        p.grad = torch.empty_like(p).copy_(g)  # in the parameter's memory order
                else:
                    torch._foreach_copy_(optimizer.worker_gradient_views(worker), ordered)
            optimizer.step()
    row_major, column_major = optimizers
    assert column_major.stage.value == "compression"
    segments = row_major._ensure_state(), column_major._ensure_state()
    assert segments[0][0].transposed is not None and segments[1][0].transposed is None  # nothing to move
    for (name, p), (_, q) in zip(models[0].named_parameters(), models[1].named_parameters()):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-8, msg=name)  # measured: at most 1 ulp apart
