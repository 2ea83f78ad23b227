"""Column-major matrices for `per_column` (`pretrain.model.column_major_linear_weights_`): the model computes
the same, saves and loads ordinary tensors, and 1-bit LAMB steps it exactly as it steps the row-major model
(whose matrices it transposes into the exchange layout and back), with no transpose at all."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_model, save_model
from transformers import BertConfig, BertForPreTraining

from pretrain.model import column_major_linear_weights_
from pretrain.optim import OnebitLamb, param_groups
from pretrain.optim.base import flat_views, views_like
from pretrain.optim.config import OnebitLambConfig
from pretrain.optim.params import ROW_SCALED_MATRICES

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


# -- optim.ffn_row_scales: the FFN intermediate matrices row-scaled and row-major --------------------------
FFN = "intermediate.dense.weight"


def _ffn_model() -> BertForPreTraining:
    """The trainer's model for `optim.ffn_row_scales=true`: column-major but for the FFN intermediates."""
    model = _model(column_major=False)
    column_major_linear_weights_(model, skip=ROW_SCALED_MATRICES)
    return model.eval()  # no dropout: a resumed run's gradients are the uninterrupted run's


def _ffn_groups(model: BertForPreTraining) -> list[dict]:
    return param_groups(model, 0.01, max_seq_length=12, row_scales=True, ffn_row_scales=True)


def test_ffn_row_scales_groups_layout_and_scale_blocks():
    """With the option the FFN intermediates are row-major, in the row-scaled group (weight decay as
    before) and exchanged with one scale per row of shape[-1] elements; every other tensor as without it."""
    model, reference = _ffn_model(), _model(column_major=True)
    names = {id(p): name for name, p in model.named_parameters()}
    groups, plain = _ffn_groups(model), _groups(reference)
    assert len(groups) == len(plain) == 4
    row_group = next(g for g in groups if g.get("row_scales") and "exp_avg_mask" not in g)
    ffn = [p for p in row_group["params"] if names[id(p)].endswith(FFN)]
    assert len(ffn) == 2 and row_group["weight_decay"] == 0.01  # one per layer
    assert [names[id(p)] for p in row_group["params"][:2]] == [
        "bert.embeddings.word_embeddings.weight",
        "bert.embeddings.token_type_embeddings.weight",
    ]
    for weight in ffn:
        assert weight.shape == (32, 16) and weight.is_contiguous()  # row-major
    assert all(not any(p is q for q in g["params"]) for g in groups if not g.get("row_scales") for p in ffn)
    # the others: the same groups by name, the same layout as the default's
    ref_names = {id(p): name for name, p in reference.named_parameters()}
    ffn_names = {names[id(p)] for p in ffn}
    for group, ref in zip(groups, plain):
        assert group["weight_decay"] == ref["weight_decay"] and group.get("row_scales") == ref.get(
            "row_scales"
        )
        ours = [names[id(p)] for p in group["params"] if names[id(p)] not in ffn_names]
        assert ours == [ref_names[id(p)] for p in ref["params"] if ref_names[id(p)] not in ffn_names]
    by_name = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        if name not in ffn_names:
            assert p.stride() == by_name[name].stride(), name
    # the exchange's scale blocks
    options = OnebitLambConfig().exchange_options()
    params = [p for g in groups for p in g["params"]]
    row_scaled = {id(p) for g in groups if g.get("row_scales") for p in g["params"]}
    blocks = options.blocks(params, row_scaled, pad=0)
    assert blocks is not None and len(blocks) == len(params)
    assert not any(options.transposed(params, row_scaled))  # nothing moves around the exchange
    for p, block, column in zip(params, blocks, options.column_scaled(params, row_scaled)):
        name = names[id(p)]
        if name.endswith(FFN):
            assert block.row_length == p.shape[-1] == 16 and block.numel == p.numel() and not column
        elif p.dim() == 2 and id(p) not in row_scaled:  # the other matrices: one scale per input column
            assert block.row_length == p.shape[0] and column, name
    # a row-scaled matrix stored column-major would scale its columns: refused
    column_major = _model(column_major=True)
    with pytest.raises(ValueError, match="must be row-major"):
        options.blocks(
            [p for g in _ffn_groups(column_major) for p in g["params"]],
            {id(p) for g in _ffn_groups(column_major) if g.get("row_scales") for p in g["params"]},
            pad=0,
        )
    with pytest.raises(ValueError, match="needs row_scales"):
        param_groups(model, 0.01, ffn_row_scales=True)


def test_ffn_row_scales_cost_the_bytes_of_their_row_scales():
    from pretrain.tools.preflight import compression_traffic

    options = {"compression": "per_column", "exact_vectors": True, "scale_dtype": "bfloat16"}
    default = compression_traffic(_model(False), options, 2, 12)
    rows = compression_traffic(_model(False), options, 2, 12, ffn_row_scales=True)
    # 2 layers x (32 rows - 16 columns) more bf16 scales, give or take the rows cut by the chunk boundary
    extra = rows.compressed_bytes - default.compressed_bytes
    assert 2 * 16 * 2 <= extra <= 2 * (2 * 16 + 4) * 2


def _train_with_ffn_rows(model: BertForPreTraining, optimizer: OnebitLamb, steps: range) -> None:
    for step in steps:
        warmup = optimizer.stage.value == "warmup"
        params = [p for group in optimizer.param_groups for p in group["params"]]
        order = {id(p): i for i, p in enumerate(model.parameters())}
        for worker in range(1 if warmup else 2):
            grads = _gradients(model, 100 * step + worker)
            ordered = [grads[order[id(p)]] for p in params]
            if warmup:
                for p, g in zip(params, ordered):
                    p.grad = torch.empty_like(p).copy_(g)
            else:
                torch._foreach_copy_(optimizer.worker_gradient_views(worker), ordered)
        optimizer.step()


def test_ffn_row_scales_train_with_one_scale_per_row(monkeypatch):
    """optim=onebit_lamb with the option, two virtual workers: the compressed averages the exchange hands
    back hold one magnitude per FFN intermediate row (two where the server chunks' boundary cuts a row),
    not per column, and training stays finite."""
    from pretrain.comm import CompressedAllreduce

    averages: list[torch.Tensor] = []
    call = CompressedAllreduce.__call__

    def recording(self, buffer, out=None, **kwargs):
        result = call(self, buffer, out, **kwargs)
        averages.append(result.clone())
        return result

    monkeypatch.setattr(CompressedAllreduce, "__call__", recording)
    model = _ffn_model()
    config = OnebitLambConfig(freeze_step=2, lr=0.01, variance_refresh=2, ffn_row_scales=True)
    optimizer = OnebitLamb(_ffn_groups(model), virtual_workers=2, **config.optimizer_kwargs())
    _train_with_ffn_rows(model, optimizer, range(7))
    assert optimizer.stage.value == "compression" and len(averages) == 5  # steps 3..7 exchanged
    assert all(torch.isfinite(p).all() for p in model.parameters())
    (segment,) = optimizer._ensure_state()
    chunk = segment.buffer.numel() // 2
    names = {id(p): name for name, p in model.named_parameters()}
    offsets, start = {}, 0
    for p in segment.params:
        offsets[id(p)] = start
        start += p.numel()
    for average in averages:
        for p, view in zip(segment.params, segment.exchange_views(average)):
            if not names[id(p)].endswith(FFN):
                continue
            assert view.shape == p.shape == (32, 16)
            cut = chunk - offsets[id(p)]  # the chunk boundary, counted from the matrix's first element
            for row in range(view.shape[0]):
                first = row * 16
                pieces = [view[row]]
                if first < cut < first + 16:
                    pieces = [view[row, : cut - first], view[row, cut - first :]]
                for piece in pieces:
                    assert piece.abs().unique().numel() == 1, (names[id(p)], row)
            # per row, not per tensor or per column: the rows' magnitudes differ
            assert view.abs().amax(1).unique().numel() > 1
            assert any(view[:, j].abs().unique().numel() > 1 for j in range(16))


def test_ffn_row_scales_resume_rebuilds_the_same_groups():
    """A checkpoint of the option's optimizer (compression stage) loads into a fresh one built the same way:
    the same groups, and the steps after it give the uninterrupted run's parameters bitwise. An optimizer
    built without the option refuses it."""
    config = OnebitLambConfig(freeze_step=2, lr=0.01, variance_refresh=2, ffn_row_scales=True)
    straight = _ffn_model()
    straight_optimizer = OnebitLamb(_ffn_groups(straight), virtual_workers=2, **config.optimizer_kwargs())
    _train_with_ffn_rows(straight, straight_optimizer, range(8))

    model = _ffn_model()
    optimizer = OnebitLamb(_ffn_groups(model), virtual_workers=2, **config.optimizer_kwargs())
    _train_with_ffn_rows(model, optimizer, range(5))
    saved_model = {name: p.detach().clone() for name, p in model.named_parameters()}
    saved = copy.deepcopy(optimizer.state_dict())

    resumed = _ffn_model()
    with torch.no_grad():
        for name, p in resumed.named_parameters():
            p.copy_(saved_model[name])
    fresh = OnebitLamb(_ffn_groups(resumed), virtual_workers=2, **config.optimizer_kwargs())
    fresh.load_state_dict(copy.deepcopy(saved))
    names = {id(p): name for name, p in resumed.named_parameters()}
    original = {id(p): name for name, p in model.named_parameters()}
    for group, before in zip(fresh.param_groups, optimizer.param_groups):
        assert [names[id(p)] for p in group["params"]] == [original[id(p)] for p in before["params"]]
        assert group.get("row_scales") == before.get("row_scales")
    row_group = next(g for g in fresh.param_groups if g.get("row_scales") and "exp_avg_mask" not in g)
    assert sum(names[id(p)].endswith(FFN) for p in row_group["params"]) == 2
    _train_with_ffn_rows(resumed, fresh, range(5, 8))
    for (name, p), (_, q) in zip(straight.named_parameters(), resumed.named_parameters()):
        assert torch.equal(p, q), name

    plain = OnebitLamb(_groups(_model(column_major=True)), virtual_workers=2, **config.optimizer_kwargs())
    with pytest.raises(ValueError, match="parameter-group layout"):
        plain.load_state_dict(copy.deepcopy(saved))


def test_the_trainer_builds_the_ffn_row_scales_groups_and_layout():
    """`pretrain.train.train_setup` asks `optim.ffn_rows` for the groups and the memory layout alike (a
    resumed run rebuilds both from its config); off, and for DeepSpeed's exchange, nothing changes."""
    from pretrain.optim.config import OnebitAdamConfig
    from pretrain.train import train_setup

    def config(optim):
        return SimpleNamespace(
            optim=optim, batch=SimpleNamespace(phases=[SimpleNamespace(max_seq_length=12)])
        )

    on = config(OnebitLambConfig(ffn_row_scales=True))
    assert train_setup._ffn_rows(on, compressed=True)
    assert not train_setup._ffn_rows(config(OnebitLambConfig()), compressed=True)
    model = _ffn_model()
    names = {id(p): name for name, p in model.named_parameters()}
    built = train_setup._param_groups(on, model, compressed=True)
    expected = _ffn_groups(model)
    assert [[names[id(p)] for p in g["params"]] for g in built] == [
        [names[id(p)] for p in g["params"]] for g in expected
    ]
    off = _model(column_major=True)
    names = {id(p): name for name, p in off.named_parameters()}
    assert [
        [names[id(p)] for p in g["params"]]
        for g in train_setup._param_groups(config(OnebitLambConfig()), off, compressed=True)
    ] == [[names[id(p)] for p in g["params"]] for g in _groups(off)]
    with pytest.raises(ValueError, match=r"optim\.ffn_row_scales needs the per_column compression"):
        OnebitAdamConfig(ffn_row_scales=True)  # DeepSpeed's exchange: no row scales
    assert OnebitAdamConfig(ffn_row_scales=True, compression="per_column").ffn_rows
