"""Host time against device time of one MoE layer step, each measured alone, without a profiler.

    python benchmarks/host_time.py [--models sonic-7b,qwen3-30b-a3b] [--backends triton,torch_gmm]
        [--routers torch,fused] [--iters 20] [--top 25] [--steps infer,fwd,fwdbwd] [--forward]
        [--tokens 1,64,4096] [--json PATH]

A step is the benchmark's forward + backward (``moeyard bench``: routed experts only, bf16, fresh
``randn`` inputs, gradients set to None first: ``fwdbwd``); ``fwd``, its forward alone (inputs still
requiring grad, as ``moeyard bench`` times the forward); ``infer``, the forward under
``torch.inference_mode`` (generation, evaluation). ``--steps`` lists the steps to time (default
``fwdbwd``; ``--forward`` is ``--steps fwd``); ``--tokens`` replaces each shape's token count by each
of a list (decoding a batch of sequences is a call of a few tokens). Per (shape, tokens, backend,
router, step):

- **host ms**: ``time.perf_counter`` around the step's Python after a synchronisation, the GPU free to
  run each kernel as it arrives: the time the host needs to issue the step (launches are
  asynchronous, so it waits on the device only at a host sync).
- **held host ms**: the same while the GPU is held busy by a ``torch.cuda._sleep`` queued before the
  step. A step that synchronises with the device waits out the sleep here (the ``sync?`` column flags
  held host ms above half the sleep). It exceeds host ms: issuing behind a busy GPU costs the host more.
- **device ms**: CUDA events around the step queued behind the sleep, so the device runs its kernels
  back to back: the time the GPU needs, optimistic (the kernels start after the sleep's spin, likely at
  higher clocks than under sustained load: 1.6-2.0 ms below the bench step at qwen3-30b-a3b on an H100).
- **step ms**: the step as ``moeyard bench`` times it (CUDA events, steps back to back,
  :func:`moeyard.bench.time_ms`): about the larger of host ms and device ms.
- All are medians of ``--iters`` steps after warm-up. ``host / device`` above 1 means a benchmark that
  times steps one after another measures host time, and a training step whose layers are this small
  is host-bound too.

Then, with ``--top N``, a ``cProfile`` of ``--iters`` host-only steps of each row (the GPU again held
busy; autograd's backward on the calling thread, so its Python shows) sorted by own time: where the
host time goes (and the top N by cumulative time). Needs CUDA.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch

from moeyard import bench
from moeyard.bench.models import get_model, routed_only, with_tokens
from moeyard.routing import use_router

SLEEP_CYCLES = 200_000_000  # ~0.1 s at H100 clocks: longer than any step's host time


def _step(module, inputs, params, i: int, step: str = "fwdbwd") -> None:
    if step == "infer":
        with torch.inference_mode():
            module(inputs.xs[i])
        return
    for t in params + inputs.xs:
        t.grad = None
    out = module(inputs.xs[i])
    if step == "fwdbwd":
        out.backward(inputs.dys[i])


def measure(module, inputs, iters: int, warmup: int = 3, step: str = "fwdbwd") -> dict:
    """``host_ms``, ``held_host_ms``, ``device_ms``, ``step_ms`` (medians) and ``sleep_ms`` of the step
    (module docstring)."""
    params = [p for p in module.parameters() if p.requires_grad]
    n = len(inputs.xs)
    for i in range(warmup):
        _step(module, inputs, params, i % n, step)
    torch.cuda.synchronize()
    s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s0.record()
    torch.cuda._sleep(SLEEP_CYCLES)
    s1.record()
    torch.cuda.synchronize()
    sleep_ms = s0.elapsed_time(s1)
    host, device = [], []
    for i in range(iters):
        torch.cuda._sleep(SLEEP_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        _step(module, inputs, params, i % n, step)
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        torch.cuda.synchronize()
        device.append(start.elapsed_time(end))
    free = []
    for i in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        _step(module, inputs, params, i % n, step)
        free.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    step_ms = bench.time_ms(lambda i: _step(module, inputs, params, i % n, step), n, 0, iters, torch.device("cuda"))
    return dict(
        host_ms=statistics.median(free),
        held_host_ms=statistics.median(host),
        device_ms=statistics.median(device),
        step_ms=step_ms,
        sleep_ms=sleep_ms,
    )


def profile_host(module, inputs, iters: int, top: int, dump: str | None = None, step: str = "fwdbwd") -> str:
    """``cProfile`` of ``iters`` steps' host work (GPU held busy): the ``top`` functions by own time,
    then by cumulative time; the raw stats into file ``dump`` when given (``pstats.Stats(dump)``)."""
    params = [p for p in module.parameters() if p.requires_grad]
    prof = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):  # backward on this thread: cProfile sees it
        for i in range(iters):
            torch.cuda._sleep(SLEEP_CYCLES)
            prof.enable()
            _step(module, inputs, params, i % len(inputs.xs), step)
            prof.disable()
            torch.cuda.synchronize()
    if dump:
        prof.dump_stats(dump)
    buf = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(top)
    return buf.getvalue()


HEADER = (
    f"{'model':16} {'tokens':>6} {'backend':10} {'router':7} {'step':6} {'host ms':>8} {'held host':>9} "
    f"{'device ms':>9} {'step ms':>8} {'host/dev':>8}  sync?"
)


def _row(r: dict) -> str:
    """One row of the table (:data:`HEADER`)."""
    sync = "yes" if r["held_host_ms"] > r["sleep_ms"] / 2 else "no"
    return (
        f"{r['model']:16} {r['tokens']:6d} {r['backend']:10} {r['router']:7} {r['step']:6} {r['host_ms']:8.3f} "
        f"{r['held_host_ms']:9.3f} {r['device_ms']:9.3f} {r['step_ms']:8.3f} "
        f"{r['host_ms'] / r['device_ms']:8.2f}  {sync}"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="sonic-7b,qwen3-30b-a3b")
    p.add_argument("--backends", default="triton,torch_gmm")
    p.add_argument("--routers", default="torch", help="comma list of routers (moeyard.routing.use_router)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--top", type=int, default=0, help="cProfile: print the N functions with most own time")
    p.add_argument("--pstats", default=None, help="directory: each row's raw cProfile stats (with --top)")
    p.add_argument(
        "--steps",
        default="fwdbwd",
        help="comma list of infer (forward under inference_mode), fwd (the forward alone), fwdbwd",
    )
    p.add_argument("--tokens", default=None, help="comma list of token counts replacing each shape's")
    p.add_argument("--forward", action="store_true", help="time the forward alone (--steps fwd)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_time.py needs CUDA", file=sys.stderr)
        return 2
    if a.iters < 1:
        raise ValueError(f"--iters: expected >= 1, got {a.iters}")
    steps = ["fwd"] if a.forward else a.steps.split(",")
    if not steps or set(steps) - {"infer", "fwd", "fwdbwd"}:
        raise ValueError(f"--steps: expected a comma list of infer, fwd, fwdbwd, got {a.steps!r}")
    tokens = [None] if a.tokens is None else [int(t) for t in a.tokens.split(",")]
    if any(t is not None and t < 1 for t in tokens):
        raise ValueError(f"--tokens: expected positive integers, got {a.tokens!r}")
    if a.pstats:
        os.makedirs(a.pstats, exist_ok=True)
    rows, profiles = [], []
    for model, T in [(m, t) for m in a.models.split(",") for t in tokens]:
        shape = get_model(model) if T is None else with_tokens(get_model(model), T)
        opts = bench.resolve_options(bench.BenchOptions(models=[model], routed_only=True, device="cuda"))
        torch.manual_seed(0)
        inputs = bench.make_inputs(shape, opts)
        for backend in a.backends.split(","):
            torch.manual_seed(0)
            module = bench.build(backend, routed_only(shape.moe_config()), "cuda", torch.bfloat16)
            with torch.no_grad():
                module.router.weight.copy_(inputs.router_weight)
            for router in a.routers.split(","):
                for step in steps:
                    with use_router(router):
                        r = measure(module, inputs, a.iters, step=step)
                        if a.top:
                            name = f"{model}-T{shape.tokens}-{backend}-{router}-{step}"
                            dump = a.pstats and os.path.join(a.pstats, f"{name}.pstats")
                            text = profile_host(module, inputs, a.iters, a.top, dump, step)
                            profiles.append((f"{model} T={shape.tokens} {backend} router={router} step={step}", text))
                    rows.append(dict(model=model, tokens=shape.tokens, backend=backend, router=router, step=step, **r))
                    print(_row(rows[-1]), flush=True)  # as it goes: a run cut short keeps its rows
            del module
            torch.cuda.empty_cache()
    for name, text in profiles:
        print(f"## cProfile {name} ({a.iters} steps)\n{text}")
    print(HEADER)
    for r in rows:
        print(_row(r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
