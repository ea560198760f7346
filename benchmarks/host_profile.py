"""Where the host time of a layer step goes: one forward + backward of a ``moeyard.MoE`` (routed experts by
default, bf16) at a model's sizes but few tokens, so the GPU finishes each kernel before the next is issued and
the step's wall time is the host's; per recipe, the host ms per step and the Python functions that take
it (``cProfile``, own time and cumulative time).

Usage (GPU machine): ``PYTHONPATH=src python3 benchmarks/host_profile.py [--model sonic-7b] [--tokens 256]
[--recipes none,fp8_rowwise_gw_hp] [--top 25] [--callers REGEX] [--shared]`` (``--shared``: keep the model's
shared experts, whose host cost the routed-only layer leaves out)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

import torch

import moeyard
from moeyard.bench.models import get_model, routed_only


def host_ms(step, n: int) -> float:
    """Wall ms per call of ``step`` over ``n`` calls, synchronised once at the end."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="sonic-7b")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--recipes", default="none,fp8_rowwise_gw_hp")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--callers", default="", help="also list the callers of the functions matching this regex")
    p.add_argument("--shared", action="store_true", help="keep the model's shared experts (default: routed only)")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    cfg = get_model(args.model).moe_config()
    cfg = cfg if args.shared else routed_only(cfg)
    x = torch.randn(args.tokens, cfg.hidden_size, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    for recipe in args.recipes.split(","):
        moe = moeyard.MoE(
            cfg, backend="triton", recipe=None if recipe == "none" else recipe, device=dev, dtype=torch.bfloat16
        )

        def fwd(moe=moe):
            return moe(x)

        def step(moe=moe):
            x.grad = None
            for t in moe.parameters():
                t.grad = None
            moe(x).backward(dy)

        for _ in range(5):
            step()
        f_ms, s_ms = host_ms(fwd, args.steps), host_ms(step, args.steps)
        print(
            f"\n== {args.model} sizes, {args.tokens} tokens · recipe {recipe}: fwd {f_ms:.3f} ms, fwd+bwd {s_ms:.3f} ms"
        )
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        prof.disable()
        for key in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(args.top)
            lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
            start = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls"))
            print(f"-- by {key} ({args.steps} steps)")
            print("\n".join(lines[start : start + args.top + 1]))
        if args.callers:
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_callers(args.callers)
            print(f"-- callers of {args.callers!r}")
            print("\n".join(ln for ln in buf.getvalue().splitlines() if ln.strip()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
