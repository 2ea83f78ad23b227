"""launch/cli.py: Hydra's and OmegaConf's errors, made by composing the repo's configs, condensed to one
line; the debug switch (`debug=true`, HYDRA_FULL_ERROR=1) and `fail`/`run` around a main."""

from __future__ import annotations

import sys

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

import data.config  # noqa: F401 - registers the schemas the configs extend
import finetune.config
import pretrain.config  # noqa: F401
import results.compare.config  # noqa: F401
from data.config import REPO_ROOT
from launch import cli


def composition_error(config: str, overrides: list[str]) -> Exception:
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        try:
            compose(config_name=config, overrides=overrides)
        except Exception as error:
            return error
    raise AssertionError(f"{config} {overrides} composed")


@pytest.mark.parametrize(
    ("config", "overrides", "expected"),
    [
        (
            "pretrain",
            ["optim=nosuch"],
            "In 'pretrain': Could not find 'optim/nosuch'; "
            "available options in 'optim': adamw, lamb, onebit_adam, onebit_lamb, onebit_lamb_deepspeed",
        ),
        (
            "pretrain",
            ["max_steps=abc"],
            "Error merging override max_steps=abc: "
            "value 'abc' of type 'str' could not be converted to Integer",
        ),
        (
            "pretrain",
            ["nokey=1"],
            "Could not override 'nokey': key 'nokey' not in 'TrainConfig'; "
            "to append to your config use +nokey=1",
        ),
        (
            "pretrain",
            ["+x=1", "+x=2"],
            "Could not append to config. An item is already at 'x'; either remove + prefix: 'x=2'; "
            "or add a second + to add or override 'x': '++x=2'",
        ),
        ("pretrain", ["seed"], "Error parsing override 'seed': missing EQUAL at '<EOF>'"),
        (
            "pretrain",
            ["++a.b=[1,"],
            "Error parsing override '++a.b=[1,': no viable alternative at input '[1,'",
        ),
        (
            "pretrain",
            ["batch.phases.0.global_batch=x"],
            "Error merging override batch.phases.0.global_batch=x: "
            "value 'x' of type 'str' could not be converted to Integer",
        ),
        (
            "prepare",
            ["data=nosuch"],
            "In 'prepare': Could not find 'data/nosuch'; "
            "available options in 'data': hub_tiny, sample, sample_8k, sample_8k_s32, tiny, "
            "wikipedia_bookcorpus",
        ),
        (
            "dashboard",
            ["save=maybe"],
            "Error merging override save=maybe: value 'maybe' is not a valid bool (type str)",
        ),
    ],
)
def test_composition_errors_condense_to_one_line(config: str, overrides: list[str], expected: str):
    error = composition_error(config, overrides)
    assert cli.condense(error) == expected


def test_the_options_list_leaves_out_schemas_and_hydras_hints():
    error = composition_error("finetune", ["task=nosuch"])
    raw = str(error)
    assert "Config search path" in raw and "task_schema" in raw  # what Hydra would print
    line = cli.condense(error)
    assert "\n" not in line and "_schema" not in line and "search path" not in line
    assert line.endswith(
        "available options in 'task': cola, mnli, mrpc, qnli, qqp, rte, squad, squad_v2, sst2, stsb, wnli"
    )


def test_an_omegaconf_error_drops_object_type_and_a_repeated_key():
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        composed = compose(config_name="finetune")  # model_path is ??? (required)
    with pytest.raises(Exception) as caught:
        finetune.config.to_object(composed)
    raw = str(caught.value)
    assert "object_type=" in raw and "full_key: model_path" in raw
    assert cli.condense(caught.value) == (
        "Structured config of type `FinetuneConfig` has missing mandatory value: model_path"
    )


def test_a_full_key_not_named_elsewhere_is_kept():
    cause = ValueError("Value 'x' could not be converted\n    full_key: optim.lr\n    object_type=LambConfig")
    error = ConfigCompositionException("Error merging an override")
    error.__cause__ = cause
    assert (
        cli.condense(error)
        == "Error merging an override: value 'x' could not be converted; full_key: optim.lr"
    )


@pytest.mark.parametrize(
    ("argv", "left", "switch"),
    [
        (["prog", "optim=lamb"], ["prog", "optim=lamb"], None),
        (["prog", "debug=true", "optim=lamb"], ["prog", "optim=lamb"], True),
        (["prog", "-m", "optim=lamb,adamw", "debug=True"], ["prog", "-m", "optim=lamb,adamw"], True),
        (["prog", "+debug=false"], ["prog"], False),
        (["prog", "debug=maybe"], ["prog", "debug=maybe"], None),  # left for Hydra to refuse
        (["prog", "wandb.debug=true"], ["prog", "wandb.debug=true"], None),
    ],
)
def test_the_debug_override_is_taken_off_the_command_line(argv, left, switch):
    assert cli.take_debug_switch(argv) is switch
    assert argv == left


@pytest.fixture
def environment(monkeypatch):
    """Both variables absent, and whatever `run` sets is undone after the test."""
    for name in (cli.FULL_ERROR, cli.CONDENSED):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return monkeypatch


def raising(error: BaseException):
    def main() -> None:
        raise error

    return main


def test_run_prints_one_line_and_exits_2(environment, capsys):
    environment.setattr(sys, "argv", ["pretrain", "nokey=1"])
    error = composition_error("pretrain", ["nokey=1"])
    with pytest.raises(SystemExit) as stop:
        cli.run(raising(error), "pretrain")
    assert stop.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"pretrain: error: {cli.condense(error)}"]
    assert not cli.debug_enabled()  # HYDRA_FULL_ERROR=1 was set for Hydra only


@pytest.mark.parametrize("how", ["override", "environment"])
def test_the_debug_switch_raises_with_the_traceback(environment, how):
    environment.setattr(sys, "argv", ["pretrain", "nokey=1", *(["debug=true"] if how == "override" else [])])
    if how == "environment":
        environment.setenv(cli.FULL_ERROR, "1")
    error = composition_error("pretrain", ["nokey=1"])
    with pytest.raises(ConfigCompositionException):
        cli.run(raising(error), "pretrain")
    assert sys.argv == ["pretrain", "nokey=1"] and cli.debug_enabled()
    with pytest.raises(ValueError, match="bad key"):
        cli.fail("pretrain", ValueError("bad key"))


def test_a_bug_keeps_its_traceback(environment):
    environment.setattr(sys, "argv", ["pretrain"])
    with pytest.raises(ZeroDivisionError):
        cli.run(raising(ZeroDivisionError("a bug")), "pretrain")


def test_fail_is_one_line_and_exit_2(environment, capsys):
    environment.setenv(cli.FULL_ERROR, "1")
    environment.setenv(cli.CONDENSED, "1")  # as `run` leaves them without the debug switch
    with pytest.raises(SystemExit) as stop:
        cli.fail("data.prepare", ValueError("data.shards.chunk_mb must be > 0"))
    assert stop.value.code == 2
    assert capsys.readouterr().err == "data.prepare: error: data.shards.chunk_mb must be > 0\n"
