"""The routed expert FFN on JAX arrays, :func:`experts`: the signature, weight layouts, activations,
biases and errors of :func:`moeyard.experts`, computed with ``jax.lax.ragged_dot`` or moeyard's Pallas grouped
GEMMs (:mod:`.gmm`; ``MOEYARD_JAX_GMM`` chooses, :mod:`.ffn`)."""

from __future__ import annotations

import jax.numpy as jnp

from ..activations import Activation, get_activation
from ..quant.recipe import resolve_recipe
from .checks import check_bool, check_float, check_ids_on_host, check_topk, invalid_ids
from .ffn import FFNSpec, routed_ffn
from .lora import lora_views

__all__ = ["experts", "check_weights"]


def experts(
    hidden_states,
    topk_ids,
    topk_weights,
    gate_up_proj,
    down_proj,
    *,
    activation: str | Activation = "swiglu",
    gate_up_bias=None,
    down_bias=None,
    transposed: bool = False,
    interleaved: bool = False,
    drop_invalid: bool = False,
    custom_vjp: bool = True,
    lora=None,
    recipe=None,
):
    """The routed expert FFN: ``out[t] = sum_k topk_weights[t, k] * FFN_e(hidden_states[t])`` with
    ``e = topk_ids[t, k]`` and ``FFN_e(x) = down_e(act(up_e(x)))``.

    Legend: T tokens, H hidden size, I expert intermediate size, E experts, K top-k.

    Args:
        hidden_states: ``[T, H]`` float.
        topk_ids: ``[T, K]`` integer expert ids, ``K <= E`` (any K with ``drop_invalid``).
        topk_weights: ``[T, K]`` float routing weights (cast to ``hidden_states.dtype``).
        gate_up_proj: ``[E, 2I, H]`` (gate rows then up rows), or ``[E, I, H]`` for a plain
            activation; ``[E, H, 2I]`` if ``transposed``.
        down_proj: ``[E, H, I]``; ``[E, I, H]`` if ``transposed``.
        activation: a name (``swiglu``, ``geglu``, ``reglu``, ``clamped_swiglu``, ``gelu``, ``relu``,
            ``relu2``, ``silu``), a :class:`moeyard.Activation`, or a JAX callable ``h [R, 2I] -> [R, I]``.
        gate_up_bias, down_bias: optional ``[E, 2I]`` (or ``[E, I]``) and ``[E, H]`` expert biases.
        transposed: weights stored ``[E, in, out]`` (gpt-oss).
        interleaved: gate/up columns interleaved ``g0, u0, g1, u1, ...`` (gpt-oss).
        drop_invalid: pairs whose id lies outside ``[0, E)`` contribute nothing (the expert-parallel
            sentinel convention). Otherwise such ids are an error: ValueError where the ids can be read
            without a sync (concrete CPU arrays, or debug mode: :mod:`moeyard.jax.checks`), else NaN
            output rows for those tokens.
        custom_vjp: True (default): the backward of :mod:`moeyard.jax.ffn`'s custom VJP, which keeps
            only ``h [T*K, N1]`` beyond the inputs; False: plain autodiff (keeps the permuted rows, the
            activation and the down projection's output too). Same values either way.
        lora: optional LoRA adapters, ``{"gate_up_proj": ExpertLoRA(lora_A=..., lora_B=..., scaling=s),
            "down_proj": ...}`` (either key may be absent) with JAX arrays in PEFT's layout for 3-D expert
            parameters, ``lora_A [r*E, in]``, ``lora_B [out, r*E]`` (see :class:`moeyard.ExpertLoRA` and
            :mod:`moeyard.jax.lora`): each projection gains ``s (x A_e^T) B_e^T`` in the compute dtype (the
            factors cast to the weights' dtype; their gradients come back in their own). With adapters JAX
            differentiates the FFN (``custom_vjp`` applies without them).
        recipe: an FP8 training recipe (``"fp8_rowwise"``, ``"fp8_rowwise_gw_hp"``, ``"fp8_blockwise"``,
            ``"mxfp8"`` or a :class:`moeyard.quant.Recipe`), emulated: every GEMM of both projections, forward,
            input gradient and weight gradient, reads operands cast to e4m3 per the recipe's blocks and back
            (:mod:`moeyard.jax.fp8`: the same values as :func:`moeyard.experts`' emulated recipes); biases stay
            in the compute dtype. Each projection then carries its own VJP (``custom_vjp`` applies without a
            recipe). None (default): the compute dtype's GEMMs.

    Returns:
        ``[T, H]`` in ``hidden_states.dtype``; differentiable w.r.t. ``hidden_states``, both weights,
        the biases, ``topk_weights`` and the LoRA factors. Traces under ``jax.jit`` (static shapes, no host sync).

    Raises:
        TypeError: an array of the wrong kind or dtype, a recipe that is neither a name, a Recipe nor None,
            or ``lora`` not a dict of :class:`moeyard.ExpertLoRA` (non-float factors, a non-numeric scaling).
        ValueError: shapes (the LoRA factors' too), ``K > E`` without ``drop_invalid``, ids out of range (see
            ``drop_invalid``), unknown activation or recipe name, a flag that is not a bool,
            ``MOEYARD_JAX_GMM`` none of ``auto``, ``pallas``, ``ragged_dot`` (:mod:`moeyard.jax.ffn`).
    """
    act = get_activation(activation)
    recipe = resolve_recipe(recipe)
    check_bool("drop_invalid", drop_invalid)
    check_bool("custom_vjp", custom_vjp)
    check_float("hidden_states", hidden_states, dim=2)
    E, H, I = check_weights(
        gate_up_proj,
        down_proj,
        gate_up_bias=gate_up_bias,
        down_bias=down_bias,
        transposed=transposed,
        interleaved=interleaved,
        gated=act.gated,
    )
    T = hidden_states.shape[0]
    if hidden_states.shape[1] != H:
        raise ValueError(f"hidden_states: expected hidden size {H} (from gate_up_proj), got {hidden_states.shape[1]}")
    if hidden_states.dtype != gate_up_proj.dtype:
        raise TypeError(
            f"hidden_states: expected dtype {gate_up_proj.dtype} (as the expert weights), got {hidden_states.dtype}"
        )
    check_topk(topk_ids, topk_weights, T, E, drop_invalid)
    N1 = gate_up_proj.shape[2] if transposed else gate_up_proj.shape[1]
    factors, scales = lora_views(lora, E, (N1, H), (H, I), gate_up_proj.dtype)
    w = jnp.asarray(topk_weights).astype(hidden_states.dtype)
    if not drop_invalid and not check_ids_on_host(topk_ids, E):
        w = jnp.where(invalid_ids(topk_ids, E), jnp.nan, w)  # a NaN output row instead of a silent wrong one
    spec = FFNSpec(
        activation=act,
        interleaved=bool(interleaved),
        transposed=bool(transposed),
        drop_invalid=bool(drop_invalid),
        num_experts=E,
        recipe=recipe,
        lora_scales=scales,
    )
    return routed_ffn(
        spec,
        bool(custom_vjp),
        jnp.asarray(hidden_states),
        jnp.asarray(topk_ids).astype(jnp.int32),
        w,
        jnp.asarray(gate_up_proj),
        gate_up_bias,
        jnp.asarray(down_proj),
        down_bias,
        factors,
    )


def check_weights(
    gate_up_proj,
    down_proj,
    *,
    gate_up_bias=None,
    down_bias=None,
    transposed: bool = False,
    interleaved: bool = False,
    gated: bool = True,
) -> tuple[int, int, int]:
    """Check the expert weights as :func:`moeyard.experts.expert_weights` does; returns ``(E, H, I)``.

    Raises:
        TypeError: a weight or bias is not a float array, or the two weights' dtypes differ.
        ValueError: shapes do not agree (the message names the argument and the expected shape), or
            ``interleaved`` with a plain activation.
    """
    check_bool("transposed", transposed)
    check_bool("interleaved", interleaved)
    for name, t in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        check_float(name, t)
        if t.ndim != 3:
            raise ValueError(f"{name}: expected a 3-D array [E, out, in], got shape {tuple(t.shape)}")
    if gate_up_proj.dtype != down_proj.dtype:
        raise TypeError(f"down_proj: expected dtype {gate_up_proj.dtype} (as gate_up_proj), got {down_proj.dtype}")
    E, N1, H = (
        (gate_up_proj.shape[0], gate_up_proj.shape[2], gate_up_proj.shape[1]) if transposed else gate_up_proj.shape
    )
    I = N1 // 2 if gated else N1
    if gated and N1 % 2:
        raise ValueError(f"gate_up_proj: gated activation needs an even output size 2I, got {N1}")
    want = (E, I, H) if transposed else (E, H, I)
    if tuple(down_proj.shape) != want:
        raise ValueError(
            f"down_proj: expected shape {want} to match gate_up_proj {tuple(gate_up_proj.shape)}, "
            f"got {tuple(down_proj.shape)}"
        )
    if interleaved and not gated:
        raise ValueError("interleaved: only meaningful for a gated activation")
    for name, b, shape in (("gate_up_bias", gate_up_bias, (E, N1)), ("down_bias", down_bias, (E, H))):
        if b is None:
            continue
        check_float(name, b)
        if tuple(b.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(b.shape)}")
    return E, H, I
