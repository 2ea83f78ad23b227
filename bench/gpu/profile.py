"""Check `profile` (opt-in): where BERT-Large's seq-128 step spends its time, one change per arm."""

from __future__ import annotations

import traceback
from typing import Any

import torch

from bench.gpu.common import MASKED_PER_SEQUENCE, MICRO_BATCH, Context, error_line, free_memory
from bench.gpu.step import (
    host_syncs,
    kernel_breakdown,
    measure_samples_per_s,
    pretraining_batch,
    training_step,
)
from bench.records import Record

# check_profile's arms, by mode, in the order they run (the costliest last: a compile each, ~1 min)
PROFILE_ARMS = {
    "eager": ("baseline", "no_mask", "no_dropout", "column_major", "boolean_index"),
    "compiled": (
        "baseline",
        "layers4",
        "cuda_graphs",
        "micro128",
        "column_major",
        "no_mask",
        "coordinate_descent",
    ),
}


def check_profile(ctx: Context) -> list[Record]:
    """Where BERT-Large's seq-128 step spends its time (opt-in: `--steps=profile`), against the baseline step
    of `throughput` (compiled here only when that check did not run): arms that each change one thing.
    `no_mask` drops the all-ones attention mask (SDPA without a mask), `no_dropout` dropout,
    `column_major` stores the linear weights as 1-bit LAMB's per-column exchange does
    (`pretrain.model.column_major_linear_weights_`: what `make pretrain OPT=onebit_lamb` trains),
    `boolean_index` gathers the masked positions with a boolean index (as before the collator's static
    `mlm_positions`), `layers4` keeps 4 of the 24 layers (the GPU's idle time per layer, and the host syncs
    of one compiled step, `host_syncs`), `cuda_graphs` compiles with `mode="reduce-overhead"` (the step
    replayed as CUDA graphs: no launch gaps), `micro128` doubles the micro-batch (half the launches per
    sample), `coordinate_descent` compiles with Inductor's coordinate-descent tuning of its generated
    kernels. Eager: every arm; compiled: each only while 90 s of the budget are left. An arm that fails is
    reported and the others run. Every compiled arm's kernels by class in its config, the costliest in
    gpu_kernels.txt."""
    from pretrain.model import (
        ModelConfig,
        ModelSize,
        PretrainingObjective,
        build_model,
        column_major_linear_weights_,
    )

    size = ModelSize.bert_tiny if ctx.smoke else ModelSize.bert_large
    seq = 32 if ctx.smoke else 128
    micro = 4 if ctx.smoke else MICRO_BATCH[128]
    masked = MASKED_PER_SEQUENCE.get(seq, 5)
    reps = 2 if ctx.smoke else 10
    batch = pretraining_batch(micro, seq, masked, 30522, ctx.device)
    inputs = {
        "baseline": batch,
        "no_mask": {**batch, "attention_mask": None},
        # a data-dependent shape: a host sync on the GPU and a graph break
        "boolean_index": {k: v for k, v in batch.items() if k != "mlm_positions"},
        "micro128": pretraining_batch(2 * micro, seq, masked, 30522, ctx.device),
    }

    def model_for(arm: str) -> torch.nn.Module:
        dropout = 0.0 if arm == "no_dropout" else 0.1
        config = ModelConfig(size=size, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
        model = build_model(config, 30522, ctx.device).train()
        if arm == "column_major":
            column_major_linear_weights_(model)
        if arm == "layers4":
            model.bert.encoder.layer = model.bert.encoder.layer[:4]
        return model

    def run_arm(mode: str, label: str, config: dict[str, Any]) -> float:
        model = model_for(label)
        objective: Any = PretrainingObjective(model)
        how: dict[str, Any] = {}
        if mode == "compiled":
            torch._dynamo.reset()
            how = {  # torch.compile takes a mode or options, not both
                "cuda_graphs": {"mode": "reduce-overhead"},
                "coordinate_descent": {"options": {"coordinate_descent_tuning": True}},
            }.get(label, {})
            objective = torch.compile(objective, dynamic=False, **how)
        arm_inputs = inputs.get(label, batch)
        graphs = label == "cuda_graphs" and ctx.device.type == "cuda"
        rate, first_s = measure_samples_per_s(ctx, model, objective, arm_inputs, reps, graphs)
        config["first_step_s"] = round(first_s, 1)
        if mode == "compiled":
            sample_count = len(arm_inputs["input_ids"])
            label_of = f"seq {seq} compiled {label}"
            config.update(kernel_breakdown(ctx, label_of, objective, arm_inputs, sample_count / rate, graphs))
            if label == "layers4":
                config["host_syncs"] = host_syncs(ctx, training_step(ctx, objective, arm_inputs))
        model.zero_grad(set_to_none=True)
        return rate

    records: list[Record] = []
    for mode, labels in PROFILE_ARMS.items():
        baseline = None
        for label in labels:
            config = ctx.config(seq=seq, micro_batch=2 * micro if label == "micro128" else micro, mode=mode)
            config["variant"] = label
            reused = ctx.results.get(f"seq{seq}_{mode}_samples_per_s") if label == "baseline" else None
            if reused is not None:  # throughput's step: the same model, batch and compile
                rate = reused
                config["from"] = "throughput"
            elif ctx.left() < (15 if mode == "eager" else 90) and not ctx.smoke:
                ctx.fail(f"profile: {mode} {label} not run, {ctx.left():.0f} s of --budget-s left")
                continue
            else:
                try:
                    rate = run_arm(mode, label, config)
                except Exception as error:  # one arm's failure must not take the others' figures down
                    traceback.print_exc()
                    ctx.fail(f"profile: {mode} {label}: {error_line(error)}")
                    continue
                finally:
                    torch._dynamo.reset()
                    free_memory()
            baseline = rate if label == "baseline" else baseline
            records.append(
                Record(
                    f"profile_seq{seq}_{mode}_{label}_samples_per_s",
                    rate,
                    "samples/s",
                    f"{mode} baseline",
                    baseline,
                    config=config,
                )
            )
    return records
