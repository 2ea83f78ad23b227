"""1-bit optimizers with k virtual workers in one process against k real gloo processes.

The test plays the trainer on both sides with the same per-worker gradients: during warmup it averages
them as Σ_w g_w/n in worker order (the real side gathers every rank's gradient and sums in rank order,
so both sides add the same floats in the same order; the trainer-level test in
tests/integration/test_simulated.py covers the gloo ring's own order), in the compression stage the
real ranks keep their own and the simulated optimizer gets each worker's in `worker_gradient_views`.
Parameters and replicated state must agree bitwise after every step, for 1-bit LAMB with DeepSpeed's
exchange, with per-column scales (embedding rows, position mask, exact vectors), the preconditioned
exchange (`precondition`), scales sent in bfloat16 (`scale_dtype`), NVLAMB's warmup with live vector
variance and the variance refresh (`variance_refresh`), and for 1-bit Adam;
a checkpoint taken in the compression stage resumes bitwise in fresh processes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.distributed.launcher import run_distributed
from tests.distributed.test_onebit_optimizers import _digest, _load, _model

pytestmark = pytest.mark.distributed

FREEZE_STEP, NUM_STEPS, SAVE_AFTER = 3, 10, 6
VOCAB, USED = 40, 30
PER_COLUMN = dict(compression="per_column", sign_scale="mean_abs", trust_ratio="live", precondition=True)
NVLAMB = {**PER_COLUMN, "exact_vectors": True, "warmup": "nvlamb", "eps": 1e-6}
CONFIGS = {
    # optim=onebit_lamb_deepspeed's algorithm (OnebitLamb's defaults)
    "deepspeed": ("onebit_lamb", dict(compression="deepspeed")),
    # per-column and per-row scales (embedding rows, position mask) under the frozen coefficient rule
    "per_column_mean_abs": ("onebit_lamb", dict(compression="per_column", sign_scale="mean_abs")),
    "per_column_exact_vectors": ("onebit_lamb", dict(compression="per_column", exact_vectors=True)),
    "adam_per_column": ("onebit_adam", dict(compression="per_column")),
    "preconditioned": ("onebit_lamb", PER_COLUMN),
    "adam_preconditioned": ("onebit_adam", dict(compression="per_column", precondition=True)),
    # exact vectors with their per-element scales sent in bfloat16
    "per_column_bfloat16": ("onebit_lamb", {**PER_COLUMN, "exact_vectors": True, "scale_dtype": "bfloat16"}),
    # the warmup as NVLAMB: pre-normalized gradients, then the frozen factor on each worker's own gradient
    "nvlamb": ("onebit_lamb", {**NVLAMB, "scale_dtype": "bfloat16"}),
    # and the 1-D tensors' variance kept live from their exact average (their exchange divisor follows it)
    "nvlamb_live_vectors": (
        "onebit_lamb",
        {**NVLAMB, "scale_dtype": "bfloat16", "live_vector_variance": True},
    ),
    # optim=onebit_lamb's algorithm: and the variance refreshed every 2nd compression step from the
    # workers' row and column sums of g² (steps 4+5 -> 5, 6+7 -> 7; the resume at 6 carries step 6's sums)
    "onebit_lamb": (
        "onebit_lamb",
        {**NVLAMB, "scale_dtype": "bfloat16", "live_vector_variance": True, "variance_refresh": 2},
    ),
}


def _build(config: str, virtual_workers: int):
    from pretrain.optim import OnebitAdam, OnebitLamb
    from pretrain.optim.onebit import ExchangeOptions
    from pretrain.optim.onebit_lamb import DEEPSPEED_ALGORITHM

    name, options = CONFIGS[config]
    model = _model(VOCAB)
    embedding, *rest = model.parameters()
    mask = (torch.arange(VOCAB) < USED).float().unsqueeze(1)
    row_scales = options.get("compression") == "per_column"
    groups = [
        {"params": [p for p in rest if p.dim() > 1], "weight_decay": 0.01},
        {"params": [p for p in rest if p.dim() == 1], "weight_decay": 0.0},
        {"params": [embedding], "weight_decay": 0.01, "exp_avg_mask": mask, "row_scales": row_scales},
    ]
    if name == "onebit_lamb":
        options = dict(options)
        tunable = {key: options.pop(key) for key in ("eps", "variance_refresh") if key in options}
        optimizer = OnebitLamb(
            groups,
            lr=0.02,
            freeze_step=FREEZE_STEP,
            max_coeff=0.3,
            virtual_workers=virtual_workers,
            algorithm=DEEPSPEED_ALGORITHM.replace(**options),
            **tunable,
        )
    else:
        optimizer = OnebitAdam(
            groups,
            lr=0.01,
            freeze_step=FREEZE_STEP,
            virtual_workers=virtual_workers,
            exchange=ExchangeOptions(**options),
        )
    return model, optimizer


def _gradients(model: torch.nn.Module, worker: int, step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + worker)
    tokens = torch.randint(0, USED, (6,), generator=generator)
    target = torch.randn(6, 4, generator=generator) * (1 + worker)
    model.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(tokens), target).backward()
    return [p.grad.clone() for p in model.parameters()]


def _ordered(model: torch.nn.Module, optimizer, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    index = {id(p): i for i, p in enumerate(model.parameters())}
    return [grads[index[id(p)]] for group in optimizer.param_groups for p in group["params"]]


def _average(per_worker: list[list[torch.Tensor]], world_size: int) -> list[torch.Tensor]:
    total = torch._foreach_div(per_worker[0], world_size)
    for grads in per_worker[1:]:
        torch._foreach_add_(total, torch._foreach_div(grads, world_size))
    return total


def _step(model, optimizer, workers: list[int], processes: int, step: int) -> None:
    """One step for `workers` (one real rank's, or this process's simulated ones)."""
    world_size = processes * len(workers)
    if optimizer.needs_gradient_allreduce:  # every worker's gradients, summed in worker order
        local = [_gradients(model, worker, step) for worker in workers]
        per_worker = local
        if processes > 1:
            per_worker = []
            for own in local:
                gathered = [[torch.empty_like(g) for g in own] for _ in range(processes)]
                for index, grad in enumerate(own):
                    dist.all_gather([ranks[index] for ranks in gathered], grad)
                per_worker.append(gathered)
            # gathered[q] of local worker w is worker q·k + w: reorder to worker order
            per_worker = [per_worker[w][q] for q in range(processes) for w in range(len(workers))]
        for p, grad in zip(model.parameters(), _average(per_worker, world_size)):
            p.grad = grad
    elif len(workers) == 1:
        for p, grad in zip(model.parameters(), _gradients(model, workers[0], step)):
            p.grad = grad
    else:
        for index, worker in enumerate(workers):
            ordered = _ordered(model, optimizer, _gradients(model, worker, step))
            torch._foreach_copy_(optimizer.worker_gradient_views(index), ordered)
        model.zero_grad(set_to_none=True)
    optimizer.step()


def _train(rank: int, processes: int, virtual: int, checkpoint_dir: str, resume: bool) -> dict:
    torch.set_num_threads(1)
    workers = [rank * virtual + w for w in range(virtual)]
    results = {}
    for config in CONFIGS:
        model, optimizer = _build(config, virtual)
        path = Path(checkpoint_dir) / f"{config}-{processes}x{virtual}-rank{rank}.pt"
        first = 0
        if resume:
            _load(path, model, optimizer)
            first = SAVE_AFTER
        digests = []
        for step in range(first, NUM_STEPS):
            _step(model, optimizer, workers, processes, step)
            digests.append(_digest(model, optimizer))
            if step + 1 == SAVE_AFTER and not resume:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
        results[config] = {"digests": digests, "bytes": optimizer.traffic.compressed_bytes}
    return results


@pytest.mark.slow  # `make test`: tests/integration/test_simulated.py runs 2 simulated workers against 2 ranks
@pytest.mark.parametrize("workers", [2, 4])
def test_virtual_workers_equal_real_ranks(workers: int, tmp_path: Path):
    real = run_distributed(_train, workers, (1, str(tmp_path), False))
    simulated = run_distributed(_train, 1, (workers, str(tmp_path), False))[0]
    for config in CONFIGS:
        assert all(rank[config]["digests"] == real[0][config]["digests"] for rank in real), config
        assert simulated[config]["digests"] == real[0][config]["digests"], config
        assert len(set(simulated[config]["digests"])) == NUM_STEPS, f"{config}: a step did not update"
        assert simulated[config]["bytes"] == pytest.approx(real[0][config]["bytes"], rel=1e-12), config
    resumed = run_distributed(_train, 1, (workers, str(tmp_path), True))[0]
    for config in CONFIGS:
        assert resumed[config]["digests"] == simulated[config]["digests"][SAVE_AFTER:], config


@pytest.mark.slow
def test_two_processes_of_two_virtual_workers_equal_four_ranks(tmp_path: Path):
    real = run_distributed(_train, 4, (1, str(tmp_path), False))
    mixed = run_distributed(_train, 2, (2, str(tmp_path), False))
    for config in CONFIGS:
        assert all(rank[config]["digests"] == real[0][config]["digests"] for rank in mixed), config
