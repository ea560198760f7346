"""Registers, spills and shared memory of the grouped GEMM kernels compiled for Hopper (sm_90a) on a
machine without a GPU, next to the estimates of :mod:`moeyard.experts.triton.tuning`.

Triton compiles to a cubin without a driver; ``cuobjdump --dump-resource-usage`` (bundled with
Triton) reads its registers (REG) and spill stack (STACK). Arguments are specialised as Triton's JIT
would for the LoRA benchmark's layouts (bf16, 16-byte-aligned pointers, sizes and strides divisible by
16, unit strides constant); launches would pick the same kernels only up to that specialisation.

    python benchmarks/regs_offline.py [--kinds down dh up] [--ranks 0 16 64 128] [--modes split fused]

Output: one line per (kind, config, rank, mode): REG, spill bytes, shared bytes (compiled), and the
estimated registers and shared bytes.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from moeyard.experts.triton import kernels_bwd, kernels_fwd, schedule, tuning  # noqa: E402

POINTERS = {"sort_order_ptr": "*i64", "offsets_ptr": "*i32", "dw_ptr": "*fp32", "tw_ptr": "*bf16"}
FLOATS = ("alpha", "limit", "lora_scale")
ODD = ("E", "top_k", "R", "chunk_rows", "N")  # sizes not assumed divisible by 16
# (kernel, config list, constexprs, unit strides) per kind; the LoRA layouts are PEFT's (A [E, r, in], B [E, out, r])
KINDS = {
    "down": (kernels_fwd.down_kernel, schedule.GEMM_CONFIGS,
             dict(HAS_BIAS=False, HAS_WEIGHT=True, ATOMIC=False), ("stride_wk", "stride_lak", "stride_lbr")),
    "dh": (kernels_bwd.dh_kernel, schedule.DH_CONFIGS, dict(ACT="swiglu", DUAL=True, HAS_BIAS=False),
           ("stride_dh", "stride_wi", "stride_lar", "stride_lbn")),
    "up": (kernels_fwd.up_kernel, schedule.DUAL_CONFIGS,
           dict(ACT="swiglu", DUAL=True, HAS_BIAS=False, STORE_H=True, GATHER=True),
           ("stride_xh", "stride_wh", "stride_bn", "stride_lak", "stride_lbr")),
    "wgrad": (kernels_bwd.wgrad_kernel, schedule.WGRAD_CONFIGS,
              dict(L_GATHER=False, R_GATHER=True, HAS_DB=False, DB_SCALE=False, CHUNKED=False),
              ("stride_ln", "stride_rn", "stride_dr")),
}


def _source(fn, consts: dict):
    names = fn.arg_names
    sig = {n: "constexpr" if n in consts else POINTERS.get(n, "*bf16") if n.endswith("_ptr")
           else "fp32" if n in FLOATS else "i32" for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n] not in ("constexpr", "fp32") and n not in ODD}
    return triton.compiler.ASTSource(fn=fn, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()},
                                     attrs=attrs)


def resources(fn, consts: dict, warps: int, stages: int) -> tuple[int, int, int]:
    """``(registers per thread, spill bytes, shared bytes)`` of ``fn`` compiled for sm_90a."""
    k = triton.compile(_source(fn, consts), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps, num_stages=stages))
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        out = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    regs, stack = re.search(r"REG:(\d+)", out), re.search(r"STACK:(\d+)", out)
    return int(regs.group(1)), int(stack.group(1)), k.metadata.shared


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", nargs="+", default=["down", "dh", "up"], choices=sorted(KINDS))
    p.add_argument("--ranks", nargs="+", type=int, default=[0, 16, 64])
    p.add_argument("--modes", nargs="+", default=["split", "fused"], choices=("split", "fused"))
    a = p.parse_args()
    print(f"{'kind':5} {'BM':>3} {'BN':>3} {'BK':>3} w s {'r':>3} {'mode':5} | REG est | spill | shared    est")
    for kind in a.kinds:
        fn, configs, flags, unit = KINDS[kind]
        variants = [(0, 0)] + [(r, 1 + (m == "fused")) for r in a.ranks if r for m in a.modes]
        for c in configs:
            for rank, lora in variants if kind != "wgrad" else [(0, 0)]:
                rp = schedule.rank_block(rank) if lora else 16
                consts = dict(flags, PRECISION="tf32", E_P2=128, **c.kwargs, **{s: 1 for s in unit})
                if kind != "wgrad":
                    consts.update(LORA=lora, RP=rp)
                regs, spill, shared = resources(fn, consts, c.num_warps, c.num_stages)
                launch = tuning.launch_of(kind, consts)  # bf16
                mode = ("-", "split", "fused")[lora]
                print(f"{kind:5} {c.kwargs['BM']:3} {c.kwargs['BN']:3} {c.kwargs['BK']:3} {c.num_warps} {c.num_stages} "
                      f"{rank:3} {mode:5} | {regs:3} {tuning.registers(c, launch):3} | {spill:5} | "
                      f"{shared:6} {tuning.smem_bytes(c, launch):6}", flush=True)


if __name__ == "__main__":
    main()
