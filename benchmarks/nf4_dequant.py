"""Selective NF4 dequantisation (``moeyard.quant.NF4Experts.dequantize``) on a CUDA GPU, at the expert stacks
of the QLoRA shapes: the rate of the Triton kernel and of the two ways a fresh output can be made.

A QLoRA step dequantises each layer's active experts twice (forward, and again in backward:
``moeyard.experts.quantized``), each time into a fresh ``[E, a, b]`` bfloat16 buffer. Bytes per call: the
NF4 codes (half a byte per element) and the block scales read, the bfloat16 values (2 bytes) written;
GB/s = 2.5 bytes per element over the median time (CUDA events, after warm-up:
:func:`moeyard.bench.layer.time_ms`). Rows:

- ``into``: the kernel into a preallocated output, every expert active (the kernel alone);
- ``fresh``: ``dequantize(active)``, an output from ``torch.empty`` whose inactive experts the kernel zeroes;
- ``zeros+into``: ``torch.zeros`` then the kernel (a memset of the output first, then the kernel);
- ``memset``: ``out.zero_()``, 2 bytes per element written: the write rate the kernel can approach.

With ``--variants`` the kernel is also timed at other elements per program and warps, and with the
rounding on the bits (the interpreter's) instead of the hardware conversion.

No bitsandbytes needed: the storage is built with ``NF4Experts.empty`` and random codes and scales.

Usage (repository root, GPU machine)::

    PYTHONPATH=src python3 benchmarks/nf4_dequant.py [--model qwen3-30b-a3b ...] [--variants] [--iters 30]
"""

from __future__ import annotations

import argparse
import itertools

import torch

from moeyard.bench.layer import time_ms
from moeyard.bench.models import get_model
from moeyard.quant import NF4Experts, triton_nf4

MODELS = ("qwen3-30b-a3b", "qwen3.5-35b-a3b", "olmoe-1b-7b", "mixtral-8x7b")


def _time(fn, iters: int) -> float:
    """Median ms of ``fn()`` (CUDA events, after 3 untimed calls): :func:`moeyard.bench.layer.time_ms`."""
    return time_ms(lambda i: fn(), 1, 3, iters, torch.device("cuda"))


def random_storage(shape, device="cuda") -> NF4Experts:
    """NF4 storage of ``shape`` with random codes and double-quantised scales (bitsandbytes' layout)."""
    s = NF4Experts.empty(shape, dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        s.data.copy_(torch.randint(0, 256, s.data.shape, dtype=torch.uint8, device=device))
        s.absmax.copy_(torch.randint(0, 256, s.absmax.shape, dtype=torch.uint8, device=device))
        s.absmax2.copy_(torch.rand(s.absmax2.shape, device=device) * 0.1 + 0.01)
        s.code2.copy_(torch.linspace(-1, 1, 256, device=device))
        s.offset.fill_(0.05)
    return s


def stacks(models) -> list[tuple[str, tuple[int, int, int]]]:
    """``(name, [E, a, b])`` of each model's two expert stacks (gate_up ``[E, 2I, H]``, down ``[E, H, I]``)."""
    out = []
    for m in models:
        c = get_model(m).config
        E, H, I = c["num_experts"], c["hidden_size"], c["intermediate_size"]
        out += [(f"{m} gate_up", (E, 2 * I, H)), (f"{m} down", (E, H, I))]
    return out


def variants(s: NF4Experts, out: torch.Tensor, iters: int) -> list[tuple[str, float]]:
    """The kernel into ``out`` at other elements per program, warps and rounding (module knobs restored)."""
    saved = (triton_nf4.ELEMENTS_PER_PROGRAM, triton_nf4.NUM_WARPS, triton_nf4.interpreting)
    rows = []
    try:
        for epp, warps, hw in itertools.product((2048, 4096, 8192, 16384), (4, 8), (True, False)):
            triton_nf4.ELEMENTS_PER_PROGRAM, triton_nf4.NUM_WARPS = epp, warps
            triton_nf4.interpreting = (lambda: False) if hw else (lambda: True)
            ms = _time(lambda: s.dequantize(None, out=out), iters)
            rows.append((f"epp {epp} warps {warps} {'hw' if hw else 'bits'}", ms))
    finally:
        triton_nf4.ELEMENTS_PER_PROGRAM, triton_nf4.NUM_WARPS, triton_nf4.interpreting = saved
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", help=f"a shape (repeatable; default {', '.join(MODELS)})")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--variants", action="store_true", help="also the kernel at other tile sizes and rounding")
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'stack':<28} {'row':<28} {'ms':>8} {'GB/s':>7}")
    for name, shape in stacks(args.model or MODELS):
        n = torch.Size(shape).numel()
        for row, ms in time_stack(shape, args.iters, args.variants):
            rate = f"{2.5 * n / ms / 1e6:7.0f}" if row != "memset" else f"{2 * n / ms / 1e6:7.0f}"
            print(f"{name:<28} {row:<28} {ms:8.3f} {rate}")


def time_stack(shape, iters: int, with_variants: bool) -> list[tuple[str, float]]:
    """The rows of the module docstring for one ``[E, a, b]`` stack: ``(row, ms)``."""
    s = random_storage(shape)
    out = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
    every = torch.ones(shape[0], dtype=torch.bool, device="cuda")
    eighth = torch.arange(shape[0], device="cuda") % 8 == 0
    rows = [
        ("into", _time(lambda: s.dequantize(None, out=out), iters)),
        ("fresh, every expert", _time(lambda: s.dequantize(every), iters)),
        ("zeros+into, every expert", _time(lambda: s.dequantize(every, out=torch.zeros_like(out)), iters)),
        ("fresh, 1/8 of the experts", _time(lambda: s.dequantize(eighth), iters)),
        ("zeros+into, 1/8", _time(lambda: s.dequantize(eighth, out=torch.zeros_like(out)), iters)),
    ]
    if with_variants:
        rows += variants(s, out, iters)
    return rows + [("memset", _time(out.zero_, iters))]


if __name__ == "__main__":
    main()
