"""The local experts at K = 1 on one GPU, as an expert-parallel rank calls them: device kernels and ms.

Three calls per shape (``triton`` backend, bf16, swiglu, 64 local experts): the routed rows alone with
``drop_invalid=True`` (``all_to_all``'s rows, and ``moeyard bench --ep``'s one-GPU figure), the same rows
padded to twice as many with ``drop_invalid="unwritten"`` (``sync_free``'s static rows) and with ``True``.
Prints each call's median ms (CUDA events, 30 runs after 5) and its top kernels (``torch.profiler``, three
calls), then a table; writes ``$OUT/k1_profile.json`` (default ``.``)::

    PYTHONPATH=src python benchmarks/k1_profile.py
"""

import functools
import json
import os

import torch

from moeyard import experts

DEV, BF16 = torch.device("cuda"), torch.bfloat16
SHAPES = (("sonic-7b, EP 2", 1536, 256, 196608), ("qwen3-30b-a3b, EP 2", 2048, 768, 262144))  # name, H, I, rows
LOCAL_EXPERTS = 64


def median_ms(fn, iters: int = 30, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[iters // 2]


def kernels(fn, calls: int = 3) -> list[tuple[str, float]]:
    """``(kernel, ms per call)``, the largest first."""
    act = torch.profiler.ProfilerActivity
    with torch.profiler.profile(activities=[act.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = [(e.key[:60], e.device_time_total / calls / 1e3) for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(out, key=lambda t: -t[1])[:6]


def case(name: str, H: int, I: int, live: int) -> list[dict]:
    El = LOCAL_EXPERTS
    g = torch.Generator().manual_seed(0)
    ids = torch.sort(torch.randint(0, El, (live,), generator=g))[0]
    w_up = (torch.randn(El, 2 * I, H, device=DEV) / H**0.5).to(BF16)
    w_down = (torch.randn(El, H, I, device=DEV) / I**0.5).to(BF16)
    rows = []
    for mode, n, drop in (
        ("routed rows, True", live, True),
        ("2x rows, unwritten", 2 * live, "unwritten"),
        ("2x rows, True", 2 * live, True),
    ):
        x = torch.randn(n, H, device=DEV).to(BF16)
        topk_ids = torch.full((n, 1), El, dtype=torch.int64)
        topk_ids[:live, 0] = ids
        topk_ids = topk_ids.to(DEV)
        w = torch.ones(n, 1, device=DEV, dtype=BF16)

        fn = functools.partial(
            experts, x, topk_ids, w, w_up, w_down, activation="swiglu", backend="triton", drop_invalid=drop
        )

        with torch.no_grad():
            ms, top = median_ms(fn), kernels(fn)
        rows.append(
            dict(shape=name, mode=mode, rows=n, live=live, ms=ms, tflops=6 * live * H * I / ms / 1e9, kernels=top)
        )
        print(name, mode, [(k, round(t, 3)) for k, t in top[:4]], flush=True)
    return rows


def main() -> None:
    rows = [r for shape in SHAPES for r in case(*shape)]
    with open(os.path.join(os.environ.get("OUT", "."), "k1_profile.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print(f"\n{'shape':<22}{'call':<22}{'rows':>8}{'ms':>8}{'TFLOP/s':>9}")
    for r in rows:
        print(f"{r['shape']:<22}{r['mode']:<22}{r['rows']:>8}{r['ms']:>8.3f}{r['tflops']:>9.0f}")


if __name__ == "__main__":
    main()
