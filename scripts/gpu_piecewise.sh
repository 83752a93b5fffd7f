#!/usr/bin/env bash
# Piecewise CUDA graphs on one GPU (docs/design.md, "CUDA graphs"), in one job of about 8 minutes:
#   tests: the pieces' CUDA tests (captured pieces against the layers, engines with pieces against
#          eager engines) and the chunked-prefill tests with pieces on;
#   serve: the long-prompt latency benchmark (docs/benchmarks.md, "Long prompts among decoding
#          streams") with chunks of 512 and 2,048 tokens, each with --piecewise-graph-tokens 2048.
# Usage: [RESULTS=dir] bash scripts/gpu_piecewise.sh [tests|serve|all]   (default all)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
what=${1:-all}
RESULTS=${RESULTS:-out/piecewise}
case "$what" in tests|serve|all) ;; *) echo "usage: bash scripts/gpu_piecewise.sh [tests|serve|all]" >&2; exit 2;; esac
source scripts/gpu_common.sh
require_cuda measures
mkdir -p "$RESULTS"

if [[ $what != serve ]]; then
  stamp "CUDA tests of the pieces"
  ZIPAGE_TEST_DEVICE=cuda TRITON_INTERPRET=0 timeout 240 python3 -m pytest -q -x -p no:cacheprovider \
    tests/test_piecewise_graphs.py 2>&1 | tail -15 | tee "$RESULTS/tests.log"
fi
if [[ $what != tests ]]; then
  for chunk in 512 2048; do
    stamp "long prompts among 128 streams: chunks of $chunk, pieces up to 2,048 tokens"
    timeout 150 python3 -m zipage.cli bench serve --shape qwen3-8b --background 128 --input-len 128 \
      --output-len 3000 --long-prompts 8192,16384,32768 --long-repeats 2 --long-start 4 --long-rate 0.5 \
      --long-output-len 16 --max-model-len 33280 --max-num-batched-tokens "$chunk" --piecewise-graph-tokens 2048 \
      --out "$RESULTS/serve-c$chunk" 2>&1 | grep -v "^INFO\|Warning\|warn" | tail -10 | tee "$RESULTS/serve-c$chunk.log"
  done
fi
stamp "done: $RESULTS"
