"""``moeyard bench --trace DIR``: one extra profiled step per (case, implementation), after timing.

For each row the benchmark calls :func:`trace_step` with the step it timed; it writes

- ``DIR/<case>-<impl>.json``: a Chrome trace of one step (``torch.profiler``, CPU and, on CUDA,
  CUDA activities; open it in https://ui.perfetto.dev or ``chrome://tracing``), and
- on CUDA, ``DIR/<case>-<impl>-memory.pickle``: a CUDA caching-allocator snapshot of one more step
  (``torch.cuda.memory._record_memory_history`` / ``_dump_snapshot``, a private PyTorch API: guarded,
  a failure is a note, not an error; open it in https://pytorch.org/memory_viz). On CPU only the
  trace is written (the note says so).

File names keep ``[A-Za-z0-9._+-]`` of the case and implementation names; anything else becomes ``_``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

import torch

MEMORY_ENTRIES = 100_000  # allocator events kept by the memory snapshot


def check_trace_dir(path: str | os.PathLike | None) -> None:
    """Raise ValueError if ``path`` cannot be the ``--trace`` directory (it exists and is not a
    directory); ``None`` is fine (no tracing). The directory is created by :func:`trace_step`."""
    if path is None:
        return
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ValueError(f"--trace: expected a directory path, got {path!r}")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--trace: {str(path)!r} exists and is not a directory; expected a directory for the traces")


def file_stem(case: str, impl: str) -> str:
    """``<case>-<impl>`` with characters outside ``[A-Za-z0-9._+-]`` replaced by ``_``."""
    return re.sub(r"[^A-Za-z0-9._+-]", "_", f"{case}-{impl}")


def trace_step(step: Callable[[], object], directory: str | os.PathLike, stem: str, device: torch.device | str) -> dict:
    """Profile one call of ``step()`` and, on CUDA, record the allocator during one more.

    Args:
        step: one benchmark step (already warmed up); called twice on CUDA, once elsewhere.
        directory: the ``--trace`` directory (created if missing).
        stem: file name stem, e.g. from :func:`file_stem`.
        device: the device the step runs on.
    Returns:
        ``{"trace": path, "memory_snapshot": path or None, "trace_note": str}`` for the row.
    Raises:
        ValueError: ``directory`` exists and is not a directory.
    """
    check_trace_dir(directory)
    os.makedirs(directory, exist_ok=True)
    device = torch.device(device)
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    trace = os.path.join(directory, f"{stem}.json")
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        step()
        if cuda:
            torch.cuda.synchronize(device)
    prof.export_chrome_trace(trace)
    if not cuda:
        return {"trace": trace, "memory_snapshot": None, "trace_note": "CPU: trace only (no memory snapshot)"}
    snapshot = os.path.join(directory, f"{stem}-memory.pickle")
    note = _memory_snapshot(step, snapshot, device)
    return {"trace": trace, "memory_snapshot": None if note else snapshot, "trace_note": note}


def _memory_snapshot(step: Callable[[], object], path: str, device: torch.device) -> str:
    """Record the allocator's history over one ``step()`` into ``path``; "" or why it failed."""
    memory = torch.cuda.memory
    try:
        memory._record_memory_history(max_entries=MEMORY_ENTRIES, device=device)
    except (AttributeError, RuntimeError, TypeError) as ex:  # private API: it may change or be missing
        return f"no memory snapshot: {type(ex).__name__}: {ex}"
    try:
        step()
        torch.cuda.synchronize(device)
        memory._dump_snapshot(path)
        return ""
    except (AttributeError, RuntimeError, TypeError, OSError) as ex:
        return f"no memory snapshot: {type(ex).__name__}: {ex}"
    finally:
        try:
            memory._record_memory_history(enabled=None, device=device)
        except (AttributeError, RuntimeError, TypeError):
            pass
