# shellcheck shell=bash
# Helpers sourced by launch/torchrun.sh, launch/multinode.sh and launch/slurm.sbatch; not run on its own.
# Written for bash 3.2+ (macOS laptops run the print mode too): no mapfile, and possibly-empty arrays
# are expanded as ${a[@]+"${a[@]}"} because bash < 4.4 under `set -u` treats an empty "${a[@]}" as unbound.

LAUNCH_DIR=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(dirname -- "$LAUNCH_DIR")
# LAUNCH_DRY_PRINT=1 in the environment, or --print on the command line: print the command, run nothing.
PRINT_ONLY=${LAUNCH_DRY_PRINT:-0}

# One line on stderr naming the launcher, then a non-zero exit (2, like argparse, for usage errors).
die() {
    printf '%s: error: %s\n' "${LAUNCHER_NAME:-launch}" "$*" >&2
    exit 2
}

# The error, then the synopsis (the usage text up to its first blank line), not the whole help.
usage_error() {
    printf '%s: error: %s\n' "${LAUNCHER_NAME:-launch}" "$*" >&2
    usage | sed -n '/^$/q;p' >&2 || true
    printf '(--help for more)\n' >&2
    exit 2
}

# The launchers' options take a value; a missing one is a usage error rather than a shift failure.
need_value() {  # option, number of remaining arguments including the option itself
    [[ $2 -ge 2 ]] || usage_error "$1 needs a value"
}

is_positive_int() {
    [[ $1 =~ ^[1-9][0-9]*$ ]]
}

# The project's virtual environment unless PYTHON names another interpreter (a conda env, a container).
launch_python() {
    if [[ -n ${PYTHON:-} ]]; then
        printf '%s\n' "$PYTHON"
    elif [[ -x $REPO_DIR/.venv/bin/python ]]; then
        printf '%s\n' "$REPO_DIR/.venv/bin/python"
    else
        die "no $REPO_DIR/.venv: run 'make setup' (GPU machines: see README), or set PYTHON=/path/to/python"
    fi
}

# Ask torch rather than nvidia-smi: the trainer picks NCCL/GPU or gloo/CPU from torch.cuda, so the
# process count follows the same answer (a CPU-only torch on a GPU host must start CPU processes).
# Prints "<visible GPUs> <usable CPU cores>".
probe_devices() {  # python
    "$1" - <<'EOF' || die "could not import torch with $1 (pass --nproc explicitly, or fix the environment)"
import os

import torch

cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
print(torch.cuda.device_count() if torch.cuda.is_available() else 0, cores)
EOF
}

# Fills LAUNCH_NPROC (processes on this node) and LAUNCH_ENV (NAME=value words for `env`).
# GPU: one process per GPU, OMP left to torchrun (it sets 1 per process). CPU: 2 processes unless
# told otherwise, and the cores split between them so gloo ranks do not oversubscribe the machine.
# shellcheck disable=SC2034  # LAUNCH_NPROC and LAUNCH_ENV are read by the sourcing launcher
plan_local_processes() {  # python, requested process count ("" = default)
    local python=$1 requested=$2 gpus=0 cores=1
    LAUNCH_ENV=()
    if [[ -n $requested && -n ${OMP_NUM_THREADS:-} ]]; then
        LAUNCH_NPROC=$requested  # nothing left to decide: skip the torch import
        return
    fi
    local probe
    probe=$(probe_devices "$python") || exit $?
    read -r gpus cores <<<"$probe"
    if [[ -n $requested ]]; then
        LAUNCH_NPROC=$requested
    elif [[ $gpus -gt 0 ]]; then
        LAUNCH_NPROC=$gpus
    else
        LAUNCH_NPROC=2
    fi
    if [[ $gpus -eq 0 && -z ${OMP_NUM_THREADS:-} ]]; then
        local threads=$((cores / LAUNCH_NPROC))
        LAUNCH_ENV=("OMP_NUM_THREADS=$((threads > 0 ? threads : 1))")
    fi
}

# The value the overrides give KEY (the last one: Hydra lets a later override win), or nothing.
override_value() {  # key, overrides...
    local key=$1 arg value=""
    shift
    for arg in "$@"; do
        case $arg in
            "$key="* | "+$key="* | "++$key="*) value=${arg#*"$key="} ;;
        esac
    done
    printf '%s' "$value"
}

has_override() {  # key, overrides...
    local key=$1 arg
    shift
    for arg in "$@"; do
        case $arg in
            "$key="* | "+$key="* | "++$key="*) return 0 ;;
        esac
    done
    return 1
}

# The pre-flight (pretrain/tools/preflight.py) once, before torchrun starts a worker: the run's header on stdout
# (when the second argument is 1) and, for a config that cannot run here (a global batch the world size does
# not divide, a cluster recipe on a machine without a GPU, ...), `pretrain: error: <one line>` on stderr and
# exit 2, instead of every worker printing it amid torchrun's report. On success the workers are told the
# world size it passed for (LAUNCH_ENV), and skip their own. Left to the workers: Hydra flags among the
# overrides (--cfg, -m, ...), and print mode, whose command must stand on its own.
run_preflight() {  # python, show the header (1/0), world size, overrides...
    local python=$1 show=$2 world=$3 status=0 arg
    shift 3
    if [[ $PRINT_ONLY == 1 ]]; then
        return 0
    fi
    for arg in "$@"; do
        if [[ $arg == -* ]]; then
            return 0
        fi
    done
    # Report.as_header prints the header from rank 0 only
    env RANK=$((show == 1 ? 0 : 1)) WORLD_SIZE="$world" "$python" -m pretrain.tools.preflight --header "$@" ||
        status=$?
    if [[ $status -ne 0 ]]; then
        exit "$status"
    fi
    LAUNCH_ENV+=("BERT_LAMB_PREFLIGHT_WORLD_SIZE=$world")
}

# Print mode: the command as one shell-quoted line. Otherwise exec it, so signals reach torchrun
# directly and its exit status is the script's.
#
# SIGUSR1 is set to "ignored" first, and torchrun and its workers inherit that. Slurm (scancel
# --signal, sbatch --signal without B:) signals every process of a job step, torchrun's agent
# included, and the agent has no USR1 handler by default (torch 2.13 included): it would die and
# take the workers down in the middle of their checkpoint. Ignored in the agent, the signal is acted
# on only by the trainer, which installs its own USR1 handler (checkpoint, exit 75); one arriving
# before that handler exists is dropped instead of killing the run.
run_or_print() {  # command words (leading NAME=value words become environment)
    if [[ $PRINT_ONLY == 1 ]]; then
        local line
        line=$(printf '%q ' "$@")
        printf '%s\n' "${line% }"
        exit 0
    fi
    trap '' USR1
    exec env "$@"
}
