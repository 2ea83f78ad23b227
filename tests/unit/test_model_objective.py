"""`PretrainingObjective`: the collator's static ``mlm_positions`` gather against the boolean index."""

from __future__ import annotations

import pytest
import torch

from pretrain.model import ModelConfig, ModelSize, PretrainingObjective, build_model

VOCAB, SEQ, MAX_PREDICTIONS = 300, 32, 6


def _batch(rows: int = 4) -> dict[str, torch.Tensor]:
    """A collated batch: rows with 1..MAX_PREDICTIONS masked positions (never 0, the [CLS] position)."""
    generator = torch.Generator().manual_seed(3)
    labels = torch.full((rows, SEQ), -100, dtype=torch.long)
    positions = torch.zeros(rows, MAX_PREDICTIONS, dtype=torch.long)
    for row in range(rows):
        count = 1 + row % MAX_PREDICTIONS
        chosen = (torch.randperm(SEQ - 2, generator=generator)[:count] + 1).sort().values
        labels[row, chosen] = torch.randint(VOCAB, (count,), generator=generator)
        positions[row, :count] = chosen
    return {
        "input_ids": torch.randint(VOCAB, (rows, SEQ), generator=generator),
        "token_type_ids": (torch.arange(SEQ) >= SEQ // 2).long().expand(rows, -1).contiguous(),
        "attention_mask": torch.ones(rows, SEQ, dtype=torch.long),
        "labels": labels,
        "next_sentence_label": torch.randint(2, (rows,), generator=generator),
        "mlm_positions": positions,
    }


@pytest.fixture(scope="module")
def objective() -> PretrainingObjective:
    torch.manual_seed(0)
    config = ModelConfig(size=ModelSize.bert_tiny, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return PretrainingObjective(build_model(config, VOCAB, torch.device("cpu")))  # no dropout: two runs agree


def _run(objective: PretrainingObjective, batch: dict[str, torch.Tensor]):
    objective.zero_grad(set_to_none=True)
    mlm, nsp, correct, count = objective(**batch)
    (mlm + nsp).backward()
    grads = [p.grad.clone() for p in objective.parameters() if p.grad is not None]
    return mlm.detach(), nsp.detach(), int(correct), int(count), grads


def test_static_positions_give_the_boolean_index_loss_and_gradients(objective):
    batch = _batch()
    boolean = {k: v for k, v in batch.items() if k != "mlm_positions"}
    static, reference = _run(objective, batch), _run(objective, boolean)
    assert static[3] == reference[3] == int((batch["labels"] != -100).sum())  # padding not counted
    assert static[2] == reference[2]
    torch.testing.assert_close(static[0], reference[0], rtol=1e-6, atol=0)  # the mean's summation order
    assert torch.equal(static[1], reference[1])
    assert len(static[4]) == len(reference[4])
    for got, want in zip(static[4], reference[4]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_static_positions_compile_without_the_boolean_index_graph_break(objective):
    """The boolean index has a data-dependent shape: Dynamo breaks the graph there (on a GPU: a host
    sync); the static gather adds no break."""
    batch = _batch()
    boolean = {k: v for k, v in batch.items() if k != "mlm_positions"}
    torch._dynamo.reset()
    static_breaks = torch._dynamo.explain(objective)(**batch).graph_break_count
    boolean_breaks = torch._dynamo.explain(objective)(**boolean).graph_break_count
    torch._dynamo.reset()
    assert static_breaks < boolean_breaks
    assert static_breaks == 0
