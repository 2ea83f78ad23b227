"""What counts as a lost peer (exit 76, requeue) and what does not."""

from __future__ import annotations

import pytest

from pretrain.distributed.liveness import is_comm_failure


@pytest.mark.parametrize(
    "text",
    [
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5678",
        "[c10d] Timed out waiting 10000ms for recv operation to complete",
        "NCCL communicator was aborted on rank 1",
    ],
)
def test_collective_errors_are_comm_failures(text: str):
    assert is_comm_failure(RuntimeError(text))


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("DataLoader timed out after 60 seconds"),  # a slow reader: a plain error, not exit 76
        RuntimeError("CUDA out of memory"),
        ValueError("gloo"),  # only runtime errors from c10d carry these words
    ],
)
def test_other_errors_are_not(error: Exception):
    assert not is_comm_failure(error)
