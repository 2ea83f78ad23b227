"""Sign packing (spec §2 step 2, §8.1), the padding rule (§8.2) and the traffic formula (§8.6)."""

from __future__ import annotations

import math

import pytest
import torch

from pretrain.comm import (
    TrafficCounter,
    compressed_call_traffic,
    get_packer,
    pack_signs,
    padded_numel,
    unpack_signs,
)
from pretrain.comm.packing import CupySignPacker, SignPacker, TorchSignPacker


class UnfusedPacker(SignPacker):
    """The base class's unpack-then-multiply ``unpack_scaled`` (what the cupy packer uses)."""

    name = "unfused"

    def pack(self, values, *, out=None):
        return pack_signs(values, out=out)

    def unpack(self, packed, dtype=torch.float32, *, out=None):
        return unpack_signs(packed, dtype, out=out)


def test_spec_pack_vector_is_0xb9():
    values = torch.tensor([1.0, -2.0, 0.0, -0.0, 3.0, -1.0, -1.0, 5.0])
    packed = pack_signs(values)
    assert packed.dtype == torch.uint8
    assert packed.tolist() == [0b10111001] == [0xB9]
    assert unpack_signs(packed).tolist() == [1.0, -1.0, 1.0, 1.0, 1.0, -1.0, -1.0, 1.0]


def test_bit_order_is_msb_first():
    # Element 8k + j -> bit 7 − j of byte k: a single non-negative value at position j.
    for position in range(8):
        values = -torch.ones(16)
        values[8 + position] = 2.0
        assert pack_signs(values).tolist() == [0, 1 << (7 - position)]


def test_zero_and_negative_zero_pack_as_plus_nan_as_minus():
    values = torch.tensor([0.0, -0.0, float("nan"), -1e-30, 1e-30, float("inf"), -float("inf"), -0.0])
    assert unpack_signs(pack_signs(values)).tolist() == [1, 1, -1, -1, 1, 1, -1, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_round_trip_matches_sign_rule(dtype):
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(8 * 1001, generator=generator).to(dtype)
    values[::7] = 0.0
    values[3::11] = -0.0
    expected = torch.where(values >= 0, 1.0, -1.0)
    packed = pack_signs(values)
    assert packed.shape == (1001,)
    assert torch.equal(unpack_signs(packed), expected)
    assert unpack_signs(packed, dtype=dtype).dtype == dtype
    # Multi-dimensional input packs in flattened (row-major) order.
    assert torch.equal(pack_signs(values.view(13, 616)), packed)


def test_round_trip_of_every_byte():
    all_bytes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(pack_signs(unpack_signs(all_bytes)), all_bytes)


def test_out_arguments_are_filled_in_place():
    values = torch.randn(64)
    packed_out = torch.empty(8, dtype=torch.uint8)
    assert pack_signs(values, out=packed_out).data_ptr() == packed_out.data_ptr()
    assert torch.equal(packed_out, pack_signs(values))
    signs_out = torch.empty(64)
    assert unpack_signs(packed_out, out=signs_out).data_ptr() == signs_out.data_ptr()
    assert torch.equal(signs_out, torch.where(values >= 0, 1.0, -1.0))


def test_fused_scaled_unpack_is_bitwise_unpack_times_scale():
    generator = torch.Generator().manual_seed(2)
    packed = torch.randint(0, 256, (4, 96), generator=generator, dtype=torch.uint8)
    scales = torch.rand(4, generator=generator) * 3
    fused = TorchSignPacker().unpack_scaled(packed, scales)
    expected = (unpack_signs(packed).view(4, -1) * scales.unsqueeze(1)).view(-1)
    assert torch.equal(fused, expected)
    assert torch.equal(UnfusedPacker().unpack_scaled(packed, scales), expected)


def test_packer_workspace_is_reused_across_sizes():
    packer = TorchSignPacker()
    generator = torch.Generator().manual_seed(3)
    # Large, then small, then large again: the scratch grows once and is sliced afterwards.
    for numel in (8 * 1000, 8 * 10, 8 * 1000, 8 * 2000):
        values = torch.randn(numel, generator=generator)
        packed = packer.pack(values)
        assert torch.equal(packed, pack_signs(values))
        assert torch.equal(packer.unpack(packed), unpack_signs(packed))
        assert torch.equal(
            packer.unpack_scaled(packed.view(1, -1), torch.tensor([0.5])), 0.5 * unpack_signs(packed)
        )


def test_invalid_inputs_raise():
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_signs(torch.ones(12))
    with pytest.raises(ValueError, match="floating"):
        pack_signs(torch.ones(8, dtype=torch.int32))
    with pytest.raises(ValueError, match="uint8"):
        unpack_signs(torch.ones(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="out must be"):
        unpack_signs(torch.zeros(2, dtype=torch.uint8), out=torch.empty(15))


def test_cpu_gets_the_torch_packer():
    assert isinstance(get_packer("cpu"), TorchSignPacker)


def _cuda_sign_test_values() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    values = torch.randn(8 * 4099, generator=generator)
    values[::5] = 0.0
    values[1::9] = -0.0
    return values


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_torch_packer_on_cuda_matches_cpu():
    values = _cuda_sign_test_values()
    packed = pack_signs(values.cuda())
    assert packed.is_cuda
    assert torch.equal(packed.cpu(), pack_signs(values))
    assert torch.equal(unpack_signs(packed).cpu(), unpack_signs(packed.cpu()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cupy_packer_gives_identical_bytes_on_cuda():
    pytest.importorskip("cupy", reason="cupy is optional on GPU machines: pip install '.[gpu]'")
    packer = get_packer("cuda")
    assert isinstance(packer, CupySignPacker)
    values = _cuda_sign_test_values()
    packed = packer.pack(values.cuda())
    assert packed.is_cuda
    assert torch.equal(packed.cpu(), pack_signs(values))
    assert torch.equal(packer.unpack(packed).cpu(), unpack_signs(packed.cpu()))
    out = torch.empty(values.numel(), device="cuda")
    assert packer.unpack(packed, out=out).data_ptr() == out.data_ptr()


# §8.2: pad length for numel 1000.
@pytest.mark.parametrize(
    ("world_size", "expected"),
    [(1, 1000), (2, 1008), (3, 1008), (4, 1024), (16, 1024), (64, 4096), (256, 65536)],
)
def test_spec_padding_table(world_size, expected):
    assert padded_numel(1000, world_size) == expected


def test_padding_is_smallest_multiple():
    for world_size in (1, 2, 3, 5, 8, 12):
        multiple = world_size * math.lcm(world_size, 8)
        for numel in (0, 1, multiple - 1, multiple, multiple + 1):
            padded = padded_numel(numel, world_size)
            assert padded % multiple == 0 and 0 <= padded - numel < multiple
    with pytest.raises(ValueError):
        padded_numel(-1, 2)


# §8.6: per-element bytes and the 16x ratio.
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_spec_traffic_ratio(world_size):
    numel = padded_numel(336_000_000, world_size)
    call = compressed_call_traffic(numel, world_size)
    # Packed signs: exactly (n − 1)/(4n) bytes per element; fp16 ring: 4(n − 1)/n.
    assert call.sign_bytes / numel == pytest.approx((world_size - 1) / (4 * world_size), rel=1e-12)
    assert call.fp16_ring_bytes / numel == pytest.approx(4 * (world_size - 1) / world_size, rel=1e-12)
    assert call.fp32_ring_bytes / numel == pytest.approx(8 * (world_size - 1) / world_size, rel=1e-12)
    assert call.fp16_ring_bytes / call.sign_bytes == pytest.approx(16.0, rel=1e-12)
    assert call.fp32_ring_bytes / call.sign_bytes == pytest.approx(32.0, rel=1e-12)
    # The O(n) scalar terms (two fp32 scale all_gathers, 8(n − 1) bytes) only lower the ratio to
    # 16 / (1 + 32n/N): below 16, above the 15.9 target for a BERT-size buffer.
    assert call.scale_bytes == 8 * (world_size - 1)
    ratio = call.fp16_ring_bytes / call.compressed_bytes
    assert ratio == pytest.approx(16 / (1 + 32 * world_size / numel), rel=1e-12)
    assert 15.9 <= ratio < 16.0


def test_spec_traffic_n8_bytes_per_element():
    call = compressed_call_traffic(padded_numel(10**6, 8), 8)
    assert call.sign_bytes / call.numel == 0.21875
    assert call.fp16_ring_bytes / call.numel == 3.5


def test_traffic_of_the_all_gather_fallback_and_of_one_rank():
    numel = 1024
    fallback = compressed_call_traffic(numel, 4, all_to_all_via_all_gather=True)
    # Phase 1 gathers whole packed buffers: (n − 1)·N/8; phase 2 unchanged: (n − 1)/n·N/8.
    assert fallback.sign_bytes == 3 * 128 + 3 / 4 * 128
    single = compressed_call_traffic(numel, 1)
    assert single.compressed_bytes == single.fp16_ring_bytes == single.fp32_ring_bytes == 0


def test_counter_totals_and_last_call():
    counter = TrafficCounter()
    assert counter.ratio_vs_fp16 is None
    first, second = compressed_call_traffic(1024, 2), compressed_call_traffic(2048, 2)
    counter.record(first)
    counter.record(second)
    assert counter.num_calls == 2 and counter.numel == 3072
    assert counter.compressed_bytes == first.compressed_bytes + second.compressed_bytes
    assert counter.last_call == second
    metrics = counter.as_dict()
    assert metrics["fp16_ring_bytes"] == 2 * 3072  # 4(n − 1)/n = 2 bytes per element at n = 2
    assert metrics["last_call_numel"] == 2048
    assert metrics["ratio_vs_fp32"] == pytest.approx(2 * metrics["ratio_vs_fp16"])
    counter.reset()
    assert counter.num_calls == 0 and counter.last_call is None
