"""`python -m bench fidelity`: the CPU study's convergence figures as benchmark records.

Reads the study's comparison (`results/cpu-study/summary.json`, written by `make compare` in
`results/cpu-study/reproduce.sh`) and writes `results/bench/fidelity.json`: per 1-bit arm and number of
workers, its final MLM loss against LAMB's at the same global batch (the ratio is the figure that
counts, target ≤ 1.01 for `optim=onebit_lamb`), LAMB's final masked-LM accuracy, the whole-run volume
reduction against an fp32 allreduce, and the downstream gaps in units of the pooled seed std. Record names
carry the arm (`onebit_lamb`, `onebit_lamb_deepspeed`, or the preset and what an ablation changed: see
`results.compare.runs.onebit_lamb_identity`) and `sim` for simulated workers. Nothing is measured here:
every number comes from the committed runs, so the file is reproducible from them. The study's long arm
(`results/cpu-study-long/summary.json`, 3,000 steps), when present, adds the same records ending in `_long`,
and the seq-32 study (`results/cpu-study-s32/summary.json`, where LAMB leaves the unigram stage) in `_s32`.
The rungs beyond BERT-tiny at batch 128 (`results/cpu-study-m/`, `results/cpu-study-b/`: a larger model, a
larger batch, against LAMB and AdamW tuned per rung) add records named by model and batch, each with its
status, from whatever runs exist (`bench/fidelity_rungs.py`).

It also states each exchange's byte cost for BERT-Large (`bert_large_compression_bytes_<mode>_n<n>`):
one compression-stage call's bytes per rank from the byte counter's formulas on the real BERT-Large
layout (parameters in the optimizer's order, segment scales included), against an fp16 ring allreduce
of the same parameters; the requirement is ≥ 15.5x less (ratio ≤ 1/15.5).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from bench.fidelity_rungs import all_rung_records
from bench.records import Record, write_records

STUDY = Path(__file__).resolve().parents[1] / "results" / "cpu-study" / "summary.json"
# the study's long arm (7.5x the steps; reproduce.sh stage `long`), reported apart: records end in `_long`
LONG_STUDY = Path(__file__).resolve().parents[1] / "results" / "cpu-study-long" / "summary.json"
# the seq-32 study (reproduce.sh stage `s32`), reported apart: records end in `_s32`
S32_STUDY = Path(__file__).resolve().parents[1] / "results" / "cpu-study-s32" / "summary.json"
REMEDY_TARGET = "<= 1.01 (3-seed means, 2 real and >= 32 simulated workers)"


def _arm_name(group: dict[str, Any]) -> str:
    """e.g. `onebit_lamb_n32sim`, `onebit_lamb_deepspeed_n2`, `onebit_lamb_refresh_from_local_n2`."""
    name = group["optimizer"] + (f"_{group['variant']}" if group.get("variant") else "")
    workers = f"n{group['workers']}" + ("sim" if group.get("simulated") else "")
    return f"{name.replace('+', '_').replace('=', '_')}_{workers}"


def _is_default(group: dict[str, Any]) -> bool:
    """optim=onebit_lamb as shipped: the arm the fidelity target is for."""
    return group["optimizer"] == "onebit_lamb" and not group.get("variant")


def _suffix(group: dict[str, Any], batches: set[int]) -> str:
    return f"_b{group['global_batch']}" if len(batches) > 1 else ""


def records_from_summary(summary: dict[str, Any], tail: str = "") -> list[Record]:
    """Records of one comparison; `tail` ends every name (e.g. "_long" for the long arm)."""
    groups = {group["label"]: group for group in summary["groups"]}
    batches = {group["global_batch"] for group in summary["groups"]}
    records: list[Record] = []
    for group in summary["groups"]:
        if group["optimizer"] == summary["reference_optimizer"] and not group.get("variant"):
            accuracy = group["final_mlm_accuracy"]
            if accuracy["mean"] is not None:
                records.append(
                    Record(
                        name=f"lamb_final_mlm_accuracy_n{group['workers']}{_suffix(group, batches)}{tail}",
                        value=accuracy["mean"],
                        unit="fraction",
                        target=">= 0.25",
                        config=_config(group),
                    )
                )
    for gap in summary["gaps"]:
        group, reference = groups[gap["group"]], groups[gap["reference"]]
        name = f"{_arm_name(group)}{_suffix(group, batches)}{tail}"
        loss, peer = group["final_mlm_loss"], reference["final_mlm_loss"]
        if loss["mean"] is None or peer["mean"] is None:
            continue
        remedy = _is_default(group)
        records.append(
            Record(
                name=f"final_mlm_loss_ratio_{name}",
                value=loss["mean"],
                unit="MLM loss (final, mean over seeds)",
                peer=reference["label"],
                peer_value=peer["mean"],
                target=REMEDY_TARGET if remedy else None,
                config={
                    **_config(group),
                    "std": loss["std"],
                    "diverged_runs": group.get("diverged", 0),
                    "note": "mean over the runs that did not diverge" if group.get("diverged") else None,
                    "peer_std": peer["std"],
                    "peer_seeds": reference["seeds"],
                },
            )
        )
        volume = group["volume_reduction_vs_lamb"]
        if volume["mean"] is not None:
            records.append(
                Record(
                    name=f"volume_reduction_vs_fp32_{name}",
                    value=volume["mean"],
                    unit="x (whole run, bytes of an fp32 allreduce / bytes sent)",
                    config=_config(group),
                )
            )
        for task, result in sorted(gap["finetune"].items()):
            noise = result["pooled_std"]
            if not noise or not math.isfinite(noise):
                continue
            records.append(
                Record(
                    name=f"downstream_gap_{task}_{name}",
                    value=result["gap"] / noise,
                    unit=f"pooled seed std ({result['metric']}; gap {result['gap']:+.4f})",
                    target="|gap| <= 1 std" if remedy else None,
                    config={**_config(group), "n": result["n"], "reference_n": result["reference_n"]},
                )
            )
    return records


def _config(group: dict[str, Any]) -> dict[str, Any]:
    return {
        "arm": group["arm"],
        "optimizer": group["optimizer"],
        "variant": group.get("variant") or "",
        "workers": group["workers"],
        "simulated_workers": bool(group.get("simulated")),
        "global_batch": group["global_batch"],
        "model": group["model"],
        "seeds": group["seeds"],
        "samples": group["samples_seen"],
        "steps": [samples // group["global_batch"] for samples in group["samples_seen"]],
        "runs": group["runs"],
        "source": "results/cpu-study (results/cpu-study/reproduce.sh)",
    }


BYTE_COST_WORLD_SIZES = (8, 64, 256)
BYTE_COST_MODES = {
    "deepspeed": dict(compression="deepspeed"),  # optim=onebit_lamb_deepspeed
    "per_column": dict(compression="per_column"),
    "per_column_bfloat16": dict(compression="per_column", scale_dtype="bfloat16"),
    "per_column_exact_vectors_bfloat16": dict(  # optim=onebit_lamb's exchange
        compression="per_column", exact_vectors=True, scale_dtype="bfloat16"
    ),
}
# optim=onebit_lamb: its exchange plus the variance refresh every K = 64 steps (an fp32 allreduce of the
# decayed matrices' row and column sums), averaged over the K steps
DEFAULT_EXCHANGE = BYTE_COST_MODES["per_column_exact_vectors_bfloat16"]
REFRESH_MODES = {"default_refresh_rank1_k64": dict(every=64)}


def byte_cost_records() -> list[Record]:
    """Bytes of one compression-stage exchange of BERT-Large per mode (module docstring)."""
    import torch
    from transformers import BertForPreTraining

    from pretrain.model import ModelConfig, ModelSize, bert_config
    from pretrain.tools.preflight import compression_traffic, refresh_traffic

    with torch.device("meta"):  # shapes only; built there so the decoder stays tied to the embedding
        model = BertForPreTraining(bert_config(ModelConfig(size=ModelSize.bert_large), 30522))
    numel = sum(p.numel() for p in model.parameters())

    def record(name: str, value: float, fp16: float, unit: str, **config: Any) -> Record:
        return Record(
            name=f"bert_large_compression_bytes_{name}",
            value=value,
            unit=unit,
            peer="fp16 ring allreduce of the same parameters",
            peer_value=fp16,
            target="ratio <= 1/15.5 (>= 15.5x less than fp16)",
            config={"parameters": numel, "times_less_than_fp16": fp16 / value, **config},
        )

    records = []
    for mode, options in BYTE_COST_MODES.items():
        for world_size in BYTE_COST_WORLD_SIZES:
            call = compression_traffic(model, options, world_size, max_seq_length=128)
            records.append(
                record(
                    f"{mode}_n{world_size}", call.compressed_bytes, call.fp16_ring_bytes,
                    "bytes per rank per compression-stage step (counter formulas)", padded=call.numel,
                    scale_segments=call.segments, scale_bytes=call.scale_bytes, sign_bytes=call.sign_bytes,
                    **options,
                )
            )  # fmt: skip
    for mode, refresh in REFRESH_MODES.items():
        for world_size in BYTE_COST_WORLD_SIZES:
            call = compression_traffic(model, DEFAULT_EXCHANGE, world_size, max_seq_length=128)
            extra = refresh_traffic(model, world_size=world_size, **refresh)  # type: ignore[arg-type]
            records.append(
                record(
                    f"{mode}_n{world_size}", call.compressed_bytes + extra, call.fp16_ring_bytes,
                    "bytes per rank per compression-stage step, the refresh averaged over its K steps",
                    exchange_bytes=call.compressed_bytes, refresh_bytes_per_step=extra, **DEFAULT_EXCHANGE,
                    **refresh,
                )
            )  # fmt: skip
    return records


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench fidelity")
    parser.add_argument("--summary", type=Path, default=STUDY)
    parser.add_argument("--long-summary", type=Path, default=LONG_STUDY, help="read when it exists")
    parser.add_argument("--s32-summary", type=Path, default=S32_STUDY, help="read when it exists")
    args = parser.parse_args(argv)
    if not args.summary.is_file():
        raise SystemExit(
            f"bench fidelity: {args.summary} not found; run results/cpu-study/reproduce.sh first"
        )
    records = records_from_summary(json.loads(args.summary.read_text()))
    if not records:
        raise SystemExit(f"bench fidelity: {args.summary} has no LAMB or 1-bit groups to compare")
    for summary, tail in ((args.long_summary, "_long"), (args.s32_summary, "_s32")):
        if summary.is_file():
            records += records_from_summary(json.loads(summary.read_text()), tail=tail)
    records += all_rung_records()
    write_records("fidelity", records + byte_cost_records())
