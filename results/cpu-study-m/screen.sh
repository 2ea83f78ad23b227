#!/usr/bin/env bash
# A screen of an exchange at 32 simulated workers, seed 1 (results/cpu-study-m/README.md, "Screens"): a rung run's
# checkpoint continued for a few hundred steps with the default's exchange or with an ablation patch
# (results/cpu-study-m/ablations/), every arm from the same state on the same batches and masks, so that their
# logged MLM losses pair window by window (screen_pairs.py). A 400-step screen takes ~13 min on 2 idle cores
# (~26 min with two at once; more than two sim32 processes pairs run out of this machine's 24 GiB).
#
#   results/cpu-study-m/screen.sh NAME FROM_RUN STEP END [PATCH]
#   e.g. results/cpu-study-m/screen.sh fp32w1600 cpu-rung-m-abl-2bitworker-onebit_lamb-lr1e-2-sim32-s1 1600 2000 fp32_worker
#
# writes results/runs/screen-NAME/ (metrics.jsonl; the checkpoint it started from is a hard link, removed at
# the end). PATCH: fp32_server, fp32_worker, two_bit_worker or worker_decay (RUNG_DECAY sets its γ).
set -euo pipefail
name=$1 from=$2 step=$3 end=$4 patch=${5:-}
cd "$(dirname "$0")/../.."
source_checkpoint=results/runs/$from/checkpoints/$(printf 'step-%08d' "$step")
[[ -f $source_checkpoint/COMPLETE ]] || { echo "screen.sh: no finished checkpoint $source_checkpoint" >&2; exit 2; }
run=results/runs/screen-$name
rm -rf "$run"
mkdir -p "$run/checkpoints"
cp -al "$source_checkpoint" "$run/checkpoints/"
# the rung driver's command (results/cpu-study-rungs/reproduce.sh) with the run's own arguments, so that the
# default's screen is its rung run continued bit for bit
OMP_NUM_THREADS=1 WANDB_MODE=disabled RUNG_ABLATION=$patch PYTHONPATH=$PWD/results/cpu-study-m/ablations:$PWD \
  launch/torchrun.sh --nproc 2 -- batch=cpu_study_s32 optim=onebit_lamb model=bert_mini \
  model.hidden_dropout_prob=0.0 model.attention_probs_dropout_prob=0.0 data_dir=data/prepared/sample_8k_s32 \
  seed=1 run_name="screen-$name" sim_world_size=16 batch.phases.0.micro_batch=4 batch.phases.0.lr=1e-2 \
  diagnostics=true log_every=5 checkpoint.every_steps=100000 wandb.mode=disabled show_progress=false \
  max_steps="$end"
rm -rf "$run/checkpoints"
