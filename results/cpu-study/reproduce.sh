#!/usr/bin/env bash
# Reproduces results/cpu-study/: BERT-mini pretrained on the whole shared sample (phase 1, seq 128) on 2 CPU
# processes with LAMB and 1-bit LAMB at global batch 32 and 128, seeds 1-3; each final checkpoint fine-tuned on
# MRPC, RTE, SST-2 and SQuAD v1.1 (dev split, see FT_* below); then `make compare`. Runs go to
# results/runs/cpu-study-*; a run whose summary.json (or fine-tune all_results.json) exists is skipped, so the
# script can be re-run after an interruption. 56 min on 2 otherwise idle cores (2026-11-22), + 4 min ablation.
#   results/cpu-study/reproduce.sh            # everything
#   SEEDS="1" BATCHES="cpu_study_b128" results/cpu-study/reproduce.sh   # a subset
set -euo pipefail
cd "$(dirname "$0")/../.."
SEEDS=${SEEDS:-"1 2 3"}
BATCHES=${BATCHES:-"cpu_study_b128 cpu_study_b32"}
OPTIMIZERS=${OPTIMIZERS:-"lamb onebit_lamb"}
TASKS=${TASKS:-"mrpc rte sst2 squad"}
PY=.venv/bin/python
export OMP_NUM_THREADS=1 WANDB_MODE=disabled

make --no-print-directory setup data/prepared/sample/seq128/manifest.json

# Fine-tuning at CPU scale: BERT-mini takes a higher LR than BERT-Base's 2e-5; one epoch on capped train sets so
# that the 12 checkpoints x 4 tasks fit in about 30 minutes. SQuAD trains on the first half of dev's articles and
# evaluates on (a cap of) the rest. Dev sets are complete for MRPC, RTE and SST-2.
finetune_args() {
  case $1 in
    mrpc)  echo "task.max_train_examples=1000" ;;
    rte)   echo "task.max_train_examples=800" ;;
    sst2)  echo "task.max_train_examples=1000 task.max_length=64" ;;
    squad) echo "task.max_train_examples=400 task.max_eval_examples=300 task.max_length=192 task.doc_stride=64" ;;
  esac
}

# 1. pretraining, all runs first (seed-major order, so a partial study is balanced)
for seed in $SEEDS; do
  for batch in $BATCHES; do
    for optim in $OPTIMIZERS; do
      run=cpu-study-${batch#cpu_study_}-$optim-s$seed
      [[ -f results/runs/$run/summary.json ]] && continue
      launch/torchrun.sh --nproc 2 -- batch="$batch" optim="$optim" model=bert_mini \
        data_dir=data/prepared/sample seed="$seed" run_name="$run" log_every=2 \
        checkpoint.every_steps=0 wandb.mode=disabled show_progress=false
    done
  done
done

# 2. fine-tuning each final checkpoint (fine-tune seed = pretraining seed)
for seed in $SEEDS; do
  for batch in $BATCHES; do
    for optim in $OPTIMIZERS; do
      run=cpu-study-${batch#cpu_study_}-$optim-s$seed
      for task in $TASKS; do
        out=results/runs/$run/finetune/final/$task
        [[ -f $out/all_results.json ]] && continue
        # shellcheck disable=SC2046
        OMP_NUM_THREADS=2 $PY -m finetune task="$task" model_path="results/runs/$run" output_dir="$out" \
          seeds="[$seed]" task.lr=1e-4 task.epochs=1 wandb.mode=disabled show_progress=false \
          $(finetune_args "$task")
      done
    done
  done
done

# 3. keep the small files (metrics, summaries, fine-tune results) next to the report, and compare from them
for run_dir in results/runs/cpu-study-*; do
  keep=results/cpu-study/runs/$(basename "$run_dir")
  mkdir -p "$keep"
  cp "$run_dir"/metrics.jsonl "$run_dir"/summary.json "$keep"/
  [[ -f $run_dir/config.yaml ]] && cp "$run_dir"/config.yaml "$keep"/
  (cd "$run_dir" && find finetune -name all_results.json -exec cp --parents {} "../../../$keep/" \;) || true
done
$PY -m results.compare study=cpu-study 'runs=[results/cpu-study/runs/cpu-study-*]'

# 4. ablation (README.md here): 1-bit LAMB at b128 on ONE process, where the compressed allreduce is the identity
#    (spec §2: n = 1 sends nothing and keeps no error), so only the frozen variance and coefficients differ from LAMB
if [[ ${ABLATION:-1} == 1 && ! -f results/runs/ablation-b128-onebit_lamb-n1-s1/summary.json ]]; then
  OMP_NUM_THREADS=2 $PY -m pretrain batch=cpu_study_b128 optim=onebit_lamb model=bert_mini \
    data_dir=data/prepared/sample seed=1 run_name=ablation-b128-onebit_lamb-n1-s1 log_every=2 \
    checkpoint.every_steps=0 wandb.mode=disabled show_progress=false
fi
if [[ -f results/runs/ablation-b128-onebit_lamb-n1-s1/summary.json ]]; then
  mkdir -p results/cpu-study/ablation/b128-onebit_lamb-n1-s1
  cp results/runs/ablation-b128-onebit_lamb-n1-s1/{metrics.jsonl,summary.json,config.yaml} \
    results/cpu-study/ablation/b128-onebit_lamb-n1-s1/
fi
