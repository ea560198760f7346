"""Selective dequantisation of FP8 block storage (``moeyard.quant.FP8BlockExperts``) on a CUDA GPU: the
Triton kernel against the torch path, at the expert stacks of real FP8 checkpoints, with every expert
active (a training step) and with few (decoding), in the compute dtype bfloat16.

Bytes moved per call: the active experts' e4m3 weights (1 byte each) read, their bfloat16 values (2 bytes)
written, scales negligible; GB/s = that over the median time (CUDA events, after warm-up).

Usage (repository root, GPU machine)::

    PYTHONPATH=src python3 benchmarks/fp8_dequant.py [--iters 50]

Prints one row per (stack, active experts): the kernel's ms and GB/s, the torch path's ms.
"""

from __future__ import annotations

import argparse
import functools

import torch

from moeyard.quant import FP8BlockExperts
from moeyard.quant.fp8_block import dequantize_torch

# (name, [E, a, b], row segments): the expert stacks of one layer of Qwen3-30B-A3B-FP8, and 64 of the 256
# experts of one DeepSeek-V3 layer (the whole stack's bfloat16 source and output would not fit beside it)
STACKS = [
    ("qwen3-30b-a3b gate_up", (128, 1536, 2048), (768, 768)),
    ("qwen3-30b-a3b down", (128, 2048, 768), None),
    ("deepseek-v3 gate_up /4", (64, 4096, 7168), (2048, 2048)),
    ("deepseek-v3 down /4", (64, 7168, 2048), None),
]


def _time(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'stack':<24} {'active':>6} {'kernel ms':>10} {'GB/s':>7} {'torch ms':>9}")
    for name, shape, segments in STACKS:
        w = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 0.02
        s = FP8BlockExperts.from_float(w, row_segments=segments)
        del w
        out = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
        E, a, b = shape
        for n_active in (E, 8):
            active = torch.zeros(E, dtype=torch.bool, device="cuda")
            active[torch.randperm(E, device="cuda")[:n_active]] = True
            ms = _time(functools.partial(s.dequantize, active, out=out), args.iters)
            torch_ms = _time(functools.partial(dequantize_torch, s, active, out), max(3, args.iters // 10))
            gbs = n_active * a * b * 3 / ms / 1e6
            print(f"{name:<24} {n_active:>6} {ms:>10.3f} {gbs:>7.0f} {torch_ms:>9.2f}")
        del s, out
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
