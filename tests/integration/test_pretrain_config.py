"""Every shipped pretraining recipe composes and builds (zero steps); config errors are one line."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from data.config import REPO_ROOT
from pretrain.config import PhaseConfig
from tests.integration.pretrain_helpers import compose_train_config

pytestmark = pytest.mark.integration

BATCHES = sorted(p.stem for p in (REPO_ROOT / "conf/batch").glob("*.yaml"))
OPTIMS = sorted(p.stem for p in (REPO_ROOT / "conf/optim").glob("*.yaml"))
MODELS = sorted(p.stem for p in (REPO_ROOT / "conf/model").glob("*.yaml"))


def run_pretrain(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pretrain", "wandb.mode=disabled", "show_progress=false", *overrides],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.parametrize(("batch", "optim"), list(itertools.product(BATCHES, OPTIMS)))
def test_recipe_composes(batch: str, optim: str):
    cfg = compose_train_config([f"batch={batch}", f"optim={optim}"])
    assert cfg.batch.name == batch and cfg.optim.name == optim
    phases = cfg.batch.phases
    if batch.startswith("cpu_study_"):
        # the CPU study's stand-ins: phase 1 only, the same samples at every batch, freeze_step ~15-20%,
        # >= 300 compression steps, a global batch that 2, 4, 8 and 32 workers divide
        assert [p.max_seq_length for p in phases] == [32 if batch.startswith("cpu_study_s32") else 128]
        if batch == "cpu_study_long":  # the b128 recipe 7.5x longer (LAMB past the unigram stage)
            assert phases[0].global_batch == 128 and phases[0].steps * 128 == 7.5 * 51200
        elif batch == "cpu_study_s32":  # seq 32: 128 x 32 tokens per step, as the b32 recipe's 32 x 128
            assert phases[0].global_batch == 128 and phases[0].steps * 128 == 409600
        elif batch == "cpu_study_s32_b1024":  # rung B: the seq-32 recipe's samples at batch 1,024
            assert phases[0].global_batch == 1024 and phases[0].steps * 1024 == 409600
        else:
            assert phases[0].global_batch == int(batch.removeprefix("cpu_study_b"))
            assert phases[0].steps * phases[0].global_batch == 51200
        assert 0.15 <= phases[0].freeze_step / phases[0].steps <= 0.22
        assert phases[0].steps - phases[0].freeze_step >= 300
        assert all(phases[0].global_batch % workers == 0 for workers in (2, 4, 8, 32))
        return
    assert [p.max_seq_length for p in phases] == [128, 512]
    if batch != "demo":
        assert phases[0].global_batch == int(batch.removesuffix("k")) * 1024
        assert phases[0].freeze_step is not None and 0.1 <= phases[0].freeze_step / phases[0].steps <= 0.2
        # same samples in every recipe (LEGW keeps the data budget; only the batch changes)
        assert phases[0].steps * phases[0].global_batch == 7038 * 65536


@pytest.mark.parametrize("model", MODELS)
def test_models_compose(model: str):
    assert compose_train_config([f"model={model}"]).model.size.value == model


@pytest.fixture(scope="module")
def tiny_data_s32(tmp_path_factory) -> Path:
    """`data=tiny` at seq 32 (the seq-32 study's recipe reads seq32/)."""
    from data.prepare import prepare_in_subprocess

    out = tmp_path_factory.mktemp("data") / "tiny_s32"
    return prepare_in_subprocess(
        out,
        "data=tiny",
        "data.tokenizer.vocab_file=null",
        "data.tokenizer.vocab_size=2000",
        "data.instances.max_seq_lengths=[32]",
    )


@pytest.mark.slow
def test_dry_run_builds_every_recipe(tiny_data: Path, tiny_data_s32: Path, tmp_path: Path):
    for batch in BATCHES:
        proc = run_pretrain(
            f"batch={batch}",
            "optim=onebit_lamb",
            "model=bert_tiny",
            f"data_dir={tiny_data_s32 if batch.startswith('cpu_study_s32') else tiny_data}",
            f"run_dir={tmp_path / batch}",
            "dry_run=true",
        )
        assert proc.returncode == 0, proc.stderr
        assert "dry run: bert_tiny" in proc.stdout
        two_phases = not batch.startswith("cpu_study_")
        assert ("phase2: seq 512" in proc.stdout) == two_phases, proc.stdout
        assert not (tmp_path / batch / "checkpoints").exists()


@pytest.mark.slow
def test_dry_run_bert_large_64k(tiny_data: Path, tmp_path: Path):
    proc = run_pretrain(
        "batch=64k",
        "optim=onebit_lamb",
        "model=bert_large",
        f"data_dir={tiny_data}",
        f"run_dir={tmp_path}",
        "dry_run=true",
    )
    assert proc.returncode == 0, proc.stderr
    assert "dry run: bert_large with 30" in proc.stdout  # ~306M parameters with the 2000-token test vocab
    assert "65536 = 1 x 64 x 1024 accumulation" in proc.stdout


# a `python -m pretrain` process each (tests/reliability/test_bad_input.py runs config errors in process)
@pytest.mark.slow
@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["batch.phases.0.global_batch=36"], "global_batch=36 is not a multiple of micro_batch=8"),
        (["batch.phases.0.freeze_step=60"], "freeze_step=60 >= total steps 50"),
        (["optim.freeze_stpe=3"], "freeze_stpe"),
        (["optim.lr=-1"], "optim.lr"),
        (["data_dir=/nonexistent/prepared"], "/nonexistent/prepared/seq128"),
        (["model.max_position_embeddings=256"], "max_position_embeddings"),
        (["optim.variance_refresh=1"], "optim.variance_refresh must be 0 (off) or >= 2"),
        (["optim.grad_allreduce=int8"], "grad_allreduce"),
        (["sim_world_size=2", "optim.grad_allreduce=bfloat16"], "optim.grad_allreduce: simulated workers"),
        # the algorithm is the preset's, not an option (DeepSpeed's: optim=onebit_lamb_deepspeed)
        (["optim.trust_ratio=frozen"], "trust_ratio"),
        (["sim_world_size=2", "optim.compile=true"], "the compiled 1-bit step needs one worker"),
    ],
)
def test_config_errors_are_one_line(tiny_data: Path, tmp_path: Path, overrides: list[str], expected: str):
    base = [
        "batch=demo",
        "optim=onebit_lamb",
        "model=bert_tiny",
        f"data_dir={tiny_data}",
        f"run_dir={tmp_path}",
    ]
    proc = run_pretrain(*base, *overrides)
    assert proc.returncode != 0
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr


def test_accumulation_must_divide_over_ranks():
    phase = PhaseConfig(name="p", max_seq_length=128, global_batch=48, micro_batch=8, steps=1, lr=1e-3)
    assert phase.accumulation_steps(2) == 3
    with pytest.raises(
        ValueError, match=r"global_batch=48 is not divisible by world_size \(4\) x micro_batch \(8\)"
    ):
        phase.accumulation_steps(4)
