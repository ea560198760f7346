#!/usr/bin/env bash
# The LoRA GPU round, in two stages that each fit one 10-minute device call.
# Usage (repository root, GPU machine):  bash benchmarks/gpu_lora.sh [check|bench|quant|gluon] [MODEL ...]
#   check: CUDA LoRA and NF4 tests; with ALL=1 also the rest of tests/cuda and verify --lora (PEFT parity,
#          27 architectures)
#   bench: moeyard bench --lora 16 at MODEL... (default: the four LoRA shapes); with ALL=1 also the per-kernel
#          profile, the split/fused crossover and a no-LoRA triton check
#   gluon: the CUDA LoRA tests, then the Gluon LoRA down projection against the Triton one
#          (MOEYARD_TRITON_GLUON_DOWN=1/0): the LoRA step's kernels in launch order, then frozen vs lora steps
#          interleaved, at MODEL (default qwen3-30b-a3b)
#   kernels: the CUDA LoRA tests, then benchmarks/lora_kernels.py (the TMA down projections, Triton and Gluon,
#          with and without LoRA; B's backward in one pass or two; lora_B's relayout) at qwen3-30b-a3b, olmoe-1b-7b
#          and mixtral-8x7b, then the LoRA step's kernels in launch order at MODEL (default qwen3-30b-a3b)
#   quant: CUDA QLoRA, NF4 and FP8-checkpoint tests (QUANT_TESTS=0 skips them; the LoRA ones are in check), benchmarks/nf4_dequant.py at MODEL, then
#          moeyard bench --quant nf4 --lora 16 (4-layer stacks) at MODEL... (default qwen3-30b-a3b); with BASE (a
#          carried folder holding an earlier src/) the bench runs from that tree too, after this one; QUANT_RECIPES
#          (e.g. fp8_rowwise_gw_hp) adds the stacks with the base GEMMs under those FP8 recipes (lora+R, qlora+R);
#          bitsandbytes comes from the wheel in .bnb (carried)
# Full logs go to $OUT (default ./out); short summaries are printed last.
set -uo pipefail
STAGE=${1:-check}; shift
margs=(); for m in "$@"; do margs+=(--model "$m"); done
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt"
summary=()
step() {  # step NAME SECONDS CMD...: run with a time limit, log to $OUT/NAME.txt
  local name=$1 secs=$2; shift 2
  timeout "$secs" "$@" > "$OUT/$name.txt" 2>&1
  summary+=("$name rc=$? ($(tail -n 1 "$OUT/$name.txt" | cut -c1-150))")
}
if [[ $STAGE == check ]]; then
  export MOEYARD_TRITON_AUTOTUNE=0  # one tile config: the tests check results, not speed
  step pytest_lora 200 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_lora_cuda.py tests/test_nf4.py
  [[ -n ${ALL:-} ]] && step pytest_cuda 200 python3 -m pytest -q -p no:cacheprovider tests/cuda \
    --deselect tests/cuda/test_lora_cuda.py
  [[ -n ${ALL:-} ]] && step verify_lora 150 python3 -m moeyard verify --device cuda --lora 8 --fuse-lora
elif [[ $STAGE == gluon ]]; then
  (( ${#margs[@]} )) || margs=(--model qwen3-30b-a3b)
  MOEYARD_TRITON_AUTOTUNE=0 step pytest_lora 200 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_lora_cuda.py
  for g in 1 0; do
    MOEYARD_TRITON_GLUON_DOWN=$g step "profile_g$g" 120 python3 benchmarks/lora_profile.py --sequence "${margs[@]:0:2}"
  done
  for run in 1 2; do for g in 1 0; do
    MOEYARD_TRITON_GLUON_DOWN=$g step "bench_g${g}_$run" 150 python3 -m moeyard bench --lora 16 --warmup 3 --iters 10 \
      --backends frozen,lora "${margs[@]}"
  done; done
elif [[ $STAGE == kernels ]]; then
  (( ${#margs[@]} )) || margs=(--model qwen3-30b-a3b)
  MOEYARD_TRITON_AUTOTUNE=0 step pytest_lora 200 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_lora_cuda.py
  step kernels 240 python3 benchmarks/lora_kernels.py
  step profile 100 python3 benchmarks/lora_profile.py --sequence "${margs[@]:0:2}"
elif [[ $STAGE == quant ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .bnb/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
  (( ${#margs[@]} )) || margs=(--model qwen3-30b-a3b)
  [[ ${QUANT_TESTS:-1} == 1 ]] && MOEYARD_TRITON_AUTOTUNE=0 step pytest_quant 240 python3 -m pytest -q \
    -p no:cacheprovider tests/cuda/test_qlora_cuda.py tests/test_nf4.py tests/cuda/test_fp8_checkpoint_cuda.py
  step dequant_nf4 120 python3 benchmarks/nf4_dequant.py --variants "${margs[@]}"
  step bench_quant 300 python3 -m moeyard bench --quant nf4 --lora 16 --warmup 3 --iters 10 \
    "${margs[@]}" ${QUANT_RECIPES:+--recipe "none,$QUANT_RECIPES"} --json "$OUT/bench_quant.json"
  [[ -n ${BASE:-} ]] && step bench_quant_base 300 env PYTHONPATH="$BASE/src:/tmp/site" python3 -m moeyard bench \
    --quant nf4 --lora 16 --warmup 3 --iters 10 "${margs[@]}" --json "$OUT/bench_quant_base.json"
else
  step bench_lora 500 python3 -m moeyard bench --lora 16 --warmup 3 --iters 10 --json "$OUT/bench_lora.json" \
    "${margs[@]}"
  [[ -n ${ALL:-} ]] && step profile 120 python3 benchmarks/lora_profile.py --modes split fused
  [[ -n ${ALL:-} ]] && step crossover 200 python3 benchmarks/lora_crossover.py --json "$OUT/crossover.json"
  [[ -n ${ALL:-} ]] && step bench_triton 60 python3 -m moeyard bench --routed-only --model qwen3-30b-a3b --backends triton,torch_gmm \
    --warmup 5 --iters 20
fi
for f in "$OUT"/verify_lora.txt "$OUT"/dequant_*.txt "$OUT"/bench_*.txt "$OUT"/profile*.txt "$OUT"/crossover.txt "$OUT"/kernels.txt; do [ -f "$f" ] && { echo "== $f"; tail -n 40 "$f"; }; done
for f in "$OUT"/pytest_*.txt; do [ -f "$f" ] && { echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed|Error" "$f" | tail -n 20; }; done
cat "$OUT/gpu.txt"; printf '%s\n' "${summary[@]}"
