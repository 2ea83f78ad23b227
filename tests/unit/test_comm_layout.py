"""Scale layouts (pretrain/comm/layout.py) and the segment-scaled reference model."""

from __future__ import annotations

import pytest
import torch

from pretrain.comm import padded_numel
from pretrain.comm.counter import compressed_call_traffic
from pretrain.comm.layout import Block, Run, ScaleLayout
from pretrain.comm.reference import ReferenceCompressedAllreduce, quantize


def test_blocks_are_cut_at_chunk_boundaries():
    # 5 rows of 4 (an "embedding"), a 10-element tensor across the boundary, an 18-element tensor
    layout = ScaleLayout.from_blocks([Block(20, 4), Block(10, 10), Block(18, 18)], 48, 2)
    assert layout.chunk_runs == [[Run(0, 5, 4), Run(20, 1, 4)], [Run(0, 1, 6), Run(6, 1, 18)]]
    assert layout.chunk_segments == [6, 2]
    assert layout.payload_offsets == [0, 6]
    assert layout.worker_runs == [Run(0, 5, 4), Run(20, 1, 4), Run(24, 1, 6), Run(30, 1, 18)]
    assert layout.segments(1) == [(24, 6), (30, 18)]


def test_a_row_split_by_a_chunk_boundary_becomes_two_segments():
    layout = ScaleLayout.from_blocks([Block(12, 3), Block(4, 4)], 16, 2)
    assert layout.chunk_runs == [[Run(0, 2, 3), Run(6, 1, 2)], [Run(0, 1, 1), Run(1, 1, 3), Run(4, 1, 4)]]
    assert layout.segments(0) + layout.segments(1) == [(0, 3), (3, 3), (6, 2), (8, 1), (9, 3), (12, 4)]


def test_single_scale_layout_is_deepspeeds():
    layout = ScaleLayout.single_scale(64, 4)
    assert layout.single and layout.worker_runs == [Run(0, 1, 64)]
    assert layout.chunk_segments == [1] * 4 and layout.payload_offsets == [0] * 4
    assert layout.total_chunk_segments == 4


@pytest.mark.parametrize(
    ("blocks", "message"),
    [
        ([Block(40, 4)], "cover 40 of 48"),
        ([Block(48, 48), Block(8, 8)], "cover 56 of 48"),
    ],
)
def test_layout_rejects_blocks_that_do_not_tile(blocks, message):
    with pytest.raises(ValueError, match=message):
        ScaleLayout.from_blocks(blocks, 48, 2)


def test_block_rows_must_divide_it():
    with pytest.raises(ValueError, match="rows of 7"):
        Block(20, 7)


def test_segment_traffic_counts_scales_per_segment():
    """DeepSpeed's layout: 8 (n − 1) scale bytes per call; S segments: 8 (n − 1)/n · S on average."""
    single = compressed_call_traffic(1024, 4)
    assert single.scale_bytes == 8 * 3
    per_row = compressed_call_traffic(1024, 4, segments=100)
    assert per_row.scale_bytes == pytest.approx(8 * 3 / 4 * 100)
    assert per_row.sign_bytes == single.sign_bytes


def _inputs(call: int, world_size: int, numel: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(call)
    return [torch.randn(numel, generator=generator) * (rank + 1) for rank in range(world_size)]


def test_one_scale_per_element_averages_exactly():
    """Blocks of one element: Q(y) = |y|·sign(y) = y, so nothing is lost and no error is kept."""
    numel, world_size = padded_numel(40, 4), 4
    layout = ScaleLayout.from_blocks([Block(numel, 1)], numel, world_size)
    reference = ReferenceCompressedAllreduce(numel, world_size, layout)
    for call in range(3):
        inputs = _inputs(call, world_size, numel)
        total = inputs[0]
        for value in inputs[1:]:
            total = total + value
        assert torch.equal(reference(inputs), total / world_size)
    assert all(not error.any() for error in reference.worker_errors + reference.server_errors)


@pytest.mark.parametrize("sign_scale", ["rms", "mean_abs"])
def test_segmented_reference_telescopes(sign_scale: str):
    """Spec §2's identity holds for any layout: Σ_t mean_i x_i − Σ_t out = mean_i e_w + concat e_s."""
    world_size = 3
    numel = padded_numel(300, world_size)
    blocks = [Block(240, 16), Block(30, 30), Block(numel - 270, numel - 270)]
    layout = ScaleLayout.from_blocks(blocks, numel, world_size)
    reference = ReferenceCompressedAllreduce(numel, world_size, layout, sign_scale)
    inputs_sum = torch.zeros(numel, dtype=torch.float64)
    outputs_sum = torch.zeros(numel, dtype=torch.float64)
    for call in range(100):
        inputs = _inputs(call, world_size, numel)
        inputs_sum += torch.stack(inputs).double().mean(0)
        outputs_sum += reference(inputs).double()
    residual = torch.stack(reference.worker_errors).double().mean(0) + torch.cat(reference.server_errors)
    assert torch.allclose(inputs_sum - outputs_sum, residual, atol=1e-4)


def test_mean_abs_scale_minimises_the_quantization_error():
    values = torch.tensor([3.0, -0.5, 0.25, -0.25, 0.1, -4.0, 0.0, 1.0])
    rms, mean_abs = quantize(values, "rms"), quantize(values, "mean_abs")
    assert float(mean_abs.scale) == pytest.approx(float(values.abs().mean()))
    assert torch.linalg.vector_norm(mean_abs.error) < torch.linalg.vector_norm(rms.error)
