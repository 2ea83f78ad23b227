#!/usr/bin/env bash
# Reproduces the study's rungs beyond BERT-tiny at batch 128 (issue #50): 1-bit LAMB against tuned LAMB and
# AdamW on the seq-32 recipe (results/cpu-study/README.md, "The seq-32 study"), one rung per model and batch:
#   m   BERT-mini (4 x 256, dropout off as BERT-tiny's) at batch 128, 3,200 steps (conf/batch/cpu_study_s32.yaml)
#   b   BERT-tiny at batch 1,024, 400 steps, the same 409,600 samples (conf/batch/cpu_study_s32_b1024.yaml)
#   s   BERT-small (4 x 512, dropout off) at batch 128 as m, one seed per arm
# Each rung's settings (model, recipe, the LRs swept, worker counts, logging) are bench/fidelity_rungs.py's
# RUNGS; its report is results/cpu-study-<rung>/README.md, the runs' small files go with the study's to
# results/cpu-study/runs/, the records to results/bench/fidelity.json (`python -m bench fidelity`).
#
# Runs go to results/runs/cpu-rung-<rung>-<arm>-lr<lr>-<workers>-s<seed> (arm lamb, adamw, onebit_lamb,
# onebit_lamb_deepspeed; workers n2 = 2 processes, simK = 2 processes x K/2 simulated workers); every run logs
# the diagnostics (diagnostics=true). A run whose summary.json exists (fine-tune: all_results.json) is skipped,
# so the script picks up where an interrupted one stopped; an interrupted run of rung m or s resumes from its
# last checkpoint (every 800 / 400 steps; SIGTERM checkpoints and stops one, exit 75). A finished run kept
# without its checkpoints (its small files from another machine) runs again when a fine-tune needs it, the
# first run's files moved to <run>/first-run/. Each pretraining run's
# wall time and the load around it go to results/runs/cpu-rung-times.tsv (kept as
# results/cpu-study-<rung>/run-times.tsv), one row per part of a run stopped and resumed.
# Stages (STAGES, in this order; each rung in RUNGS):
#   data        the study's 8K vocabulary (its sha256 checked) and the sample at seq 32 (data/prepared/)
#   lamb_sweep  LAMB at the rung's three LRs (x3 apart around the recipe's), seed 1, 2 processes; while the
#               best is at an edge, one more LR beyond it (at most two more)
#   adamw_sweep the same for AdamW (optim=adamw: torch's fused AdamW, bias-corrected, the recipe's schedule)
#   seeds       LAMB and AdamW at their best LRs, the rung's seeds (SEEDS="1 2 3" overrides them)
#   onebit      the default (optim=onebit_lamb) at LAMB's best LR, the seeds x the rung's worker counts
#   deepspeed   DeepSpeed's algorithm (optim=onebit_lamb_deepspeed) at LAMB's best LR, seed 1 x the worker
#               counts; seeds 2-3 where seed 1 is at most 2 LAMB seed std above the target (needs LAMB's 3
#               seeds; not on a one-seed rung)
#   onebit_lr   the default at the LRs x3 below and above LAMB's best, seed 1, 2 processes
#   ablation    rung b: the default at LAMB's best LR, 2 processes, with optim.variance_refresh=8 (seed 1),
#               freeze_step 160 (the seeds) and 120 (seed 1): cpu-rung-b-abl-<what>-onebit_lamb-...;
#               rung m: optim.ffn_row_scales=true (a scale per FFN neuron) and freeze_step 1280 (40 %, after
#               LAMB's loss falls from 6.1 to 5.3), the seeds x the worker counts; and LAMB itself at 32
#               simulated workers (abl-lamb, the seeds): the peer's own trajectory there, nothing compressed;
#               and the default and LAMB at 8 simulated workers (16 sequences each; the seeds): whether the
#               cost at 32 simulated workers (4 each) follows each worker's share; and the exchange without
#               the server's 1-bit compression at 8 simulated workers (abl-fp32server, seed 1: a study's
#               patch, results/cpu-study-m/ablations/), and without the workers' (abl-fp32worker, seed 1, at 8
#               and 32 simulated workers); and
#               the workers' values in 2 bits (abl-2bitworker, seed 1, at 8 and 32 simulated workers)
#   floor       the randomly initialised model (cpu-rung-floor-<model>: max_steps=0)
#   ft_lr       the SST-2 LR check on the new rung: LAMB's seed-1 checkpoint at its best LR and the floor at
#               3e-4 1e-3 3e-3, then one LR beyond an edge while the best is at one (at most two more) ->
#               results/cpu-study-<rung>/finetune-lr<LR>/ (outside the runs; `bench.fidelity_rungs ft-lr`)
#   finetune    SST-2 (full training set, length 32, 1 epoch) of every finished run at its arm's best LR that
#               did not diverge, seed = the run's (rungs m, s: seeds 1-3 each), and the floor at seeds 1-3; LR:
#               the check's best for LAMB's checkpoint (FT_LR=<lr> overrides it; before any check, the
#               seq-32 study's 1e-3). With this stage on, a run that finishes at its arm's best LR once the
#               check has chosen is fine-tuned before the next run starts: a machine's checkpoints may not
#               outlive it, and a run kept without them runs again for its fine-tunes
#   report      keep the runs' small files in results/cpu-study/runs/, `make compare` of the best-LR
#               runs (results/cpu-study-<rung>/report.md), the records (python -m bench fidelity)
# DRY=1 lists the pretraining runs still to do (sweeps: the planned LRs) and runs nothing; MAX_RUNS=<n> stops
# after n pretraining runs; ONLY=<extended regex> runs only the pretraining runs whose name matches (the others
# are left pending), to take the runs a target needs first. Every run is started under `nice -n ${NICE:-19}`
# (a shared 2-core machine).
#   results/cpu-study-rungs/reproduce.sh                                      # everything, every rung
#   RUNGS=b STAGES="lamb_sweep adamw_sweep report" results/cpu-study-rungs/reproduce.sh   # a subset
#   DRY=1 RUNGS=m results/cpu-study-rungs/reproduce.sh                        # what is pending
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNGS=${RUNGS:-"b m s"}
SEEDS=${SEEDS:-}  # empty: each rung's (bench/fidelity_rungs.py)
STAGES=${STAGES:-"data lamb_sweep adamw_sweep seeds onebit deepspeed onebit_lr ablation floor ft_lr finetune report"}
FT_LR=${FT_LR:-}  # empty: each rung's from its LR check
DRY=${DRY:-0}
NICE=${NICE:-19}
SIM_PROCESSES=2
DATA=sample_8k_s32
PY=.venv/bin/python
TIMES=results/runs/cpu-rung-times.tsv
declare -A LISTED=()  # DRY: the runs listed so far
STARTED=0  # pretraining runs done by this invocation (MAX_RUNS=<n>: stop before the next)
export OMP_NUM_THREADS=1 WANDB_MODE=disabled

# the environment: `make setup` (not here when .venv is a link to another checkout's, as in a git worktree:
# its stamp would be older than this checkout's files and setup would reinstall the project from here)
[[ -L .venv || -x $PY ]] || make --no-print-directory setup
stage() { [[ " $STAGES " == *" $1 "* ]]; }

declare -A ARM=(
  [lamb]="optim=lamb"
  [adamw]="optim=adamw optim.fused=true"
  [onebit_lamb]="optim=onebit_lamb"
  [onebit_lamb_deepspeed]="optim=onebit_lamb_deepspeed"
  # the ablations (stage `ablation`; bench/fidelity_rungs.py leaves cpu-rung-*-abl-* out of the records)
  [abl-refresh8-onebit_lamb]="optim=onebit_lamb optim.variance_refresh=8"
  [abl-freeze120-onebit_lamb]="optim=onebit_lamb batch.phases.0.freeze_step=120"
  [abl-freeze160-onebit_lamb]="optim=onebit_lamb batch.phases.0.freeze_step=160"
  [abl-freeze1280-onebit_lamb]="optim=onebit_lamb batch.phases.0.freeze_step=1280"
  [abl-ffnrows-onebit_lamb]="optim=onebit_lamb optim.ffn_row_scales=true"
  # the server's average sent in fp32, not in 1 bit (ARM_PATCH: results/cpu-study-m/ablations/fp32_server.py)
  [abl-fp32server-onebit_lamb]="optim=onebit_lamb"
  # the workers' values sent in fp32 and averaged exactly, the server's 1 bit kept (fp32_worker.py there)
  [abl-fp32worker-onebit_lamb]="optim=onebit_lamb"
  # each worker's values in 2 bits (two sign passes), the server's 1 bit kept (two_bit_worker.py there)
  [abl-2bitworker-onebit_lamb]="optim=onebit_lamb"
  # the control: LAMB itself at simulated workers (nothing compressed; the gradient is that of the n-worker run)
  [abl-lamb]="optim=lamb"
)
# a study's patch an arm's processes apply (results/cpu-study-m/ablations/: its sitecustomize.py reads
# RUNG_ABLATION, with that folder first on PYTHONPATH)
declare -A ARM_PATCH=(
  [abl-fp32server-onebit_lamb]=fp32_server
  [abl-fp32worker-onebit_lamb]=fp32_worker
  [abl-2bitworker-onebit_lamb]=two_bit_worker
)

if stage data && (( ! DRY )); then  # as results/cpu-study/reproduce.sh: the vocabulary, then the seq-32 sample
  VOCAB=data/prepared/vocab/sample-8192.txt
  VOCAB_SHA256=3bbba317d37e628781b478be6d56ffe2ccf593291da729d0179a2c48ac65b573
  if [[ ! -f $VOCAB ]]; then
    $PY -m data.prepare data=sample data.instances.short_seq_draw=document \
      data.shards.output_dir=data/prepared/sample_vocab_source show_progress=false
    $PY -m data.vocab_subset data/prepared/sample_vocab_source/seq128 8192 "$VOCAB"
  fi
  if [[ $(sha256sum "$VOCAB" | cut -d' ' -f1) != "$VOCAB_SHA256" ]]; then
    echo "reproduce.sh: $VOCAB is not the study's vocabulary (sha256 differs): remove it and data/prepared/$DATA, then re-run" >&2
    exit 2
  fi
  [[ -f data/prepared/$DATA/seq32/manifest.json ]] || $PY -m data.prepare data="$DATA" show_progress=false
fi

children_cpu() {  # children_cpu <`times` output>: its second line (children: user, system) in whole seconds
  sed -n 2p "$1" | awk '{ t = 0; for (i = 1; i <= 2; i++) { split($i, f, "m"); sub("s", "", f[2]); t += f[1] * 60 + f[2] }
    printf "%d", t }'
}

run_name() { echo "cpu-rung-$RUNG-$1-lr$2-$3-s$4"; }  # run_name <arm> <lr> <workers> <seed>

# pretrain <arm> <lr> <workers: n2 | sim8 | sim32 | sim64> <seed>
pretrain() {
  local arm=$1 lr=$2 workers=$3 seed=$4
  local run
  run=$(run_name "$arm" "$lr" "$workers" "$seed")
  [[ -f results/runs/$run/summary.json ]] && return 0
  if [[ -n ${ONLY:-} && ! $run =~ $ONLY ]]; then return 0; fi
  if [[ -n ${MAX_RUNS:-} ]] && (( STARTED >= MAX_RUNS )); then exit 0; fi
  if (( DRY )); then
    [[ -n ${LISTED[$run]:-} ]] || echo "pending $run"
    LISTED[$run]=1
    return 0
  fi
  local processes=$SIM_PROCESSES per_process=1
  case $workers in
    n*) processes=${workers#n} ;;
    sim*) per_process=$(( ${workers#sim} / SIM_PROCESSES )) ;;
  esac
  local share=$(( GLOBAL / (processes * per_process) ))
  local micro=$(( share < 64 ? share : 64 ))  # 64 x 32 tokens, as the seq-32 study
  local every=0 start=$SECONDS load
  every=$CHECKPOINT_EVERY  # long runs: resumable from a checkpoint
  load=$(cut -d' ' -f1 /proc/loadavg)
  times > results/runs/.times-before  # the CPU seconds of this shell's finished children (not in a subshell)
  local status=0 patch_env=()
  [[ -z ${ARM_PATCH[$arm]:-} ]] ||
    patch_env=("RUNG_ABLATION=${ARM_PATCH[$arm]}" "PYTHONPATH=$PWD/results/cpu-study-m/ablations:$PWD")
  # shellcheck disable=SC2086  # ARM, MODEL_ARGS: overrides, word-split
  nice -n "$NICE" env OMP_NUM_THREADS=$(( processes == 1 ? 2 : 1 )) "${patch_env[@]}" \
    launch/torchrun.sh --nproc "$processes" -- \
    batch="$BATCH" ${ARM[$arm]} model="$MODEL" $MODEL_ARGS data_dir="data/prepared/$DATA" seed="$seed" \
    run_name="$run" sim_world_size="$per_process" batch.phases.0.micro_batch="$micro" batch.phases.0.lr="$lr" \
    diagnostics=true log_every="$LOG_EVERY" checkpoint.every_steps="$every" wandb.mode=disabled show_progress=false \
    || status=$?
  times > results/runs/.times-after
  # run, wall seconds, CPU seconds (user + system, every process of the run), 1-minute load average at its
  # start and at its end (on a shared machine the wall time follows the load, the CPU time much less), exit
  # status (0: finished; 75: stopped by SIGTERM at a checkpoint, continued by the next call); rows without
  # the status are older, finished runs' last parts
  printf '%s\t%d\t%d\t%s\t%s\t%d\n' "$run" $(( SECONDS - start )) \
    $(( $(children_cpu results/runs/.times-after) - $(children_cpu results/runs/.times-before) )) \
    "$load" "$(cut -d' ' -f1 /proc/loadavg)" "$status" >> "$TIMES"
  (( status == 0 )) || exit "$status"
  STARTED=$(( STARTED + 1 ))
  fine_tune_now "$run"
}

# tune <lamb | adamw>: the planned LRs, then one beyond an edge while the best sits at one
tune() {
  local optimizer=$1 next lrs
  if (( DRY )); then
    lrs=$([[ $optimizer == lamb ]] && echo "$LAMB_LRS" || echo "$ADAMW_LRS")
    for lr in $lrs; do pretrain "$optimizer" "$lr" n2 1; done
    return 0
  fi
  local previous=""
  while true; do
    read -r _ next <<< "$($PY -m bench.fidelity_rungs best-lr "$RUNG" "$optimizer" results/runs)"
    [[ $next == - ]] && return 0
    if [[ -n ${ONLY:-} && ! $(run_name "$optimizer" "$next" n2 1) =~ $ONLY ]]; then return 0; fi
    if [[ $next == "$previous" ]]; then echo "reproduce.sh: $optimizer at LR $next did not finish" >&2; exit 1; fi
    pretrain "$optimizer" "$next" n2 1
    previous=$next
  done
}

best_lr() { $PY -m bench.fidelity_rungs best-lr "$RUNG" "$1" results/runs | cut -d' ' -f1; }

diverged() {  # diverged <run folder>: non-finite or ending above its first loss (results/compare/analysis.py)
  $PY -c 'import sys; from pathlib import Path; from results.compare.analysis import diverged
from results.compare.runs import load_run_folder
sys.exit(0 if diverged(load_run_folder(Path(sys.argv[1]))) else 1)' "$1"
}

# restore_checkpoint <run folder>: a finished run without its checkpoints runs again (same name, so the same
# arm, LR, workers and seed); the first run's summary, metrics and config go to <run>/first-run/
restore_checkpoint() {
  local run=$1 name
  name=$(basename "$run")
  [[ -d $run/checkpoints && -f $run/summary.json ]] && return 0
  [[ $name =~ ^cpu-rung-$RUNG-(.+)-lr(.+)-(n[0-9]+|sim[0-9]+)-s([0-9]+)$ ]] || return 0
  local arm=${BASH_REMATCH[1]} lr=${BASH_REMATCH[2]} workers=${BASH_REMATCH[3]} seed=${BASH_REMATCH[4]}
  if [[ -n ${ONLY:-} && ! $name =~ $ONLY ]]; then return 0; fi  # left as it is, its fine-tunes pending
  if (( DRY )); then
    [[ -n ${LISTED[$name]:-} ]] || echo "pending $name (again: its checkpoints are not here)"
    LISTED[$name]=1
    return 0
  fi
  if [[ -f $run/summary.json ]]; then
    mkdir -p "$run/first-run"
    mv "$run/summary.json" "$run/metrics.jsonl" "$run/config.yaml" "$run/first-run/"
  fi
  pretrain "$arm" "$lr" "$workers" "$seed"
}

finished() {  # finished <run folder>: the folder holding its summary (the run's, or its first run's)
  if [[ -f $1/summary.json ]]; then echo "$1"; elif [[ -f $1/first-run/summary.json ]]; then echo "$1/first-run"; fi
}

sst2() {  # sst2 <model folder> <output folder> <LR> <seed>
  [[ -f $2/all_results.json ]] && return 0
  restore_checkpoint "$1"
  [[ -f $2/all_results.json ]] && return 0  # the run again fine-tuned itself (fine_tune_now)
  (( DRY )) && { echo "pending fine-tune $2"; return 0; }
  [[ -d $1/checkpoints ]] || { echo "reproduce.sh: $1 has no checkpoints: fine-tune $2 left pending" >&2; return 0; }
  nice -n "$NICE" env OMP_NUM_THREADS=2 $PY -m finetune task=sst2 model_path="$1" output_dir="$2" task.lr="$3" \
    task.epochs=1 task.max_length=32 "seeds=[$4]" wandb.mode=disabled show_progress=false
}

# fine_tune_run <run folder> <LR>: SST-2 on the run's final checkpoint at the rung's fine-tune seeds (one: the
# run's own seed); a run that diverged is not fine-tuned (the records count it)
fine_tune_run() {
  local run=$1 lr=$2 kept ft_seed
  kept=$(finished "$run")
  [[ -n $kept ]] || return 0
  diverged "$kept" && return 0
  if (( FT_SEEDS == 1 )); then
    sst2 "$run" "$run/finetune/final/sst2-len32" "$lr" "${run##*-s}"
  else
    for ft_seed in $(seq "$FT_SEEDS"); do sst2 "$run" "$run/finetune/final/sst2-len32-s$ft_seed" "$lr" "$ft_seed"; done
  fi
}

# fine_tune_now <run name>: with stage finetune on, a run just finished at its arm's best LR is fine-tuned
# before the next run starts, once the SST-2 LR check has chosen (or FT_LR is given)
fine_tune_now() {
  stage finetune && [[ -n $TUNED ]] || return 0
  [[ $1 =~ ^cpu-rung-$RUNG-(${TUNED// /|})-(n|sim)[0-9]+-s[0-9]+$ ]] || return 0
  local lr next
  read -r lr next < <($PY -m bench.fidelity_rungs ft-lr "$RUNG" "$FOLDER")
  [[ -n $FT_LR || $next == - ]] || return 0
  fine_tune_run "results/runs/$1" "${FT_LR:-$lr}"
}

MODEL="" BATCH="" GLOBAL="" LAMB_LRS="" ADAMW_LRS="" RUNG_WORKERS="" LOG_EVERY="" MODEL_ARGS="" RUNG_SEEDS=""
FT_SEEDS="" FLOOR_FT_SEEDS="" CHECKPOINT_EVERY=""
for RUNG in $RUNGS; do
  eval "$($PY -m bench.fidelity_rungs spec "$RUNG")"  # sets the variables above
  TUNED=""  # the fine-tuned arms, once the sweeps are done (not the last rung's)
  seeds=${SEEDS:-$RUNG_SEEDS}
  FOLDER=results/cpu-study-$RUNG
  FLOOR=results/runs/cpu-rung-floor-$MODEL
  mkdir -p results/runs
  stage lamb_sweep && tune lamb
  stage adamw_sweep && tune adamw
  LAMB_LR=$(best_lr lamb)
  ADAMW_LR=$(best_lr adamw)
  # the runs fine-tuned, by name prefix: each arm at its best LR, the 1-bit arms at LAMB's
  TUNED="lamb-lr$LAMB_LR adamw-lr$ADAMW_LR onebit_lamb-lr$LAMB_LR onebit_lamb_deepspeed-lr$LAMB_LR"
  if stage seeds; then
    for seed in $seeds; do
      pretrain lamb "$LAMB_LR" n2 "$seed"
      pretrain adamw "$ADAMW_LR" n2 "$seed"
    done
  fi
  if stage onebit; then
    for seed in $seeds; do
      for workers in $RUNG_WORKERS; do pretrain onebit_lamb "$LAMB_LR" "$workers" "$seed"; done
    done
  fi
  if stage deepspeed; then
    for workers in $RUNG_WORKERS; do pretrain onebit_lamb_deepspeed "$LAMB_LR" "$workers" 1; done
    for workers in $($PY -m bench.fidelity_rungs deepspeed-seeds "$RUNG" results/runs); do
      for seed in $seeds; do pretrain onebit_lamb_deepspeed "$LAMB_LR" "$workers" "$seed"; done
    done
  fi
  if stage onebit_lr; then
    for lr in $($PY -m bench.fidelity_rungs lr-neighbours "$LAMB_LR"); do pretrain onebit_lamb "$lr" n2 1; done
  fi
  if stage ablation && [[ $RUNG == b ]]; then  # why the default misses by ~1 % (results/cpu-study-b/README.md)
    pretrain abl-refresh8-onebit_lamb "$LAMB_LR" n2 1
    for seed in $seeds; do pretrain abl-freeze160-onebit_lamb "$LAMB_LR" n2 "$seed"; done
    pretrain abl-freeze120-onebit_lamb "$LAMB_LR" n2 1
  fi
  if stage ablation && [[ $RUNG == m ]]; then  # where the default's gap opens (results/cpu-study-m/README.md)
    for seed in $seeds; do  # both worker counts: the target is missed at 32 simulated workers
      for workers in $RUNG_WORKERS; do
        pretrain abl-ffnrows-onebit_lamb "$LAMB_LR" "$workers" "$seed"
        pretrain abl-freeze1280-onebit_lamb "$LAMB_LR" "$workers" "$seed"
        # what LAMB's own trajectory does at this worker count: the peer without compression
        if [[ $workers == sim* ]]; then pretrain abl-lamb "$LAMB_LR" "$workers" "$seed"; fi
      done
      # between 2 processes (64 sequences per worker) and 32 simulated workers (4): 16 per worker, with
      # LAMB at the same count to pair it with (the seeds' spread across worker counts hides a 1 % cost)
      pretrain onebit_lamb "$LAMB_LR" sim8 "$seed"
      pretrain abl-lamb "$LAMB_LR" sim8 "$seed"
    done
    # whether the server's second 1-bit compression is the cost that grows from 2 workers to 8 ("Steps behind")
    pretrain abl-fp32server-onebit_lamb "$LAMB_LR" sim8 1
    # then whether the workers' own compression is (the only part left that changes with the worker count)
    pretrain abl-fp32worker-onebit_lamb "$LAMB_LR" sim8 1
    # it is ("The workers' compression" in the rung's report): whether a second bit per worker is enough
    pretrain abl-2bitworker-onebit_lamb "$LAMB_LR" sim8 1
    pretrain abl-2bitworker-onebit_lamb "$LAMB_LR" sim32 1
    # a second bit takes back 81 % of the cost at 8 workers but 30 % at 32: whether exact worker values take
    # back all of it at 32 too
    pretrain abl-fp32worker-onebit_lamb "$LAMB_LR" sim32 1
  fi
  if stage floor && [[ ! -d $FLOOR/checkpoints ]] && (( DRY )); then echo "pending floor $FLOOR"; fi
  if stage floor && [[ ! -d $FLOOR/checkpoints ]] && (( ! DRY )); then
    # shellcheck disable=SC2086
    nice -n "$NICE" $PY -m pretrain batch="$BATCH" optim=lamb model="$MODEL" $MODEL_ARGS data_dir="data/prepared/$DATA" \
      seed=1 run_name="cpu-rung-floor-$MODEL" max_steps=0 wandb.mode=disabled show_progress=false
  fi
  if stage ft_lr; then  # LAMB's seed-1 checkpoint and the floor, outside the run folders
    lamb=results/runs/cpu-rung-$RUNG-lamb-lr$LAMB_LR-n2-s1
    checked=""
    while [[ -n $(finished "$lamb") && -d $FLOOR/checkpoints ]]; do
      read -r _ lr < <($PY -m bench.fidelity_rungs ft-lr "$RUNG" "$FOLDER")
      [[ $lr == - ]] && break
      if [[ $lr == "$checked" ]]; then echo "reproduce.sh: SST-2 at LR $lr left no result" >&2; exit 1; fi
      checked=$lr
      for run in "$lamb" "$FLOOR"; do sst2 "$run" "$FOLDER/finetune-lr$lr/$(basename "$run")" "$lr" 1; done
      (( DRY )) && break  # nothing ran: the next answer would be the same
    done
  fi
  if stage finetune; then
    read -r ft_lr _ < <($PY -m bench.fidelity_rungs ft-lr "$RUNG" "$FOLDER")
    ft_lr=${FT_LR:-$ft_lr}
    if [[ -d $FLOOR/checkpoints ]]; then
      for seed in $FLOOR_FT_SEEDS; do sst2 "$FLOOR" "$FLOOR/finetune/final/sst2-len32-s$seed" "$ft_lr" "$seed"; done
    fi
    for prefix in $TUNED; do
      for run in results/runs/cpu-rung-"$RUNG"-"$prefix"-*; do fine_tune_run "$run" "$ft_lr"; done
    done
  fi
  if stage report && (( ! DRY )); then
    # the small files (metrics, summaries, configs, fine-tune results) next to the report; runs kept from an
    # earlier machine (committed, no longer under results/runs/) stay as they are
    for run_dir in results/runs/cpu-rung-"$RUNG"-* "$FLOOR"; do
      [[ -f $run_dir/summary.json || -d $run_dir/finetune ]] || continue  # unfinished: not reported
      keep=results/cpu-study/runs/$(basename "$run_dir")
      mkdir -p "$keep"
      # a run again for its checkpoints: its record is the first run's (its fine-tunes are the run again's)
      first=$run_dir; [[ -f $run_dir/first-run/summary.json ]] && first=$run_dir/first-run
      for file in metrics.jsonl summary.json config.yaml; do
        [[ -f $first/$file ]] || continue
        rm -f "$keep/$file" "$keep/$file.gz"
        cp "$first/$file" "$keep/"
      done
      # metrics with diagnostics pass 1 MiB: kept compressed (results.compare reads both)
      if [[ -f $keep/metrics.jsonl ]] && (( $(stat -c %s "$keep/metrics.jsonl") > 1048576 )); then
        gzip -n -9 "$keep/metrics.jsonl"
      fi
      (cd "$run_dir" && find finetune -name all_results.json -exec cp --parents {} "../../../$keep/" \;) || true
    done
    if [[ -f $TIMES ]]; then  # this machine's rows added to the kept ones (earlier machines' stay)
      touch "$FOLDER/run-times.tsv"
      added=$(grep "^cpu-rung-$RUNG-" "$TIMES" | grep -vxFf "$FOLDER/run-times.tsv" || true)
      [[ -z $added ]] || printf '%s\n' "$added" >> "$FOLDER/run-times.tsv"
    fi
    # the comparison of each arm at its LR (LAMB's best for the 1-bit arms; the sweeps' other LRs left out:
    # the comparison groups runs by optimizer options, and the LR is a batch option)
    runs=$(find results/cpu-study/runs -maxdepth 1 \( -name "cpu-rung-$RUNG-lamb-lr$LAMB_LR-*" \
      -o -name "cpu-rung-$RUNG-adamw-lr$ADAMW_LR-*" -o -name "cpu-rung-$RUNG-onebit_lamb-lr$LAMB_LR-*" \
      -o -name "cpu-rung-$RUNG-onebit_lamb_deepspeed-lr$LAMB_LR-*" \) | sort | paste -sd,)
    if [[ -n $runs ]]; then
      $PY -m results.compare study="cpu-study-$RUNG" "runs=[$runs]" final_window=10
    fi
  fi
done
if stage report && (( ! DRY )); then $PY -m bench fidelity; fi
if (( DRY )); then
  echo "${#LISTED[@]} pretraining runs pending (the stages after the sweeps at the best LRs so far)"
fi
