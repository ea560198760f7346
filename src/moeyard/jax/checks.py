"""Input checks of :mod:`moeyard.jax`, with the messages of :mod:`moeyard.checks`.

What is checked where (as on the PyTorch side):
- Always, from shapes and dtypes only (no device data): types, dtypes, ranks, shapes, ``k <= E``.
- Expert ids in ``[0, E)``: read on the host only for concrete arrays on the CPU (no transfer, no
  sync), or on any device in debug mode (``moeyard.set_debug(True)`` / ``MOEYARD_DEBUG=1``: one
  device-to-host copy per call). Under ``jax.jit`` (tracers) they are never read: a token routed to
  an invalid id gets a NaN output row instead (visible, never silently wrong).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..checks import is_debug


def is_array(a) -> bool:
    """A JAX array (a tracer included) or a NumPy array."""
    return isinstance(a, (jax.Array, np.ndarray))


def kind(a) -> str:
    """A short description of ``a`` for error messages."""
    if is_array(a):
        return f"a {a.dtype} array of shape {tuple(a.shape)}"
    return f"a {type(a).__name__}"


def is_floating(a) -> bool:
    return is_array(a) and jnp.issubdtype(a.dtype, jnp.floating)


def is_integer(a) -> bool:
    return is_array(a) and jnp.issubdtype(a.dtype, jnp.integer)


def check_float(name: str, a, *, dim: int | None = None) -> None:
    """Raise TypeError unless ``a`` is a floating-point array (ValueError unless it has ``dim`` dimensions)."""
    if not is_floating(a):
        raise TypeError(f"{name}: expected a floating-point array, got {kind(a)}")
    if dim is not None and a.ndim != dim:
        raise ValueError(f"{name}: expected a {dim}-D array, got shape {tuple(a.shape)}")


def check_bool(name: str, v) -> None:
    """Raise ValueError unless ``v`` is True or False."""
    if not isinstance(v, (bool, np.bool_)):
        raise ValueError(f"{name}: expected True or False, got {v!r}")


def check_topk(topk_ids, topk_weights, num_tokens: int, num_experts: int, drop_invalid: bool = False) -> None:
    """Shapes and dtypes of the routing arrays; ``k <= E`` unless ``drop_invalid``.

    Raises:
        TypeError: ``topk_ids`` not integer, ``topk_weights`` not floating point.
        ValueError: shapes disagree, or ``k > E`` without ``drop_invalid``.
    """
    if not is_integer(topk_ids):
        raise TypeError(f"topk_ids: expected an integer array [T, K], got {kind(topk_ids)}")
    check_float("topk_weights", topk_weights)
    if topk_ids.ndim != 2 or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids: expected shape [{num_tokens}, K], got {tuple(topk_ids.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(
            f"topk_weights: expected shape {tuple(topk_ids.shape)} (as topk_ids), got {tuple(topk_weights.shape)}"
        )
    k = topk_ids.shape[1]
    if k > num_experts and not drop_invalid:
        raise ValueError(f"topk_ids: top-k {k} exceeds num_experts {num_experts}")


def invalid_ids(topk_ids, num_experts: int):
    """``[T, K]`` bool: ids outside ``[0, E)`` (device op, no sync)."""
    return (topk_ids < 0) | (topk_ids >= num_experts)


def readable_without_sync(a) -> bool:
    """Whether the values of ``a`` can be read here: a NumPy array, or a concrete JAX array on the CPU
    (or on any device in debug mode); never a tracer."""
    if isinstance(a, np.ndarray):
        return True
    if isinstance(a, jax.core.Tracer) or not isinstance(a, jax.Array):
        return False
    return all(d.platform == "cpu" for d in a.devices()) or is_debug()


def check_ids_on_host(topk_ids, num_experts: int) -> bool:
    """Raise ValueError for ids outside ``[0, E)`` when they can be read without a sync
    (:func:`readable_without_sync`). Returns True when they were checked."""
    if not readable_without_sync(topk_ids):
        return False
    ids = np.asarray(topk_ids)
    bad = (ids < 0) | (ids >= num_experts)
    if bad.any():
        vals = sorted(set(ids[bad].tolist()))[:8]
        raise ValueError(f"topk_ids: expected expert ids in [0, {num_experts}), got {vals}")
    return True


def accumulation_dtype(dtype):
    """float64 for float64 data, else float32: the dtype sums and products are accumulated in."""
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def precision(dtype):
    """``Precision.HIGHEST`` for float32 / float64 matmuls (full-precision products, as PyTorch's
    defaults: no TF32), else the default."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) in (jnp.float32, jnp.float64) else None


def varying_axes(a) -> frozenset:
    """The mesh axes ``a`` varies over inside ``jax.shard_map`` (empty elsewhere, and for None): the
    type's ``manual_axis_type.varying`` (jax 0.10), or its ``vma`` (earlier releases)."""
    if a is None:
        return frozenset()
    t = jax.typeof(a)
    manual = getattr(t, "manual_axis_type", None)
    return frozenset(getattr(manual, "varying", None) or getattr(t, "vma", None) or ())


def match_varying(ct, axes: frozenset):
    """``ct`` summed over the mesh axes it varies over and its input (of mesh axes ``axes``) does not: the
    gradient of an input that is the same on every device of an axis (replicated weights inside
    ``jax.shard_map``) is the sum of the devices' contributions, as JAX's own transposes make it."""
    if ct is None:
        return None
    extra = tuple(sorted(varying_axes(ct) - axes))
    return jax.lax.psum(ct, extra) if extra else ct


def to_varying(a, axes: frozenset):
    """``a`` typed varying over ``axes`` inside ``jax.shard_map`` (``jax.lax.pcast`` over the axes it does
    not vary over yet; ``a`` itself when there are none)."""
    missing = tuple(sorted(axes - varying_axes(a)))
    return jax.lax.pcast(a, missing, to="varying") if missing else a
