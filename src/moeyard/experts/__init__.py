"""Expert backends and the functional routed-expert FFN, :func:`experts`.

Backends (one knob, ``backend=``): ``loop`` (reference), ``bmm_padded``, ``grouped_mm``, and
``triton`` where it is installed; ``auto`` picks the best that runs for the device and dtype.
"""

from __future__ import annotations

import functools

import torch

from ..activations import Activation, get_activation
from ..checks import check_drop_invalid, check_float, check_ids_on_host, check_topk, invalid_ids
from ..kernel_op import records_graph
from ..quant.recipe import Recipe
from . import (
    bmm_padded as _bmm_padded,  # noqa: F401  (registers)
    grouped_mm as _grouped_mm,  # noqa: F401  (registers)
    loop as _loop,  # noqa: F401  (registers)
    scaled_hopper as _scaled_hopper,
    triton as _triton,  # noqa: F401  (registers; imports triton on first use only)
)
from .quantized import dequantized, is_quantized
from .registry import (
    ExpertBackend,
    Workload,
    available_backends,
    backend_names,
    get_backend,
    register_backend,
    resolve_backend,
    set_backend,
    use_backend,
)
from .weights import ExpertLoRA, ExpertWeights, LowRank, Projection, expert_weights

Tensor = torch.Tensor

__all__ = [
    "experts",
    "ExpertBackend",
    "ExpertLoRA",
    "ExpertWeights",
    "LowRank",
    "Projection",
    "Workload",
    "expert_weights",
    "available_backends",
    "backend_names",
    "get_backend",
    "register_backend",
    "resolve_backend",
    "set_backend",
    "use_backend",
]


def experts(
    hidden_states: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    gate_up_proj: Tensor,
    down_proj: Tensor,
    *,
    activation: str | Activation = "swiglu",
    backend: str | None = "auto",
    gate_up_bias: Tensor | None = None,
    down_bias: Tensor | None = None,
    transposed: bool = False,
    interleaved: bool = False,
    drop_invalid: bool | str = False,
    lora: dict[str, ExpertLoRA] | None = None,
    recipe: str | Recipe | None = None,
    check_ids: bool = True,
) -> Tensor:
    """The routed expert FFN: ``out[t] = sum_k topk_weights[t, k] * FFN_e(hidden_states[t])`` with
    ``e = topk_ids[t, k]`` and ``FFN_e(x) = down_e(act(up_e(x)))``.

    Legend: T tokens, H hidden size, I expert intermediate size, E experts, K top-k.

    Args:
        hidden_states: ``[T, H]`` float (any strides).
        topk_ids: ``[T, K]`` integer expert ids, ``K <= E`` (any K with ``drop_invalid``: a rank's
            local experts under expert parallelism can number fewer than K).
        topk_weights: ``[T, K]`` float routing weights (cast to ``hidden_states.dtype``).
        gate_up_proj: ``[E, 2I, H]`` (gate rows then up rows), or ``[E, I, H]`` for a plain
            activation (transformers' ``up_proj``); ``[E, H, 2I]`` if ``transposed``. Either weight
            may be quantised storage (:class:`moeyard.quant.NF4Experts`,
            :class:`moeyard.quant.FP8BlockExperts`; frozen): then only the
            experts that receive tokens are dequantised, and again in backward
            (:mod:`moeyard.experts.quantized`). Under an FP8 recipe's fused Hopper form, NF4 storage in the
            standard layout is read by the FP8 weight casts instead, and no dense weight is written
            (``MOEYARD_FP8_NF4=dequantize`` dequantises there too:
            :func:`moeyard.experts.scaled_hopper.nf4_mode`).
        down_proj: ``[E, H, I]``; ``[E, I, H]`` if ``transposed``.
        activation: a name (``swiglu``, ``geglu``, ``reglu``, ``clamped_swiglu``, ``gelu``, ``relu``,
            ``relu2``, ``silu``), a :class:`moeyard.Activation`, or a callable ``h [R, 2I] -> [R, I]``.
        backend: a backend name, ``auto`` (the best that runs here), or None (the process default,
            :func:`moeyard.set_backend` / ``MOEYARD_BACKEND``).
        gate_up_bias, down_bias: optional ``[E, 2I]`` (or ``[E, I]``) and ``[E, H]`` expert biases.
        transposed: weights stored ``[E, in, out]`` (gpt-oss).
        interleaved: gate/up columns interleaved ``g0, u0, g1, u1, ...`` (gpt-oss).
        drop_invalid: pairs whose id lies outside ``[0, E)`` contribute nothing (the expert-parallel
            "sentinel" convention). Otherwise such ids are an error: ValueError where they can be
            read without a host sync (CPU) or in debug mode, else NaN output rows for those tokens.
            ``"unwritten"``: as True, and where K is 1 the output rows of tokens whose pair is dropped,
            and those rows of the input gradient, may be left unwritten (any values) instead of zeroed,
            for a caller that never reads them (``sync_free``'s static receive buffers: on the
            ``triton`` backend this saves a pass writing zeros over them, forward and backward; the
            other backends write zeros).
        lora: optional LoRA adapters, ``{"gate_up_proj": ExpertLoRA(lora_A, lora_B, scaling),
            "down_proj": ...}`` (either key may be absent) in PEFT's layout as they are:
            ``lora_A [r*E, in]``, ``lora_B [out, r*E]`` (see :class:`moeyard.ExpertLoRA`). Each
            projection computes ``x W_e^T + b_e + s (x A_e^T) B_e^T``; ``W + dW`` is never formed. With
            the base weights frozen (``requires_grad=False``) no base weight gradient is computed.
        recipe: an FP8 training recipe (``"fp8_rowwise"``, ``"fp8_blockwise"``, ``"mxfp8"`` or a
            :class:`moeyard.quant.Recipe`; :mod:`moeyard.quant.recipe`): the base GEMMs of both
            projections, forward, input gradient and weight gradient, read e4m3 operands scaled per the
            recipe's blocks; biases and LoRA terms stay in the compute dtype. ``fp8_rowwise`` in bfloat16
            on Hopper runs ``torch._scaled_grouped_mm`` (``grouped_mm`` and ``triton`` backends); every
            other combination runs the recipe emulated (quantise, dequantise, the backend's own GEMMs).
            None (default): the compute dtype's GEMMs.
        check_ids: False where the caller guarantees every id lies in ``[0, E)`` (as moeyard's router
            does): skips the check of ``drop_invalid`` (on an accelerator, four small device ops per
            call that make the rows of invalid ids NaN). An id outside the range then gives a wrong
            result (``grouped_mm``, ``triton``) or the backend's own error (``loop``, ``bmm_padded``).

    Returns:
        ``[T, H]`` in ``hidden_states.dtype``; differentiable w.r.t. ``hidden_states``, both weights,
        the biases, ``topk_weights`` and the LoRA factors.

    Raises:
        TypeError: a tensor of the wrong kind or dtype.
        ValueError: shapes, devices, ``K > E`` without ``drop_invalid``, ids out of range (see
            ``drop_invalid``), ``drop_invalid`` not False, True or ``"unwritten"``, unknown activation
            or backend, or a backend that cannot run here (the message names those that can).
    """
    act = get_activation(activation)
    check_drop_invalid(drop_invalid)
    check_float("hidden_states", hidden_states, dim=2)
    spec = dict(
        gate_up_bias=gate_up_bias, down_bias=down_bias, transposed=transposed, interleaved=interleaved, lora=lora
    )
    stored = _stored_weights(hidden_states, gate_up_proj, down_proj, act, backend, transposed, recipe)
    weights = (
        None if stored is None else expert_weights(gate_up_proj, down_proj, gated=act.gated, recipe=recipe, **spec)
    )
    if weights is not None and not stored(weights):
        weights = stored = None
    if weights is None and (is_quantized(gate_up_proj) or is_quantized(down_proj)):
        with dequantized((gate_up_proj, down_proj), topk_ids) as (up, down):
            return experts(
                hidden_states,
                topk_ids,
                topk_weights,
                up,
                down,
                activation=act,
                backend=backend,
                drop_invalid=drop_invalid,
                recipe=recipe,
                check_ids=check_ids,
                **spec,
            )
    if weights is None:
        weights = expert_weights(gate_up_proj, down_proj, gated=act.gated, recipe=recipe, **spec)
    T, H = hidden_states.shape
    if H != weights.hidden_size:
        raise ValueError(f"hidden_states: expected hidden size {weights.hidden_size} (from gate_up_proj), got {H}")
    if hidden_states.dtype != weights.w_up.dtype:
        raise TypeError(
            f"hidden_states: expected dtype {weights.w_up.dtype} (as the expert weights), got {hidden_states.dtype}"
        )
    if hidden_states.device != weights.w_up.device:
        raise ValueError(
            f"hidden_states: expected device {weights.w_up.device} (as the expert weights), got {hidden_states.device}"
        )
    check_topk(topk_ids, topk_weights, T, weights.num_experts, hidden_states.device, drop_invalid)
    if stored is not None:  # NF4 storage read by the FP8 fast path's casts
        forward = _scaled_hopper.routed_ffn
    else:
        workload = _workload(topk_ids, weights)
        forward = resolve_backend(backend, hidden_states.device, hidden_states.dtype, weights, act, workload).forward
    if check_ids and not drop_invalid and not check_ids_on_host(topk_ids, weights.num_experts):
        # accelerator, no debug: a NaN weight makes the token's output NaN instead of reading ids back
        topk_weights = topk_weights.masked_fill(invalid_ids(topk_ids, weights.num_experts), float("nan"))
    run = forward if weights.recipe is None else _eager_recipe(forward)
    return run(hidden_states, topk_ids, topk_weights, weights, act, drop_invalid=drop_invalid)


def _stored_weights(x: Tensor, gate_up_proj, down_proj, act: Activation, backend, transposed, recipe):
    """For quantised expert storage that an FP8 recipe's Hopper fast path reads in its weight casts (NF4,
    standard layout, a backend registered with ``reads_storage``, whose FP8 path is the fused form): a check
    ``(weights) -> bool`` that the fused form serves these :class:`ExpertWeights` (storage kept in them); else
    None (dequantise)."""
    from ..quant.recipe import resolve_recipe

    ws = (gate_up_proj, down_proj)
    if transposed or recipe is None or not any(is_quantized(w) for w in ws):
        return None
    if not all(isinstance(w, Tensor) or _scaled_hopper.takes_storage(w) for w in ws):
        return None
    recipe = resolve_recipe(recipe)
    if _scaled_hopper.fast_path_reason(recipe, x.device, x.dtype, None) is not None:
        return None
    if not resolve_backend(backend, x.device, x.dtype, None, act).reads_storage:
        return None
    return lambda weights: (
        _scaled_hopper.fast_path_reason(recipe, x.device, x.dtype, weights) is None
        and (_scaled_hopper.fused(weights, act))
    )


@functools.cache
def _eager_recipe(forward):
    """``forward`` run eagerly inside a ``torch.compile``d model (a graph break): under an FP8 recipe the
    expert stage is the one eager mode tests, bit for bit. (Inductor's CPU code for the emulated recipes' fused
    float8 round trips was seen to differ from eager by ten times the recipe's own error,
    ``tests/test_fp8.py``; the fast path's Triton casts are plain launches, not custom ops.)"""
    return torch.compiler.disable(forward, recursive=True)


def _workload(topk_ids: Tensor, weights: ExpertWeights) -> Workload:
    """The call's pairs, and whether the base expert weights will get gradients."""
    weight_grad = records_graph(weights.w_up, weights.w_down, weights.b_up, weights.b_down)
    return Workload(pairs=topk_ids.numel(), weight_grad=weight_grad)
