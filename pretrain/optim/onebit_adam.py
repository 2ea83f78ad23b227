"""1-bit Adam (arXiv 2102.02888; DeepSpeed `OnebitAdam`; docs/pretraining.md) on plain torch.distributed.

Warmup (steps 1..freeze_step, gradients averaged by the trainer): Adam without bias correction,
p ← p − η·(m/(√v+ε) + λp). Compression (later steps, local gradients): m ← β1·m + (1−β1)·g_local, one
compressed allreduce per parameter group of that group's fused flat momentum (DeepSpeed's fp16 wrapper
also flattens per group), the group's `exp_avg_mask`, then the same update with v frozen.

Per-parameter state: `exp_avg` (view into its group's flat buffer), `exp_avg_sq`, and `master_param`
for bf16/fp16 parameters; the step count lives in the param groups.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from pretrain.comm.kernels import MomentumSource
from pretrain.optim import functional as F
from pretrain.optim.live_step import local_momentum_
from pretrain.optim.onebit import ExchangeOptions, OnebitOptimizer


class OnebitAdam(OnebitOptimizer):
    """1-bit Adam. Defaults as DeepSpeed's; `exp_avg_mask`, `group`, `virtual_workers` and the exchange
    (`exchange`, `pretrain.optim.onebit.ExchangeOptions`; DeepSpeed's by default) as in `OnebitLamb`."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        freeze_step: int = 100000,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        exchange: ExchangeOptions | None = None,
        group: Any = None,
        virtual_workers: int = 1,
    ) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(
            params,
            defaults,
            freeze_step=freeze_step,
            group=group,
            exchange=exchange,
            virtual_workers=virtual_workers,
        )

    def _segment_groups(self) -> list[list[Tensor]]:
        return [list(group["params"]) for group in self.param_groups]

    def _init_param_state(self, param: Tensor) -> None:
        self.state[param]["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32)

    def _tensors(self, group: dict[str, Any]) -> list[list[Tensor]]:
        params = group["params"]
        return [
            [self._fp32_param(p) for p in params],
            [self.state[p]["exp_avg"] for p in params],
            [self.state[p]["exp_avg_sq"] for p in params],
        ]

    def _warmup_step(self, grads: list[Tensor]) -> None:
        for group, span in self._group_slices():
            params, exp_avgs, exp_avg_sqs = self._tensors(group)
            beta1, beta2 = group["betas"]
            hyper = dict(
                lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"]
            )
            self._chunked(F.adam_update_, [params, grads[span], exp_avgs, exp_avg_sqs], (), **hyper)

    def _compression_step(self, grads: list[Tensor]) -> None:
        for (group, span), segment in zip(self._group_slices(), self._segments or []):
            beta1 = group["betas"][0]
            prepared = self._preconditioned_local_momentum(segment, grads[span], None, beta1=beta1)
            if segment.local is None and prepared is False:  # virtual workers: inside the exchange
                momenta = segment.views
                if not local_momentum_(momenta, grads[span], beta1=beta1):  # numba where it can
                    F.local_momentum_(momenta, grads[span], beta1=beta1)
            source = prepared if isinstance(prepared, MomentumSource) else None
            self._exchange(segment, None, beta1=beta1, divided=prepared is not False, source=source)
        self._apply_masks()
        for group, _ in self._group_slices():
            hyper = dict(lr=group["lr"], eps=group["eps"], weight_decay=group["weight_decay"])
            self._chunked(F.adam_frozen_update_, self._tensors(group), (), **hyper)
