"""`python -m pretrain` — pretrain BERT with LAMB / 1-bit LAMB / AdamW / 1-bit Adam (Hydra).

    python -m pretrain batch=demo optim=onebit_lamb model=bert_tiny data_dir=data/prepared/tiny
    torchrun --standalone --nproc-per-node 8 -m pretrain batch=64k optim=onebit_lamb model=bert_large
    python -m pretrain batch=64k optim=onebit_lamb model=bert_large dry_run=true   # validate a config
    python -m pretrain -m optim=lamb,onebit_lamb batch=8k,16k                    # Hydra multirun

Exit codes: 0 done, 2 bad config/data/checkpoint (one-line error), 75 checkpointed on SIGTERM/SIGUSR1,
76 a peer rank died or stalled inside a collective (one line naming it; requeue to resume).
"""

from __future__ import annotations

import os
import signal
import sys

import hydra
from omegaconf import DictConfig

from data.documents import DataError
from launch import cli
from pretrain.config import TrainConfig, to_object


@hydra.main(config_path="../conf", config_name="pretrain", version_base="1.3")
def main(dict_cfg: DictConfig) -> None:
    from pretrain.distributed.liveness import PEER_LOST_EXIT_CODE, PeerLost, watch
    from pretrain.distributed.process_group import init_distributed, shutdown_distributed
    from pretrain.train.trainer import PREEMPTED_EXIT_CODE, Preempted, Trainer

    try:
        cfg = to_object(dict_cfg)
        preflight_header(cfg)
        env = init_distributed(timeout_s=cfg.dist.timeout_s)
        trainer: Trainer | None = None
        try:
            with watch(env, cfg.dist, lambda: trainer.state.global_step + 1 if trainer else 0, cfg.run_dir):
                trainer = Trainer(cfg, env)
                trainer.fit()
        except PeerLost as lost:
            # a peer is gone: tearing the process group down could wait on it, and what must survive (the
            # newest checkpoint) is on disk already
            print(f"pretrain: error: {lost}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(PEER_LOST_EXIT_CODE)
        finally:
            shutdown_distributed()
    except Preempted as stop:
        print(f"pretrain: {stop}", file=sys.stderr)
        # The checkpoint is written: a further SIGTERM (torchrun's agent sends one as soon as another rank
        # exits) must not turn exit code 75 into death by signal while the interpreter shuts down.
        for signum in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(signum, signal.SIG_IGN)
        sys.exit(PREEMPTED_EXIT_CODE)
    except (DataError, ValueError) as error:
        cli.fail("pretrain", error)


def preflight_header(cfg: TrainConfig) -> None:
    """The pre-flight report (pretrain/tools/preflight.py) from the launcher's rank 0, before anything is
    built;
    its errors stop every rank (each computes the same report) with the one-line message. Skipped when the
    launcher ran it for this world size before starting the workers (launch/common.sh): it printed both."""
    from pretrain.tools.preflight import build, checked_by_launcher

    if not checked_by_launcher():
        build(cfg).as_header()


if __name__ == "__main__":
    cli.run(main, "pretrain")
