"""Where a layer step's host time goes at the kernel launches, and what :mod:`moeyard.launch` saves.

    PYTHONPATH=src python3 benchmarks/launch_probe.py [--shapes qwen3-30b-a3b:64:none,sonic-7b:256:fp8_rowwise_gw_hp]
        [--rounds 8] [--steps 20] [--parts ab,split,launcher]

Each shape is ``model:tokens:recipe`` (``none``: bf16), the ``triton`` backend, routed experts, an eager forward +
backward (inputs and gradients as ``moeyard bench``'s). Parts, host ms (``time.perf_counter`` around the step's
Python after a synchronisation; medians, and minima where said):

- ``ab``: the direct launch path (:mod:`moeyard.launch`) against Triton's own, interleaved: ``--rounds`` rounds of
  ``--steps`` steps each way; median and min per path.
- ``split``: the step issued behind a GPU held busy (``torch.cuda._sleep``), as is; the time spent inside
  ``JITFunction.run`` (Triton's launch path, the direct path off) and the launches per step; the step with every
  launch skipped (bf16 only: the FP8 path's index tensors come from kernels), which leaves the layer's Python and
  torch ops; and the aten ops per step.
- ``launcher``: each launch's compiled launcher (``CudaLauncher.__call__``) and the C launch inside it, µs, in step
  order, with the kernel's argument count.

Needs CUDA; patches Triton's classes only inside this process, for the measurement.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moeyard
from moeyard import launch
from moeyard.bench.models import get_model, routed_only

SLEEP_CYCLES = 400_000_000  # a held GPU: longer than any step's host time


def _layer(model: str, tokens: int, recipe: str | None):
    cfg = routed_only(get_model(model).moe_config())
    dev = torch.device("cuda")
    moe = moeyard.MoE(cfg, backend="triton", recipe=recipe, device=dev, dtype=torch.bfloat16)
    xs = [torch.randn(tokens, cfg.hidden_size, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(4)]
    dy = torch.randn_like(xs[0])
    params = [p for p in moe.parameters() if p.requires_grad]

    def step(i: int) -> None:
        for t in params + xs:
            t.grad = None
        moe(xs[i % len(xs)]).backward(dy)

    return step


def _host_ms(step, steps: int, held: bool = False) -> list[float]:
    for i in range(3):
        step(i)
    torch.cuda.synchronize()
    out = []
    for i in range(steps):
        if held:
            torch.cuda._sleep(SLEEP_CYCLES)
        t0 = time.perf_counter()
        step(i)
        out.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    return out


def ab(step, rounds: int, steps: int) -> str:
    res: dict[bool, list[float]] = {True: [], False: []}
    previous = launch.enabled()
    try:
        for _ in range(rounds):
            for flag in (True, False):
                launch.set_enabled(flag)
                res[flag] += _host_ms(step, steps)
    finally:
        launch.set_enabled(previous)
    med, low = statistics.median, min
    return (
        f"direct / Triton's path, host ms median (min): {med(res[True]):.3f} ({low(res[True]):.3f}) / "
        f"{med(res[False]):.3f} ({low(res[False]):.3f})"
    )


def _jit_classes():
    from triton.experimental import gluon  # noqa: F401  (its JIT class, a subclass)
    from triton.runtime.jit import JITFunction

    out, todo = [], [JITFunction]
    while todo:
        c = todo.pop()
        out.append(c)
        todo += c.__subclasses__()
    return {c: c.__dict__["run"] for c in out if "run" in c.__dict__}


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n[str(func)] += 1
        return func(*args, **(kwargs or {}))


def split(step, steps: int, bf16: bool) -> str:
    previous = launch.set_enabled(False)
    owners = _jit_classes()
    spent = [0.0, 0]

    def timed(real):
        def run(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return real(self, *a, **k)
            finally:
                spent[0] += time.perf_counter() - t0
                spent[1] += 1

        return run

    try:
        whole = statistics.median(_host_ms(step, steps, held=True))
        for c, real in owners.items():
            c.run = timed(real)
        spent[:] = [0.0, 0]
        _host_ms(step, steps, held=True)
        calls = steps + 3
        in_run, launches = spent[0] * 1e3 / calls, spent[1] / calls
        skipped = "-"
        if bf16:
            for c in owners:
                c.run = lambda self, *a, **k: None
            skipped = f"{statistics.median(_host_ms(step, steps, held=True)):.3f}"
    finally:
        for c, real in owners.items():
            c.run = real
        launch.set_enabled(previous)
    ops = _Ops()
    with ops:
        step(0)
    top = ", ".join(f"{k.replace('aten.', '')} x{v}" for k, v in ops.n.most_common(8))
    return (
        f"held GPU, host ms: step {whole:.3f}, inside JITFunction.run {in_run:.3f} over {launches:.1f} launches, "
        f"every launch skipped {skipped}; aten ops {sum(ops.n.values())} ({top})"
    )


def launcher(step, steps: int) -> str:
    import triton.backends.nvidia.driver as nvd

    real = nvd.CudaLauncher.__call__
    rec = []

    def timed(self, *a, **k):
        inner, box = self.launch, [0.0]

        def c_launch(*aa, **kk):
            t0 = time.perf_counter()
            try:
                return inner(*aa, **kk)
            finally:
                box[0] = time.perf_counter() - t0

        self.launch = c_launch
        t0 = time.perf_counter()
        try:
            return real(self, *a, **k)
        finally:
            self.launch = inner
            rec.append((time.perf_counter() - t0, box[0], len(a) - 9))

    _host_ms(step, 3)
    nvd.CudaLauncher.__call__ = timed
    try:
        _host_ms(step, steps)
    finally:
        nvd.CudaLauncher.__call__ = real
    per = len(rec) // (steps + 3)
    rows = []
    for j in range(per):
        rs = rec[j::per]
        rows.append(
            f"{1e6 * statistics.median(r[0] for r in rs):.1f} / {1e6 * statistics.median(r[1] for r in rs):.1f} "
            f"({rs[0][2]})"
        )
    return f"{per} launches, µs launcher / its C launch (arguments): " + ", ".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qwen3-30b-a3b:64:none,sonic-7b:256:fp8_rowwise_gw_hp")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--parts", default="ab,split,launcher")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("launch_probe.py needs CUDA", file=sys.stderr)
        return 2
    parts = a.parts.split(",")
    if set(parts) - {"ab", "split", "launcher"} or a.rounds < 1 or a.steps < 1:
        raise ValueError(f"--parts: a comma list of ab, split, launcher; --rounds, --steps >= 1 (got {a})")
    for spec in a.shapes.split(","):
        try:
            model, tokens, recipe = spec.split(":")
            tokens = int(tokens)
        except ValueError:
            raise ValueError(f"--shapes: expected model:tokens:recipe entries, got {spec!r}") from None
        recipe = None if recipe == "none" else recipe
        step = _layer(model, tokens, recipe)
        name = f"{model} T={tokens} {recipe or 'bf16'}"
        if "ab" in parts:
            print(f"{name}: {ab(step, a.rounds, a.steps)}", flush=True)
        if "split" in parts:
            print(f"{name}: {split(step, 2 * a.steps, recipe is None)}", flush=True)
        if "launcher" in parts:
            print(f"{name}: {launcher(step, a.steps)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
