"""Tiny end-to-end fine-tunes (MRPC, STS-B, a SQuAD v1.1 slice, a SQuAD v2.0 slice, 2-process MRPC) of a
random tiny BERT on ../shared/data, the output layout per checkpoint, the W&B group, and the one-line
error for a model folder that is not a BERT."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from data.config import REPO_ROOT
from tests.squad_v2_helpers import write_squad_v2

QUIET = ["wandb.mode=disabled", "show_progress=false", "log_every=1"]


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory, shared_data: Path) -> Path:
    """A random 2-layer BERT (hidden 64) saved as an HF folder with the uncased vocab's fast tokenizer,
    plus a pretraining_state.json as our checkpoints' exports carry."""
    from transformers import BertConfig, BertForPreTraining, BertTokenizer

    folder = tmp_path_factory.mktemp("tiny_bert")
    vocab = shared_data / "vocab" / "bert-base-uncased-vocab.txt"
    # transformers 5: BertTokenizer is the fast (tokenizers) one (BertTokenizerFast is an alias)
    tokenizer = BertTokenizer(vocab_file=str(vocab), do_lower_case=True)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=512,
    )
    BertForPreTraining(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "pretraining_state.json").write_text(json.dumps({"samples_seen": 4096}))
    return folder


def compose_config(overrides: list[str]):
    from finetune.config import to_object

    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        return to_object(compose(config_name="finetune", overrides=overrides))


def run_single(overrides: list[str]) -> dict:
    from finetune.runner import run_finetune
    from pretrain.distributed.process_group import DistributedEnv

    # a world of one needs no process group; keeps the pytest process free of one
    env = DistributedEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    return run_finetune(compose_config(overrides), env)


def finetune_worker(rank: int, world_size: int, overrides: list[str]) -> dict:
    """fn for run_local: fine-tune under a gloo group of `world_size`; -> the results (rank 0: metrics)."""
    from finetune.runner import run_finetune
    from pretrain.distributed.process_group import init_distributed

    torch.set_num_threads(1)
    results = run_finetune(compose_config(overrides), init_distributed())
    return {"per_seed": results["per_seed"], "world_size": results["world_size"]}


def assert_summary(results: dict, metrics: list[str], seeds: list[int]) -> None:
    assert results["seeds"] == seeds
    assert sorted(results["per_seed"]) == sorted(str(s) for s in seeds)
    for seed in seeds:
        for name in metrics:
            assert isinstance(results["per_seed"][str(seed)][name], float), (seed, name)
    for name in metrics:
        summary = results["summary"][name]
        values = [results["per_seed"][str(s)][name] for s in seeds]
        assert summary["mean"] == pytest.approx(sum(values) / len(values))
        assert summary["std"] >= 0.0
        assert min(values) <= summary["median"] <= max(values)


def test_mrpc_two_seeds(tiny_bert: Path, tmp_path: Path) -> None:
    out = tmp_path / "mrpc"
    results = run_single(
        [
            "task=mrpc",
            f"model_path={tiny_bert}",
            f"output_dir={out}",
            "seeds=[1,2]",
            "task.epochs=1",
            "task.batch_size=16",
            "task.max_length=64",
            "task.max_train_examples=128",
            "task.max_eval_examples=64",
            "task.lr=1e-4",
            *QUIET,
        ]
    )
    written = json.loads((out / "all_results.json").read_text())
    assert written["per_seed"] == results["per_seed"]
    assert_summary(written, ["accuracy", "f1"], [1, 2])
    assert written["pretraining_samples_seen"] == 4096
    # a foreign folder (no run_name in its pretraining_state.json, not under checkpoints/)
    assert written["pretraining_run"] is None and written["checkpoint"] == "final"
    assert written["data"]["num_train_examples"] == 128
    assert written["data"]["num_eval_examples"] == {"dev": 64}
    assert written["main_metric"] == "f1"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval/accuracy" in r]
    assert len(losses) == 2 * 8 and all(r["loss"] > 0 for r in losses)  # 128 / 16 steps per seed
    assert [r["seed"] for r in evals] == [1, 2]
    assert all(r["pretraining_samples_seen"] == 4096 for r in evals)
    # different seeds -> different head init and order -> different training
    assert losses[0]["loss"] != losses[8]["loss"]


@pytest.mark.slow
def test_stsb_regression_from_a_classification_fine_tune(tiny_bert: Path, tmp_path: Path) -> None:
    """STS-B (1 output) starting from an RTE fine-tune (2 classes): encoder kept, head re-initialized."""
    run_single(
        [
            "task=rte",
            f"model_path={tiny_bert}",
            f"output_dir={tmp_path / 'rte'}",
            "save_model=true",
            "task.epochs=1",
            "task.batch_size=16",
            "task.max_length=64",
            "task.max_train_examples=32",
            "task.max_eval_examples=16",
            *QUIET,
        ]
    )
    assert (tmp_path / "rte" / "model" / "config.json").is_file()
    results = run_single(
        [
            "task=stsb",
            f"model_path={tiny_bert}",
            f"task.init_from={tmp_path / 'rte' / 'model'}",
            f"output_dir={tmp_path}",
            "task.epochs=1",
            "task.batch_size=16",
            "task.max_length=64",
            "task.max_train_examples=64",
            "task.max_eval_examples=48",
            *QUIET,
        ]
    )
    assert_summary(results, ["pearson", "spearman"], [42])
    assert results["summary"]["pearson"]["std"] == 0.0


def test_squad_slice_trains_on_part_of_dev(tiny_bert: Path, tmp_path: Path) -> None:
    results = run_single(
        [
            "task=squad",
            f"model_path={tiny_bert}",
            f"output_dir={tmp_path}",
            "task.epochs=1",
            "task.batch_size=16",
            "task.max_length=128",
            "task.doc_stride=32",
            "task.max_train_examples=48",
            "task.max_eval_examples=32",
            *QUIET,
        ]
    )
    assert_summary(results, ["exact_match", "f1"], [42])
    assert 0.0 <= results["per_seed"]["42"]["f1"] <= 100.0
    assert results["data"]["num_train_examples"] == 48
    assert results["data"]["num_eval_examples"] == {"dev": 32}
    assert "trained on 48 of the" in results["data"]["notes"][0]
    assert "first 50% of the articles" in results["data"]["notes"][0]
    predictions = json.loads((tmp_path / "predictions.json").read_text())
    assert len(predictions) == 32
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in predictions.items())


@pytest.mark.slow
def test_squad_v2_slice_with_unanswerable_questions(
    tiny_bert: Path, tmp_path: Path, shared_data: Path
) -> None:
    """v2.0 from a v1.1 dev slice with every third question unanswerable: trains on them (labelled at
    [CLS]), reports the official v2.0 metrics and writes predictions.json ("" = no answer) and
    null_odds.json."""
    impossible = write_squad_v2(shared_data, tmp_path / "squad", max_articles=6)
    out = tmp_path / "out"
    results = run_single(
        [
            "task=squad_v2",
            f"model_path={tiny_bert}",
            f"data_dir={tmp_path / 'squad'}",
            f"output_dir={out}",
            "task.epochs=1",
            "task.batch_size=16",
            "task.max_length=128",
            "task.doc_stride=32",
            "task.max_train_examples=48",
            "task.max_eval_examples=45",
            *QUIET,
        ]
    )
    metrics = results["per_seed"]["42"]
    assert results["main_metric"] == "exact" and results["skips"] == {"dev": {}}
    assert results["data"]["num_train_examples"] == 48
    predictions = json.loads((out / "predictions.json").read_text())
    null_odds = json.loads((out / "null_odds.json").read_text())
    assert len(predictions) == 45 and set(null_odds) == set(predictions)
    no_answer = [qid for qid in predictions if qid in impossible]
    num_no_answer, num_answer = len(no_answer), 45 - len(no_answer)
    assert metrics["total"] == 45.0 and metrics["NoAns_total"] == num_no_answer >= 10
    assert metrics["HasAns_total"] == num_answer >= 10
    # an unanswerable question is right exactly when the prediction is "" (EM and F1 alike)
    right = sum(predictions[qid] == "" for qid in no_answer)
    assert metrics["NoAns_exact"] == metrics["NoAns_f1"] == pytest.approx(100 * right / num_no_answer)
    assert metrics["exact"] == pytest.approx(
        (num_answer * metrics["HasAns_exact"] + num_no_answer * metrics["NoAns_exact"]) / 45
    )
    # threshold 0: "" exactly where null score − best span score > 0
    assert all((text == "") == (null_odds[qid] > 0) for qid, text in predictions.items())
    assert metrics["best_f1"] >= metrics["f1"] - 1e-9 and metrics["best_exact"] >= metrics["exact"] - 1e-9
    for name in ("best_exact_thresh", "best_f1_thresh"):
        assert metrics[name] == 0.0 or metrics[name] in null_odds.values()


def test_split_by_article_is_deterministic_and_disjoint() -> None:
    from finetune.runner import split_by_article

    examples = [{"title": t, "qid": f"{t}{i}"} for t in "abcd" for i in range(3)]
    train, held_out = split_by_article(examples, 0.5)
    assert {e["title"] for e in train} == {"a", "b"}
    assert {e["title"] for e in held_out} == {"c", "d"}
    assert split_by_article(examples, 0.01)[0] == examples[:3]  # at least one article each side
    with pytest.raises(ValueError, match="train_fraction"):
        split_by_article(examples[:3], 0.5)


@pytest.mark.slow
def test_two_process_mrpc_matches_layout(tiny_bert: Path, tmp_path: Path) -> None:
    from launch.local import run_local

    overrides = [
        "task=mrpc",
        f"model_path={tiny_bert}",
        f"output_dir={tmp_path}",
        "task.epochs=1",
        "task.batch_size=16",
        "task.max_length=64",
        "task.max_train_examples=64",
        "task.max_eval_examples=32",
        *QUIET,
    ]
    results = run_local(finetune_worker, world_size=2, args=(overrides,), timeout=120)
    assert results[0]["world_size"] == 2
    assert set(results[0]["per_seed"]["42"]) == {"accuracy", "f1"}
    assert results[1]["per_seed"]["42"] == {}  # metrics are computed on rank 0 only
    written = json.loads((tmp_path / "all_results.json").read_text())
    assert written["world_size"] == 2
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in records if "loss" in r]) == 4  # 64 examples / global batch 16


@pytest.mark.slow  # a `python -m finetune` process
def test_bad_model_folder_is_a_one_line_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "finetune",
            f"model_path={tmp_path}",
            f"output_dir={tmp_path / 'out'}",
            *QUIET,
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 2, completed.stderr
    lines = completed.stderr.strip().splitlines()
    assert len(lines) == 1 and str(tmp_path) in lines[0] and "not 'bert'" in lines[0], lines
    assert lines[0].startswith(f"finetune: error: model_path={tmp_path}: model_type is 'gpt2'")
    # the pre-flight header stopped it before anything was built or written
    assert completed.stdout.startswith("pre-flight: finetune mrpc") and "Traceback" not in completed.stderr
    assert not (tmp_path / "out").exists()


def test_missing_config_json_names_the_folder(tmp_path: Path) -> None:
    from finetune.runner import check_model_folder

    with pytest.raises(ValueError, match=r"no config\.json"):
        check_model_folder(str(tmp_path))


def test_a_run_folder_means_its_newest_complete_checkpoint(tiny_bert: Path, tmp_path: Path) -> None:
    import shutil

    from finetune.config import run_name_of
    from finetune.runner import check_model_folder

    run = tmp_path / "runs" / "64k-lamb-bert_large"
    for step, complete in ((10, True), (20, True), (30, False)):  # step 30 is an unfinished save
        checkpoint = run / "checkpoints" / f"step-{step:08d}"
        shutil.copytree(tiny_bert, checkpoint / "hf")
        if complete:
            (checkpoint / "COMPLETE").touch()
    assert check_model_folder(str(run)) == run / "checkpoints" / "step-00000020" / "hf"
    assert run_name_of(str(run)) == "64k-lamb-bert_large"
    assert run_name_of(str(run / "checkpoints" / "step-00000020" / "hf")) == "64k-lamb-bert_large"
    assert run_name_of("/models/bert-base-uncased") == "bert-base-uncased"


@pytest.mark.parametrize("task", sorted(p.stem for p in (REPO_ROOT / "conf" / "task").glob("*.yaml")))
def test_every_task_recipe_composes(task: str, shared_data: Path) -> None:
    from finetune.tasks import GLUE_TASKS, TASKS

    cfg = compose_config([f"task={task}", "model_path=/models/bert"])
    assert cfg.task.name == task and task in TASKS
    expected = shared_data / ("glue_data" if task in GLUE_TASKS else "squad")
    assert Path(str(cfg.data_dir)) == expected
    assert cfg.output_dir.endswith(f"results/runs/bert/finetune/final/{task}")


def test_a_misspelt_key_fails_at_composition() -> None:
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match=r"task\.learning_rate"):
        compose_config(["task=mrpc", "model_path=/m", "task.learning_rate=1e-4"])
    with pytest.raises(ValueError, match=r"task\.warmup_ratio"):
        compose_config(["task=mrpc", "model_path=/m", "task.warmup_ratio=1.5"])


def _pretraining_run(tiny_bert: Path, root: Path, steps: dict[int, bool], state: dict | None = None) -> Path:
    """A pretraining run folder with `checkpoints/step-N/hf` copies of `tiny_bert` ({step: complete})."""
    import shutil

    run = root / "runs" / "16k-onebit_lamb-bert_tiny"
    for step, complete in steps.items():
        checkpoint = run / "checkpoints" / f"step-{step:08d}"
        shutil.copytree(tiny_bert, checkpoint / "hf")
        if state is not None:
            (checkpoint / "hf" / "pretraining_state.json").write_text(
                json.dumps({**state, "global_step": step})
            )
        if complete:
            (checkpoint / "COMPLETE").touch()
    return run


def test_output_folder_per_checkpoint(tiny_bert: Path, tmp_path: Path) -> None:
    """Each checkpoint of a run gets its own folder: .../<run>/finetune/<step-N>/<task>; a run folder
    means its newest complete checkpoint; other folders are `final`; output_dir= still wins."""
    from finetune.config import checkpoint_tag_of

    run = _pretraining_run(tiny_bert, tmp_path, {100: True, 200: True, 300: False})
    runs = REPO_ROOT / "results" / "runs"
    for model_path, tag in (
        (run, "step-00000200"),
        (run / "checkpoints" / "step-00000100" / "hf", "step-00000100"),
        (run / "checkpoints" / "step-00000100", "step-00000100"),
        (tiny_bert, "final"),
    ):
        assert checkpoint_tag_of(str(model_path)) == tag
        cfg = compose_config(["task=rte", f"model_path={model_path}"])
        expected_run = tiny_bert.name if model_path == tiny_bert else run.name
        assert cfg.checkpoint == tag
        assert Path(cfg.output_dir) == runs / expected_run / "finetune" / tag / "rte"
    cfg = compose_config(["task=rte", f"model_path={run}", f"output_dir={tmp_path / 'mine'}"])
    assert cfg.output_dir == str(tmp_path / "mine") and cfg.checkpoint == "step-00000200"
    assert checkpoint_tag_of(str(tmp_path / "runs" / "empty")) == "final"


def test_results_and_wandb_name_the_pretraining_run(tiny_bert: Path, tmp_path: Path) -> None:
    """all_results.json carries the run, checkpoint and samples seen; W&B joins the run's group, read
    from the export's pretraining_state.json, else the run's name; wandb.group= wins."""
    from finetune.runner import PretrainingInfo, read_pretraining_info, wandb_init_kwargs

    state = {
        "samples_seen": 8192,
        "run_name": "16k-onebit_lamb-bert_tiny",
        "wandb_group": "16k",
        "optimizer": "onebit_lamb",
        "global_batch": 16384,
    }
    run = _pretraining_run(tiny_bert, tmp_path, {10: True, 20: True}, state)
    out = tmp_path / "out"
    results = run_single(
        [
            "task=rte",
            f"model_path={run}",
            f"output_dir={out}",
            "task.epochs=1",
            "task.batch_size=16",
            "task.max_length=64",
            "task.max_train_examples=16",
            "task.max_eval_examples=16",
            *QUIET,
        ]
    )
    written = json.loads((out / "all_results.json").read_text())
    assert written["per_seed"] == results["per_seed"] and written["model_path"].endswith("step-00000020/hf")
    assert written["checkpoint"] == "step-00000020" and written["pretraining_run"] == run.name
    assert written["pretraining_samples_seen"] == 8192 and written["wandb_group"] == "16k"

    info = read_pretraining_info(run / "checkpoints" / "step-00000020" / "hf")
    assert info == PretrainingInfo(
        run=run.name, wandb_group="16k", samples_seen=8192, optimizer="onebit_lamb", global_batch=16384
    )
    cfg = compose_config(["task=rte", f"model_path={run}", "wandb.mode=offline", "wandb.tags=[sweep]"])
    kwargs = wandb_init_kwargs(cfg, 7, info)
    assert kwargs["group"] == "16k" and kwargs["mode"] == "offline" and kwargs["job_type"] == "finetune"
    assert kwargs["tags"] == [
        "sweep",
        "finetune",
        "rte",
        "seed-7",
        "checkpoint-step-00000020",
        "pretraining_samples_seen=8192",
    ]
    assert kwargs["name"] == f"{run.name}-step-00000020-rte-seed7"
    assert kwargs["config"]["pretraining_samples_seen"] == 8192 and kwargs["config"]["seed"] == 7
    # the dashboard groups fine-tunes by the pretraining run's optimizer and global batch
    assert kwargs["config"]["optimizer"] == "onebit_lamb" and kwargs["config"]["global_batch"] == 16384
    assert kwargs["directory"] == cfg.output_dir
    # an export that predates wandb_group: the run's name (from the path); a foreign folder: its name
    old_export = run / "checkpoints" / "step-00000010" / "hf"
    (old_export / "pretraining_state.json").write_text(json.dumps({"samples_seen": 4096}))
    old = read_pretraining_info(old_export)
    assert old == PretrainingInfo(run=run.name, wandb_group=None, samples_seen=4096)
    assert wandb_init_kwargs(cfg, 7, old)["group"] == run.name
    foreign_cfg = compose_config(["task=rte", f"model_path={tiny_bert}"])
    foreign = read_pretraining_info(tiny_bert)
    assert foreign.run is None and wandb_init_kwargs(foreign_cfg, 1, foreign)["group"] == tiny_bert.name
    chosen = compose_config(["task=rte", f"model_path={run}", "wandb.group=mine"])
    assert wandb_init_kwargs(chosen, 7, info)["group"] == "mine"


# -- the pre-flight header (finetune/preflight.py) -----------------------------------------------------------
@pytest.mark.slow  # a `python -m finetune` process
def test_the_preflight_header_names_the_model_folder_and_the_data(
    tiny_bert: Path, tmp_path: Path, shared_data: Path
) -> None:
    state = {"samples_seen": 8192, "run_name": "16k-onebit_lamb-bert_tiny", "optimizer": "onebit_lamb"}
    run = _pretraining_run(
        tiny_bert, tmp_path, {10: True, 20: True, 30: False}, {**state, "global_batch": 16384}
    )
    out = tmp_path / "out"
    command = [
        sys.executable,
        "-m",
        "finetune",
        "task=mrpc",
        f"model_path={run}",
        f"output_dir={out}",
        "seeds=[1]",
    ]
    tiny = ["task.epochs=1", "task.batch_size=8", "task.max_length=32", "task.max_train_examples=8"]
    done = subprocess.run(
        [*command, *tiny, "task.max_eval_examples=8", *QUIET],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    header = done.stdout.splitlines()[:8]
    assert header[0] == "pre-flight: finetune mrpc, train on 'train' (first 8 examples), evaluate on 'dev'"
    newest = run / "checkpoints" / "step-00000020" / "hf"
    assert header[1] == f"  model: {newest} (newest complete checkpoint of {run})"
    assert header[2] == (
        f"  pretraining: run {run.name}, optimizer onebit_lamb, global batch 16384, 8,192 samples seen"
    )
    assert header[3].startswith("  devices: ") and header[3].endswith("; world size 1")
    assert header[4].startswith(
        "  batch: global 8 = 1 x 8 per rank, 1 epoch, lr 2e-05, max length 32, seeds [1]"
    )
    assert header[5] == f"  data: local files in {shared_data / 'glue_data' / 'MRPC'}: train.tsv, dev.tsv"
    assert header[6] == f"  output: {out}" and header[7].startswith("  W&B: disabled")
    assert (out / "all_results.json").is_file()


def _preflight(overrides: list[str], world_size: int = 1):
    from finetune.preflight import build

    return build(compose_config(overrides), world_size)


def test_preflight_problems_are_one_line_naming_the_key(tiny_bert: Path, tmp_path: Path) -> None:
    model = f"model_path={tiny_bert}"
    report = _preflight(["task=mrpc", model, f"data_dir={tmp_path}"], world_size=3)
    assert [problem.split(":")[0] for problem in report.problems] == [
        "task.batch_size=32 is not divisible by the world size 3",
        f"data_dir={tmp_path}",
        f"data_dir={tmp_path}",
    ]
    assert f"{tmp_path / 'MRPC' / 'train.tsv'} not found (task mrpc, split train)" in report.problems[1]
    assert all("\n" not in problem for problem in report.problems)
    assert "per rank" in report.text() and "x ? per rank" in report.text()

    report = _preflight(["task=rte", model, f"task.init_from={tmp_path / 'absent'}"])
    assert report.problems == [f"task.init_from={tmp_path / 'absent'}: no such folder"]
    assert f"  model: {tiny_bert}" in report.lines  # a foreign folder: used as given, no pretraining run


def test_preflight_data_sources_and_earlier_results(
    tiny_bert: Path, tmp_path: Path, shared_data: Path, monkeypatch
) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    report = _preflight(["task=mnli", f"model_path={tiny_bert}", "data_dir=null"])
    assert not report.problems, report.problems
    assert (
        "  data: Hugging Face hub: nyu-mll/glue (mnli), offline mode (HF_DATASETS_OFFLINE=1): only the "
        "local cache is read" in report.lines
    )
    assert report.lines[0].endswith("evaluate on 'dev_matched', 'dev_mismatched'")

    out = tmp_path / "squad"
    out.mkdir()
    (out / "all_results.json").write_text("{}")
    report = _preflight(["task=squad", f"model_path={tiny_bert}", f"output_dir={out}"])
    assert not report.problems, report.problems
    assert f"  data: local files in {shared_data / 'squad'}: dev-v1.1.json.gz" in report.lines
    assert "train on the first 50% of the articles of 'dev'" in report.lines[0]
    assert (
        f"  output: {out} (holds an earlier run's all_results.json: this run replaces them)" in report.lines
    )
