"""Check 4, `throughput`: BERT-Large's training samples/s and MFU against NVIDIA's per-GPU figure."""

from __future__ import annotations

from typing import Any

import torch

from bench.gpu.common import (
    MASKED_PER_SEQUENCE,
    MICRO_BATCH,
    NVIDIA_GLOBAL_BATCH,
    NVIDIA_GPUS,
    NVIDIA_PEAK_TFLOPS,
    NVIDIA_SAMPLES_PER_S,
    Context,
    free_memory,
    training_flops,
)
from bench.gpu.step import kernel_breakdown, measure_samples_per_s, pretraining_batch
from bench.records import Record


def check_throughput(ctx: Context) -> list[Record]:
    from pretrain.model import SIZES, ModelConfig, ModelSize, PretrainingObjective, build_model

    size = ModelSize.bert_tiny if ctx.smoke else ModelSize.bert_large
    vocab = 30522
    model = build_model(ModelConfig(size=size), vocab, ctx.device)
    model.train()
    eager = PretrainingObjective(model)
    layers, hidden, _, intermediate = SIZES[size]
    records: list[Record] = []
    seqs = (128, 512) if not ctx.smoke else (32,)
    for seq in seqs:
        micro = MICRO_BATCH.get(seq, 4) if not ctx.smoke else 4
        masked = MASKED_PER_SEQUENCE.get(seq, max(1, seq * 15 // 100))
        batch = pretraining_batch(micro, seq, masked, vocab, ctx.device)
        flops = training_flops(seq, masked, layers, hidden, intermediate, vocab)
        # one static graph per sequence length (dynamic=False): a second length would otherwise recompile
        # with dynamic shapes, slower kernels than either length gets alone
        torch._dynamo.reset()  # a fresh cache per compile: past its recompile limit Dynamo runs eager
        compiled = torch.compile(eager, dynamic=False)
        for mode, objective in (("eager", eager), ("compiled", compiled)):
            needs = 20 if mode == "eager" else 110
            if ctx.left() < needs and not ctx.smoke:
                ctx.fail(f"throughput: seq {seq} {mode} not run, {ctx.left():.0f} s of --budget-s left")
                continue

            reps = 2 if ctx.smoke else 10
            samples_per_s, first_s = measure_samples_per_s(ctx, model, objective, batch, reps)
            seconds = micro / samples_per_s
            ctx.results[f"seq{seq}_{mode}_samples_per_s"] = samples_per_s
            kernels: dict[str, Any] = {}
            if mode == "compiled":  # where the step goes, from 3 more steps (~1 s)
                kernels = kernel_breakdown(ctx, f"seq {seq} compiled", objective, batch, seconds)
                model.zero_grad(set_to_none=True)
            config = ctx.config(
                model=size.value,
                seq=seq,
                micro_batch=micro,
                masked_per_sequence=masked,
                precision="bf16 autocast",
                attention="sdpa",
                mode=mode,
                first_step_s=round(first_s, 1),
                reps=reps,
                flops_per_sequence=flops,
                flops_formula="bench.gpu.training_flops",
                peak_tflops=ctx.peak,
                **kernels,
            )
            nvidia = NVIDIA_SAMPLES_PER_S.get(seq)
            scaled = nvidia * ctx.peak / NVIDIA_PEAK_TFLOPS if (nvidia and ctx.peak) else None
            peer = (
                f"NVIDIA DLE A100-80GB {nvidia:g} samples/s x peak {ctx.peak:g}/{NVIDIA_PEAK_TFLOPS:g}"
                if scaled
                else None
            )
            name = f"bert_large_seq{seq}_{mode}" if not ctx.smoke else f"toy_seq{seq}_{mode}"
            records.append(
                Record(
                    f"{name}_samples_per_s", samples_per_s, "samples/s", peer, scaled, ">= 1.0", config=config
                )
            )
            if ctx.peak:
                mfu = samples_per_s * flops / (ctx.peak * 1e12)
                nvidia_mfu = nvidia * flops / (NVIDIA_PEAK_TFLOPS * 1e12) if nvidia else None
                records.append(
                    Record(
                        f"{name}_mfu",
                        mfu,
                        "fraction of peak",
                        "NVIDIA DLE MFU on A100 (same formula)",
                        nvidia_mfu,
                        ">= 1.0",
                        config=config,
                    )
                )
            lamb = ctx.results.get("lamb_step_s")
            if lamb and seq in NVIDIA_GLOBAL_BATCH:
                accumulation = NVIDIA_GLOBAL_BATCH[seq] // (NVIDIA_GPUS * micro)
                with_step = accumulation * micro / (accumulation * seconds + lamb)
                step_config = {**config, "accumulation": accumulation, "lamb_compiled_step_s": lamb}
                records.append(
                    Record(
                        f"{name}_samples_per_s_with_lamb_step",
                        with_step,
                        "samples/s",
                        peer,
                        scaled,
                        ">= 1.0",
                        config=step_config,
                    )
                )
    del model, eager
    free_memory()
    return records
