"""HF `BertForPreTraining` built from a named size; the vocab size comes from the prepared data."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import BertConfig, BertForPreTraining


class ModelSize(str, enum.Enum):
    bert_large = "bert_large"
    bert_base = "bert_base"
    bert_small = "bert_small"
    bert_mini = "bert_mini"
    bert_tiny = "bert_tiny"


# layers, hidden, heads, intermediate (Devlin et al. 2019; small/mini/tiny as in Turc et al. 2019)
SIZES: dict[ModelSize, tuple[int, int, int, int]] = {
    ModelSize.bert_large: (24, 1024, 16, 4096),
    ModelSize.bert_base: (12, 768, 12, 3072),
    ModelSize.bert_small: (4, 512, 8, 2048),
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
    # The GPU step's arms (issue #51, docs/gpus.md), each measured side by side by `make gpu-check`:
    # the MLM decoder's vocabulary padded to a multiple of this inside the forward (zero rows, logits sliced
    # back to the vocabulary: the same loss; parameters, checkpoints and HF exports keep the tokenizer's
    # rows). null: 64 on CUDA, none on the CPU -- the GPU default, pending a GPU's measurement.
    pad_vocab_multiple: int | None = None
    # the compiled step replayed as CUDA graphs (torch.compile mode="reduce-overhead"), gradients
    # accumulated into static buffers (`StaticGradients`); needs compile=true and CUDA. Off until measured.
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        if self.max_position_embeddings < 8:
            raise ValueError("model.max_position_embeddings must be >= 8")
        if self.pad_vocab_multiple is not None and self.pad_vocab_multiple < 1:
            raise ValueError(f"model.pad_vocab_multiple must be >= 1 or null, got {self.pad_vocab_multiple}")
        if self.cuda_graphs and not self.compile:
            raise ValueError("model.cuda_graphs=true replays the compiled step: it needs model.compile=true")

    def vocab_multiple(self, device: torch.device) -> int:
        """The multiple the MLM decoder's vocabulary is padded to on `device` (1: none)."""
        if self.pad_vocab_multiple is not None:
            return self.pad_vocab_multiple
        return GPU_VOCAB_MULTIPLE if device.type == "cuda" else 1


# pending a GPU's measurement (`make gpu-check`'s `arms`): cuBLAS's matrix products run on whole tiles, and
# 30,522 rows is no multiple of 8; NVIDIA pads to 8 (30,528), 64 gives the same 30,528 rows
GPU_VOCAB_MULTIPLE = 64


def padded_size(size: int, multiple: int) -> int:
    """`size` rounded up to a multiple of `multiple`."""
    return -(-size // multiple) * multiple


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


def column_major_linear_weights_(model: nn.Module, skip: tuple[str, ...] = ()) -> int:
    """Store every `nn.Linear` weight column-major (its transpose contiguous), except one tied to an
    embedding and those whose parameter name ends with one of `skip` (left as they are: the matrices
    `optim.ffn_row_scales` gives one scale per row, `pretrain.optim.params.ROW_SCALED_MATRICES`); returns
    how many. For `optim.compression=per_column`, which gives every input column of these
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
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or id(module.weight) in tied:
            continue
        if skip and f"{name}.weight".endswith(skip):
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

    ``pad_vocab_multiple`` (> 1): the decoder's weight and bias are padded with zero rows to a multiple of
    it inside the forward (a whole number of tiles for the GPU's matrix products) and the logits sliced
    back to the vocabulary, so loss, gradients and parameters are the unpadded model's (gradients of the
    padding rows are dropped by the pad's backward).
    """

    def __init__(self, model: BertForPreTraining, pad_vocab_multiple: int = 1):
        super().__init__()
        self.model = model
        self.pad_vocab_multiple = pad_vocab_multiple

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
        logits = self.mlm_logits(hidden).float()
        mlm_loss = nn.functional.cross_entropy(logits, targets)  # the padding's -100 is ignored
        nsp_logits = self.model.cls.seq_relationship(pooled_output).float()
        nsp_loss = nn.functional.cross_entropy(nsp_logits, next_sentence_label)
        correct = (logits.detach().argmax(dim=-1) == targets).sum()  # never true at a -100
        return mlm_loss, nsp_loss, correct, (targets != -100).sum()

    def mlm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The MLM head's logits over the vocabulary for `hidden` ([N, H]), through the padded decoder when
        `pad_vocab_multiple` asks for one."""
        predictions = self.model.cls.predictions
        decoder = predictions.decoder
        vocab = decoder.weight.shape[0]
        extra = padded_size(vocab, self.pad_vocab_multiple) - vocab
        if extra == 0:
            return predictions(hidden)
        weight = nn.functional.pad(decoder.weight, (0, 0, 0, extra))
        bias = nn.functional.pad(decoder.bias, (0, extra))
        return nn.functional.linear(predictions.transform(hidden), weight, bias)[:, :vocab]


class StaticGradients:
    """Gradient accumulation into buffers that live across steps, for a step replayed as CUDA graphs.

    A step compiled with mode="reduce-overhead" returns its gradients in the graphs' own memory, which the
    next replay overwrites; autograd would keep the first micro-batch's as `.grad` ("accessing tensor output
    of CUDAGraphs that has been overwritten", seen on an H200). With every `.grad` allocated (zeros) before
    the first backward of a step, autograd adds each micro-batch's gradients into it instead, which also
    copies them out of the graphs' memory. `begin_micro_step()` before every forward: allocates missing
    buffers and marks a new graph replay (`torch.compiler.cudagraph_mark_step_begin`). The optimizer's
    `zero_grad(set_to_none=True)` may free them: the next step allocates them again. The same arithmetic as
    plain accumulation (0 + g = g): the gradients are equal (test on the CPU)."""

    def __init__(self, parameters: list[torch.Tensor], mark_replays: bool = True):
        self.parameters, self.mark_replays = parameters, mark_replays

    def begin_micro_step(self) -> None:
        for parameter in self.parameters:
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
        if self.mark_replays:
            torch.compiler.cudagraph_mark_step_begin()


class GraphedStep(nn.Module):
    """`objective` with `StaticGradients.begin_micro_step` before every forward: what DDP wraps when
    `model.cuda_graphs` is on (the objective compiled with mode="reduce-overhead")."""

    def __init__(self, objective: nn.Module, parameters: list[torch.Tensor], mark_replays: bool = True):
        super().__init__()
        self.objective = objective
        self.gradients = StaticGradients(parameters, mark_replays)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.gradients.begin_micro_step()
        return self.objective(*args, **kwargs)
