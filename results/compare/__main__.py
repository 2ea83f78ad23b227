"""`python -m results.compare` — compare pretraining runs: report, plots and summary.json (Hydra).

    python -m results.compare study=demo runs='[results/runs/demo-lamb,results/runs/demo-onebit_lamb]'
    python -m results.compare study=cpu runs='[results/runs/cpu-*]' target_loss=6.5 smoothing=0.8
    python -m results.compare study=wb wandb.source=wandb wandb.entity=<team> wandb.group=64k

Writes results/<study>/ (report.md, summary.json, *.png). Exit codes: 0 done, 2 bad config or input
(one-line error naming the file, line or key).
"""

from __future__ import annotations

import shlex
import sys

import hydra
from omegaconf import DictConfig

from launch import cli
from results.compare.config import to_object


@hydra.main(config_path="../../conf", config_name="compare", version_base="1.3")
def main(dict_cfg: DictConfig) -> None:
    from omegaconf.errors import MissingMandatoryValue

    from results.compare import CompareError, run_compare

    try:
        try:
            cfg = to_object(dict_cfg)
        except MissingMandatoryValue as missing:
            raise ValueError(f"{missing.full_key} is required ({missing.full_key}=<value>)") from None
        invocation = shlex.join(["python", "-m", "results.compare", *sys.argv[1:]])
        report = run_compare(cfg, invocation)
    except (CompareError, ValueError) as error:
        cli.fail("compare", error)
    print(f"compare: {report} (+ summary.json and plots in {report.parent})")


if __name__ == "__main__":
    cli.run(main, "compare")
