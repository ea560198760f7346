"""Which router implementation :func:`moeyard.routing.route` uses, read at every call.

``MOEYARD_ROUTER=torch|fused`` (environment), or in code :func:`use_router` (a context manager; it
wins over the environment). Default: ``torch`` (the chain of torch ops). The fused Triton router
(:mod:`moeyard.routing.fused`) takes half the torch path's device time per forward + backward
(``benchmarks/NOTES.md`` round 9) but timed slower with backward in the router-only bench (round 8,
host-bound), so it stays opt-in until whole-layer runs show the gain. ``fused`` is used only where it
applies (:func:`moeyard.routing.fused.unsupported` says why not); elsewhere the torch path runs.
"""
from __future__ import annotations

import contextlib
import os

ENV = "MOEYARD_ROUTER"
IMPLS = ("torch", "fused")
DEFAULT = "torch"
_OVERRIDE: list[str | None] = [None]


def _check(impl, source: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"{source}: expected one of {IMPLS}, got {impl!r}")
    return impl


def router_impl() -> str:
    """The implementation in force now: a :func:`use_router` override, else ``MOEYARD_ROUTER``, else
    ``torch``.

    Raises:
        ValueError: ``MOEYARD_ROUTER`` is set to something else than ``torch`` or ``fused``.
    """
    if _OVERRIDE[0] is not None:
        return _OVERRIDE[0]
    raw = os.environ.get(ENV, "")
    return DEFAULT if raw == "" else _check(raw, ENV)


@contextlib.contextmanager
def use_router(impl: str):
    """Use router implementation ``impl`` (``"torch"`` or ``"fused"``) inside a ``with`` block.

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
