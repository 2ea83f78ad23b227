"""Error-compensated 1-bit compressed allreduce (spec §2), over any torch.distributed process group.

How an optimizer uses it (1-bit LAMB / 1-bit Adam compression stage, spec §3.5 d):

1. Put everything to be averaged in ONE flat, contiguous fp32 buffer of ``padded_numel(total, n)``
   elements (the momenta as views into it, zeros in the pad) and build one
   ``CompressedAllreduce(len(buffer), group, device)`` for it, once.
2. Each compression step: fill the buffer with this rank's local values and call ``engine(buffer)``.
   The buffer is overwritten IN PLACE with the compressed average, identical bit for bit on every
   rank; the pad region takes part like any other element (do not re-zero it).
3. Checkpoint ``engine.state_dict()`` per rank; restore with ``load_state_dict`` (raises
   :class:`ErrorStateMismatch`, a ``ValueError``, for another world size/rank/length, or pass
   ``reset_on_mismatch=True`` to zero the errors with a logged warning instead).

Never call it with non-finite values: a NaN or inf poisons the persistent error buffers (the scales
become NaN); skip the step on all ranks first (spec §5.3), or ``reset_errors()`` afterwards.

What is communicated per call (n ranks, N elements, C = N/n):

- phase 1: ``all_to_all_single`` of the packed worker signs (N/8 uint8, chunk j of C/8 bytes goes to
  rank j) and an all_gather of the n fp32 worker scales;
- phase 2: an all_gather of the n packed server chunks (C/8 uint8 each) and of the n fp32 server
  scales.

No collective reduces packed bytes and no PREMUL_SUM is used, so gloo and NCCL both work. With
n == 1 the call returns the buffer untouched: no compression and no error feedback, exactly as
DeepSpeed's optimizers skip the call for a single rank, so n == 1 training is exact.
"""

from __future__ import annotations

import enum
import logging
import math
from typing import Any

import torch
import torch.distributed as dist

from pretrain.comm.counter import TrafficCounter, compressed_call_traffic
from pretrain.comm.packing import BITS_PER_BYTE, SignPacker, get_packer

logger = logging.getLogger(__name__)


def pad_multiple(world_size: int) -> int:
    """DeepSpeed's "divider": ``n · lcm(n, 8)``. Buffers must be a multiple of it (spec §2, §8.2)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return world_size * math.lcm(world_size, BITS_PER_BYTE)


def padded_numel(numel: int, world_size: int) -> int:
    """Smallest multiple of ``pad_multiple(world_size)`` that is ``>= numel``.

    The algorithm itself only needs a multiple of 8n (whole bytes per rank chunk); the stricter
    DeepSpeed rule is kept because the pad length changes the worker scale ‖y‖/√N, so the same rule
    is needed for bitwise parity with DeepSpeed. Examples (numel 1000): n=1 -> 1000, 2 -> 1008,
    3 -> 1008, 4 -> 1024, 16 -> 1024, 64 -> 4096, 256 -> 65536.
    """
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    multiple = pad_multiple(world_size)
    return -(-numel // multiple) * multiple


class CollectiveMode(str, enum.Enum):
    """How the two phases are carried out.

    NATIVE: ``all_to_all_single`` + ``all_gather_into_tensor`` (``all_gather_single`` where torch
    has it): the spec's traffic. ALL_GATHER: only the list form of ``dist.all_gather`` with
    equal-size tensors, which every backend has had for years; phase 1 then gathers every rank's
    whole packed buffer, (n − 1)·N/8 bytes instead of (n − 1)/n·N/8, with identical results.
    """

    NATIVE = "native"
    ALL_GATHER = "all_gather"


# ProcessGroupGloo gained the flat-tensor all_gather (_allgather_base / all_gather_into_tensor)
# around torch 2.3 (2024; before that torch's own functional collectives special-cased gloo);
# all_to_all_single has been in gloo since torch 1.7. Verified NATIVE on gloo with torch 2.13 (CPU).
_FIRST_TORCH_WITH_GLOO_ALL_GATHER_INTO_TENSOR = (2, 3)


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def default_collective_mode(group: dist.ProcessGroup | None = None) -> CollectiveMode:
    """The one place that decides whether the native collectives can be used on ``group``."""
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend and _torch_version() < _FIRST_TORCH_WITH_GLOO_ALL_GATHER_INTO_TENSOR:
        return CollectiveMode.ALL_GATHER
    return CollectiveMode.NATIVE


# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns); same contract.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ErrorStateMismatch(ValueError):
    """A saved error state does not fit this instance (other world size, rank or buffer length)."""


class CompressedAllreduce:
    """Error-feedback 1-bit averaging of one flat fp32 buffer of fixed length over ``group``.

    Holds this rank's persistent worker error (``numel`` fp32) and server error (``numel / n``
    fp32, the chunk this rank serves), zero at construction, plus preallocated send/receive
    buffers, all on ``device``. With n == 1 nothing is allocated and calls are the identity.

    Memory per rank, N = numel: errors 4N + 4N/n bytes; packed send/receive 3N/8 bytes (plus
    n·N/8 in ALL_GATHER mode); the torch packer's reused scratch ~1.6N bytes (a bool mask, shifted
    bytes, int32 gather indices). The caller's buffer doubles as fp32 scratch during the call.

    Args:
        numel: buffer length; a multiple of 8·n (use :func:`padded_numel` for DeepSpeed parity).
        group: process group (None = default group); NCCL, gloo or any backend with the collectives.
        device: where buffers live; must match the tensors passed in (CUDA for NCCL).
        collective_mode: force NATIVE or ALL_GATHER; default :func:`default_collective_mode`.
        packer: sign packer; default :func:`~pretrain.comm.packing.get_packer` for ``device``.
        counter: byte counter to record into (shared across instances if desired); default a new one.
    """

    def __init__(
        self,
        numel: int,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
        *,
        collective_mode: CollectiveMode | str | None = None,
        packer: SignPacker | None = None,
        counter: TrafficCounter | None = None,
    ) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError("this process is not a member of the given process group")
        minimum_multiple = BITS_PER_BYTE * self.world_size
        if numel <= 0 or numel % minimum_multiple != 0:
            raise ValueError(
                f"numel must be a positive multiple of 8 * world_size = {minimum_multiple}, got {numel}; "
                f"pad the flat buffer to padded_numel(numel, {self.world_size})"
            )
        self.numel = numel
        self.chunk_numel = numel // self.world_size
        self.device = torch.device(device)
        self.collective_mode = CollectiveMode(collective_mode or default_collective_mode(group))
        self.packer = packer or get_packer(self.device)
        self.traffic = counter or TrafficCounter()

        # Persistent state. Empty for n == 1: the identity call has no error feedback.
        compressing = self.world_size > 1
        self.worker_error = torch.zeros(numel if compressing else 0, device=self.device)
        self.server_error = torch.zeros(self.chunk_numel if compressing else 0, device=self.device)
        if compressing:
            self._allocate_communication_buffers()

    def _allocate_communication_buffers(self) -> None:
        """Send/receive buffers reused by every call (their sizes never change)."""
        packed_numel = self.numel // BITS_PER_BYTE
        chunk_bytes = self.chunk_numel // BITS_PER_BYTE
        world_size = self.world_size
        self._worker_packed = torch.empty(packed_numel, dtype=torch.uint8, device=self.device)
        # Row i: the packed signs of rank i's chunk for this rank (phase 1 receive).
        self._received_packed = torch.empty(world_size, chunk_bytes, dtype=torch.uint8, device=self.device)
        self._worker_scales = torch.empty(world_size, dtype=torch.float32, device=self.device)
        self._server_packed = torch.empty(chunk_bytes, dtype=torch.uint8, device=self.device)
        # Row j: the packed server chunk j (phase 2 receive).
        self._gathered_server_packed = torch.empty(
            world_size, chunk_bytes, dtype=torch.uint8, device=self.device
        )
        self._server_scales = torch.empty(world_size, dtype=torch.float32, device=self.device)
        if self.collective_mode is CollectiveMode.ALL_GATHER:
            self._all_packed = torch.empty(world_size, packed_numel, dtype=torch.uint8, device=self.device)

    # ----------------------------------------------------------------------------- collectives

    def _exchange_worker_chunks(self) -> None:
        """Phase 1 signs: rank i's chunk j of ``_worker_packed`` lands in row i of rank j's receive."""
        if self.collective_mode is CollectiveMode.NATIVE:
            dist.all_to_all_single(self._received_packed.view(-1), self._worker_packed, group=self.group)
            return
        dist.all_gather(list(self._all_packed.unbind(0)), self._worker_packed, group=self.group)
        per_rank = self._all_packed.view(self.world_size, self.world_size, -1)
        self._received_packed.copy_(per_rank[:, self.rank])

    def _gather(self, output: torch.Tensor, local: torch.Tensor) -> None:
        """All-gather equal-size ``local`` tensors into the rows of ``output`` (rank order)."""
        if self.collective_mode is CollectiveMode.NATIVE:
            _all_gather_flat(output.view(-1), local.reshape(-1), group=self.group)
        else:
            dist.all_gather(list(output.view(self.world_size, -1).unbind(0)), local, group=self.group)

    # ------------------------------------------------------------------------------------ call

    @torch.no_grad()
    def __call__(self, buffer: torch.Tensor) -> torch.Tensor:
        """Replace ``buffer`` (1-D contiguous fp32, length ``numel``) by its compressed average.

        In place; returns ``buffer``. Afterwards it holds, on every rank bitwise alike,
        ``concat_j s_j · sign(z_j)`` (spec §2 step 6). During the call the buffer is used as
        scratch, so it must not be read concurrently. Collective: every rank of the group must call.
        """
        self._check_buffer(buffer)
        self.traffic.record(
            compressed_call_traffic(
                self.numel, self.world_size, self.collective_mode is CollectiveMode.ALL_GATHER
            )
        )
        if self.world_size == 1:
            return buffer

        # Worker (spec §2 step 1-2): y = x + e_w, held in the worker-error buffer itself.
        worker_error = self.worker_error.add_(buffer)
        worker_scale = (torch.linalg.vector_norm(worker_error) / math.sqrt(self.numel)).reshape(1)
        self.packer.pack(worker_error, out=self._worker_packed)
        # e_w <- y − s·sign(y); `buffer` is free scratch from here on.
        quantized = self.packer.unpack_scaled(self._worker_packed.view(1, -1), worker_scale, out=buffer)
        worker_error.sub_(quantized)

        # Phase 1 (step 3).
        self._exchange_worker_chunks()
        self._gather(self._worker_scales, worker_scale)

        # Server for chunk `rank` (step 4): z = (1/n) Σ_i s_i·sign_i + e_s, summed in rank order.
        contributions = buffer.view(self.world_size, self.chunk_numel)
        self.packer.unpack_scaled(self._received_packed, self._worker_scales, out=buffer)
        total = contributions[0]
        for source_rank in range(1, self.world_size):
            total.add_(contributions[source_rank])
        server_value = self.server_error.add_(total.div_(self.world_size))
        server_scale = (torch.linalg.vector_norm(server_value) / math.sqrt(self.chunk_numel)).reshape(1)
        self.packer.pack(server_value, out=self._server_packed)
        server_quantized = self.packer.unpack_scaled(
            self._server_packed.view(1, -1), server_scale, out=contributions[0]
        )
        server_value.sub_(server_quantized)

        # Phase 2 (step 5) and decompression of every chunk into the buffer (step 6).
        self._gather(self._gathered_server_packed, self._server_packed)
        self._gather(self._server_scales, server_scale)
        self.packer.unpack_scaled(self._gathered_server_packed, self._server_scales, out=buffer)
        return buffer

    def _check_buffer(self, buffer: torch.Tensor) -> None:
        if buffer.dim() != 1 or buffer.numel() != self.numel:
            raise ValueError(
                f"expected a flat buffer of {self.numel} elements (padded), got shape {tuple(buffer.shape)}"
            )
        if buffer.dtype != torch.float32 or not buffer.is_contiguous():
            raise ValueError(f"expected a contiguous float32 buffer, got {buffer.dtype}")
        if buffer.device != self.worker_error.device:
            raise ValueError(f"buffer is on {buffer.device}, this instance on {self.worker_error.device}")

    # ------------------------------------------------------------------------------ checkpoint

    def reset_errors(self) -> None:
        """Zero both error buffers (fresh start of error feedback)."""
        self.worker_error.zero_()
        self.server_error.zero_()

    def state_dict(self) -> dict[str, Any]:
        """This rank's error state. The tensors are the live buffers, not copies (clone to keep)."""
        return {
            "world_size": self.world_size,
            "rank": self.rank,
            "numel": self.numel,
            "worker_error": self.worker_error,
            "server_error": self.server_error,
        }

    def load_state_dict(self, state_dict: dict[str, Any], *, reset_on_mismatch: bool = False) -> bool:
        """Restore errors saved by :meth:`state_dict` on the same rank of a same-size group.

        Returns True when restored. On a world size, rank or length mismatch: raises
        :class:`ErrorStateMismatch` (a ``ValueError``), or, with ``reset_on_mismatch=True``, zeroes
        the errors, logs a warning and returns False. Errors are per-rank shards of a global state
        and cannot be re-split for another world size.
        """
        expected = {"world_size": self.world_size, "rank": self.rank, "numel": self.numel}
        found = {key: state_dict.get(key) for key in expected}
        if found != expected:
            message = f"compressed-allreduce error state saved for {found}, this run has {expected}"
            if not reset_on_mismatch:
                raise ErrorStateMismatch(message)
            logger.warning("%s: resetting the error-feedback buffers to zero", message)
            self.reset_errors()
            return False
        self.worker_error.copy_(state_dict["worker_error"])
        self.server_error.copy_(state_dict["server_error"])
        return True
