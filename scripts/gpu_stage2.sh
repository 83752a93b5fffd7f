#!/usr/bin/env bash
# GPU runs that each fit one 10-minute device call; several parts can run side by side on the
# GPUs of one host (CUDA_VISIBLE_DEVICES picks the GPU of each).
# Usage: OUT=results-dir [SCALE=1] [LIMIT=570 seconds] [SHAPE=qwen3-8b] [MAX_S=seconds] bash scripts/gpu_stage2.sh PART
# (MAX_S: the throughput parts stop each mode after that many seconds of run, --max-seconds)
#   full8k | zipage8k   reasoning-8k, KV cache capped at 48 GB of Qwen3-8B KV x SCALE, peak demand 2x
#   full16k | zipage16k the same for reasoning-16k (MODES overrides the Zipage modes, e.g. zipage+sync)
#   whole8k             Zipage with the whole GPU (no cache cap), 512 requests, MAX_SEQS (default 512) running;
#                       the replay predicts 505 s of run at SCALE=1 (too long for one call with the start) and
#                       358 s at SCALE=0.75
#   sweep-budget        Zipage budget 1024/2048/4096 (block 256), at scale 1/2
#   sweep-block         Zipage block 64/128 (budget 2048), at scale 1/2 (MODES picks one, e.g. zipage+block=64,
#                       to run the two on two GPUs)
#   eager               each mode with and without CUDA graphs and fused kernels, EAGER_SCALE (default medium);
#                       MODES splits it over two GPUs (full,full+eager and zipage,zipage+eager)
#   profile             decode steps at batch 1/64/256, graphs and eager, with the kernels' time per step by kind
#   verify              the engine tests on CUDA (greedy tokens, asynchronous scheduling, compression; the norm
#                       and RoPE kernels run inside them) and the kernel bench (each kernel against its twin)
#   compression         one compression by stage (REQUESTS, default 1,4,16,64; kernels checked against
#                       their twins) and its cost beside the decode steps of BESIDE (default 128) requests
#   hf                  transformers generate, HF_BATCH (default 1) requests per call, beside 4 full-KV requests
#   train               train the synthetic-task model (MINUTES, default 9.2; INIT: a checkpoint to start from)
#   eval                synthetic evaluation of checkpoints/ledger-14m, 200 problems, every policy and budget;
#                       EVAL picks the variants (default: keep16 keep16pool keep32pool plain16: statement kept
#                       or not, window 16 or 32, Zipage pooling at every compression); results saved per run
#   tp-test             tensor-parallel engine tests on two GPUs
#   tp-bench            full and Zipage at TP (default 2), reasoning-8k at SCALE
#   serve               online benchmark, MODE=full|zipage, Qwen3-8B shape, 12 GB KV cache
# Each part leaves one archive OUT/PART.tgz (results and log), split into 15 MB pieces if larger.
# Measured wall times on an H200, engine start included (the latest build's where several exist):
# full8k at SCALE=1 (the standard run) about 520 s, at 0.75 about 325-400 s; zipage8k at 1 about
# 265-290 s, at 0.75 about 215-265 s; full16k at 0.5 about 300-370 s, at 1 with MAX_S=450 about 500 s
# (the whole run would take about 15 minutes); zipage16k at 0.5 about 175-200 s, at 1 about 353 s;
# train 535 s (MINUTES=9.2); serve about 200 s per mode (RATES=2,8,inf NREQ=64); eval about 150 s per
# variant; verify about 110-146 s; compression 53 s; tp-test more than 162 s (ZIPAGE_TP_TIMEOUT_S
# bounds its engine part); tp-bench at SCALE=0.25 about 250 s at TP=2 and 200 s at TP=1;
# sweep-budget at SCALE=0.4 up to 545 s on a cold machine; sweep-block at 0.4 about 140 s for
# block=64 and more than 170 s for block=128 (give each LIMIT=300); eager at its default scale about
# 250 s for MODES=full,full+eager and 240 s for zipage,zipage+eager (the graphs-off run is most of it).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$(pwd)
OUT=${OUT:-out}
SCALE=${SCALE:-1}
LIMIT=${LIMIT:-570}
SHAPE=${SHAPE:-qwen3-8b}
part=${1:?part}
name=$part${TAG:-}
dir=$OUT/$name
mkdir -p "$dir"
bench() {
  timeout "$LIMIT" python3 -m zipage.cli bench throughput --shape "$SHAPE" --scale "$SCALE" ${MAX_S:+--max-seconds "$MAX_S"} \
    "$@" --out "$dir" 2>&1 | grep -v "it/s"
}
run() {
  case "$part" in
    full8k) bench --workload reasoning-8k --modes full --hf-requests "${HF:-0}" ;;
    zipage8k) bench --workload reasoning-8k --modes "${MODES:-zipage}" --hf-requests 0 ;;
    full16k) bench --workload reasoning-16k --modes full --hf-requests 0 ;;
    zipage16k) bench --workload reasoning-16k --modes "${MODES:-zipage}" --hf-requests 0 ;;
    whole8k) bench --workload reasoning-8k --whole-gpu --num-requests 512 --max-num-seqs "${MAX_SEQS:-512}" \
        --modes zipage --hf-requests 0 ;;
    sweep-budget) bench --workload reasoning-8k --hf-requests 0 \
        --modes zipage+budget=1024,zipage,zipage+budget=4096 ;;
    sweep-block) bench --workload reasoning-8k --hf-requests 0 --modes "${MODES:-zipage+block=64,zipage+block=128}" ;;
    eager) SCALE=${EAGER_SCALE:-medium} bench --hf-requests 0 --modes "${MODES:-full,full+eager,zipage,zipage+eager}" ;;
    profile) timeout "$LIMIT" python3 -m zipage.cli bench decode --shape "$SHAPE" --batch 1,64,256 --context 1024 \
        --steps 32 --modes graphs,eager --profile-steps 8 --out "$dir/decode.json" 2>&1 | grep -v "it/s" ;;
    verify) ZIPAGE_TEST_DEVICE=cuda timeout "$LIMIT" python3 -m pytest -q -x -p no:cacheprovider \
          tests/test_generation.py tests/test_async_scheduling.py tests/test_compression_engine.py 2>&1
        timeout 150 python3 -m zipage.cli bench kernels --batch 64,256 --context 4096 --block-size 256 \
          --out "$dir/kernels.json" 2>&1 | grep -v "it/s" ;;
    compression) timeout "$LIMIT" python3 -m zipage.cli bench compression --shape "$SHAPE" \
          --requests "${REQUESTS:-1,4,16,64}" --beside "${BESIDE:-128}" --out "$dir/compression.json" 2>&1 \
          | grep -v "it/s" ;;
    hf) bench --workload reasoning-8k --num-requests 4 --modes full --hf-requests "${HF:-4}" \
        --hf-batch-size "${HF_BATCH:-1}" ;;
    train) timeout "$LIMIT" python3 -m zipage.quality.train --out "$dir" --max-minutes "${MINUTES:-9.2}" \
        --eval-reserve-s 45 ${INIT:+--init-from "$INIT"} \
        2>&1 | grep -v "it/s" ;;
    eval) declare -A flags=([keep16]="--keep-prompt --window 16" [keep32]="--keep-prompt --window 32"
          [keep16pool]="--keep-prompt --window 16 --pool-every-compression"
          [keep32pool]="--keep-prompt --window 32 --pool-every-compression" [plain16]="--window 16")
        for variant in ${EVAL:-keep16 keep16pool keep32pool plain16}; do
          timeout "$LIMIT" python3 -m zipage.cli eval synthetic --model checkpoints/ledger-14m --num-problems 200 \
            --budgets 0.125,0.25,0.375,0.5,0.75,0.875 --out "$dir/$variant" ${flags[$variant]} 2>&1 | grep -v "it/s"
        done ;;
    tp-test) ZIPAGE_TEST_DEVICE=cuda timeout "$LIMIT" python3 -m pytest -q -x -p no:cacheprovider \
        tests/test_tensor_parallel.py 2>&1 ;;
    tp-bench) bench --workload reasoning-8k --modes full,zipage --hf-requests 0 \
        --tensor-parallel-size "${TP:-2}" ;;
    serve) budget=(); [ "${MODE:-zipage}" = zipage ] && budget=(--kv-budget-tokens 512)
        timeout "$LIMIT" python3 -m zipage.cli bench serve --shape "$SHAPE" \
          --kv-cache-memory-bytes "${KV_BYTES:-12000000000}" "${budget[@]}" --rates "${RATES:-2,8,inf}" --num-requests "${NREQ:-64}" \
          --input-len 256 --output-len 2048 --out "$dir" 2>&1 | grep -v "it/s" ;;
    *) echo "unknown part $part" >&2; return 2 ;;
  esac
}
run | tee "$dir/log.txt"
code=${PIPESTATUS[0]}
tar czf "$OUT/$name.tgz" -C "$OUT" "$name" && rm -rf "$dir"
if [ "$(stat -c %s "$OUT/$name.tgz")" -gt 15000000 ]; then
  split -b 15000000 "$OUT/$name.tgz" "$OUT/$name.tgz.part-" && rm "$OUT/$name.tgz"
fi
exit "$code"
