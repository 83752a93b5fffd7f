#!/usr/bin/env bash
# Mixed steps on one GPU (docs/benchmarks.md, "Long prompts among decoding streams"), in one job of
# about 8 minutes:
#   tests:  the CUDA tests of the pieces, of prompt chunks' flash attention (the operator called
#           directly, split-K for deep chunks, and through the varlen wrapper) and of the eager
#           steps' direct launches;
#   chunks: one 32K-token prompt's mixed steps beside 128 decoding streams, timed one by one, with
#           where the device time goes (zipage bench chunks --profile), chunks costed by attention
#           over SPAN keys, or with ZIPAGE=1 the prompt compressed to a budget of 2,048 between
#           chunks of CHUNK tokens (default 512); pieces on (the default);
#   serve:  the long-prompt latency benchmark, one run per entry of RUNS; pieces on (the default).
# Usage: [RESULTS=dir] [RUNS="512 512:8192 512z"] [SPAN=8192] [ZIPAGE=1 [CHUNK=512]] [PROFILE=seconds] [CONTROL=1]
#        bash scripts/gpu_piecewise.sh [tests|chunks|serve|all]
#        (default all). RUNS lists the serve runs, each CHUNK[:SPAN][z][t]: chunks of CHUNK tokens
#        (--max-num-batched-tokens), costed by attention over SPAN keys (--prefill-attention-span,
#        a number or "model"), z for Zipage (budget 2,048, prompts compressed between their chunks,
#        so a chunk attends to at most the budget plus itself), t for the engine on a thread of
#        the server (--no-engine-process). SPAN is the chunks run's --prefill-attention-span (0:
#        plain chunks). PROFILE: each serve run also records the engine's kernels for that many
#        seconds from the first long prompt (--profile-window). CONTROL=1: each serve run then
#        sends its streams alone, for their decode step at the window's context lengths (--control).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
what=${1:-all}
RESULTS=${RESULTS:-out/piecewise}
case "$what" in tests|chunks|serve|all) ;; *) echo "usage: bash scripts/gpu_piecewise.sh [tests|chunks|serve|all]" >&2; exit 2;; esac
source scripts/gpu_common.sh
require_cuda measures
mkdir -p "$RESULTS"

if [[ $what == tests || $what == all ]]; then
  stamp "CUDA tests of the pieces and of the chunks' flash attention"
  ZIPAGE_TEST_DEVICE=cuda TRITON_INTERPRET=0 timeout 240 python3 -m pytest -q -x -p no:cacheprovider \
    tests/test_flash_chunks.py tests/test_piecewise_graphs.py tests/test_step_launches.py 2>&1 | tail -15 \
    | tee "$RESULTS/tests.log"
fi
if [[ $what == chunks || $what == all ]]; then
  if [[ -n ${ZIPAGE:-} ]]; then
    mode=(--max-num-batched-tokens "${CHUNK:-512}" --kv-budget-tokens 2048 --prefill-compression always)
  else
    mode=(--max-num-batched-tokens 512 --prefill-attention-span "${SPAN:-8192}")
  fi
  stamp "one 32K-token prompt in steps of ${mode[1]} tokens beside 128 streams ${mode[*]:2}"
  timeout 120 python3 -m zipage.cli bench chunks --shape qwen3-8b --streams 128 --prompt-len 32768 \
    "${mode[@]}" --profile --out "$RESULTS/chunks" 2>&1 | grep -v "Warning\|warn" | tail -34 | tee "$RESULTS/chunks.log"
fi
if [[ $what == serve || $what == all ]]; then
  for run in ${RUNS:-512 512:8192 512z}; do
    spec=${run%t}; spec=${spec%z}; chunk=${spec%%:*}; extra=()
    [[ $spec == *:* ]] && extra=(--prefill-attention-span "${spec#*:}")
    [[ ${run%t} == *z ]] && extra+=(--kv-budget-tokens 2048 --prefill-compression always)
    [[ $run == *t ]] && extra+=(--no-engine-process)
    stamp "long prompts among 128 streams: chunks of $chunk ${extra[*]}"
    timeout $((${CONTROL:-0} ? 200 : 130)) python3 -m zipage.cli bench serve --shape qwen3-8b --background 128 --input-len 128 \
      --output-len 3000 --long-prompts 8192,16384,32768 --long-repeats 2 --long-start 4 --long-rate 0.5 \
      --long-output-len 16 --max-model-len 33280 --max-num-batched-tokens "$chunk" "${extra[@]}" \
      --profile-window "${PROFILE:-0}" ${CONTROL:+--control} \
      --out "$RESULTS/serve-c${run/:/-s}" 2>&1 | grep -v "^INFO\|Warning\|warn" | tail -40 \
      | tee "$RESULTS/serve-c${run/:/-s}.log"
  done
fi
stamp "done: $RESULTS"
