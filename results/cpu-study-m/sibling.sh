#!/usr/bin/env bash
# A rounding sibling of a rung run at 32 simulated workers (results/cpu-study-m/README.md, "The noise in a
# final MLM loss"): the rung driver's command for the arm (results/cpu-study-rungs/reproduce.sh) with the
# attention computed by the eager kernel instead of torch's scaled_dot_product_attention
# (`model.attn_implementation=eager`: the same product, softmax and sum in another order). The rule, the
# batches and the masks are the run's, and its logged losses are the run's to ~1e-6 over the first 100 steps,
# so the two runs differ by what rounding grows into over 3,200 steps. (Simulating the 32 workers in one
# process of 2 threads differs by rounding too, but runs ~1.8 s per step against ~1.2.)
#
#   results/cpu-study-m/sibling.sh OPTIM SEED     # OPTIM: lamb (the control, `abl-lamb`) or onebit_lamb
#   e.g. results/cpu-study-m/sibling.sh lamb 2    # a sibling of cpu-rung-m-abl-lamb-lr1e-2-sim32-s2
#
# Writes results/runs/sibling-OPTIM-eager-sSEED/ and checkpoints every 800 steps: run again, it continues from
# its last checkpoint. The whole script is one function, read before it runs.
set -euo pipefail
cd "$(dirname "$0")/../.."

main() {
  [[ $# -eq 2 && ($1 == lamb || $1 == onebit_lamb) ]] || { sed -n 10,11p "$0" >&2; exit 2; }
  local optim=$1 seed=$2
  OMP_NUM_THREADS=1 WANDB_MODE=disabled launch/torchrun.sh --nproc 2 -- batch=cpu_study_s32 optim="$optim" \
    model=bert_mini model.hidden_dropout_prob=0.0 model.attention_probs_dropout_prob=0.0 \
    model.attn_implementation=eager data_dir=data/prepared/sample_8k_s32 seed="$seed" \
    run_name="sibling-$optim-eager-s$seed" sim_world_size=16 \
    batch.phases.0.micro_batch=4 batch.phases.0.lr=1e-2 diagnostics=true log_every=5 checkpoint.every_steps=800 \
    wandb.mode=disabled show_progress=false
}

main "$@"; exit  # one line: bash has read it whole before main runs
