"""Expert activations on JAX arrays: the functions of :mod:`moeyard.activations`, named the same.

An activation is described once, by :class:`moeyard.Activation` (name, ``alpha``, ``limit``, or a
custom ``fn``); here it is applied to JAX arrays. A custom ``fn`` must then be a JAX function
(``h [R, 2I] -> [R, I]`` when ``fn_gated``, else ``[R, I] -> [R, I]``).

Sources: as :mod:`moeyard.activations` (GLU variants, Shazeer 2020, arXiv 2002.05202; ReLU², So et al.
2021, arXiv 2109.08668; gpt-oss's clamped SwiGLU from its model card and transformers'
``GptOssExperts._apply_gate``). GELU is the exact (erf) form, as ``torch.nn.functional.gelu``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..activations import GATED, PLAIN, Activation, get_activation

__all__ = ["Activation", "GATED", "PLAIN", "apply_activation", "get_activation", "glu", "split_gate_up"]


def apply_activation(act: Activation, h, *, interleaved: bool = False):
    """``act`` on ``h [..., 2I]`` (gated) or ``h [..., I]`` (plain); returns ``[..., I]`` in ``h.dtype``."""
    if act.fn is not None:
        return act.fn(h)
    if not act.gated:
        return _plain(act.name, h)
    gate, up = split_gate_up(h, interleaved=interleaved)
    return glu(act.name, gate, up, alpha=act.alpha, limit=act.limit)


def split_gate_up(h, *, interleaved: bool):
    """``h [..., 2I]`` -> ``(gate, up)``, each ``[..., I]``: columns ``0::2, 1::2`` when interleaved
    (gpt-oss), else the two halves."""
    if interleaved:
        return h[..., 0::2], h[..., 1::2]
    i = h.shape[-1] // 2
    return h[..., :i], h[..., i:]


def glu(name: str, gate, up, *, alpha: float = 1.702, limit: float = 7.0):
    """``act(gate) * up`` (or gpt-oss's clamped form) in the inputs' dtype.

    Raises:
        ValueError: ``name`` is not a gated activation.
    """
    if name == "swiglu":
        return jax.nn.silu(gate) * up
    if name == "geglu":
        return jax.nn.gelu(gate, approximate=False) * up
    if name == "reglu":
        return jax.nn.relu(gate) * up
    if name == "clamped_swiglu":
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))
    raise ValueError(f"activation: {name!r} is not gated")


def _plain(name: str, h):
    if name == "gelu":
        return jax.nn.gelu(h, approximate=False)
    if name == "relu":
        return jax.nn.relu(h)
    if name == "relu2":
        return jnp.square(jax.nn.relu(h))
    if name == "silu":
        return jax.nn.silu(h)
    raise ValueError(f"activation: {name!r} is not a plain activation")
