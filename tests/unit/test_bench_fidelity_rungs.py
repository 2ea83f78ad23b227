"""bench/fidelity_rungs.py: the rungs' records (issue #50) from synthetic run folders."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.fidelity_rungs import (
    RUNGS,
    Rung,
    Sweep,
    deepspeed_seed_workers,
    load_rung_runs,
    lr_neighbour,
    lr_tag,
    main,
    rung_records,
)

RUNG = RUNGS["b"]  # BERT-tiny at batch 1,024: LAMB 1e-2 3e-2 1e-1, AdamW 1e-3 3e-3 1e-2


def write_run(
    root: Path, optimizer: str, lr: str, workers: str, seed: int, final_loss: float, *,
    accuracy: float = 0.3, sst2: float | None = None, finished: bool = True, diverge: bool = False,
    rung: Rung = RUNG,
) -> Path:  # fmt: skip
    """A finished run of the rung: 20 logged records, the last 10 at `final_loss` (the final window)."""
    name = f"cpu-rung-{rung.key}-{optimizer}-lr{lr}-{workers}-s{seed}"
    folder = root / name
    folder.mkdir(parents=True)
    processes, simulated = (int(workers[1:]), 1) if workers.startswith("n") else (2, int(workers[3:]) // 2)
    steps = rung.steps
    phase = {"global_batch": rung.global_batch, "steps": steps, "lr": float(lr), "freeze_step": 80}
    config: dict[str, Any] = {
        "model": {"size": rung.model},
        "optim": {"name": optimizer, "lr": 0.001},
        "batch": {
            "name": rung.batch,
            "phases": [phase],
        },
        "seed": seed,
        "sim_world_size": simulated,
        "optimizer": optimizer,
        "global_batch": rung.global_batch,
        "world_size": processes,
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    with (folder / "metrics.jsonl").open("w") as file:
        for index in range(20):
            step = (index + 1) * steps // 20
            loss = 9.0 if index < 10 else final_loss
            if diverge and index >= 15:
                loss = math.nan
            record = {
                "step": step,
                "samples_seen": step * rung.global_batch,
                "mlm_loss": "nan" if math.isnan(loss) else loss,
                "mlm_accuracy": 0.0 if index < 10 else accuracy,
                "phase": 1,
            }
            file.write(json.dumps(record) + "\n")
    if finished:
        summary = {"global_step": steps, "samples_seen": steps * rung.global_batch}
        (folder / "summary.json").write_text(json.dumps(summary))
    if sst2 is not None:
        write_finetune(folder / "finetune" / "final" / "sst2-len32", seed, sst2)
    return folder


def write_finetune(folder: Path, seed: int, accuracy: float) -> None:
    folder.mkdir(parents=True)
    payload = {
        "task": "sst2",
        "main_metric_key": "accuracy",
        "per_seed": {str(seed): {"accuracy": accuracy}},
        "pretraining_samples_seen": 409600,
        "config": {"task": {"lr": 0.001, "epochs": 1, "max_length": 32, "batch_size": 32}},
    }
    (folder / "all_results.json").write_text(json.dumps(payload))


def lamb_sweep_and_seeds(root: Path) -> None:
    """LAMB: 3e-2 best of the three planned LRs, then seeds 2-3 there."""
    write_run(root, "lamb", "1e-2", "n2", 1, 4.6)
    write_run(root, "lamb", "3e-2", "n2", 1, 4.0, accuracy=0.30, sst2=0.80)
    write_run(root, "lamb", "1e-1", "n2", 1, 4.4)
    write_run(root, "lamb", "3e-2", "n2", 2, 4.2, accuracy=0.28, sst2=0.79)
    write_run(root, "lamb", "3e-2", "n2", 3, 4.1, accuracy=0.29, sst2=0.81)


def records_of(root: Path) -> dict[str, Any]:
    return {record.name: record for record in rung_records(RUNG, root)}


def test_lr_names_and_the_x3_grid():
    assert [lr_tag(lr) for lr in (0.03, 0.1, 1e-3, 3e-4)] == ["3e-2", "1e-1", "1e-3", "3e-4"]
    assert lr_neighbour("3e-2", up=True) == "1e-1" and lr_neighbour("3e-2", up=False) == "1e-2"
    assert lr_neighbour("1e-2", up=False) == "3e-3" and lr_neighbour("1e-1", up=True) == "3e-1"


def test_the_sweep_runs_the_plan_then_one_lr_beyond_an_edge():
    planned = ("1e-2", "3e-2", "1e-1")
    assert Sweep("lamb", planned, {}).next_lr == "3e-2"  # the recipe's LR first
    assert Sweep("lamb", planned, {"3e-2": 4.5}).next_lr == "1e-2"
    interior = Sweep("lamb", planned, {"1e-2": 4.5, "3e-2": 4.0, "1e-1": 4.4})
    assert interior.best == "3e-2" and interior.next_lr is None and interior.status == "complete"
    high = Sweep("lamb", planned, {"1e-2": 4.5, "3e-2": 4.2, "1e-1": 4.1})
    assert high.edge == "high" and high.next_lr == "3e-1" and high.status.startswith("partial: 3 of 3")
    # a diverged LR (None) is never the best; the best at the low edge extends downwards
    low = Sweep("lamb", planned, {"1e-2": 4.0, "3e-2": 4.2, "1e-1": None})
    assert low.best == "1e-2" and low.next_lr == "3e-3"
    # at most two LRs beyond the plan
    capped = Sweep("lamb", planned, {"1e-3": 3.9, "3e-3": 4.0, "1e-2": 4.1, "3e-2": 4.2, "1e-1": 4.3})
    assert capped.next_lr is None and capped.complete and "low edge" in capped.status


def test_ratio_records_against_lamb_at_its_best_lr(tmp_path: Path):
    lamb_sweep_and_seeds(tmp_path)
    write_run(tmp_path, "onebit_lamb", "3e-2", "n2", 1, 4.05)
    write_run(tmp_path, "onebit_lamb", "3e-2", "n2", 2, 4.25)
    write_run(tmp_path, "onebit_lamb", "3e-2", "sim32", 1, 4.2)
    write_run(tmp_path, "onebit_lamb", "1e-2", "n2", 1, 4.5)  # a neighbouring LR: its own record
    write_run(tmp_path, "onebit_lamb", "3e-2", "sim64", 1, 4.3, finished=False)  # still running: not counted
    write_run(tmp_path, "abl-freeze160-onebit_lamb", "3e-2", "n2", 1, 3.0)  # an ablation: not the arm's
    ablation_config = tmp_path / f"cpu-rung-{RUNG.key}-abl-freeze160-onebit_lamb-lr3e-2-n2-s1" / "config.yaml"
    config_text = ablation_config.read_text().replace("abl-freeze160-onebit_lamb", "onebit_lamb")
    ablation_config.write_text(config_text)  # the optimizer's own name, as a real ablation's config has
    records = records_of(tmp_path)
    lamb_mean = (4.0 + 4.2 + 4.1) / 3  # seeds 1-3 at 3e-2; the sweep's other LRs are not the peer
    default = records["final_mlm_loss_ratio_onebit_lamb_bert_tiny_b1024_n2"]
    assert default.value == pytest.approx(4.15) and default.peer_value == pytest.approx(lamb_mean)
    assert default.ratio == pytest.approx(4.15 / lamb_mean)
    assert default.config["status"] == "partial: 2 of 3 seeds, LAMB 3 of 3 seeds"
    assert default.config["seeds"] == [1, 2] and default.config["peer_seeds"] == [1, 2, 3]
    assert default.config["lr"] == pytest.approx(0.03) and default.config["variant"] == "onebit_lamb"
    assert default.config["samples"] == [409_600] and default.config["steps"] == [400]
    assert default.config["workers"] == 2 and default.config["simulated_workers"] is False
    assert default.config["std"] == pytest.approx(statistics.stdev([4.05, 4.25]))
    assert default.target is not None
    simulated = records["final_mlm_loss_ratio_onebit_lamb_bert_tiny_b1024_n32sim"]
    assert simulated.config["workers"] == 32 and simulated.config["simulated_workers"] is True
    assert simulated.ratio == pytest.approx(4.2 / lamb_mean)
    assert "final_mlm_loss_ratio_onebit_lamb_bert_tiny_b1024_n64sim" not in records
    neighbour = records["final_mlm_loss_ratio_onebit_lamb_bert_tiny_b1024_n2_lr1e-2"]
    assert neighbour.ratio == pytest.approx(4.5 / lamb_mean) and neighbour.target is None
    best = records["lamb_best_lr_bert_tiny_b1024"]
    assert best.value == pytest.approx(0.03) and best.config["status"] == "complete"
    assert best.config["final_mlm_loss_by_lr"] == {"1e-2": 4.6, "3e-2": 4.0, "1e-1": 4.4}
    accuracy = records["lamb_final_mlm_accuracy_bert_tiny_b1024"]
    assert accuracy.value == pytest.approx((0.30 + 0.28 + 0.29) / 3)
    assert accuracy.config["status"] == "complete"


def test_adamw_at_its_own_best_lr_and_a_diverged_seed(tmp_path: Path):
    lamb_sweep_and_seeds(tmp_path)
    write_run(tmp_path, "adamw", "1e-3", "n2", 1, 4.8)
    write_run(tmp_path, "adamw", "3e-3", "n2", 1, 4.3)
    write_run(tmp_path, "adamw", "1e-2", "n2", 1, 4.0, diverge=True)  # diverged: never the best
    write_run(tmp_path, "adamw", "3e-3", "n2", 2, 4.5)
    write_run(tmp_path, "onebit_lamb_deepspeed", "3e-2", "n2", 1, 4.4, diverge=True)
    records = records_of(tmp_path)
    adamw = records["final_mlm_loss_ratio_adamw_bert_tiny_b1024_n2"]
    assert adamw.config["lr"] == pytest.approx(3e-3) and adamw.value == pytest.approx(4.4)
    assert adamw.config["status"] == "partial: 2 of 3 seeds, LAMB 3 of 3 seeds"
    assert records["adamw_best_lr_bert_tiny_b1024"].config["final_mlm_loss_by_lr"]["1e-2"] is None
    # DeepSpeed's only run diverged: no mean, so no ratio record (never a made-up number)
    assert "final_mlm_loss_ratio_onebit_lamb_deepspeed_bert_tiny_b1024_n2" not in records


def test_partial_lamb_sweep_is_named_in_the_status(tmp_path: Path):
    write_run(tmp_path, "lamb", "3e-2", "n2", 1, 4.0)
    write_run(tmp_path, "onebit_lamb", "3e-2", "n2", 1, 4.04)
    records = records_of(tmp_path)
    status = records["final_mlm_loss_ratio_onebit_lamb_bert_tiny_b1024_n2"].config["status"]
    assert status == "partial: 1 of 3 seeds, LAMB 1 of 3 seeds, LAMB LR sweep partial: 1 of 3 LRs; next 1e-2"
    assert records["lamb_best_lr_bert_tiny_b1024"].config["status"].startswith("partial: 1 of 3 LRs")
    accuracy = records["lamb_final_mlm_accuracy_bert_tiny_b1024"].config["status"]
    assert accuracy == "partial: 1 of 3 seeds, LAMB LR sweep partial: 1 of 3 LRs; next 1e-2"


def test_no_lamb_run_no_ratio(tmp_path: Path):
    write_run(tmp_path, "onebit_lamb", "3e-2", "n2", 1, 4.04)
    assert rung_records(RUNG, tmp_path) == []
    assert rung_records(RUNG, tmp_path / "absent") == []


def test_downstream_gap_in_pooled_seed_std_and_the_floor(tmp_path: Path):
    lamb_sweep_and_seeds(tmp_path)  # SST-2 0.80, 0.79, 0.81
    for seed, accuracy in ((1, 0.80), (2, 0.82), (3, 0.81)):
        write_run(tmp_path, "onebit_lamb", "3e-2", "n2", seed, 4.1, sst2=accuracy)
    floor = tmp_path / f"cpu-rung-floor-{RUNG.model}"
    for seed, accuracy in ((1, 0.78), (2, 0.79)):
        write_finetune(floor / "finetune" / "final" / f"sst2-len32-s{seed}", seed, accuracy)
    records = records_of(tmp_path)
    lamb = [0.80, 0.79, 0.81]
    ours = [0.80, 0.82, 0.81]
    noise = math.sqrt((statistics.stdev(ours) ** 2 + statistics.stdev(lamb) ** 2) / 2)
    gap = records["downstream_gap_sst2_onebit_lamb_bert_tiny_b1024_n2"]
    assert gap.value == pytest.approx((statistics.fmean(ours) - statistics.fmean(lamb)) / noise)
    assert gap.value == pytest.approx(1.0) and gap.config["status"] == "complete"
    floor_gap = records["downstream_gap_sst2_random_init_bert_tiny_b1024"]
    floor_noise = math.sqrt((statistics.stdev([0.78, 0.79]) ** 2 + statistics.stdev(lamb) ** 2) / 2)
    assert floor_gap.value == pytest.approx((0.785 - 0.80) / floor_noise)
    assert floor_gap.config["status"] == "partial: 2 of 3 fine-tunes, LAMB 3 of 3"


def test_the_scripts_questions(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    main(["best-lr", "b", "lamb", str(tmp_path)])  # nothing run yet: the recipe's LR, and it is the next
    assert capsys.readouterr().out.split() == ["3e-2", "3e-2"]
    write_run(tmp_path, "lamb", "1e-2", "n2", 1, 4.3)
    write_run(tmp_path, "lamb", "3e-2", "n2", 1, 4.1)
    write_run(tmp_path, "lamb", "1e-1", "n2", 1, 4.0)
    main(["best-lr", "b", "lamb", str(tmp_path)])
    assert capsys.readouterr().out.split() == ["1e-1", "3e-1"]
    write_run(tmp_path, "lamb", "3e-1", "n2", 1, 4.2)
    main(["best-lr", "b", "lamb", str(tmp_path)])
    assert capsys.readouterr().out.split() == ["1e-1", "-"]
    # DeepSpeed's seeds 2-3 where its seed 1 is within 2 LAMB std of 1.01 x LAMB's mean
    write_run(tmp_path, "lamb", "1e-1", "n2", 2, 4.1)
    write_run(tmp_path, "lamb", "1e-1", "n2", 3, 4.2)
    limit = 1.01 * 4.1 + 2 * statistics.stdev([4.0, 4.1, 4.2])
    write_run(tmp_path, "onebit_lamb_deepspeed", "1e-1", "n2", 1, limit - 0.01)
    write_run(tmp_path, "onebit_lamb_deepspeed", "1e-1", "sim32", 1, limit + 0.01)
    runs = load_rung_runs(tmp_path, RUNG)
    assert deepspeed_seed_workers(runs, RUNG) == ["n2"]
    records = records_of(tmp_path)  # seed 1 alone is the plan outside the band, not a partial arm
    inside = records["final_mlm_loss_ratio_onebit_lamb_deepspeed_bert_tiny_b1024_n2"].config["status"]
    outside = records["final_mlm_loss_ratio_onebit_lamb_deepspeed_bert_tiny_b1024_n32sim"].config["status"]
    assert inside == "partial: 1 of 3 seeds, LAMB 3 of 3 seeds" and outside.startswith(
        "complete: seed 1 only"
    )
    main(["spec", "m"])
    spec = dict(line.split("=", 1) for line in capsys.readouterr().out.splitlines())
    assert spec["MODEL"] == "'bert_mini'" and spec["LAMB_LRS"] == "'3e-3 1e-2 3e-2'"
    assert "model.hidden_dropout_prob=0.0" in spec["MODEL_ARGS"]


def test_the_sst2_lr_check_picks_lambs_best_and_extends_an_edge(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    def check(lr: str, lamb: float, floor: float) -> None:
        write_finetune(tmp_path / f"finetune-lr{lr}" / f"cpu-rung-{RUNG.key}-lamb-lr3e-2-n2-s1", 1, lamb)
        write_finetune(tmp_path / f"finetune-lr{lr}" / f"cpu-rung-floor-{RUNG.model}", 1, floor)

    main(["ft-lr", "b", str(tmp_path)])  # nothing checked: the seq-32 study's LR, and the check starts there
    assert capsys.readouterr().out.split() == ["1e-3", "1e-3"]
    check("1e-3", 0.77, 0.79)  # the floor's scores do not choose
    check("3e-3", 0.51, 0.51)
    main(["ft-lr", "b", str(tmp_path)])
    assert capsys.readouterr().out.split() == ["1e-3", "3e-4"]
    check("3e-4", 0.79, 0.78)  # best at the low edge: one LR below it next
    main(["ft-lr", "b", str(tmp_path)])
    assert capsys.readouterr().out.split() == ["3e-4", "1e-4"]
    check("1e-4", 0.78, 0.78)
    main(["ft-lr", "b", str(tmp_path)])
    assert capsys.readouterr().out.split() == ["3e-4", "-"]


def test_a_one_seed_rung_is_complete_at_one_seed_and_fine_tunes_each_checkpoint_three_times(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    small = RUNGS["s"]  # BERT-small: one pretraining seed per arm, three SST-2 seeds per checkpoint
    for lr, loss in (("3e-3", 4.6), ("1e-2", 4.0), ("3e-2", 4.4)):
        write_run(tmp_path, "lamb", lr, "n2", 1, loss, rung=small)
    default = write_run(tmp_path, "onebit_lamb", "1e-2", "n2", 1, 4.02, rung=small)
    lamb = tmp_path / "cpu-rung-s-lamb-lr1e-2-n2-s1"
    for seed, (ours, theirs) in enumerate(((0.80, 0.81), (0.79, 0.80), (0.81, 0.79)), start=1):
        write_finetune(default / "finetune" / "final" / f"sst2-len32-s{seed}", seed, ours)
        write_finetune(lamb / "finetune" / "final" / f"sst2-len32-s{seed}", seed, theirs)
    write_run(tmp_path, "onebit_lamb_deepspeed", "1e-2", "n2", 1, 4.01, rung=small)
    records = {record.name: record for record in rung_records(small, tmp_path)}
    ratio = records["final_mlm_loss_ratio_onebit_lamb_bert_small_b128_n2"]
    assert ratio.value / ratio.peer_value == pytest.approx(4.02 / 4.0)
    assert ratio.config["status"] == "complete"  # no AdamW here: the status counts seeds and LAMB's sweep
    gap = records["downstream_gap_sst2_onebit_lamb_bert_small_b128_n2"]
    assert gap.config["n"] == 3 and gap.config["status"] == "complete"
    assert gap.value == pytest.approx(0.0)  # same mean, 0.80 each side
    assert deepspeed_seed_workers(load_rung_runs(tmp_path, small), small) == []  # no LAMB std: no seeds 2-3
    main(["spec", "s"])
    spec = dict(line.split("=", 1) for line in capsys.readouterr().out.splitlines())
    assert spec["MODEL"] == "'bert_small'" and spec["RUNG_SEEDS"] == "'1'" and spec["FT_SEEDS"] == "'3'"
    main(["spec", "m"])
    spec = dict(line.split("=", 1) for line in capsys.readouterr().out.splitlines())
    assert spec["RUNG_SEEDS"] == "'1 2 3'" and spec["FT_SEEDS"] == "'3'"
    assert spec["CHECKPOINT_EVERY"] == "'800'"
    main(["spec", "b"])  # one fine-tune per checkpoint, no checkpoints before the end
    spec = dict(line.split("=", 1) for line in capsys.readouterr().out.splitlines())
    assert spec["FT_SEEDS"] == "'1'" and spec["CHECKPOINT_EVERY"] == "'0'"


def test_the_floor_is_complete_at_its_three_fine_tunes_where_lamb_has_nine(tmp_path: Path):
    mini = RUNGS["m"]  # 3 pretraining seeds x 3 SST-2 seeds per checkpoint: LAMB's 9; the floor: 3
    for lr, loss in (("3e-3", 4.6), ("3e-2", 4.4)):
        write_run(tmp_path, "lamb", lr, "n2", 1, loss, rung=mini)
    scores = iter((0.80, 0.79, 0.81, 0.78, 0.80, 0.82, 0.79, 0.81, 0.80))
    for seed in (1, 2, 3):
        lamb = write_run(tmp_path, "lamb", "1e-2", "n2", seed, 4.0 + seed / 100, rung=mini)
        for ft_seed in (1, 2, 3):
            write_finetune(lamb / "finetune" / "final" / f"sst2-len32-s{ft_seed}", ft_seed, next(scores))
    floor = tmp_path / f"cpu-rung-floor-{mini.model}"
    for seed, accuracy in ((1, 0.78), (2, 0.79)):
        write_finetune(floor / "finetune" / "final" / f"sst2-len32-s{seed}", seed, accuracy)
    name = "downstream_gap_sst2_random_init_bert_mini_b128"
    partial = {record.name: record for record in rung_records(mini, tmp_path)}[name]
    assert partial.config["status"] == "partial: 2 of 3 fine-tunes, LAMB 9 of 9"
    write_finetune(floor / "finetune" / "final" / "sst2-len32-s3", 3, 0.77)
    floor_gap = {record.name: record for record in rung_records(mini, tmp_path)}[name]
    assert floor_gap.config["status"] == "complete" and floor_gap.config["reference_n"] == 9
    assert floor_gap.value < 0  # 0.78 against LAMB's 0.80
