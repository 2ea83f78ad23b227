"""Process-group setup from torchrun's environment: the one place where CPU and GPU runs differ.

CUDA available -> NCCL backend, one GPU per local rank, bf16 autocast (fp16 on request).
No CUDA       -> gloo backend on CPU, fp32.
A plain `python -m pretrain` without torchrun runs as a world of one.
"""

from __future__ import annotations

import datetime
import inspect
import os
import socket
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


@dataclass(frozen=True)
class DistributedEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_s: float = 1800.0) -> DistributedEnv:
    """Join (or create, for a world of one) the default process group.

    torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*) is used as is; under a submitit
    SLURM task (Hydra's submitit launcher) it is derived from SLURM's by submitit itself. Only
    SUBMITIT_EXECUTOR is checked: SLURM_PROCID is also set in plain batch/salloc shells. `timeout_s`
    bounds every collective (pretrain: `dist.timeout_s`; pretrain/distributed/liveness.py names a stalled
    peer).
    """
    if "RANK" not in os.environ and os.environ.get("SUBMITIT_EXECUTOR") == "slurm":
        from submitit.helpers import TorchDistributedEnvironment

        TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        # sites that give each task its own GPU show one device per process
        device, backend = torch.device("cuda", local_rank % torch.cuda.device_count()), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        store = _attempt_store(world_size, timeout)
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, store=store)
    return DistributedEnv(rank, world_size, local_rank, device, backend)


def _attempt_store(world_size: int, timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun with its agent's store, a store whose keys are private to this restart attempt.

    torch 2.13's env:// init reads keys that the attempt before a `--max-restarts` restart left in the
    agent's store: the new ranks' gloo connects to the dead ranks' ports ("connectFullMesh failed ...
    Connection refused") and the restarted job fails. None (plain env://) everywhere else."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"/bert_lamb/attempt_{attempt}", store)


def no_buffer_sync() -> dict[str, Any]:
    """DDP's keyword that turns off the buffers' broadcast before every forward: `forward_sync_buffers`
    from torch 2.13 (where `broadcast_buffers` is deprecated), `broadcast_buffers` before it (2.11 on GPU
    images, for one: `bench gpu` found the new name refused there)."""
    parameters = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers" if "forward_sync_buffers" in parameters else "broadcast_buffers": False}


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def autocast_context(device: torch.device, precision: str) -> AbstractContextManager:
    """fp32 everywhere on CPU; bf16 (default) or fp16 autocast on CUDA."""
    if device.type != "cuda" or precision == "fp32":
        return nullcontext()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return torch.autocast("cuda", dtype=dtype)
