#!/usr/bin/env bash
# The FP8 GPU round in one device call (Hopper): CUDA tests of the recipes' fast path, the benchmark at the
# ANCHORS shapes (bf16 and fp8_rowwise rows of moeyard next to the torch pipeline and torchao's FP8 path),
# the kernels of one FP8 step, and the SQNR tables at a real shape.
# Usage (repository root, GPU machine):  bash benchmarks/gpu_fp8.sh [MODEL ...]
#   torchao comes from the wheel in .whl (carried; pip download --no-deps torchao) when present.
#   FP8_STEPS (default "test bench profile numerics") picks the steps; FP8_BENCH_ARGS adds bench flags,
#   FP8_RECIPES and FP8_BACKENDS set the bench's rows, FP8_PROFILE_ARGS the profile's arguments; also "e2e"
#   (a training step, tokens/s per recipe), "accum" (the same with 1 and 4 micro-batches per optimizer step)
#   and "ep" (two GPUs: bench --ep 2 with FP8 dispatch beside bf16 dispatch, FP8_EP_RECIPE's experts);
#   also "ckpt" (FP8 checkpoint storage: CUDA tests, the dequantisation kernel's rates) and "train"
#   (examples/fp8_train.py, the small model, 300 steps: loss curves of bf16 seeds and each recipe); "casts"
#   (benchmarks/fp8_cast_probe.py: the expert weights' FP8 casts alone at the anchor shapes); "wgrad"
#   (the Gluon FP8 weight gradient's CUDA tests, then benchmarks/fp8_wgrad_probe.py: the FP8 weight gradients and
#   their column casts alone, CUTLASS, Triton and Gluon against bf16); "memory"
#   (benchmarks/memory_peak.py: what is alive at the peak of one step, FP8_MEMORY_ARGS its arguments); "probe"
#   (benchmarks/fp8_gemm_probe.py, FP8_PROBE_ARGS its arguments: each FP8 GEMM alone); "ab" (this tree against
#   BASE, an earlier src/ in a carried git-ignored folder: the bench's bf16 and gw_hp rows, trees interleaved,
#   FP8_AB_RUNS times each, FP8_BENCH_ARGS added; benchmarks/ab_table.py prints each run and the medians' difference);
#   "hostab" (the same trees through benchmarks/host_time.py: host, device and step ms of the forward and the
#   forward + backward, bf16 and the FP8 recipes, FP8_HOST_ARGS its shape arguments, FP8_HOST_BACKENDS its rows);
#   "lora" (LoRA on an FP8 base: the FP8 GEMMs' low-rank term and the fused LoRA layer's CUDA tests, then the LoRA
#   bench, bf16 and FP8 base, frozen and LoRA rows, at the given models (default the three LoRA shapes), with
#   FP8_LORA_ACCUM micro-batches per cast block, default "1 8"); "graphs" (the bench's bf16 and gw_hp rows with
#   --cuda-graph: each step captured in a CUDA graph, the replays timed, no host launch work); "host"
#   (benchmarks/host_profile.py, FP8_HOST_ARGS its arguments: the host time of a step and where it goes).
# Full logs go to $OUT (default ./out); short summaries are printed last.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -d /tmp/site/torchao ]; then
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
elif compgen -G ".whl/torchao-*.whl" > /dev/null; then
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
  test) step pytest_fp8 150 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_fp8_cuda.py ;;
  bench) step bench_fp8 300 python3 -m moeyard bench --recipe "${FP8_RECIPES:-none,fp8_rowwise,fp8_rowwise_gw_hp}" \
           --backends "${FP8_BACKENDS:-triton,torchao_fp8}" --warmup 3 --iters 10 --json "$OUT/bench_fp8.json" \
           "${margs[@]}" ${FP8_BENCH_ARGS:-} ;;
  e2e) step e2e_fp8 130 python3 -m moeyard bench --e2e --model qwen3-30b-a3b \
         --recipe "${FP8_RECIPES:-none,fp8_rowwise,fp8_rowwise_gw_hp}" --warmup 3 --iters 10 ;;
  accum) for m in 1 4; do  # gradient accumulation: FP8 weights cast once per optimizer step (cache_fp8_weights)
           step "e2e_accum$m" 200 python3 -m moeyard bench --e2e --model qwen3-30b-a3b --grad-accum "$m" \
             --recipe "${FP8_RECIPES:-none,fp8_rowwise_gw_hp}" --warmup 2 --iters 5 --json "$OUT/e2e_accum$m.json"
         done ;;
  ep) step ep_fp8 240 torchrun --standalone --nproc-per-node 2 -m moeyard bench --ep 2 --model qwen3-30b-a3b \
        --routing balanced --fp8-dispatch --recipe "${FP8_EP_RECIPE:-fp8_rowwise}" --warmup 3 --iters 10 \
        --json "$OUT/ep_fp8.json" ;;
  profile) step profile_fp8 120 python3 benchmarks/fp8_profile.py \
             ${FP8_PROFILE_ARGS:---model qwen3-30b-a3b --model sonic-120b --recipes none,fp8_rowwise,fp8_rowwise_gw_hp --casts} ;;
  host) step host_fp8 200 python3 benchmarks/host_profile.py ${FP8_HOST_ARGS:---model sonic-7b --tokens 256 --top 60} ;;
  casts) step casts_fp8 120 python3 benchmarks/fp8_cast_probe.py ;;
  wgrad) step pytest_wgrad 240 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_fp8_cuda.py \
          -k "gluon_fp8_wgrad or gluon_wgrad"
         step wgrad_fp8 300 python3 benchmarks/fp8_wgrad_probe.py --cast-blocks 128x64x4 "${margs[@]}" ;;
  probe) step probe_fp8 330 python3 benchmarks/fp8_gemm_probe.py ${FP8_PROBE_ARGS:-} ;;
  ab) for r in ${FP8_AB_RUNS:-1}; do for tree in this base; do
        src=$PWD/src; [ $tree = base ] && src=${BASE:?BASE: a folder holding src/}/src
        step "ab_${tree}_$r" 200 env PYTHONPATH="$src:${PYTHONPATH#*:}" python3 -m moeyard bench \
          --recipe "${FP8_RECIPES:-none,fp8_rowwise_gw_hp}" --backends triton --warmup 3 --iters 10 \
          --json "$OUT/ab_${tree}_$r.json" "${margs[@]}" ${FP8_BENCH_ARGS:-}
      done; done
      step ab_table 20 python3 benchmarks/ab_table.py "$OUT" ;;
  hostab) for r in ${FP8_AB_RUNS:-1}; do for tree in this base; do
            src=$PWD/src; [ $tree = base ] && src=${BASE:?BASE: a folder holding src/}/src
            step "host_${tree}_$r" 150 env PYTHONPATH="$src:${PYTHONPATH#*:}" python3 benchmarks/host_time.py \
              ${FP8_HOST_ARGS:---models sonic-7b --tokens 256,24576 --steps fwd,fwdbwd} \
              --backends "${FP8_HOST_BACKENDS:-triton,triton+fp8_rowwise_gw_hp,triton+fp8_rowwise}"
          done; done ;;
  lora) step pytest_lora 300 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_grouped.py \
          tests/cuda/test_fp8_cuda.py
        lmodels=("${margs[@]}"); [ ${#lmodels[@]} -eq 0 ] && lmodels=(--model qwen3-30b-a3b --model qwen3.5-35b-a3b --model olmoe-1b-7b)
        for m in ${FP8_LORA_ACCUM:-1 8}; do
          step "bench_lora$m" 300 python3 -m moeyard bench --lora 16 --recipe "${FP8_RECIPES:-fp8_rowwise_gw_hp}" \
            --backends frozen,lora --grad-accum "$m" --warmup 2 --iters 6 --json "$OUT/bench_lora$m.json" "${lmodels[@]}"
        done ;;
  graphs) step bench_graphs 300 python3 -m moeyard bench --cuda-graph --recipe "${FP8_RECIPES:-none,fp8_rowwise_gw_hp}" \
            --backends triton --no-peers --warmup 3 --iters 10 --json "$OUT/bench_graphs.json" "${margs[@]}" ;;
  memory) step memory_fp8 150 python3 benchmarks/memory_peak.py \
            ${FP8_MEMORY_ARGS:---model qwen3-30b-a3b --model sonic-120b --recipes none,fp8_rowwise_gw_hp} ;;
  ckpt) step pytest_ckpt 150 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_fp8_checkpoint_cuda.py
        step dequant_fp8 90 python3 benchmarks/fp8_dequant.py ;;
  train) step train_fp8 330 python3 examples/fp8_train.py --device cuda --size small --steps 300 --out "$OUT" ;;
  numerics) step numerics_random 60 python3 benchmarks/fp8_numerics.py --tokens 4096 --json "$OUT/numerics.json"
            step numerics_torchao 40 python3 benchmarks/fp8_numerics.py --tokens 4096 --protocol torchao ;;
esac; done
for f in "$OUT"/casts*.txt "$OUT"/probe*.txt "$OUT"/ab_table.txt "$OUT"/bench_*.txt "$OUT"/e2e*.txt "$OUT"/ep_*.txt "$OUT"/profile*.txt "$OUT"/host*.txt "$OUT"/memory*.txt "$OUT"/numerics*.txt "$OUT"/dequant*.txt "$OUT"/train*.txt; do [ -f "$f" ] && { echo "== $f"; tail -n 60 "$f"; }; done
for f in "$OUT"/pytest_*.txt; do [ -f "$f" ] && { echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed|Error" "$f" | tail -n 20; }; done
cat "$OUT/gpu.txt"; printf '%s\n' "${summary[@]}"
