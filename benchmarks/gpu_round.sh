#!/usr/bin/env bash
# One GPU round, time-boxed to fit one 10-minute device call: `moeyard verify` on the GPU, `moeyard bench`
# at qwen3-30b-a3b with 16384 tokens for every backend (+ the torch grouped_mm pipeline), the CUDA tests,
# and (stage "peers", a separate call: SonicMoE compiles for minutes on a fresh machine) the SonicMoE shapes.
# Usage (repository root, GPU machine):  bash benchmarks/gpu_round.sh [main|profile|peers]
#   profile: the triton backend's per-kernel profile with A/B of its options (benchmarks/triton_profile.py).
# Full logs go to $OUT (default ./out); short summaries are printed last.
set -uo pipefail
STAGE=${1:-main}
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
[[ $STAGE == peers && -f .peers/install.sh ]] && source .peers/install.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt"
python3 -m moeyard info > "$OUT/info.txt" 2>&1
summary=()
step() {  # step NAME SECONDS CMD...: run with a time limit, log to $OUT/NAME.txt
  local name=$1 secs=$2; shift 2
  timeout "$secs" "$@" > "$OUT/$name.txt" 2>&1
  summary+=("$name rc=$? ($(tail -n 1 "$OUT/$name.txt" | cut -c1-150))")
}
if [[ $STAGE == main ]]; then
  MOEYARD_TRITON_AUTOTUNE=0 step verify 120 python3 -m moeyard verify --device cuda
  step bench_16k 240 python3 -m moeyard bench --model qwen3-30b-a3b --tokens 16384 --warmup 3 --iters 10 \
    --backends loop,bmm_padded,grouped_mm,triton,torch_gmm --json "$OUT/bench_16k.json"
  MOEYARD_TRITON_AUTOTUNE=0 step pytest_cuda 170 python3 -m pytest -q -p no:cacheprovider tests/cuda
elif [[ $STAGE == profile ]]; then
  step profile_qwen 280 python3 benchmarks/triton_profile.py --configs qwen3-30b-a3b --variants --out "$OUT"
  step profile_sonic 200 python3 benchmarks/triton_profile.py --configs sonic-7b --variants --out "$OUT"
else
  for routing in random zipf; do
    step "bench_peers_$routing" 280 python3 -m moeyard bench --model qwen3-30b-a3b --model sonic-7b --routing $routing \
      --backends triton,grouped_mm --json "$OUT/bench_peers_$routing.json"
  done
fi
for f in "$OUT"/verify.txt "$OUT"/bench_*.txt "$OUT"/profile_*.txt; do [ -f "$f" ] && { echo "== $f"; tail -n 36 "$f"; }; done
[ -f "$OUT/pytest_cuda.txt" ] && grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_cuda.txt" | tail -n 25
cat "$OUT/gpu.txt"; printf '%s\n' "${summary[@]}"
