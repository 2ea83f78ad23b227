"""Optimizer diagnostics per parameter family (`diagnostics=true`): what the 1-bit exchange does to the
momentum, and what the step does to each part of BERT. Logged at log steps to metrics.jsonl and W&B
under `diag/`; `make compare` plots them next to the loss curves.

Families: word embeddings, position/type embeddings, attention, FFN, LayerNorm + biases, MLM head (its
transform, its LayerNorm and the decoder bias), pooler + NSP head. Per family F, with Σ over its tensors:

- `diag/fidelity_cos/F`, `diag/fidelity_rel_error/F` (1-bit optimizers, compression stage): cosine and
  ‖m̂ − m‖/‖m‖ of the compressed-averaged momentum m̂ against the exact average m of the workers' local
  momenta, both without κ. The exact average costs one extra fp32 allreduce of the momentum at log
  steps, which the byte counters never see. `diag/step_fidelity_cos/F`, `diag/step_fidelity_rel_error/F`:
  the same in the units of the step, m/(√v + ε) with the optimizer's (frozen) v — what the update
  applies; a large momentum with a large variance moves a weight no more than a small one with a small
  variance, so the momentum-unit figures can mislead (`optim.precondition` lowers them:
  results/cpu-study/README.md).
- `diag/update_ratio/F`: ‖Δp‖/‖p‖ of this step; `diag/lamb_update_ratio/F`: the same for LAMB's
  layer-wise trust-ratio rule applied to this step's momentum and variance (as stored, without bias
  correction) and the weights the step started from: Δ = η·r·u with u = m/(√v + ε) + λp and
  r = ‖p‖/‖u‖, 1 where a norm is 0; clamped to [min_coeff, max_coeff] for LAMB's `deepspeed` variant (its
  own rule), capped at max_coeff only for 1-bit LAMB (whose live trust ratio has no floor). For LAMB
  itself that is η on every tensor with ‖p‖ > 0; for DeepSpeed's 1-bit LAMB's compression stage it shows
  how far the frozen coefficient and factor (Δ = η·c̄·f·u) take the step from LAMB's.
- vocabulary rows, by how often the token occurs in the phase's data (counted once over up to
  `MAX_COUNTED_INSTANCES` instances; buckets `BUCKETS`): `diag/vocab_update_rms/B` (RMS of the word-
  embedding rows' update norms), `diag/bias_update_rms/B` (RMS of the decoder bias's update),
  `diag/tiny_variance_rows/B` (rows whose variance is ≤ ε² everywhere: the frozen variance in the 1-bit
  compression stage) and, once, `diag/vocab_rows/B`.

Interface (the trainer's and the optimizer's, nothing else): `begin_step(active)` before the forward
pass, `end_step(skipped)` after the optimizer step -> metrics; the 1-bit optimizers call
`before_exchange` / `after_exchange` (their `probe`) while `active`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from data.dataset import PretrainingDataset
from pretrain.optim import OnebitLamb
from pretrain.optim.base import flat_views

FAMILIES = (
    "word_embeddings",
    "position_type_embeddings",
    "attention",
    "ffn",
    "layernorm_bias",
    "mlm_head",
    "pooler_nsp",
)
# token-frequency buckets: (name, lowest count, highest count) over the counted data
BUCKETS = (("unseen", 0, 0), ("1-9", 1, 9), ("10-99", 10, 99), ("100-999", 100, 999), ("1000+", 1000, None))
MAX_COUNTED_INSTANCES = 200_000
DECODER_BIAS = "cls.predictions.bias"
WORD_EMBEDDINGS = "word_embeddings.weight"


def family_of(name: str) -> str:
    """The family of a `BertForPreTraining` parameter name."""
    if name.endswith(WORD_EMBEDDINGS):
        return "word_embeddings"
    if "position_embeddings" in name or "token_type_embeddings" in name:
        return "position_type_embeddings"
    if name.startswith("cls.predictions"):
        return "mlm_head"
    if "LayerNorm" in name or name.endswith("bias"):
        return "layernorm_bias"
    if ".attention." in name:
        return "attention"
    if ".intermediate." in name or ".output." in name:
        return "ffn"
    return "pooler_nsp"


def token_counts(folder: str | Path, vocab_size: int, max_instances: int = MAX_COUNTED_INSTANCES) -> Tensor:
    """Occurrences of each token id in the first `max_instances` instances of a prepared folder."""
    dataset = PretrainingDataset(folder)
    counts = np.zeros(vocab_size, dtype=np.int64)
    for index in range(min(len(dataset), max_instances)):
        counts += np.bincount(dataset[index]["input_ids"].astype(np.int64), minlength=vocab_size)
    return torch.from_numpy(counts)


def _bucket_of(counts: Tensor) -> Tensor:
    buckets = torch.zeros_like(counts)
    for index, (_, low, _high) in enumerate(BUCKETS):
        buckets[counts >= low] = index
    return buckets


def _fidelity_sums(compressed: Tensor, exact: Tensor) -> Tensor:
    """⟨m̂, m⟩, ‖m̂‖², ‖m‖², ‖m̂ − m‖² (flat tensors)."""
    difference = compressed - exact
    return torch.stack(
        [
            torch.dot(compressed, exact),
            torch.dot(compressed, compressed),
            torch.dot(exact, exact),
            torch.dot(difference, difference),
        ]
    )


class Diagnostics:
    """See the module docstring. `model` is the `BertForPreTraining`; `token_counts` a vocab-sized count
    tensor (None: no vocabulary-row metrics)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, token_counts: Tensor | None):
        self.optimizer = optimizer
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.family = {id(p): family_of(name) for name, p in named}
        by_name = dict(named)
        self.embedding = next((p for name, p in named if name.endswith(WORD_EMBEDDINGS)), None)
        self.decoder_bias = by_name.get(DECODER_BIAS)
        self.buckets: Tensor | None = None
        if token_counts is not None and self.embedding is not None:
            self.buckets = _bucket_of(token_counts.to(self.embedding.device))
        self.active = False
        variant = getattr(optimizer, "variant", None)
        clamped = isinstance(optimizer, OnebitLamb) or getattr(variant, "value", variant) == "deepspeed"
        self._coeff_range: tuple[float, float] | None = None
        if clamped:
            floor = 0.0 if isinstance(optimizer, OnebitLamb) else optimizer.min_coeff  # type: ignore[attr-defined]
            self._coeff_range = (floor, optimizer.max_coeff)  # type: ignore[attr-defined]
        self._before: list[Tensor] = []
        self._exact: Tensor | None = None
        self._fidelity: dict[str, Tensor] = {}
        self._step_fidelity: dict[str, Tensor] = {}
        self._eps = {
            id(p): group.get("eps", 1e-8) for group in optimizer.param_groups for p in group["params"]
        }
        self._reported_rows = False
        if hasattr(optimizer, "probe"):
            optimizer.probe = self

    # -- the trainer's side ------------------------------------------------------------------------------
    def begin_step(self, active: bool) -> None:
        self.active = active
        self._fidelity, self._step_fidelity = {}, {}
        if active:
            self._before = [p.detach().float().clone() for p in self.params]

    @torch.no_grad()
    def end_step(self, skipped: bool) -> dict[str, float]:
        """The step's metrics (empty unless active and the step was taken)."""
        if not self.active or skipped:
            self.active = False
            return {}
        self.active = False
        metrics = self._fidelity_metrics()
        metrics.update(self._update_metrics())
        metrics.update(self._vocabulary_metrics())
        self._before = []
        return metrics

    # -- the optimizer's side (1-bit exchange) ----------------------------------------------------------
    @torch.no_grad()
    def before_exchange(self, local: Tensor, world_size: int, group: Any) -> None:
        """The exact average of the workers' (κ-scaled) local momenta: local is [N] or [k, N]."""
        exact = local.sum(0) if local.dim() == 2 else local.clone()
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(exact, group=group)
        self._exact = exact.div_(world_size)

    @torch.no_grad()
    def after_exchange(self, averaged: Tensor, params: list[Tensor], kappas: list[Tensor] | None) -> None:
        """Accumulate per family ⟨m̂, m⟩, ‖m̂‖², ‖m‖², ‖m̂ − m‖² (κ divided out per tensor)."""
        assert self._exact is not None
        offset = 0
        for index, p in enumerate(params):
            exact = self._exact[offset : offset + p.numel()]
            compressed = averaged[offset : offset + p.numel()]
            offset += p.numel()
            if kappas is not None:
                exact, compressed = exact / kappas[index], compressed / kappas[index]
            family = self.family.get(id(p), "pooler_nsp")
            sums = _fidelity_sums(compressed, exact)
            self._fidelity[family] = self._fidelity.get(family, torch.zeros_like(sums)) + sums
            variance = self.optimizer.state[p].get("exp_avg_sq")
            if variance is not None:
                # in memory order, as the momentum buffer holds it (column-major `per_column` matrices)
                divisor = flat_views(variance)[0].sqrt().add_(self._eps.get(id(p), 1e-8))
                sums = _fidelity_sums(compressed / divisor, exact / divisor)
                self._step_fidelity[family] = self._step_fidelity.get(family, torch.zeros_like(sums)) + sums
        self._exact = None

    # -- metrics ----------------------------------------------------------------------------------------
    def _fidelity_metrics(self) -> dict[str, float]:
        metrics = {}
        for prefix, sums in (("fidelity", self._fidelity), ("step_fidelity", self._step_fidelity)):
            for family, (dot, compressed, exact, error) in sums.items():
                denominator = (compressed * exact).sqrt()
                metrics[f"diag/{prefix}_cos/{family}"] = float(dot / denominator) if denominator > 0 else 1.0
                relative = float((error / exact).sqrt()) if exact > 0 else 0.0
                metrics[f"diag/{prefix}_rel_error/{family}"] = relative
        return metrics

    def _lamb_update_norm(self, p: Tensor, weight: Tensor, group: dict[str, Any]) -> Tensor:
        """‖η·r·u‖ for the trust-ratio rule at the pre-step `weight` (module docstring)."""
        state = self.optimizer.state.get(p, {})
        if "exp_avg" not in state or "exp_avg_sq" not in state:
            return torch.zeros((), device=p.device)
        update = state["exp_avg"] / (state["exp_avg_sq"].sqrt() + (group.get("eps") or 1e-6))
        update = update + group["weight_decay"] * weight
        weight_norm, update_norm = torch.linalg.vector_norm(weight), torch.linalg.vector_norm(update)
        if weight_norm == 0 or update_norm == 0:
            return group["lr"] * update_norm
        ratio = weight_norm / update_norm
        if self._coeff_range is not None:
            ratio = ratio.clamp(*self._coeff_range)
        return group["lr"] * ratio * update_norm

    def _update_metrics(self) -> dict[str, float]:
        sums: dict[str, Tensor] = {}
        group_of = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        for p, before in zip(self.params, self._before):
            family = self.family[id(p)]
            delta = torch.linalg.vector_norm(p.detach().float() - before)
            lamb = self._lamb_update_norm(p, before, group_of[id(p)]) if id(p) in group_of else delta * 0
            values = torch.stack([delta**2, torch.linalg.vector_norm(before) ** 2, lamb**2])
            sums[family] = sums.get(family, torch.zeros_like(values)) + values
        metrics = {}
        for family, (delta, weight, lamb) in sums.items():
            scale = weight.sqrt()
            metrics[f"diag/update_ratio/{family}"] = float(delta.sqrt() / scale) if scale > 0 else 0.0
            metrics[f"diag/lamb_update_ratio/{family}"] = float(lamb.sqrt() / scale) if scale > 0 else 0.0
        return metrics

    def _vocabulary_metrics(self) -> dict[str, float]:
        if self.buckets is None or self.embedding is None:
            return {}
        index = {id(p): i for i, p in enumerate(self.params)}
        embedding = self.embedding.detach().float()
        row_updates = torch.linalg.vector_norm(embedding - self._before[index[id(self.embedding)]], dim=1)
        bias_updates = None
        if self.decoder_bias is not None:
            bias = self.decoder_bias.detach().float()
            bias_updates = (bias - self._before[index[id(self.decoder_bias)]]).abs()
        state = self.optimizer.state.get(self.embedding, {})
        variance = state.get("exp_avg_sq")
        group = next(g for g in self.optimizer.param_groups if any(p is self.embedding for p in g["params"]))
        eps = group.get("eps") or 1e-6
        metrics = {}
        for bucket, (name, _, _) in enumerate(BUCKETS):
            rows = self.buckets == bucket
            count = int(rows.sum())
            if not self._reported_rows:
                metrics[f"diag/vocab_rows/{name}"] = float(count)
            if count == 0:
                continue
            metrics[f"diag/vocab_update_rms/{name}"] = float(row_updates[rows].pow(2).mean().sqrt())
            if bias_updates is not None:
                metrics[f"diag/bias_update_rms/{name}"] = float(bias_updates[rows].pow(2).mean().sqrt())
            if variance is not None:
                tiny = (variance[rows] <= eps * eps).all(dim=1)
                metrics[f"diag/tiny_variance_rows/{name}"] = float(tiny.sum())
        self._reported_rows = True
        return metrics
