#!/usr/bin/env bash
# LoRA / QLoRA under expert parallelism on one host with 4 GPUs (NCCL): the weak-scaling table, then
# QLoRA of the full Qwen3-235B-A22B architecture.
#
#   bash benchmarks/gpu_ep_lora.sh                       # logs and JSON under $OUT (default ./gpu_ep_lora_out)
#   EP_SIZES="1 2" EP_STEPS=bench bash benchmarks/gpu_ep_lora.sh   # 2 GPUs: the scaling rows only
#   BNB_WHEEL=/path/bitsandbytes-*.whl bash benchmarks/gpu_ep_lora.sh   # install bitsandbytes first
#                                                       (default: the wheel in .bnb/ when carried)
#
# 1. bench: moeyard bench --ep N for N in $EP_SIZES (default 1 2 4) at qwen3-30b-a3b and qwen3-235b-a22b
#    ($EP_MODELS), $EP_TOKENS tokens per rank (default 8192), balanced and Zipf routing, every
#    dispatcher, the bf16 training step and the LoRA r=16 step; each row also times the same step on
#    one GPU (all experts, the rank's own tokens): benchmarks/ep_scaling_table.py prints the
#    weak-scaling table (per-GPU throughput against one GPU) from the JSON files.
# 2. qlora235: examples/qwen3_235b_qlora.py on 4 GPUs (94 layers, NF4 experts, LoRA r=16, FSDP2,
#    activation checkpointing): per-step loss, s/step, tokens/s, per-GPU peak memory; needs
#    bitsandbytes (BNB_WHEEL installs a carried wheel).
# 3. qloradsv3 (8 GPUs, not in the default steps): the same example with --model deepseek-v3 (61 layers,
#    256 experts; EP_DSV3_ARGS adds flags, e.g. "--batch 1 --lora-dtype bfloat16" on 80 GB GPUs).
#    EP_STEPS="bench qlora235 qloradsv3" EP_SIZES="1 2 4 8" on an 8-GPU host.
# Files in $OUT: bench_ep<N>_<model>_<train|lora>.{log,json}, scaling.md, qwen3_235b_qlora.{log,json},
# deepseek_v3_qlora.{log,json}, env.txt.
set -u
OUT=${OUT:-./gpu_ep_lora_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0            # no NVLink multicast
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
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
torch.cuda.nccl.version(), 'triton', triton.__version__)"; date -u; } > "$OUT/env.txt" 2>&1

SIZES=${EP_SIZES:-1 2 4}
MODELS=${EP_MODELS:-qwen3-30b-a3b qwen3-235b-a22b}
TOKENS=${EP_TOKENS:-8192}
STEPS=${EP_STEPS:-bench qlora235}
has() { [[ " $STEPS " == *" $1 "* ]]; }
names=()
if has bench; then
    for n in $SIZES; do
        for model in $MODELS; do
            for mode in train lora; do
                name="bench_ep${n}_${model}_${mode}"
                names+=("$name")
                step "$name" "${EP_LIMIT_BENCH:-600}" torchrun --standalone --nproc-per-node "$n" -m moeyard bench \
                    --ep "$n" --model "$model" --tokens "$TOKENS" --dtype bfloat16 --warmup 3 --iters 10 \
                    $([ $mode = lora ] && echo --lora 16) --json "$OUT/$name.json"
            done
        done
    done
    python benchmarks/ep_scaling_table.py "$OUT"/bench_ep*.json > "$OUT/scaling.md" 2>&1
fi
if has qlora235 || has qloradsv3; then
    BNB_WHEEL=${BNB_WHEEL:-$(ls .bnb/bitsandbytes-*.whl 2> /dev/null | head -n 1)}
    # the interpreter's own pip (a bare `pip` may belong to another Python and leave this one without it)
    [ -n "$BNB_WHEEL" ] && python3 -m pip install --no-deps --no-index "$BNB_WHEEL" > "$OUT/bnb_install.log" 2>&1
fi
if has qlora235; then
    names+=(qwen3_235b_qlora)
    step qwen3_235b_qlora "${EP_LIMIT_QLORA:-1800}" torchrun --standalone --nproc-per-node 4 \
        examples/qwen3_235b_qlora.py --out "$OUT/qwen3_235b_qlora.json"
fi
if has qloradsv3; then
    names+=(deepseek_v3_qlora)
    step deepseek_v3_qlora "${EP_LIMIT_QLORA:-1800}" torchrun --standalone --nproc-per-node 8 \
        examples/qwen3_235b_qlora.py --model deepseek-v3 ${EP_DSV3_ARGS:-} --out "$OUT/deepseek_v3_qlora.json"
fi

echo
echo "################ summary ################"
head -4 "$OUT/env.txt"
for name in "${names[@]}"; do echo "$name: ${STATUS[$name]:-not run}"; done
has bench && cat "$OUT/scaling.md"
has qlora235 && grep -E '^(step|\| qwen3|built|rank 0 holds)' "$OUT/qwen3_235b_qlora.log"
has qloradsv3 && grep -E '^(step|\| deepseek|built|rank 0 holds)' "$OUT/deepseek_v3_qlora.log"
