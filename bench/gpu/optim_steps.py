"""Check 3, `optim`: the optimizers' steps over BERT-Large's parameters against fused AdamW."""

from __future__ import annotations

import time
from typing import Any

import torch

from bench.gpu.common import Context, free_memory, interleaved, sync
from bench.records import Record

# ---------------------------------------------------------------------------------------- 3. optim


def _param_holder(ctx: Context) -> torch.nn.Module:
    from transformers import BertConfig

    from bench.optim import bert_parameters

    if ctx.smoke:
        config = BertConfig(
            vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256
        )
        return bert_parameters(False, config).to(ctx.device)
    return bert_parameters(True).to(ctx.device)


def check_optim(ctx: Context) -> list[Record]:
    from bench.optim import PEER_ADAMW, Contenders

    holder = _param_holder(ctx)
    numel = sum(p.numel() for p in holder.parameters())
    contenders = Contenders(holder)
    names = ("adamw", "lamb", "compiled", "onebit_default", "onebit_compiled")
    optimizers: dict[str, Any] = {}
    compile_seconds: dict[str, float] = {}
    for name in names:
        started = time.perf_counter()
        optimizers[name] = contenders.build(name)  # the compiled ones step (and compile) once here
        sync(ctx.device)
        compile_seconds[name] = round(time.perf_counter() - started, 1)
    reps = 3 if ctx.smoke else 10
    medians = interleaved({n: optimizers[n].step for n in names}, ctx.device, warmup=2, reps=reps)
    config = ctx.config(
        shapes="BERT-Large" if not ctx.smoke else "toy",
        num_params=numel,
        dtype="float32",
        reps=reps,
        statistic="median step seconds, the five interleaved",
        build_and_first_steps_s=compile_seconds,
        onebit="the project's default exchange (conf/optim/onebit_lamb.yaml), compression stage, one process",
    )
    labels = {
        "lamb": "lamb_eager_step",
        "compiled": "lamb_compiled_step",
        "onebit_default": "onebit_lamb_compression_step",
        "onebit_compiled": "onebit_lamb_compiled_compression_step",
    }
    records = [
        Record(labels[n], medians[n], "s", PEER_ADAMW, medians["adamw"], config=config) for n in labels
    ]
    ctx.results["lamb_step_s"] = medians["compiled"]
    del optimizers, contenders, holder
    free_memory()
    return records
