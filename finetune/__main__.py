"""`python -m finetune` — fine-tune a BERT checkpoint on SQuAD v1.1/v2.0 or a GLUE task (Hydra).

    python -m finetune task=mrpc model_path=results/runs/<run>/checkpoints/step-00001000/hf
    python -m finetune task=squad model_path=<HF BERT folder> seeds=[1,2,3]
    python -m finetune task=squad_v2 model_path=results/runs/<run> data_dir=null task.train_split=train
    python -m finetune task=rte model_path=<HF folder> task.init_from=<an MNLI fine-tune's model folder>
    python -m finetune -m task=cola,sst2,mrpc,stsb,qqp,mnli,qnli,rte,wnli model_path=...   # all of GLUE
    torchrun --standalone --nproc-per-node 8 -m finetune task=squad model_path=...         # data parallel

Local data (the layout of ../shared/data) by default; `data_dir=null` reads the Hugging Face hub.
Rank 0 first prints a pre-flight header (finetune/preflight.py): task, model folder, devices, batch, data
source, output folder, W&B mode; its problems stop every rank before anything is built.
Exit codes: 0 done, 2 bad config, model folder or data (one-line error; `debug=true` shows the traceback).
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from data.documents import DataError
from finetune.config import FinetuneConfig, to_object
from launch import cli


@hydra.main(config_path="../conf", config_name="finetune", version_base="1.3")
def main(dict_cfg: DictConfig) -> None:
    from finetune.runner import run_finetune
    from pretrain.distributed.process_group import init_distributed, shutdown_distributed

    try:
        cfg = to_object(dict_cfg)
        preflight_header(cfg)
        env = init_distributed()
        try:
            run_finetune(cfg, env)
        finally:
            shutdown_distributed()
    except (DataError, ValueError) as error:
        cli.fail("finetune", error)


def preflight_header(cfg: FinetuneConfig) -> None:
    """The pre-flight report (finetune/preflight.py) from the launcher's rank 0, before anything is built;
    its errors stop every rank (each computes the same report) with the one-line message."""
    from finetune.preflight import build

    build(cfg).as_header()


if __name__ == "__main__":
    cli.run(main, "finetune")
