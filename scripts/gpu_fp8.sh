# FP8 on a GPU in one job: the fp8 CUDA tests, decode attention bf16 against fp8, whole decode
# steps with fp8 weights and KV (the quantizers fused into the norms and the SwiGLU, and not),
# then reasoning-8k with fp8 weights and KV, Zipage and full KV. PART picks one (default all).
#
#   bash scripts/gpu_fp8.sh [tests|attention|decode|zipage8k|full8k|all|probs|probs-quality|probs8k|gemm-tma|quantizers|pdl|pdl8k|registers|ratio8k]
#
# Not part of all: probs, decode attention and whole decode steps with P @ V on float8 matrix units
# (paged_decode.FP8_PROBABILITIES) against without, each with where 4 steps' time goes by kernel; probs-quality, the synthetic tasks' accuracy with it
# (200 problems a task, fp8 weights and KV, against a bf16 run of the same problems); probs8k, the
# Zipage reasoning-8k run with it. PROBS_MAX_REGISTERS (default 128, the fastest cap in the
# attention sweep) caps that kernel's registers in those parts. gemm-tma: the W8A8 GEMM's candidate
# configs whose operands TMA loads, timed per Qwen3-8B layer at 64-256 tokens beside the engine's
# configs (scripts/fp8_gemm_sweep.py --match tma), after their CUDA test. quantizers: the W8A8
# activation quantizers reading a row once against twice (fp8_linear.ONE_PASS_MAX_WIDTH), their
# CUDA tests, each kernel alone (scripts/fp8_quantizer_sweep.py), and whole decode steps both ways.
# pdl: the decode step's kernels with programmatic dependent launch (kernels/common.PDL) against
# without: its CUDA tests, then whole decode steps off, on with the next kernel launched early and on with
# it launched as each kernel exits (common.PDL_EARLY_TRIGGER), fp8 weights and KV (with where 4 steps'
# time goes by kernel) and bf16; pdl8k: the Zipage reasoning-8k run with fp8 weights and KV, with it
# (PDL_EARLY_TRIGGER=True: the next kernel launched early; default False, as each kernel exits).
# registers: the float8 decode kernel (widening) with its registers capped (paged_decode.
# FP8_WIDENING_MAX_REGISTERS at 96 and 88) against the compiler's count: its CUDA test, the kernel
# alone (equal contexts and random ones), then whole decode steps with the cap REGISTERS (default 96) and without.
# ratio8k: the Zipage reasoning-8k run in bf16, then with fp8 weights and KV, on one start of the machine
# (separate starts have differed by about 2%).
#
# Each part prints its table; RESULTS (default out/fp8) gets the JSON files.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
part=${1:-all}
RESULTS=${RESULTS:-out/fp8}
case "$part" in
  tests|attention|decode|zipage8k|full8k|all|probs|probs-quality|probs8k|gemm-tma|quantizers|pdl|pdl8k|registers) ;;
  ratio8k) ;;
  *) echo "PART must be tests, attention, decode, zipage8k, full8k, all, probs, probs-quality, probs8k, gemm-tma," \
          "quantizers, pdl, pdl8k, registers or ratio8k," \
          "got '$part'" >&2
     exit 2 ;; esac
source scripts/gpu_common.sh
require_cuda "measures fp8"
mkdir -p "$RESULTS"
FP8="--quantization fp8 --kv-cache-dtype fp8"
PROBS_MAX_REGISTERS=${PROBS_MAX_REGISTERS:-128}
REGISTERS=${REGISTERS:-96}
registers_cap() {  # python source that caps the float8 widening decode kernel's registers ($1: a count or None)
  echo "from zipage.kernels import paged_decode; paged_decode.FP8_WIDENING_MAX_REGISTERS = $1"
}
probs_on() {  # python source that turns the float8 P @ V path on ($1: True or False)
  echo "from zipage.kernels import paged_decode; paged_decode.FP8_PROBABILITIES = $1
paged_decode.FP8_PROBS_MAX_REGISTERS = $PROBS_MAX_REGISTERS"
}

if [ "$part" = tests ] || [ "$part" = all ]; then
  stamp "fp8 CUDA tests"
  ZIPAGE_TEST_DEVICE=cuda TRITON_INTERPRET=0 python3 -m pytest -q tests/test_fp8_kv.py tests/test_fp8_weights.py \
    -k "cuda or fused" 2>&1 | tail -3
fi
if [ "$part" = attention ] || [ "$part" = all ]; then
  stamp "decode attention, the engine's kernels: bf16 against fp8"
  python3 scripts/decode_tile_sweep.py --default-only --batch 1,16,64,128,256 --context 1024,2048,4096 \
    --out "$RESULTS/attention.json"
fi
if [ "$part" = decode ] || [ "$part" = all ]; then
  for fused in True False; do
    stamp "whole decode steps, fp8 weights and KV, quantizers fused into the norms and the SwiGLU: $fused"
    python3 -c "import sys; from zipage.layers import quant; quant.FUSE_QUANTIZERS = $fused
from zipage.cli import main; sys.exit(main(sys.argv[1:]))" bench decode --shape qwen3-8b --batch 1,64,256 \
      --modes graphs --steps 32 $FP8 --out "$RESULTS/decode-fused-$fused.json"
  done
fi
if [ "$part" = probs ]; then
  stamp "decode attention, fp8 cache: P @ V widened to bf16 against on float8 matrix units"
  python3 scripts/decode_tile_sweep.py --default-only --fp8-probabilities --batch 1,16,64,128,256 \
    --context 1024,1040,2048,4096 --out "$RESULTS/attention-probs.json"  # 1,040: a partial last tile
  for probs in True False; do
    stamp "whole decode steps, fp8 weights and KV, P @ V on float8 matrix units: $probs"
    python3 -c "import sys; $(probs_on $probs)
from zipage.cli import main; sys.exit(main(sys.argv[1:]))" bench decode --shape qwen3-8b --batch 1,64,256 \
      --modes graphs --steps 32 --profile-steps 4 $FP8 --out "$RESULTS/decode-probs-$probs.json" 2>&1 \
      | grep -v "it/s\]" | tail -40
  done
fi
if [ "$part" = gemm-tma ]; then
  stamp "the W8A8 kernel with TMA loads: CUDA test"
  # a failure is reported and the sweep still runs: the sweep checks each config's output itself
  (ZIPAGE_TEST_DEVICE=cuda TRITON_INTERPRET=0 python3 -m pytest -q tests/test_fp8_weights.py \
    -k "cuda_w8a8_tma" 2>&1 || true) | tail -15
  stamp "the W8A8 GEMM per layer, 64-256 tokens: TMA candidates against the engine's configs"
  python3 scripts/fp8_gemm_sweep.py --variants w8a8 --batches 64,128,256 --match tma --budget-s 240 \
    --out "$RESULTS/gemm-tma"
fi
if [ "$part" = quantizers ]; then
  stamp "the activation quantizers: CUDA tests"
  (ZIPAGE_TEST_DEVICE=cuda TRITON_INTERPRET=0 python3 -m pytest -q tests/test_fp8_weights.py \
    -k "alike or quantize_rows_fp8 or fused_quantizers" 2>&1 || true) | tail -15
  stamp "the activation quantizers alone: a row read once against twice"
  python3 scripts/fp8_quantizer_sweep.py
  for width in 0 16384; do
    stamp "whole decode steps, fp8 weights and KV, ONE_PASS_MAX_WIDTH=$width"
    python3 -c "import sys; from zipage.kernels import fp8_linear; fp8_linear.ONE_PASS_MAX_WIDTH = $width
from zipage.cli import main; sys.exit(main(sys.argv[1:]))" bench decode --shape qwen3-8b --batch 1,64,128,256 \
      --modes graphs --steps 32 $FP8 --out "$RESULTS/decode-one-pass-$width.json" 2>&1 | grep -v "it/s\]" | tail -6
  done
fi
if [ "$part" = pdl ]; then
  stamp "programmatic dependent launch: CUDA tests"
  (ZIPAGE_TEST_DEVICE=cuda TRITON_INTERPRET=0 python3 -m pytest -q tests/test_pdl.py 2>&1 || true) | tail -15
  for weights in fp8 bf16; do
    # off; on with the next kernel launched early (as each program has waited); on, launched at exit
    for pdl in False:True True:True True:False; do
      stamp "whole decode steps, $weights weights and KV, PDL: ${pdl%%:*}, early trigger: ${pdl#*:}"
      if [ $weights = fp8 ]; then options="$FP8 --profile-steps 4"; else options=""; fi
      python3 -c "import sys; from zipage.kernels import common; common.PDL = ${pdl%%:*}
common.PDL_EARLY_TRIGGER = ${pdl#*:}
from zipage.cli import main; sys.exit(main(sys.argv[1:]))" bench decode --shape qwen3-8b --batch 1,64,128,256 \
        --modes graphs --steps 32 $options --out "$RESULTS/decode-$weights-pdl-${pdl/:/-}.json" 2>&1 \
        | grep -v "it/s\]" | tail -48
    done
  done
fi
if [ "$part" = pdl8k ]; then
  stamp "reasoning-8k, zipage, fp8 weights and KV, programmatic dependent launch"
  python3 -c "import sys; from zipage.kernels import common; common.PDL = True
common.PDL_EARLY_TRIGGER = ${PDL_EARLY_TRIGGER:-False}
from zipage.cli import main; sys.exit(main(sys.argv[1:]))" bench throughput --shape qwen3-8b --scale 1 \
    --workload reasoning-8k --modes zipage --hf-requests 0 $FP8 --out "$RESULTS/zipage-8k-pdl" 2>&1 \
    | grep -v "it/s\]\|tok/s\]" | tail -12
fi
if [ "$part" = registers ]; then
  stamp "the float8 decode kernels: CUDA test (capped, the same numbers)"
  (ZIPAGE_TEST_DEVICE=cuda TRITON_INTERPRET=0 python3 -m pytest -q tests/test_fp8_kv.py \
    -k "cuda_kernels_bf16" 2>&1 || true) | tail -15
  for ragged in "" --ragged; do
    stamp "decode attention, fp8 cache: the widening kernel with its registers capped ${ragged:+(random lengths)}"
    python3 scripts/decode_tile_sweep.py --default-only --widening-registers 96,88 $ragged \
      --batch 16,64,128,256 --context 1040,2048,4096 --out "$RESULTS/attention-registers${ragged/--/-}.json"
  done
  for cap in None "$REGISTERS"; do
    stamp "whole decode steps, fp8 weights and KV, the widening kernel's registers capped at $cap"
    python3 -c "import sys; $(registers_cap "$cap")
from zipage.cli import main; sys.exit(main(sys.argv[1:]))" bench decode --shape qwen3-8b --batch 1,64,128,256 \
      --modes graphs --steps 32 $FP8 --out "$RESULTS/decode-registers-$cap.json" 2>&1 | grep -v "it/s\]" | tail -6
  done
fi
if [ "$part" = ratio8k ]; then
  for weights in bf16 fp8; do
    stamp "reasoning-8k, zipage, $weights weights and KV"
    if [ $weights = fp8 ]; then options=$FP8; else options=""; fi
    python3 -m zipage.cli bench throughput --shape qwen3-8b --scale 1 --workload reasoning-8k --modes zipage \
      --hf-requests 0 $options --out "$RESULTS/zipage-8k-$weights" 2>&1 | grep -v "it/s\]\|tok/s\]" | tail -12
  done
fi
if [ "$part" = probs-quality ]; then
  for task in tracing:checkpoints/tracing-14m ledger:checkpoints/ledger-14m; do
    name=${task%%:*} model=${task#*:}
    [ "$name" = ledger ] && task_name=standard || task_name=tracing
    eval_args=(eval synthetic --model "$model" --task "$task_name" --num-problems 200 --budgets 0.5,0.667
               --policies zipage --block-size 32 --dtype bfloat16)
    stamp "accuracy, $name: bf16"
    python3 -m zipage.cli "${eval_args[@]}" --save-tokens --out "$RESULTS/quality/$name-bf16" 2>&1 | tail -6
    stamp "accuracy, $name: fp8 weights and KV, P @ V on float8 matrix units"
    python3 -c "import sys; $(probs_on True)
from zipage.cli import main; sys.exit(main(sys.argv[1:]))" "${eval_args[@]}" $FP8 \
      --reference "$RESULTS/quality/$name-bf16" --out "$RESULTS/quality/$name-probs" 2>&1 | tail -6
  done
fi
if [ "$part" = probs8k ]; then
  stamp "reasoning-8k, zipage, fp8 weights and KV, P @ V on float8 matrix units"
  python3 -c "import sys; $(probs_on True)
from zipage.cli import main; sys.exit(main(sys.argv[1:]))" bench throughput --shape qwen3-8b --scale 1 \
    --workload reasoning-8k --modes zipage --hf-requests 0 $FP8 --out "$RESULTS/zipage-8k-probs" 2>&1 \
    | grep -v "it/s\]\|tok/s\]" | tail -12
fi
for mode in zipage full; do
  if [ "$part" = "${mode}8k" ] || [ "$part" = all ]; then
    stamp "reasoning-8k, $mode, fp8 weights and KV"
    python3 -m zipage.cli bench throughput --shape qwen3-8b --scale 1 --workload reasoning-8k --modes "$mode" \
      --hf-requests 0 $FP8 --out "$RESULTS/$mode-8k" 2>&1 | grep -v "it/s\]\|tok/s\]" | tail -12
  fi
done
stamp "done"
