"""Input checks shared by the public entry points, and the debug mode.

What is checked where:
- Always, without touching device data: types, dtypes, devices, ranks and shapes, ``k <= E``.
- Expert ids in ``[0, E)``: on CPU tensors always (reading CPU memory costs no sync). On an
  accelerator the default path does not read them back; a token routed to an invalid id gets a NaN
  output row instead (visible, never silently wrong). In debug mode (``moeyard.set_debug(True)`` or
  ``MOEYARD_DEBUG=1``) they are checked on every device, with one host sync per call.
"""

from __future__ import annotations

import os

import torch

Tensor = torch.Tensor
_debug: list[bool | None] = [None]


def set_debug(enabled: bool | None) -> None:
    """Turn debug checks on or off (``None``: follow ``MOEYARD_DEBUG``)."""
    _debug[0] = enabled


def is_debug() -> bool:
    """True when debug checks are on (``set_debug`` or ``MOEYARD_DEBUG=1``)."""
    if _debug[0] is not None:
        return _debug[0]
    return os.environ.get("MOEYARD_DEBUG", "0") not in ("", "0", "false", "False")


def env_choice(name: str, choices: tuple[str, ...]) -> str:
    """The environment variable ``name`` (stripped, lower-cased) if it is one of ``choices``; unset or empty:
    ``choices[0]``, the default.

    Raises:
        ValueError: another value (the message names the variable and the choices).
    """
    value = os.environ.get(name, "").strip().lower() or choices[0]
    if value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def kind(t) -> str:
    """A short description of ``t`` for error messages."""
    if isinstance(t, Tensor):
        return f"a {t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"
    return f"a {type(t).__name__}"


def check_float(name: str, t, *, dim: int | None = None) -> None:
    """Raise TypeError unless ``t`` is a floating-point tensor (of ``dim`` dimensions)."""
    if not isinstance(t, Tensor) or not t.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {kind(t)}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name}: expected a {dim}-D tensor, got shape {tuple(t.shape)}")


UNWRITTEN = "unwritten"  # drop_invalid: dropped pairs contribute nothing, their tokens' rows may stay unwritten


def check_drop_invalid(drop_invalid) -> None:
    """Raise ValueError unless ``drop_invalid`` is False, True or ``"unwritten"``."""
    if drop_invalid not in (False, True) and drop_invalid != UNWRITTEN:
        raise ValueError(f"drop_invalid: expected False, True or {UNWRITTEN!r}, got {drop_invalid!r}")


def check_topk(
    topk_ids, topk_weights, num_tokens: int, num_experts: int, device: torch.device, drop_invalid: bool | str = False
) -> None:
    """Shapes, dtypes and devices of the routing tensors; ``k <= E`` unless ``drop_invalid`` (ids
    outside ``[0, E)`` are then dropped, so a token may carry more ids than there are experts: the
    local experts of an expert-parallel rank with ``E_l < K``).

    Raises:
        TypeError: ``topk_ids`` not integer, ``topk_weights`` not floating point.
        ValueError: shapes disagree, ``k > E`` (without ``drop_invalid``), or devices differ.
    """
    if (
        not isinstance(topk_ids, Tensor)
        or topk_ids.dtype.is_floating_point
        or topk_ids.dtype == torch.bool
        or topk_ids.is_complex()
    ):
        raise TypeError(f"topk_ids: expected an integer tensor [T, K], got {kind(topk_ids)}")
    check_float("topk_weights", topk_weights)
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids: expected shape [{num_tokens}, K], got {tuple(topk_ids.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(
            f"topk_weights: expected shape {tuple(topk_ids.shape)} (as topk_ids), got {tuple(topk_weights.shape)}"
        )
    k = topk_ids.shape[1]
    if k > num_experts and not drop_invalid:
        raise ValueError(f"topk_ids: top-k {k} exceeds num_experts {num_experts}")
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t.device != device:
            raise ValueError(f"{name}: expected device {device} (as hidden_states), got {t.device}")


def invalid_ids(topk_ids: Tensor, num_experts: int) -> Tensor:
    """``[T, K]`` bool: ids outside ``[0, E)`` (device op, no sync)."""
    return (topk_ids < 0) | (topk_ids >= num_experts)


def check_ids_on_host(topk_ids: Tensor, num_experts: int) -> bool:
    """Raise ValueError for ids outside ``[0, E)`` when that costs no sync (CPU) or in debug mode.

    Returns True when the ids were checked (never while ``torch.compile`` traces: a data-dependent
    branch would break the graph).
    """
    if (topk_ids.device.type != "cpu" and not is_debug()) or torch.compiler.is_compiling():
        return False
    raise_invalid_ids(topk_ids, num_experts)
    return True


def raise_invalid_ids(topk_ids: Tensor, num_experts: int) -> None:
    """Raise ValueError naming the ids outside ``[0, E)``. Reads the ids on the host: one sync on an
    accelerator."""
    bad = invalid_ids(topk_ids, num_experts)
    if bool(bad.any()):
        vals = sorted(set(topk_ids[bad].tolist()))[:8]
        raise ValueError(f"topk_ids: expected expert ids in [0, {num_experts}), got {vals}")
