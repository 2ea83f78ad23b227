"""The single-process reference against the spec's numbers (§8.3, §8.4) and identity (§8.5)."""

from __future__ import annotations

import math

import pytest
import torch

from pretrain.comm.reference import ReferenceCompressedAllreduce, quantize


def test_spec_n1_quantizer():
    quantized = quantize(torch.tensor([3.0, -4.0, 0, 0, 0, 0, 0, 0]))
    scale = 5 / math.sqrt(8)
    assert float(quantized.scale) == pytest.approx(1.767767, abs=1e-6)
    assert quantized.signs.tolist() == [1, -1, 1, 1, 1, 1, 1, 1]
    assert torch.allclose(quantized.value, scale * quantized.signs)
    expected_error = torch.tensor([1.232233, -2.232233] + [-1.767767] * 6)
    assert torch.allclose(quantized.error, expected_error, atol=1e-6)


def spec_two_rank_inputs() -> list[torch.Tensor]:
    """§8.4: x0 = [−7.5, −6.5, …, 7.5], x1 = [2, −2] × 8."""
    return [torch.arange(16, dtype=torch.float32) - 7.5, torch.tensor([2.0, -2.0] * 8)]


def test_spec_two_rank_vector():
    reference = ReferenceCompressedAllreduce(16, 2)
    output = reference(spec_two_rank_inputs())
    assert reference.last_worker_scales == pytest.approx([4.609772, 2.0], abs=1e-6)
    assert reference.last_server_scales == pytest.approx([2.512469, 2.512469], abs=1e-6)
    assert torch.allclose(output, torch.tensor([-2.512469] * 8 + [2.512469] * 8), atol=1e-6)
    assert torch.allclose(reference.server_errors[0], torch.tensor([1.207583, -0.792417] * 4), atol=1e-6)
    assert torch.allclose(reference.server_errors[1], torch.tensor([0.792417, -1.207583] * 4), atol=1e-6)
    assert torch.equal(reference.worker_errors[1], torch.zeros(16))

    # Same inputs again, errors carried: magnitude 3.402184, signs [−×6, +, +, −, −, +×6].
    output = reference(spec_two_rank_inputs())
    signs = [-1] * 6 + [1, 1, -1, -1] + [1] * 6
    assert torch.allclose(output, 3.402184 * torch.tensor(signs, dtype=torch.float32), atol=1e-6)


def test_single_rank_is_the_identity():
    reference = ReferenceCompressedAllreduce(16, 1)
    values = torch.randn(16)
    assert torch.equal(reference([values]), values)


def test_spec_telescoping_identity_four_ranks_200_calls():
    """Σ_t mean_i x_i(t) − Σ_t out(t) = mean_i e_w^(i)(T) + concat_r e_s^(r)(T)."""
    world_size, numel, num_calls = 4, 1024, 200
    reference = ReferenceCompressedAllreduce(numel, world_size)
    generator = torch.Generator().manual_seed(5)
    input_sum = torch.zeros(numel, dtype=torch.float64)
    output_sum = torch.zeros(numel, dtype=torch.float64)
    for _ in range(num_calls):
        inputs = [torch.randn(numel, generator=generator) for _ in range(world_size)]
        input_sum += torch.stack(inputs).double().mean(0)
        output_sum += reference(inputs).double()
    residual = torch.stack(reference.worker_errors).double().mean(0) + torch.cat(reference.server_errors)
    # Each call adds a few fp32 roundings of O(1) values; 200 calls stay well below 1e-5.
    assert torch.allclose(input_sum - output_sum, residual, rtol=0, atol=1e-5)
    # The identity is not trivially satisfied by small sums: the residual is O(1).
    assert residual.abs().max() > 0.1


def test_mismatched_inputs_raise():
    reference = ReferenceCompressedAllreduce(16, 2)
    with pytest.raises(ValueError):
        reference([torch.zeros(16)])
    with pytest.raises(ValueError):
        ReferenceCompressedAllreduce(12, 2)
