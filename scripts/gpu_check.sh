#!/usr/bin/env bash
# The checks that need a GPU, in one run of at most 8 minutes on one H100/H200:
#   1. the GPU-marked tests (fp8 through Transformer Engine against bf16, the emulation on CUDA,
#      device kinds, fingerprints, profiles, configs),
#   2. benchmarks/precision/fp8_stage.py: Transformer Engine fp8 numerics against bf16 and the
#      step time of one fp8 stage against the same stage in bf16 at hidden 4096 (goal >= 1.3x).
# Everything lands under $OUT (default runs/gpu_check): env.txt, gpu_tests.{txt,xml},
# fp8_stage.{json,md} (and fp8_stage_current.* for current scaling), summary.txt.
#
#   OUT=/tmp/gpu bash scripts/gpu_check.sh          # on the GPU machine
#   bash scripts/gpu_check.sh --cpu-only            # its CPU-runnable parts: collection, the
#                                                   # benchmark on CPU with the fp8 emulation
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
: >"$OUT/summary.txt"
note() { echo "$*" | tee -a "$OUT/summary.txt"; }
part() {  # part NAME SECONDS CMD...: run CMD under a time limit, log to $OUT/NAME.txt, note the outcome
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS rc
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.txt" 2>&1
  rc=$?
  if [ $rc -eq 0 ]; then note "PASS  $name ($((SECONDS - t0)) s)"; else note "FAIL  $name (exit $rc, $((SECONDS - t0)) s; see $name.txt)"; STATUS=1; fi
}

{
  date -u
  "$PY" -c "import torch, lightning; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'lightning', lightning.__version__)"
  "$PY" -c "import transformer_engine as te; print('transformer_engine', getattr(te, '__version__', '?'))" 2>&1 | tail -1
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv
} >"$OUT/env.txt" 2>&1

GPU_TESTS=(tests/test_fp8_gpu.py tests/test_devices.py tests/test_profile.py tests/test_bias_fingerprint.py tests/test_configs.py)

if [ "$CPU_ONLY" = 1 ]; then
  note "cpu-only: the GPU parts are skipped"
  # the GPU tests are collected (imports, markers); they skip without CUDA
  part gpu_tests_collect 120 "$PY" -m pytest -q -p no:cacheprovider -m gpu --collect-only "${GPU_TESTS[@]}"
  part fp8_stage_cpu 180 "$PY" benchmarks/precision/fp8_stage.py --device cpu --backend emulate --hidden 128 \
    --blocks 1 --tokens 256 --warmup 2 --steps 3 --out "$OUT"
  exit $STATUS
fi

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  note "FAIL  no CUDA device visible to torch (see env.txt); use --cpu-only on a machine without a GPU"
  exit 1
fi

# 1. GPU-marked tests (~1-2 min): they fail, not skip, where a GPU is there but a part is missing
part gpu_tests 200 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs --junitxml="$OUT/gpu_tests.xml" "${GPU_TESTS[@]}"

# 2. one fp8 stage against a bf16 stage (~1 min each): delayed scaling, then current scaling
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
        print(f"fp8 stage ({name} scaling): bf16/fp8 step time {r['bf16_over_fp8']:.2f} ({goal} the 1.3 goal), "
              f"numerics {'ok' if r['numerics_ok'] else 'OUT OF BOUNDS'}: {r['numerics']}")
EOF
else
  note "FAIL  transformer_engine is not installed: the fp8 stage benchmark needs it (pip install transformer_engine[pytorch])"
  STATUS=1
fi
exit $STATUS
