"""The weak-scaling table of ``moeyard bench --ep N`` runs at several N (their ``--json`` files).

Each file holds, per (case, routing, dispatcher), the slowest rank's expert-parallel step (forward +
backward, ``overlap_chunks`` 1) and the same step on one GPU on each rank's own tokens (all E experts,
no exchange), whose ratio is the per-GPU throughput against one GPU (``weak_scaling`` in the JSON,
:func:`moeyard.bench.ep.weak_scaling`). This prints one markdown row per (case, step, routing,
dispatcher) with, for each N, the expert-parallel ms and that ratio, and the target line (>= 85% per
GPU at EP 4, balanced routing).

    python benchmarks/ep_scaling_table.py out/bench_ep1_*.json out/bench_ep2_*.json out/bench_ep4_*.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def load(paths: list[str]) -> dict:
    """``{(case, step, routing, dispatcher): {N: weak-scaling entry}}`` from the JSON files."""
    rows: dict = defaultdict(dict)
    for path in paths:
        with open(path) as f:
            result = json.load(f)
        W = result["world_size"]
        step = f"LoRA r={result['lora_rank']}" if result.get("lora_rank") else "bf16 train"
        for s in result["weak_scaling"]:
            label = s["dispatcher"] + (f" ({s['exchange']})" if s["exchange"] not in ("auto", None) else "")
            rows[(s["case"], step, s["routing"], label)][W] = s
    return rows


def table(rows: dict) -> str:
    sizes = sorted({n for per in rows.values() for n in per})
    head = "| case | step | routing | dispatcher | " + " | ".join(f"EP{n} ms (per GPU vs 1 GPU)" for n in sizes) + " |"
    lines = [head, "|" + "---|" * (4 + len(sizes))]
    for (case, step, routing, dispatcher), per in sorted(rows.items()):
        cells = [f"{per[n]['ep_fwd_bwd_ms']:.2f} ({per[n]['per_gpu']:.0%})" if n in per else "-" for n in sizes]
        lines.append(f"| {case} | {step} | {routing} | {dispatcher} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="+", help="moeyard bench --ep N --json files")
    args = ap.parse_args(argv)
    rows = load(args.json)
    print(table(rows))
    at4 = [per[4]["per_gpu"] for (_, _, routing, _), per in rows.items() if routing == "balanced" and 4 in per]
    if at4:
        print(f"\nEP4 balanced: best {max(at4):.0%}, worst {min(at4):.0%} per GPU against one GPU (target >= 85%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
