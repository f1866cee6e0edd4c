#!/usr/bin/env bash
# The GPU checks in one run, on a machine with a CUDA GPU and pdserve installed (no Ray
# needed: the serving check starts plain processes): the tests marked `cuda`, then the
# kernel, offline-engine, KV-transfer and serving benchmarks (benchmarks/README.md,
# "Kernels" and "GPU"). Each step has its own time limit and goes on after a failure;
# its output goes to OUT_DIR/<step>.log and a line per step to OUT_DIR/summary.txt.
#
#   bash benchmarks/gpu_checks.sh OUT_DIR [STEP ...]     # default: every step
set -u
cd "$(dirname "$0")/.."
out=${1:-gpu-checks}
shift || true
mkdir -p "$out"
steps=${*:-kernel-tests engine-tests kv-tests kernels-bench offline-bench kv-bench serving-bench}
# NOTE: the C++ CPU kernels are not what these checks are about: no build of them here
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PDSERVE_CPU_KERNELS=0

step() {  # step NAME SECONDS COMMAND...: run COMMAND if NAME was asked for
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  [[ " $steps " == *" $name "* ]] || return 0
  timeout -k 5 "$limit" "$@" >"$out/$name.log" 2>&1
  rc=$?
  echo "== $name: exit $rc after $((SECONDS - start)) s (limit $limit)" | tee -a "$out/summary.txt"
  tail -n "${TAIL_LINES:-30}" "$out/$name.log"
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'triton', triton.__version__, \
'transformers', transformers.__version__)"
} 2>&1 | tee "$out/summary.txt"

# The three test runs side by side (separate processes; the engine tests measure their
# own process's GPU memory only). Per-test time limits dump every thread's stack on a hang.
step kernel-tests 150 python3 -m pytest -q -m cuda -n 4 -p no:cacheprovider tests/kernels &
step engine-tests 150 python3 -m pytest -v -m cuda -p no:cacheprovider --timeout 100 \
  -o timeout_method=thread tests/test_cuda_engine.py &
step kv-tests 150 python3 -m pytest -v -m cuda -p no:cacheprovider --timeout 60 \
  -o timeout_method=thread tests/test_kvtransfer_cuda.py &
wait
step kernels-bench 60 python3 benchmarks/kernels.py
step offline-bench 110 python3 benchmarks/offline_throughput.py --repeats 1
step kv-bench 50 python3 benchmarks/kv_transfer.py --device cuda --geometry llama-3-8b \
  --prompt-tokens 1024 --prompt-tokens 4096 --reps 3
step serving-bench 100 python3 benchmarks/plain_serving.py
