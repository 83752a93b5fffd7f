#!/usr/bin/env bash
# The standard throughput runs on one H200, one part per device call (each fits in 10 minutes).
# Usage: OUT=results-dir bash scripts/gpu_stage2.sh PART
#   full8k | zipage8k   reasoning-8k, KV cache capped at 48 GB of Qwen3-8B KV, peak demand 2x the cache
#   full16k | zipage16k the same for reasoning-16k
#   whole8k             Zipage with the whole GPU (no cache cap)
#   sweep-budget        Zipage budget 1024/2048/4096 (block 256), at scale 1/2
#   sweep-block         Zipage block 64/128 (budget 2048), at scale 1/2
#   eager               each mode with and without CUDA graphs and fused kernels, medium scale
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$(pwd)
OUT=${OUT:-out}
mkdir -p "$OUT"
bench() { timeout 570 python3 -m zipage.cli bench throughput "$@" 2>&1 | grep -v "it/s" | tail -16; }
case "${1:?part}" in
  full8k) bench --workload reasoning-8k --modes full --hf-requests 64 --out "$OUT/full8k" ;;
  zipage8k) bench --workload reasoning-8k --modes zipage --hf-requests 0 --out "$OUT/zipage8k" ;;
  full16k) bench --workload reasoning-16k --modes full --hf-requests 0 --out "$OUT/full16k" ;;
  zipage16k) bench --workload reasoning-16k --modes zipage --hf-requests 0 --out "$OUT/zipage16k" ;;
  whole8k) bench --workload reasoning-8k --whole-gpu --num-requests 512 --modes zipage --hf-requests 0 \
      --out "$OUT/whole8k" ;;
  sweep-budget) bench --workload reasoning-8k --scale 0.5 --hf-requests 0 --out "$OUT/sweep-budget" \
      --modes zipage+budget=1024,zipage,zipage+budget=4096 ;;
  sweep-block) bench --workload reasoning-8k --scale 0.5 --hf-requests 0 --out "$OUT/sweep-block" \
      --modes zipage+block=64,zipage+block=128 ;;
  eager) bench --scale medium --hf-requests 0 --out "$OUT/eager" --modes full,full+eager,zipage,zipage+eager ;;
  *) echo "unknown part $1" >&2; exit 2 ;;
esac
