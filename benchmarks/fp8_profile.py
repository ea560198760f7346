"""Where an FP8 training step's time goes: the CUDA kernels of one forward + backward of a
``moeyard.MoE`` (routed experts only, bf16) under each recipe, from ``torch.profiler``, grouped by kernel
name, next to the same step without a recipe. The GEMMs' share of the dense e4m3 rate of the run is in
the last column (their FLOPs: the forward's ``6 T k H I`` per GEMM set, times 3 for forward + backward).

Usage (GPU machine): ``PYTHONPATH=src python3 benchmarks/fp8_profile.py [--model qwen3-30b-a3b]
[--backend triton] [--recipes none,fp8_rowwise] [--shared]``
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import torch

import moeyard
from moeyard.bench import dense_fp8_tflops, dense_tflops, layer_flops
from moeyard.bench.models import get_model, routed_only

# kernel names that are GEMMs: CUTLASS / cuBLAS, moeyard's FP8 grouped GEMM and the triton backend's
GEMM_NAMES = (
    "gemm",
    "sm90",
    "cutlass",
    "grouped_kernel",
    "gathered_kernel",
    "up_kernel",
    "down_kernel",
    "dh_kernel",
    "wgrad_kernel",
    "down_tma_kernel",
)


def step_kernels(moe, x, dy, warmup: int = 3, forward: bool = False) -> tuple[float, dict[str, tuple[int, float]]]:
    """(ms of the profiled step, {kernel name: (calls, total ms)}); with ``forward`` the training forward
    alone (autograd on, no backward)."""

    def step():
        for p in moe.parameters():  # as zero_grad does: no gradient-accumulation adds in the profile
            p.grad = None
        x.grad = None
        y = moe(x)
        if not forward:
            y.backward(dy)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
    kernels: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[ev.name[:90]]
            k[0] += 1
            k[1] += ev.device_time_total / 1e3 if hasattr(ev, "device_time_total") else ev.cuda_time_total / 1e3
    return start.elapsed_time(end), {k: (v[0], v[1]) for k, v in kernels.items()}


def cast_rates(T: int, H: int, I: int, E: int, K: int) -> None:
    """GB/s of each FP8 cast of the step at this shape (bytes: the operand read twice (amax, then cast),
    the e4m3 output and scales written once), against a device copy of the same operand."""
    from triton.testing import do_bench

    from moeyard.activations import Activation
    from moeyard.quant import fp8_colwise as cols, fp8_triton as cast

    dev = "cuda"
    R = T * K
    off = torch.arange(0, R + 1, R // E, device=dev, dtype=torch.int32)[: E + 1]
    off[-1] = R
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    rows = torch.randn(R, H, device=dev, dtype=torch.bfloat16)
    h = torch.randn(R, 2 * I, device=dev, dtype=torch.bfloat16)
    w = torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16)
    idx = torch.randint(0, T, (R,), device=dev)
    rw = torch.rand(R, device=dev)
    act = Activation()
    cases = {
        "rowwise x [T, H]": (lambda: cast.rowwise(x), 3 * x.numel()),
        "rowwise rows [R, H]": (lambda: cast.rowwise(rows), 5 * rows.numel()),
        "rowwise act(h) [R, 2I] -> [R, I]": (lambda: cast.rowwise(h, act), 4 * h.numel() + h.numel() // 2),
        "colwise rows [R, H] per expert": (lambda: cols.colwise_per_group(rows, off), 5 * rows.numel()),
        "colwise x[index] [R, H] per expert": (lambda: cols.colwise_per_group(x, off, index=idx), 5 * rows.numel()),
        "colwise act(h) per expert": (lambda: cols.colwise_per_group(h, off, act), 4 * h.numel() + h.numel() // 2),
        "colwise w [E, 2I, H] per expert": (lambda: cast.colwise_per_expert(w), 5 * w.numel()),
        "act backward h, da -> dh": (lambda: cast.act_backward(h, rows[:, :I], act), 4 * h.numel() + 2 * R * I),
        "act backward h, da -> dh, e4m3 dh, rw act(h)": (
            lambda: cast.act_backward(h, rows[:, :I], act, row_weights=rw, quantize=True, with_act_rows=True),
            5 * h.numel() + 4 * R * I,
        ),
        "copy rows [R, H] (ceiling)": (lambda: rows.clone(), 4 * rows.numel()),
    }
    print(f"\nFP8 casts at T {T}, H {H}, I {I}, E {E}, k {K} (R = {R} rows):")
    for name, (fn, nbytes) in cases.items():
        ms = do_bench(fn, warmup=10, rep=50, return_mode="median")
        print(f"  {ms:7.3f} ms  {nbytes / ms / 1e6:7.0f} GB/s  {name}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", default=[])
    p.add_argument("--backend", default="triton")
    p.add_argument("--recipes", default="none,fp8_rowwise")
    p.add_argument("--top", type=int, default=18)
    p.add_argument("--casts", action="store_true", help="also time each FP8 cast alone (GB/s)")
    p.add_argument("--forward", action="store_true", help="profile the training forward alone (no backward)")
    p.add_argument("--shared", action="store_true", help="keep the model's shared experts (default: routed only)")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    bf16, fp8 = dense_tflops(dev, 3, 10), dense_fp8_tflops(dev, 3, 10)
    print(f"{torch.cuda.get_device_name()} · dense bf16 {bf16:.0f} TFLOP/s · dense e4m3 {fp8 or 0:.0f} TFLOP/s")
    for name in args.model or ["qwen3-30b-a3b"]:
        shape = get_model(name)
        cfg = shape.moe_config() if args.shared else routed_only(shape.moe_config())
        T = shape.tokens
        flops = (1 if args.forward else 3) * layer_flops(cfg, T)
        torch.manual_seed(0)
        x = torch.randn(T, cfg.hidden_size, device=dev, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)
        for recipe in args.recipes.split(","):
            moe = moeyard.MoE(
                cfg, backend=args.backend, recipe=None if recipe == "none" else recipe, device=dev, dtype=torch.bfloat16
            )
            ms, kernels = step_kernels(moe, x, dy, forward=args.forward)
            total = sum(v[1] for v in kernels.values())
            gemm = sum(v[1] for k, v in kernels.items() if any(g in k.lower() for g in GEMM_NAMES))
            print(
                f"\n== {name} (T {T}) · {args.backend} · recipe {recipe}: step {ms:.2f} ms, kernels {total:.2f} ms "
                f"({flops / ms / 1e9:.0f} TFLOP/s); GEMM kernels {gemm:.2f} ms "
                f"= {flops / gemm / 1e9 if gemm else 0:.0f} TFLOP/s"
                f"{f' = {flops / gemm / 1e9 / fp8:.0%} of dense e4m3' if gemm and fp8 and recipe != 'none' else ''}"
            )
            for k, (n, t) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[: args.top]:
                print(f"  {t:8.3f} ms {n:4d}x  {k}")
            del moe
            torch.cuda.empty_cache()
        if args.casts:
            cast_rates(T, cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.top_k)
    return 0


if __name__ == "__main__":
    sys.exit(main())
