#!/usr/bin/env bash
# One GPU round per stage, each time-boxed to fit one 10-minute device call (bf16, routed experts only,
# the torch grouped_mm pipeline and, when installed, SonicMoE timed in the same run).
# Usage (repository root, GPU machine):  bash benchmarks/gpu_round.sh [main|loaders|profile|peers|peer|anchors|router|e2e|gaps|ab|abprof|prefetch|host|hosttime|hostab|tmaup|routerab|lora|loraab|lorapointer|compile|small|launch]
#   main: verify, CUDA tests, bench (random and Zipf routing) at qwen3-30b-a3b and sonic-7b.
#   profile: the TMA CUDA tests, then the triton backend's per-kernel profile with A/B of the TMA-loaded
#            down projection (benchmarks/triton_profile.py).
#   peers: triton vs torch_gmm vs SonicMoE at qwen3-30b-a3b and sonic-7b (needs .peers, see README).
#   peer: the same at one shape, MODEL=<name> (SonicMoE compiles one shape in ~7 min on a fresh machine).
#   anchors: sonic-30b-a, sonic-120b, qwen3.5-35b-a3b (PEERS=1: with SonicMoE too).
#   router: CUDA tests (fused router included), the fused router's benchmark, and auto's choice at
#           sonic-120b (auto vs triton vs grouped_mm vs the torch pipeline, fwd+bwd).
#   e2e: a transformers decoder stack's training step (moeyard vs grouped_mm), with plot and a trace.
#   gaps: the per-kernel profile at qwen3.5-35b-a3b, sonic-30b-a and sonic-120b (where each shape's gap to
#         SonicMoE sits), then LoRA split vs fused at mixtral-8x7b (benchmarks/lora_crossover.py).
#   ab: this tree against BASE=dir (holding an earlier src/, e.g. `git archive REV src | tar -x -C .ab/base`
#       in a git-ignored folder, carried): the triton and LoRA CUDA tests, then, interleaved per tree, the
#       LoRA bench (frozen vs lora at LORA_MODEL, default qwen3-30b-a3b; about 80 s a tree) and the
#       whole-layer triton bench (qwen3-30b-a3b, sonic-7b; about 40 s a tree).
#   abprof: the per-kernel profile (benchmarks/triton_profile.py) of this tree and of BASE, interleaved, at
#       qwen3-30b-a3b and sonic-7b (about 50 s a tree and shape); BASE holds src/ and benchmarks/
#       (`git archive REV src benchmarks | tar -x -C .ab/base`).
#   loaders: the gathering kernels' loader warps: their CUDA tests, then this tree against BASE (an earlier src/,
#       carried): the per-kernel profile and the whole-layer bench at the five anchor shapes, then the dh probe.
#   prefetch: the dh kernel's L2 prefetch of h (option prefetch_h): its CUDA tests, the per-kernel profile
#       with and without it (qwen3-30b-a3b, sonic-7b), then the whole-layer bench at qwen3-30b-a3b with
#       MOEYARD_TRITON_PREFETCH=0/1 interleaved, twice each (about 35 s a run).
#   host: where a bench step's time goes at sonic-7b: one traced step per implementation (moeyard bench
#       --trace) summarised by benchmarks/trace_summary.py (host span, device busy time, launches, waits),
#       then the whole layer at qwen3-30b-a3b with the torch and the fused router, interleaved, twice each.
#   hosttime: host ms vs device ms of one fwd+bwd step, each alone (benchmarks/host_time.py), at sonic-7b and
#       qwen3-30b-a3b, triton and torch_gmm, torch and fused router, with a cProfile of each row's host work;
#       the same for the forward alone (fused router); then the whole-layer bench at both shapes.
#   tmaup: the triton, parity, LoRA and router CUDA tests, then the per-kernel profile with the up projection's weight
#       tiles through TMA (default) and by pointer loads (qwen3-30b-a3b, sonic-120b).
#   routerab: the CUDA tests, then the whole-layer bench (sonic-7b, qwen3-30b-a3b) with MOEYARD_ROUTER=torch and
#       auto (the default: the fused router on CUDA), interleaved, twice each.
#   hostab: the router, triton and parity CUDA tests, then this tree against BASE (an earlier src/, carried),
#       interleaved, twice each: host_time.py (sonic-7b, qwen3-30b-a3b, triton, fused router, forward and
#       forward + backward) and the whole-layer bench at both shapes; then this tree's cProfile at sonic-7b.
#   lora: the triton and LoRA CUDA tests, the LoRA step's kernels in launch order (benchmarks/lora_profile.py
#       --sequence) at LORA_MODEL (default qwen3-30b-a3b), then frozen vs LoRA step at qwen3-30b-a3b and
#       qwen3.5-35b-a3b.
#   loraab: this tree against BASE (src/ and benchmarks/, carried): the triton and LoRA CUDA tests, then per tree,
#       interleaved: the LoRA step's kernels (lora_profile.py --sequence, once) and frozen vs LoRA (twice) at LORA_MODEL.
#   lorapointer: the LoRA step with the pointer-loaded down projection (MOEYARD_TRITON_TMA=0) against the
#       default TMA one, interleaved: kernels in launch order, split and fused (lora_profile.py), then frozen
#       vs LoRA at LORA_MODEL.
#   small: few tokens per call (decoding, small batches), where the host sets the pace: benchmarks/host_time.py at
#       SMALL_MODEL (default qwen3-30b-a3b), 8-4096 tokens, inference and training steps, triton against the torch
#       pipeline, grouped_mm and (with .peers carried) SonicMoE; host, device and step ms.
#   launch: the kernels' CUDA tests through moeyard.launch's direct path (fixed configs, then autotuned), and the
#       path's host-time A/B and per-launch launcher times (benchmarks/launch_probe.py).
#   compile: the triton and transformers CUDA tests (torch.compile with Inductor among them), then the whole layer
#       eager, under torch.compile and under torch.compile's CUDA graphs (reduce-overhead), interleaved, twice
#       each, at sonic-7b and qwen3-30b-a3b (RUNS="1 2" by default; NO_TESTS=1 skips the tests).
# Full logs go to $OUT (default ./out); short summaries are printed last.
set -uo pipefail
STAGE=${1:-main}
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [[ ( $STAGE == peers || $STAGE == peer || -n ${PEERS:-} ) && -f .peers/install.sh ]]; then
  source .peers/install.sh
  # SonicMoE's GEMMs (QuACK) autotune on first use, compiling every candidate: minutes per shape on a fresh
  # machine. QuACK keeps each GEMM's autotune pick and compiled kernels (.o) under QUACK_CACHE_DIR as it
  # finishes: .peers-cache (git-ignored), sent back as $OUT/quack_cache.tgz. Untarred into .peers-cache and
  # carried with .peers, a later call compiles only what is missing (sonic-7b: two calls, NOTES round 12).
  export QUACK_CACHE_DIR=$PWD/.peers-cache QUACK_COMPILE_WORKERS=${QUACK_COMPILE_WORKERS:-16}
  mkdir -p "$QUACK_CACHE_DIR"
  trap 'tar czf "$OUT/quack_cache.tgz" -C "$QUACK_CACHE_DIR" . 2>/dev/null' EXIT
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt"
python3 -m moeyard info > "$OUT/info.txt" 2>&1
summary=()
step() {  # step NAME SECONDS CMD...: run with a time limit, log to $OUT/NAME.txt
  local name=$1 secs=$2; shift 2
  timeout "$secs" "$@" > "$OUT/$name.txt" 2>&1
  summary+=("$name rc=$? ($(tail -n 1 "$OUT/$name.txt" | cut -c1-150))")
}
BENCH=(python3 -m moeyard bench --routed-only --warmup 5 --iters 20)
if [[ $STAGE == main ]]; then
  MOEYARD_TRITON_AUTOTUNE=0 step verify 120 python3 -m moeyard verify --device cuda
  MOEYARD_TRITON_AUTOTUNE=0 step pytest_cuda 170 python3 -m pytest -q -p no:cacheprovider tests/cuda
  for routing in random zipf; do
    step "bench_$routing" 150 "${BENCH[@]}" --model qwen3-30b-a3b --model sonic-7b --routing $routing \
      --backends triton,grouped_mm,torch_gmm --json "$OUT/bench_$routing.json"
  done
elif [[ $STAGE == profile ]]; then
  # the options measured before (atomic, chunk) lost in round 3; TMA loads against pointer loads
  MOEYARD_TRITON_AUTOTUNE=0 step pytest_triton 150 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_triton_cuda.py
  V=default,pointer
  step profile_qwen 260 python3 benchmarks/triton_profile.py --configs qwen3-30b-a3b --variants $V --out "$OUT"
  step profile_sonic 200 python3 benchmarks/triton_profile.py --configs sonic-7b --variants $V --out "$OUT"
elif [[ $STAGE == peers ]]; then  # SonicMoE compiles for minutes on a fresh machine
  step bench_peers 560 "${BENCH[@]}" --model qwen3-30b-a3b --model sonic-7b --backends triton,torch_gmm,sonicmoe \
    --json "$OUT/bench_peers.json"
elif [[ $STAGE == peer ]]; then
  step "bench_peer_${MODEL:?MODEL=<shape name>}" ${PEER_SECS:-560} "${BENCH[@]}" --model "$MODEL" --backends triton,torch_gmm,sonicmoe \
    --json "$OUT/bench_peer_$MODEL.json"
elif [[ $STAGE == router ]]; then
  MOEYARD_TRITON_AUTOTUNE=0 step pytest_cuda 200 python3 -m pytest -q -p no:cacheprovider tests/cuda
  step router 150 python3 benchmarks/router_bench.py --json "$OUT/router.json"
  step bench_auto 200 "${BENCH[@]}" --model sonic-120b --backends auto,triton,grouped_mm,torch_gmm \
    --json "$OUT/bench_auto.json"
elif [[ $STAGE == e2e ]]; then
  step bench_e2e 540 python3 -m moeyard bench --e2e --model qwen3-30b-a3b --model olmoe-1b-7b --warmup 3 --iters 10 \
    --json "$OUT/bench_e2e.json" --plot "$OUT/bench_e2e.png" --trace "$OUT/traces"
elif [[ $STAGE == gaps ]]; then
  step profile_anchors 400 python3 benchmarks/triton_profile.py --configs qwen3.5-35b-a3b,sonic-30b-a,sonic-120b \
    --out "$OUT"
  step crossover_mixtral 170 python3 benchmarks/lora_crossover.py --models mixtral-8x7b --json "$OUT/crossover.json"
elif [[ $STAGE == ab ]]; then
  BASE=$(cd "${BASE:?BASE=dir with an earlier src/}" && pwd)
  MOEYARD_TRITON_AUTOTUNE=0 step pytest_triton 150 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_triton_cuda.py \
    tests/cuda/test_lora_cuda.py
  for what in lora layer; do
    for tree in base new; do
      src=$PWD/src; [[ $tree == base ]] && src=$BASE/src
      if [[ $what == lora ]]; then
        PYTHONPATH=$src step "bench_lora_$tree" 140 python3 -m moeyard bench --lora 16 --warmup 3 --iters 10 \
          --backends frozen,lora --model "${LORA_MODEL:-qwen3-30b-a3b}"
      else
        PYTHONPATH=$src step "bench_layer_$tree" 80 "${BENCH[@]}" --model qwen3-30b-a3b --model sonic-7b --backends triton
      fi
    done
  done
elif [[ $STAGE == loraab ]]; then
  BASE=$(cd "${BASE:?BASE=dir with an earlier src/ and benchmarks/}" && pwd)
  MOEYARD_TRITON_AUTOTUNE=0 step pytest_triton 170 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_triton_cuda.py \
    tests/cuda/test_lora_cuda.py -k "${TESTS_K:-tma or down or lora}"
  for run in 1 2; do
    for tree in new base; do
      root=$PWD; [[ $tree == base ]] && root=$BASE
      [[ $run == 1 ]] && PYTHONPATH=$root/src step "lora_kernels_$tree" 120 python3 "$root/benchmarks/lora_profile.py" \
        --model "${LORA_MODEL:-qwen3-30b-a3b}" --sequence
      PYTHONPATH=$root/src step "bench_lora_${tree}_$run" 90 python3 -m moeyard bench --lora 16 --warmup 3 --iters 10 \
        --backends frozen,lora --model "${LORA_MODEL:-qwen3-30b-a3b}"
    done
  done
  for f in "$OUT"/lora_kernels_*.txt; do echo "== $f"; grep -E "^(down|up_|dh_|wgrad|total)" "$f"; done
elif [[ $STAGE == abprof ]]; then
  BASE=$(cd "${BASE:?BASE=dir with an earlier src/}" && pwd)
  for shape in qwen3-30b-a3b sonic-7b; do
    for tree in base new; do
      root=$PWD; [[ $tree == base ]] && root=$BASE  # each tree's own profile script (it calls the kernels' launchers)
      PYTHONPATH=$root/src step "profile_${shape}_$tree" 140 python3 "$root/benchmarks/triton_profile.py" --configs $shape \
        --out "$OUT/profile_${shape}_$tree"
    done
  done
elif [[ $STAGE == loaders ]]; then
  BASE=$(cd "${BASE:?BASE=dir with an earlier src/}" && pwd)
  step pytest_gathered 150 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_lora_cuda.py -k gluon_gathered \
    tests/cuda/test_triton_cuda.py
  anchors=sonic-7b,qwen3-30b-a3b,sonic-30b-a,sonic-120b,qwen3.5-35b-a3b
  for tree in base new; do
    src=$PWD/src; [[ $tree == base ]] && src=$BASE/src
    PYTHONPATH=$src step "kernels_$tree" 120 python3 benchmarks/triton_profile.py --configs $anchors --rep 100 \
      --out "$OUT/kernels_$tree"
  done
  for tree in new base; do
    src=$PWD/src; [[ $tree == base ]] && src=$BASE/src
    PYTHONPATH=$src step "layer_$tree" 110 "${BENCH[@]}" --model ${anchors//,/ --model } --backends triton --no-peers \
      --json "$OUT/layer_$tree.json"
  done
  step probe 150 python3 benchmarks/gather_epilogue_probe.py --models qwen3-30b-a3b,qwen3.5-35b-a3b,sonic-120b
  for f in "$OUT"/kernels_*.txt; do echo "== $f"; grep -E "^## |^\| (up|dh) " "$f"; done
  for f in "$OUT"/layer_*.txt "$OUT"/probe.txt; do echo "== $f"; grep -E "^\| " "$f" | tail -n 20; done
elif [[ $STAGE == prefetch ]]; then
  MOEYARD_TRITON_AUTOTUNE=0 step pytest_prefetch 150 python3 -m pytest -q -p no:cacheprovider \
    tests/cuda/test_triton_cuda.py -k "prefetch or options or graph or sync"
  step profile_prefetch 300 python3 benchmarks/triton_profile.py --configs qwen3-30b-a3b,sonic-7b \
    --variants default,prefetch --out "$OUT"
  for run in 1 2; do
    for v in 0 1; do
      MOEYARD_TRITON_PREFETCH=$v step "bench_prefetch${v}_$run" 70 "${BENCH[@]}" --model qwen3-30b-a3b --backends triton
    done
  done
elif [[ $STAGE == host ]]; then
  step bench_trace 200 "${BENCH[@]}" --model sonic-7b --backends triton,torch_gmm --trace "$OUT/traces"
  step trace_summary 30 python3 benchmarks/trace_summary.py "$OUT"/traces/*.json
  for run in 1 2; do
    for r in torch fused; do
      MOEYARD_ROUTER=$r step "bench_router_${r}_$run" 70 "${BENCH[@]}" --model qwen3-30b-a3b --backends triton
    done
  done
elif [[ $STAGE == hosttime ]]; then
  step host_time 300 python3 benchmarks/host_time.py --models sonic-7b,qwen3-30b-a3b --backends triton,torch_gmm \
    --routers torch,fused --top 30 --json "$OUT/host_time.json"
  step host_time_fwd 120 python3 benchmarks/host_time.py --models sonic-7b,qwen3-30b-a3b --backends triton,torch_gmm \
    --routers fused --forward --top 30 --json "$OUT/host_time_fwd.json"
  step bench_host 120 "${BENCH[@]}" --model sonic-7b --model qwen3-30b-a3b --backends triton,torch_gmm
elif [[ $STAGE == hostab ]]; then
  BASE=$(cd "${BASE:?BASE=dir with an earlier src/}" && pwd)
  MOEYARD_TRITON_AUTOTUNE=0 step pytest_cuda 200 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_router_cuda.py \
    tests/cuda/test_triton_cuda.py tests/cuda/test_cuda_parity.py
  run=0
  for tree in "$BASE" "$PWD" "$BASE" "$PWD"; do  # interleaved, twice each
    run=$((run + 1)); name=$([[ $tree == "$BASE" ]] && echo base || echo new)_$run
    PYTHONPATH="$tree/src" step "host_ab_$name" 110 python3 benchmarks/host_time.py --models sonic-7b,qwen3-30b-a3b \
      --backends triton --routers fused --steps fwd,fwdbwd --iters 30
    PYTHONPATH="$tree/src" step "bench_ab_$name" 70 "${BENCH[@]}" --model sonic-7b --model qwen3-30b-a3b --backends triton
  done
  step host_profile 60 python3 benchmarks/host_time.py --models sonic-7b --backends triton --routers fused \
    --steps fwd,fwdbwd --top 50 --pstats "$OUT/pstats"
elif [[ $STAGE == tmaup ]]; then
  MOEYARD_TRITON_AUTOTUNE=0 step pytest_cuda 300 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_triton_cuda.py \
    tests/cuda/test_cuda_parity.py tests/cuda/test_lora_cuda.py tests/cuda/test_router_cuda.py
  step profile_tmaup 200 python3 benchmarks/triton_profile.py --configs qwen3-30b-a3b,sonic-120b \
    --variants default,pointer_up --out "$OUT"
elif [[ $STAGE == routerab ]]; then
  MOEYARD_TRITON_AUTOTUNE=0 step pytest_cuda 240 python3 -m pytest -q -p no:cacheprovider tests/cuda
  for run in 1 2; do
    for r in torch auto; do
      MOEYARD_ROUTER=$r step "bench_router_${r}_$run" 80 "${BENCH[@]}" --model sonic-7b --model qwen3-30b-a3b \
        --backends triton
    done
  done
elif [[ $STAGE == lora ]]; then
  MOEYARD_TRITON_AUTOTUNE=0 step pytest_triton 170 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_triton_cuda.py \
    tests/cuda/test_lora_cuda.py
  step lora_profile 150 python3 benchmarks/lora_profile.py --model "${LORA_MODEL:-qwen3-30b-a3b}" --sequence
  step bench_lora 200 python3 -m moeyard bench --lora 16 --warmup 3 --iters 10 --backends frozen,lora \
    --model qwen3-30b-a3b --model qwen3.5-35b-a3b --json "$OUT/bench_lora.json"
elif [[ $STAGE == lorapointer ]]; then
  for tma in 1 0; do
    MOEYARD_TRITON_TMA=$tma step "lora_kernels_tma$tma" 150 python3 benchmarks/lora_profile.py \
      --model "${LORA_MODEL:-qwen3-30b-a3b}" --modes split fused --sequence
  done
  for run in 1 2; do
    for tma in 0 1; do
      MOEYARD_TRITON_TMA=$tma step "bench_lora_tma${tma}_$run" 90 python3 -m moeyard bench --lora 16 --warmup 3 \
        --iters 10 --backends frozen,lora --model "${LORA_MODEL:-qwen3-30b-a3b}"
    done
  done
  for f in "$OUT"/lora_kernels_tma*.txt; do echo "== $f"; grep -E "^(down|up_|dh_|wgrad|total|autotune down)" "$f"; done
elif [[ $STAGE == compile ]]; then
  [[ -z ${NO_TESTS:-} ]] && MOEYARD_TRITON_AUTOTUNE=0 step pytest_compile 200 python3 -m pytest -q -p no:cacheprovider \
    tests/cuda/test_triton_cuda.py tests/cuda/test_transformers_cuda.py
  for run in ${RUNS:-1 2}; do
    for mode in eager default reduce-overhead; do
      flag=(); [[ $mode != eager ]] && flag=(--compile "$mode")
      step "bench_compile_${mode}_$run" 200 "${BENCH[@]}" --model sonic-7b --model qwen3-30b-a3b --backends triton \
        --no-peers "${flag[@]}" --json "$OUT/bench_compile_${mode}_$run.json"
    done
  done
elif [[ $STAGE == launch ]]; then
  # the direct launch path (moeyard.launch) under the kernels' CUDA tests, fixed configs then autotuned, and its A/B
  step pytest_launch_fixed 420 env MOEYARD_TRITON_AUTOTUNE=0 python3 -m pytest -q -p no:cacheprovider -x \
    tests/cuda/test_launch_cuda.py tests/cuda/test_triton_cuda.py tests/cuda/test_fp8_cuda.py tests/cuda/test_router_cuda.py
  step pytest_launch_tuned 240 python3 -m pytest -q -p no:cacheprovider -x tests/cuda/test_launch_cuda.py
  step host_launch 200 python3 benchmarks/launch_probe.py --parts ab,launcher
elif [[ $STAGE == small ]]; then
  peers=""; [[ -n ${PEERS:-} ]] && peers=",sonicmoe"
  step host_small 540 python3 benchmarks/host_time.py --models "${SMALL_MODEL:-qwen3-30b-a3b}" --tokens 8,64,512,4096 \
    --backends "triton,grouped_mm,torch_gmm$peers" --steps infer,fwdbwd --routers auto --iters 40 \
    --json "$OUT/host_small.json"
else  # anchors: the other ANCHORS.md shapes
  step bench_anchors 560 "${BENCH[@]}" --model sonic-30b-a --model sonic-120b --model qwen3.5-35b-a3b \
    --backends triton,torch_gmm${PEERS:+,sonicmoe} --json "$OUT/bench_anchors.json"
fi
for f in "$OUT"/verify.txt "$OUT"/bench_*.txt "$OUT"/probe_*.txt "$OUT"/profile_*.txt "$OUT"/crossover_*.txt "$OUT"/trace_*.txt "$OUT"/host_*.txt; do [ -f "$f" ] && { echo "== $f"; tail -n 36 "$f"; }; done
[ -f "$OUT/lora_profile.txt" ] && grep -v "^autotune" "$OUT/lora_profile.txt" | tail -n 120
for f in "$OUT"/pytest_*.txt; do grep -E "^(FAILED|ERROR)|passed|failed" "$f" | tail -n 25; done
cat "$OUT/gpu.txt"; printf '%s\n' "${summary[@]}"
