#!/usr/bin/env bash
# The placement grid in one command: MLP and LM x two equal cores and the cgroup pair x 2 and 4 ranks,
# each cell with plan="auto", the hand-balanced plan of every schedule family at few and many
# micro-batches, DDP and FSDP2, side by side in one invocation of cgroup_bench.py per cell.
#
#   bash benchmarks/placement/grid.sh [out_dir] [extra cgroup_bench.py options...]
#
# Writes <out_dir>/<cell>/results.{md,json} and <out_dir>/<cell>.log (default runs/grid) and prints every cell's ratios at the end.
# The cgroup cells need root and a cgroup-v1 cpu controller (see CGROUP.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-runs/grid}
shift || true
mkdir -p "$out"
py=${PYTHON:-python}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && py=.venv/bin/python
configs="auto hand hand-gpipe hand-interleaved1f1b hand-interleaved_zb hand-zbv hand-dualpipev ddp fsdp"
cells=()
for ranks in 2 4; do
  for model in mlp lm; do
    for pair in equal cgroup; do
      cell="${model}_${pair}_${ranks}ranks"
      flags=(--ranks "$ranks" --model "$model" --rounds 1 --steps 10 --hand-m 4 12 --configs $configs)
      [ "$pair" = equal ] && flags+=(--equal)
      echo "== $cell" >&2
      "$py" benchmarks/placement/cgroup_bench.py "${flags[@]}" "$@" --out "$out/$cell" > "$out/$cell.log" 2>&1 \
        || { echo "$cell failed: see $out/$cell.log" >&2; exit 1; }
      cells+=("$cell")
    done
  done
done
for cell in "${cells[@]}"; do
  echo "## $cell"
  grep -E '^auto (÷|measured)' "$out/$cell/results.md" || true
done
