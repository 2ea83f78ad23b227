#!/usr/bin/env bash
# A screen of an exchange at 32 simulated workers, seed 1 (results/cpu-study-m/README.md, "Screens"): the
# default's rung run checkpointed at a step, then continued for a few hundred steps with the default's
# exchange or with an ablation patch (results/cpu-study-m/ablations/), every arm from the same state on the
# same batches and masks, so that their logged MLM losses pair window by window (screen_pairs.py).
#
#   results/cpu-study-m/screen.sh base STEP                  # the default's rung run to STEP, checkpointed there
#   results/cpu-study-m/screen.sh NAME STEP END [PATCH]      # that checkpoint continued to END
#   e.g. results/cpu-study-m/screen.sh base 800
#        results/cpu-study-m/screen.sh fp32w-800 800 1400 fp32_worker
#
# The base is results/runs/screen-base-onebit_lamb-sim32-s1 (`cpu-rung-m-onebit_lamb-lr1e-2-sim32-s1` to STEP:
# the rung driver's command, so on the machines the study ran on its logged losses are the kept run's bit for
# bit, as is the default's screen from its checkpoint; on another machine's floats they are a sibling run's,
# and its screens pair with each other, not with screens from the study's base); a screen writes
# results/runs/screen-NAME/ (metrics.jsonl; the checkpoint it starts from is a hard link, removed at the end).
# PATCH (results/cpu-study-m/ablations/): fp32_server, fp32_worker, two_bit_worker, worker_decay (RUNG_DECAY
# sets its γ), exact_mean, exact_live_variance or exact_until (exact_mean through step RUNG_EXACT_UNTIL, the
# default's exchange after it); lamb: LAMB's rule from the default's state (the checkpoint converted by
# lamb_state.py, the screen run with optim=lamb); none: the default. SCREEN_ARGS: more Hydra overrides for a
# screen (word-split), e.g. SCREEN_ARGS=optim.variance_refresh=0. Measured on 2 otherwise idle cores: the base
# to step 800 in 1,230 s (1.5 s per step), a screen alone at ~1.3-1.6 s per step; two 600-step screens at once
# in ~38 min (3.8 s per step each: one at a time is faster). Two runs of 2 processes at 32 simulated workers
# take 8-14 GiB, so no more than two at once on this machine's 24 GiB. The whole script is one function, read
# before it runs: editing this file does not break a screen that is running.
set -euo pipefail
cd "$(dirname "$0")/../.."
BASE=screen-base-onebit_lamb-sim32-s1

# run_default <run name> <max steps> <checkpoint every> [patch]: the rung driver's command for the default at
# 32 simulated workers, seed 1 (results/cpu-study-rungs/reproduce.sh), with the run's own arguments
run_default() {
  # shellcheck disable=SC2086  # SCREEN_ARGS: overrides, word-split
  OMP_NUM_THREADS=1 WANDB_MODE=disabled RUNG_ABLATION=${4:-} PYTHONPATH=$PWD/results/cpu-study-m/ablations:$PWD \
    launch/torchrun.sh --nproc 2 -- batch=cpu_study_s32 optim=onebit_lamb model=bert_mini \
    model.hidden_dropout_prob=0.0 model.attention_probs_dropout_prob=0.0 data_dir=data/prepared/sample_8k_s32 \
    seed=1 run_name="$1" sim_world_size=16 batch.phases.0.micro_batch=4 batch.phases.0.lr=1e-2 \
    diagnostics=true log_every=5 checkpoint.every_steps="$3" wandb.mode=disabled show_progress=false \
    max_steps="$2" ${SCREEN_ARGS:-}
}

usage() { sed -n 7,10p "$0" >&2; exit 2; }

main() {
  [[ $# -ge 2 ]] || usage
  if [[ $1 == base ]]; then
    [[ $# -eq 2 ]] || usage
    SCREEN_ARGS="" run_default "$BASE" "$2" "$2"
    return
  fi
  [[ $# -eq 3 || $# -eq 4 ]] || usage
  local name=$1 step=$2 end=$3 patch=${4:-}
  local source_checkpoint run
  source_checkpoint=results/runs/$BASE/checkpoints/$(printf 'step-%08d' "$step")
  [[ -f $source_checkpoint/COMPLETE ]] || {
    echo "screen.sh: no finished checkpoint $source_checkpoint (results/cpu-study-m/screen.sh base $step)" >&2
    exit 2
  }
  run=results/runs/screen-$name
  rm -rf "$run"
  mkdir -p "$run/checkpoints"
  if [[ $patch == lamb ]]; then
    .venv/bin/python results/cpu-study-m/lamb_state.py "$source_checkpoint" "results/runs/$BASE/config.yaml" \
      "$run/checkpoints/$(basename "$source_checkpoint")"
    SCREEN_ARGS="${SCREEN_ARGS:-} optim=lamb" run_default "screen-$name" "$end" 100000
  else
    cp -al "$source_checkpoint" "$run/checkpoints/"
    run_default "screen-$name" "$end" 100000 "$patch"
  fi
  rm -rf "$run/checkpoints"
}

main "$@"; exit  # one line: bash has read it whole before main runs
