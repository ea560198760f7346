#!/usr/bin/env bash
# One GPU round: CUDA tests, `moeyard verify` on the GPU, and `moeyard bench` with the peers.
# Usage (repository root, GPU machine):  bash benchmarks/gpu_round.sh [tests|bench|peers|all]
#   tests: CUDA test modules + verify;  bench: qwen3-30b-a3b at 16384 tokens, every backend + torch_gmm;
#   peers: the SonicMoE comparison shapes (needs .peers/ from shared/peers/fetch_sonicmoe.sh).
# Full logs go to $OUT (default ./out); short summaries are printed last.
set -uo pipefail
STAGE=${1:-all}
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
[ -f .peers/install.sh ] && source .peers/install.sh
python3 -c "import rich" 2>/dev/null || { python3 -m pip install -q --no-index --no-deps --target /tmp/rs .whl/*.whl \
  && export PYTHONPATH="/tmp/rs:$PYTHONPATH"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m moeyard info > "$OUT/info.txt" 2>&1
summary=()
if [[ $STAGE == tests || $STAGE == all ]]; then
  python3 -m pytest -q -p no:cacheprovider tests/cuda > "$OUT/pytest_cuda.txt" 2>&1
  summary+=("pytest tests/cuda rc=$?: $(tail -n 1 "$OUT/pytest_cuda.txt")")
  python3 -m moeyard verify --device cuda > "$OUT/verify.txt" 2>&1
  summary+=("verify cuda float32 rc=$?")
  python3 -m moeyard verify --device cuda --dtype bfloat16 > "$OUT/verify_bf16.txt" 2>&1
  summary+=("verify cuda bfloat16 rc=$?")
fi
if [[ $STAGE == bench || $STAGE == all ]]; then
  python3 -m moeyard bench --model qwen3-30b-a3b --tokens 16384 --no-peers --backends loop,bmm_padded,grouped_mm,triton,torch_gmm \
    --json "$OUT/bench_16k.json" > "$OUT/bench_16k.txt" 2>&1
  summary+=("bench 16k rc=$?")
fi
if [[ $STAGE == peers || $STAGE == all ]]; then
  for routing in random zipf; do
    python3 -m moeyard bench --model qwen3-30b-a3b --model sonic-7b --routing $routing --backends triton,grouped_mm \
      --json "$OUT/bench_peers_$routing.json" > "$OUT/bench_peers_$routing.txt" 2>&1
    summary+=("bench peers $routing rc=$?")
  done
fi
for f in verify.txt verify_bf16.txt bench_16k.txt bench_peers_random.txt bench_peers_zipf.txt; do
  [ -f "$OUT/$f" ] && { echo "== $f"; tail -n 40 "$OUT/$f"; }
done
cat "$OUT/gpu.txt"; printf '%s\n' "${summary[@]}"
