"""LoRA adapters on the experts, on JAX arrays: the ``lora=`` argument of :func:`moeyard.jax.experts`, with
the checks, messages and layouts of the PyTorch side (:mod:`moeyard.experts.weights`).

The adapters come in PEFT's layout for 3-D expert parameters, as :class:`moeyard.ExpertLoRA` holding JAX
arrays: ``lora_A [r*E, in]`` (rows expert-major) and ``lora_B [out, r*E]`` (columns rank-major), ``in`` and
``out`` the projection's, whatever the weight layout. Expert ``e``'s projection gains ``s (x A_e^T) B_e^T``
with ``A_e = lora_A.reshape(E, r, in)[e]`` and ``B_e = lora_B.reshape(out, r, E)[:, :, e]`` (Hu et al.,
LoRA, arXiv 2106.09685). ``W + dW`` is never formed: the term is two thin grouped GEMMs.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..experts.weights import LORA_KEYS, adapter_rank, adapters_by_projection
from .checks import check_float


def lora_views(lora, E: int, up_shape: tuple[int, int], down_shape: tuple[int, int], dtype):
    """``((A_up, B_up) | None, (A_down, B_down) | None), (s_up | None, s_down | None)`` from ``lora`` (None, or a
    dict with keys among ``gate_up_proj`` and ``down_proj`` of :class:`moeyard.ExpertLoRA`): ``A [E, r, in]``
    and ``B [E, out, r]`` in ``dtype`` (the expert weights'; the factors' gradients come back in their own
    dtype), for projections of ``(out, in)`` = ``up_shape`` and ``down_shape``; None where a projection has no
    adapter.

    Raises:
        TypeError: not such a dict, an entry not an ExpertLoRA, non-float factors, a non-numeric scaling.
        ValueError: factor shapes (``lora_A [r*E, in]``, ``lora_B [out, r*E]``), or the adapter's
            ``num_experts`` not E.
    """
    views, scales = [], []
    for key, adapter, (out, inp) in zip(LORA_KEYS, adapters_by_projection(lora), (up_shape, down_shape), strict=True):
        a, b, s = (None, None, None) if adapter is None else low_rank(adapter, E, out, inp, dtype, f"lora[{key!r}]")
        views.append(None if adapter is None else (a, b))
        scales.append(s)
    return tuple(views), tuple(scales)


def low_rank(adapter, E: int, out: int, inp: int, dtype, name: str = "lora"):
    """``(A [E, r, in], B [E, out, r], s)`` of one adapter checked against an ``[E, out, in]`` projection (the
    PyTorch side's :func:`moeyard.experts.weights.low_rank`, its messages).

    Raises:
        TypeError: not an :class:`moeyard.ExpertLoRA`, non-float factors, non-numeric scaling.
        ValueError: shapes, or the adapter's ``num_experts`` not E.
    """
    r, s = adapter_rank(adapter, E, out, inp, name, check_float)
    A, B = adapter.lora_A, adapter.lora_B
    a = jnp.asarray(A).astype(dtype).reshape(E, r, inp)
    b = jnp.transpose(jnp.asarray(B).astype(dtype).reshape(out, r, E), (2, 0, 1))  # [E, out, r]
    return a, b, s
