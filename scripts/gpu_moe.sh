#!/usr/bin/env bash
# Qwen3-30B-A3B shape (random weights) on one GPU (docs/benchmarks.md, "Mixture of experts"): one
# mode of the reasoning workload per job, so that a whole run fits a job of 10 minutes.
#   full | zipage: bench throughput --workload $WORKLOAD --modes <mode>, the KV cache capped at $CAP
#                  tokens, cut at $MAX_SECONDS of its run (default 500: whole runs of reasoning-8k at
#                  the 80 GB card's cap end sooner); QUANT=fp8 for float8 experts and dense layers
#   layer:         the MoE layer and whole decode steps, bf16 and fp8 experts (about 3 minutes)
# Usage: [RESULTS=dir] [WORKLOAD=reasoning-8k] [CAP=132000] [MAX_SECONDS=500] [QUANT=fp8]
#        bash scripts/gpu_moe.sh full|zipage|layer
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
what=${1:-}
case "$what" in full|zipage|layer) ;; *) echo "usage: bash scripts/gpu_moe.sh full|zipage|layer" >&2; exit 2;; esac
source scripts/gpu_common.sh
require_cuda measures
RESULTS=${RESULTS:-out/moe}
mkdir -p "$RESULTS"
if [[ $what == layer ]]; then
  for quant in none fp8; do
    extra=(); [[ $quant == fp8 ]] && extra=(--quantization fp8)
    stamp "MoE layer and decode steps, experts $quant"
    python3 -m zipage.cli bench moe --batch 1,64,256 --iters 30 "${extra[@]}" 2>&1 | grep -v "Warning\|warn" | tail -8
    python3 -m zipage.cli bench decode --shape qwen3-30b-a3b --batch 1,64,256 --modes graphs --steps 32 "${extra[@]}" \
      2>&1 | grep -v "Warning\|warn" | tail -8
  done
else
  extra=(); [[ -n ${QUANT:-} ]] && extra=(--quantization "$QUANT")
  name="${WORKLOAD:-reasoning-8k}-$what${QUANT:+-$QUANT}"
  stamp "$name, KV cache ${CAP:-132000} tokens"
  python3 -m zipage.cli bench throughput --shape qwen3-30b-a3b --workload "${WORKLOAD:-reasoning-8k}" --modes "$what" \
    --hf-requests 0 --kv-cache-tokens "${CAP:-132000}" --max-seconds "${MAX_SECONDS:-500}" "${extra[@]}" \
    --out "$RESULTS/$name" 2>&1 | grep -v "Warning\|warn" | tail -30
fi
stamp "done: $RESULTS"
