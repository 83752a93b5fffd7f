#!/usr/bin/env bash
# The register-tracing task on one GPU: train its model, then compare Zipage settings on it and on
# the ledger model (docs/quality.md, "Do the tuned settings carry over to other tasks?").
# Usage: [RESULTS=dir] [CHECKPOINT=dir] [SETTINGS=list] bash scripts/gpu_quality_tasks.sh [PART] [TRAIN_MINUTES]
#   train    train the tracing model into CHECKPOINT (default checkpoints/tracing-14m) for TRAIN_MINUTES
#            (default 5.5) of training, plus 45 s kept for saving and the built-in full-KV evaluation of
#            200 held-out problems; the log goes to RESULTS/train.log
#   compare  `zipage eval synthetic --settings SETTINGS` (default defaults,keep_prompt,pool,block_window,tuned)
#            on 32 held-out problems, blocks of 32, float32, budgets 1/2 and 2/3 of the mean sequence, on
#            CHECKPOINT (task tracing) and on checkpoints/ledger-14m (the ledger task): RESULTS/tracing/
#            and RESULTS/ledger/ (synthetic.json, synthetic.md, synthetic.png) and their logs
#   all      (default) train, then compare
#   fp8      the FP8 accuracy table of docs/fp8.md on NUM_PROBLEMS (default 200) held-out problems of
#            both models: bf16 activations, Zipage at budgets 1/2 and 2/3, full KV; a bf16 run (its
#            tokens saved), then fp8 KV, fp8 weights and both, each against it (RESULTS/fp8/TASK-VARIANT/);
#            about 50 s per run of 200 problems on an H200, about 7 minutes in all
# RESULTS defaults to out/quality-tasks. Estimated wall times on an H200 (not yet measured): train about
# TRAIN_MINUTES + 1.3 minutes (6.8 at the default: start, data workers, the 45 s reserve); compare about
# 2-3 minutes (11 engine runs per model, each a few seconds for 32 problems of these 13.8M models plus its
# start). Where one call may run 10 minutes at most, run `train` and `compare` as two calls.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
part=${1:-all}
minutes=${2:-5.5}
RESULTS=${RESULTS:-out/quality-tasks}
CHECKPOINT=${CHECKPOINT:-checkpoints/tracing-14m}
SETTINGS=${SETTINGS:-defaults,keep_prompt,pool,block_window,tuned}
LEDGER=checkpoints/ledger-14m
RESERVE_S=45
case "$part" in train|compare|all|fp8) ;; *) echo "PART must be train, compare, all or fp8, got '$part'" >&2; exit 2 ;; esac
source scripts/gpu_common.sh
check_train_minutes "$minutes"
mkdir -p "$RESULTS"

stamp "$(python3 -c 'import sys, torch, transformers; print("python", sys.version.split()[0], "torch",
  torch.__version__, "transformers", transformers.__version__, "CUDA", torch.cuda.is_available())')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
require_cuda "trains and evaluates"

train() {
  local max_minutes
  max_minutes=$(awk -v m="$minutes" -v r="$RESERVE_S" 'BEGIN { printf "%.3f", m + r / 60 }')
  stamp "training the tracing model into $CHECKPOINT: $minutes min of training, --max-minutes $max_minutes"
  timeout $(( ${max_minutes%.*} * 60 + 180 )) python3 -m zipage.quality.train --task tracing --out "$CHECKPOINT" \
    --max-minutes "$max_minutes" --eval-reserve-s "$RESERVE_S" 2>&1 | tee "$RESULTS/train.log"
  stamp "trained; held-out result in $CHECKPOINT/training.json"
}

compare() {  # NAME MODEL TASK
  local name=$1 model=$2 task=$3
  if [ ! -f "$model/model.safetensors" ]; then
    echo "no checkpoint at $model (run the train part first, or set CHECKPOINT)" >&2
    return 2
  fi
  stamp "settings $SETTINGS on $model (task $task)"
  timeout 420 python3 -m zipage.cli eval synthetic --model "$model" --task "$task" --num-problems 32 \
    --budgets 0.5,0.667 --settings "$SETTINGS" --block-size 32 --dtype float32 --out "$RESULTS/$name" \
    2>&1 | tee "$RESULTS/$name.log"
  stamp "wrote $RESULTS/$name/synthetic.md"
}

fp8() {  # NAME MODEL TASK
  local name=$1 model=$2 task=$3 variant
  local eval=(python3 -m zipage.cli eval synthetic --model "$model" --task "$task" --num-problems "${NUM_PROBLEMS:-200}"
              --budgets 0.5,0.667 --policies zipage --block-size 32 --dtype bfloat16)
  stamp "fp8 accuracy on $model (task $task): bf16"
  timeout 300 "${eval[@]}" --save-tokens --out "$RESULTS/fp8/$name-bf16" 2>&1 | tail -8 | tee "$RESULTS/fp8/$name-bf16.log"
  for variant in "kv:--kv-cache-dtype fp8" "weights:--quantization fp8" "both:--kv-cache-dtype fp8 --quantization fp8"; do
    stamp "fp8 accuracy on $model (task $task): ${variant%%:*}"
    # shellcheck disable=SC2086  # the variant's options split into words
    timeout 300 "${eval[@]}" ${variant#*:} --reference "$RESULTS/fp8/$name-bf16" --out "$RESULTS/fp8/$name-${variant%%:*}" \
      2>&1 | tail -8 | tee "$RESULTS/fp8/$name-${variant%%:*}.log"
  done
}

if [ "$part" = fp8 ]; then
  mkdir -p "$RESULTS/fp8"
  fp8 ledger "$LEDGER" standard
  fp8 tracing "$CHECKPOINT" tracing
  stamp "done"
  exit 0
fi
if [ "$part" != compare ]; then train; fi
if [ "$part" != train ]; then
  compare tracing "$CHECKPOINT" tracing
  compare ledger "$LEDGER" standard
fi
stamp "done"
