"""The A/B runs of ``benchmarks/gpu_fp8.sh``'s ``ab`` step in one short table: for each shape and
implementation, every run's fwd+bwd ms from this tree and from the base tree (runs interleaved), the
medians and their difference.

Usage (GPU machine, after the ``ab`` step)::

    python3 benchmarks/ab_table.py OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path


def collect(folder: Path) -> dict[tuple[str, str], dict[str, list[float]]]:
    """``{(case, impl): {"this": [ms, ...], "base": [ms, ...]}}`` from ``ab_{this,base}_N.json`` in ``folder``
    (moeyard's rows only: peers are timed by each tree alike)."""
    runs: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: {"this": [], "base": []})
    for path in sorted(folder.glob("ab_*_*.json")):
        tree = path.stem.split("_")[1]
        if tree not in ("this", "base"):
            continue
        for row in json.loads(path.read_text())["rows"]:
            if row.get("kind") == "moeyard" and row.get("fwdbwd_ms") is not None:
                runs[(row["case"], row["impl"])][tree].append(row["fwdbwd_ms"])
    return runs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path)
    args = p.parse_args(argv)
    runs = collect(args.folder)
    if not runs:
        print(f"no ab_*_N.json rows in {args.folder}")
        return 1
    print(f"{'case':<18} {'impl':<26} {'this ms (runs)':<26} {'base ms (runs)':<26} {'median diff':>11}")
    for (case, impl), trees in runs.items():
        this, base = trees["this"], trees["base"]
        diff = statistics.median(this) - statistics.median(base) if this and base else float("nan")
        cells = [" ".join(f"{v:.2f}" for v in t) or "-" for t in (this, base)]
        print(f"{case:<18} {impl:<26} {cells[0]:<26} {cells[1]:<26} {diff:+11.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
