"""Split vs fused LoRA in the triton backend: the LoRA training step of the routed experts (base
frozen) timed with ``lora_mode=split`` and ``lora_mode=fused`` at model shapes and ranks, in one
process, to choose the default of the ``lora_mode`` option (:mod:`moeyard.experts.triton.options`).

    python benchmarks/lora_crossover.py [--ranks 16 64] [--models ...] [--tokens T] [--json PATH]

Prints one row per (shape, rank): split ms, fused ms and the faster mode.
"""

from __future__ import annotations

import argparse
import json

import torch

from moeyard import bench
from moeyard.bench import lora as bench_lora
from moeyard.bench.models import get_model, with_tokens
from moeyard.experts.triton import options

MODELS = (
    "qwen3-30b-a3b",
    "qwen3.5-35b-a3b",
    "olmoe-1b-7b",
    "mixtral-8x7b",
    "gpt-oss-20b",
    "sonic-120b",
    "qwen3-235b-a22b",
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--ranks", nargs="+", type=int, default=[16, 64])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json")
    a = p.parse_args()
    opts = bench.resolve_options(bench.BenchOptions(iters=a.iters, warmup=3))
    rows = []
    print(f"{'shape':18} {'r':>3} {'split ms':>9} {'fused ms':>9} {'faster':>7}", flush=True)
    for name in a.models:
        shape = with_tokens(get_model(name), a.tokens)
        for rank in a.ranks:
            torch.manual_seed(0)
            case = bench_lora.make_case(shape, rank, torch.device(opts.device), torch.bfloat16)
            T, H, I, E, K = case.sizes
            ms = {}
            for mode in ("split", "fused"):
                with options.use_options(lora_mode=mode):
                    ms[mode] = bench_lora.measure(bench_lora.build("lora", case), case, opts)["step_ms"]
            best = min(ms, key=ms.get)
            rows.append(
                dict(
                    shape=name, T=T, H=H, I=I, E=E, k=K, rank=rank, **{f"{m}_ms": v for m, v in ms.items()}, faster=best
                )
            )
            print(f"{name:18} {rank:>3} {ms['split']:9.3f} {ms['fused']:9.3f} {best:>7}", flush=True)
            del case
            bench.free_memory(opts.device)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
