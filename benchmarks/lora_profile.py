"""Where the LoRA step's time goes: per-kernel CUDA time of one ``frozen`` and one ``lora`` step of
:mod:`moeyard.bench_lora` (torch.profiler), and the tile configs the autotuner picked.

    python benchmarks/lora_profile.py [--model qwen3-30b-a3b] [--rank 16] [--modes split fused]
"""
from __future__ import annotations

import argparse
import collections

import torch

from moeyard import bench, bench_lora
from moeyard.experts.triton import ops, options
from moeyard.models import get_model


def kernel_times(module, case, steps: int = 3) -> dict[str, float]:
    """``{kernel name: ms per step}`` over ``steps`` profiled steps."""
    x, dy = case.xs[0].requires_grad_(), case.dys[0]
    for _ in range(3):
        module(x).backward(dy)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            module(x).backward(dy)
        torch.cuda.synchronize()
    times = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name[:60]] += e.device_time_total / 1e3 / steps
    return dict(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--modes", nargs="+", default=["auto"])
    a = p.parse_args()
    torch.manual_seed(0)
    case = bench_lora.make_case(get_model(a.model), a.rank, torch.device("cuda"), torch.bfloat16)
    cols = {"frozen": kernel_times(bench_lora.build("frozen", case), case)}
    for mode in a.modes:
        with options.use_options(lora_mode=mode):
            cols[f"lora/{mode}"] = kernel_times(bench_lora.build("lora", case), case)
    names = sorted({k for c in cols.values() for k in c}, key=lambda k: -max(c.get(k, 0) for c in cols.values()))
    print(f"{'kernel':60} " + " ".join(f"{c:>12}" for c in cols))
    for k in names:
        print(f"{k:60} " + " ".join(f"{cols[c].get(k, 0):12.3f}" for c in cols))
    print(f"{'total':60} " + " ".join(f"{sum(c.values()):12.3f}" for c in cols.values()))
    for name, launcher in ops._LAUNCHERS.items():
        for key, cfg in getattr(launcher, "cache", {}).items():
            print("autotune", name, key[:8], cfg)
    bench._free("cuda")


if __name__ == "__main__":
    main()
