"""HF `BertForPreTraining` built from a named size; the vocab size comes from the prepared data."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import nn
from transformers import BertConfig, BertForPreTraining


class ModelSize(str, enum.Enum):
    bert_large = "bert_large"
    bert_base = "bert_base"
    bert_mini = "bert_mini"
    bert_tiny = "bert_tiny"


# layers, hidden, heads, intermediate (Devlin et al. 2019; mini/tiny as in Turc et al. 2019)
SIZES: dict[ModelSize, tuple[int, int, int, int]] = {
    ModelSize.bert_large: (24, 1024, 16, 4096),
    ModelSize.bert_base: (12, 768, 12, 3072),
    ModelSize.bert_mini: (4, 256, 4, 1024),
    ModelSize.bert_tiny: (2, 128, 2, 512),
}


@dataclass
class ModelConfig:
    size: ModelSize = ModelSize.bert_large
    max_position_embeddings: int = 512
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    initializer_range: float = 0.02
    attn_implementation: str = "sdpa"
    compile: bool = False  # torch.compile the model

    def __post_init__(self) -> None:
        if self.max_position_embeddings < 8:
            raise ValueError("model.max_position_embeddings must be >= 8")


def bert_config(cfg: ModelConfig, vocab_size: int) -> BertConfig:
    layers, hidden, heads, intermediate = SIZES[ModelSize(cfg.size)]
    return BertConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=intermediate,
        max_position_embeddings=cfg.max_position_embeddings,
        hidden_dropout_prob=cfg.hidden_dropout_prob,
        attention_probs_dropout_prob=cfg.attention_probs_dropout_prob,
        initializer_range=cfg.initializer_range,
        attn_implementation=cfg.attn_implementation,  # type: ignore[call-arg]
    )


def build_model(cfg: ModelConfig, vocab_size: int, device: torch.device) -> BertForPreTraining:
    """A freshly initialised model on `device` (fp32 parameters; autocast handles low precision)."""
    model = BertForPreTraining(bert_config(cfg, vocab_size)).to(device)  # type: ignore[arg-type]
    return model


def column_major_linear_weights_(model: nn.Module) -> int:
    """Store every `nn.Linear` weight column-major (its transpose contiguous), except one tied to an
    embedding; returns how many. For `optim.compression=per_column`, which gives every input column of these
    matrices its own 1-bit scale: the exchange wants each column contiguous, and a row-major weight (with
    its gradient, momentum and variance) would be transposed into that layout and back at every step
    (0.2-0.35 s of BERT-Base's 1-bit step at 2 CPU ranks, issue #15). Column-major, the momentum buffer is
    the exchange layout itself. Nothing else changes: the same shapes and names (checkpoints and the HF
    export hold ordinary row-major tensors, loads copy element by element), the matmuls take the transpose
    as it comes (forward and backward as fast: a one-thread CPU probe, issue #15's closing note), and autograd
    hands back gradients in the weight's order, as the optimizers need (`pretrain.optim.base.flat_views`).
    """
    tied = {id(module.weight) for module in model.modules() if isinstance(module, nn.Embedding)}
    count = 0
    for module in model.modules():
        if not isinstance(module, nn.Linear) or id(module.weight) in tied:
            continue
        weight = module.weight
        if not weight.is_contiguous():  # column-major already
            continue
        module.weight = nn.Parameter(weight.detach().t().contiguous().t(), requires_grad=weight.requires_grad)
        count += 1
    return count


class PretrainingObjective(nn.Module):
    """BERT's pretraining loss with the MLM decoder applied to the masked positions only.

    HF `BertForPreTraining` decodes every position (batch x seq x vocab logits), although only ~15%
    carry a label; gathering the masked positions first (as NVIDIA's BERT does) gives the same loss
    for a fraction of the decoder's FLOPs and memory. DDP wraps this module, so its forward is what
    runs under the gradient-sync hooks. Returns (mlm_loss, nsp_loss, mlm_correct, mlm_count); the loss
    is the sum HF computes when given labels.

    With ``mlm_positions`` ([B, P], the collator's: each row's masked positions, then 0, whose label is
    -100) the positions are gathered with that static shape; without it, with a boolean index. Same loss
    and gradients up to the reduction's summation order, but the boolean index has a data-dependent
    shape: on a GPU it waits for the host and splits a compiled graph in two (16% of BERT-Large's
    compiled seq-128 step idle on an H200, README "On a GPU").
    """

    def __init__(self, model: BertForPreTraining):
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        labels: torch.Tensor,
        next_sentence_label: torch.Tensor,
        mlm_positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        sequence_output, pooled_output = self.model.bert(
            input_ids=input_ids,
            token_type_ids=token_type_ids,
            attention_mask=attention_mask,
            return_dict=False,
        )[:2]
        if mlm_positions is None:
            masked = labels != -100
            hidden, targets = sequence_output[masked], labels[masked]
        else:
            index = mlm_positions.unsqueeze(-1).expand(-1, -1, sequence_output.shape[-1])
            hidden = sequence_output.gather(1, index).flatten(0, 1)
            targets = labels.gather(1, mlm_positions).flatten()
        logits = self.model.cls.predictions(hidden).float()
        mlm_loss = nn.functional.cross_entropy(logits, targets)  # the padding's -100 is ignored
        nsp_logits = self.model.cls.seq_relationship(pooled_output).float()
        nsp_loss = nn.functional.cross_entropy(nsp_logits, next_sentence_label)
        correct = (logits.detach().argmax(dim=-1) == targets).sum()  # never true at a -100
        return mlm_loss, nsp_loss, correct, (targets != -100).sum()
