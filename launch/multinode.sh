#!/usr/bin/env bash
# Several machines: run this same command on every node; torchrun's c10d rendezvous forms the job.
set -euo pipefail
LAUNCHER_NAME=launch/multinode.sh
# shellcheck source=launch/common.sh
source "$(dirname -- "${BASH_SOURCE[0]}")/common.sh"

usage() {
    cat <<'EOF'
usage: launch/multinode.sh --nnodes N --rdzv-endpoint HOST:PORT [--rdzv-id ID]
                           [--nproc-per-node P] [--max-restarts K] [--print] [--] <hydra overrides>

Run the same command on every node (by hand, pdsh, or srun: launch/slurm.sbatch does that). The
node that owns HOST hosts the rendezvous; ranks are assigned when all N nodes have joined. Each node
runs the pre-flight (pretrain/tools/preflight.py) first: a config that cannot run is one line, exit 2.
A worker's exit code (2 error, 75 checkpointed, 76 peer lost) is the launcher's.

  --nnodes N              nodes (MIN:MAX for an elastic range)
  --rdzv-endpoint H:P     an address of one of the nodes that every node can reach, and a free port;
                          identical on all nodes
  --rdzv-id ID            names this job at the endpoint; identical on all nodes (default:
                          $SLURM_JOB_ID when set, else required)
  --nproc-per-node P      processes per node; default: one per visible GPU, 2 without CUDA
  --max-restarts K        restart the whole worker group up to K times after a failure (default 0);
                          with K > 0, resume=auto is added so a restart continues from the newest
                          complete checkpoint instead of step 0
  --print                 print the command instead of running it (also: LAUNCH_DRY_PRINT=1)

NCCL over Ethernet (export on every node before launching; values depend on your site):
  NCCL_SOCKET_IFNAME=eth0     the interface that carries inter-node traffic (see `ip -br addr`);
                              GLOO_SOCKET_IFNAME likewise for gloo (CPU runs)
  NCCL_IB_DISABLE=1           on Ethernet-only clusters, so NCCL does not probe for InfiniBand
  NCCL_DEBUG=WARN             (INFO once, to see which interface and transport NCCL chose)

example (4 nodes x 8 GPUs; the same line on each node):
  launch/multinode.sh --nnodes 4 --nproc-per-node 8 --rdzv-endpoint node01:29500 --rdzv-id bert64k \
      -- batch=64k optim=onebit_lamb model=bert_large data_dir=/shared/prepared/wiki
EOF
}

nnodes=""
endpoint=""
rdzv_id=${SLURM_JOB_ID:-}
nproc=""
max_restarts=0
while [[ $# -gt 0 ]]; do
    case $1 in
        --nnodes | --rdzv-endpoint | --rdzv-id | --nproc-per-node | --max-restarts)
            need_value "$1" $#
            option=$1 value=$2
            shift 2
            ;;
        --nnodes=* | --rdzv-endpoint=* | --rdzv-id=* | --nproc-per-node=* | --max-restarts=*)
            option=${1%%=*} value=${1#*=}
            shift
            ;;
        --print)
            PRINT_ONLY=1
            shift
            continue
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
    case $option in
        --nnodes) nnodes=$value ;;
        --rdzv-endpoint) endpoint=$value ;;
        --rdzv-id) rdzv_id=$value ;;
        --nproc-per-node) nproc=$value ;;
        --max-restarts) max_restarts=$value ;;
    esac
done

[[ -n $nnodes ]] || usage_error "--nnodes is required"
[[ $nnodes =~ ^[1-9][0-9]*(:[1-9][0-9]*)?$ ]] || usage_error "--nnodes must be N or MIN:MAX, got '$nnodes'"
[[ -n $endpoint ]] || usage_error "--rdzv-endpoint HOST:PORT is required"
[[ $endpoint =~ ^.+:[0-9]+$ ]] || usage_error "--rdzv-endpoint must be HOST:PORT, got '$endpoint'"
[[ -n $rdzv_id ]] || usage_error "--rdzv-id is required outside SLURM (any name, the same on every node)"
if [[ -n $nproc ]] && ! is_positive_int "$nproc"; then
    usage_error "--nproc-per-node must be a positive integer, got '$nproc'"
fi
[[ $max_restarts =~ ^[0-9]+$ ]] ||
    usage_error "--max-restarts must be a non-negative integer, got '$max_restarts'"

overrides=("$@")
if [[ $max_restarts -gt 0 ]]; then
    if ! has_override resume ${overrides[@]+"${overrides[@]}"}; then
        overrides+=("resume=auto")
    elif [[ $(override_value resume "${overrides[@]}") != auto ]]; then
        printf '%s: warning: --max-restarts %s without resume=auto: %s\n' "$LAUNCHER_NAME" "$max_restarts" \
            "a restart will not continue from the newest checkpoint" >&2
    fi
fi

python=$(launch_python)
plan_local_processes "$python" "$nproc"
# The pre-flight on each node (its devices), for the whole world; an elastic MIN:MAX world is known only
# to the workers. Under srun the header comes from the first node only (every node could refuse).
show_header=1
[[ ${SLURM_NODEID:-0} == 0 ]] || show_header=0
if [[ $nnodes =~ ^[0-9]+$ ]]; then
    run_preflight "$python" "$show_header" $((nnodes * LAUNCH_NPROC)) ${overrides[@]+"${overrides[@]}"}
fi

# launch.elastic: torchrun (torch.distributed.run) without its traceback after a worker's one-line error
run_or_print ${LAUNCH_ENV[@]+"${LAUNCH_ENV[@]}"} "$python" -m launch.elastic \
    --nnodes "$nnodes" --nproc-per-node "$LAUNCH_NPROC" \
    --rdzv-backend c10d --rdzv-endpoint "$endpoint" --rdzv-id "$rdzv_id" \
    --max-restarts "$max_restarts" \
    -m pretrain ${overrides[@]+"${overrides[@]}"}
