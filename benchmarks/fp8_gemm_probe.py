"""Probe: the four e4m3 grouped GEMMs of the ``fp8_rowwise`` recipes' forward and input gradients: rows in
expert order, the down projection (``act(h) [N, I] x W_down^T``) and the up projection's input gradient
(``d h [N, 2I] x W_up``); rows gathered by token, the up projection (``x[token] [N, H] x W_up^T``) and the
down projection's input gradient (``d out[token] [N, H] x W_down``); each on the Gluon kernel
(:mod:`moeyard.quant.fp8_gluon`) and on the Triton kernel (:func:`moeyard.quant.fp8_grouped.grouped_kernel`,
``gluon=False``), at the anchor shapes.

Each row: ms (median of CUDA-event timings after warm-up, three input sets in turn), TFLOP/s, the share of
the dense e4m3 rate measured in the same run (``torch._scaled_mm``, rowwise scales, 8192^3), the relative
error (Frobenius) against float32 on the dequantised operands, and the host ms per call (launch cost).

    PYTHONPATH=src python3 benchmarks/fp8_gemm_probe.py [--models qwen3-30b-a3b,sonic-120b]
        [--tiles 256:3,128:5] [--no-triton]

``--tiles BN:STAGES,...`` times the Gluon kernel once per tile width ``BN`` and ring depth ``STAGES``
(the module's ``BN`` and ``STAGES`` set for that row; the first is the one timed against the Triton kernel).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import time

import torch

from moeyard.bench import dense_fp8_tflops, time_ms
from moeyard.bench.models import get_model
from moeyard.quant import fp8_gluon, fp8_grouped
from moeyard.quant.fp8_triton import rowwise


def operands(R: int, K: int, E: int, N: int, seed: int, tokens: int = 0):
    """Rows ``[R, K]`` (or, with ``tokens``, ``[tokens, K]`` and each row's token ``[R]``) and ``W [E, N, K]``
    cast rowwise, and balanced-at-random offsets ``[E + 1]``."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    a, sa = rowwise(torch.randn(tokens or R, K, device="cuda", generator=g, dtype=torch.bfloat16))
    b, sb = rowwise(torch.randn(E * N, K, device="cuda", generator=g, dtype=torch.bfloat16))
    counts = torch.bincount(torch.randint(0, E, (R,), device="cuda", generator=g), minlength=E)
    offsets = torch.zeros(E + 1, dtype=torch.int32, device="cuda")
    offsets[1:] = counts.cumsum(0)
    index = None
    if tokens:  # each expert's rows in token order, over all tokens (as the dispatch's sort leaves them)
        expert = torch.repeat_interleave(torch.arange(E, device="cuda"), counts)
        key = expert * tokens + torch.randint(0, tokens, (R,), device="cuda", generator=g)
        index = key.sort().values % tokens
    return a, sa, b.view(E, N, K), sb.view(E, N), offsets, index


def host_ms(fn, args, calls: int = 50) -> float:
    """Host milliseconds per call of ``fn(*args)``: ``calls`` calls enqueued back to back, then one sync
    (the GPU runs behind, so this is the Python and launch cost, unless the queue fills)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e3 / calls


def gemm(a, sa, b, sb, offsets, index, gluon=True):
    return fp8_grouped.grouped_mm(a, sa, b, sb, offsets, torch.bfloat16, index=index, gluon=gluon)


def run_set(pool, gluon: bool, i: int) -> None:
    """The GEMM on input set ``i`` of ``pool``, on the Gluon kernel or not."""
    gemm(*pool[i], gluon=gluon)


@contextlib.contextmanager
def gluon_tiles(bn: int, stages: int):
    """The Gluon kernel with tile width ``bn`` and ``stages`` ring stages inside the block."""
    old = fp8_gluon.BN, fp8_gluon.STAGES
    fp8_gluon.BN, fp8_gluon.STAGES = bn, stages
    try:
        yield
    finally:
        fp8_gluon.BN, fp8_gluon.STAGES = old


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="sonic-7b,qwen3-30b-a3b,sonic-30b-a,sonic-120b,qwen3.5-35b-a3b")
    p.add_argument("--tiles", default=f"{fp8_gluon.BN}:{fp8_gluon.STAGES}", help="Gluon BN:STAGES, comma-separated")
    p.add_argument("--no-triton", action="store_true", help="skip the Triton kernel's rows")
    args = p.parse_args()
    tiles = [tuple(int(v) for v in t.split(":")) for t in args.tiles.split(",")]
    dense = dense_fp8_tflops(torch.device("cuda"), 3, 10)
    print(f"{torch.cuda.get_device_name()} · dense e4m3 {dense:.0f} TFLOP/s · ms / TFLOP/s / share of dense / rel err")
    for name in args.models.split(","):
        cfg = get_model(name).moe_config()
        T, E, k, H, I = get_model(name).tokens, cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size
        R = T * k
        print(f"{name} (R {R} rows, E {E}, H {H}, I {I})")
        cases = (  # label, K, N, gathered
            ("up  x[t] W_up^T", H, 2 * I, True),
            ("down  act(h) W_down^T", I, H, False),
            ("dgrad  d out[t] W_down", H, I, True),
            ("dgrad  d h W_up", 2 * I, H, False),
        )
        for label, K, N, gathered in cases:
            pool = [operands(R, K, E, N, s, T if gathered else 0) for s in range(3)]
            a, sa, b, sb, offsets, index = pool[0]
            ref = fp8_grouped.reference(a, sa, b, sb, offsets, torch.float32, index=index)
            flops = 2.0 * R * K * N
            rows = [(f"gluon {bn}:{st}", True, bn, st) for bn, st in tiles]
            rows += [] if args.no_triton else [("triton", False, *tiles[0])]
            for kernel, gluon, bn, st in rows:
                with gluon_tiles(bn, st):
                    err = float((gemm(*pool[0], gluon=gluon).float() - ref).norm() / ref.norm())
                    ms = time_ms(functools.partial(run_set, pool, gluon), len(pool), 5, 30, torch.device("cuda"))
                    host = host_ms(functools.partial(gemm, gluon=gluon), pool[0])
                rate = flops / ms / 1e9
                print(
                    f"  {label:24s} {kernel:11s} {ms:7.3f} ms {rate:6.0f} TFLOP/s {rate / dense:5.0%} err {err:.1e} host {host:.3f} ms"
                )
            del pool, ref


if __name__ == "__main__":
    main()
