#!/usr/bin/env bash
# Create .venv (if missing) and install lightning_hpp with the extras the demo and the tests use.
# On a machine without a CUDA GPU the CPU build of torch is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  python -m pip install -q "torch==2.13.0"
else
  # a local CPU wheel if the machine has one, else PyTorch's CPU index (never the multi-GB CUDA build)
  python -m pip install -q --no-index "torch==2.13.0" 2>/dev/null \
    || python -m pip install -q "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
fi
python -m pip install -q -e ".[dev,examples,s3,hydra,bench]"
