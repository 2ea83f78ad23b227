"""What the rung's ablation patches (fp32_server.py, fp32_worker.py, two_bit_worker.py, worker_decay.py,
exact_mean.py) share: installing their methods on the engine class, unpipelined, and the opening of a replaced
call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pretrain.comm.compressed_allreduce import CompressedAllreduce
from pretrain.comm.plan import MomentumSource


def patch(engine: type[CompressedAllreduce], methods: dict[str, Any]) -> type[CompressedAllreduce]:
    """Set `methods` on `engine` (CompressedAllreduce or a subclass) in place, its instances not pipelined
    (the pipelined call has its own passes); returns it."""
    original_init = engine.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        self._pipeline = None

    for name, method in {"__init__": __init__, **methods}.items():
        setattr(engine, name, method)
    return engine


def begin_call(
    self: Any, buffer: torch.Tensor, out: torch.Tensor | None, source: MomentumSource | None
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """A replaced `__call__`'s opening, as the engine's: the checked [k, numel] rows and the output, the call
    recorded, a value source filled into the buffer; True when there is nothing to compress (one worker: the
    output holds the values)."""
    local, out = self._check_call(buffer, out)
    self.traffic.record(self._call_traffic)
    if source is not None:
        if self.virtual_workers > 1:
            raise ValueError("a value source needs one worker per process")
        source.fill(local[0])
    if self.world_size == 1:
        if out is not buffer:
            out.copy_(local[0])
        return local, out, True
    return local, out, False


def replaced_call(body: Callable[[Any, torch.Tensor, torch.Tensor], None]) -> Callable[..., torch.Tensor]:
    """A replacement for the engine's `__call__`: the engine's opening (`begin_call`), then `body(self, local,
    out)` writes the average of the [k, numel] rows `local` into `out`, unless there is one worker only."""

    @torch.no_grad()
    def __call__(
        self: Any,
        buffer: torch.Tensor,
        out: torch.Tensor | None = None,
        *,
        source: MomentumSource | None = None,
    ) -> torch.Tensor:
        local, out, identity = begin_call(self, buffer, out, source)
        if not identity:
            body(self, local, out)
        return out

    __call__.__doc__ = body.__doc__
    __call__.__module__ = body.__module__
    return __call__
