"""Expert backends, registered by name and picked by one knob: ``backend=``.

A backend computes the routed expert FFN
``out[t] = sum_k w[t, k] * FFN_{ids[t, k]}(x[t])`` behind one signature::

    forward(hidden_states [T, H], topk_ids [T, K], topk_weights [T, K],
            weights: ExpertWeights, activation: Activation, *, drop_invalid: bool | str) -> [T, H]

(``drop_invalid`` False, True or ``"unwritten"``, as :func:`moeyard.experts` documents; a backend may
treat ``"unwritten"`` as True.)

``unsupported(device, dtype, weights, activation)`` returns None when the backend runs there, else a
reason; ``auto`` takes the highest-``priority`` backend that runs, unless that backend's ``defer``
names another backend that runs and is measured faster for the call's :class:`Workload` (no
built-in backend defers today: ``triton`` measured fastest on CUDA at every benchmark shape). The
process-wide default (used where no backend is named, e.g. by the transformers integration) is ``set_backend(name)`` or, before
any call, the ``MOEYARD_BACKEND`` environment variable; otherwise ``auto``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..activations import Activation
from .weights import ExpertWeights

ENV_BACKEND = "MOEYARD_BACKEND"


@dataclass(frozen=True)
class Workload:
    """What one experts call computes, for ``auto``'s shape-aware choice (static: no device data).

    Attributes:
        pairs: routed (token, expert) pairs ``T * K``.
        weight_grad: grad mode is on and the base expert weights (or biases) require grad (full
            fine-tuning, pre-training; not inference, not LoRA on a frozen base).
    """

    pairs: int
    weight_grad: bool


@dataclass(frozen=True, kw_only=True)
class ExpertBackend:
    """A registered backend (see the module docstring for the contract)."""

    name: str
    forward: Callable[..., torch.Tensor]
    unsupported: Callable[[torch.device, torch.dtype, ExpertWeights | None, Activation | None], str | None]
    priority: dict[str, int]  # device type -> rank for ``auto`` (higher wins; absent = never auto)
    description: str = ""
    # ``defer(device, dtype, weights, workload)``: None, or the name of a backend ``auto`` should run
    # instead for this call (used only when that backend runs here)
    defer: Callable[[torch.device, torch.dtype, ExpertWeights, Workload], str | None] | None = None
    # ``reads_storage``: under an FP8 recipe on the Hopper fast path, the backend's weight casts read quantised
    # expert storage (NF4) as it is, so ``experts`` hands it the storage instead of dequantising first
    reads_storage: bool = False


_BACKENDS: dict[str, ExpertBackend] = {}
_default: list[str | None] = [None]


def floating_only(
    device: torch.device, dtype: torch.dtype, weights: ExpertWeights | None, activation: Activation | None
) -> str | None:
    """An ``unsupported`` check for backends built from torch ops: any device, any floating dtype."""
    return None if dtype.is_floating_point else f"needs a floating dtype, got {dtype}"


def register_backend(backend: ExpertBackend) -> ExpertBackend:
    """Add ``backend`` to the registry (replacing one of the same name)."""
    _BACKENDS[backend.name] = backend
    return backend


def unregister_backend(name: str) -> ExpertBackend | None:
    """Remove backend ``name`` from the registry (a temporary one, e.g. ``moeyard verify``'s ``jax``
    column); returns it, or None when it was not registered. The process default is not changed."""
    return _BACKENDS.pop(name, None)


def backend_names() -> list[str]:
    """Every registered backend name, plus ``auto``."""
    return sorted(_BACKENDS) + ["auto"]


def available_backends(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> list[str]:
    """Names of the backends that run on ``device`` in ``dtype`` (for any shape they accept)."""
    device = torch.device(device)
    return [n for n, b in sorted(_BACKENDS.items()) if b.unsupported(device, dtype, None, None) is None]


def set_backend(name: str | None) -> None:
    """Set the process-wide default backend (``None`` restores ``MOEYARD_BACKEND`` / ``auto``).

    Raises:
        ValueError: unknown name.
    """
    if name is not None:
        check_backend_name(name)
    _default[0] = name


@contextlib.contextmanager
def use_backend(name: str | None):
    """``with use_backend(name):`` set the process default backend for the block, then restore the
    previous setting (also a ``None`` one). Raises ValueError for an unknown name."""
    previous = _default[0]
    set_backend(name)
    try:
        yield
    finally:
        _default[0] = previous


def get_backend() -> str:
    """The process-wide default backend name: ``set_backend``'s, else ``$MOEYARD_BACKEND``, else ``auto``.

    Raises:
        ValueError: ``MOEYARD_BACKEND`` names no backend.
    """
    name = _default[0] or os.environ.get(ENV_BACKEND) or "auto"
    check_backend_name(name, source=ENV_BACKEND if _default[0] is None else "backend")
    return name


def resolve_backend(
    name: str | None,
    device: torch.device,
    dtype: torch.dtype,
    weights: ExpertWeights | None = None,
    activation: Activation | None = None,
    workload: Workload | None = None,
) -> ExpertBackend:
    """The backend to run for ``name`` (``None``: the default; ``auto``: the best that runs here,
    for ``workload`` when it and ``weights`` are given: see ``ExpertBackend.defer``).

    Raises:
        ValueError: unknown name, or the named backend cannot run on this device / dtype / shape
            (the message names those that can).
    """
    name = get_backend() if name is None else name
    check_backend_name(name)
    if name == "auto":
        ranked = sorted(_BACKENDS.values(), key=lambda b: -b.priority.get(device.type, -1))
        for b in ranked:
            if device.type in b.priority and b.unsupported(device, dtype, weights, activation) is None:
                return _deferred(b, device, dtype, weights, activation, workload)
        raise ValueError(f"backend: no registered backend runs on {device.type} with {dtype}")
    b = _BACKENDS[name]
    reason = b.unsupported(device, dtype, weights, activation)
    if reason is not None:
        ok = [n for n in sorted(_BACKENDS) if _BACKENDS[n].unsupported(device, dtype, weights, activation) is None]
        raise ValueError(f"backend: {name!r} cannot run here ({reason}); backends that can: {ok}")
    return b


def _deferred(b: ExpertBackend, device, dtype, weights, activation, workload) -> ExpertBackend:
    """``b``, or the backend its ``defer`` names for this workload when that one runs here."""
    if b.defer is None or weights is None or workload is None:
        return b
    other = _BACKENDS.get(b.defer(device, dtype, weights, workload) or "")
    if other is None or other.unsupported(device, dtype, weights, activation) is not None:
        return b
    return other


def check_backend_name(name, source: str = "backend") -> None:
    """Raise ValueError unless ``name`` is a registered backend or ``auto`` (``source`` names the argument)."""
    if not isinstance(name, str) or (name != "auto" and name not in _BACKENDS):
        raise ValueError(f"{source}: expected one of {backend_names()}, got {name!r}")
