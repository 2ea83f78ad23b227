"""Check 1, `packer`: the sign packers' bytes against each other and their speed."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from bench.gpu.common import BERT_LARGE_NUMEL, Context, interleaved
from bench.records import Record

# --------------------------------------------------------------------------------------- 1. packer


def _planted(length: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values with ±0, ±Inf, NaN and subnormals planted at random positions."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(length, generator=generator)
    specials = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-42, -1e-42])
    count = min(length, max(len(specials), length // 50))
    positions = torch.randperm(length, generator=generator)[:count]
    values[positions] = specials[torch.arange(count) % len(specials)]
    return values.to(dtype)


def packer_lengths(smoke: bool) -> list[int]:
    from pretrain.comm import padded_numel

    lengths = [8, 16, 24, 8 * 127, 8 * 128, 8 * 129, 8 * 4095, 8 * 4096, 8 * 4097]
    # buffers padded for n workers, and one pad unit beyond
    lengths += [padded_numel(1000, n) for n in (2, 8, 64)] + [padded_numel(1000, 64) + 8]
    if not smoke:
        lengths += [padded_numel(1_000_003, 64), padded_numel(1_000_003, 64) - 8]
    return lengths


def check_packer(ctx: Context) -> list[Record]:
    from pretrain.comm import padded_numel
    from pretrain.comm.packing import CupySignPacker, TorchSignPacker, _import_cupy, pack_signs, unpack_signs

    device = ctx.device
    packers: dict[str, Any] = {"torch": TorchSignPacker()}
    cupy_module = _import_cupy() if device.type == "cuda" else None
    if cupy_module is not None:
        packers["cupy"] = CupySignPacker(cupy_module)
    elif device.type == "cuda":
        ctx.fail("packer: cupy does not import on this CUDA machine (pip install '.[gpu]')")
    differing: list[str] = []
    cases = 0
    for dtype in (torch.float32, torch.bfloat16):
        for index, length in enumerate(packer_lengths(ctx.smoke)):
            values = _planted(length, dtype, seed=index)
            expected = pack_signs(values)
            expected_unpacked = unpack_signs(expected)
            rows = 8 if (length // 8) % 8 == 0 else 1
            scales = torch.rand(rows, generator=torch.Generator().manual_seed(index)) + 0.5
            expected_scaled = unpack_signs(expected).view(rows, -1).mul(scales.view(-1, 1)).view(-1)
            on_device = values.to(device)
            for name, packer in packers.items():
                cases += 1
                packed = packer.pack(on_device)
                if not torch.equal(packed.cpu(), expected):
                    differing.append(f"{name} pack {dtype} n={length}")
                if not torch.equal(packer.unpack(packed).cpu(), expected_unpacked):
                    differing.append(f"{name} unpack {dtype} n={length}")
                got = packer.unpack_scaled(packed.view(rows, -1), scales.to(device)).cpu()
                if not torch.equal(got, expected_scaled):
                    differing.append(f"{name} unpack_scaled {dtype} n={length}")
    # the BERT-Large buffer itself (padded for 64 workers), every packer against the torch one on this device
    numel = padded_numel(BERT_LARGE_NUMEL, 64) if not ctx.smoke else padded_numel(200_000, 64)
    values = torch.randn(numel, device=device)
    values[:: 1 << 16] = 0.0
    values[1 :: 1 << 16] = -0.0
    values[2 :: 1 << 16] = math.nan
    reference = packers["torch"].pack(values).clone()
    for name, packer in packers.items():
        if name != "torch" and not torch.equal(packer.pack(values), reference):
            differing.append(f"{name} pack of the full buffer ({numel})")
    if device.type == "cuda" and not torch.equal(
        reference[:4096].cpu(), pack_signs(values[: 4096 * 8].cpu())
    ):
        differing.append("torch pack on the GPU vs the CPU")
    if differing:
        ctx.fail(f"packer: bytes differ in {len(differing)} cases: {differing[:6]}")
    config = ctx.config(
        packers=sorted(packers),
        lengths=packer_lengths(ctx.smoke),
        dtypes=["float32", "bfloat16"],
        planted="±0, ±Inf, NaN, ±1e-42 (subnormal)",
        differing=differing,
        cases=cases,
    )
    records = [Record("packer_cases_differing", float(len(differing)), "cases", target="0", config=config)]

    # throughput over the BERT-Large buffer
    packed = reference
    decoded = torch.empty(numel, device=device)
    copy_target = torch.empty_like(values)
    reps = 3 if ctx.smoke else 20
    funcs: dict[str, Callable[[], Any]] = {"copy": lambda: copy_target.copy_(values)}
    for name, packer in packers.items():
        funcs[f"pack_{name}"] = lambda p=packer: p.pack(values, out=packed)
        funcs[f"unpack_{name}"] = lambda p=packer: p.unpack(packed, out=decoded)
    seconds = interleaved(funcs, device, warmup=2, reps=reps)
    moved = {"pack": 4 * numel + numel // 8, "unpack": numel // 8 + 4 * numel, "copy": 8 * numel}
    gbps = {name: moved[name.split("_")[0]] / t / 1e9 for name, t in seconds.items()}
    timing = ctx.config(numel=numel, reps=reps, statistic="median", bytes="read + written, fp32 values")
    for op in ("pack", "unpack"):
        records.append(
            Record(
                f"{op}_torch_gbps",
                gbps[f"{op}_torch"],
                "GB/s",
                "device-to-device copy",
                gbps["copy"],
                config=timing,
            )
        )
        if "cupy" in packers:
            records.append(
                Record(
                    f"{op}_cupy_gbps",
                    gbps[f"{op}_cupy"],
                    "GB/s",
                    "torch packer",
                    gbps[f"{op}_torch"],
                    config=timing,
                )
            )
    return records
