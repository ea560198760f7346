"""What is alive at the peak of one forward + backward of a ``moeyard.MoE`` (routed experts, bf16) under
each recipe: the peak extra bytes (above what was allocated before the step, as ``moeyard bench`` counts
them) and the tensors alive at that moment, grouped by the moeyard line that allocated them, from
``torch.cuda.memory._record_memory_history``.

Usage (GPU machine): ``PYTHONPATH=src python3 benchmarks/memory_peak.py [--model qwen3-30b-a3b]
[--recipes none,fp8_rowwise_gw_hp] [--top 12]``
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import torch

import moeyard
from moeyard.bench.models import get_model, routed_only

GIB = 2**30


def _site(frames: list[dict]) -> str:
    """The innermost moeyard frame of an allocation's stack (else the innermost frame)."""
    for f in frames:
        if "moeyard" in f["filename"] and "memory_peak" not in f["filename"]:
            path = f["filename"].split("moeyard/")[-1]
            return f"{path}:{f['line']} {f['name']}"
    return f"{frames[0]['filename'].split('/')[-1]}:{frames[0]['line']} {frames[0]['name']}" if frames else "?"


def live_at_peak(trace: list[dict]) -> tuple[int, dict[str, int]]:
    """(peak bytes above the trace's start, {allocation site: bytes alive at the peak})."""
    live: dict[int, tuple[int, str]] = {}
    now = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], _site(e.get("frames", [])))
            now += e["size"]
            if now > peak:
                peak, at_peak = now, dict(live)
        elif e["action"] == "free_completed" and e["addr"] in live:
            now -= live.pop(e["addr"])[0]
    sites: dict[str, int] = defaultdict(int)
    for size, site in at_peak.values():
        sites[site] += size
    return peak, sites


def peak_of_step(moe, x: torch.Tensor, dy: torch.Tensor) -> tuple[float, int, dict[str, int]]:
    """(peak extra GiB by ``max_memory_allocated``, then :func:`live_at_peak` of the trace) of one fwd+bwd
    of ``moe`` after two warm-up steps, every gradient cleared before each step (as ``moeyard bench``)."""
    params = [t for t in moe.parameters() if t.requires_grad] + [x]

    def step():
        for t in params:
            t.grad = None
        moe(x).backward(dy)

    for _ in range(2):
        step()
    for t in params:
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    step()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    for t in params:
        t.grad = None
    counted = (torch.cuda.max_memory_allocated() - base) / GIB
    return (counted, *live_at_peak(snap["device_traces"][x.device.index or 0]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", default=[])
    p.add_argument("--recipes", default="none,fp8_rowwise_gw_hp")
    p.add_argument("--backend", default="triton")
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    for name in args.model or ["qwen3-30b-a3b"]:
        shape = get_model(name)
        cfg = routed_only(shape.moe_config())
        torch.manual_seed(0)
        x = torch.randn(shape.tokens, cfg.hidden_size, device=dev, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)
        for recipe in args.recipes.split(","):
            moe = moeyard.MoE(
                cfg, backend=args.backend, recipe=None if recipe == "none" else recipe, device=dev, dtype=torch.bfloat16
            )
            counted, peak, sites = peak_of_step(moe, x, dy)
            print(
                f"\n== {name} · {args.backend} · recipe {recipe}: peak extra {counted:.2f} GiB (trace {peak / GIB:.2f})"
            )
            for site, size in sorted(sites.items(), key=lambda kv: -kv[1])[: args.top]:
                print(f"  {size / GIB:7.3f} GiB  {site}")
            del moe
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
