#!/usr/bin/env bash
# The FP8 GPU round in one device call (Hopper): CUDA tests of the recipes' fast path, the benchmark at the
# ANCHORS shapes (bf16 and fp8_rowwise rows of moeyard next to the torch pipeline and torchao's FP8 path),
# the kernels of one FP8 step, and the SQNR tables at a real shape.
# Usage (repository root, GPU machine):  bash benchmarks/gpu_fp8.sh [MODEL ...]
#   torchao comes from the wheel in .whl (carried; pip download --no-deps torchao) when present.
#   FP8_STEPS (default "test bench profile numerics") picks the steps; FP8_BENCH_ARGS adds bench flags.
# Full logs go to $OUT (default ./out); short summaries are printed last.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if compgen -G ".whl/torchao-*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/torchao-*.whl \
    && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
margs=(); for m in "$@"; do margs+=(--model "$m"); done
STEPS=${FP8_STEPS:-test bench profile numerics}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt"
summary=()
step() {  # step NAME SECONDS CMD...: run with a time limit, log to $OUT/NAME.txt
  local name=$1 secs=$2; shift 2
  timeout "$secs" "$@" > "$OUT/$name.txt" 2>&1
  summary+=("$name rc=$? ($(tail -n 1 "$OUT/$name.txt" | cut -c1-150))")
}
for s in $STEPS; do case $s in
  test) step pytest_fp8 170 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_fp8_cuda.py ;;
  bench) step bench_fp8 330 python3 -m moeyard bench --recipe none,fp8_rowwise \
           --backends triton,grouped_mm,torch_gmm,torchao_fp8 --warmup 3 --iters 10 --json "$OUT/bench_fp8.json" \
           "${margs[@]}" ${FP8_BENCH_ARGS:-} ;;
  profile) step profile_fp8 120 python3 benchmarks/fp8_profile.py --model qwen3-30b-a3b --model sonic-120b \
             --recipes none,fp8_rowwise --casts ;;
  numerics) step numerics_random 60 python3 benchmarks/fp8_numerics.py --tokens 4096 --json "$OUT/numerics.json"
            step numerics_torchao 40 python3 benchmarks/fp8_numerics.py --tokens 4096 --protocol torchao ;;
esac; done
for f in "$OUT"/bench_*.txt "$OUT"/profile*.txt "$OUT"/numerics*.txt; do [ -f "$f" ] && { echo "== $f"; tail -n 60 "$f"; }; done
for f in "$OUT"/pytest_*.txt; do [ -f "$f" ] && { echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed|Error" "$f" | tail -n 20; }; done
cat "$OUT/gpu.txt"; printf '%s\n' "${summary[@]}"
