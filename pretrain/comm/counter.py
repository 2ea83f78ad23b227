"""Byte accounting for the compressed allreduce, so the trainer can log the communication saving.

What is counted (docs/onebit-lamb.md): the payload bytes **this rank sends**, under the usual
ring-algorithm cost model, and nothing else (no headers, no TCP/NCCL protocol overhead, no store
traffic). Per collective, with n ranks:

- all_to_all of a buffer of B bytes per rank: the rank keeps its own chunk and sends the other
  n − 1 chunks, i.e. ``(n − 1)/n · B``.
- all_gather where each rank contributes b bytes (B = n·b gathered): a ring all_gather forwards
  n − 1 chunks, i.e. ``(n − 1) · b = (n − 1)/n · B``.
- ring allreduce of B bytes (reduce-scatter + all_gather): ``2 (n − 1)/n · B``. The peers are an
  fp16 (B = 2 bytes/element) and an fp32 (B = 4) allreduce of the same tensor:
  ``4 (n − 1)/n`` and ``8 (n − 1)/n`` bytes per element.

For one compressed call on N elements (N a multiple of 8n): two packed-sign collectives of
``(n − 1)/n · N/8`` bytes each plus the scales. With DeepSpeed's layout (one scale per worker buffer
and per server chunk, S = n segments) those are two exchanges of ``4 (n − 1)`` bytes, so
``(n − 1)/(4n) · N + 8 (n − 1)`` bytes; the ratio vs fp16 is ``16 / (1 + 32 n / N)`` -> 16 as N grows.
With S segments over all chunks (per-tensor or per-row scales, `pretrain.comm.layout`) each phase
sends ``(n − 1)/n · b S`` bytes of scales on average per rank (b = 4 for fp32 scales, 2 for
bfloat16 ones; a rank serving an embedding's rows sends more, the others less), i.e.
``2 b (n − 1)/n · S`` in all. With n == 1 nothing is sent and the
peers are zero too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

FP16_BYTES = 2
FP32_BYTES = 4


def all_to_all_bytes(bytes_per_rank: int, world_size: int) -> float:
    """Bytes one rank sends in an all_to_all of ``bytes_per_rank`` (its whole input buffer)."""
    return (world_size - 1) / world_size * bytes_per_rank


def all_gather_bytes(bytes_contributed: int, world_size: int) -> float:
    """Bytes one rank sends in a ring all_gather where every rank contributes ``bytes_contributed``."""
    return (world_size - 1) * bytes_contributed


def ring_allreduce_bytes(numel: int, bytes_per_element: int, world_size: int) -> float:
    """Bytes one rank sends in a ring allreduce of ``numel`` elements of ``bytes_per_element``."""
    return 2 * (world_size - 1) / world_size * numel * bytes_per_element


@dataclass(frozen=True)
class CallTraffic:
    """Bytes one rank sent in one compressed allreduce call, and what the peers would have sent.

    ``sign_bytes``: the two packed-sign collectives; ``scale_bytes``: the two scale exchanges;
    ``compressed_bytes`` = their sum. ``fp16_ring_bytes``/``fp32_ring_bytes``: a plain ring allreduce
    of the same ``numel`` elements in that precision.
    """

    numel: int
    world_size: int
    sign_bytes: float
    scale_bytes: float
    fp16_ring_bytes: float
    fp32_ring_bytes: float
    segments: int = 0  # scale segments over all chunks (world_size: DeepSpeed's layout)

    @property
    def compressed_bytes(self) -> float:
        return self.sign_bytes + self.scale_bytes


def compressed_call_traffic(
    numel: int,
    world_size: int,
    all_to_all_via_all_gather: bool = False,
    *,
    segments: int | None = None,
    scale_bytes: int = FP32_BYTES,
) -> CallTraffic:
    """Traffic of one call on ``numel`` (padded) elements.

    ``all_to_all_via_all_gather``: the fallback path where phase 1 all_gathers every rank's whole
    packed buffer instead of an all_to_all, sending ``(n − 1) · N/8`` instead of ``(n − 1)/n · N/8``
    (its scales are counted as on the native path). ``segments``: scales over all chunks (None: n,
    DeepSpeed's layout). ``scale_bytes``: bytes per scale (4: fp32; 2: bfloat16 scales).
    """
    if world_size == 1:
        return CallTraffic(numel, 1, 0.0, 0.0, 0.0, 0.0)
    packed_bytes = numel // 8
    chunk_bytes = packed_bytes // world_size
    if all_to_all_via_all_gather:
        phase_one = all_gather_bytes(packed_bytes, world_size)
    else:
        phase_one = all_to_all_bytes(packed_bytes, world_size)
    phase_two = all_gather_bytes(chunk_bytes, world_size)
    scales = 2 * (world_size - 1) * scale_bytes * (segments or world_size) / world_size
    return CallTraffic(
        numel=numel,
        world_size=world_size,
        sign_bytes=phase_one + phase_two,
        scale_bytes=scales,
        fp16_ring_bytes=ring_allreduce_bytes(numel, FP16_BYTES, world_size),
        fp32_ring_bytes=ring_allreduce_bytes(numel, FP32_BYTES, world_size),
        segments=segments or world_size,
    )


class TrafficCounter:
    """Running totals of :class:`CallTraffic` for one rank; ``last_call`` is the most recent call."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.num_calls = 0
        self.numel = 0
        self.compressed_bytes = 0.0
        self.fp16_ring_bytes = 0.0
        self.fp32_ring_bytes = 0.0
        self.exact_bytes = 0.0  # full-precision exchanges besides the compressed calls (`record_exact`)
        self.last_call: CallTraffic | None = None

    def record_exact(self, numel: int, bytes_per_element: int, world_size: int) -> None:
        """An exact allreduce of `numel` elements (ring cost) that a 1-bit optimizer sends on top of its
        compressed calls (1-bit LAMB's variance refresh); counted in `bytes_sent`, not in the ratios."""
        self.exact_bytes += ring_allreduce_bytes(numel, bytes_per_element, world_size)

    @property
    def bytes_sent(self) -> float:
        """Everything this rank sent: the compressed calls and the exact exchanges."""
        return self.compressed_bytes + self.exact_bytes

    def record(self, call: CallTraffic) -> None:
        self.num_calls += 1
        self.numel += call.numel
        self.compressed_bytes += call.compressed_bytes
        self.fp16_ring_bytes += call.fp16_ring_bytes
        self.fp32_ring_bytes += call.fp32_ring_bytes
        self.last_call = call

    @property
    def ratio_vs_fp16(self) -> float | None:
        """fp16 ring bytes / compressed bytes over all calls; None before anything was sent."""
        return self.fp16_ring_bytes / self.compressed_bytes if self.compressed_bytes else None

    @property
    def ratio_vs_fp32(self) -> float | None:
        return self.fp32_ring_bytes / self.compressed_bytes if self.compressed_bytes else None

    def as_dict(self) -> dict[str, float | int | None]:
        """Flat metrics for the logger: totals, per-element figures and the last call's figures."""
        metrics: dict[str, float | int | None] = {
            "num_calls": self.num_calls,
            "compressed_bytes": self.compressed_bytes,
            "fp16_ring_bytes": self.fp16_ring_bytes,
            "fp32_ring_bytes": self.fp32_ring_bytes,
            "ratio_vs_fp16": self.ratio_vs_fp16,
            "ratio_vs_fp32": self.ratio_vs_fp32,
        }
        for key in ("compressed_bytes", "fp16_ring_bytes", "fp32_ring_bytes"):
            total = metrics[key]
            metrics[f"{key}_per_element"] = total / self.numel if self.numel else None  # type: ignore[operator]
        if self.last_call is not None:
            metrics.update({f"last_call_{key}": value for key, value in asdict(self.last_call).items()})
            metrics["last_call_compressed_bytes"] = self.last_call.compressed_bytes
        return metrics
