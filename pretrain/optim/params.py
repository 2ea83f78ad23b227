"""Parameter groups for HF BERT: which tensors get weight decay, and the 1-bit momentum mask.

Rules (docs/pretraining.md, "Optimizers"; one deliberate difference from DeepSpeed's BERT example):
- weight decay 0 for every parameter whose name contains `bias` or `LayerNorm` (HF BERT's LayerNorm
  weight and bias), `weight_decay` for all others;
- the pooler is KEPT in the optimizer (DeepSpeed's BERT example drops it): HF `BertForPreTraining`
  trains it through the NSP head, and a parameter outside the optimizer would silently freeze;
- optional (1-bit optimizers): `position_embeddings.weight` in its own group whose `exp_avg_mask` is 1 on
  rows < max_seq_length and 0 on the rows a run at that length never uses. Pass the same
  `max_seq_length` argument style in every phase so the group layout (and so the checkpoint) matches;
- optional (1-bit optimizers with `compression=per_column`): the word and token-type embeddings in their
  own group flagged `row_scales` (the position group gets the flag too), so that the 1-bit exchange gives
  each of their rows its own scale. Without it the layout is the one DeepSpeed's BERT example uses;
- optional, with `row_scales` (`optim.ffn_row_scales`, an ablation under study: results/cpu-study-m): every
  FFN intermediate matrix (`*.intermediate.dense.weight`, [intermediate, hidden]) joins the row-scaled group
  (one scale per neuron instead of per input column, same weight decay). The trainer keeps these matrices
  row-major (`pretrain.model.column_major_linear_weights_(skip=ROW_SCALED_MATRICES)`), the layout the
  exchange's row blocks read.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

NO_DECAY_MARKERS = ("bias", "LayerNorm")
POSITION_EMBEDDINGS = "position_embeddings.weight"
ROW_SCALED_EMBEDDINGS = ("word_embeddings.weight", "token_type_embeddings.weight")
# `ffn_row_scales`: the linear weights that join the row-scaled group (and stay row-major)
ROW_SCALED_MATRICES = ("intermediate.dense.weight",)


def param_groups(
    model: nn.Module,
    weight_decay: float = 0.01,
    *,
    max_seq_length: int | None = None,
    row_scales: bool = False,
    ffn_row_scales: bool = False,
) -> list[dict[str, Any]]:
    """Groups in a fixed order: [decayed, not decayed, (row-scaled embeddings, then with `ffn_row_scales`
    the FFN intermediate matrices), (position embeddings with exp_avg_mask)].

    Frozen parameters (requires_grad False) are left out; tied parameters appear once. The mask has
    shape [num_positions, 1] and broadcasts over the embedding width. `ffn_row_scales` needs `row_scales`.
    """
    if ffn_row_scales and not row_scales:
        raise ValueError("param_groups: ffn_row_scales needs row_scales (per_column compression)")
    row_scaled = ROW_SCALED_EMBEDDINGS + (ROW_SCALED_MATRICES if ffn_row_scales else ())
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    embeddings: list[nn.Parameter] = []
    positions: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if max_seq_length is not None and name.endswith(POSITION_EMBEDDINGS):
            positions.append(param)
        elif row_scales and name.endswith(row_scaled):
            embeddings.append(param)
        elif any(marker in name for marker in NO_DECAY_MARKERS):
            no_decay.append(param)
        else:
            decay.append(param)
    groups: list[dict[str, Any]] = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if row_scales:
        groups.append({"params": embeddings, "weight_decay": weight_decay, "row_scales": True})
    if max_seq_length is not None:
        if len(positions) != 1:
            raise ValueError(
                f"expected one '{POSITION_EMBEDDINGS}' parameter to mask, found {len(positions)}"
            )
        (table,) = positions
        mask = torch.zeros(table.shape[0], 1, dtype=torch.float32, device=table.device)
        mask[:max_seq_length] = 1.0
        position_group = {"params": positions, "weight_decay": weight_decay, "exp_avg_mask": mask}
        if row_scales:
            position_group["row_scales"] = True
        groups.append(position_group)
    return [group for group in groups if group["params"]]
