#!/usr/bin/env bash
# Reproduces results/cpu-study/: LAMB against 1-bit LAMB as DeepSpeed has it (`deepspeed`, parity) and with the
# remedy (`remedy`: per-row scales, the least-squares sign scale, a live trust ratio; `remedy_pre`: the same
# exchanging m/(sqrt(v)+eps); `remedy_col`: that with per-column scales; `remedy_col_ev16`: that with the 1-D
# tensors exact and bfloat16 scales, the config default until the seq-32 study; `remedy_nv_lv`: that with
# optim=lamb's LAMB as the warmup and the 1-D tensors' variance kept live, the config default since;
# `remedy_nv_lv_r<K>` / `_l<K>` / `_fr<K>`: that with the variance refreshed every K compression steps
# (optim.variance_refresh) from one exactly averaged step, the workers' own squares, or their row/column sums;
# results/cpu-study/README.md),
# on the shared sample with an 8K vocabulary cut from BERT's
# (conf/data/sample_8k.yaml), phase 1 (seq 128), at 2 real processes and at 8 and 32 simulated workers
# (`sim_world_size`, 2 processes x 4 or 16), plus ablations, a batch-32 arm, a 4-process arm and fine-tunes
# (SST-2 on its full training set at length 64, MRPC's full training set for 3 epochs) of every main-comparison
# checkpoint and of a randomly initialised model (the floor). Every pretraining run logs the diagnostics
# (`diagnostics=true`). Then `make compare` and `python -m bench fidelity` (results/bench/fidelity.json).
#
# The code: `deepspeed` is optim=onebit_lamb_deepspeed, `remedy_nv_lv_k64` optim=onebit_lamb and `remedy_nv_lv`
# optim=onebit_lamb optim.variance_refresh=0, on any commit since the presets. Every other 1-bit arm sets
# options that lost and left the optimizer (results/cpu-study/README.md, "Arms removed from the code"): run
# those stages from commit 71ee42b, the last that has them (git worktree add ../study 71ee42b).
#
# Runs go to results/runs/cpu-study-*; a run whose summary.json (fine-tune: all_results.json) exists is skipped,
# so the script picks up where an interrupted one stopped. Stages (STAGES, in this order):
#   main      seeds x {lamb n2, deepspeed n2, remedy n2, deepspeed sim32, remedy sim32}
#   decomposition  seeds x remedy_clamped (the live coefficient floored at min_coeff, as in the warmup) at n2
#             and sim32; on 1 process (n1: no compression, the frozen state alone) remedy and deepspeed; LAMB as
#             1-bit LAMB's warmup computes it (`lamb_deepspeed`: DeepSpeed's variant, no bias correction, no
#             clipping, coefficients clamped to [0.01, 10]) at n2
#   output_bias  seeds x the remedy with the MLM decoder bias averaged exactly (`remedy_bias`) at n2 and sim32
#   finetune  every main-stage checkpoint that did not diverge + the random-init floor (3 seeds) on SST-2, MRPC
#   scale     seed 1: remedy and deepspeed at sim8 and at 4 real processes (n4), remedy at sim64
#   pieces    seed 1 at n2 and sim32, one piece of the remedy changed at a time: per_row alone (DeepSpeed's
#             sign scale and frozen coefficient), per_row + live, per_row + mean_abs, per_tensor + mean_abs + live,
#             deepspeed + live, remedy + exact_vectors (PIECES="<arms>" runs a subset)
#   batch32   seed 1 at batch 32 (4x the steps): lamb, deepspeed, remedy at n2
#   precondition  seeds x remedy_pre (the remedy exchanging m/(sqrt(v)+eps); part of the default since) at n2, sim32
#   columns   seeds x remedy_col (remedy_pre with one scale per input column of every other matrix) at n2, sim32;
#             seed 1 at n4, sim8, sim64, and with the 1-D tensors exact (remedy_col_exact) at n2
#   local     seeds x remedy_local (remedy_pre with every worker keeping its own momentum) at n2, sim32
#   long      seeds x {lamb, remedy_col_ev16 (the default then)} at n2 with conf/batch/cpu_study_long.yaml (3,000
#             steps, 2,400 of them compressed); reported apart in results/cpu-study-long/ (LONG_ARMS="<arms>")
#   long_finetune  the long runs' final checkpoints on SST-2 and MRPC (FT_TASKS="sst2" for a subset); the
#             floor is the `finetune` stage's randomly initialised model
#   s32       seeds x {lamb n2, remedy_nv_lv (frozen v) and remedy_nv_lv_k64 (the default: the rank-1 variance
#             refresh) n2 and sim32, deepspeed n2 and sim32} with
#             conf/batch/cpu_study_s32.yaml on the sample at seq 32 (data=sample_8k_s32): 3,200 steps, 2,560 of
#             them compressed, where LAMB leaves the unigram stage (> 25% masked-LM accuracy); reported apart in
#             results/cpu-study-s32/ (S32_ARMS="<arms>", WORKERS="<workers>" for subsets; MODEL=<another>:
#             runs cpu-study-s32-<model>-*, reported in results/cpu-study-s32-<model>/; on one GPU add
#             SIM_PROCESSES=1 and run LAMB at WORKERS=n1; S32_ARMS=lamb WORKERS=sim32: LAMB's own run at 32
#             simulated workers, the peer at that worker count)
#   s32_finetune  the seq-32 main arms' final checkpoints (S32_FT_ARMS="<arms>", WORKERS="<workers>" for
#             subsets) and the randomly initialised model (the floor) on SST-2's full training set at length
#             32, the pretraining length (1 epoch, LR S32_FT_LR, default 1e-3: chosen on LAMB's seed-1
#             checkpoint and the floor from 3e-5 to 3e-3; other LRs write to
#             results/cpu-study-s32/finetune-lr<LR>/, outside the run folders), seed = the run's
#   arms      any arms of the table below: ARMS="<arms>" at WORKERS (default n2) for SEEDS with the recipe BATCH
#             (default cpu_study_b128); not in the default STAGES
#   report    keep the runs' small files in results/cpu-study/runs/, compare, records
#   results/cpu-study/reproduce.sh                                  # everything
#   STAGES="main report" SEEDS="1" results/cpu-study/reproduce.sh   # a subset
set -euo pipefail
cd "$(dirname "$0")/../.."
SEEDS=${SEEDS:-"1 2 3"}
STAGES=${STAGES:-"main decomposition output_bias precondition columns local finetune scale pieces batch32 long long_finetune s32 s32_finetune report"}
MODEL=${MODEL:-bert_tiny}
# simulated workers (simK) run as SIM_PROCESSES processes x K/SIM_PROCESSES; on one GPU (NCCL takes one
# process per GPU) SIM_PROCESSES=1, with LAMB at WORKERS=n1: e.g. SIM_PROCESSES=1 MODEL=bert_base STAGES=s32
# S32_ARMS=lamb WORKERS=n1, then S32_ARMS="remedy_nv_lv_k64 deepspeed" WORKERS="sim8 sim32"
SIM_PROCESSES=${SIM_PROCESSES:-2}
MODEL_TAG=$([[ $MODEL == bert_tiny ]] || echo "-$MODEL")
DATA=${DATA:-sample_8k}
PY=.venv/bin/python
export OMP_NUM_THREADS=1 WANDB_MODE=disabled

make --no-print-directory setup
# The 8K vocabulary is cut by token frequency in the sample's seq-128 instances as the study prepared them
# (short targets drawn per document). `data=sample` draws them per chunk since 10b93f6, which moves a few tokens
# across the 8,192 cut and gave 17,864 instances instead of the study's 18,913: so the vocabulary has its own
# preparation, and its hash is checked before anything trains on it.
VOCAB=data/prepared/vocab/sample-8192.txt
VOCAB_SHA256=3bbba317d37e628781b478be6d56ffe2ccf593291da729d0179a2c48ac65b573
if [[ $DATA == sample_8k ]]; then
  if [[ ! -f $VOCAB ]]; then
    $PY -m data.prepare data=sample data.instances.short_seq_draw=document \
      data.shards.output_dir=data/prepared/sample_vocab_source show_progress=false
    $PY -m data.vocab_subset data/prepared/sample_vocab_source/seq128 8192 "$VOCAB"
  fi
  if [[ $(sha256sum "$VOCAB" | cut -d' ' -f1) != "$VOCAB_SHA256" ]]; then
    echo "reproduce.sh: $VOCAB is not the study's vocabulary (sha256 differs): remove it and data/prepared/$DATA, then re-run" >&2
    exit 2
  fi
fi
make --no-print-directory "data/prepared/$DATA/seq128/manifest.json"
if [[ " $STAGES " == *" s32 "* && ! -f data/prepared/${DATA}_s32/seq32/manifest.json ]]; then
  $PY -m data.prepare data="${DATA}_s32" show_progress=false
fi

declare -A ARM=(
  [lamb]="optim=lamb"
  [deepspeed]="optim=onebit_lamb_deepspeed"
  [remedy]="optim=onebit_lamb optim.warmup=deepspeed optim.live_vector_variance=false optim.compression=per_row optim.sign_scale=mean_abs optim.trust_ratio=live optim.precondition=false optim.exact_vectors=false optim.scale_dtype=float32 optim.variance_refresh=0"
  [remedy_clamped]="optim=onebit_lamb optim.warmup=deepspeed optim.live_vector_variance=false optim.compression=per_row optim.sign_scale=mean_abs optim.trust_ratio=live_clamped optim.precondition=false optim.exact_vectors=false optim.scale_dtype=float32 optim.variance_refresh=0"
  [per_row]="optim=onebit_lamb optim.warmup=deepspeed optim.live_vector_variance=false optim.compression=per_row optim.sign_scale=rms optim.trust_ratio=frozen optim.precondition=false optim.exact_vectors=false optim.scale_dtype=float32 optim.variance_refresh=0"
  [per_row_live]="optim=onebit_lamb optim.warmup=deepspeed optim.live_vector_variance=false optim.compression=per_row optim.sign_scale=rms optim.trust_ratio=live optim.precondition=false optim.exact_vectors=false optim.scale_dtype=float32 optim.variance_refresh=0"
  [per_row_mean_abs]="optim=onebit_lamb optim.warmup=deepspeed optim.live_vector_variance=false optim.compression=per_row optim.sign_scale=mean_abs optim.trust_ratio=frozen optim.precondition=false optim.exact_vectors=false optim.scale_dtype=float32 optim.variance_refresh=0"
  [per_tensor_remedy]="optim=onebit_lamb optim.warmup=deepspeed optim.live_vector_variance=false optim.compression=per_tensor optim.sign_scale=mean_abs optim.trust_ratio=live optim.precondition=false optim.exact_vectors=false optim.scale_dtype=float32 optim.variance_refresh=0"
  [deepspeed_live]="optim=onebit_lamb optim.warmup=deepspeed optim.live_vector_variance=false optim.compression=deepspeed optim.sign_scale=rms optim.trust_ratio=live optim.precondition=false optim.exact_vectors=false optim.scale_dtype=float32 optim.variance_refresh=0"
  [lamb_deepspeed]="optim=lamb optim.variant=deepspeed optim.bias_correction=false optim.max_coeff=10.0"
  [remedy_bias]="optim=onebit_lamb optim.warmup=deepspeed optim.live_vector_variance=false optim.compression=per_row optim.sign_scale=mean_abs optim.trust_ratio=live optim.exact_output_bias=true optim.precondition=false optim.exact_vectors=false optim.scale_dtype=float32 optim.variance_refresh=0"
  [remedy_exact]="optim=onebit_lamb optim.warmup=deepspeed optim.live_vector_variance=false optim.compression=per_row optim.sign_scale=mean_abs optim.trust_ratio=live optim.exact_vectors=true optim.precondition=false optim.scale_dtype=float32 optim.variance_refresh=0"
  [remedy_pre]="optim=onebit_lamb optim.warmup=deepspeed optim.live_vector_variance=false optim.compression=per_row optim.sign_scale=mean_abs optim.trust_ratio=live optim.precondition=true optim.exact_vectors=false optim.scale_dtype=float32 optim.variance_refresh=0"
  [remedy_col]="optim=onebit_lamb optim.warmup=deepspeed optim.live_vector_variance=false optim.compression=per_column optim.sign_scale=mean_abs optim.trust_ratio=live optim.precondition=true optim.exact_vectors=false optim.scale_dtype=float32 optim.variance_refresh=0"
  [remedy_col_exact]="optim=onebit_lamb optim.warmup=deepspeed optim.live_vector_variance=false optim.compression=per_column optim.sign_scale=mean_abs optim.trust_ratio=live optim.precondition=true optim.exact_vectors=true optim.scale_dtype=float32 optim.variance_refresh=0"
  [remedy_pre_exact]="optim=onebit_lamb optim.warmup=deepspeed optim.live_vector_variance=false optim.compression=per_row optim.sign_scale=mean_abs optim.trust_ratio=live optim.precondition=true optim.exact_vectors=true optim.scale_dtype=float32 optim.variance_refresh=0"
  [remedy_col_vb16]="optim=onebit_lamb optim.warmup=deepspeed optim.live_vector_variance=false optim.compression=per_column optim.sign_scale=mean_abs optim.trust_ratio=live optim.precondition=true optim.vector_block=16 optim.exact_vectors=false optim.scale_dtype=float32 optim.variance_refresh=0"
  [remedy_col_ev16]="optim=onebit_lamb optim.warmup=deepspeed optim.live_vector_variance=false optim.compression=per_column optim.sign_scale=mean_abs optim.trust_ratio=live optim.precondition=true optim.exact_vectors=true optim.scale_dtype=bfloat16 optim.variance_refresh=0"
  [remedy_col_bf16]="optim=onebit_lamb optim.warmup=deepspeed optim.live_vector_variance=false optim.compression=per_column optim.sign_scale=mean_abs optim.trust_ratio=live optim.precondition=true optim.scale_dtype=bfloat16 optim.exact_vectors=false optim.variance_refresh=0"
  [remedy_col_eps6]="optim=onebit_lamb optim.warmup=deepspeed optim.live_vector_variance=false optim.compression=per_column optim.sign_scale=mean_abs optim.trust_ratio=live optim.precondition=true optim.eps=1e-6 optim.exact_vectors=false optim.scale_dtype=float32 optim.variance_refresh=0"
  # the default with optim=lamb's LAMB in the warmup and its rules kept after the freeze (seq-32 study)
  [remedy_nv]="optim=onebit_lamb optim.warmup=nvlamb optim.live_vector_variance=false optim.compression=per_column optim.sign_scale=mean_abs optim.trust_ratio=live optim.precondition=true optim.exact_vectors=true optim.scale_dtype=bfloat16 optim.variance_refresh=0"
  # and the 1-D tensors' variance kept live after the freeze (from their exact average)
  [remedy_nv_lv]="optim=onebit_lamb optim.variance_refresh=0"
  # that, with the variance frozen at step 1,280 instead of 640 (40% of the run)
  [remedy_nv_lv_f1280]="optim=onebit_lamb optim.warmup=nvlamb optim.live_vector_variance=true optim.compression=per_column optim.sign_scale=mean_abs optim.trust_ratio=live optim.precondition=true optim.exact_vectors=true optim.scale_dtype=bfloat16 batch.phases.0.freeze_step=1280 optim.variance_refresh=0"
  # that, with every 64th (16th) compression step averaging gradients exactly and refreshing v (variance_refresh)
  [remedy_nv_lv_r64]="optim=onebit_lamb optim.warmup=nvlamb optim.live_vector_variance=true optim.variance_refresh=64 optim.compression=per_column optim.sign_scale=mean_abs optim.trust_ratio=live optim.precondition=true optim.exact_vectors=true optim.scale_dtype=bfloat16"
  [remedy_nv_lv_r16]="optim=onebit_lamb optim.warmup=nvlamb optim.live_vector_variance=true optim.variance_refresh=16 optim.compression=per_column optim.sign_scale=mean_abs optim.trust_ratio=live optim.precondition=true optim.exact_vectors=true optim.scale_dtype=bfloat16"
  # every 2nd step refreshing v (weight 1 - beta2^2: the dense EMA, nearly); on 1 process: v live, no exchange
  [remedy_nv_lv_r2]="optim=onebit_lamb optim.warmup=nvlamb optim.live_vector_variance=true optim.variance_refresh=2 optim.compression=per_column optim.sign_scale=mean_abs optim.trust_ratio=live optim.precondition=true optim.exact_vectors=true optim.scale_dtype=bfloat16"
  # every 64th (16th) compression step refreshing v from every worker's own squared gradients over those steps
  [remedy_nv_lv_l64]="optim=onebit_lamb optim.warmup=nvlamb optim.live_vector_variance=true optim.variance_refresh=64 optim.refresh_from=local optim.compression=per_column optim.sign_scale=mean_abs optim.trust_ratio=live optim.precondition=true optim.exact_vectors=true optim.scale_dtype=bfloat16"
  [remedy_nv_lv_l16]="optim=onebit_lamb optim.warmup=nvlamb optim.live_vector_variance=true optim.variance_refresh=16 optim.refresh_from=local optim.compression=per_column optim.sign_scale=mean_abs optim.trust_ratio=live optim.precondition=true optim.exact_vectors=true optim.scale_dtype=bfloat16"
  # every 64th compression step rescaling v block by block (128 elements) by the workers' squared gradients' block
  # sums, sent in bfloat16 (BERT-Large's compression stage stays 15.5x below fp16)
  [remedy_nv_lv_b64]="optim=onebit_lamb optim.warmup=nvlamb optim.live_vector_variance=true optim.variance_refresh=64 optim.refresh_from=blocks optim.refresh_block=128 optim.compression=per_column optim.sign_scale=mean_abs optim.trust_ratio=live optim.precondition=true optim.exact_vectors=true optim.scale_dtype=bfloat16"
  # every 64th compression step folding in the workers' squared gradients rebuilt from their row and column sums (r c^T / sum r)
  [remedy_nv_lv_k64]="optim=onebit_lamb"
  # every 64th compression step rescaling the frozen v by the row and column sums of the workers' squared gradients
  [remedy_nv_lv_fr64]="optim=onebit_lamb optim.warmup=nvlamb optim.live_vector_variance=true optim.variance_refresh=64 optim.refresh_from=factored optim.compression=per_column optim.sign_scale=mean_abs optim.trust_ratio=live optim.precondition=true optim.exact_vectors=true optim.scale_dtype=bfloat16"
  # the default with the variance frozen later (seq-32 study: after LAMB leaves the unigram stage)
  [remedy_col_ev16_f1600]="optim=onebit_lamb optim.warmup=deepspeed optim.live_vector_variance=false optim.compression=per_column optim.sign_scale=mean_abs optim.trust_ratio=live optim.precondition=true optim.exact_vectors=true optim.scale_dtype=bfloat16 batch.phases.0.freeze_step=1600 optim.variance_refresh=0"
  [remedy_local]="optim=onebit_lamb optim.warmup=deepspeed optim.live_vector_variance=false optim.compression=per_row optim.sign_scale=mean_abs optim.trust_ratio=live optim.precondition=true optim.local_momentum=true optim.exact_vectors=false optim.scale_dtype=float32 optim.variance_refresh=0"
)

# pretrain <arm> <workers: n1 | n2 | n4 | sim8 | sim32> <seed> <batch recipe>
pretrain() {
  local arm=$1 workers=$2 seed=$3 batch=$4
  local global=${batch##*_b} tag data=$DATA cap=32
  case $batch in
    cpu_study_long) global=128 tag=long ;;
    cpu_study_s32) global=128 tag=s32 data=${DATA}_s32 cap=64 ;;  # 64 x 32 tokens: less than 32 x 128
    *) tag=b$global ;;
  esac
  tag+=$MODEL_TAG  # another model's runs never mix with the study's
  local run="cpu-study-$tag-$arm-$workers-s$seed"
  [[ -f results/runs/$run/summary.json ]] && return 0
  local processes=$SIM_PROCESSES per_process=1
  case $workers in
    n*) processes=${workers#n} ;;
    sim*) per_process=$(( ${workers#sim} / SIM_PROCESSES )) ;;
  esac
  local share=$(( global / (processes * per_process) ))
  local micro=$(( share < cap ? share : cap ))
  # shellcheck disable=SC2086
  OMP_NUM_THREADS=$(( processes == 1 ? 2 : 1 )) launch/torchrun.sh --nproc "$processes" -- batch="$batch" ${ARM[$arm]} model="$MODEL" \
    data_dir="data/prepared/$data" seed="$seed" run_name="$run" sim_world_size="$per_process" \
    batch.phases.0.micro_batch="$micro" diagnostics=true log_every=5 checkpoint.every_steps=0 \
    wandb.mode=disabled show_progress=false
}

finetune() {  # finetune <run folder> <task> <seed>
  local out=$1/finetune/final/$2
  [[ -f $out/all_results.json ]] && return 0
  local args=("task.lr=1e-4" "seeds=[$3]")
  case $2 in
    sst2) args+=("task.epochs=1" "task.max_length=64") ;;
    mrpc) args+=("task.epochs=3") ;;
  esac
  OMP_NUM_THREADS=2 $PY -m finetune task="$2" model_path="$1" output_dir="$out" "${args[@]}" \
    wandb.mode=disabled show_progress=false
}

stage() { [[ " $STAGES " == *" $1 "* ]]; }

random_init() {  # the floor: the same model, initialised, no step taken; prints its run folder
  local run=results/runs/cpu-study-random-init$MODEL_TAG
  if [[ ! -d $run/checkpoints ]]; then
    $PY -m pretrain batch=cpu_study_b128 optim=lamb model="$MODEL" data_dir="data/prepared/$DATA" seed=1 \
      run_name="cpu-study-random-init$MODEL_TAG" max_steps=0 wandb.mode=disabled show_progress=false >&2
  fi
  echo "$run"
}

diverged() {  # diverged <run folder>: non-finite or ending above its first loss (results/compare/analysis.py)
  $PY -c 'import sys; from pathlib import Path; from results.compare.analysis import diverged
from results.compare.runs import load_run_folder
sys.exit(0 if diverged(load_run_folder(Path(sys.argv[1]))) else 1)' "$1"
}

if stage main; then
  for seed in $SEEDS; do
    pretrain lamb n2 "$seed" cpu_study_b128
    for arm in deepspeed remedy; do
      for workers in n2 sim32; do pretrain "$arm" "$workers" "$seed" cpu_study_b128; done
    done
  done
fi
if stage decomposition; then
  for seed in $SEEDS; do  # the remedy with the warmup's floor on the live coefficient, across seeds
    for workers in n2 sim32; do pretrain remedy_clamped "$workers" "$seed" cpu_study_b128; done
  done
  for arm in remedy deepspeed; do pretrain "$arm" n1 1 cpu_study_b128; done
  pretrain lamb_deepspeed n2 1 cpu_study_b128
fi
if stage output_bias; then  # the remedy + the decoder bias averaged exactly, across seeds
  for seed in $SEEDS; do
    for workers in n2 sim32; do pretrain remedy_bias "$workers" "$seed" cpu_study_b128; done
  done
fi
if stage precondition; then  # the remedy exchanging m/(sqrt(v)+eps) instead of m, across seeds
  for seed in $SEEDS; do
    for workers in ${WORKERS:-n2 sim32}; do pretrain remedy_pre "$workers" "$seed" cpu_study_b128; done
  done
fi
if stage columns; then  # remedy_pre with one scale per input column of every matrix (per_column)
  for seed in $SEEDS; do
    for workers in ${WORKERS:-n2 sim32}; do pretrain remedy_col "$workers" "$seed" cpu_study_b128; done
  done
  if [[ -z ${WORKERS:-} ]]; then  # seed 1: the other worker counts, and what sending the 1-D tensors exactly adds
    for workers in n4 sim8 sim64; do pretrain remedy_col "$workers" 1 cpu_study_b128; done
    pretrain remedy_col_exact n2 1 cpu_study_b128
  fi
fi
if stage local; then  # the preconditioned remedy with local momenta (no error re-entering the momentum)
  for seed in $SEEDS; do
    for workers in ${WORKERS:-n2 sim32}; do pretrain remedy_local "$workers" "$seed" cpu_study_b128; done
  done
fi
if stage long; then  # 7.5x longer (conf/batch/cpu_study_long.yaml): LAMB past the unigram stage
  for seed in $SEEDS; do
    for arm in ${LONG_ARMS:-lamb remedy_col_ev16}; do pretrain "$arm" n2 "$seed" cpu_study_long; done
  done
fi
if stage long_finetune; then  # the long arm's checkpoints on SST-2 and MRPC (FT_TASKS), against the floor
  for seed in $SEEDS; do
    for run in results/runs/cpu-study-long-*-s"$seed"; do
      [[ -f $run/summary.json ]] || continue
      diverged "$run" && continue
      for task in ${FT_TASKS:-sst2 mrpc}; do finetune "$run" "$task" "$seed"; done
    done
  done
fi
if stage s32; then  # seq 32: LAMB past the unigram stage on 2 cores (conf/batch/cpu_study_s32.yaml)
  for seed in $SEEDS; do
    for arm in ${S32_ARMS:-lamb remedy_nv_lv remedy_nv_lv_k64 deepspeed}; do
      for workers in ${WORKERS:-n2 sim32}; do
        # LAMB at simulated workers only on request (S32_ARMS=lamb WORKERS=sim32): the control, since each
        # worker's MLM loss is the mean over its own sequences' masked tokens, as on real ranks
        [[ $arm == lamb && $workers == sim* && -z ${WORKERS:-} ]] && continue
        pretrain "$arm" "$workers" "$seed" cpu_study_s32
      done
    done
  done
fi
if stage s32_finetune; then  # the main comparison's arms (S32_FT_ARMS="<arms>": others) at n2 and sim32
  S32_FT_LR=${S32_FT_LR:-1e-3}
  random=$(random_init)
  for seed in $SEEDS; do
    runs=("$random")
    for arm in ${S32_FT_ARMS:-lamb remedy_nv_lv_k64 remedy_nv_lv deepspeed}; do
      for workers in ${WORKERS:-n2 sim32}; do runs+=("results/runs/cpu-study-s32$MODEL_TAG-$arm-$workers-s$seed"); done
    done
    for run in "${runs[@]}"; do
      [[ $run == "$random" || -f $run/summary.json ]] || continue
      [[ $run != "$random" ]] && diverged "$run" && continue
      out=$run/finetune/final/sst2-len32  # (a `$(... && echo)` here ended the script under set -e)
      # another LR: outside the run folders, which `make compare` reads (one recipe per task there)
      if [[ $S32_FT_LR != 1e-3 ]]; then out=results/cpu-study-s32$MODEL_TAG/finetune-lr$S32_FT_LR/$(basename "$run"); fi
      if [[ $run == "$random" ]]; then out+="-s$seed"; fi
      [[ -f $out/all_results.json ]] || OMP_NUM_THREADS=2 $PY -m finetune task=sst2 model_path="$run" \
        output_dir="$out" task.lr="$S32_FT_LR" task.epochs=1 task.max_length=32 "seeds=[$seed]" \
        wandb.mode=disabled show_progress=false
    done
  done
fi
if stage arms; then  # ARMS="remedy_col remedy_pre_exact" WORKERS="n2 sim32" SEEDS="1 2 3"
  for seed in $SEEDS; do
    for workers in ${WORKERS:-n2}; do
      for arm in ${ARMS:?STAGES=arms needs ARMS}; do pretrain "$arm" "$workers" "$seed" "${BATCH:-cpu_study_b128}"; done
    done
  done
fi
if stage finetune; then
  random=$(random_init)
  for task in sst2 mrpc; do
    for seed in 1 2 3; do  # one folder per seed: all_results.json marks each as done
      out=$random/finetune/final/$task-s$seed
      extra=()
      [[ $task == sst2 ]] && extra=(task.epochs=1 task.max_length=64)
      [[ -f $out/all_results.json ]] || OMP_NUM_THREADS=2 $PY -m finetune task="$task" model_path="$random" \
        output_dir="$out" task.lr=1e-4 "seeds=[$seed]" wandb.mode=disabled show_progress=false "${extra[@]}"
    done
  done
  for seed in $SEEDS; do
    for run in results/runs/cpu-study-b128-{lamb-n2,deepspeed-n2,remedy-n2,deepspeed-sim32,remedy-sim32}-s"$seed"; do
      [[ -f $run/summary.json ]] || continue
      diverged "$run" && continue  # nothing to fine-tune; the report names it
      for task in sst2 mrpc; do finetune "$run" "$task" "$seed"; done
    done
  done
fi
if stage scale; then
  for arm in remedy deepspeed; do
    for workers in sim8 n4; do pretrain "$arm" "$workers" 1 cpu_study_b128; done
  done
  pretrain remedy sim64 1 cpu_study_b128
fi
if stage pieces; then
  for workers in n2 sim32; do
    for arm in ${PIECES:-remedy_exact per_row_live per_row_mean_abs per_tensor_remedy deepspeed_live per_row}; do
      pretrain "$arm" "$workers" 1 cpu_study_b128
    done
  done
fi
if stage batch32; then
  for arm in lamb deepspeed remedy; do pretrain "$arm" n2 1 cpu_study_b32; done
fi
if stage report; then
  # the small files (metrics, summaries, configs, fine-tune results) next to the report; compare from them.
  # Runs kept from an earlier machine (committed, no longer under results/runs/) stay as they are.
  for run_dir in results/runs/cpu-study-*; do
    [[ -f $run_dir/summary.json || -d $run_dir/finetune ]] || continue  # unfinished: not reported
    keep=results/cpu-study/runs/$(basename "$run_dir")
    # copied over what is there, never removed first: a committed run's fine-tune results (e.g. the floor's,
    # fine-tuned on an earlier machine) stay when this machine holds only part of them
    mkdir -p "$keep"
    rm -f "$keep/metrics.jsonl" "$keep/metrics.jsonl.gz"
    for file in metrics.jsonl summary.json config.yaml; do
      [[ -f $run_dir/$file ]] && cp "$run_dir/$file" "$keep/"
    done
    # long runs' metrics (every 5 steps, with diagnostics) pass 1 MiB: kept compressed (results.compare reads both)
    if (( $(stat -c %s "$keep/metrics.jsonl") > 1048576 )); then gzip -n -9 "$keep/metrics.jsonl"; fi
    (cd "$run_dir" && find finetune -name all_results.json -exec cp --parents {} "../../../$keep/" \;) || true
  done
  $PY -m results.compare study=cpu-study 'runs=[results/cpu-study/runs/cpu-study-b*]' final_window=10
  for tag in long s32; do  # the long arm and the seq-32 study, reported apart
    # freeze-step ablations (arms ending in _f<step>) stay out: the comparison groups runs by their optimizer
    # options, and freeze_step is a batch option, so they would be averaged with the default; the study's
    # README reports them
    # study and model: results/cpu-study-s32/ holds BERT-tiny's runs, results/cpu-study-s32-<model>/ another's
    other_models="cpu-study-$tag-bert_*"
    if [[ -n $MODEL_TAG ]]; then other_models=none; fi
    run_list=$(find results/cpu-study/runs -maxdepth 1 -name "cpu-study-$tag$MODEL_TAG-*" ! -name "*_f[0-9]*" \
      ! -name "$other_models" | sort | paste -sd,)
    if [[ -n $run_list ]]; then
      $PY -m results.compare study="cpu-study-$tag$MODEL_TAG" "runs=[$run_list]" final_window=10
    fi
  done
  $PY -m bench fidelity
fi
