#!/usr/bin/env bash
# The retrieval task (long prompts) on one GPU, in one job of about 9.5 minutes: train its model,
# then compare how a prompt meets the budget (docs/quality.md): full KV; the prompt cached whole
# and compressed at the first decode step (prefill_compression="off"); the prompt compressed
# between its prefill chunks of CHUNK tokens (prefill_compression="always").
# Usage: [RESULTS=dir] [CHECKPOINT=dir] [CHUNK=256] [BUDGETS=list] bash scripts/gpu_retrieval.sh [TRAIN_MINUTES]
#   TRAIN_MINUTES (default 6) of training plus 30 s for saving and the built-in full-KV evaluation;
#   the training problems grow from retrieval-tiny's 8 to 12 facts to the standard 120 to 240 over the
#   first half of the training after the warmup (train.py's curriculum, the retrieval task's default);
#   then `zipage eval synthetic --task retrieval --settings prompt_whole,prefill` on 64 held-out
#   problems, blocks of 32, float32, BUDGETS (default 0.25,0.375,0.5,0.75 of the mean sequence),
#   into RESULTS/retrieval (synthetic.json, .md, .png; accuracy by thirds of the length in the JSON).
# RESULTS defaults to out/retrieval, CHECKPOINT to out/retrieval/retrieval-14m (27 MB, kept out of
# the repository).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
minutes=${1:-6}
RESULTS=${RESULTS:-out/retrieval}
CHECKPOINT=${CHECKPOINT:-$RESULTS/retrieval-14m}
CHUNK=${CHUNK:-256}
BUDGETS=${BUDGETS:-0.25,0.375,0.5,0.75}
RESERVE_S=30
source scripts/gpu_common.sh
check_train_minutes "$minutes"
require_cuda "trains and evaluates"
mkdir -p "$RESULTS"

max_minutes=$(awk -v m="$minutes" -v r="$RESERVE_S" 'BEGIN { printf "%.3f", m + r / 60 }')
stamp "training the retrieval model into $CHECKPOINT: $minutes min of training"
timeout $(( ${max_minutes%.*} * 60 + 150 )) python3 -m zipage.quality.train --task retrieval --out "$CHECKPOINT" \
  --max-minutes "$max_minutes" --eval-reserve-s "$RESERVE_S" --eval-problems 32 2>&1 | tee "$RESULTS/train.log"
stamp "prompt kept whole against compressed between chunks of $CHUNK tokens, budgets $BUDGETS"
timeout 240 python3 -m zipage.cli eval synthetic --model "$CHECKPOINT" --task retrieval --num-problems 64 \
  --budgets "$BUDGETS" --settings prompt_whole,prefill --max-num-batched-tokens "$CHUNK" --block-size 32 \
  --dtype float32 --out "$RESULTS/retrieval" 2>&1 | tee "$RESULTS/eval.log"
stamp "done: $RESULTS/retrieval/synthetic.md"
