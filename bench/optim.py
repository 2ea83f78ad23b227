"""Optimizer step time on BERT's real parameter shapes (CPU), against peers measured in the same run.

Parameters, gradients and optimizer states are fp32 tensors with the shapes of HF `BertForPreTraining`
(BERT-Large: 24 layers, hidden 1024, 16 heads, intermediate 4096, vocab 30522, ≈336M parameters;
`--quick`: BERT-Base shapes, fewer repetitions). All optimizers update the same parameter tensors with
the same fixed gradients (values do not affect the timing). Each record races two optimizers, their
steps interleaved so that machine noise hits both alike, with at most two optimizer states alive:

- `Lamb` eager (on CPU: the numba loops, `pretrain.optim.lamb_loops`) and `Lamb(compile=True)` (NVLAMB) vs
  `torch.optim.AdamW(fused=True)`. Target ≤ 1.5× (issue #3), ≤ 1.6× compiled (issue #15). The eager step
  also as the trainer runs it (`lamb_eager_step_trainer`): the trainer's Inf/NaN check computes the global
  gradient norm every step for every optimizer, AdamW included, and hands it to LAMB
  (`mark_gradients_checked`), whose step then makes no norm pass of its own. Also LAMB's global
  gradient-norm pass alone against the same peer (`lamb_gradient_norm_pass`): one read of every gradient,
  which AdamW without clipping skips; the compiled step with every tensor compiled against the default
  (small tensors eager, `lamb_compiled_step_every_tensor_compiled`); and each pass of the compiled step on
  one large tensor against fused AdamW on a tensor as large (`lamb_kernel_*`: the two kernels, the
  gradient norm with ATen's norm and as the BLAS dot `global_grad_norm` takes on CPU;
  `lamb_kernel_loops_step`: the numba loops' two passes together).
- `Lamb` eager and compiled vs torch-optimizer's `Lamb` (the `bench` extra; recorded as skipped, with
  the reason, if it is missing). Target: ours ≥ 3× faster, i.e. ratio ≤ 0.333.
- The 1-bit LAMB compression-stage step with one process (the n = 1 path: compute only, no wire time
  and no κ scaling) vs `Lamb` eager: DeepSpeed's algorithm (the class defaults), and the project's
  default (`conf/optim/onebit_lamb.yaml`: per-column scales, preconditioned, live trust ratio) eager and
  compiled (`compile=True`, pretrain/optim/compiled.py; target ≤ 1.0×, issue #15). With one process the
  eager step skips the exchange's layout passes (division by √v+ε, transposes), which the compiled step
  still makes, so the compiled record understates its gain over the eager step at n ≥ 2.

Records (results/bench/optim.json): step seconds (median), peer seconds, ratio = value / peer.

    python -m bench optim [--quick]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from bench.records import Record, results_name, write_records
from pretrain.optim import Lamb, OnebitLamb, lamb_loops, marginals, mark_gradients_checked, param_groups
from pretrain.optim import compiled as compiled_module
from pretrain.optim import functional as F
from pretrain.optim.base import Workspace, global_grad_norm
from pretrain.optim.onebit_lamb import ONEBIT_LAMB_ALGORITHM

PEER_ADAMW = "torch.optim.AdamW(fused=True)"
PEER_TORCH_OPTIMIZER = "torch_optimizer.Lamb"
PEER_LAMB = "pretrain.optim.Lamb (eager)"


def bert_parameters(large: bool, config: Any = None) -> torch.nn.Module:
    """A module holding fresh fp32 tensors with `BertForPreTraining`'s parameter names and shapes (of
    BERT-Large or BERT-Base, or of the `BertConfig` given)."""
    from transformers import BertConfig, BertForPreTraining

    if config is None and large:
        config = BertConfig(
            vocab_size=30522,
            hidden_size=1024,
            num_hidden_layers=24,
            num_attention_heads=16,
            intermediate_size=4096,
        )
    elif config is None:
        config = BertConfig(vocab_size=30522)  # BERT-Base defaults
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in BertForPreTraining(config).named_parameters()}
    generator = torch.Generator().manual_seed(0)
    holder = torch.nn.Module()
    for index, (name, shape) in enumerate(shapes.items()):
        param = torch.nn.Parameter(0.02 * torch.randn(shape, generator=generator))
        param.grad = 1e-3 * torch.randn(shape, generator=generator)
        # keep the HF names so `param_groups` applies BERT's decay rule (dots are not allowed in names)
        holder.register_parameter(f"p{index:04d}_{name.replace('.', '__')}", param)
    return holder


def _decay_groups(model: torch.nn.Module, row_scales: bool = False) -> list[dict]:
    """BERT's groups; the mangled names are turned back into HF's for `param_groups`' name rules."""

    class HFNames:
        def named_parameters(self):  # "p0001_bert__embeddings__word_embeddings__weight" -> HF name
            return [(name.split("_", 1)[1].replace("__", "."), p) for name, p in model.named_parameters()]

    return param_groups(HFNames(), 0.01, row_scales=row_scales)  # type: ignore[arg-type]


def interleaved_medians(steps: Mapping[str, Callable[[], Any]], warmup: int, reps: int) -> dict[str, float]:
    """Median seconds per call of each step function, calls interleaved round-robin after `warmup`."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(reps):
        for name, step in steps.items():
            started = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}


def _torch_optimizer_lamb(groups: list[dict]) -> torch.optim.Optimizer:
    import torch_optimizer

    return torch_optimizer.Lamb(groups, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)


def _torch_optimizer_note() -> str | None:
    """None when torch-optimizer imports, else why it is skipped."""
    try:
        import torch_optimizer  # noqa: F401
    except ImportError as error:
        return f"torch-optimizer not installed ({error}); install the 'bench' extra"
    return None


# optim=onebit_lamb's algorithm (pretrain/optim/onebit_lamb.py), with its variance refresh (the 63 of 64
# steps that add the marginals)
DEFAULT_ONEBIT = {"algorithm": ONEBIT_LAMB_ALGORITHM, "variance_refresh": 64}


def _onebit_in_compression(groups: list[dict], **options: Any) -> OnebitLamb:
    optimizer = OnebitLamb(groups, lr=1e-3, freeze_step=1, coeff_beta=0.5, **options)
    optimizer.step()  # the one warmup step; every later step is a compression step
    optimizer.step()  # the first compression step (compiles, with compile=True)
    return optimizer


class _GradientNormPass:
    """LAMB's global gradient-norm pass alone (`step()` as LAMB's first line runs it): one read of every
    gradient that AdamW without clipping does not make. Recorded to show its share of LAMB's ratio."""

    def __init__(self, groups: list[dict]) -> None:
        self.grads = [p.grad for group in groups for p in group["params"]]

    def step(self) -> None:
        global_grad_norm(self.grads)


class _TrainerLamb:
    """`Lamb` eager as the trainer steps it: the gradient norm of the trainer's check (computed once
    here: the trainer computes it for AdamW as well) passed in before every step."""

    def __init__(self, groups: list[dict]) -> None:
        self.optimizer = Lamb(groups, lr=1e-3)
        self.norm = global_grad_norm([p.grad for group in groups for p in group["params"]])

    def step(self) -> None:
        mark_gradients_checked(self.optimizer, self.norm)
        self.optimizer.step()


class _EveryTensorCompiled:
    """`Lamb(compile=True)` with every tensor through the compiled kernels (`COMPILED_MIN_NUMEL` = 0, the
    path before small tensors took the eager update): the same run's A/B of that change."""

    def __init__(self, groups: list[dict]) -> None:
        self.optimizer = Lamb(groups, lr=1e-3, compile=True)

    def step(self) -> None:
        saved, compiled_module.COMPILED_MIN_NUMEL = compiled_module.COMPILED_MIN_NUMEL, 0
        try:
            self.optimizer.step()
        finally:
            compiled_module.COMPILED_MIN_NUMEL = saved


def kernel_breakdown(numel: int, warmup: int, reps: int) -> dict[str, float]:
    """Seconds of fused AdamW's step on one fp32 tensor of `numel` elements and of each pass of the
    compiled LAMB step on a tensor as large: the two kernels, the gradient norm with ATen's norm and as
    the BLAS dot that `global_grad_norm` takes on CPU; and the numba loops' whole step (both passes)."""
    param = torch.nn.Parameter(0.02 * torch.randn(numel))
    param.grad = 1e-3 * torch.randn(numel)
    adamw = torch.optim.AdamW([param], lr=1e-3, fused=True)
    flat, grad = param.data.view(-1), param.grad.view(-1)
    exp_avg, exp_avg_sq = torch.zeros(numel), torch.zeros(numel)
    direction = compiled_module.compiled(F.lamb_tensor_direction_)
    apply = compiled_module.compiled(F.lamb_tensor_apply_)
    scalars = F.lamb_kernel_scalars(
        clamp_ratio=False, lr=1e-3, eps=1e-6, weight_decay=0.01, bias_correction1=0.1,
        bias_correction2_sqrt=0.03, grad_scale=1.0, beta1=0.9, beta2=0.999,
    )  # fmt: skip
    coeffs = torch.tensor([1.0, 1e-3])
    loop_state = [flat.clone(), grad, torch.zeros(numel), torch.zeros(numel)]

    def loops_step() -> None:
        lamb_loops.lamb_step_(
            *([t] for t in loop_state), nvlamb=True, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-6,
            weight_decay=0.01, bias_correction1=0.1, bias_correction2_sqrt=0.03,
        )  # fmt: skip

    with torch.no_grad():
        return interleaved_medians(
            {
                "adamw": adamw.step,
                "direction": lambda: direction(flat, grad, exp_avg, exp_avg_sq, scalars, clamp_ratio=False),
                "apply": lambda: apply(flat, exp_avg, exp_avg_sq, coeffs, scalars),
                "norm_aten": lambda: torch.linalg.vector_norm(grad),
                "norm_dot": lambda: torch.dot(grad, grad),
                **({"loops_step": loops_step} if lamb_loops._loops() is not None else {}),
            },
            warmup,
            reps,
        )


def marginal_sums(model: torch.nn.Module, warmup: int, reps: int) -> dict[str, float]:
    """Seconds to add the row and column sums of g² for every weight matrix of `model` (1-bit LAMB's
    factored/rank1 variance refresh, each compression step): the numba loop and the torch path, both on
    one thread (numba's loop is single-threaded; the e2e benchmark's ranks run one thread each)."""
    matrices = [p.detach() for p in model.parameters() if p.dim() == 2]
    grads = [0.01 * torch.randn(m.shape) for m in matrices]
    sums = [(torch.zeros(m.shape[0]), torch.zeros(m.shape[1])) for m in matrices]
    workspace = Workspace()

    def run(add: Callable[..., None]) -> None:
        for grad, (rows, cols) in zip(grads, sums):
            add(grad, rows, cols, workspace)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return interleaved_medians(
            {
                "numba": lambda: run(marginals.add_square_marginals),
                "torch": lambda: run(marginals.torch_add_square_marginals),
            },
            warmup,
            reps,
        )
    finally:
        torch.set_num_threads(threads)


class Contenders:
    """Optimizers over the same tensors, built on first use and released when a pair no longer needs
    them: at most two optimizer states are alive at a time (BERT-Large: ≈ 2.7 GB each, 5.4 for 1-bit
    LAMB), which keeps this machine's memory system out of the measurement."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.live: dict[str, torch.optim.Optimizer] = {}
        self.compile_seconds = float("nan")

    def build(self, name: str) -> torch.optim.Optimizer:
        groups = _decay_groups(self.model)
        if name == "adamw":
            return torch.optim.AdamW(groups, lr=1e-3, fused=True)
        if name == "lamb":
            return Lamb(groups, lr=1e-3)
        if name == "torch_optimizer":
            return _torch_optimizer_lamb(groups)
        if name == "onebit":
            return _onebit_in_compression(groups)
        if name == "every_tensor_compiled":
            return _EveryTensorCompiled(groups)  # type: ignore[return-value]
        if name == "lamb_trainer":
            return _TrainerLamb(groups)  # type: ignore[return-value]
        if name == "grad_norm":
            return _GradientNormPass(groups)  # type: ignore[return-value]
        if name in ("onebit_default", "onebit_compiled"):
            row_groups = _decay_groups(self.model, row_scales=True)
            return _onebit_in_compression(row_groups, **DEFAULT_ONEBIT, compile=name == "onebit_compiled")
        optimizer = Lamb(groups, lr=1e-3, compile=True)
        started = time.perf_counter()
        optimizer.step()  # compiles
        self.compile_seconds = time.perf_counter() - started
        return optimizer

    def race(self, names: tuple[str, str], warmup: int, reps: int, keep: tuple[str, ...] = ()) -> list[float]:
        """Median step seconds of the two, interleaved; then release every optimizer not in `keep`."""
        steps = {}
        for name in names:
            if name not in self.live:
                self.live[name] = self.build(name)
            steps[name] = self.live[name].step
        medians = interleaved_medians(steps, warmup, reps)
        del steps
        for name in [n for n in self.live if n not in keep]:
            del self.live[name]
        gc.collect()
        return [medians[name] for name in names]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench optim", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="BERT-Base shapes, fewer repetitions")
    args = parser.parse_args(argv)
    large = not args.quick
    reps, warmup = (5, 1) if large else (3, 1)
    model = bert_parameters(large)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    config = {
        "shapes": "BERT-Large" if large else "BERT-Base",
        "num_params": numel,
        "num_tensors": len(params),
        "dtype": "float32",
        "threads": torch.get_num_threads(),
        "reps": reps,
        "statistic": "median seconds per step, the two optimizers of a record interleaved",
        "variant": "nvlamb",
    }
    print(f"[bench optim] {config['shapes']}: {numel / 1e6:.1f}M parameters in {len(params)} tensors")
    contenders = Contenders(model)
    records: list[Record] = []
    step_time, vs_peer = "<= 1.5", "<= 0.333 (>= 3x faster)"
    skipped = _torch_optimizer_note()

    lamb, adamw = contenders.race(("lamb", "adamw"), warmup, reps, keep=("lamb",))
    eager_config = {**config, "kernels": "numba loops" if lamb_loops._loops() is not None else "foreach"}
    records.append(Record("lamb_eager_step", lamb, "s", PEER_ADAMW, adamw, step_time, eager_config))
    lamb, adamw = contenders.race(("lamb_trainer", "adamw"), warmup, reps)
    note = "the gradient norm from the trainer's check (mark_gradients_checked), which AdamW's runs make too"
    records.append(
        Record(
            "lamb_eager_step_trainer", lamb, "s", PEER_ADAMW, adamw, "<= 1.6", {**eager_config, "note": note}
        )
    )
    if skipped is None:
        lamb, peer = contenders.race(("lamb", "torch_optimizer"), warmup, reps, keep=("torch_optimizer",))
        records.append(
            Record(
                "lamb_eager_step_vs_torch_optimizer", lamb, "s", PEER_TORCH_OPTIMIZER, peer, vs_peer, config
            )
        )
        compiled, peer = contenders.race(("compiled", "torch_optimizer"), warmup, reps, keep=("compiled",))
        compiled_config = {**config, "compile_seconds": round(contenders.compile_seconds, 1)}
        records.append(
            Record(
                "lamb_compiled_step_vs_torch_optimizer",
                compiled,
                "s",
                PEER_TORCH_OPTIMIZER,
                peer,
                vs_peer,
                compiled_config,
            )
        )
    else:
        for name in ("lamb_eager_step_vs_torch_optimizer", "lamb_compiled_step_vs_torch_optimizer"):
            records.append(
                Record(name, float("nan"), "s", None, None, vs_peer, {**config, "skipped_peer": skipped})
            )
    compiled, adamw = contenders.race(("compiled", "adamw"), warmup, reps, keep=("adamw",))
    compiled_config = {**config, "compile_seconds": round(contenders.compile_seconds, 1)}
    records.append(Record("lamb_compiled_step", compiled, "s", PEER_ADAMW, adamw, "<= 1.6", compiled_config))
    norm, adamw = contenders.race(("grad_norm", "adamw"), warmup, reps)
    note = "LAMB's global gradient-norm pass alone (part of both LAMB steps above); AdamW does not clip"
    norm_config = {**config, "note": note}
    records.append(Record("lamb_gradient_norm_pass", norm, "s", PEER_ADAMW, adamw, None, norm_config))
    every, split = contenders.race(("every_tensor_compiled", "compiled"), warmup, reps)
    note = f"every tensor compiled vs tensors below {compiled_module.COMPILED_MIN_NUMEL} elements eager"
    records.append(
        Record(
            "lamb_compiled_step_every_tensor_compiled",
            every,
            "s",
            "pretrain.optim.Lamb(compile=True)",
            split,
            None,
            {**config, "note": note},
        )
    )
    kernel_numel = (64 if large else 16) << 20
    times = kernel_breakdown(kernel_numel, warmup, reps + 2)
    note = "one tensor; fused AdamW's step on it is the peer"
    kernel_config = {**config, "numel": kernel_numel, "note": note}
    for name in ("direction", "apply", "norm_aten", "norm_dot", "loops_step"):
        if name not in times:  # no numba
            continue
        seconds, peer = times[name], times["adamw"]
        records.append(Record(f"lamb_kernel_{name}", seconds, "s", PEER_ADAMW, peer, None, kernel_config))
    times = marginal_sums(model, warmup, reps + 2)
    note = "row and column sums of g² over every weight matrix (variance_refresh's marginals), one thread"
    records.append(
        Record(
            "onebit_lamb_square_marginals",
            times["numba"] if marginals._numba_marginals() is not None else float("nan"),
            "s",
            "torch ops (pretrain.optim.marginals.torch_add_square_marginals)",
            times["torch"],
            None,
            {**config, "note": note},
        )
    )
    onebit, lamb = contenders.race(("onebit", "lamb"), warmup, reps, keep=("lamb",))
    note = "compute only: one process, so no compressed allreduce and no kappa scaling"
    records.append(
        Record(
            "onebit_lamb_compression_step_n1", onebit, "s", PEER_LAMB, lamb, None, {**config, "note": note}
        )
    )
    default_config = {
        **config,
        "note": note,
        "optimizer": {**ONEBIT_LAMB_ALGORITHM.options(), "variance_refresh": 64},
    }
    onebit, lamb = contenders.race(("onebit_default", "lamb"), warmup, reps, keep=("lamb",))
    records.append(
        Record("onebit_lamb_default_compression_step_n1", onebit, "s", PEER_LAMB, lamb, None, default_config)
    )
    onebit, lamb = contenders.race(("onebit_compiled", "lamb"), warmup, reps)
    records.append(
        Record(
            "onebit_lamb_compiled_compression_step_n1",
            onebit,
            "s",
            PEER_LAMB,
            lamb,
            "<= 1.0",
            {**default_config, "compile": True},
        )
    )
    write_records(results_name("optim", not large), records)
