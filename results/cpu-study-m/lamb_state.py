"""A 1-bit LAMB checkpoint as a LAMB checkpoint: the default's state at a step, continued by LAMB's rule.

    .venv/bin/python results/cpu-study-m/lamb_state.py SOURCE RUN_CONFIG TARGET

SOURCE is a finished checkpoint of an `optim=onebit_lamb` run after its freeze (`<run>/checkpoints/step-N`),
RUN_CONFIG that run's `config.yaml`, TARGET a new checkpoint folder (`<other run>/checkpoints/step-N`) that
`optim=lamb` resumes from (results/cpu-study-m/README.md, "Screens": `screen.sh NAME STEP END lamb`). What
is carried over: the weights; per parameter (matched by name: the two optimizers group the tensors
differently) the momentum and the variance, as LAMB keeps them: after the freeze 1-bit LAMB holds the
bias-corrected m̂ and v̂ (the refreshed, frozen v), so LAMB's raw moments are m̂·(1−β1^t) and v̂·(1−β2^t) and
its next step's bias correction gives m̂ and v̂ back; the step count, the LR and the scheduler (one entry per
LAMB group); the data cursor, the RNG streams (every rank's, the simulated workers' too) and the loss scale.
What is not: the workers' and servers' error feedback and the refresh's sums (LAMB has none), the frozen
pre-normalization factor (LAMB's is live: m̂ and v̂ stay in the units of the frozen factor's gradients, and
v relaxes into LAMB's with β2, a time constant of 1,000 steps). A study's tool, not a product feature.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import yaml
from transformers import BertConfig, BertForPreTraining

from pretrain.checkpoint import CheckpointError, load_checkpoint
from pretrain.checkpoint import _sha256 as sha256
from pretrain.optim import build_optimizer
from pretrain.optim.base import split_replicated
from pretrain.optim.config import LambConfig
from pretrain.optim.params import param_groups
from pretrain.tools.frozen_state import _ordered as optimizer_order

COPIED = ("model.safetensors",)


def lamb_checkpoint(source: Path, run_config: dict[str, Any], target: Path) -> None:
    """Write `target` (via `target.tmp`, renamed when complete) from the 1-bit LAMB checkpoint `source`."""
    if run_config["optim"]["name"] != "onebit_lamb":
        raise CheckpointError(f"{source}: optim.name is {run_config['optim']['name']}, not onebit_lamb")
    if target.exists():
        raise CheckpointError(f"{target}: exists")
    model = BertForPreTraining(BertConfig.from_pretrained(source / "hf"))
    ranks = sorted(source.glob("rank-*.pt"))
    states = [load_checkpoint(source, int(path.stem.split("-")[1]), model)[0] for path in ranks]
    saved = states[0]["optimizer"]
    named = optimizer_order(model, run_config)
    if len(named) != len(saved["state"]):
        raise CheckpointError(f"{source}: {len(saved['state'])} optimizer states for {len(named)} parameters")
    if "exp_avg_sq_fresh" not in saved["state"][0]:
        raise CheckpointError(f"{source}: before the freeze (no frozen variance): LAMB's own state then")
    moments = {name: saved["state"][index] for index, (name, _) in enumerate(named)}
    seen = {(g["step"], g["lr"], g["initial_lr"], tuple(g["betas"])) for g in saved["param_groups"]}
    if len(seen) != 1:
        raise CheckpointError(
            f"{source}: the optimizer's groups differ in step, LR or betas (not one schedule)"
        )
    ((step, lr, initial_lr, (beta1, beta2)),) = seen

    config = LambConfig(beta1=beta1, beta2=beta2, weight_decay=run_config["optim"]["weight_decay"])
    groups = param_groups(model, config.weight_decay)
    lamb = build_optimizer("lamb", config, groups)
    names = {id(param): name for name, param in model.named_parameters()}
    for lamb_group in lamb.param_groups:
        lamb_group.update(step=step, lr=lr, initial_lr=initial_lr)
        for param in lamb_group["params"]:
            state = moments[names[id(param)]]
            lamb.state[param] = {
                "exp_avg": state["exp_avg"].contiguous() * (1.0 - beta1**step),
                "exp_avg_sq": state["exp_avg_sq"].contiguous() * (1.0 - beta2**step),
            }
    replicated, own = split_replicated(lamb.state_dict())

    shared = torch.load(source / "train_state.pt", map_location="cpu", weights_only=True)
    shared["optim_options"] = config.options()
    scheduler = shared["lr_scheduler"]
    for key in ("base_lrs", "_last_lr", "lr_lambdas"):
        if len({repr(value) for value in scheduler[key]}) != 1:
            raise CheckpointError(f"{source}: the LR scheduler's groups differ ({key}): not one schedule")
        scheduler[key] = scheduler[key][: len(lamb.param_groups)]

    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in COPIED:
        shutil.copy2(source / name, tmp / name)
    shutil.copytree(source / "hf", tmp / "hf")
    torch.save({"optimizer": replicated}, tmp / "replicated.pt")
    torch.save(shared, tmp / "train_state.pt")
    for path, state in zip(ranks, states, strict=True):
        rank_state = {key: value for key, value in state.items() if key != "optimizer"}
        rank_state["optimizer"] = own
        torch.save(rank_state, tmp / path.name)
    sums = {path.name: sha256(path) for path in sorted(tmp.iterdir()) if path.is_file()}
    (tmp / "checksums.json").write_text(json.dumps({"sha256": sums}, indent=1) + "\n")
    (tmp / "COMPLETE").write_text("")
    tmp.rename(target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a 1-bit LAMB checkpoint after the freeze")
    parser.add_argument("run_config", type=Path, help="its run's config.yaml")
    parser.add_argument("target", type=Path, help="the LAMB checkpoint folder to write")
    args = parser.parse_args(argv)
    try:
        lamb_checkpoint(args.source, yaml.safe_load(args.run_config.read_text()), args.target)
    except (CheckpointError, OSError, KeyError) as error:
        print(f"lamb_state.py: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
