#!/usr/bin/env bash
# The checks that need a GPU, in one run of at most 8 minutes on one H100/H200:
#   1. the GPU-marked tests (fp8 through Transformer Engine against bf16, the emulation on CUDA,
#      device kinds, fingerprints, profiles, configs), then tests/test_cluster_gpu.py: the fp8 verdict from
#      the real device's report beside a simulated A100, NCCL's abort after a first error, the stages on the
#      GPU at a second entry point, the start-up broadcast's one bucket on the GPU, CUDA-event timing,
#   2. benchmarks/precision/two_stage.py: a 2-stage transformers Llama in bf16 on the one GPU (both stages
#      in one rank, an interleaved schedule) against Lightning's own strategy, and the device-placement
#      harness (tests/device_harness.py) with its stages on the GPU,
#   3. benchmarks/precision/fp8_stage.py: Transformer Engine fp8 numerics against bf16 and the
#      step time of one fp8 stage against the same stage in bf16 at hidden 4096 (goal >= 1.3x).
# Everything lands under $OUT (default runs/gpu_check): env.txt, gpu_tests.{txt,xml}, two_stage.json,
# fp8_stage.{json,md} (and fp8_stage_current.* for current scaling), summary.txt: one table of every part.
#
#   OUT=/tmp/gpu bash scripts/gpu_check.sh          # on the GPU machine
#   bash scripts/gpu_check.sh --cpu-only            # its CPU-runnable parts: collection, the placement
#                                                   # harness on the meta device, the 2-stage check and
#                                                   # the fp8 benchmark on CPU (fp8 emulated)
# Exit status: 0 when every part that ran passed, 1 otherwise (each part still runs).
set -uo pipefail
cd "$(dirname "$0")/.."

CPU_ONLY=0
for arg in "$@"; do
  case "$arg" in
    --cpu-only) CPU_ONLY=1 ;;
    *) echo "usage: $0 [--cpu-only]" >&2; exit 2 ;;
  esac
done
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
STATUS=0
printf '| part | result |\n|---|---|\n' | tee "$OUT/summary.txt"
note() { echo "$*" | tee -a "$OUT/summary.txt"; }
DEADLINE=$((SECONDS + 470))  # every part together: at most 8 minutes, whatever each part's own limit
part() {  # part NAME SECONDS CMD...: run CMD under a time limit, log to $OUT/NAME.txt, note the outcome
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS rc
  if [ $((DEADLINE - SECONDS)) -lt "$limit" ]; then limit=$((DEADLINE - SECONDS)); fi
  if [ "$limit" -le 0 ]; then note "| $name | FAIL (no time left of the 8 minutes) |"; STATUS=1; return; fi
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.txt" 2>&1
  rc=$?
  if [ $rc -eq 0 ]; then note "| $name | PASS ($((SECONDS - t0)) s) |"; else note "| $name | FAIL (exit $rc, $((SECONDS - t0)) s; see $name.txt) |"; STATUS=1; fi
  grep -h '^| ' "$OUT/$name.txt" | grep -v -e '^| check |' -e '^|---' | tee -a "$OUT/summary.txt" || true
}

{
  date -u
  "$PY" -c "import torch, lightning; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'lightning', lightning.__version__)"
  "$PY" -c "import transformer_engine as te; print('transformer_engine', getattr(te, '__version__', '?'))" 2>&1 | tail -1
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv
} >"$OUT/env.txt" 2>&1

GPU_TESTS=(tests/test_fp8_gpu.py tests/test_fp8_state.py tests/test_devices.py tests/test_profile.py tests/test_bias_fingerprint.py tests/test_configs.py)
CLUSTER_TESTS=(tests/test_cluster_gpu.py)

if [ "$CPU_ONLY" = 1 ]; then
  note "| cpu-only | the GPU parts are skipped |"
  # the GPU tests are collected (imports, markers); they skip without CUDA
  part gpu_tests_collect 120 "$PY" -m pytest -q -p no:cacheprovider -m gpu --collect-only "${GPU_TESTS[@]}" \
    "${CLUSTER_TESTS[@]}"
  part placement_meta 180 "$PY" -m pytest -q -p no:cacheprovider tests/test_device_placement.py
  part two_stage_cpu 300 "$PY" benchmarks/precision/two_stage.py --device cpu --precision bf16-true --out "$OUT"
  part fp8_stage_cpu 180 "$PY" benchmarks/precision/fp8_stage.py --device cpu --backend emulate --hidden 128 \
    --blocks 1 --tokens 256 --warmup 2 --steps 3 --out "$OUT"
  exit $STATUS
fi

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  note "| cuda | FAIL: no CUDA device visible to torch (see env.txt); use --cpu-only on a machine without a GPU |"
  exit 1
fi

# 1. GPU-marked tests (~1-2 min), then the cluster checks (~1 min): they fail, not skip, where a GPU is there but a
#    part is missing
part gpu_tests 150 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs --junitxml="$OUT/gpu_tests.xml" "${GPU_TESTS[@]}"
part cluster_gpu 90 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs --junitxml="$OUT/cluster_gpu.xml" \
  "${CLUSTER_TESTS[@]}"

# 2. a 2-stage Llama in bf16 on the GPU against one process, and the placement harness on the GPU (~1 min)
part two_stage 120 "$PY" benchmarks/precision/two_stage.py --device cuda --precision bf16-true --out "$OUT"

# 3. one fp8 stage against a bf16 stage (~1 min each): delayed scaling, then current scaling
if "$PY" -c "import transformer_engine" 2>/dev/null; then
  part fp8_stage 120 "$PY" benchmarks/precision/fp8_stage.py --hidden 4096 --blocks 2 --tokens 8192 --out "$OUT"
  part fp8_stage_current 90 "$PY" benchmarks/precision/fp8_stage.py --hidden 4096 --blocks 2 --tokens 8192 \
    --recipe current --out "$OUT/current"
  "$PY" - "$OUT" <<'EOF' | tee -a "$OUT/summary.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for name, path in (("delayed", out / "fp8_stage.json"), ("current", out / "current" / "fp8_stage.json")):
    if path.exists():
        r = json.loads(path.read_text())
        goal = "meets" if r["bf16_over_fp8"] >= 1.3 else "BELOW"
        print(f"| fp8 stage ({name} scaling) | bf16/fp8 step time {r['bf16_over_fp8']:.2f} ({goal} the 1.3 goal), "
              f"numerics {'ok' if r['numerics_ok'] else 'OUT OF BOUNDS'}: {r['numerics']} |")
EOF
else
  note "| fp8_stage | FAIL: transformer_engine is not installed: the fp8 stage benchmark needs it (pip install transformer_engine[pytorch]) |"
  STATUS=1
fi
exit $STATUS
