"""1-bit compressed communication for the 1-bit optimizers (docs/onebit-lamb.md, "The compressed allreduce").

- :class:`CompressedAllreduce`: error-feedback 1-bit averaging of one flat fp32 buffer, in place,
  over any process group; pad the buffer with :func:`padded_numel`.
- :class:`TrafficCounter` / :class:`CallTraffic`: bytes on the wire vs fp16/fp32 ring allreduce.
- :func:`pack_signs` / :func:`unpack_signs` / :func:`get_packer`: MSB-first 1-bit sign packing.
- :mod:`pretrain.comm.reference`: the slow single-process model used by the tests (not exported).
"""

from pretrain.comm.compressed_allreduce import (
    CollectiveMode,
    CompressedAllreduce,
    ErrorStateMismatch,
    default_collective_mode,
    pad_multiple,
    padded_numel,
)
from pretrain.comm.counter import CallTraffic, TrafficCounter, compressed_call_traffic
from pretrain.comm.packing import SignPacker, get_packer, pack_signs, unpack_signs

__all__ = [
    "CallTraffic",
    "CollectiveMode",
    "CompressedAllreduce",
    "ErrorStateMismatch",
    "SignPacker",
    "TrafficCounter",
    "compressed_call_traffic",
    "default_collective_mode",
    "get_packer",
    "pack_signs",
    "pad_multiple",
    "padded_numel",
    "unpack_signs",
]
