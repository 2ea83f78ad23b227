"""results/cpu-study-m/lamb_state.py: a 1-bit LAMB checkpoint after the freeze, resumed by optim=lamb.

The demo recipe's tiny 1-bit LAMB run (2 simulated workers) is checkpointed after its freeze and converted;
LAMB's moments are the 1-bit run's m̂ and v̂ in LAMB's raw form (its bias correction gives them back), name
by name though the two optimizers group the tensors differently; LAMB resumes from it at that step with the
weights, LR and data cursor carried over, and trains on. Converted at the freeze step itself, where 1-bit
LAMB's state is LAMB's, LAMB's continuation is LAMB's own run to rounding.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import yaml
from transformers import BertConfig, BertForPreTraining

from launch.local import run_local
from pretrain.checkpoint import CheckpointError, load_checkpoint
from pretrain.optim.params import param_groups
from pretrain.tools.frozen_state import _ordered
from tests.integration.pretrain_helpers import read_metrics, tiny_run_overrides, train_worker

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parents[2] / "results" / "cpu-study-m" / "lamb_state.py"
spec = importlib.util.spec_from_file_location("lamb_state", SCRIPT)
assert spec and spec.loader
lamb_state = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lamb_state)

STEP = 14  # the demo recipe freezes at step 12


def train(overrides: list[str]) -> None:
    run_local(train_worker, 1, (overrides,))


def _named_states(checkpoint: Path, order: list[str]) -> tuple[dict[str, dict], list[dict]]:
    model = BertForPreTraining(BertConfig.from_pretrained(checkpoint / "hf"))
    optimizer = load_checkpoint(checkpoint, 0, model)[0]["optimizer"]
    return {name: optimizer["state"][index] for index, name in enumerate(order)}, optimizer["param_groups"]


def test_lamb_resumes_from_the_defaults_state(
    tiny_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    common = ("sim_world_size=2", "checkpoint.export_hf=true", f"checkpoint.every_steps={STEP}")
    source_run = tmp_path / "onebit"
    train(tiny_run_overrides(tiny_data, source_run, "onebit_lamb", *common, f"max_steps={STEP}"))
    source = source_run / "checkpoints" / f"step-{STEP:08d}"
    target_run = tmp_path / "lamb"
    target = target_run / "checkpoints" / source.name
    run_config = yaml.safe_load((source_run / "config.yaml").read_text())
    assert lamb_state.main([str(source), str(source_run / "config.yaml"), str(target)]) == 0
    assert (target / "COMPLETE").is_file() and not target.with_name(target.name + ".tmp").exists()

    model = BertForPreTraining(BertConfig.from_pretrained(source / "hf"))
    onebit, onebit_groups = _named_states(source, [name for name, _ in _ordered(model, run_config)])
    names = {id(p): name for name, p in model.named_parameters()}
    lamb_order = [names[id(p)] for group in param_groups(model, 0.01) for p in group["params"]]
    lamb, lamb_groups = _named_states(target, lamb_order)
    assert len(onebit_groups) > len(lamb_groups) == 2  # the tensors are grouped differently
    assert set(lamb) == set(onebit)
    step = lamb_groups[0]["step"]
    assert step == STEP and {g["lr"] for g in lamb_groups} == {onebit_groups[0]["lr"]}
    for name, state in lamb.items():
        assert set(state) == {"exp_avg", "exp_avg_sq"}
        for key, beta in (("exp_avg", 0.9), ("exp_avg_sq", 0.999)):
            torch.testing.assert_close(state[key] / (1 - beta**step), onebit[name][key].contiguous())
    with pytest.raises(CheckpointError, match="exists"):
        lamb_state.lamb_checkpoint(source, run_config, target)

    def two_schedules(*args, **kwargs):  # one group's LR off the others': not one schedule to carry over
        state, *rest = load_checkpoint(*args, **kwargs)
        state["optimizer"]["param_groups"][1]["lr"] *= 2
        return (state, *rest)

    with monkeypatch.context() as patched:
        patched.setattr(lamb_state, "load_checkpoint", two_schedules)
        with pytest.raises(CheckpointError, match="groups differ in step, LR or betas"):
            lamb_state.lamb_checkpoint(source, run_config, tmp_path / "two")
    assert not (tmp_path / "two").exists() and not (tmp_path / "two.tmp").exists()

    train(tiny_run_overrides(tiny_data, target_run, "lamb", *common, f"max_steps={STEP + 4}"))
    steps = [m["step"] for m in read_metrics(target_run) if "loss" in m]
    assert steps == list(range(STEP + 1, STEP + 5))  # resumed at the checkpoint's step, with LAMB's rule
    assert all(m["lr"] < onebit_groups[0]["lr"] for m in read_metrics(target_run) if "lr" in m)


def test_a_checkpoint_before_the_freeze_is_refused(tiny_data: Path, tmp_path: Path):
    common = ("sim_world_size=2", "checkpoint.export_hf=true", "checkpoint.every_steps=4", "max_steps=4")
    run = tmp_path / "early"
    train(tiny_run_overrides(tiny_data, run, "onebit_lamb", *common))
    config = yaml.safe_load((run / "config.yaml").read_text())
    with pytest.raises(CheckpointError, match="before the freeze"):
        lamb_state.lamb_checkpoint(run / "checkpoints" / "step-00000004", config, tmp_path / "out")


FREEZE = 12  # the demo recipe's freeze_step
END = FREEZE + 6


def losses(run: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(run) if "loss" in m}


def test_lamb_from_the_freeze_is_lambs_own_run(tiny_data: Path, tmp_path: Path):
    """1-bit LAMB's warmup is LAMB's rule: converted at the freeze step and continued by LAMB, it is LAMB's
    own run from step 0 to rounding."""
    common = ("sim_world_size=2", "checkpoint.export_hf=true", f"checkpoint.every_steps={FREEZE}")
    source_run, converted_run, lamb_run = tmp_path / "onebit", tmp_path / "converted", tmp_path / "lamb"
    train(tiny_run_overrides(tiny_data, source_run, "onebit_lamb", *common, f"max_steps={FREEZE}"))
    source = source_run / "checkpoints" / f"step-{FREEZE:08d}"
    target = converted_run / "checkpoints" / source.name
    assert lamb_state.main([str(source), str(source_run / "config.yaml"), str(target)]) == 0
    train(tiny_run_overrides(tiny_data, converted_run, "lamb", *common, f"max_steps={END}"))
    train(tiny_run_overrides(tiny_data, lamb_run, "lamb", "sim_world_size=2", f"max_steps={END}"))
    lamb, warmup, converted = losses(lamb_run), losses(source_run), losses(converted_run)
    assert sorted(converted) == list(range(FREEZE + 1, END + 1))
    for step in range(1, FREEZE + 1):
        assert warmup[step] == pytest.approx(lamb[step], rel=1e-5)
    for step in converted:  # a v off by LAMB's bias correction (1 - 0.999^12) moves step 13 by 7e-4
        assert converted[step] == pytest.approx(lamb[step], rel=1e-5)
