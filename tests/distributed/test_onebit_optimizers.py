"""1-bit LAMB and 1-bit Adam on 2 and 4 gloo processes (spec §8.14, §8.15; issue 3).

One launch trains both optimizers (and a LAMB twin) through warmup and compression and checks, per
step: replicas bitwise identical (parameters and optimizer state), 1-bit LAMB warmup == LAMB, masked
momentum rows stay zero, an Inf injected on one rank skips the step on all ranks. It saves per-rank
checkpoints at a compression step; a second launch (fresh processes) loads them and must end bitwise
where the uninterrupted run ended. The test plays the trainer: it mean-allreduces gradients exactly
when `needs_gradient_allreduce` is True.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.distributed.launcher import run_distributed

pytestmark = pytest.mark.distributed

FREEZE_STEP = 3
SAVE_AFTER = 5  # steps taken when the checkpoint is written (compression stage)
OVERFLOW_STEP = 6  # index of the step whose first attempt carries an Inf on the last rank
NUM_STEPS = 9
VOCAB, USED_TOKENS = 12, 9  # embedding rows >= USED_TOKENS are never looked up and are masked


def _model(vocab: int = VOCAB) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(vocab, 8), torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(),
        torch.nn.Linear(16, 4),
    )  # fmt: skip


def _groups(model: torch.nn.Module) -> list[dict]:
    embedding, *rest = model.parameters()
    mask = (torch.arange(VOCAB) < USED_TOKENS).float().unsqueeze(1)
    return [
        {"params": [p for p in rest if p.dim() > 1], "weight_decay": 0.01},
        {"params": [p for p in rest if p.dim() == 1], "weight_decay": 0.0},
        {"params": [embedding], "weight_decay": 0.01, "exp_avg_mask": mask},
    ]


def _build(name: str):
    from pretrain.optim import Lamb, OnebitAdam, OnebitLamb

    model = _model()
    if name == "onebit_lamb":
        return model, OnebitLamb(_groups(model), lr=0.02, freeze_step=FREEZE_STEP, max_coeff=0.3)
    if name == "onebit_adam":
        return model, OnebitAdam(_groups(model), lr=0.01, freeze_step=FREEZE_STEP)
    groups = [{k: v for k, v in g.items() if k != "exp_avg_mask"} for g in _groups(model)]
    return model, Lamb(groups, lr=0.02, variant="deepspeed", bias_correction=False, max_coeff=0.3)


def _backward(model: torch.nn.Module, rank: int, step: int, allreduce: bool) -> None:
    """This rank's gradients for `step` (its own data), mean-allreduced when the optimizer asks."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, USED_TOKENS, (6,), generator=generator)
    target = torch.randn(6, 4, generator=generator)
    model.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(tokens), target).backward()
    if allreduce and dist.get_world_size() > 1:
        for p in model.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad.div_(dist.get_world_size())


def _digest(model: torch.nn.Module, optimizer) -> str:
    """Hash of parameters and the replicated optimizer state (not the rank-local error buffers)."""
    tensors = [p.detach().reshape(-1) for p in model.parameters()]
    for p in model.parameters():
        tensors += [
            v.reshape(-1).float() for _, v in sorted(optimizer.state[p].items()) if torch.is_tensor(v)
        ]
    return hashlib.sha256(torch.cat(tensors).numpy().tobytes()).hexdigest()


def _step(model, optimizer, rank: int, world_size: int, step: int, log: dict) -> None:
    if step == OVERFLOW_STEP:
        before = _digest(model, optimizer)
        _backward(model, rank, step, optimizer.needs_gradient_allreduce)
        if rank == world_size - 1:
            next(iter(model.parameters())).grad[0, 0] = float("inf")
        optimizer.step()
        log["skipped"] = (
            optimizer.last_step_skipped,
            optimizer.num_skipped_steps,
            before == _digest(model, optimizer),
        )
    _backward(model, rank, step, optimizer.needs_gradient_allreduce)
    optimizer.step()
    assert not optimizer.last_step_skipped


def _load(path: Path, model: torch.nn.Module, optimizer) -> None:
    """Restore a `{"model", "optimizer"}` checkpoint written by `torch.save` in a test."""
    saved = torch.load(path, weights_only=True)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])


def _train(rank: int, world_size: int, checkpoint_dir: str, resume: bool) -> dict:
    torch.set_num_threads(1)
    results = {}
    for name in ("onebit_lamb", "onebit_adam"):
        model, optimizer = _build(name)
        lamb_model, lamb = _build("lamb")
        path = Path(checkpoint_dir) / f"{name}-rank{rank}.pt"
        first = 0
        if resume:
            _load(path, model, optimizer)
            first = SAVE_AFTER
        log: dict = {"digests": [], "warmup_equals_lamb": [], "masked_rows_zero": [], "allreduce": []}
        for step in range(first, NUM_STEPS):
            log["allreduce"].append(optimizer.needs_gradient_allreduce)
            _step(model, optimizer, rank, world_size, step, log)
            log["digests"].append(_digest(model, optimizer))
            momentum = optimizer.state[next(iter(model.parameters()))]["exp_avg"]
            log["masked_rows_zero"].append(bool(momentum[USED_TOKENS:].eq(0).all()) or step < FREEZE_STEP)
            if name == "onebit_lamb" and step < FREEZE_STEP:
                _backward(lamb_model, rank, step, allreduce=True)
                lamb.step()
                same = all(torch.equal(a, b) for a, b in zip(model.parameters(), lamb_model.parameters()))
                log["warmup_equals_lamb"].append(same)
            if step + 1 == SAVE_AFTER and not resume:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
                errors = optimizer.state_dict()["extra"]["compressors"][0]["worker_error"]
                log["errors_nonzero_at_save"] = bool(errors.abs().sum() > 0)
                log["bytes_sent_at_save"] = optimizer.traffic.compressed_bytes
        results[name] = log
    return results


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_replicas_warmup_overflow_and_resume(world_size: int, tmp_path: Path):
    full = run_distributed(_train, world_size, (str(tmp_path), False))
    resumed = run_distributed(_train, world_size, (str(tmp_path), True))
    for name in ("onebit_lamb", "onebit_adam"):
        logs = [ranks[name] for ranks in full]
        assert all(log["digests"] == logs[0]["digests"] for log in logs), f"{name}: replicas diverged"
        assert len(set(logs[0]["digests"])) == NUM_STEPS, f"{name}: some step did not update"
        expected_allreduce = [step < FREEZE_STEP for step in range(NUM_STEPS)]
        assert all(log["allreduce"] == expected_allreduce for log in logs)
        assert all(all(log["masked_rows_zero"]) for log in logs), f"{name}: masked momentum leaked"
        assert all(log["skipped"] == (True, 1, True) for log in logs), (
            f"{name}: overflow not skipped everywhere"
        )
        assert all(log["errors_nonzero_at_save"] and log["bytes_sent_at_save"] > 0 for log in logs)
        # fresh processes resumed from the per-rank checkpoints end exactly where the full run ended
        resumed_logs = [ranks[name] for ranks in resumed]
        assert all(log["digests"] == logs[0]["digests"][SAVE_AFTER:] for log in resumed_logs), (
            f"{name}: resume differs"
        )
    lamb_logs = [ranks["onebit_lamb"]["warmup_equals_lamb"] for ranks in full]
    assert all(log == [True] * FREEZE_STEP for log in lamb_logs), "1-bit LAMB warmup differs from LAMB"
