#!/usr/bin/env bash
# Set up, then run the main job: the hybrid vision model in 3 pipeline stages on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec python examples/hybrid_vision/train.py "$@"
