# Tensor parallelism on one host's GPUs, each part sized for one call of at most 10 minutes:
#
#   bash scripts/gpu_tp.sh PART [TP]        TP: GPUs per model (default 2)
#
#   test        the tensor-parallel tests on CUDA (NCCL, CUDA graphs): sharded layers and models against
#               one process, the engine's greedy tokens at TP=2 against size 1 (full KV, compression);
#               TEST_TIMEOUT (default 540 s) bounds them, TESTS (a pytest -k expression, e.g. engine) picks some
#   decode      whole decode steps, Qwen3-8B shape, batch 1/64/256, context 1,024: one rank's layers alone
#               on one GPU (--one-rank-of TP: the most TP can reach), then TP=1, then TP
#   profile     the same at batch 64 and 256 with where 4 steps' time goes by kernel kind (collectives,
#               matmuls, attention, ...), rank 0's kernels: TP=1, then TP
#   allreduce   one all-reduce at a step's sizes (1-256 rows of 4,096 bf16) in CUDA graphs: NCCL against
#               PyTorch's symmetric-memory one-shot and two-shot kernels (scripts/allreduce_sweep.py)
#   zipage8k    the standard reasoning-8k run, Zipage, at TP (TP=1 for comparison: TP=1 as the argument)
#   full8k      the same with full KV
#   32b-zipage  the Qwen3-32B shape at TP, Zipage, reasoning-8k, with the KV cache two 80 GB cards hold
#   32b-full    the same with full KV
#
# The 32B cache follows the standard run's rule: that run gives Qwen3-8B 48 GB of KV on an 80 GB
# card, which is the card less the model's 16.4 GB of bf16 weights less 15.6 GB kept for activations,
# CUDA graphs and headroom. Each 80 GB card at TP=2 holds half of Qwen3-32B's 65.5 GB of weights,
# so it keeps 80 - 32.8 - 15.6 = 31.6 GB for KV, 63.2 GB over the two; a token costs 256 KiB there
# (64 layers x 8 KV heads x 128 x 2 x 2 bytes), so the cap is 241,394 tokens (KV_TOKENS overrides).
# MAX_S (default 420) cuts a 32B run short so that it fits a call: the tokens so far count. SCALE
# (default 1) shrinks the workload's lengths (a 32B run's KV cap stays as set). The scheduling replay
# of the 32B runs (zipage bench replay --shape qwen3-32b --workload reasoning-8k --modes full,zipage
# --kv-cache-tokens 241394 --tensor-parallel-size 2, on a CPU) gives 143 requests, 221 preemptions for
# full KV, and 47 preemptions, 3,130 compressions and 98 query slots for Zipage.
# ALL_REDUCE (default nccl; one-shot) picks how the GPUs sum partial outputs in decode, profile and
# the reasoning-8k runs (EngineConfig.all_reduce).
# RESULTS (default out/tp) gets each part's JSON; every line of output is also printed.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
part=${1:-}
tp=${2:-2}
RESULTS=${RESULTS:-out/tp}
case "$part" in test|decode|profile|allreduce|zipage8k|full8k|32b-zipage|32b-full) ;;
  *) echo "PART must be test, decode, profile, allreduce, zipage8k, full8k, 32b-zipage or 32b-full, got '$part'" >&2; exit 2 ;; esac
if ! [[ "$tp" =~ ^[1-9][0-9]*$ ]]; then
  echo "TP must be a whole number of GPUs >= 1, got '$tp'" >&2
  exit 2
fi
source scripts/gpu_common.sh
require_cuda "runs tensor parallelism"
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
if [ "$tp" -gt "$gpus" ]; then
  echo "TP=$tp needs $tp GPUs; this machine has $gpus" >&2
  exit 2
fi
mkdir -p "$RESULTS"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true

throughput() {  # SHAPE MODE [extra options]
  local shape=$1 mode=$2
  shift 2
  stamp "reasoning-8k, $shape, $mode, TP=$tp"
  python3 -m zipage.cli bench throughput --shape "$shape" --scale "${SCALE:-1}" --workload reasoning-8k \
    --modes "$mode" --hf-requests 0 --tensor-parallel-size "$tp" --all-reduce "${ALL_REDUCE:-nccl}" --out "$RESULTS/$shape-$mode-tp$tp" "$@" 2>&1 \
    | grep -v "it/s\]\|tok/s\]" | tail -12
}

case "$part" in
  test)
    stamp "tensor-parallel tests on CUDA"
    ZIPAGE_TEST_DEVICE=cuda TRITON_INTERPRET=0 timeout "${TEST_TIMEOUT:-540}" python3 -m pytest -q -x -p no:cacheprovider \
      ${TESTS:+-k "$TESTS"} tests/test_tensor_parallel.py 2>&1 | tail -5 ;;
  decode)
    if [ "$tp" -gt 1 ]; then
      stamp "one rank's layers of TP=$tp alone on one GPU, Qwen3-8B shape"
      python3 -m zipage.cli bench decode --shape qwen3-8b --batch 1,64,256 --modes graphs --steps 32 \
        --one-rank-of "$tp" --out "$RESULTS/decode-one-rank-of-$tp.json" 2>&1 | grep -v "it/s\]" | tail -4
    fi
    for size in 1 "$tp"; do
      stamp "whole decode steps, Qwen3-8B shape, TP=$size"
      python3 -m zipage.cli bench decode --shape qwen3-8b --batch 1,64,256 --modes graphs --steps 32 \
        --tensor-parallel-size "$size" --all-reduce "${ALL_REDUCE:-nccl}" --out "$RESULTS/decode-tp$size.json" 2>&1 | grep -v "it/s\]" | tail -4
    done ;;
  profile)
    for size in 1 "$tp"; do
      stamp "where decode steps' time goes, Qwen3-8B shape, TP=$size"
      python3 -m zipage.cli bench decode --shape qwen3-8b --batch 64,256 --modes graphs --steps 32 --profile-steps 4 \
        --tensor-parallel-size "$size" --all-reduce "${ALL_REDUCE:-nccl}" --out "$RESULTS/decode-profile-tp$size.json" 2>&1 | grep -v "it/s\]" | tail -24
    done ;;
  allreduce)
    stamp "all-reduce at a decode step's sizes, TP=$tp: NCCL against symmetric memory"
    python3 scripts/allreduce_sweep.py --gpus "$tp" --out "$RESULTS/allreduce-tp$tp.json" 2>&1 | tail -12 ;;
  zipage8k) throughput qwen3-8b zipage ;;
  full8k) throughput qwen3-8b full ;;
  32b-zipage|32b-full)
    throughput qwen3-32b "${part#32b-}" --kv-cache-tokens "${KV_TOKENS:-241394}" --max-seconds "${MAX_S:-420}" ;;
esac
stamp "done"
