#!/usr/bin/env bash
# Expert parallelism on one host with 2 GPUs (NCCL): correctness, then the dispatchers' timings.
#
#   bash benchmarks/gpu_ep.sh                 # logs and JSON under $OUT (default ./gpu_ep_out)
#   EP_SHAPES=qwen3-30b-a3b bash benchmarks/gpu_ep.sh   # one shape only
#   EP_SYMM_ONLY=1 bash benchmarks/gpu_ep.sh            # step 3 only
#   EP_STEPS="symm check" bash benchmarks/gpu_ep.sh     # any of: check bench symm p2p (default: all four)
#   EP_NPROC=1 EP_STEPS="p2p bench" bash benchmarks/gpu_ep.sh  # one GPU (no NVLink: local costs only;
#                                                       # symm needs 2 ranks); EP_SRC=dir: moeyard from dir/src
#
# 1. benchmarks/ep_check.py under torchrun: every dispatcher x {triton, grouped_mm} x {bf16, fp32}
#    against the single-process oracle, sync debug mode, CUDA-graph replay, overlap_chunks 2 and 3,
#    FSDP2 on a (dp=1, ep=2) mesh (PASS/FAIL table).
# 2. moeyard bench --ep 2 at qwen3-30b-a3b and sonic-7b shapes (T per rank = the shape's), balanced
#    and Zipf routing, every dispatcher: dispatch / experts / combine ms, GB/s next to a plain NCCL
#    all_to_all_single of the same bytes, per-GPU TFLOP/s next to one GPU on the same local experts,
#    and the whole call (forward; forward + backward) with overlap_chunks 1, 2 and 4 (EP_OVERLAP).
# 3. benchmarks/ep_symm_check.py under torchrun: the NVSHMEM exchange of sync_free (raw ops against
#    their reference, the layer against the oracle at E_l = 4 and 64, sync debug mode), the bare
#    exchanges' GB/s, a kernel profile of dispatch + combine, then dispatch / combine ms at
#    qwen3-30b-a3b for all_to_all, sync_free + equal splits, sync_free + symm_mem.
# 4. benchmarks/ep_symm_check.py --exchange p2p: the peer-to-peer exchange of sync_free (the row-copy
#    kernel on local and peer memory, the layer against the oracle at E_l = 4 and 64, sync debug mode,
#    CUDA-graph replay), a kernel profile of its dispatch + combine, then dispatch / combine ms at
#    qwen3-30b-a3b next to all_to_all.
# Every step is time-boxed (EP_LIMIT_CHECK / _BENCH (per shape) / _SYMM / _P2P seconds: 200 / 240 / 300 / 300). Files in $OUT: ep_check.log,
# ep_check.json, bench_<shape>.log, bench_<shape>.json, ep_symm_check.log, ep_symm_check.json,
# ep_p2p_check.log, ep_p2p_check.json, env.txt.
set -u
OUT=${OUT:-./gpu_ep_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0            # no NVLink multicast
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_SYMMETRIC_SIZE=${NVSHMEM_SYMMETRIC_SIZE:-8G}   # step 3's symmetric buffers
export TORCH_NCCL_ASYNC_ERROR_HANDLING=3
export PYTHONPATH="${EP_SRC:-$PWD}/src${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=4
declare -A STATUS

step() {  # step NAME SECONDS CMD...: run with a time limit, log to $OUT/NAME.log, record the exit code
    local name=$1 secs=$2; shift 2
    local t0=$SECONDS
    echo "== $name (limit ${secs}s): $*"
    timeout --kill-after=15 "$secs" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    STATUS[$name]="rc=$rc $((SECONDS - t0))s$([ $rc -eq 124 ] && echo ' TIMEOUT')"
    echo "   -> ${STATUS[$name]}"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvidia-smi topo -m
  python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl',
torch.cuda.nccl.version(), 'triton', triton.__version__)"; } > "$OUT/env.txt" 2>&1

NPROC=${EP_NPROC:-2}
TR="torchrun --standalone --nproc-per-node $NPROC"
SHAPES=${EP_SHAPES:-qwen3-30b-a3b sonic-7b}
OVERLAP=${EP_OVERLAP:-1,2,4}
STEPS=${EP_STEPS:-check bench symm p2p}
[ "${EP_SYMM_ONLY:-0}" = 1 ] && STEPS=symm
has() { [[ " $STEPS " == *" $1 "* ]]; }
# the NVSHMEM step first when asked for: it is the least tried
has symm && MOEYARD_TRITON_AUTOTUNE=0 step ep_symm_check "${EP_LIMIT_SYMM:-300}" $TR benchmarks/ep_symm_check.py --json "$OUT/ep_symm_check.json"
has p2p && MOEYARD_TRITON_AUTOTUNE=0 step ep_p2p_check "${EP_LIMIT_P2P:-300}" $TR benchmarks/ep_symm_check.py --exchange p2p --json "$OUT/ep_p2p_check.json"
has check && MOEYARD_TRITON_AUTOTUNE=0 step ep_check "${EP_LIMIT_CHECK:-200}" $TR benchmarks/ep_check.py --json "$OUT/ep_check.json"
if has bench; then
    for shape in $SHAPES; do
        step "bench_$shape" "${EP_LIMIT_BENCH:-240}" $TR -m moeyard bench --ep "$NPROC" --model "$shape" --dtype bfloat16 \
            --warmup 3 --iters 10 --overlap "$OVERLAP" --json "$OUT/bench_$shape.json"
    done
fi

echo
echo "################ summary ################"
cat "$OUT/env.txt" | head -4
for name in ep_check $(printf 'bench_%s ' $SHAPES) ep_symm_check ep_p2p_check; do echo "$name: ${STATUS[$name]:-not run}"; done
if has check; then
    echo "---- ep_check (tail) ----"
    grep -E '^(PASS|FAIL|====)' "$OUT/ep_check.log" || tail -30 "$OUT/ep_check.log"
    grep -E 'Error|error:' "$OUT/ep_check.log" | sort | uniq -c | sort -rn | head -8
fi
has bench && for shape in $SHAPES; do
    echo "---- bench --ep $NPROC $shape ----"
    # the rich table (slowest rank's ms, rank 0's rates); on failure the log's tail
    grep -E '^[┃│┏┡└]|moeyard bench --ep' "$OUT/bench_$shape.log" | grep -v '━━━━' || tail -25 "$OUT/bench_$shape.log"
done
if has symm; then
    echo "---- ep_symm_check (tail) ----"
    grep -E "^(PASS|FAIL|====)|^routing|^(balanced|zipf) |^raw " "$OUT/ep_symm_check.log" || tail -30 "$OUT/ep_symm_check.log"
    sed -n '/^==== profile/,/^==== end profile/p' "$OUT/ep_symm_check.log" | grep -vE '^-+|^$|end profile'
fi
if has p2p; then
    echo "---- ep_p2p_check (tail) ----"
    grep -E "^(PASS|FAIL|====)|^routing|^(balanced|zipf) " "$OUT/ep_p2p_check.log" || tail -30 "$OUT/ep_p2p_check.log"
    sed -n '/^==== profile/,/^==== end profile/p' "$OUT/ep_p2p_check.log" | grep -vE '^-+|^$|end profile'
fi
! has check || [ "${STATUS[ep_check]%% *}" = "rc=0" ] || exit 1
! has p2p || [ "${STATUS[ep_p2p_check]%% *}" = "rc=0" ] || exit 1
! has symm || [ "${STATUS[ep_symm_check]%% *}" = "rc=0" ]
