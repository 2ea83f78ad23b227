"""Data-parallel gradient averaging as a DDP communication hook that the optimizer can switch off.

LAMB/AdamW and the 1-bit warmup stage: every bucket is mean-allreduced (overlapped with backward, as
plain DDP does). 1-bit compression stage (`optimizer.needs_gradient_allreduce` is False): the hook
returns the local bucket untouched, so gradients are never communicated; the optimizer exchanges the
compressed momentum instead. The trainer sets `enabled` before each step from the optimizer.

`dtype` (`optim.grad_allreduce`): float32 averages exactly; bfloat16/float16 cast each bucket, divide
it by n, allreduce that and copy it back, as DDP's `bf16_compress_hook`/`fp16_compress_hook` do (half
the bytes: the fair baseline on GPUs, issue #15).

At log steps (`measure=True`) the hook also records this rank's squared gradient norm before
averaging, which with the averaged norm gives the gradient noise scale (McCandlish et al. 2018).

Benchmark-only switch: `communicate = False` (never set by training code) makes every step behave like
the compression stage's local path: same hook, same compute, no allreduce, so the ranks' models drift
apart. `bench/net.py` sets it on a built trainer (`trainer.sync.communicate = False`) to measure the
no-communication bound of data-parallel LAMB; it is not a training mode.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at registration.
import time

import torch
import torch.distributed as dist
from torch.distributed import GradBucket

from pretrain.comm.counter import ring_allreduce_bytes
from pretrain.distributed import faults


class GradientSync:
    def __init__(self, group: dist.ProcessGroup | None, world_size: int, dtype: torch.dtype = torch.float32):
        self.group = group
        self.world_size = world_size
        self.dtype = dtype
        self.enabled = True
        self.communicate = True  # benchmark-only: False skips the allreduce on every step (see above)
        self.measure = False
        self.local_square_norm = torch.zeros(())
        self.numel = 0  # elements allreduced in the last step
        self.first_launch: float | None = None
        self.last_done: float | None = None

    def start_step(self, *, enabled: bool, measure: bool) -> None:
        self.enabled, self.measure = enabled, measure
        self.local_square_norm = torch.zeros(())
        self.numel = 0
        self.first_launch = self.last_done = None

    @property
    def seconds(self) -> float:
        """Wall time from the first bucket's launch to the last bucket's completion in this step."""
        if self.first_launch is None or self.last_done is None:
            return 0.0
        return self.last_done - self.first_launch

    @property
    def bytes_sent(self) -> float:
        """Bytes this rank put on the wire this step (ring allreduce model, in `dtype`)."""
        if self.world_size == 1:
            return 0.0
        return ring_allreduce_bytes(self.numel, self.dtype.itemsize, self.world_size)

    @staticmethod
    def hook(state: "GradientSync", bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        if state.measure:
            state.local_square_norm = state.local_square_norm.to(buffer.device) + buffer.float().pow(2).sum()
        if not state.enabled or not state.communicate or state.world_size == 1:
            future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            future.set_result(buffer)
            return future
        if state.first_launch is None:
            state.first_launch = time.perf_counter()
            # test-only (pretrain/distributed/faults.py): the step's first bucket
            faults.inside("grad_allreduce")
        state.numel += buffer.numel()
        if buffer.dtype == state.dtype:
            sent = buffer.div_(state.world_size)
        else:  # DDP's compression hooks: cast, divide, allreduce, cast back into the bucket
            sent = buffer.to(state.dtype).div_(state.world_size)
        work = dist.all_reduce(sent, group=state.group, async_op=True)

        def done(fut: torch.futures.Future) -> torch.Tensor:
            state.last_done = time.perf_counter()
            reduced = fut.value()[0]
            return reduced if reduced is buffer else buffer.copy_(reduced)

        return work.get_future().then(done)
