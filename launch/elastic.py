"""torchrun whose failure report is the workers' own: `python -m launch.elastic <torchrun arguments>`.

    python -m launch.elastic --standalone --nproc-per-node 2 -m pretrain batch=demo model=bert_tiny

The launchers (launch/torchrun.sh, launch/multinode.sh) run this instead of `python -m torch.distributed.run`.
The agent is torchrun's own, run with the same arguments (rendezvous, restarts, signals, error files); only
the end of a failed run differs. torchrun ends it with its own traceback, the ~20-line `ChildFailedError`
table and exit code 1 whatever the workers exited with, which buries the one line a worker printed.
Here, when the first failed worker (torchrun's root cause) exited with a code whose meaning it printed in
one line itself (`REPORTED`: 2 a user error, 75 checkpointed on SIGTERM/SIGUSR1, 76 a peer rank lost),
nothing is added: not the table, not the agent's "failed (exitcode: ...)" and "Sending process ... closing
signal" log lines; and the exit code is that worker's, so a caller (SLURM, a requeue script) can tell a
checkpointed stop from a crash. Any other failure (a crash, a rank killed by a signal) prints torchrun's
table without the agent's traceback and exits with the worker's code, or 1 for a signal.

A signal to the agent itself (SIGTERM from `kill`, a container runtime or Slurm's cancel; SIGINT) is passed
to every worker's process group, and the agent waits for them (30 s) before it raises: when every worker
then exited 75 (it checkpointed, and said so in its line) that is the exit code, without the agent's
traceback; otherwise one line names the signal and the workers' exit codes, exit 128 + the signal's number.

Debug switch (launch/cli.py): `debug=true` among the overrides, or HYDRA_FULL_ERROR=1, leaves torchrun's
report as it is.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from launch import cli

CHECKPOINTED = 75  # pretrain/distributed/preemption.py's PREEMPTED_EXIT_CODE
REPORTED = frozenset({2, CHECKPOINTED, 76})
# The agent's own lines about a failed group (torch.distributed.elastic.multiprocessing.api): held back,
# and shown only when the failure is not one the worker reported itself.
_AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"
_FAILURE_MESSAGES = ("failed (exitcode", "Sending process")


class _HoldFailureLines(logging.Filter):
    """Keeps the agent's failure log records back instead of letting them through."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith(_FAILURE_MESSAGES):
            self.held.append(record)
            return False
        return True


@contextmanager
def _workers_exit_codes_at_shutdown() -> Iterator[dict[int, int | None]]:
    """The workers' exit codes as the agent's shutdown leaves them (local rank -> code; negative: the
    signal that ended it; None: still running): torchrun's agent, signalled, stops its workers and raises
    without them."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    codes: dict[int, int | None] = {}
    shutdown = LocalElasticAgent._shutdown

    def recording_shutdown(agent: LocalElasticAgent, *args, **kwargs) -> None:
        shutdown(agent, *args, **kwargs)
        handlers = getattr(agent._pcontext, "subprocess_handlers", None) or {}
        codes.update({rank: handler.proc.poll() for rank, handler in handlers.items()})

    LocalElasticAgent._shutdown = recording_shutdown  # type: ignore[method-assign,assignment]
    try:
        yield codes
    finally:
        LocalElasticAgent._shutdown = shutdown  # type: ignore[method-assign]


def main(argv: list[str]) -> int:
    """Run torchrun with `argv`; the exit code as described in the module docstring."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
    from torch.distributed.run import main as torchrun_main
    from torch.distributed.run import parse_args, run

    switch = cli.take_debug_switch(["launch.elastic", *argv])  # on a copy: the workers read it too
    if cli.debug_enabled() if switch is None else switch:
        torchrun_main(argv)
        return 0
    agent_logger = logging.getLogger(_AGENT_LOGGER)
    hold = _HoldFailureLines()
    agent_logger.addFilter(hold)
    try:
        with _workers_exit_codes_at_shutdown() as codes:
            record(run)(parse_args(argv))  # record: the error file for a parent agent, as torchrun's main
    except SignalException as signalled:
        if codes and set(codes.values()) == {CHECKPOINTED}:
            return CHECKPOINTED
        name = signal.Signals(signalled.sigval).name
        listed = ", ".join(f"local rank {rank}: {code}" for rank, code in sorted(codes.items()))
        listed = listed or "none started"
        print(f"launch.elastic: {name}: the workers stopped without a checkpoint ({listed})", file=sys.stderr)
        return 128 + int(signalled.sigval)
    except ChildFailedError as failed:
        _, failure = failed.get_first_failure()
        if failure.exitcode in REPORTED:
            return failure.exitcode
        agent_logger.removeFilter(hold)
        for held in hold.held:
            agent_logger.handle(held)
        print(failed, file=sys.stderr, flush=True)
        return failure.exitcode if failure.exitcode > 0 else 1
    finally:
        agent_logger.removeFilter(hold)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
