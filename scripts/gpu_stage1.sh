#!/usr/bin/env bash
# GPU validation of the compressed engine: engine tests on CUDA (sync and async compression,
# decode and compression graphs, fused kernels), then a medium-scale throughput run.
# Usage: OUT=results-dir bash scripts/gpu_stage1.sh [modes]
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$(pwd)
OUT=${OUT:-out}
MODES=${1:-full,zipage,zipage+sync}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
ZIPAGE_TEST_DEVICE=cuda timeout 240 python3 -m pytest tests/test_generation.py tests/test_api.py \
    tests/test_compression_engine.py -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -8
timeout 240 python3 -m zipage.cli bench throughput --scale medium --asynchronous --modes "$MODES" \
    --hf-requests 0 --out "$OUT/medium" 2>&1 | tee "$OUT/medium.log" | grep -v "it/s" | tail -12
