"""Error-compensated 1-bit compressed allreduce over any torch.distributed process group
(docs/onebit-lamb.md).

How an optimizer uses it (1-bit LAMB / 1-bit Adam compression stage, docs/onebit-lamb.md):

1. Put everything to be averaged in ONE flat, contiguous fp32 buffer of ``padded_numel(total, n)``
   elements (the momenta as views into it, zeros in the pad) and build one
   ``CompressedAllreduce(len(buffer), group, device)`` for it, once.
2. Each compression step: fill the buffer with this rank's local values and call ``engine(buffer)``.
   The buffer is overwritten IN PLACE with the compressed average, identical bit for bit on every
   rank; the pad region takes part like any other element (do not re-zero it).
3. Checkpoint ``engine.state_dict()`` per rank; restore with ``load_state_dict`` (raises
   :class:`ErrorStateMismatch`, a ``ValueError``, for another world size/rank/length/layout, or pass
   ``reset_on_mismatch=True`` to zero the errors with a logged warning instead).

Never call it with non-finite values: a NaN or inf poisons the persistent error buffers (the scales
become NaN); skip the step on all ranks first (docs/pretraining.md), or ``reset_errors()`` afterwards.

Scales (``layout``, :mod:`pretrain.comm.layout`): by default DeepSpeed's, one scale per worker
buffer and one per server chunk. ``ScaleLayout.from_blocks`` gives one scale per tensor, or per row
of an embedding matrix, for workers and servers alike; the scales travel with the signs of their
chunk. ``sign_scale``: the scale of a segment y is ‖y‖₂/√len (``rms``, DeepSpeed) or ‖y‖₁/len
(``mean_abs``, the scale that minimises ‖y − s·sign(y)‖₂).

Virtual workers (``virtual_workers=k``): each process stands for k data-parallel workers, each with
its own worker error; the call takes a ``[k, numel]`` buffer (row w = worker w's local values) and
writes the average into ``out``. The n = (group size)·k workers are numbered process-major (process
r holds workers r·k … r·k + k − 1 and serves chunks r·k … r·k + k − 1), and every sum runs in that
order, so k virtual workers on one process give bitwise what k processes give (tested).

What is communicated per call (n workers, N elements, C = N/n, S segments over all chunks):

- phase 1: ``all_to_all_single`` of the packed worker signs (N/8 uint8, chunk j of C/8 bytes goes to
  the server of chunk j) and of the worker scales of each chunk's segments;
- phase 2: an all_gather of the n packed server chunks (C/8 uint8 each) and an exchange of the
  servers' scales (S over all chunks, fp32 or bfloat16: ``scale_dtype``).

No collective reduces packed bytes and no PREMUL_SUM is used, so gloo and NCCL both work. With
n == 1 the call returns the buffer untouched: no compression and no error feedback, exactly as
DeepSpeed's optimizers skip the call for a single rank, so n == 1 training is exact.
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pretrain.comm.collectives import all_gather_flat
from pretrain.comm.counter import TrafficCounter, compressed_call_traffic
from pretrain.comm.kernels import get_kernels
from pretrain.comm.layout import ScaleLayout
from pretrain.comm.packing import BITS_PER_BYTE, SignPacker, get_packer
from pretrain.comm.pipeline import PipelinedExchange, pieces_for
from pretrain.comm.plan import MomentumSource, RunPlan, ScaleDtype, SignScale

# What `SignScale` and `ScaleDtype` are imported from by the optimizers and their configs
__all__ = [
    "CollectiveMode",
    "CompressedAllreduce",
    "ErrorStateMismatch",
    "PointHook",
    "ScaleDtype",
    "SignScale",
    "default_collective_mode",
    "pad_multiple",
    "padded_numel",
]

# Called with the name of a point of the call when it is reached (`CompressedAllreduce`'s ``hook``)
PointHook = Callable[[str], None]

logger = logging.getLogger(__name__)


def pad_multiple(world_size: int) -> int:
    """DeepSpeed's "divider": ``n · lcm(n, 8)``. Buffers must be a multiple of it (docs/onebit-lamb.md)."""
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
    has it): the documented traffic (docs/onebit-lamb.md). ALL_GATHER: only the list form of
    ``dist.all_gather`` with
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
    if not (dist.is_available() and dist.is_initialized()):
        return CollectiveMode.NATIVE  # no collectives at all (one process of virtual workers)
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend and _torch_version() < _FIRST_TORCH_WITH_GLOO_ALL_GATHER_INTO_TENSOR:
        return CollectiveMode.ALL_GATHER
    return CollectiveMode.NATIVE


class ErrorStateMismatch(ValueError):
    """A saved error state does not fit this instance (other world size, rank, length or layout)."""


class CompressedAllreduce:
    """Error-feedback 1-bit averaging of one flat fp32 buffer of fixed length over ``group``.

    Holds the persistent worker error of each of this process's k workers (``numel`` fp32 each) and
    the server error of each chunk it serves (``numel / n`` fp32 each, n = group size · k), zero at
    construction, plus preallocated send/receive buffers, all on ``device``. With n == 1 nothing is
    allocated and calls are the identity.

    Memory per process, N = numel: errors k·4N + k·4N/n bytes; packed send/receive (2k + 1)·N/8 bytes
    (plus k·n·N/8 in ALL_GATHER mode); the scales (4 bytes per segment, a few times); with the torch
    kernels, the packer's reused scratch ~1.6N bytes (the numba kernels: 32 KiB; the compiled kernels: segment
    maps of ~1.3 bytes per element, :mod:`pretrain.comm.compiled_kernels`). The caller's buffer
    doubles as fp32 scratch during the call.

    Byte accounting (``traffic``): what one of n real ranks sends per call, also with virtual workers
    (the figure of the run being simulated); segment scales are counted at their average per rank.

    Args:
        numel: buffer length; a multiple of 8·n (use :func:`padded_numel` for DeepSpeed parity).
        group: process group (None = default group); NCCL, gloo or any backend with the collectives.
        device: where buffers live; must match the tensors passed in (CUDA for NCCL).
        collective_mode: force NATIVE or ALL_GATHER; default :func:`default_collective_mode`.
        packer: sign packer; default :func:`~pretrain.comm.packing.get_packer` for ``device``.
        counter: byte counter to record into (shared across instances if desired); default a new one.
        layout: where scales apply (:mod:`pretrain.comm.layout`); default DeepSpeed's single scale.
        virtual_workers: k, the data-parallel workers this process stands for (module docstring).
        sign_scale: ``rms`` (DeepSpeed) or ``mean_abs``.
        scale_dtype: ``float32`` (DeepSpeed) or ``bfloat16`` (:class:`ScaleDtype`).
        kernels: the elementwise passes (:mod:`pretrain.comm.kernels`): ``auto`` (default; fused numba
            loops on CPU, torch ops elsewhere), ``torch`` (the reference) or ``numba``. Same bits either way.
        pipeline: pieces each chunk's signs travel in, so that the wire overlaps the compression
            (:mod:`pretrain.comm.pipeline`): None = auto (1 per MiB of a chunk's signs, at most 8), 0 or 1 =
            off. Same bits either way. Used with one worker per process over the native collectives.
        fuse_worker_pass: the worker's and the server's steps in one pass each where the kernels can
            (`numba_kernels.WorkerPass`, `numba_kernels.ServerPass`: numba, ``mean_abs``; pipelined, their
            stretches sent point to point, :mod:`pretrain.comm.pipeline`); False runs the passes separately
            (a benchmark's peer). Same bits either way.
        hook: called with ``"exchange"`` once per call, between the workers' signs and the servers'
            (after the all-to-all, before the all-gather); by default the class attribute
            ``CompressedAllreduce.hook`` (None), which the reliability tests' fault injection sets
            (`pretrain.distributed.faults`) for the engines the optimizers build out of its reach. Set by
            whoever
            builds the engine; never changes the result.
    """

    hook: PointHook | None = None  # every instance's `hook` unless it is given one (class docstring)

    def __init__(
        self,
        numel: int,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
        *,
        collective_mode: CollectiveMode | str | None = None,
        packer: SignPacker | None = None,
        counter: TrafficCounter | None = None,
        layout: ScaleLayout | None = None,
        virtual_workers: int = 1,
        sign_scale: SignScale | str = SignScale.rms,
        scale_dtype: ScaleDtype | str = ScaleDtype.float32,
        kernels: str | None = None,
        pipeline: int | None = None,
        fuse_worker_pass: bool = True,
        hook: PointHook | None = None,
    ) -> None:
        self.group = group
        if hook is not None:
            self.hook = hook
        if dist.is_available() and dist.is_initialized():
            self.num_processes, self.rank = dist.get_world_size(group), dist.get_rank(group)
        elif group is None:  # no torch.distributed: a world of this one process (virtual workers only)
            self.num_processes, self.rank = 1, 0
        else:
            raise ValueError("a process group was given but torch.distributed is not initialized")
        if self.rank < 0:
            raise ValueError("this process is not a member of the given process group")
        if virtual_workers < 1:
            raise ValueError(f"virtual_workers must be >= 1, got {virtual_workers}")
        self.virtual_workers = virtual_workers
        self.world_size = self.num_processes * virtual_workers  # workers taking part
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
        self.kernels = get_kernels(self.device, self.packer, kernels)
        self.fuse_worker_pass = fuse_worker_pass
        self.traffic = counter or TrafficCounter()
        self.sign_scale = SignScale(sign_scale)
        self.scale_dtype = ScaleDtype(scale_dtype)
        self.wire_dtype = torch.bfloat16 if self.scale_dtype is ScaleDtype.bfloat16 else None
        self._wire_buffers: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}  # `_wire_buffer`
        self.layout = layout or ScaleLayout.single_scale(numel, self.world_size)
        if (self.layout.numel, self.layout.world_size) != (numel, self.world_size):
            raise ValueError(
                f"{self.layout!r} does not fit a buffer of {numel} elements over {self.world_size} workers"
            )
        self._call_traffic = compressed_call_traffic(
            numel,
            self.world_size,
            self.collective_mode is CollectiveMode.ALL_GATHER,
            segments=self.layout.total_chunk_segments,
            scale_bytes=self.scale_dtype.bytes,
        )

        # Persistent state. Empty for n == 1: the identity call has no error feedback.
        compressing = self.world_size > 1
        k = virtual_workers
        worker_shape = (numel,) if k == 1 else (k, numel)
        server_shape = (self.chunk_numel,) if k == 1 else (k, self.chunk_numel)
        self.worker_error = torch.zeros(worker_shape if compressing else (0,), device=self.device)
        self.server_error = torch.zeros(server_shape if compressing else (0,), device=self.device)
        self._pipeline: PipelinedExchange | None = None
        if compressing:
            self._prepare()
            pipelined = k == 1 and self.num_processes > 1 and self.collective_mode is CollectiveMode.NATIVE
            pieces = pieces_for(self, pipeline)  # validates `pipeline` in every case
            if pipelined and pieces > 1:
                self._pipeline = PipelinedExchange(self, pieces)

    @property
    def pieces(self) -> int:
        """Pieces a call's signs travel in (1: not pipelined)."""
        return len(self._pipeline.pieces) if self._pipeline is not None else 1

    # ------------------------------------------------------------------------------- set-up

    def _prepare(self) -> None:
        """Plans and send/receive buffers reused by every call (their sizes never change). The pipeline
        (:mod:`pretrain.comm.pipeline`) runs a call over the same ones: those it reads are public
        attributes (``worker_plan``, ``chunk_plans``, ``worker_errors``, ``recv_signs``, …), as are the
        steps it shares (``round_scales``, ``exchange_worker_scales``, ``exchange_server_scales``); the
        rest stays private to this module."""
        k, processes, n = self.virtual_workers, self.num_processes, self.world_size
        layout, device = self.layout, self.device
        chunk_bytes = self.chunk_numel // BITS_PER_BYTE
        self.worker_errors = self.worker_error.view(k, self.numel)
        self.server_errors = self.server_error.view(k, self.chunk_numel)
        self.worker_plan = RunPlan(layout.worker_runs, self.sign_scale, device)
        self.chunk_plans = [RunPlan(runs, self.sign_scale, device) for runs in layout.chunk_runs]
        self.local_chunks = [self.rank * k + c for c in range(k)]
        segments = layout.chunk_segments
        # Phase 1. Signs: [destination process, worker, its local chunk, bytes]; for k == 1 that is
        # the packed buffer itself.
        self.worker_scales = torch.empty(k, layout.worker_segments, device=device)
        self.worker_packed = torch.empty(k, self.numel // BITS_PER_BYTE, dtype=torch.uint8, device=device)
        shape = (processes, k, k, chunk_bytes)
        if k == 1:
            self._send_signs = self.worker_packed.view(shape)
        else:
            self._send_signs = torch.empty(shape, dtype=torch.uint8, device=device)
        self.recv_signs = (
            self._send_signs if processes == 1 else torch.empty(shape, dtype=torch.uint8, device=device)
        )
        # Scales in the same order: worker w's scales of the segments of chunk q·k + c.
        index: list[int] = []
        self._send_scale_splits: list[int] = []
        for process in range(processes):
            count = 0
            for worker in range(k):
                for chunk in range(process * k, process * k + k):
                    base = worker * layout.worker_segments + layout.payload_offsets[chunk]
                    index.extend(range(base, base + segments[chunk]))
                    count += segments[chunk]
            self._send_scale_splits.append(count)
        self.send_scale_index = torch.tensor(index, dtype=torch.int64, device=device)
        self.send_scales = torch.empty(len(index), device=device)
        self.local_segments = sum(segments[chunk] for chunk in self.local_chunks)
        self._local_offsets = [sum(segments[self.rank * k : chunk]) for chunk in self.local_chunks]
        self.recv_scales = (
            self.send_scales if processes == 1 else torch.empty(n * self.local_segments, device=device)
        )
        # Server and phase 2.
        self.server_scales = torch.empty(self.local_segments, device=device)
        self.server_packed = torch.empty(k, chunk_bytes, dtype=torch.uint8, device=device)
        self.gathered_server_packed = (
            self.server_packed
            if processes == 1
            else torch.empty(processes, k, chunk_bytes, dtype=torch.uint8, device=device)
        )
        self._process_segments = [sum(segments[q * k : q * k + k]) for q in range(processes)]
        self.all_server_scales = (
            self.server_scales if processes == 1 else torch.empty(sum(segments), device=device)
        )
        self.chunk_scale_offsets = [sum(segments[:chunk]) for chunk in range(n)]
        if processes > 1:
            self._replicated_server_scales = torch.empty(processes * self.local_segments, device=device)
        if processes > 1 and self.collective_mode is CollectiveMode.ALL_GATHER:
            self._prepare_all_gather_mode()

    def _prepare_all_gather_mode(self) -> None:
        """Buffers of the fallback path, which gathers whole buffers instead of all_to_all."""
        k, processes, layout = self.virtual_workers, self.num_processes, self.layout
        self._all_packed = torch.empty(
            processes, k, self.numel // BITS_PER_BYTE, dtype=torch.uint8, device=self.device
        )
        self._all_worker_scales = torch.empty(processes, k, layout.worker_segments, device=self.device)
        mine = [
            layout.payload_offsets[chunk] + offset
            for chunk in self.local_chunks
            for offset in range(layout.chunk_segments[chunk])
        ]
        self._my_payload_index = torch.tensor(mine, dtype=torch.int64, device=self.device)
        widest = max(self._process_segments)
        self._padded_server_scales = torch.empty(widest, device=self.device)
        self._all_padded_server_scales = torch.empty(processes, widest, device=self.device)
        valid = [q * widest + i for q in range(processes) for i in range(self._process_segments[q])]
        self._valid_server_scales = torch.tensor(valid, dtype=torch.int64, device=self.device)

    # ------------------------------------------------------------------------------------ call

    @torch.no_grad()
    def __call__(
        self, buffer: torch.Tensor, out: torch.Tensor | None = None, *, source: MomentumSource | None = None
    ) -> torch.Tensor:
        """Replace ``buffer`` (1-D contiguous fp32, length ``numel``) by its compressed average.

        In place; returns ``buffer``. Afterwards it holds, on every rank bitwise alike,
        ``concat_j s_j · sign(z_j)`` (phase 2 of docs/onebit-lamb.md). During the call the buffer is used as
        scratch, so it must not be read concurrently. Collective: every rank of the group must call.

        With k > 1 virtual workers: ``buffer`` is [k, numel] (row w: worker w's values; used as
        scratch) and the average is written into ``out`` (1-D, ``numel``), which is returned.

        ``source`` (one worker per process): this rank's values are not in ``buffer`` yet but formed from
        it (:class:`~pretrain.comm.plan.MomentumSource`: the momenta, which may be views of ``buffer``;
        its pad elements are read from ``buffer``), inside the first pass where the kernels can.
        """
        local, out = self._check_call(buffer, out)
        self.traffic.record(self._call_traffic)
        if source is not None and self.virtual_workers > 1:
            raise ValueError("a value source needs one worker per process")
        if self.world_size == 1:
            if source is not None:
                source.fill(out)
            return out
        if self._pipeline is not None:
            self._pipeline(local[0], out, source)
            return out
        for worker in range(self.virtual_workers):
            self._compress_worker(worker, local[worker], source)
        self._exchange_worker_chunks()
        if self.hook is not None:  # between the all-to-all and the all-gather (test-only fault injection)
            self.hook("exchange")
        scratch = local.view(-1)
        for local_chunk in range(self.virtual_workers):
            self._serve(local_chunk, scratch)
        self._exchange_server_chunks()
        self._decode_output(out)
        return out

    def _compress_worker(self, worker: int, values: torch.Tensor, source: MomentumSource | None) -> None:
        """Worker and pack (docs/onebit-lamb.md): y = x + e_w (held in the error buffer), scales, signs,
        e_w ← y − Q(y)."""
        error, plan = self.worker_errors[worker], self.worker_plan
        fused = None
        if self.fuse_worker_pass:
            bfloat16 = self.wire_dtype is not None
            fused = self.kernels.worker_pass(
                error, values, plan, self.worker_scales[worker], source, bfloat16=bfloat16
            )
        if fused is not None:  # the same steps segment by segment, in one pass (numba_kernels.WorkerPass)
            fused.run(0, self.numel, self.worker_packed[worker], 0)
            return
        scales = self.kernels.add_scales_(error, values, plan, out=self.worker_scales[worker], source=source)
        scales = self.round_scales(scales)
        # `values` is free scratch from here on
        self.kernels.compress_(error, scales, plan, self.worker_packed[worker], scratch=values)

    def _exchange_worker_chunks(self) -> None:
        """Phase 1: chunk j's signs and worker scales go to the process serving chunk j."""
        k, processes = self.virtual_workers, self.num_processes
        if k > 1:
            per_destination = self.worker_packed.view(k, processes, k, -1).transpose(0, 1)
            self._send_signs.copy_(per_destination)
        torch.index_select(self.worker_scales.view(-1), 0, self.send_scale_index, out=self.send_scales)
        if processes == 1:
            return
        if self.collective_mode is CollectiveMode.NATIVE:
            dist.all_to_all_single(self.recv_signs.view(-1), self._send_signs.view(-1), group=self.group)
            self.exchange_worker_scales()
            return
        dist.all_gather(list(self._all_packed.unbind(0)), self.worker_packed, group=self.group)
        n, first = self.world_size, self.rank * k
        per_chunk = self._all_packed.view(processes, k, n, -1)[:, :, first : first + k]
        self.recv_signs.copy_(per_chunk)
        self._all_gather_scales(self._all_worker_scales, self.worker_scales)
        gathered = self._all_worker_scales.view(n, -1).index_select(1, self._my_payload_index)
        self.recv_scales.copy_(gathered.view(-1))

    def _serve(self, local_chunk: int, scratch: torch.Tensor) -> None:
        """Server, one chunk (docs/onebit-lamb.md): z = (1/n) Σ_i Q_i + e_s (worker order), e_s ← z − Q(z)."""
        n, chunk = self.world_size, self.local_chunks[local_chunk]
        plan, count = self.chunk_plans[chunk], self.layout.chunk_segments[chunk]
        offset = self._local_offsets[local_chunk]
        signs = self.recv_signs[:, :, local_chunk].reshape(n, -1)
        scales = self.recv_scales.view(n, self.local_segments)[:, offset : offset + count]
        server_value = self.server_errors[local_chunk]
        server = None
        if self.fuse_worker_pass:  # the same steps segment by segment, in one pass (numba_kernels.ServerPass)
            server = self.kernels.server_pass(
                server_value,
                signs.contiguous(),
                scales.contiguous(),
                plan,
                self.server_scales[offset : offset + count],
                bfloat16=self.wire_dtype is not None,
            )
        if server is not None:
            server.run(0, self.chunk_numel, self.server_packed[local_chunk], 0)
            return
        self.kernels.accumulate_(server_value, signs, scales, plan, scratch=scratch[: n * self.chunk_numel])
        server_scales = self.round_scales(
            plan.scales(server_value, out=self.server_scales[offset : offset + count])
        )
        self.kernels.compress_(
            server_value,
            server_scales,
            plan,
            self.server_packed[local_chunk],
            scratch=scratch[: self.chunk_numel],
        )

    def _exchange_server_chunks(self) -> None:
        """Phase 2: every process receives every chunk's server signs and scales."""
        processes = self.num_processes
        if processes == 1:
            return
        if self.collective_mode is CollectiveMode.NATIVE:
            all_gather_flat(
                self.gathered_server_packed.view(-1), self.server_packed.view(-1), group=self.group
            )
            self.exchange_server_scales()
            return
        gathered = list(self.gathered_server_packed.view(processes, -1).unbind(0))
        dist.all_gather(gathered, self.server_packed.view(-1), group=self.group)
        self._padded_server_scales[: self.local_segments].copy_(self.server_scales)
        self._all_gather_scales(self._all_padded_server_scales, self._padded_server_scales)
        torch.index_select(
            self._all_padded_server_scales.view(-1), 0, self._valid_server_scales, out=self.all_server_scales
        )

    def exchange_worker_scales(self) -> None:
        """Native phase 1's scales: ``send_scales`` (filled) to the processes serving their chunks."""
        self._all_to_all_scales(
            self.recv_scales,
            self.send_scales,
            [self.virtual_workers * self.local_segments] * self.num_processes,
            self._send_scale_splits,
        )

    def exchange_server_scales(self) -> None:
        """Native phase 2's scales: this process's server scales to every process."""
        self._replicated_server_scales.view(self.num_processes, -1).copy_(self.server_scales)
        self._all_to_all_scales(
            self.all_server_scales,
            self._replicated_server_scales,
            self._process_segments,
            [self.local_segments] * self.num_processes,
        )

    def _wire_buffer(self, like: torch.Tensor) -> torch.Tensor:
        """A ``scale_dtype`` buffer shaped like the fp32 scale buffer ``like``, allocated at its first use and
        reused by every later call (keyed by ``like``'s memory and shape: the scale buffers never change)."""
        key = (like.data_ptr(), tuple(like.shape))
        buffer = self._wire_buffers.get(key)
        if buffer is None:
            buffer = torch.empty(like.shape, dtype=self.wire_dtype, device=self.device)
            self._wire_buffers[key] = buffer
        return buffer

    def round_scales(self, scales: torch.Tensor) -> torch.Tensor:
        """Round ``scales`` in place to what the wire carries (``scale_dtype``); returns them."""
        if self.wire_dtype is not None:
            scales.copy_(self._wire_buffer(scales).copy_(scales))
        return scales

    def _all_to_all_scales(
        self, output: torch.Tensor, send: torch.Tensor, output_splits: list[int], input_splits: list[int]
    ) -> None:
        """``all_to_all_single`` of fp32 scale buffers, sent in ``scale_dtype`` (exact: already rounded)."""
        wire = self.wire_dtype is not None
        received = self._wire_buffer(output) if wire else output
        dist.all_to_all_single(
            received,
            self._wire_buffer(send).copy_(send) if wire else send,
            output_split_sizes=output_splits,
            input_split_sizes=input_splits,
            group=self.group,
        )
        if wire:
            output.copy_(received)

    def _all_gather_scales(self, output: torch.Tensor, send: torch.Tensor) -> None:
        """``all_gather`` of ``send`` into the rows of ``output`` (fp32), sent in ``scale_dtype``."""
        wire = self.wire_dtype is not None
        received = self._wire_buffer(output) if wire else output
        sent = self._wire_buffer(send).copy_(send) if wire else send
        dist.all_gather(list(received.unbind(0)), sent, group=self.group)
        if wire:
            output.copy_(received)

    def _decode_output(self, out: torch.Tensor) -> None:
        """Phase 2 (docs/onebit-lamb.md): every chunk decoded from its server's signs and scales."""
        signs = self.gathered_server_packed.view(self.world_size, -1)
        self.kernels.decode_chunks_(
            signs, self.all_server_scales, self.chunk_plans, self.chunk_scale_offsets, out
        )

    def _check_call(
        self, buffer: torch.Tensor, out: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.virtual_workers
        expected = (self.numel,) if k == 1 else (k, self.numel)
        if tuple(buffer.shape) != expected:
            what = f"a flat buffer of {self.numel} elements" if k == 1 else f"a [{k}, {self.numel}] buffer"
            raise ValueError(f"expected {what} (padded), got shape {tuple(buffer.shape)}")
        if buffer.dtype != torch.float32 or not buffer.is_contiguous():
            raise ValueError(f"expected a contiguous float32 buffer, got {buffer.dtype}")
        if buffer.device != self.worker_error.device:
            raise ValueError(f"buffer is on {buffer.device}, this instance on {self.worker_error.device}")
        if out is None:
            if k > 1:
                raise ValueError("with virtual workers the average goes to `out`: pass a numel-long buffer")
            out = buffer
        elif out.shape != (self.numel,) or out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous float32 buffer of {self.numel} elements")
        return buffer.view(k, self.numel), out

    # ------------------------------------------------------------------------------ checkpoint

    def _layout_key(self) -> str:
        if self.layout.single:
            return "single"
        return f"segments:{self.layout.total_chunk_segments}:{self.sign_scale.value}"

    def _identity(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "rank": self.rank,
            "numel": self.numel,
            "virtual_workers": self.virtual_workers,
            "layout": self._layout_key(),
        }

    def reset_errors(self) -> None:
        """Zero both error buffers (fresh start of error feedback)."""
        self.worker_error.zero_()
        self.server_error.zero_()

    def state_dict(self) -> dict[str, Any]:
        """This rank's error state. The tensors are the live buffers, not copies (clone to keep)."""
        return {**self._identity(), "worker_error": self.worker_error, "server_error": self.server_error}

    def load_state_dict(self, state_dict: dict[str, Any], *, reset_on_mismatch: bool = False) -> bool:
        """Restore errors saved by :meth:`state_dict` on the same rank of a same-size group.

        Returns True when restored. On a world size, rank, length, virtual-worker or layout mismatch:
        raises :class:`ErrorStateMismatch` (a ``ValueError``), or, with ``reset_on_mismatch=True``,
        zeroes the errors, logs a warning and returns False. Errors are per-rank shards of a global
        state and cannot be re-split for another world size.
        """
        expected = self._identity()
        defaults = {"virtual_workers": 1, "layout": "single"}  # states saved before these existed
        found = {key: state_dict.get(key, defaults.get(key)) for key in expected}
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
