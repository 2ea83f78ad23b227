#!/usr/bin/env bash
# The device script (issue #51 item 3): everything `make gpu-check` checks, in one call on a lent GPU machine.
#
#   here, once (no device time):  bash bench/gpu/device.sh --prepare-wheels
#       downloads into .whl/ (git-ignored through .git/info/exclude, ~5 MB) the wheels of the project's
#       dependencies that the GPU image lacks (hydra, omegaconf, datasets, torchao for the float8 arm, ...);
#       prepare data/prepared/tiny too (make prepare DATA=tiny): the pipeline test reads it
#   on the device (carry: .whl data/prepared/tiny):  bash bench/gpu/device.sh [bench gpu options]
#       installs them to /tmp/site, then `python -m bench gpu` (packers, allreduce, `make test-gpu` with the
#       pipeline, optimizer steps, throughput, the step's arms) writing gpu.json, gpu_kernels.txt and
#       gpu_logs/ to $OUT (else results/bench); ~8 minutes on an H100/H200 (--budget-s 480)
#   anywhere, on the CPU:         bash bench/gpu/device.sh --cpu-smoke   (the same script at toy sizes)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && ! command -v nvidia-smi >/dev/null && PY=.venv/bin/python
# pinned to what this project's CPU environment runs; --no-deps: what the image has stays
# (wandb is imported only when W&B is on; blingfire only to prepare data, which travels prepared)
WHEELS="hydra-core==1.3.8 omegaconf==2.3.1 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0
mwparserfromhell==0.7.2 torchao==0.18.0"

if [ "${1:-}" = "--prepare-wheels" ]; then
  mkdir -p .whl .git/info && { grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude; }
  for wheel in $WHEELS; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform any -d .whl "$wheel" || echo "device.sh: no wheel for $wheel"
  done
  # hydra's parser runtime ships as a source archive only: built here into a pure-Python wheel
  "$PY" -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3 || echo "device.sh: antlr4 wheel failed"
  ls -la .whl; exit 0
fi

if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 2
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
out=${OUT:-results/bench}
mkdir -p "$out"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
"$PY" -m bench gpu --out="$out" "$@" 2>&1 | tee "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"
