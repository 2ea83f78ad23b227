"""pretrain/tools/frozen_state.py: the per-tensor table of what a frozen variance does to the step."""

from __future__ import annotations

import pytest
import torch

from pretrain.tools.frozen_state import _ordered, frozen_state_rows, main


def test_rows_flag_the_tensor_whose_variance_froze_small():
    weight = torch.full((4, 4), 0.5)
    fresh = {"exp_avg": torch.full((4, 4), 1e-3), "exp_avg_sq": torch.full((4, 4), 1e-6)}  # √v = 1e-3
    stale = {"exp_avg": torch.full((4, 4), 1e-3), "exp_avg_sq": torch.full((4, 4), 1e-14)}  # √v = 1e-7
    stale["exp_avg_sq"][0, 0] = 1e-6  # one element with a usable variance
    group = {"weight_decay": 0.0, "eps": 1e-8}
    rows = frozen_state_rows(
        [
            ("bert.encoder.layer.0.attention.self.value.weight", weight),
            ("bert.encoder.layer.0.attention.self.query.weight", weight),
        ],
        [fresh, stale],
        [group, group],
        tiny=1e-6,
    )
    value, query = rows
    assert value.family == query.family == "attention"
    assert value.tiny_fraction == 0.0 and value.tiny_share == 0.0
    assert value.update_to_weight == pytest.approx(2.0 / (1 + 1e-5), rel=1e-4)  # ‖u‖ = 4·1, ‖p‖ = 2
    assert query.tiny_fraction == pytest.approx(15 / 16)
    assert query.tiny_share > 0.999  # 15 elements with u ≈ 1e4 against one with u ≈ 1
    assert query.update_to_weight > 1e3 * value.update_to_weight
    assert query.sqrt_v_median == pytest.approx(1e-7, rel=1e-3)


def test_weight_decay_enters_the_update():
    weight = torch.ones(3)
    state = {"exp_avg": torch.zeros(3), "exp_avg_sq": torch.ones(3)}
    (row,) = frozen_state_rows([("x.bias", weight)], [state], [{"weight_decay": 0.5, "eps": 1e-8}], tiny=1e-6)
    assert row.update_to_weight == pytest.approx(0.5)


def test_cli_names_a_folder_without_checkpoint(tmp_path, capsys):
    assert main([str(tmp_path / "run" / "checkpoints" / "step-00000010")]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and "step-00000010" in error and len(error.strip().splitlines()) == 1


def test_the_optimizer_order_follows_the_runs_ffn_row_scales():
    """The tool rebuilds the trainer's groups from the run's config: with `optim.ffn_row_scales` the FFN
    intermediates come after the embeddings, in the row-scaled group (an older run's config has no key)."""
    from transformers import BertConfig, BertForPreTraining

    model = BertForPreTraining(
        BertConfig(
            vocab_size=30, hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16
        )
    )
    config = {
        "optim": {"name": "onebit_lamb", "weight_decay": 0.01, "mask_unused_position_embeddings": True},
        "batch": {"phases": [{"max_seq_length": 12}]},
    }
    plain = [name for name, _ in _ordered(model, config)]
    config["optim"]["ffn_row_scales"] = True
    ordered = _ordered(model, config)
    names = [name for name, _ in ordered]
    ffn = [name for name in plain if name.endswith("intermediate.dense.weight")]
    assert len(ffn) == 2 and sorted(names) == sorted(plain) and names != plain
    row_scaled = [name for name, group in ordered if group.get("row_scales") and "exp_avg_mask" not in group]
    assert row_scaled == [
        "bert.embeddings.word_embeddings.weight",
        "bert.embeddings.token_type_embeddings.weight",
        *ffn,
    ]
