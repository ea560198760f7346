"""The Hopper fast path of the ``fp8_rowwise`` recipe: ``torch._scaled_grouped_mm`` (CUTLASS, SM 9.0) on
e4m3 operands with float32 rowwise scales, cast by :mod:`moeyard.quant.fp8_triton`.

Which scale each GEMM's operands carry (expert-major rows ``x [R, K]``, ``w [E, N, K]``, offsets ``[E + 1]``):

- forward ``y = x w_e^T``: ``x`` one scale per row (over K), ``w_e`` one per output channel (over K);
- dgrad ``dx = dy w_e``: ``dy`` one per row (over N), ``w_e^T`` one per input channel (over N);
- wgrad ``dw_e = dy_e^T x_e``: ``dy^T`` and ``x^T`` one per channel and expert, over the expert's tokens
  (so the rows of each expert are padded to a multiple of 16: ``Recipe.align``).

Forward and dgrad accumulate with ``use_fast_accum`` (contraction over H or I, at most a few thousand);
wgrad contracts over an expert's tokens (thousands to hundreds of thousands) and accumulates exactly.

The down projection takes the activation fused (:meth:`HopperRowwise.act_down`, for a named activation
without a LoRA term on the down projection): its forward casts ``act(h)`` straight from ``h``, its backward
gives ``d h`` from ``h`` and casts ``act(h)^T`` for wgrad from ``h`` again, so ``act(h)`` is never
written in bf16 nor kept for backward (only ``h`` is, as the activation alone would keep it).

Elsewhere (another GPU, dtype or recipe, or sizes that are not multiples of 16) a recipe runs emulated
(:class:`moeyard.experts.scaled.Emulated`) and, on a GPU, says so once.
"""
from __future__ import annotations

import warnings

import torch

from ..activations import Activation
from ..kernel_op import have_triton
from ..quant.recipe import Recipe
from .scaled import Emulated, RecipeGEMMs
from .weights import ExpertWeights

Tensor = torch.Tensor
_warned: set[tuple] = set()


class HopperRowwise(RecipeGEMMs):
    """``fp8_rowwise`` on ``torch._scaled_grouped_mm`` (shapes: :mod:`moeyard.experts.scaled`, offsets form)."""

    def forward(self, x, w, offsets, recipe):
        from ..quant import fp8_triton as cast
        E, N, K = w.shape
        xq, xs = cast.rowwise(x)
        wq, ws = cast.rowwise(w.reshape(E * N, K))
        return torch._scaled_grouped_mm(xq, wq.view(E, N, K).mT, xs, ws.view(E, N), offs=offsets[1:],
                                        out_dtype=x.dtype, use_fast_accum=True)

    def dgrad(self, dy, w, offsets, recipe):
        from ..quant import fp8_triton as cast
        dyq, dys = cast.rowwise(dy)
        wq, ws = cast.colwise_per_expert(w)  # [E, K, N], [E, K]
        return torch._scaled_grouped_mm(dyq, wq.mT, dys, ws, offs=offsets[1:], out_dtype=dy.dtype, use_fast_accum=True)

    def wgrad(self, dy, x, offsets, recipe):
        from ..quant import fp8_triton as cast
        dyq, dys = cast.colwise_per_group(dy, offsets)  # [N, R], [E, N]
        xq, xs = cast.colwise_per_group(x, offsets)     # [K, R], [E, K]
        return torch._scaled_grouped_mm(dyq, xq.mT, dys.reshape(-1), xs.reshape(-1), offs=offsets[1:],
                                        out_dtype=dy.dtype, use_fast_accum=False)


    def act_down(self, h: Tensor, w: Tensor, offsets: Tensor, act: Activation, interleaved: bool,
                 recipe: Recipe) -> Tensor:
        """``act(h) w_e^T`` ``[R, N]`` for ``h [R, 2I]`` (gated) or ``[R, I]``, ``w [E, N, I]``; differentiable
        w.r.t. ``h`` and ``w`` (module docstring)."""
        return _ActDown.apply(h, w, offsets, act, interleaved, recipe)


class _ActDown(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, offsets, act, interleaved, recipe):
        from ..quant import fp8_triton as cast
        E, N, I = w.shape
        aq, a_s = cast.rowwise(h, act, interleaved=interleaved)
        wq, ws = cast.rowwise(w.reshape(E * N, I))
        ctx.save_for_backward(h, w, offsets)
        ctx.act, ctx.interleaved, ctx.recipe = act, interleaved, recipe
        return torch._scaled_grouped_mm(aq, wq.view(E, N, I).mT, a_s, ws.view(E, N), offs=offsets[1:],
                                        out_dtype=h.dtype, use_fast_accum=True)

    @staticmethod
    def backward(ctx, dy):
        from ..quant import fp8_triton as cast
        h, w, offsets = ctx.saved_tensors
        dy = dy.contiguous()
        dh = dw = None
        if ctx.needs_input_grad[0]:
            da = HOPPER_ROWWISE.dgrad(dy, w, offsets, ctx.recipe)
            dh = cast.act_backward(h, da, ctx.act, interleaved=ctx.interleaved)
        if ctx.needs_input_grad[1]:
            dyq, dys = cast.colwise_per_group(dy, offsets)
            aq, a_s = cast.colwise_per_group(h, offsets, ctx.act, interleaved=ctx.interleaved)
            dw = torch._scaled_grouped_mm(dyq, aq.mT, dys.reshape(-1), a_s.reshape(-1), offs=offsets[1:],
                                          out_dtype=dy.dtype, use_fast_accum=False)
        return dh, dw, None, None, None, None


HOPPER_ROWWISE = HopperRowwise()


def fast_path_reason(recipe: Recipe, device: torch.device, dtype: torch.dtype, weights: ExpertWeights | None) -> str | None:
    """None when the Hopper fast path serves ``recipe`` here, else why not."""
    if device.type != "cuda":
        return f"no FP8 GEMM on {device.type}"
    if not recipe.rowwise:
        return f"{recipe.name} has no Hopper fast path (torch._scaled_grouped_mm takes rowwise scales on SM 9.0)"
    if not hasattr(torch, "_scaled_grouped_mm") or not have_triton():
        return "needs torch._scaled_grouped_mm and Triton"
    cap = torch.cuda.get_device_capability(device)
    if cap != (9, 0):
        return f"the rowwise FP8 grouped GEMM runs on SM 9.0 (Hopper), this GPU is SM {cap[0]}.{cap[1]}"
    if dtype != torch.bfloat16:
        return f"the fast path computes in bfloat16, got {dtype}"
    if weights is not None:
        for name, n in (("hidden_size", weights.hidden_size), ("intermediate_size", weights.intermediate_size)):
            if n % 16:
                return f"{name}={n} is not a multiple of 16 (FP8 rows need 16-byte strides)"
    return None


def recipe_gemms(recipe: Recipe, device: torch.device, dtype: torch.dtype, weights: ExpertWeights,
                 emulated: Emulated) -> tuple[RecipeGEMMs, int]:
    """``(gemms, align)`` for a grouped backend: the Hopper fast path and ``recipe.align`` where it runs,
    else ``emulated`` and 1 (with one warning per reason on a GPU: emulation is slower than the compute
    dtype's own GEMMs)."""
    reason = fast_path_reason(recipe, device, dtype, weights)
    if reason is None:
        return HOPPER_ROWWISE, recipe.align
    if device.type == "cuda" and (recipe.name, reason) not in _warned:
        _warned.add((recipe.name, reason))
        warnings.warn(f"moeyard: recipe {recipe.name!r} runs emulated (quantise, dequantise, bf16 GEMMs: its "
                      f"numerics, slower than bf16): {reason}", stacklevel=4)
    return emulated, 1
