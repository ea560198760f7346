"""Which router implementation :func:`moeyard.routing.route` uses, read at every call.

``MOEYARD_ROUTER=auto|torch|fused`` (environment), or in code :func:`use_router` (a context manager;
it wins over the environment).

- ``auto`` (default): the fused Triton router (:mod:`moeyard.routing.fused`) for CUDA tensors when
  triton is installed, the torch path otherwise. On an H100 the whole layer's forward + backward takes
  0.24 ms (sonic-7b) and 0.33 ms (qwen3-30b-a3b) less device time and less host time with it
  (``benchmarks/host_time.py``, ``benchmarks/NOTES.md`` round 10).
- ``torch``: the chain of torch ops (the reference).
- ``fused``: the fused router wherever it applies, also on CPU under ``TRITON_INTERPRET=1``; it raises
  ImportError without triton.

The fused router is used only where it applies (:func:`moeyard.routing.fused.unsupported` says why
not: grouped top-k, float64, ...); elsewhere the torch path runs.
"""

from __future__ import annotations

import contextlib
import os

ENV = "MOEYARD_ROUTER"
IMPLS = ("auto", "torch", "fused")
DEFAULT = "auto"
_OVERRIDE: list[str | None] = [None]


def _check(impl, source: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"{source}: expected one of {IMPLS}, got {impl!r}")
    return impl


def router_impl() -> str:
    """The implementation in force now: a :func:`use_router` override, else ``MOEYARD_ROUTER``, else
    ``auto``.

    Raises:
        ValueError: ``MOEYARD_ROUTER`` is set to something else than ``auto``, ``torch`` or ``fused``.
    """
    if _OVERRIDE[0] is not None:
        return _OVERRIDE[0]
    raw = os.environ.get(ENV, "")
    return DEFAULT if raw == "" else _check(raw, ENV)


@contextlib.contextmanager
def use_router(impl: str):
    """Use router implementation ``impl`` (``"auto"``, ``"torch"`` or ``"fused"``) inside a ``with`` block.

    Raises:
        ValueError: an unknown ``impl``.
    """
    _check(impl, "impl")
    saved = _OVERRIDE[0]
    _OVERRIDE[0] = impl
    try:
        yield
    finally:
        _OVERRIDE[0] = saved
