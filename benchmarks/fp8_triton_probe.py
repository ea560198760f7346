"""Probe: the gathered up projection (``h = x[token] @ W_e^T``, sorted rows) with e4m3 operands on moeyard's
Triton grouped GEMM (:func:`moeyard.quant.fp8_grouped.grouped_mm`: ``tl.dot`` on float8, rowwise scales in the
epilogue, the token gather in the A loads), next to the e4m3 rows gathered and then CUTLASS
``torch._scaled_grouped_mm`` (``MOEYARD_FP8_GEMM=cutlass``) and moeyard's bf16 up projection
(``act="none"``, so the outputs are the same ``[N, 2I]``), at anchor shapes.

Each row: ms (median of CUDA-event timings after warm-up, fresh random inputs), TFLOP/s and the share of the
dense rate of the same dtype measured in the same run (``torch.mm`` bf16, ``torch._scaled_mm`` e4m3 rowwise, on
``[N, H] x [H, 2I]``). Correctness: each FP8 output against float32 on the dequantised operands.

    PYTHONPATH=src python3 benchmarks/fp8_triton_probe.py [--models qwen3-30b-a3b,sonic-120b] [--json F]
    TRITON_INTERPRET=1 PYTHONPATH=src python3 benchmarks/fp8_triton_probe.py --check   # CPU: tiny case only
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from moeyard.bench.models import get_model
from moeyard.experts.triton import ops
from moeyard.quant import fp8_grouped

E4M3_MAX = 448.0


def fp8_up(x8, xs, w8, ws, r):
    """``[N, NC]`` bf16 sorted rows: ``(x8[token] * xs) @ (w8[e] * ws)^T`` on moeyard's Triton e4m3 GEMM."""
    return fp8_grouped.grouped_mm(x8, xs, w8, ws, r.expert_offsets, torch.bfloat16, index=token_rows(r))


def token_rows(r):
    return (r.sort_order // r.top_k).long()


def rowwise(t: torch.Tensor):
    """e4m3 codes and float32 scales over the last dim (amax / 448)."""
    scale = t.float().abs().amax(-1).clamp(min=1e-12) / E4M3_MAX
    return (t.float() / scale[..., None]).to(torch.float8_e4m3fn), scale


def inputs(T, E, K, H, NC, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, H, device=device, generator=g).bfloat16()
    w = (torch.randn(E, NC, H, device=device, generator=g) / H**0.5).bfloat16()
    ids = torch.rand(T, E, device=device, generator=g).argsort(-1)[:, :K].to(torch.int32)
    return x, w, ids


def reference(x8, xs, w8, ws, r):
    """float32 on the dequantised operands, sorted rows."""
    return fp8_grouped.reference(x8, xs, w8, ws, r.expert_offsets, torch.float32, index=token_rows(r))


def time_ms(fn, make, warmup=5, iters=30):
    """Median ms of ``fn(*make())`` with fresh inputs each run (CUDA events)."""
    for _ in range(warmup):
        fn(*make())
    times = []
    for _ in range(iters):
        args = make()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        fn(*args)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def run_shape(name: str, device) -> dict:
    shape = get_model(name)
    cfg = shape.moe_config()
    T, E, K, H = shape.tokens, cfg.num_experts, cfg.top_k, cfg.hidden_size
    NC = 2 * cfg.intermediate_size
    N = T * K
    flops = 2.0 * N * H * NC
    pool = [inputs(T, E, K, H, NC, device, s) for s in range(3)]
    prepared = []
    for x, w, ids in pool:
        r = ops.routing(ids, E)
        x8, xs = rowwise(x)
        w8, ws = rowwise(w)
        prepared.append((x, w, r, x8, xs, w8, ws))
    it = iter(range(10**9))

    def pick():
        return prepared[next(it) % len(prepared)]

    x, w, r, x8, xs, w8, ws = prepared[0]
    ref = reference(x8, xs, w8, ws, r)
    out = {"model": name, "T": T, "E": E, "K": K, "H": H, "NC": NC}
    out["rel_err_triton"] = float((fp8_up(x8, xs, w8, ws, r).float() - ref).norm() / ref.norm())

    def cutlass(p):
        _, _, r, x8, xs, w8, ws = p
        tok = token_rows(r)
        return torch._scaled_grouped_mm(
            x8[tok], w8.transpose(-2, -1), xs[tok], ws, offs=r.expert_offsets[1:], out_dtype=torch.bfloat16
        )

    got = cutlass(prepared[0]).float()
    out["rel_err_cutlass"] = float((got - ref).norm() / ref.norm())
    spec = ops.ActSpec(name="none")
    rows = {
        "bf16 moeyard up_proj": lambda p: ops.up_proj(p[0], p[1], None, p[2], spec, store_h=False),
        "e4m3 triton (moeyard)": lambda p: fp8_up(p[3], p[4], p[5], p[6], p[2]),
        "e4m3 gather + CUTLASS": cutlass,
    }
    xd, wd = torch.randn(N, H, device=device).bfloat16(), torch.randn(NC, H, device=device).bfloat16()
    xd8, xds = rowwise(xd)
    wd8, wds = rowwise(wd)
    dense = {
        "bf16": time_ms(lambda: torch.mm(xd, wd.t()), lambda: ()),
        "e4m3": time_ms(
            lambda: torch._scaled_mm(
                xd8, wd8.t(), scale_a=xds[:, None], scale_b=wds[None, :], out_dtype=torch.bfloat16, use_fast_accum=True
            ),
            lambda: (),
        ),
    }
    out["dense_tflops"] = {k: flops / v / 1e9 for k, v in dense.items()}
    out["rows"] = {}
    for label, fn in rows.items():
        ms = time_ms(fn, lambda: (pick(),))
        rate = flops / ms / 1e9
        base = dense["bf16" if label.startswith("bf16") else "e4m3"]
        out["rows"][label] = {"ms": ms, "tflops": rate, "of_dense": rate / (flops / base / 1e9)}
    return out


def check_interpreter():
    """A tiny case under ``TRITON_INTERPRET=1``: relative error against float32."""
    torch.manual_seed(0)
    T, E, K, H, NC = 24, 4, 2, 64, 96
    x, w, ids = inputs(T, E, K, H, NC, "cpu", 0)
    r = ops.routing(ids, E)
    x8, xs = rowwise(x)
    w8, ws = rowwise(w)
    got = fp8_up(x8, xs, w8, ws, r).float()
    ref = reference(x8, xs, w8, ws, r)
    err = float((got - ref).norm() / ref.norm())
    print(f"interpreter rel err {err:.2e}")
    assert err < 1e-2, err


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="qwen3-30b-a3b,sonic-120b,sonic-7b")
    p.add_argument("--json")
    p.add_argument("--check", action="store_true")
    args = p.parse_args()
    if args.check:
        check_interpreter()
        return
    device = torch.device("cuda")
    results = [run_shape(m, device) for m in args.models.split(",")]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(f"\n{torch.cuda.get_device_name()} · up projection [N, H] x [H, 2I] · ms / TFLOP/s / share of dense")
    for res in results:
        dense = ", ".join(f"{k} {v:.0f}" for k, v in res["dense_tflops"].items())
        errs = ", ".join(f"{k[8:]} {v:.1e}" for k, v in res.items() if k.startswith("rel_err"))
        print(f"{res['model']} (T {res['T']}, N {res['T'] * res['K']}): dense TFLOP/s {dense}; rel err {errs}")
        for label, row in res["rows"].items():
            print(f"  {label:24s} {row['ms']:7.3f} ms {row['tflops']:6.0f} TFLOP/s {100 * row['of_dense']:5.1f}%")


if __name__ == "__main__":
    main()
