"""What is alive at the peak of one training step of the ``triton`` layer, eager and under
``torch.compile``: records the CUDA caching allocator's history over one fwd+bwd, replays it to find
the peak, and prints the blocks alive there (size, count, the moeyard / Inductor frames that made
them; a block with no frames was made by the autograd engine itself). ``benchmarks/NOTES.md`` round 28.

    MODEL=qwen3-30b-a3b [MODE=default] OUT=dir PYTHONPATH=src python benchmarks/mem_peak.py
"""

import collections
import os

import torch

from moeyard.bench import BenchOptions, build, make_inputs
from moeyard.bench.models import get_model, routed_only

OUT = os.environ.get("OUT", "/tmp")
shape = get_model(os.environ.get("MODEL", "qwen3-30b-a3b"))
opts = BenchOptions(device="cuda", dtype="bfloat16")
cfg = routed_only(shape.moe_config())
inputs = make_inputs(shape, opts)
dev = torch.device("cuda")


def frames_of(ev):
    fr = ev.get("frames") or []
    keep = [
        f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}"
        for f in fr
        if "moeyard" in f["filename"]
        or "mem_peak" in f["filename"]
        or "torch/_inductor" in f["filename"]
        or "torch/autograd" in f["filename"]
        or "output_code" in f["filename"]
        or "/tmp/" in f["filename"]
    ]
    return " < ".join(keep[:5])


def analyse(tag, mode):
    torch.manual_seed(0)
    layer = build("triton", cfg, dev, torch.bfloat16)
    with torch.no_grad():
        layer.router.weight.copy_(inputs.router_weight)
    fn = layer if mode is None else torch.compile(layer, mode=mode)
    params = [p for p in layer.parameters() if p.requires_grad]

    def step(i):
        for t in params + inputs.xs:
            t.grad = None
        fn(inputs.xs[i]).backward(inputs.dys[i])

    for i in range(3):
        step(i % len(inputs.xs))
    for t in params + inputs.xs:
        t.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
    step(0)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak = torch.cuda.max_memory_allocated() - base
    live, total, best, best_set = {}, 0, -1, None
    for ev in snap["device_traces"][0]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            total += ev["size"]
        elif ev["action"] in ("free_requested",):
            e = live.pop(ev["addr"], None)
            if e is not None:
                total -= e["size"]
        if total > best:
            best, best_set = total, dict(live)
    print(
        f"== {tag}: peak extra {peak / 2**30:.3f} GiB; traced live-at-peak (allocated in step) {best / 2**30:.3f} GiB"
    )
    agg = collections.Counter()
    for e in best_set.values():
        agg[(e["size"], frames_of(e))] += 1
    for (size, where), n in sorted(agg.items(), key=lambda kv: -kv[0][0] * kv[1])[:25]:
        print(f"  {n} x {size / 2**20:9.2f} MiB  {where}")
    with open(f"{OUT}/mem_{tag}.txt", "w") as f:
        for (size, where), n in sorted(agg.items(), key=lambda kv: -kv[0][0] * kv[1]):
            f.write(f"{n} x {size} {where}\n")


analyse("eager", None)
analyse("compiled", os.environ.get("MODE", "default"))
