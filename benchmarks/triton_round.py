"""One GPU round for the ``triton`` expert backend: the CUDA tests, then the whole routed expert
path (forward with autograd on, and forward + backward) against the ``grouped_mm`` backend and a
dense bf16 matmul of the same run, at real model shapes.

Usage (repository root, GPU machine): ``PYTHONPATH=src python benchmarks/triton_round.py``
Full logs go to ``$OUT`` (or ``--out``); a short table is printed last.
FLOP convention (SonicMoE's): fwd = 6*T*K*H*I, bwd = 12*T*K*H*I.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

CONFIGS = {  # name: (T, H, I, E, K)
    "sonic-7b": (24576, 1536, 256, 128, 8),
    "qwen3-30b-a3b": (32768, 2048, 768, 128, 8),
}


def run_tests(out_dir: str) -> str:
    env = dict(os.environ, MOEYARD_TRITON_AUTOTUNE="0", PYTHONUNBUFFERED="1")
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "tests/cuda/test_triton_cuda.py"],
                          capture_output=True, text=True, env=env)
    log = proc.stdout + proc.stderr
    with open(os.path.join(out_dir, "tests.log"), "w") as f:
        f.write(log)
    tail = [line for line in log.splitlines() if line.strip()][-1:]
    summary = f"tests rc={proc.returncode} ({time.time() - t0:.0f}s): {tail[0] if tail else ''}"
    if proc.returncode:
        print(log[-6000:])
    return summary


def make_inputs(T, H, I, E, K, dtype=torch.bfloat16, seed=0):
    g = torch.Generator("cuda").manual_seed(seed)
    dev = "cuda"
    x = torch.randn(T, H, device=dev, dtype=dtype, generator=g)
    w_up = (torch.randn(E, 2 * I, H, device=dev, generator=g) / H ** 0.5).to(dtype)
    w_down = (torch.randn(E, H, I, device=dev, generator=g) / I ** 0.5).to(dtype)
    logits = torch.randn(T, E, device=dev, generator=g)
    tw, ids = logits.softmax(-1).topk(K, dim=-1)
    tw = (tw / tw.sum(-1, keepdim=True)).to(dtype)
    dout = torch.randn(T, H, device=dev, dtype=dtype, generator=g)
    return [t.requires_grad_() for t in (x, w_up, w_down, tw)], ids, dout


def timed(fn, reps: int, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` over ``reps`` runs (CUDA events)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def bench_backend(backend, shape, reps):
    import moeyard
    from moeyard.experts import triton as _triton  # noqa: F401  (registers "triton")
    (x, w_up, w_down, tw), ids, dout = make_inputs(*shape)

    def fwd():
        return moeyard.experts(x, ids, tw, w_up, w_down, backend=backend)

    def fwd_bwd():
        return torch.autograd.grad(fwd(), (x, w_up, w_down, tw), dout)

    fwd_bwd()  # compile / autotune
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd_bwd()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
    return timed(fwd, reps), timed(fwd_bwd, reps), peak


def parity(shape):
    """Relative difference triton vs grouped_mm (bf16) on the benchmark shape: out and dx."""
    import moeyard
    from moeyard.experts import triton as _triton  # noqa: F401  (registers "triton")
    (x, w_up, w_down, tw), ids, dout = make_inputs(*shape, seed=7)
    res = {}
    for b in ("triton", "grouped_mm"):
        out = moeyard.experts(x, ids, tw, w_up, w_down, backend=b)
        res[b] = [out] + list(torch.autograd.grad(out, (x, w_up, w_down, tw), dout))
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    return [rel(a, b) for a, b in zip(res["triton"], res["grouped_mm"])]


def dense_tflops(reps: int) -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = timed(lambda: a @ b, reps)
    return 2 * 8192 ** 3 / ms / 1e9


def profile(shape, out_dir):
    import moeyard
    from moeyard.experts import triton as _triton  # noqa: F401  (registers "triton")
    from torch.profiler import ProfilerActivity, profile as prof
    (x, w_up, w_down, tw), ids, dout = make_inputs(*shape)
    step = lambda: torch.autograd.grad(moeyard.experts(x, ids, tw, w_up, w_down, backend="triton"),  # noqa: E731
                                       (x, w_up, w_down, tw), dout)
    step()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    table = p.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60)
    with open(os.path.join(out_dir, "profile.txt"), "w") as f:
        f.write(table)
    return table


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/triton_round"))
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--backends", default="grouped_mm,triton")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--profile", default="qwen3-30b-a3b")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d %H:%M')}",
          flush=True)
    summary = [] if args.skip_tests else [run_tests(args.out)]
    print(*summary, flush=True)
    dense = dense_tflops(args.reps)
    rows = []
    for name in args.configs.split(","):
        shape = CONFIGS[name]
        T, H, I, E, K = shape
        flops = 6 * T * K * H * I
        for b in args.backends.split(","):
            t0 = time.time()
            f_ms, fb_ms, peak = bench_backend(b, shape, args.reps)
            rows.append((name, b, f_ms, flops / f_ms / 1e9, fb_ms, 3 * flops / fb_ms / 1e9, peak))
            print(f"{name} {b}: fwd {f_ms:.2f} ms, fwd+bwd {fb_ms:.2f} ms, peak {peak:.2f} GiB "
                  f"({time.time() - t0:.0f}s)", flush=True)
        if "triton" in args.backends and "grouped_mm" in args.backends:
            diffs = parity(shape)
            summary.append(f"{name} triton vs grouped_mm rel diff (out, dx, dw_up, dw_down, dtw): "
                           + ", ".join(f"{d:.1e}" for d in diffs))
        if name == args.profile:
            print(profile(shape, args.out), flush=True)
    lines = [*summary, f"dense bf16 8192^3: {dense:.0f} TFLOP/s",
             "| config | backend | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | peak GiB |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {n} | {b} | {f:.2f} | {ft:.0f} | {fb:.2f} | {fbt:.0f} | {p:.2f} |" for n, b, f, ft, fb, fbt, p in rows]
    text = "\n".join(lines)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
