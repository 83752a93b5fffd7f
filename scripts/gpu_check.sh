#!/usr/bin/env bash
# The GPU check of the engine core, in one device call: engine tests on CUDA,
# kernel correctness and bandwidth, decode throughput of a Qwen3-8B shape.
# Usage: OUT=results-dir bash scripts/gpu_check.sh [quick]
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$(pwd)
OUT=${OUT:-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
ZIPAGE_TEST_DEVICE=cuda python3 -m pytest tests/test_generation.py tests/test_api.py -q -x -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
python3 -m zipage.cli bench kernels --out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log" | tail -25
python3 -m zipage.cli bench decode --shape qwen3-8b --batch 1,64,256 --context 1024 --steps 64 \
    --out "$OUT/decode.json" 2>&1 | tee "$OUT/decode.log" | grep -v "it/s" | tail -12
