#!/usr/bin/env bash
# Create .venv (if missing) and install zipage with its test tools and the Ray extra into it.
# torch is pinned and installed first: a plain `torch` requirement would pull a
# multi-GB CUDA build where a CPU build is wanted.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==${TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install --quiet -e ".[test,ray]"
