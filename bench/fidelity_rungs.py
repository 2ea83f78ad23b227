"""The fidelity records of the study's rungs beyond BERT-tiny at batch 128 (issue #50), from their runs.

A rung is one model at one global batch on the seq-32 recipe (`results/cpu-study-rungs/reproduce.sh` runs
it; its report is in `results/cpu-study-<key>/`, its runs' small files with the study's in
`results/cpu-study/runs/`):

- `m`: BERT-mini (4 x 256) at batch 128, 3,200 steps (`conf/batch/cpu_study_s32.yaml`);
- `b`: BERT-tiny at batch 1,024, 400 steps, the same 409,600 samples (`conf/batch/cpu_study_s32_b1024.yaml`);
- `s`: BERT-small (4 x 512) at batch 128, as `m`, one seed per arm.

Each rung tunes its baselines: LAMB and AdamW at three LRs x3 apart (seed 1, 2 processes; extended by one LR
beyond an edge when the best is at one), then each at its best LR over the rung's seeds (1-3; `s`: 1); the
1-bit arms run at LAMB's best LR. Run folders are named `cpu-rung-<key>-<arm>-lr<lr>-<workers>-s<seed>`
(`lr3e-2`, `n2`, `sim32`), the randomly initialised model `cpu-rung-floor-<model>`. Records (`python -m bench
fidelity` writes them into `results/bench/fidelity.json`), each computed from the runs that exist and
carrying its `status`:

- `lamb_best_lr_<model>_b<batch>` (and `adamw_best_lr_...`): the LR of the lowest seed-1 final MLM loss;
- `lamb_final_mlm_accuracy_<model>_b<batch>`: LAMB's final masked-LM accuracy at its best LR, over seeds;
- `final_mlm_loss_ratio_<variant>_<model>_b<batch>_n<workers>[sim]`: value = the arm's mean final MLM loss
  over seeds, peer_value = LAMB's at its best LR, ratio = value / peer_value (`onebit_lamb`,
  `onebit_lamb_deepspeed` at LAMB's best LR; `adamw` at its own); `..._lr<lr>` for the default at an LR next
  to LAMB's best;
- `downstream_gap_sst2_<variant>_<model>_b<batch>_n<workers>[sim]`: SST-2 dev accuracy minus LAMB's, in
  pooled seed standard deviations, sqrt((s_a^2 + s_b^2) / 2) (`random_init` for the floor); over the
  fine-tunes of the arm's checkpoints (`b`: one per checkpoint with the run's seed; `m`, `s`: seeds 1-3 on
  each, since one SST-2 fine-tune's seed noise, ~0.9 points at rung b, exceeds the checkpoints' differences).

Final MLM loss = mean of the last `FINAL_WINDOW` logged records (`results.compare.analysis.final_value`),
None for a diverged run (counted in the record, left out of the mean). Status: `complete` when both sides
have the rung's seeds (and LAMB's LR sweep is done), else `partial: ...` saying what exists. Nothing is
estimated: a record without runs on both sides is not written.

`python -m bench.fidelity_rungs` answers the study script: `spec <rung>` (its settings, as shell
assignments), `best-lr <rung> <optimizer> <runs folder>` (the best LR so far, and the next LR to run or `-`),
`lr-neighbours <lr>` (the LRs x3 below and above), `deepspeed-seeds <rung> <runs folder>` (the worker counts
where DeepSpeed's seed 1 is at most 2 LAMB std above the target, so that it gets seeds 2-3), `ft-lr <rung>
[<folder>]` (SST-2's LR for the rung's fine-tunes from its LR check, and the next LR to check or `-`).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bench.records import Record
from results.compare.analysis import diverged, final_value
from results.compare.runs import load_run_folder, read_finetune_result

REPO = Path(__file__).resolve().parents[1]
KEPT_RUNS = REPO / "results" / "cpu-study" / "runs"  # the study's runs' small files, the rungs' among them
FINAL_WINDOW = 10  # logged records, as the seq-32 study (results/cpu-study/reproduce.sh: final_window=10)
SEEDS = 3
FLOOR_FINETUNE_SEEDS = 3  # the random-init floor's SST-2 seeds (reproduce.sh: spec's FLOOR_FT_SEEDS)
TARGET = "<= 1.01 (3-seed means, 2 real and >= 32 simulated workers)"
DOWNSTREAM_TASK = "sst2"
MAX_EXTRA_LRS = 2  # LRs added beyond an edge of the planned sweep
FINETUNE_LRS = ("3e-4", "1e-3", "3e-3")  # SST-2's LR check per rung; 1e-3 is the seq-32 study's recipe


@dataclass(frozen=True)
class Rung:
    key: str
    model: str
    batch: str  # the batch recipe (conf/batch/)
    global_batch: int
    steps: int
    lamb_lrs: tuple[str, ...]  # the planned sweep, centred on the recipe's LR
    adamw_lrs: tuple[str, ...]
    workers: tuple[str, ...]  # the 1-bit arms' worker counts: n<processes> or sim<workers>
    log_every: int
    # dropout off, as BERT-tiny's config (conf/model/bert_tiny.yaml): the rung changes the size only
    model_overrides: tuple[str, ...] = ()
    seeds: int = SEEDS  # pretraining seeds per arm at its LR (the sweeps run seed 1)
    finetune_seeds: int = 1  # SST-2 seeds per checkpoint: 1 = the pretraining run's own seed, k = seeds 1..k
    checkpoint_every: int = 0  # steps between a run's checkpoints (0: at the end only), to resume long runs

    @property
    def folder(self) -> Path:
        """The rung's report."""
        return REPO / "results" / f"cpu-study-{self.key}"

    @property
    def recipe_lr(self) -> str:
        return self.lamb_lrs[len(self.lamb_lrs) // 2]

    @property
    def samples(self) -> int:
        return self.global_batch * self.steps

    @property
    def tag(self) -> str:
        return f"{self.model}_b{self.global_batch}"


NO_DROPOUT = ("model.hidden_dropout_prob=0.0", "model.attention_probs_dropout_prob=0.0")
RUNGS = {
    "m": Rung(
        key="m", model="bert_mini", batch="cpu_study_s32", global_batch=128, steps=3200,
        lamb_lrs=("3e-3", "1e-2", "3e-2"), adamw_lrs=("3e-4", "1e-3", "3e-3"), workers=("n2", "sim32"),
        log_every=5, model_overrides=NO_DROPOUT, finetune_seeds=3, checkpoint_every=800,
    ),
    # one seed per arm (the rung above BERT-mini)
    "s": Rung(
        key="s", model="bert_small", batch="cpu_study_s32", global_batch=128, steps=3200,
        lamb_lrs=("3e-3", "1e-2", "3e-2"), adamw_lrs=("3e-4", "1e-3", "3e-3"), workers=("n2", "sim32"),
        log_every=5, model_overrides=NO_DROPOUT, seeds=1, finetune_seeds=3, checkpoint_every=400,
    ),
    # log_every 1: the final window (10 records) spans the last 10 steps, 10,240 samples
    "b": Rung(
        key="b", model="bert_tiny", batch="cpu_study_s32_b1024", global_batch=1024, steps=400,
        lamb_lrs=("1e-2", "3e-2", "1e-1"), adamw_lrs=("1e-3", "3e-3", "1e-2"),
        workers=("n2", "sim32", "sim64"), log_every=1,
    ),
}  # fmt: skip


# -- LRs on the 1-3-10 grid, named as in the run folders ---------------------------------------------------
def lr_tag(lr: float) -> str:
    """0.03 -> "3e-2" (the run folders' spelling)."""
    mantissa, exponent = f"{lr:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def lr_value(tag: str) -> float:
    return float(tag)


def lr_neighbour(tag: str, up: bool) -> str:
    """The next LR on the x3 grid (1, 3, 10, 30, ...): "3e-2" up -> "1e-1", down -> "1e-2"."""
    mantissa, exponent = tag.split("e")
    step = {("1", True): ("3", 0), ("3", True): ("1", 1), ("1", False): ("3", -1), ("3", False): ("1", 0)}
    new, shift = step[(mantissa, up)]
    return f"{new}e{int(exponent) + shift}"


# -- the runs --------------------------------------------------------------------------------------------
@dataclass
class RungRun:
    name: str
    optimizer: str  # lamb | adamw | onebit_lamb | onebit_lamb_deepspeed
    lr: str
    workers: int
    simulated: bool
    seed: int
    model: str
    global_batch: int
    samples: int
    steps: int
    diverged: bool
    final_mlm_loss: float | None
    final_mlm_accuracy: float | None
    downstream: list[float] = field(default_factory=list)  # SST-2 dev accuracy per fine-tune seed

    @property
    def workers_tag(self) -> str:
        return f"n{self.workers}" + ("sim" if self.simulated else "")


# cpu-rung-<rung>-abl-<what>-...: an arm with one option changed (the reports' ablations)
ABLATION_TAG = "abl"


def finished_run_folders(runs_dir: Path, rung: Rung) -> list[Path]:
    """The rung's pretraining runs that finished (summary.json written), the floor and the ablations left out:
    an ablation runs an arm's optimizer with one option changed, and would count as that arm."""
    return sorted(
        folder
        for folder in runs_dir.glob(f"cpu-rung-{rung.key}-*")
        if (folder / "summary.json").is_file()
        and (folder / "config.yaml").is_file()
        and not folder.name.startswith(f"cpu-rung-{rung.key}-{ABLATION_TAG}-")
    )


def downstream_scores(folder: Path, task: str = DOWNSTREAM_TASK) -> list[float]:
    """Every fine-tune seed's main metric in `<folder>/finetune/final/<task>-len32*/` (the study's recipe)."""
    scores: list[float] = []
    for path in sorted((folder / "finetune" / "final").glob(f"{task}-len32*/all_results.json")):
        scores.extend(read_finetune_result(path).scores.values())
    return scores


def load_rung_run(folder: Path) -> RungRun:
    run = load_run_folder(folder)
    raw = yaml.safe_load((folder / "config.yaml").read_text(encoding="utf-8"))
    phase = raw["batch"]["phases"][0]
    summary = json.loads((folder / "summary.json").read_text(encoding="utf-8"))
    optimizer = run.optimizer + (f"[{run.variant}]" if run.variant else "")
    return RungRun(
        name=folder.name,
        optimizer=optimizer,
        lr=lr_tag(float(phase["lr"])),
        workers=int(run.workers or 1),
        simulated=run.simulated,
        seed=int(run.seed or 0),
        model=str(run.model),
        global_batch=run.global_batch,
        samples=int(summary["samples_seen"]),
        steps=int(summary["global_step"]),
        diverged=diverged(run),
        final_mlm_loss=final_value(run, "mlm_loss", FINAL_WINDOW),
        final_mlm_accuracy=final_value(run, "mlm_accuracy", FINAL_WINDOW),
        downstream=downstream_scores(folder),
    )


def load_rung_runs(runs_dir: Path, rung: Rung) -> list[RungRun]:
    runs = [load_rung_run(folder) for folder in finished_run_folders(runs_dir, rung)]
    return [r for r in runs if r.model == rung.model and r.global_batch == rung.global_batch]


def select(
    runs: Iterable[RungRun], optimizer: str, *, lr: str | None = None, workers: str | None = "n2",
    seed: int | None = None,
) -> list[RungRun]:  # fmt: skip
    return [
        r
        for r in runs
        if r.optimizer == optimizer
        and (lr is None or r.lr == lr)
        and (workers is None or r.workers_tag == workers)
        and (seed is None or r.seed == seed)
    ]


# -- the LR sweeps --------------------------------------------------------------------------------------
@dataclass
class Sweep:
    optimizer: str
    planned: tuple[str, ...]
    losses: dict[str, float | None]  # LR -> seed-1 final MLM loss (None: diverged)

    @property
    def best(self) -> str | None:
        finite = {lr: loss for lr, loss in self.losses.items() if loss is not None}
        return min(finite, key=lambda lr: finite[lr]) if finite else None

    @property
    def planned_done(self) -> int:
        return sum(lr in self.losses for lr in self.planned)

    @property
    def edge(self) -> str | None:
        """`low` / `high` when the best is the lowest / highest LR run so far (the optimum may lie beyond)."""
        best = self.best
        if best is None or len(self.losses) < 2:
            return None
        ordered = sorted(self.losses, key=lr_value)
        return "low" if best == ordered[0] else "high" if best == ordered[-1] else None

    @property
    def middle(self) -> str:
        """The recipe's LR, the middle of the plan: the choice before any run."""
        return self.planned[len(self.planned) // 2]

    @property
    def next_lr(self) -> str | None:
        """The next LR to run: the planned ones first (the recipe's, the middle one, before the others), then
        one beyond the edge the best sits at (at most `MAX_EXTRA_LRS` beyond the plan)."""
        middle = self.middle
        for lr in (middle, *(lr for lr in self.planned if lr != middle)):
            if lr not in self.losses:
                return lr
        edge = self.edge
        if edge is None or len(self.losses) >= len(self.planned) + MAX_EXTRA_LRS:
            return None
        ordered = sorted(self.losses, key=lr_value)
        return lr_neighbour(ordered[-1], up=True) if edge == "high" else lr_neighbour(ordered[0], up=False)

    @property
    def complete(self) -> bool:
        return self.planned_done == len(self.planned) and self.next_lr is None

    @property
    def status(self) -> str:
        if self.complete:
            return "complete" + (f" (best at the {self.edge} edge of the LRs run)" if self.edge else "")
        extra = len(self.losses) - self.planned_done
        return (
            f"partial: {self.planned_done} of {len(self.planned)} LRs"
            + (f" + {extra} beyond the edge" if extra else "")
            + (f"; next {self.next_lr}" if self.next_lr else "")
        )


def sweep(runs: Sequence[RungRun], rung: Rung, optimizer: str) -> Sweep:
    planned = rung.lamb_lrs if optimizer == "lamb" else rung.adamw_lrs
    losses = {r.lr: r.final_mlm_loss for r in select(runs, optimizer, seed=1)}
    return Sweep(optimizer, planned, losses)


def finetune_sweep(rung: Rung, folder: Path | None = None) -> Sweep:
    """The SST-2 LR check (the study script's stage `ft_lr`): LAMB's seed-1 checkpoint at its best LR
    fine-tuned at each LR into `<folder>/finetune-lr<LR>/cpu-rung-<key>-lamb-.../` (folder: the rung's
    report). An LR sweep whose "loss" is minus the dev accuracy: the planned `FINETUNE_LRS`, then one LR
    beyond an edge."""
    scores: dict[str, float | None] = {}
    for path in sorted(
        (folder or rung.folder).glob(f"finetune-lr*/cpu-rung-{rung.key}-lamb-*/all_results.json")
    ):
        lr = path.parent.parent.name.removeprefix("finetune-lr")
        scores[lr] = -statistics.fmean(read_finetune_result(path).scores.values())
    return Sweep("finetune", FINETUNE_LRS, scores)


def lamb_best(runs: Sequence[RungRun], rung: Rung) -> str:
    """LAMB's best LR so far, or the recipe's before any LAMB run (the provisional choice)."""
    return sweep(runs, rung, "lamb").best or rung.recipe_lr


# -- records ---------------------------------------------------------------------------------------------
def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _seeds_status(
    rung: Rung,
    arm: Sequence[RungRun],
    peer: Sequence[RungRun] | None,
    lamb_sweep: Sweep,
    wanted: int | None = None,
) -> str:
    """`peer`: LAMB's runs at its best LR (None when the record is LAMB's own); `wanted`: the arm's planned
    seeds where the plan runs fewer than the rung's (DeepSpeed's seed 1 outside the band of
    `deepspeed_seed_workers`)."""
    arm_seeds, peer_seeds, seeds = len({r.seed for r in arm}), len({r.seed for r in peer or arm}), rung.seeds
    if arm_seeds >= (wanted or seeds) and peer_seeds >= seeds and lamb_sweep.complete:
        if wanted is not None and wanted < seeds:
            return "complete: seed 1 only (more than 2 LAMB seed std above the target: seeds 2-3 not planned)"
        return "complete"
    parts = [f"{arm_seeds} of {wanted or seeds} seeds"] + (
        [f"LAMB {peer_seeds} of {seeds} seeds"] if peer else []
    )
    if not lamb_sweep.complete:
        parts.append(f"LAMB LR sweep {lamb_sweep.status}")
    return "partial: " + ", ".join(parts)


def _config(rung: Rung, runs: Sequence[RungRun], variant: str, lr: str, **extra: Any) -> dict[str, Any]:
    first = runs[0]
    return {
        "model": rung.model,
        "global_batch": rung.global_batch,
        "workers": first.workers,
        "simulated_workers": first.simulated,
        "variant": variant,
        "lr": lr_value(lr),
        "seeds": sorted(r.seed for r in runs),
        "samples": sorted({r.samples for r in runs}),
        "steps": sorted({r.steps for r in runs}),
        "runs": [r.name for r in runs],
        "diverged_runs": [r.name for r in runs if r.diverged],
        "final_window_records": FINAL_WINDOW,
        "log_every": rung.log_every,
        "source": f"results/cpu-study/runs/cpu-rung-{rung.key}-* (results/cpu-study-rungs/reproduce.sh)",
        **extra,
    }


def _losses(runs: Sequence[RungRun]) -> list[float]:
    return [r.final_mlm_loss for r in runs if r.final_mlm_loss is not None]


def _lr_record(rung: Rung, runs: Sequence[RungRun], result: Sweep) -> Record | None:
    best = result.best
    if best is None:
        return None
    best_runs = select(runs, result.optimizer, lr=best, seed=1)
    return Record(
        name=f"{result.optimizer}_best_lr_{rung.tag}",
        value=lr_value(best),
        unit="peak LR (lowest seed-1 final MLM loss of the sweep, 2 processes)",
        config=_config(
            rung, best_runs, result.optimizer, best, status=result.status, planned_lrs=list(result.planned),
            final_mlm_loss_by_lr={lr: result.losses[lr] for lr in sorted(result.losses, key=lr_value)},
            edge=result.edge,
        ),
    )  # fmt: skip


def _ratio_record(
    rung: Rung, name: str, variant: str, lr: str, arm: Sequence[RungRun], peer: Sequence[RungRun],
    lamb_sweep: Sweep, target: str | None, wanted: int | None = None,
) -> Record | None:  # fmt: skip
    losses, peer_losses = _losses(arm), _losses(peer)
    if not losses or not peer_losses:
        return None
    value, std = _mean_std(losses)
    peer_value, peer_std = _mean_std(peer_losses)
    return Record(
        name=name,
        value=value,
        unit="MLM loss (final, mean over seeds)",
        peer=f"lamb lr {lr_value(lamb_sweep.best or rung.recipe_lr):g} n2",
        peer_value=peer_value,
        target=target,
        config=_config(
            rung, arm, variant, lr, status=_seeds_status(rung, arm, peer, lamb_sweep, wanted), std=std,
            per_seed={r.seed: r.final_mlm_loss for r in arm}, peer_std=peer_std,
            peer_seeds=sorted(r.seed for r in peer), peer_per_seed={r.seed: r.final_mlm_loss for r in peer},
        ),
    )  # fmt: skip


def _gap_record(
    rung: Rung, name: str, variant: str, lr: str, scores: Sequence[float], runs: Sequence[RungRun],
    peer: Sequence[RungRun], lamb_sweep: Sweep, target: str | None,
) -> Record | None:  # fmt: skip
    """`scores` (the arm's SST-2 accuracies; `runs`: the pretraining runs they come from, none for the floor)
    against LAMB's at its best LR, in pooled seed std."""
    peer_scores = [s for r in peer for s in r.downstream]
    if len(scores) < 2 or len(peer_scores) < 2:  # one score per side has no noise estimate
        return None
    mean, std = _mean_std(scores)
    peer_mean, peer_std = _mean_std(peer_scores)
    noise = math.sqrt((std**2 + peer_std**2) / 2)
    if not noise:
        return None
    with_scores = [r for r in runs if r.downstream]
    # an arm: every checkpoint's fine-tunes; the floor (no runs): one random init at FLOOR_FINETUNE_SEEDS
    peer_wanted = rung.seeds * rung.finetune_seeds
    wanted = peer_wanted if runs else FLOOR_FINETUNE_SEEDS
    status = (
        "complete"
        if len(scores) >= wanted and len(peer_scores) >= peer_wanted and lamb_sweep.complete
        else f"partial: {len(scores)} of {wanted} fine-tunes, LAMB {len(peer_scores)} of {peer_wanted}"
    )
    config = (
        _config(rung, with_scores, variant, lr)
        if with_scores
        else {"model": rung.model, "global_batch": rung.global_batch, "variant": variant, "lr": None}
    )
    return Record(
        name=name,
        value=(mean - peer_mean) / noise,
        unit=f"pooled seed std (SST-2 dev accuracy, length 32; gap {mean - peer_mean:+.4f})",
        target=target,
        config={
            **config, "status": status, "accuracy_mean": mean, "accuracy_std": std, "n": len(scores),
            "reference_mean": peer_mean, "reference_std": peer_std, "reference_n": len(peer_scores),
            "reference_runs": [r.name for r in peer if r.downstream],
        },
    )  # fmt: skip


def floor_scores(runs_dir: Path, model: str) -> list[float]:
    return downstream_scores(runs_dir / f"cpu-rung-floor-{model}")


def rung_records(rung: Rung, runs_dir: Path | None = None) -> list[Record]:
    """The rung's records from the finished runs in `runs_dir` (default: the small files the study keeps)."""
    runs_dir = runs_dir or KEPT_RUNS
    if not runs_dir.is_dir():
        return []
    runs = load_rung_runs(runs_dir, rung)
    lamb_sweep, adamw_sweep = sweep(runs, rung, "lamb"), sweep(runs, rung, "adamw")
    records = [r for r in (_lr_record(rung, runs, lamb_sweep), _lr_record(rung, runs, adamw_sweep)) if r]
    best = lamb_sweep.best
    if best is None:
        return records
    lamb = select(runs, "lamb", lr=best)
    accuracies = [r.final_mlm_accuracy for r in lamb if r.final_mlm_accuracy is not None]
    if accuracies:
        records.append(
            Record(
                name=f"lamb_final_mlm_accuracy_{rung.tag}",
                value=statistics.fmean(accuracies),
                unit="fraction (masked-LM accuracy, final, mean over seeds)",
                target=">= 0.25",
                config=_config(
                    rung,
                    lamb,
                    "lamb",
                    best,
                    status=_seeds_status(rung, lamb, None, lamb_sweep),
                    per_seed={r.seed: r.final_mlm_accuracy for r in lamb},
                ),
            )
        )
    arms: list[tuple[str, str, str, str | None]] = []  # (variant, workers, lr, target)
    if adamw_sweep.best is not None:
        arms.append(("adamw", "n2", adamw_sweep.best, None))
    for variant in ("onebit_lamb", "onebit_lamb_deepspeed"):
        for workers in sorted(
            {r.workers_tag for r in select(runs, variant, workers=None)}, key=_workers_order
        ):
            arms.append((variant, workers, best, TARGET if variant == "onebit_lamb" else None))
    banded = {_tag(w) for w in deepspeed_seed_workers(runs, rung)}
    for variant, workers, lr, target in arms:
        arm = select(runs, variant, lr=lr, workers=workers)
        name = f"{variant}_{rung.tag}_{workers}"
        wanted = None  # DeepSpeed's seeds 2-3 run only within the band (`deepspeed_seed_workers`)
        if variant == "onebit_lamb_deepspeed" and len(lamb) >= rung.seeds and workers not in banded:
            wanted = 1
        record = _ratio_record(
            rung, f"final_mlm_loss_ratio_{name}", variant, lr, arm, lamb, lamb_sweep, target, wanted
        )
        if record:
            records.append(record)
        gap_target = "|gap| <= 1 std" if variant == "onebit_lamb" else None
        scores = [score for run in arm for score in run.downstream]
        gap = _gap_record(
            rung, f"downstream_gap_sst2_{name}", variant, lr, scores, arm, lamb, lamb_sweep, gap_target
        )
        if gap:
            records.append(gap)
    for lr in sorted({r.lr for r in select(runs, "onebit_lamb")} - {best}, key=lr_value):  # its LR preference
        arm = select(runs, "onebit_lamb", lr=lr)
        name = f"final_mlm_loss_ratio_onebit_lamb_{rung.tag}_n2_lr{lr}"
        record = _ratio_record(rung, name, "onebit_lamb", lr, arm, lamb, lamb_sweep, None)
        if record:
            records.append(record)
    floor = floor_scores(runs_dir, rung.model)
    name = f"downstream_gap_sst2_random_init_{rung.tag}"
    gap = _gap_record(rung, name, "random_init", best, floor, [], lamb, lamb_sweep, None)
    if gap:
        records.append(gap)
    return records


def _workers_order(tag: str) -> tuple[bool, int]:
    return tag.endswith("sim"), int(tag[1:].removesuffix("sim"))


def all_rung_records() -> list[Record]:
    return [record for rung in RUNGS.values() for record in rung_records(rung)]


# -- answers for the study script -------------------------------------------------------------------------
def _tag(workers: str) -> str:
    """A worker count as the script names it (`n2`, `sim32`) -> as the records do (`n2`, `n32sim`)."""
    return workers if workers.startswith("n") else f"n{workers.removeprefix('sim')}sim"


def deepspeed_seed_workers(runs: Sequence[RungRun], rung: Rung) -> list[str]:
    """Worker counts where DeepSpeed's seed-1 final MLM loss is at most 2 LAMB seed std above the target
    (1.01 x LAMB's mean): the issue runs its seeds 2-3 there. A seed-1 loss far below the target counts too:
    DeepSpeed's seeds spread far more than LAMB's (rung b, 2 processes: 0.940x-1.020x LAMB's mean, std 11x
    LAMB's), so one seed cannot tell which side of the target the arm is on. Needs LAMB's three seeds at its
    best LR."""
    best = lamb_best(runs, rung)
    losses = _losses(select(runs, "lamb", lr=best))
    if rung.seeds < SEEDS or len(losses) < SEEDS:  # a one-seed rung: no LAMB std, no seeds 2-3
        return []
    mean, std = _mean_std(losses)
    out = []
    for workers in rung.workers:
        tag = _tag(workers)
        first = _losses(select(runs, "onebit_lamb_deepspeed", lr=best, workers=tag, seed=1))
        if first and first[0] <= 1.01 * mean + 2 * std:
            out.append(workers)
    return out


def _spec(rung: Rung) -> str:
    lines = {
        "MODEL": rung.model,
        "BATCH": rung.batch,
        "GLOBAL": str(rung.global_batch),
        "LAMB_LRS": " ".join(rung.lamb_lrs),
        "ADAMW_LRS": " ".join(rung.adamw_lrs),
        "RUNG_WORKERS": " ".join(rung.workers),
        "LOG_EVERY": str(rung.log_every),
        "MODEL_ARGS": " ".join(rung.model_overrides),
        "RECIPE_LR": rung.recipe_lr,
        "RUNG_SEEDS": " ".join(str(seed) for seed in range(1, rung.seeds + 1)),
        "FT_SEEDS": str(rung.finetune_seeds),
        "FLOOR_FT_SEEDS": " ".join(str(seed) for seed in range(1, FLOOR_FINETUNE_SEEDS + 1)),
        "CHECKPOINT_EVERY": str(rung.checkpoint_every),
    }
    return "\n".join(f"{key}='{value}'" for key, value in lines.items())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.fidelity_rungs")
    commands = parser.add_subparsers(dest="command", required=True)
    spec = commands.add_parser("spec", help="the rung's settings as shell assignments")
    spec.add_argument("rung", choices=sorted(RUNGS))
    best = commands.add_parser("best-lr", help="'<best LR so far> <next LR to run or ->'")
    best.add_argument("rung", choices=sorted(RUNGS))
    best.add_argument("optimizer", choices=("lamb", "adamw"))
    best.add_argument("runs", type=Path)
    neighbours = commands.add_parser("lr-neighbours", help="'<LR below> <LR above>' on the x3 grid")
    neighbours.add_argument("lr")
    more = commands.add_parser("deepspeed-seeds", help="worker counts that get DeepSpeed's seeds 2-3")
    more.add_argument("rung", choices=sorted(RUNGS))
    more.add_argument("runs", type=Path)
    finetune = commands.add_parser("ft-lr", help="'<SST-2 LR so far> <next LR to check or ->'")
    finetune.add_argument("rung", choices=sorted(RUNGS))
    finetune.add_argument("folder", type=Path, nargs="?", help="the check's fine-tunes (the report's)")
    args = parser.parse_args(argv)
    if args.command == "lr-neighbours":
        print(lr_neighbour(args.lr, up=False), lr_neighbour(args.lr, up=True))
        return
    rung = RUNGS[args.rung]
    if args.command == "spec":
        print(_spec(rung))
        return
    if args.command == "ft-lr":
        check = finetune_sweep(rung, args.folder)
        print(check.best or check.middle, check.next_lr or "-")
        return
    runs = load_rung_runs(args.runs, rung) if args.runs.is_dir() else []
    if args.command == "best-lr":
        result = sweep(runs, rung, args.optimizer)
        print(result.best or result.middle, result.next_lr or "-")
    else:
        print(" ".join(deepspeed_seed_workers(runs, rung)))


if __name__ == "__main__":
    main(sys.argv[1:])
