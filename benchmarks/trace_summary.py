"""Host time against device time of one profiled step, from the Chrome traces of ``moeyard bench --trace``.

    python benchmarks/trace_summary.py DIR/*.json

Per trace: the host span (first start to last end of the host-side events: ``cpu_op``,
``cuda_runtime``, ``cuda_driver``, ``python_function``), the device busy time (kernels, copies and
memsets, overlaps merged) and span (first start to last end), the kernel launches, and the runtime
calls that make the host wait for the device or for the allocator (synchronisations, synchronous
copies, ``cudaMalloc`` / ``cudaFree``). A step whose host span exceeds its device busy time, with the
device idle in between, is host-bound: a benchmark that times steps back to back measures its host
time. The profiler adds a few microseconds per host event, so the host span is an upper bound.
"""

from __future__ import annotations

import argparse
import json
import sys

HOST_CATS = ("cpu_op", "cuda_runtime", "cuda_driver", "python_function")
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
WAITS = ("Synchronize", "cudaMemcpy", "cudaMalloc", "cudaFree")  # substrings of runtime call names


def _merged(intervals: list[tuple[float, float]]) -> float:
    """Total length (same unit) of the union of ``[start, end)`` intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            total += 0.0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (0.0 if cur_e is None else cur_e - cur_s)


def summarize(trace: dict) -> dict:
    """``host_ms``, ``device_busy_ms``, ``device_span_ms``, ``launches`` and ``waits`` (runtime call
    name -> count) of a Chrome trace dict (``torch.profiler`` export; event times in microseconds).

    Raises:
        ValueError: ``trace`` has no ``traceEvents`` list.
    """
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        raise ValueError("trace: expected a Chrome trace dict with a 'traceEvents' list")
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    host = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e.get("cat") in HOST_CATS]
    device = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e.get("cat") in DEVICE_CATS]
    runtime = [e for e in spans if e.get("cat") == "cuda_runtime"]
    waits: dict[str, int] = {}
    for e in runtime:
        if any(w in e.get("name", "") for w in WAITS):
            waits[e["name"]] = waits.get(e["name"], 0) + 1
    span = lambda iv: (max(e for _, e in iv) - min(s for s, _ in iv)) / 1e3 if iv else 0.0
    return dict(
        host_ms=span(host),
        device_busy_ms=_merged(device) / 1e3,
        device_span_ms=span(device),
        launches=sum(e.get("cat") in ("cuda_runtime", "cuda_driver") and "Launch" in e.get("name", "") for e in spans),
        waits=waits,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", help="Chrome trace JSON files (moeyard bench --trace DIR)")
    a = p.parse_args(argv)
    print(f"{'trace':48} {'host ms':>8} {'dev busy':>8} {'dev span':>8} {'launches':>8}  waits")
    for path in a.traces:
        with open(path) as f:
            s = summarize(json.load(f))
        waits = ", ".join(f"{k} x{v}" for k, v in sorted(s["waits"].items())) or "-"
        print(
            f"{path[-48:]:48} {s['host_ms']:8.3f} {s['device_busy_ms']:8.3f} {s['device_span_ms']:8.3f} "
            f"{s['launches']:8d}  {waits}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
