#!/usr/bin/env bash
# Set up, then run the whole test suite (CPU; GPU tests skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec python -m pytest -q -p no:cacheprovider --timeout=600 "$@"
