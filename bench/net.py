"""Emulated-Ethernet benchmark: gloo ranks in network namespaces over rate-limited veth links
(launch/netns.py), so bandwidth, not the loopback, bounds communication. Needs root.

    python -m bench net              # full: about 40 min; results/bench/net.json and net_e2e.json
    python -m bench net --part=e2e --compile   # e2e with optim.compile=true: net_e2e_compiled.json
    python -m bench net --quick      # seconds: small buffer, 2 ranks; *_quick.json
    python -m bench net --part=allreduce --rates=1gbit,none --world-sizes=2   (options with `=`)

Part 1, `allreduce` (net.json): the 1-bit compressed allreduce (pretrain/comm) vs gloo's fp32 and fp16
`all_reduce` (+ division by n, i.e. a mean) of the same flat buffer, BERT-Base (110M) and BERT-Large
(336M) sized, 2 and 4 ranks, at each rate (tbf on every rank's egress; "none" = unshaped veth). Per
(size, ranks) one launch allocates one fp32 buffer per rank; the fp16 buffer is a view on half of
its storage (refilled before each fp16 call) to keep 4 x BERT-Large within memory. The three operations
alternate in every repeat; the reported time is the median over repeats of the slowest rank. Bytes per
operation and rank come from three sources: the in-process model (`pretrain.comm` byte counter for the
compressed call, the ring formula 2(n-1)/n x bytes for the plain ones), the interface's tx_bytes and
the tbf qdisc's "Sent" bytes (`tc -s qdisc`, which counts every segment's headers). Records: compressed
seconds vs fp32 (target ratio <= 1/20 at 1 Gbit/s for BERT-Large) and vs fp16, per rate; bytes on the
wire compressed vs fp32; the single-thread memory bandwidth (calibrates the scaling model's compression
cost). Where memory allows, also the exchange `optim=onebit_lamb` runs (its layout for the size's model:
per-column and per-row scales, exact vectors, bfloat16 scales, mean |y|) with both compressions fused and
sent stretch by stretch, against fp32 (target at 1 Gbit/s for BERT-Large: >= 10x, stretch 20x) and against
the same call with its passes separate (`compressed_default_vs_separate_passes`: ratio < 1). A (size,
ranks) pair that would not fit in the available memory is skipped and says so.

Part 2, `e2e` (net_e2e.json): training samples/s of BERT-Base at seq 128 with a small micro batch at
1 Gbit/s, 2 and 4 ranks: LAMB (fp32 gradient allreduce overlapped with backward) vs 1-bit LAMB in its
compression stage (freeze_step=1, measured after it) vs the no-communication bound (LAMB with the
gradient allreduce skipped: `GradientSync.communicate = False`, a benchmark-only switch). Each step is
`Trainer.train_step` between two barriers (so the slowest rank counts); the median over steps, after
`E2E_WARMUP_STEPS` untimed ones per variant and round (1-bit LAMB's one-time costs: below). Timed
steps log nothing, as in a real run; the phase breakdown (data, forward/backward, optimizer,
communication) comes from 2 log steps after them. Targets (issue #15): 1-bit LAMB >= 2.0x LAMB and
>= 0.8x the bound. Every rank has one thread: the machine has 2 cores, so
4 ranks share them and their compute takes about twice as long.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist

from bench.records import RESULTS_DIR, Record, write_records
from launch.netns import EmulatedNetwork, interface_counters, set_rate_from_rank, unavailable_reason
from pretrain.comm import CompressedAllreduce, padded_numel
from pretrain.comm.counter import ring_allreduce_bytes

BUFFER_NUMEL = {"bert_base": 110_000_000, "bert_large": 336_000_000}
RATES = ("none", "10gbit", "1gbit")  # "none" first: it doubles as the warm-up rate (cheap)
WORLD_SIZES = (2, 4)
OPERATIONS = ("fp32", "fp16", "compressed")
# Peers of issue #15's work, timed in the same processes where their engines fit in memory: the compressed
# call as it was (torch-op passes, not pipelined), and the fused passes without the pipeline.
TORCH_KERNELS = "compressed_torch"
UNPIPELINED = "compressed_unpipelined"
PEERS = {TORCH_KERNELS: {"kernels": "torch", "pipeline": 0}, UNPIPELINED: {"pipeline": 0}}
# The exchange `optim=onebit_lamb` runs (per-column and per-row scales, the 1-D tensors exact, bfloat16
# scales, mean |y|: `bench.comm.default_layout_options` for the size's model): both compressions fused, sent
# stretch by stretch (issue #15), and its peer with the passes separate (`fuse_worker_pass=False`).
DEFAULT = "compressed_default"
DEFAULT_SEPARATE = "compressed_default_separate"
DEFAULTS = {DEFAULT: {}, DEFAULT_SEPARATE: {"fuse_worker_pass": False}}
QUICK_NUMEL = 4_000_000
GIB = 1024**3
# Per element of the buffer, per rank: fp32 buffer 4, worker error 4, packed send/receive 3/8; + server
# error 4/n. The torch-kernels peer engine adds its own errors (4 + 4/n), packed buffers and the torch
# packer's scratch ~1.63 (bool mask, shifted bytes, int32 indices). Plus the interpreter + torch.
_BYTES_PER_ELEMENT = 4 + 4 + 0.375
_TORCH_PEER_BYTES_PER_ELEMENT = 4 + 0.375 + 1.63 + 4 + 0.375  # and the unpipelined engine's
_DEFAULT_ENGINE_BYTES_PER_ELEMENT = (
    4 + 0.375
)  # each default-layout engine: its errors (+ 4/n), packed buffers
_BASE_PROCESS_BYTES = 0.4 * GIB
_MEMORY_MARGIN = 2 * GIB
RATE_BITS = {"1gbit": 1e9, "10gbit": 1e10, "none": None}


def rate_bits_per_s(rate: str) -> float | None:
    """'1gbit' -> 1e9, '500mbit' -> 5e8, 'none' -> None (tc's decimal prefixes)."""
    text = rate.lower()
    if text in ("none", "unlimited"):
        return None
    for suffix, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if text.endswith(suffix):
            return float(text.removesuffix(suffix)) * scale
    raise ValueError(f"rate '{rate}': expected e.g. 1gbit, 500mbit or none")


# ----------------------------------------------------------------------------------------- part 1


def estimated_rank_bytes(
    numel: int, world_size: int, torch_peer: bool = False, defaults: bool = False
) -> float:
    """Peak memory of one allreduce-benchmark rank (see _BYTES_PER_ELEMENT)."""
    per_element = _BYTES_PER_ELEMENT + 4 / world_size
    if torch_peer:
        per_element += _TORCH_PEER_BYTES_PER_ELEMENT + 8 / world_size
    if defaults:
        per_element += len(DEFAULTS) * (_DEFAULT_ENGINE_BYTES_PER_ELEMENT + 4 / world_size)
    return numel * per_element + _BASE_PROCESS_BYTES


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _allreduce_worker(
    rank: int,
    world_size: int,
    numel: int,
    rates: list[str],
    repeats: int,
    operation_names: list[str],
    size: str = "bert_base",
) -> dict:
    """Runs inside a rank's namespace: times the operations at each rate, with byte counts."""
    padded = padded_numel(numel, world_size)
    default_numel, default_options = 0, {}
    if any(name in DEFAULTS for name in operation_names):
        from bench.comm import default_layout_options

        default_numel, default_options = default_layout_options(0, world_size, size)
    generator = torch.Generator().manual_seed(rank)
    storage = torch.empty(max(padded, default_numel)).uniform_(-1, 1, generator=generator)
    buffer = storage[:padded]
    # fp16 view on the first half of the fp32 storage: no second buffer (memory), refilled before use.
    half = buffer.view(torch.float16)[:padded]
    engine = CompressedAllreduce(padded)
    peers = {
        name: CompressedAllreduce(padded, **kwargs)  # type: ignore[arg-type]
        for name, kwargs in PEERS.items()
        if name in operation_names
    }
    defaults = {
        name: CompressedAllreduce(default_numel, **default_options, **kwargs)  # type: ignore[arg-type]
        for name, kwargs in DEFAULTS.items()
        if name in operation_names
    }

    def fp32() -> None:
        dist.all_reduce(buffer)
        buffer.div_(world_size)

    def fp16() -> None:
        dist.all_reduce(half)
        half.div_(world_size)

    def compressed() -> None:
        engine(buffer)

    operations: dict[str, Callable[[], None]] = {"fp32": fp32, "fp16": fp16, "compressed": compressed}
    for name, peer in peers.items():
        operations[name] = lambda peer=peer: peer(buffer)
    for name, peer in defaults.items():
        operations[name] = lambda peer=peer: peer(storage[:default_numel])
    peers.update(defaults)
    model_bytes = {
        "fp32": ring_allreduce_bytes(padded, 4, world_size),
        "fp16": ring_allreduce_bytes(padded, 2, world_size),
    }

    def measure(name: str) -> dict[str, float]:
        if name == "fp16":
            half.uniform_(-1, 1, generator=generator)
        before = interface_counters()
        dist.barrier()
        start = time.perf_counter()
        operations[name]()
        dist.barrier()  # the slowest rank defines the collective's time
        seconds = time.perf_counter() - start
        after = interface_counters()
        if name in peers:
            counted = peers[name].traffic.last_call.compressed_bytes  # type: ignore[assignment]
        else:
            counted = engine.traffic.last_call.compressed_bytes if name == "compressed" else model_bytes[name]
        return {
            "seconds": seconds,
            "model_bytes": float(counted),  # type: ignore[union-attr]
            **{key: float(after[key] - before[key]) for key in after},
        }

    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    for index, rate in enumerate(rates):
        dist.barrier()
        if rank == 0:
            set_rate_from_rank(rate)
        dist.barrier()
        if index == 0:  # warm-up: first-touch page faults, gloo connections, packer scratch, numba
            for name in operation_names:
                measure(name)
        results[rate] = {name: [] for name in operation_names}
        for _ in range(repeats):  # alternated so that machine drift hits all alike
            for name in operation_names:
                results[rate][name].append(measure(name))
    dist.barrier()
    copy_bandwidth = None
    if rank == 0:  # single-thread memory bandwidth, the others idle in the barrier
        half_numel = padded // 2
        samples = []
        for _ in range(3):
            start = time.perf_counter()
            buffer[:half_numel].copy_(buffer[half_numel : 2 * half_numel])
            samples.append(2 * 4 * half_numel / (time.perf_counter() - start))  # read + write
        copy_bandwidth = statistics.median(samples)
    dist.barrier()
    return {
        "results": results,
        "numel_padded": padded,
        "collective_mode": engine.collective_mode.value,
        "pieces": engine.pieces,
        "default_numel_padded": default_numel,
        "default_pieces": defaults[DEFAULT].pieces if DEFAULT in defaults else None,
        "peak_rss_bytes": _peak_rss(),
        "copy_bytes_per_s": copy_bandwidth,
    }


def _slowest(per_rank: list[dict], rate: str, name: str, key: str) -> list[float]:
    """Per repeat, the maximum over ranks of `key` (seconds: the slowest rank; bytes: the busiest)."""
    columns = [result["results"][rate][name] for result in per_rank]
    return [max(sample[key] for sample in repeat) for repeat in zip(*columns)]


def _allreduce_records(
    size: str, numel: int, world_size: int, rates: list[str], repeats: int, quick: bool
) -> list[Record]:
    needed = estimated_rank_bytes(numel, world_size) * world_size
    available = psutil.virtual_memory().available
    label = f"{size}_n{world_size}"
    if needed > available - _MEMORY_MARGIN:
        reason = (
            f"skipped {label}: needs ~{needed / GIB:.1f} GiB for {world_size} ranks, "
            f"{available / GIB:.1f} GiB available (margin {_MEMORY_MARGIN / GIB:.0f} GiB)"
        )
        print(f"[bench net] {reason}", flush=True)
        return [Record(f"skipped_{label}", 0.0, "skipped", config={"reason": reason})]
    operations = list(OPERATIONS)
    with_defaults = estimated_rank_bytes(numel, world_size, defaults=True) * world_size
    if with_defaults <= available - _MEMORY_MARGIN:
        operations += list(DEFAULTS)
    else:
        print(
            f"[bench net] {label}: no default-layout engines (needs ~{with_defaults / GIB:.1f} GiB)",
            flush=True,
        )
    with_peer = estimated_rank_bytes(numel, world_size, torch_peer=True, defaults=DEFAULT in operations)
    if with_peer * world_size <= available - _MEMORY_MARGIN:
        operations += list(PEERS)
    else:
        needed = with_peer * world_size / GIB
        print(f"[bench net] {label}: no torch-kernels peer (needs ~{needed:.1f} GiB)", flush=True)
    started = time.perf_counter()
    with EmulatedNetwork(world_size, rates[0]) as network:
        layout_model = "bert_mini" if quick else size  # the default layout's model (BERT-mini: 11M)
        per_rank = network.run(_allreduce_worker, (numel, rates, repeats, operations, layout_model))
    run_seconds = time.perf_counter() - started
    first = per_rank[0]
    base_config: dict[str, Any] = {
        "buffer": size,
        "numel_padded": first["numel_padded"],
        "buffer_MB_fp32": first["numel_padded"] * 4 / 1e6,
        "world_size": world_size,
        "repeats": repeats,
        "threads_per_rank": 1,
        "collective_mode": first["collective_mode"],
        "peak_rss_GiB_per_rank": [round(r["peak_rss_bytes"] / GIB, 2) for r in per_rank],
        "estimated_GiB_per_rank": round(estimated_rank_bytes(numel, world_size) / GIB, 2),
        "run_seconds": round(run_seconds, 1),
        "quick": quick,
        "shaping": "tbf on each rank's egress (launch/netns.sh); ingress bounded by the peers' egress",
    }
    records = []
    for rate in rates:
        seconds = {name: _slowest(per_rank, rate, name, "seconds") for name in operations}
        medians = {name: statistics.median(values) for name, values in seconds.items()}
        wire = {
            name: {
                key: statistics.median(_slowest(per_rank, rate, name, key))
                for key in ("model_bytes", "tx_bytes", "qdisc_sent_bytes")
            }
            for name in operations
        }
        nominal = rate_bits_per_s(rate)
        breakdown = {
            name: {
                "seconds_median": medians[name],
                "seconds": seconds[name],
                **{f"{key}_per_rank": value for key, value in wire[name].items()},
                "model_goodput_Gbit_s": wire[name]["model_bytes"] * 8 / medians[name] / 1e9,
                "wire_seconds_at_rate": (wire[name]["model_bytes"] * 8 / nominal) if nominal else None,
            }
            for name in operations
        }
        config = {
            **base_config,
            "rate": rate,
            "operations": breakdown,
            "copy_bytes_per_s": first["copy_bytes_per_s"],
        }
        is_target = rate == "1gbit" and size == "bert_large"
        for peer in ("fp32", "fp16"):
            target = None
            if peer == "fp32":
                target = "ratio <= 0.05 (>= 20x faster; limit ~1/32)" if is_target else "informational"
            records.append(
                Record(
                    f"allreduce_seconds_compressed_vs_{peer}_{label}_{rate}",
                    medians["compressed"],
                    "s",
                    peer=f"gloo {peer} all_reduce + divide by n (same buffer, same processes)",
                    peer_value=medians[peer],
                    target=target or "informational",
                    config={**config, "speedup": medians[peer] / medians["compressed"]},
                )
            )
        if TORCH_KERNELS in operations:
            for peer, what, target in (
                (TORCH_KERNELS, "torch-op passes, not pipelined (the call before #15)", "ratio < 1"),
                (UNPIPELINED, "fused passes, not pipelined (pipeline=0)", "ratio < 1 where the wire is slow"),
            ):
                suffix = "torch_kernels" if peer == TORCH_KERNELS else "unpipelined"
                records.append(
                    Record(
                        f"allreduce_seconds_compressed_vs_{suffix}_{label}_{rate}",
                        medians["compressed"],
                        "s",
                        peer=f"the same compressed call with the {what}, same processes",
                        peer_value=medians[peer],
                        target=target,
                        config={**config, "pieces": first["pieces"]},
                    )
                )
        if DEFAULT in operations:
            default_config = {
                **config,
                "layout": "optim=onebit_lamb default (per_column, exact vectors, bfloat16 scales, mean_abs)",
                "numel_padded_default": first["default_numel_padded"],
                "pieces": first["default_pieces"],
            }
            target = "ratio <= 0.1 (>= 10x; stretch 0.05)" if is_target else "informational"
            records.append(
                Record(
                    f"allreduce_seconds_compressed_default_vs_fp32_{label}_{rate}",
                    medians[DEFAULT],
                    "s",
                    peer="gloo fp32 all_reduce + divide by n of the size's buffer (same processes; the "
                    "default layout's buffer is the model's parameters padded, within 0.3 %)",
                    peer_value=medians["fp32"],
                    target=target,
                    config=default_config,
                )
            )
            records.append(
                Record(
                    f"allreduce_seconds_compressed_default_vs_separate_passes_{label}_{rate}",
                    medians[DEFAULT],
                    "s",
                    peer="the same call with the worker's and the server's passes separate "
                    "(fuse_worker_pass=False: the pipeline's all_to_all/all_gather pieces), same processes",
                    peer_value=medians[DEFAULT_SEPARATE],
                    target="ratio < 1",
                    config=default_config,
                )
            )
        if nominal is not None:
            records.append(
                Record(
                    f"wire_bytes_compressed_vs_fp32_{label}_{rate}",
                    wire["compressed"]["qdisc_sent_bytes"],
                    "B/rank/call",
                    peer="fp32 all_reduce, tc qdisc Sent bytes of the same rank",
                    peer_value=wire["fp32"]["qdisc_sent_bytes"],
                    target="ratio ~1/32 (the byte counter's model)",
                    config={
                        **base_config,
                        "rate": rate,
                        "bytes": wire,
                        "counter_ratio": wire["compressed"]["model_bytes"] / wire["fp32"]["model_bytes"],
                        "note": "tc counts every TCP segment's headers; tx_bytes counts GSO packets once",
                    },
                )
            )
    if first["copy_bytes_per_s"]:
        records.append(
            Record(
                f"memory_copy_bytes_per_s_{label}",
                first["copy_bytes_per_s"],
                "B/s",
                target="informational: calibrates the compression cost per byte moved (bench/scaling.py)",
                config={
                    **base_config,
                    "what": "rank 0, one thread, copy_ of half the buffer onto the other half",
                },
            )
        )
    return records


# ----------------------------------------------------------------------------------------- part 2

# lamb_bf16: LAMB with gradients averaged in bfloat16 (optim.grad_allreduce), the fair GPU baseline (#15)
VARIANTS = ("lamb", "lamb_bf16", "onebit_lamb", "no_comm")


def _train_worker(
    rank: int,
    world_size: int,
    variants: list[str],
    rounds: int,
    model: str,
    data_dir: str,
    run_root: str,
    micro_batch: int,
    warmup_steps: int,
    steps: int,
    compile: bool = False,
    keep_host_memory: bool = True,
) -> dict:
    """Runs inside a rank's namespace: for each round and variant, a fresh trainer, `warmup_steps`
    untimed and `steps` timed `Trainer.train_step` calls. One process for all variants: no repeated
    start-up, and the rounds alternate the variants so that machine drift hits them alike."""
    import gc

    from hydra import compose, initialize_config_dir

    from data.config import REPO_ROOT
    from pretrain.config import to_object
    from pretrain.distributed.process_group import init_distributed
    from pretrain.train import host_memory
    from pretrain.train.trainer import Trainer

    results: dict[str, dict[str, Any]] = {
        variant: {"step_seconds": [], "phases": [], "onebit_bytes_per_call": None} for variant in variants
    }
    env = init_distributed()
    for round_index in range(rounds):
        for variant in variants:
            overrides = [
                "batch=demo",
                f"optim={'onebit_lamb' if variant == 'onebit_lamb' else 'lamb'}",
                f"model={model}",
                f"data_dir={data_dir}",
                f"run_dir={run_root}/{variant}-{round_index}",
                "wandb.mode=disabled",
                "num_workers=0",
                # timed steps log nothing, as in a real run (log_every ~100): a log step adds the optimizer's
                # statistics (1-bit LAMB: error-feedback norms, ~0.2 s at BERT-Base). The phase times come
                # from PHASE_STEPS log steps after the timed ones.
                f"log_every={NO_LOG}",
                "show_progress=false",
                f"batch.phases.0.global_batch={micro_batch * world_size}",
                f"batch.phases.0.micro_batch={micro_batch}",
                "batch.phases.0.steps=100000",
                # 1-bit LAMB: one warmup step, then the compression stage; the others have no freeze_step.
                f"batch.phases.0.freeze_step={1 if variant == 'onebit_lamb' else 'null'}",
                *(["optim.grad_allreduce=bfloat16"] if variant == "lamb_bf16" else []),
                *(["optim.compile=true"] if compile else []),
                f"keep_host_memory={str(keep_host_memory).lower()}",
            ]
            with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
                cfg = to_object(compose(config_name="pretrain", overrides=overrides))
            trainer = Trainer(cfg, env)
            if variant == "no_comm":
                trainer.sync.communicate = False  # benchmark-only bound: same compute, no gradient allreduce
            phase = trainer._enter_phase(0)
            for _ in range(warmup_steps):
                trainer.train_step(phase)
            traffic = getattr(trainer.optimizer, "traffic", None)
            bytes_before = float(traffic.compressed_bytes) if traffic is not None else 0.0
            for _ in range(steps):
                dist.barrier()
                start = time.perf_counter()
                metrics = trainer.train_step(phase)
                dist.barrier()
                results[variant]["step_seconds"].append(time.perf_counter() - start)
                assert metrics is None
            if traffic is not None:
                results[variant]["onebit_bytes_per_call"] = (
                    float(traffic.compressed_bytes) - bytes_before
                ) / steps
            trainer.cfg.log_every = 1  # the phase breakdown: log steps, not counted in samples/s
            for _ in range(PHASE_STEPS):
                dist.barrier()
                metrics = trainer.train_step(phase)
                assert metrics is not None
                results[variant]["phases"].append({key: float(metrics[key]) for key in _PHASE_KEYS})
            results[variant]["stage"] = getattr(getattr(trainer.optimizer, "stage", None), "value", None)
            results[variant]["num_params"] = trainer.num_params
            results[variant]["rss_bytes_end"] = psutil.Process().memory_info().rss
            if trainer.data is not None:
                trainer.data.close()
            del trainer, phase
            gc.collect()
            # the next variant's shapes do not fit the kept heap's fragments: start it from a released heap
            host_memory.release_freed_memory()
            results[variant]["rss_bytes_after_release"] = psutil.Process().memory_info().rss
    return {"variants": results, "peak_rss_bytes": _peak_rss(), "host_memory_kept": host_memory.kept()}


NO_LOG = 10**9  # log_every of the timed steps: none of them logs
# Untimed steps per variant and round: 1-bit LAMB's first (its warmup, freeze_step=1) and two compression
# steps.
# The first compression step loads the numba kernels and builds the exchange (~4 s); the second still grows
# the heap to its peak (68K page faults per rank, 2.0 s of CPU against 1.2 s in the steps after it, 0 faults
# from then on: BERT-Base, 2 ranks), a one-time cost a run pays once, which 2 warm-up steps left
# in the first timed step of every round.
E2E_WARMUP_STEPS = 3
PHASE_STEPS = 2  # log steps per variant and round after the timed ones, for the phase breakdown
_PHASE_KEYS = ("time_data", "time_forward_backward", "time_optimizer", "time_communication", "bytes_step")


def _e2e_records(
    world_size: int,
    rate: str,
    model: str,
    data_dir: Path,
    micro_batch: int,
    warmup: int,
    steps: int,
    rounds: int,
    quick: bool,
    compile: bool = False,
    keep_host_memory: bool = True,
) -> list[Record]:
    print(
        f"[bench net] e2e {model} n={world_size} {rate}{' compiled' if compile else ''}"
        f"{'' if keep_host_memory else ' keep_host_memory=false'}: "
        f"{', '.join(VARIANTS)} x {rounds} round(s)",
        flush=True,
    )
    started = time.perf_counter()
    with (
        tempfile.TemporaryDirectory(prefix="net-e2e-") as run_root,
        EmulatedNetwork(world_size, rate) as network,
    ):
        per_rank = network.run(
            _train_worker,
            (
                list(VARIANTS),
                rounds,
                model,
                str(data_dir),
                run_root,
                micro_batch,
                warmup,
                steps,
                compile,
                keep_host_memory,
            ),
            env={"WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"},
        )
    run_seconds = time.perf_counter() - started
    results = {}
    for variant in VARIANTS:
        ranks = [r["variants"][variant] for r in per_rank]
        step_seconds = [max(times) for times in zip(*(r["step_seconds"] for r in ranks))]
        median_step = statistics.median(step_seconds)
        num_phase_steps = len(ranks[0]["phases"])
        phase_medians = {
            key: statistics.median(max(r["phases"][i][key] for r in ranks) for i in range(num_phase_steps))
            for key in _PHASE_KEYS
        }
        if ranks[0]["onebit_bytes_per_call"] is not None:  # 1-bit: the exchange is in the optimizer step
            phase_medians["bytes_step"] = ranks[0]["onebit_bytes_per_call"]
        results[variant] = {
            "samples_per_s": micro_batch * world_size / median_step,
            "step_seconds_median": median_step,
            "step_seconds": step_seconds,
            "phase_seconds_median": phase_medians,
            "stage": ranks[0]["stage"],
            "num_params": ranks[0]["num_params"],
            "rss_GiB_end_per_rank": [round(r["rss_bytes_end"] / GIB, 2) for r in ranks],
            "rss_GiB_after_release_per_rank": [round(r["rss_bytes_after_release"] / GIB, 2) for r in ranks],
        }
    config = {
        "model": model,
        "seq": 128,
        "world_size": world_size,
        "rate": rate,
        "micro_batch": micro_batch,
        "global_batch": micro_batch * world_size,
        "accumulation": 1,
        "threads_per_rank": 1,
        "cpu_cores": os.cpu_count(),
        "warmup_steps": warmup,
        "timed_steps_per_round": steps,
        "timed_steps_log": False,  # as in a real run (log_every > the timed steps)
        "phase_log_steps_per_round": PHASE_STEPS,
        "rounds": rounds,
        "quick": quick,
        "compile": compile,  # optim.compile for every variant (LAMB's and 1-bit LAMB's compiled steps)
        # keep_host_memory (the default) for every variant: glibc keeps freed memory
        # (pretrain/train/host_memory.py), so a step's large temporaries fault no fresh pages (a CPU-only
        # cost: GPUs
        # allocate through CUDA's cache); false: the faulting reference (--no-keep-host-memory)
        "keep_host_memory": keep_host_memory,
        "host_memory_kept_per_rank": [r["host_memory_kept"] for r in per_rank],
        "no_comm_bound": "LAMB with GradientSync.communicate=False: same compute, gradient allreduce skipped",
        "peak_rss_GiB_per_rank": [round(r["peak_rss_bytes"] / GIB, 2) for r in per_rank],
        "run_seconds": round(run_seconds, 1),
        "variants": results,
    }
    label = f"{model}_n{world_size}_{rate}"
    onebit = results["onebit_lamb"]["samples_per_s"]
    return [
        Record(
            f"e2e_samples_per_s_onebit_lamb_vs_lamb_{label}",
            onebit,
            "samples/s",
            peer="LAMB (fp32 gradient allreduce), same ranks, rate and data",
            peer_value=results["lamb"]["samples_per_s"],
            target="ratio >= 2.0",
            config=config,
        ),
        Record(
            f"e2e_samples_per_s_onebit_lamb_vs_bf16_lamb_{label}",
            onebit,
            "samples/s",
            peer="LAMB, bfloat16 gradient allreduce (optim.grad_allreduce=bfloat16), same ranks and rate",
            peer_value=results["lamb_bf16"]["samples_per_s"],
            target="informational: 1-bit LAMB against the baseline GPU users run (issue #15)",
            config=config,
        ),
        Record(
            f"e2e_samples_per_s_onebit_lamb_vs_no_comm_{label}",
            onebit,
            "samples/s",
            peer="no-communication bound (LAMB, gradient allreduce skipped)",
            peer_value=results["no_comm"]["samples_per_s"],
            target="ratio >= 0.8",
            config=config,
        ),
        Record(
            f"e2e_samples_per_s_lamb_vs_no_comm_{label}",
            results["lamb"]["samples_per_s"],
            "samples/s",
            peer="no-communication bound (LAMB, gradient allreduce skipped)",
            peer_value=results["no_comm"]["samples_per_s"],
            target="informational: how communication-bound LAMB is",
            config=config,
        ),
    ]


def _prepared_data(folder: Path) -> Path:
    """`make prepare DATA=tiny`'s output when complete (BERT uncased vocab), else prepared into `folder`."""
    from data.config import REPO_ROOT
    from data.prepare import prepare_in_subprocess

    prepared = REPO_ROOT / "data" / "prepared" / "tiny"
    if all((prepared / f"seq{length}" / "manifest.json").is_file() for length in (128, 512)):
        return prepared
    return prepare_in_subprocess(folder / "tiny", "data=tiny")


# ------------------------------------------------------------------------------------------ main


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench net", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small buffer, 2 ranks, bert_tiny e2e: seconds")
    parser.add_argument("--part", choices=("all", "allreduce", "e2e"), default="all")
    parser.add_argument("--rates", type=_csv, default=None, help="comma-separated, e.g. 1gbit,none")
    parser.add_argument("--world-sizes", type=_csv, default=None, help="comma-separated, e.g. 2,4")
    parser.add_argument("--sizes", type=_csv, default=None, help="bert_base,bert_large")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--micro-batch", type=int, default=1, help="e2e micro batch per rank")
    parser.add_argument("--steps", type=int, default=None, help="e2e timed steps per variant and round")
    parser.add_argument("--rounds", type=int, default=None, help="e2e rounds over the three variants")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="e2e with optim.compile=true for every variant: net_e2e_compiled.json",
    )
    parser.add_argument(
        "--no-keep-host-memory",
        action="store_true",
        help="e2e with keep_host_memory=false for every variant (glibc unmaps freed large blocks: the step's "
        "large temporaries fault fresh pages): "
        "net_e2e[_compiled]_no_keep_host_memory.json",
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)

    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"bench net: the emulated network is unavailable: {reason}")
    for rate in args.rates or ():
        rate_bits_per_s(rate)  # a bad rate fails here, not after minutes of measurement
    world_sizes = (
        [int(n) for n in args.world_sizes] if args.world_sizes else ([2] if args.quick else list(WORLD_SIZES))
    )
    suffix = "_quick" if args.quick else ""
    torch.set_num_threads(1)

    if args.part in ("all", "allreduce"):
        rates = args.rates or (["none", "1gbit"] if args.quick else list(RATES))
        sizes = args.sizes or (["quick"] if args.quick else list(BUFFER_NUMEL))
        repeats = args.repeats or (2 if args.quick else 3)
        records: list[Record] = []
        for size in sizes:
            numel = QUICK_NUMEL if size == "quick" else BUFFER_NUMEL[size]
            for world_size in world_sizes:
                print(f"[bench net] allreduce {size} n={world_size} rates {rates}", flush=True)
                records += _allreduce_records(size, numel, world_size, rates, repeats, args.quick)
        write_records(f"net{suffix}", records, args.out)

    if args.part in ("all", "e2e"):
        rate = (args.rates or ["1gbit"])[-1] if args.part == "e2e" else "1gbit"
        model = "bert_tiny" if args.quick else "bert_base"
        steps = args.steps or (3 if args.quick else 4)
        rounds = args.rounds or (1 if args.quick else 2)
        records = []
        with tempfile.TemporaryDirectory(prefix="net-e2e-data-") as folder:
            data_dir = _prepared_data(Path(folder))
            for world_size in world_sizes:
                records += _e2e_records(
                    world_size,
                    rate,
                    model,
                    data_dir,
                    args.micro_batch,
                    E2E_WARMUP_STEPS,
                    steps,
                    rounds,
                    args.quick,
                    args.compile,
                    not args.no_keep_host_memory,
                )
        kept = "_no_keep_host_memory" if args.no_keep_host_memory else ""
        write_records(f"net_e2e{'_compiled' if args.compile else ''}{kept}{suffix}", records, args.out)


if __name__ == "__main__":
    main(sys.argv[1:])
