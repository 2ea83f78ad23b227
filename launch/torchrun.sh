#!/usr/bin/env bash
# One machine, N training processes: torchrun --standalone running `python -m pretrain`.
set -euo pipefail
LAUNCHER_NAME=launch/torchrun.sh
# shellcheck source=launch/common.sh
source "$(dirname -- "${BASH_SOURCE[0]}")/common.sh"

usage() {
    cat <<'EOF'
usage: launch/torchrun.sh [--nproc N] [--print] [--] <hydra overrides>

Runs `python -m pretrain <overrides>` on N processes of this machine under torchrun --standalone
(a private rendezvous on a free local port, so several runs can share a machine). The pre-flight
(pretrain/tools/preflight.py) runs first, once: a config that cannot run here is one line, exit 2, before
any worker starts. A worker's exit code (2 error, 75 checkpointed, 76 peer lost) is the launcher's.

  --nproc N   processes; default: one per visible GPU (NCCL), or 2 on a machine without CUDA (gloo,
              OMP_NUM_THREADS = cores / N unless already set)
  --print     print the command instead of running it (also: LAUNCH_DRY_PRINT=1)

Python: .venv/bin/python of this repository, or $PYTHON.

examples:
  launch/torchrun.sh -- batch=64k optim=onebit_lamb model=bert_large data_dir=/data/prepared/wiki
  launch/torchrun.sh --nproc 2 -- batch=demo optim=onebit_lamb model=bert_tiny
EOF
}

nproc=""
while [[ $# -gt 0 ]]; do
    case $1 in
        --nproc | --nproc-per-node)
            need_value "$1" $#
            nproc=$2
            shift 2
            ;;
        --nproc=* | --nproc-per-node=*)
            nproc=${1#*=}
            shift
            ;;
        --print)
            PRINT_ONLY=1
            shift
            ;;
        -h | --help)
            usage
            exit 0
            ;;
        --)
            shift
            break
            ;;
        -*) usage_error "unknown option $1 (Hydra flags such as --cfg go after --)" ;;
        *) break ;;
    esac
done
if [[ -n $nproc ]] && ! is_positive_int "$nproc"; then
    usage_error "--nproc must be a positive integer, got '$nproc'"
fi

python=$(launch_python)
plan_local_processes "$python" "$nproc"
run_preflight "$python" 1 "$LAUNCH_NPROC" "$@"

# launch.elastic: torchrun (torch.distributed.run) without its traceback after a worker's one-line error
run_or_print ${LAUNCH_ENV[@]+"${LAUNCH_ENV[@]}"} "$python" -m launch.elastic \
    --standalone --nproc-per-node "$LAUNCH_NPROC" \
    -m pretrain "$@"
