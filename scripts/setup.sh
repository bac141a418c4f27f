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
pip_q() { python -m pip install -qq --disable-pip-version-check "$@"; }
if python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  :  # torch 2.13.0 already there
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  pip_q "torch==2.13.0"
elif pip_q --no-index --no-deps "torch==2.13.0" 2>/dev/null; then
  # a local CPU wheel (pip's find-links): torch itself from it, its dependencies from the ordinary index
  pip_q "torch==2.13.0"
else
  # no local wheel: PyTorch's CPU index (never the multi-GB CUDA build)
  pip_q "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple
fi
# a .venv made before the sweeps moved to Optuna >= 4 has hydra-optuna-sweeper (it pins optuna < 3, and
# Hydra would still import its plugin): the study sweeper replaces it
if python -m pip show -qq hydra-optuna-sweeper >/dev/null 2>&1; then
  python -m pip uninstall -qq -y hydra-optuna-sweeper
fi
pip_q -e ".[dev,examples,s3,hydra,bench]"
