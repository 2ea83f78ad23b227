"""Simulated data-parallel ranks: `sim_world_size=k` runs k workers in each process.

The paper's regime is tens to hundreds of data-parallel workers; a CPU machine runs two processes. With
`sim_world_size=k` each of the W processes stands for k workers, so the run is a data-parallel run of
n = W·k workers: worker w of process r is worker v = r·k + w, and it gets exactly what rank v of a real
n-process run gets:

- its micro-batches (the sampler of rank v in a world of n; `VirtualPhaseData`);
- its own dropout stream (`worker_seed(seed, v)`; its RNG state is swapped in around its forward and
  backward passes and checkpointed);
- gradient averaging while the optimizer asks for it: Σ_w g_w/n over the k local workers in order,
  then an allreduce over the W processes (a real run's DDP hook divides by n and sums over ranks);
- in the 1-bit compression stage its own gradient, written into the optimizer's per-worker buffer
  (`worker_gradient_views`); the optimizer forms every worker's local momentum and error feedback and
  averages them with the same compressed-allreduce arithmetic (`pretrain.comm`, virtual workers).

So at W = 1 a simulated run of k = 2 reproduces a real 2-process gloo run bitwise (two-term sums are
commutative); at k > 2, and with W > 1, the warmup's gradient sums run in another order than gloo's
ring (fp32 rounding, ~1e-7 relative per step), so trajectories agree to that and drift as rounding
differences do (tests/integration/test_simulated.py states the tolerance). The compression stage's
arithmetic is the same as on real ranks, in the same order.

Cost: the forward and backward work is that of the n-worker run (same samples), on W processes; memory
adds k·(4N + 4N + 4N/n) bytes for a buffer of N parameters (gradients/local momenta, worker errors,
server errors) and one RNG state per worker. Byte counts in the metrics are those of the simulated
n-worker run, per worker.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pretrain.optim import needs_gradient_allreduce
from pretrain.train.phase_data import PhaseData


def worker_seed(seed: int, worker: int) -> int:
    """The seed of data-parallel worker `worker`'s dropout stream (distinct from the model's init seed)."""
    return int(np.random.SeedSequence([seed, worker, 0xD1]).generate_state(1, dtype=np.uint64)[0] >> 1)


def _grad(param: torch.Tensor) -> torch.Tensor:
    return param.grad if param.grad is not None else torch.zeros_like(param)


class VirtualPhaseData:
    """The k workers' `PhaseData`, one per worker rank of the n-worker world. Their samplers share the
    global cursor, so the state of one is the state of all."""

    def __init__(self, make: Callable[[int, int], PhaseData], first: int, num_workers: int, world_size: int):
        self.workers = [make(first + worker, world_size) for worker in range(num_workers)]

    def next_step(self, accumulation: int) -> list[list[dict[str, torch.Tensor]]]:
        """Per worker, the micro-batches of one optimizer step."""
        return [data.next_step(accumulation) for data in self.workers]

    @property
    def epoch(self) -> int:
        return self.workers[0].epoch

    def state_dict(self) -> dict[str, Any]:
        return self.workers[0].state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for data in self.workers:
            data.load_state_dict(state)

    def close(self) -> None:
        for data in self.workers:
            data.close()


class SimulatedRanks:
    """k workers in this process (module docstring). `forward_backward` replaces the trainer's loop over
    micro-batches, `step` its optimizer call."""

    def __init__(self, num_workers: int, rank: int, num_processes: int, seed: int, device: torch.device):
        self.num_workers = num_workers
        self.first = rank * num_workers
        self.world_size = num_processes * num_workers
        self.num_processes = num_processes
        self.device = device
        self._rng = [self._seeded_state(seed, self.first + w) for w in range(num_workers)]
        self._average: list[torch.Tensor] | None = None

    def _seeded_state(self, seed: int, worker: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(worker_seed(seed, worker))
        state = {"cpu": generator.get_state()}
        if self.device.type == "cuda":
            cuda = torch.Generator(device=self.device).manual_seed(worker_seed(seed, worker))
            state["cuda"] = cuda.get_state()
        return state

    def _swap_in(self, worker: int) -> None:
        torch.set_rng_state(self._rng[worker]["cpu"])
        if "cuda" in self._rng[worker]:
            torch.cuda.set_rng_state(self._rng[worker]["cuda"], self.device)

    def _swap_out(self, worker: int) -> None:
        self._rng[worker]["cpu"] = torch.get_rng_state()
        if "cuda" in self._rng[worker]:
            self._rng[worker]["cuda"] = torch.cuda.get_rng_state(self.device)

    def forward_backward(
        self,
        batches: list[list[dict[str, torch.Tensor]]],
        micro_step: Callable[[dict[str, torch.Tensor]], torch.Tensor],
        optimizer: torch.optim.Optimizer,
        params: list[torch.Tensor],
    ) -> torch.Tensor:
        """Run every worker's micro-batches (`micro_step` does one forward/backward, without gradient
        sync, and returns its metric totals); leave averaged gradients in `.grad` (gradient-averaging
        steps) or each worker's own in the optimizer's worker buffer (1-bit compression stage).
        Returns the metric totals summed over the workers."""
        averaging = needs_gradient_allreduce(optimizer)
        totals: torch.Tensor | None = None
        for worker, worker_batches in enumerate(batches):
            for p in params:
                p.grad = None
            self._swap_in(worker)
            # summed per worker, then over workers: the order a real run's totals allreduce has
            worker_totals = torch.zeros(5, device=self.device)
            for batch in worker_batches:
                worker_totals += micro_step(batch)
            totals = worker_totals if totals is None else totals + worker_totals
            self._swap_out(worker)
            if averaging:
                self._accumulate(worker, [_grad(p) for p in params])
            else:  # the optimizer's parameter order
                ordered = [_grad(p) for group in optimizer.param_groups for p in group["params"]]
                torch._foreach_copy_(optimizer.worker_gradient_views(worker), ordered)  # type: ignore[attr-defined]
        if averaging:
            self._finish_average(params)
        else:
            for p in params:
                p.grad = None
        assert totals is not None
        return totals

    def _accumulate(self, worker: int, grads: list[torch.Tensor]) -> None:
        """Σ_w g_w/n in worker order, as a real run's DDP hook divides each rank's bucket by n."""
        if worker == 0:
            self._average = list(torch._foreach_div(grads, self.world_size))
        else:
            assert self._average is not None
            torch._foreach_add_(self._average, torch._foreach_div(grads, self.world_size))

    def _finish_average(self, params: list[torch.Tensor]) -> None:
        assert self._average is not None
        if self.num_processes > 1:
            flat = torch.cat([g.reshape(-1) for g in self._average])
            dist.all_reduce(flat)
            pieces = flat.split([g.numel() for g in self._average])
            torch._foreach_copy_(self._average, [piece.view_as(g) for piece, g in zip(pieces, self._average)])
        for p, grad in zip(params, self._average):
            p.grad = grad.view_as(p)
        self._average = None

    def state_dict(self) -> dict[str, Any]:
        return {"num_workers": self.num_workers, "first": self.first, "rng": self._rng}

    def load_state_dict(self, state: dict[str, Any]) -> bool:
        """Restore the workers' RNG streams; False (streams restart) when the layout differs."""
        if (state.get("num_workers"), state.get("first")) != (self.num_workers, self.first):
            return False
        self._rng = [{key: value.clone() for key, value in rng.items()} for rng in state["rng"]]
        return True
