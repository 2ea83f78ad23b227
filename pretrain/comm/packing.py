"""1-bit sign packing: 8 signs per byte, most-significant bit first (docs/onebit-lamb.md).

Bit layout: element ``8k + j`` of the flat input becomes bit ``7 − j`` of byte ``k``, the same layout
as ``numpy.packbits``/``cupy.packbits`` with the default ``bitorder="big"``.

Sign convention: a bit is 1 where ``x >= 0`` and 0 elsewhere. Hence +0.0 **and −0.0** pack to 1
(decoded as +1), matching DeepSpeed's NCCL/cupy path (its XPU kernel uses ``signbit`` and differs on
−0.0 only). **NaN packs to 0** (decoded as −1) because every comparison with NaN is false; a NaN input
makes the compressed allreduce's scale NaN anyway, so callers must skip non-finite steps before
communicating (docs/pretraining.md, "Optimizers") rather than rely on the sign of a NaN.

Two packers give identical bytes: the pure-torch one (CPU and CUDA) and, on CUDA when cupy imports, a
cupy one. ``get_packer(device)`` is the only place that chooses between them. Packer objects keep
scratch buffers between calls (fresh multi-hundred-MB CPU allocations cost more in page faults than
the arithmetic), so use one packer per thread.
"""

from __future__ import annotations

import abc
import functools

import torch

BITS_PER_BYTE = 8


def _check_pack_input(values: torch.Tensor) -> None:
    if values.numel() % BITS_PER_BYTE != 0:
        raise ValueError(f"pack_signs needs a multiple of 8 elements, got {values.numel()}")
    if not values.is_floating_point():
        raise ValueError(f"pack_signs expects a floating-point tensor, got {values.dtype}")


def _check_packed(packed: torch.Tensor) -> None:
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack expects uint8 packed signs, got {packed.dtype}")


def _output(out: torch.Tensor | None, dtype: torch.dtype, numel: int, device: torch.device) -> torch.Tensor:
    """``out`` checked (contiguous, ``numel`` elements of ``dtype``) and flattened, or a new tensor."""
    if out is None:
        return torch.empty(numel, dtype=dtype, device=device)
    if out.dtype != dtype or out.numel() != numel or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {dtype} tensor of {numel} elements, "
            f"got {out.dtype} with {out.numel()} elements"
        )
    return out.view(numel)


class _Workspace:
    """Scratch tensors that grow to the largest size requested and are then reused."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype or buffer.device != device:
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[name] = buffer
        return buffer[:numel]


def _scratch(workspace: _Workspace | None, name: str, numel: int, dtype, device) -> torch.Tensor:
    if workspace is None:
        return torch.empty(numel, dtype=dtype, device=device)
    return workspace.get(name, numel, dtype, device)


def _pack(values: torch.Tensor, out: torch.Tensor | None, workspace: _Workspace | None) -> torch.Tensor:
    _check_pack_input(values)
    num_bytes = values.numel() // BITS_PER_BYTE
    packed = _output(out, torch.uint8, num_bytes, values.device)
    mask = _scratch(workspace, "mask", values.numel(), torch.bool, values.device)
    torch.ge(values.reshape(-1), 0, out=mask)
    # bool -> uint8 is a free reinterpretation (both one byte, True == 1); rows of 8 signs.
    bits = mask.view(torch.uint8).view(num_bytes, BITS_PER_BYTE)
    shifted = _scratch(workspace, "shifted", num_bytes, torch.uint8, values.device)
    # Eight strided shift-or passes: portable (no endianness or integer-overflow tricks) and ~5x
    # faster on CPU than a multiply-and-sum over the (M, 8) block.
    torch.bitwise_left_shift(bits[:, 0], 7, out=packed)
    for position in range(1, BITS_PER_BYTE):
        torch.bitwise_left_shift(bits[:, position], 7 - position, out=shifted)
        packed.bitwise_or_(shifted)
    return packed


@functools.cache
def sign_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(256, 8) table: row b holds the ±1 values that byte b decodes to, MSB first."""
    byte_values = torch.arange(256, dtype=torch.int32, device=device).unsqueeze(1)
    shifts = torch.arange(7, -1, -1, dtype=torch.int32, device=device)
    bits = (byte_values >> shifts) & 1
    return (bits * 2 - 1).to(dtype)


def _unpack_scaled(
    packed: torch.Tensor,
    row_scales: torch.Tensor | None,
    dtype: torch.dtype,
    out: torch.Tensor | None,
    workspace: _Workspace | None,
) -> torch.Tensor:
    """Decode ``packed`` (rows of bytes) to ±1, times ``row_scales[row]`` when given, in one gather."""
    _check_packed(packed)
    num_bytes = packed.numel()
    result = _output(out, dtype, num_bytes * BITS_PER_BYTE, packed.device)
    table = sign_table(dtype, packed.device)
    # index_select takes int32 indices (half the memory of int64).
    indices = _scratch(workspace, "indices", num_bytes, torch.int32, packed.device)
    indices.copy_(packed.reshape(-1))
    if row_scales is not None:
        # One scaled copy of the table per row, and row r's bytes index into copy r. scale · (±1) is
        # exact, so this equals unpack-then-multiply bit for bit while saving a pass over the output.
        num_rows = row_scales.numel()
        table = (row_scales.reshape(num_rows, 1, 1).to(dtype) * table).view(num_rows * 256, BITS_PER_BYTE)
        row_offsets = torch.arange(num_rows, dtype=torch.int32, device=packed.device) * 256
        indices.view(num_rows, -1).add_(row_offsets.unsqueeze(1))
    # One gather from a 256-row table is ~4x faster on CPU than shifting and converting per bit.
    torch.index_select(table, 0, indices, out=result.view(num_bytes, BITS_PER_BYTE))
    return result


def pack_signs(values: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack the signs of ``values`` (any shape, floating point, numel % 8 == 0) into uint8.

    Returns a 1-D uint8 tensor of ``numel // 8`` bytes on ``values.device``: ``out`` when given
    (contiguous uint8 of that length), a new tensor otherwise. ``values >= 0`` (including −0.0)
    gives bit 1, negatives and NaN give bit 0; MSB first.
    """
    return _pack(values, out, workspace=None)


def unpack_signs(
    packed: torch.Tensor, dtype: torch.dtype = torch.float32, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Decode a uint8 tensor of packed signs into ``8 * packed.numel()`` values of ±1.

    Returns a 1-D tensor of ``dtype`` on ``packed.device`` (bit 1 -> +1, bit 0 -> −1): ``out`` when
    given (contiguous, ``8 * packed.numel()`` elements of ``dtype``), a new tensor otherwise.
    """
    return _unpack_scaled(packed, None, dtype, out, workspace=None)


class SignPacker(abc.ABC):
    """What the compressed allreduce needs from a packer; every implementation gives identical bytes."""

    name: str

    @abc.abstractmethod
    def pack(self, values: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Same contract as :func:`pack_signs`."""

    @abc.abstractmethod
    def unpack(
        self, packed: torch.Tensor, dtype: torch.dtype = torch.float32, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Same contract as :func:`unpack_signs`."""

    def unpack_scaled(
        self, packed: torch.Tensor, row_scales: torch.Tensor, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Decode ``packed`` of shape (rows, bytes) into fp32 ``row_scales[row] · (±1)``, flattened.

        ``row_scales``: fp32, one per row. Bitwise equal to ``unpack`` followed by a multiply.
        """
        result = self.unpack(packed, torch.float32, out=out)
        result.view(row_scales.numel(), -1).mul_(row_scales.reshape(-1, 1))
        return result


class TorchSignPacker(SignPacker):
    """Pure-torch packer; works on every device. Reuses its scratch buffers across calls."""

    name = "torch"

    def __init__(self) -> None:
        self._workspace = _Workspace()

    def pack(self, values: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        return _pack(values, out, self._workspace)

    def unpack(
        self, packed: torch.Tensor, dtype: torch.dtype = torch.float32, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return _unpack_scaled(packed, None, dtype, out, self._workspace)

    def unpack_scaled(
        self, packed: torch.Tensor, row_scales: torch.Tensor, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return _unpack_scaled(packed, row_scales, torch.float32, out, self._workspace)


class CupySignPacker(SignPacker):
    """cupy ``packbits``/``unpackbits`` over DLPack, for CUDA tensors only.

    The cupy kernels run on torch's current CUDA stream, so no extra synchronization is needed and
    the tensors handed back are ordered like any other torch op on that stream.
    """

    name = "cupy"

    def __init__(self, cupy_module) -> None:
        self._cupy = cupy_module

    def _on_torch_stream(self):
        return self._cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)

    def pack(self, values: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        _check_pack_input(values)
        if not values.is_cuda:
            raise ValueError("the cupy packer only handles CUDA tensors")
        result = _output(out, torch.uint8, values.numel() // BITS_PER_BYTE, values.device)
        mask = (values.reshape(-1) >= 0).contiguous()
        with self._on_torch_stream():
            packed = torch.from_dlpack(self._cupy.packbits(self._cupy.from_dlpack(mask)))
        return result.copy_(packed)

    def unpack(
        self, packed: torch.Tensor, dtype: torch.dtype = torch.float32, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        _check_packed(packed)
        if not packed.is_cuda:
            raise ValueError("the cupy packer only handles CUDA tensors")
        result = _output(out, dtype, packed.numel() * BITS_PER_BYTE, packed.device)
        with self._on_torch_stream():
            bits = self._cupy.unpackbits(self._cupy.from_dlpack(packed.reshape(-1).contiguous()))
        # ±1 from {0, 1}: 2b − 1, written straight into the result.
        return torch.mul(torch.from_dlpack(bits), 2, out=result).sub_(1)


def _import_cupy():
    """cupy or None. Imported lazily: module import must work on machines without CUDA or cupy."""
    try:
        import cupy
    except Exception:  # ImportError, or a CUDA driver/runtime mismatch raised at import time
        return None
    return cupy


def get_packer(device: torch.device | str, prefer_cupy: bool = True) -> SignPacker:
    """The one place that picks a packer: cupy for CUDA devices when it imports, torch otherwise.

    Both produce identical bytes, so the choice never changes results, only speed. Returns a new
    packer (with its own scratch buffers) on every call.
    """
    if torch.device(device).type == "cuda" and prefer_cupy:
        cupy_module = _import_cupy()
        if cupy_module is not None:
            return CupySignPacker(cupy_module)
    return TorchSignPacker()
