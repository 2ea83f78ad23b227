"""`python -m bench gpu`: GPU checks, their figures and the step's arms -> results/bench/gpu.json.

The checks run in order within --budget-s (480 s), each written as it ends (a cut-off run keeps what it
did); exit 1 when one failed. What each checks: the package's docstring (`bench.gpu`)."""

from __future__ import annotations

import argparse
import math
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from bench.gpu.allreduce import check_allreduce
from bench.gpu.arms import check_arms, selected_arms
from bench.gpu.common import Context, error_line, free_memory, peak_tflops
from bench.gpu.gpu_tests import check_tests
from bench.gpu.optim_steps import check_optim
from bench.gpu.packers import check_packer
from bench.gpu.profile import check_profile
from bench.gpu.throughput import check_throughput
from bench.records import RESULTS_DIR, Record, write_records

# in the order they run: the quick correctness checks first, then `make test-gpu` (the pipeline on this GPU),
# the compiles last; `profile` runs only when named
STEPS = ("packer", "allreduce", "tests", "optim", "throughput", "arms")
# seconds a check may take (an H200 took 2, 18, 78 (the pipeline), 25 and 142 s, compiles included; the
# compiled comm kernels' arms, the tests beside the pipeline and the arms not yet timed on a GPU): a check
# is skipped, and says so, when less than this is left of --budget-s
STEP_SECONDS = {
    "packer": 10,
    "allreduce": 120,
    "tests": 150,
    "optim": 60,
    "throughput": 170,
    "arms": 90,  # each arm checks the budget itself and is listed as not run when it does not fit
    "profile": 30,  # each of its arms checks the budget itself (a compiled arm needs 90 s)
}
BUDGET_S = 480.0  # issue #51: the device script within ~8 minutes on one H100/H200


CHECKS: dict[str, Callable[[Context], list[Record]]] = {
    "packer": check_packer,
    "allreduce": check_allreduce,
    "tests": check_tests,
    "optim": check_optim,
    "throughput": check_throughput,
    "arms": check_arms,
    "profile": check_profile,
}


def _write_kernel_tables(ctx: Context, result_name: str) -> None:
    """The costliest kernels of every profiled step to <out>/<result>_kernels.txt (temp name, then rename)."""
    if not ctx.kernel_tables:
        return
    tables = ctx.kernel_tables.items()
    text = "\n\n".join(f"## {label} ({ctx.device_name})\n{table}" for label, table in tables)
    path = ctx.out_dir / f"{result_name}_kernels.txt"
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text + "\n")
    temporary.replace(path)


def _summary(records: list[Record]) -> str:
    lines = [f"{'record':58s} {'value':>12s} {'peer':>12s} {'ratio':>7s}"]
    for r in records:
        peer = f"{r.peer_value:12.4g}" if r.peer_value is not None else " " * 12
        ratio = f"{r.ratio:7.3f}" if r.ratio is not None else ""
        lines.append(f"{r.name:58s} {r.value:12.4g} {peer} {ratio}")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench gpu", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", default=",".join(STEPS), help=f"comma-separated subset of {','.join(STEPS)}"
    )
    parser.add_argument(
        "--budget-s", type=float, default=BUDGET_S, help="skip checks that would end after this"
    )
    parser.add_argument("--arms", default="default", help="the arms check's arms: default, all, or names")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak")
    parser.add_argument("--cpu-smoke", action="store_true", help="every check at toy sizes on the CPU")
    parser.add_argument("--out", type=Path, default=None, help="folder for gpu.json (default results/bench)")
    args = parser.parse_args(argv)
    steps = [s for s in args.steps.split(",") if s]
    unknown = [s for s in steps if s not in CHECKS]
    if unknown:
        raise SystemExit(f"bench gpu: unknown --steps {unknown}; known: {','.join(CHECKS)}")
    arms = selected_arms(args.arms)
    if args.cpu_smoke:
        device, name = torch.device("cpu"), "cpu (smoke)"
    elif not torch.cuda.is_available():
        print(
            "bench gpu: no CUDA device (torch.cuda.is_available() is False): nothing to check here; run "
            "`make gpu-check` on a GPU machine (`--cpu-smoke` runs the checks at toy sizes on the CPU)"
        )
        return
    else:
        device = torch.device("cuda", torch.cuda.current_device())
        name = torch.cuda.get_device_name(device)
    started = time.perf_counter()
    ctx = Context(
        device=device,
        smoke=args.cpu_smoke,
        deadline=started + args.budget_s,
        peak=args.peak_tflops or (peak_tflops(name) if device.type == "cuda" else None),
        out_dir=Path(args.out or RESULTS_DIR),
        device_name=name,
        arms=arms,
    )
    result_name = "gpu_smoke" if args.cpu_smoke else "gpu"
    print(
        f"[bench gpu] {name}, peak bf16 {ctx.peak} TFLOP/s, torch {torch.__version__}, checks {steps}",
        flush=True,
    )
    records: list[Record] = []
    for step in steps:
        left = ctx.deadline - time.perf_counter()
        if left < STEP_SECONDS[step] and not args.cpu_smoke:
            ctx.fail(f"{step}: not run, {left:.0f} s of --budget-s left (needs up to {STEP_SECONDS[step]} s)")
            continue
        step_started = time.perf_counter()
        try:
            records += CHECKS[step](ctx)
        except Exception as error:  # one check's failure must not hide the others' results
            traceback.print_exc()
            message = error_line(error)
            ctx.fail(f"{step}: {message}")
            records.append(Record(f"{step}_error", math.nan, "", config=ctx.config(error=message)))
        free_memory()
        print(f"[bench gpu] {step}: {time.perf_counter() - step_started:.1f} s", flush=True)
        # after every check: a cut-off run keeps what it did
        write_records(result_name, records, ctx.out_dir, quiet=step != steps[-1])
        _write_kernel_tables(ctx, result_name)
    print(_summary(records))
    print(f"[bench gpu] {time.perf_counter() - started:.0f} s; ", end="")
    if ctx.failures:
        print(f"{len(ctx.failures)} failed:\n  " + "\n  ".join(m.splitlines()[0] for m in ctx.failures))
        raise SystemExit(1)
    print("every check passed")
