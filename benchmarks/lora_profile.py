"""Where the LoRA step's time goes: per-kernel CUDA time of one ``frozen`` and one ``lora`` step of
:mod:`moeyard.bench.lora` (torch.profiler), and the tile configs the autotuner picked.

    python benchmarks/lora_profile.py [--model qwen3-30b-a3b] [--rank 16] [--modes split fused] [--regs] [--sequence]
                                      [--recipe fp8_rowwise_gw_hp]

``--recipe``: also the ``frozen`` and ``lora`` steps on an FP8 base under that recipe (columns
``frozen+<recipe>``, ``lora+<recipe>``).

``--regs``: also every compiled variant of the grouped GEMM kernels (each config the autotuner tried)
with its compiled registers per thread and spills (``n_regs``, ``n_spills``) and shared memory next to
the estimates of :mod:`moeyard.experts.triton.tuning` (``*``: a config an autotuner of that kernel chose).
``--sequence``: each column's kernels of one step in launch order (tells the LoRA rows' thin passes
from the main GEMMs of the same kernel).
"""

from __future__ import annotations

import argparse
import collections

import torch

from moeyard import bench
from moeyard.bench import lora as bench_lora
from moeyard.bench.models import get_model
from moeyard.experts.triton import kernels_bwd, kernels_fwd, ops, options, tuning


def kernel_times(module, case, steps: int = 3) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """``({kernel name: ms per step}, [(kernel name, ms)] of one step in launch order)`` over
    ``steps`` profiled steps."""
    x, dy = case.xs[0].requires_grad_(), case.dys[0]
    for _ in range(3):
        module(x).backward(dy)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            module(x).backward(dy)
        torch.cuda.synchronize()
    times = collections.Counter()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    for e in events:
        times[e.name[:60]] += e.device_time_total / 1e3 / steps
    events.sort(key=lambda e: e.time_range.start)
    one_step = [(e.name[:60], e.device_time_total / 1e3) for e in events[-(len(events) // steps) :]]
    return dict(times), one_step


KERNELS = {
    "up": kernels_fwd.up_kernel,
    "down": kernels_fwd.down_kernel,
    "dh": kernels_bwd.dh_kernel,
    "wgrad": kernels_bwd.wgrad_kernel,
}
TILE = ("BM", "BN", "BK")


def compiled_variants(fn):
    """``(constexprs by name, argument types by name, CompiledKernel)`` of every variant of the JIT
    function ``fn`` compiled in this process (Triton 3.6 and 3.9: ``device_caches``' first entry)."""
    for cache in fn.device_caches.values():
        for kernel in cache[0].values():
            src = kernel.src
            consts = {fn.arg_names[k[0]] if isinstance(k, tuple) else k: v for k, v in src.constants.items()}
            yield consts, dict(src.signature), kernel


def _chosen(fn) -> set:
    """``(BM, BN, BK, num_warps, num_stages)`` of the configs that autotuners of the JIT function
    ``fn`` chose (for any of their launches: the ``autotune`` lines say which)."""
    return {
        (c.kwargs["BM"], c.kwargs["BN"], c.kwargs["BK"], c.num_warps, c.num_stages)
        for launcher in ops._LAUNCHERS.values()
        if getattr(launcher, "fn", None) is fn
        for c in getattr(launcher, "cache", {}).values()
    }


def print_compiled() -> None:
    """One line per compiled variant: compiled registers, spills, shared memory vs the estimates."""
    import triton

    print(f"{'kernel':6} {'BM':>3} {'BN':>3} {'BK':>3} w s LORA  RP DUAL | n_regs est | spills | smem   est")
    for kind, fn in KERNELS.items():
        chosen = _chosen(fn)
        for consts, sig, k in compiled_variants(fn):
            if not hasattr(k, "n_regs") or k.n_regs is None:
                k._init_handles()
            md = k.metadata
            cfg = triton.Config({m: consts[m] for m in TILE}, num_warps=md.num_warps, num_stages=md.num_stages)
            launch = tuning.launch_of(kind, {**sig, **consts})
            mark = "*" if (consts["BM"], consts["BN"], consts["BK"], md.num_warps, md.num_stages) in chosen else " "
            print(
                f"{kind:6} {consts['BM']:3} {consts['BN']:3} {consts['BK']:3} {md.num_warps} {md.num_stages} "
                f"{consts.get('LORA', 0):4} {consts.get('RP', 0):3} {int(consts.get('DUAL', 0)):4} | "
                f"{k.n_regs:6} {tuning.registers(cfg, launch):3} | {k.n_spills:6} | "
                f"{md.shared:6} {tuning.smem_bytes(cfg, launch):6} {mark}"
            )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--modes", nargs="+", default=["split"], choices=options.LORA_MODES)
    p.add_argument("--regs", action="store_true", help="compiled n_regs / n_spills against the estimates")
    p.add_argument("--sequence", action="store_true", help="each column's kernels of one step in launch order")
    p.add_argument("--recipe", default=None, help="also the frozen and LoRA steps on an FP8 base (recipe name)")
    a = p.parse_args()
    torch.manual_seed(0)
    case = bench_lora.make_case(get_model(a.model), a.rank, torch.device("cuda"), torch.bfloat16)
    cols, seqs = {}, {}
    cols["frozen"], seqs["frozen"] = kernel_times(bench_lora.build("frozen", case), case)
    for mode in a.modes:
        with options.use_options(lora_mode=mode):
            cols[f"lora/{mode}"], seqs[f"lora/{mode}"] = kernel_times(bench_lora.build("lora", case), case)
    for impl in [f"frozen+{a.recipe}", f"lora+{a.recipe}"] if a.recipe else []:
        cols[impl], seqs[impl] = kernel_times(bench_lora.build(impl, case), case)
    names = sorted({k for c in cols.values() for k in c}, key=lambda k: -max(c.get(k, 0) for c in cols.values()))
    print(f"{'kernel':60} " + " ".join(f"{c:>12}" for c in cols))
    for k in names:
        print(f"{k:60} " + " ".join(f"{cols[c].get(k, 0):12.3f}" for c in cols))
    print(f"{'total':60} " + " ".join(f"{sum(c.values()):12.3f}" for c in cols.values()))
    for name, launcher in ops._LAUNCHERS.items():
        for key, cfg in getattr(launcher, "cache", {}).items():
            print("autotune", name, key[:8], cfg)
    if a.regs:
        print_compiled()
    if a.sequence:
        for col, seq in seqs.items():
            print(f"-- {col}: one step in launch order (ms)")
            for name, ms in seq:
                print(f"   {ms:8.3f}  {name}")
    bench.free_memory("cuda")


if __name__ == "__main__":
    main()
