"""Plumbing shared by our optimizers: fp32 master weights, skip-on-overflow bookkeeping, checkpoints.

Contracts every optimizer here keeps:
- Math runs in fp32. A bf16/fp16 parameter gets an fp32 master copy in `state[p]["master_param"]`; the
  step updates the master and copies it back into the parameter. Gradients are read in fp32.
- `step()` first looks at the gradients; if any is Inf/NaN it changes nothing, counts the step in
  `num_skipped_steps` and sets `last_step_skipped` (the 1-bit optimizers agree on this across ranks).
- `mark_gradients_checked(norm)` before `step()`: the caller has MAX-allreduced that no rank's gradients hold
  Inf/NaN and (optionally) passes the global norm it computed of these same `.grad`s; the step then neither
  checks again nor reads the gradients for their norm (one step only; `take_caller_check`).
- `needs_gradient_allreduce` says whether the trainer must average the gradients over the data-parallel
  group before the next `step()` (always True here; the 1-bit optimizers turn it off).
- The training loop's interface, `pretrain.optim.protocol.TrainingOptimizer`: the two above,
  `last_step_skipped`, `bytes_sent` (0 here), `start_phase` (nothing to do here) and `statistics()`.
- `state_dict()`/`load_state_dict()` keep tensor dtypes (torch's default loader would cast fp32 state to a
  bf16 parameter's dtype) and never restore `exp_avg_mask` from a checkpoint: the current run's masks win.
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from pretrain.optim import functional as F
from pretrain.optim.kernel_path import KernelPath, kernel_path

# Param-group keys owned by the current run's configuration, never taken from a checkpoint.
RUN_OWNED_GROUP_KEYS = ("params", "exp_avg_mask")
EXTRA_STATE_KEY = "extra"
# The parts of a `state_dict()` that are the same on every data-parallel rank: the per-parameter state
# (moments, frozen variance, coefficients) follows the synchronized gradients or the compressed average,
# which every rank receives bitwise alike, and the groups hold the schedule's hyperparameters. What differs
# per rank (the 1-bit error feedback, local momenta) lives under EXTRA_STATE_KEY.
REPLICATED_STATE_KEYS = ("state", "param_groups")


def split_replicated(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A `state_dict()` (this module's optimizers or torch's) as (replicated, this rank's own); the union
    of the two is the state dict. Checkpoints write the replicated part once (`pretrain.checkpoint`)."""
    replicated = {key: value for key, value in state_dict.items() if key in REPLICATED_STATE_KEYS}
    own = {key: value for key, value in state_dict.items() if key not in REPLICATED_STATE_KEYS}
    return replicated, own


def evaluate_closure(closure: Callable[[], Any] | None) -> Any:
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def global_norm(per_tensor_norms: Tensor) -> Tensor:
    """√Σ‖g_i‖², fp32 scalar; non-finite iff some gradient holds Inf/NaN (or the sum overflows fp32)."""
    return torch.linalg.vector_norm(per_tensor_norms.float())


def global_grad_norm(grads: list[Tensor]) -> Tensor:
    """√Σ‖g_i‖² over the tensors themselves, fp32 scalar, non-finite as `global_norm`.

    fp32 tensors on the CPU path: one BLAS dot product per tensor, which reads memory ~1.7× as fast as
    ATen's norm kernel there (one read stream per thread; `bench optim`'s `lamb_gradient_norm_pass`; the
    sums differ in rounding only). Elsewhere the multi-tensor norm kernel: one launch for all tensors."""
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    on_cpu_path = kernel_path(grads[0].device) is KernelPath.cpu
    if on_cpu_path and grads[0].device.type == "cpu" and all(g.dtype == torch.float32 for g in grads):
        flat = [g.t().reshape(-1) if _column_major(g) else g.reshape(-1) for g in grads]  # views
        return torch.stack([torch.dot(g, g) for g in flat]).sum().sqrt()
    return global_norm(F.grad_norms(grads))


# On the CPU path (`kernel_path`), updates run over chunks of consecutive tensors of about this many
# elements: the scratch stays small and a chunk's several passes hit the cache. On the multi-tensor path
# a chunk is a whole group (a number of kernel launches that does not grow with the tensors; memory
# bandwidth is what counts there).
CPU_CHUNK_NUMEL = 1 << 20


class Workspace:
    """fp32 scratch reused by every step, never freed in between: allocating and freeing hundreds of MB
    per step costs more than the math on CPU (page faults), and the math wants no allocation anyway."""

    def __init__(self, chunk_numel: int | None = None) -> None:
        self.chunk_numel = chunk_numel
        self._buffer: Tensor | None = None
        self._counts: dict[tuple[torch.device, tuple[int, ...]], Tensor] = {}

    def chunks(self, tensors: list[Tensor]) -> list[slice]:
        """Consecutive index ranges of at most `chunk_numel` elements (a bigger tensor stands alone)."""
        limit = self.chunk_numel
        if limit is None and tensors and kernel_path(tensors[0].device) is KernelPath.cpu:
            limit = CPU_CHUNK_NUMEL
        if limit is None:
            return [slice(0, len(tensors))]
        spans, start, size = [], 0, 0
        for index, tensor in enumerate(tensors):
            if index > start and size + tensor.numel() > limit:
                spans.append(slice(start, index))
                start, size = index, 0
            size += tensor.numel()
        spans.append(slice(start, len(tensors)))
        return spans

    def counts(self, tensors: list[Tensor]) -> Tensor:
        """The tensors' numels as an int64 tensor on their device (`functional.per_tensor`), made once
        per list of sizes: a copy to the device each step would wait for it."""
        key = (tensors[0].device, tuple(t.numel() for t in tensors))
        if key not in self._counts:
            self._counts[key] = torch.tensor(key[1], dtype=torch.int64, device=key[0])
        return self._counts[key]

    def flat(self, numel: int, device: torch.device) -> Tensor:
        """The first `numel` elements of the buffer (grown if needed)."""
        if self._buffer is None or self._buffer.numel() < numel or self._buffer.device != device:
            self._buffer = torch.empty(numel, dtype=torch.float32, device=device)
        return self._buffer[:numel]

    def views(self, tensors: list[Tensor]) -> list[Tensor]:
        """Scratch views shaped (and strided) like `tensors`, all from one buffer."""
        return views_like(self.flat(sum(t.numel() for t in tensors), tensors[0].device), tensors)


def views_like(flat: Tensor, tensors: list[Tensor]) -> list[Tensor]:
    """Consecutive views of the 1-D `flat`, one per tensor, with its shape and memory order: a row-major
    tensor's view is row-major, a column-major matrix's (`pretrain.model.column_major_linear_weights_`)
    column-major; any other tensor's view is row-major. Elementwise ops between tensors of one memory
    order run at contiguous speed; mixing them reads one side transposed."""
    views, offset = [], 0
    for t in tensors:
        piece = flat[offset : offset + t.numel()]
        views.append(piece.view(t.shape[1], t.shape[0]).t() if _column_major(t) else piece.view(t.shape))
        offset += t.numel()
    return views


def flat_views(*tensors: Tensor) -> list[Tensor]:
    """The tensors' elements in memory order as 1-D views (`view(-1)`, or a column-major matrix's
    transpose's), for the compiled kernels, which take every tensor flat: element i of one is element i
    of the others only if all share one memory order, which is checked (ValueError otherwise)."""
    orders = [_row_major(t) for t in tensors]
    if len(set(orders)) > 1:
        raise ValueError(f"tensors of one step in different memory orders: {[t.stride() for t in tensors]}")
    return [t.view(-1) if row_major else t.t().view(-1) for t, row_major in zip(tensors, orders)]


def _column_major(t: Tensor) -> bool:
    """A matrix whose transpose is contiguous and which is not contiguous itself."""
    return t.dim() == 2 and not t.is_contiguous() and t.t().is_contiguous()


def _row_major(t: Tensor) -> bool:
    """True for a contiguous tensor, False for a column-major matrix; anything else is refused."""
    if t.is_contiguous():
        return True
    if t.dim() == 2 and t.t().is_contiguous():
        return False
    raise ValueError(
        f"optimizer tensors must be row-major, or column-major matrices; got strides {t.stride()}"
    )


def chunked(
    workspace: Workspace,
    update: Callable[..., Tensor | None],
    tensor_lists: list[list[Tensor]],
    per_tensor: tuple[Tensor, ...] = (),
    *,
    expand: bool = False,
    **kwargs: Any,
) -> Tensor | None:
    """Apply a list update (`functional`) chunk by chunk with `workspace` scratch. `tensor_lists[0]`
    decides the chunks; `per_tensor` 1-D values are sliced alike; per-tensor results concatenated.
    `expand`: the update takes `counts` (`functional.per_tensor`), given on the multi-tensor path."""
    results = []
    for span in workspace.chunks(tensor_lists[0]):
        chunk = tensor_lists[0][span]
        if expand and kernel_path(chunk[0].device) is KernelPath.multi_tensor:
            kwargs["counts"] = workspace.counts(chunk)
        results.append(
            update(
                *(tensors[span] for tensors in tensor_lists),
                *(values[span] for values in per_tensor),
                workspace=workspace.views(chunk),
                **kwargs,
            )
        )
    return None if results[0] is None else torch.cat(results)  # type: ignore[arg-type]


class OptimizerBase(torch.optim.Optimizer):
    """torch.optim.Optimizer plus the contracts in this module's docstring."""

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any]) -> None:
        super().__init__(params, defaults)
        self.num_skipped_steps = 0
        self.last_step_skipped = False
        self.workspace = Workspace()
        self._caller_check: tuple[Tensor | None] | None = None  # mark_gradients_checked() before this step

    @property
    def needs_gradient_allreduce(self) -> bool:
        """Whether the trainer must allreduce (mean) the gradients before the next `step()`."""
        return True

    @property
    def bytes_sent(self) -> float:
        """Bytes this rank sent inside `step()` so far: none (the trainer averages the gradients)."""
        return 0.0

    def start_phase(self, *, freeze_step: int | None, max_seq_length: int) -> None:
        """A training phase starts (`TrainingOptimizer.start_phase`): nothing changes here."""

    def mark_gradients_checked(self, grad_norm: Tensor | None = None) -> None:
        """The caller has MAX-allreduced whether any rank's `.grad` holds Inf/NaN and found none (the
        trainer's loss scaler, every step); `grad_norm`, if given, is the global norm it computed of these
        same (unscaled) gradients, `global_grad_norm` of them. The next `step()` uses both instead of
        reading the gradients again for their norm (a full pass over them, a host sync, for the 1-bit
        optimizers an allreduce). One step only."""
        self._caller_check = (grad_norm,)

    def take_caller_check(self) -> tuple[bool, Tensor | None]:
        """(whether the caller checked this step's gradients, the norm it passed or None); clears both."""
        check, self._caller_check = self._caller_check, None
        return (False, None) if check is None else (True, check[0])

    def statistics(self) -> dict[str, float]:
        """A few numbers for the metrics log (host syncs: call at log steps only)."""
        return {"skipped_steps": float(self.num_skipped_steps)}

    # -- fp32 views ------------------------------------------------------------------------------------
    def _fp32_param(self, param: Tensor) -> Tensor:
        """The fp32 tensor the math updates: the parameter itself, or its fp32 master (created lazily)."""
        if param.dtype == torch.float32:
            return param
        state = self.state[param]
        if "master_param" not in state:
            state["master_param"] = param.detach().float()
        return state["master_param"]

    @staticmethod
    def _fp32_grad(param: Tensor) -> Tensor:
        grad = param.grad
        if grad is None:
            return torch.zeros_like(param, dtype=torch.float32)
        if grad.is_sparse:
            raise ValueError("sparse gradients are not supported")
        return grad if grad.dtype == torch.float32 else grad.float()

    def _chunked(
        self,
        update: Callable[..., Tensor | None],
        tensor_lists: list[list[Tensor]],
        per_tensor: tuple[Tensor, ...],
        **kwargs: Any,
    ) -> Tensor | None:
        """`chunked` with this optimizer's workspace."""
        return chunked(self.workspace, update, tensor_lists, per_tensor, **kwargs)

    def _copy_masters_back(self, params: list[Tensor]) -> None:
        low_precision = [p for p in params if p.dtype != torch.float32]
        if low_precision:
            torch._foreach_copy_(low_precision, [self.state[p]["master_param"] for p in low_precision])

    def _record_skip(self, skip: bool) -> bool:
        self.last_step_skipped = skip
        self.num_skipped_steps += int(skip)
        return skip

    # -- checkpoints -----------------------------------------------------------------------------------
    def _extra_state(self) -> dict[str, Any]:
        return {"num_skipped_steps": self.num_skipped_steps}

    def _load_extra_state(self, extra: dict[str, Any]) -> None:
        self.num_skipped_steps = int(extra.get("num_skipped_steps", 0))

    def state_dict(self) -> dict[str, Any]:
        """torch's layout ({"state": {index: {...}}, "param_groups": [...]}) without `exp_avg_mask`, plus
        {"extra": {...}} from `_extra_state()`. Tensors are the live state tensors, not copies."""
        state_dict = super().state_dict()
        state_dict["param_groups"] = [
            {k: v for k, v in group.items() if k != "exp_avg_mask"} for group in state_dict["param_groups"]
        ]
        state_dict[EXTRA_STATE_KEY] = self._extra_state()
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a `state_dict()`: tensors are copied onto each parameter's device keeping their dtype;
        group hyperparameters come from the checkpoint except `exp_avg_mask` (the current run's)."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
            len(saved["params"]) != len(group["params"])
            for saved, group in zip(saved_groups, self.param_groups)
        ):
            raise ValueError("optimizer checkpoint has a different parameter-group layout than this model")
        by_index = {
            index: param
            for saved, group in zip(saved_groups, self.param_groups)
            for index, param in zip(saved["params"], group["params"])
        }
        for saved, group in zip(saved_groups, self.param_groups):
            group.update({k: copy.deepcopy(v) for k, v in saved.items() if k not in RUN_OWNED_GROUP_KEYS})
        self.state = defaultdict(dict)
        for index, param_state in state_dict["state"].items():
            param = by_index[index]
            self.state[param] = {
                key: value.to(device=param.device, copy=True) if isinstance(value, Tensor) else value
                for key, value in param_state.items()
            }
        self._load_extra_state(state_dict.get(EXTRA_STATE_KEY, {}))


def is_finite(value: Tensor) -> bool:
    """Host-side check of a scalar tensor (one device sync)."""
    return math.isfinite(float(value))
