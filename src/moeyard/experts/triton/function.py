"""Autograd for the ``triton`` backend.

Fused path (named activations): forward = gathered up projection with the activation in its
epilogue (keeps ``h [N, N1]`` for backward), down projection with bias and routing weight in its
epilogue, deterministic combine (or, with ``options().atomic_combine``, float32 atomics in the down
projection's epilogue, also for the input gradient). Backward = activation-gradient kernel (recomputes ``act(h)``,
yields ``d_h``, ``w * a`` and ``d topk_weights``), then grouped weight gradients and the input
gradient (``d_h @ W_up`` per pair, combined per token). Kept for backward: ``h`` plus the inputs.

Custom activation callables run in torch between two autograd functions (up projection, down
projection + combine) built from the same kernels.

Legend: T tokens, H hidden, I intermediate, N1 = 2I (gated) or I, E experts, K top-k, N = T*K.
"""
from __future__ import annotations

import torch

from ...activations import Activation
from ..weights import ExpertWeights
from . import ops
from .ops import ActSpec, Routing

Tensor = torch.Tensor


def triton_experts(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, weights: ExpertWeights,
                   activation: Activation, *, drop_invalid: bool = False) -> Tensor:
    """The routed expert FFN (shapes and semantics as :func:`moeyard.experts`)."""
    r = ops.routing(topk_ids, weights.num_experts)
    tw = topk_weights.reshape(-1)
    if activation.fn is None:
        spec = ActSpec(name=activation.name, alpha=activation.alpha, limit=activation.limit,
                       interleaved=weights.interleaved)
        return _FusedExperts.apply(x, tw, weights.w_up, weights.w_down, weights.b_up, weights.b_down, r, spec,
                                   drop_invalid)
    h = _UpProj.apply(x, weights.w_up, weights.b_up, r)
    a = activation(h, interleaved=weights.interleaved)
    return _DownProj.apply(a, tw, weights.w_down, weights.b_down, r, drop_invalid)


class _FusedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tw, w_up, w_down, b_up, b_down, r: Routing, spec: ActSpec, drop_invalid: bool):
        train = any(ctx.needs_input_grad)
        h, a = ops.up_proj(x, w_up, b_up, r, spec, store_h=train)
        out = _down_forward(a, tw, w_down, b_down, r, drop_invalid)
        if train:
            ctx.save_for_backward(x, tw, w_up, w_down, b_up, b_down, h)
        ctx.r, ctx.spec = r, spec
        return out

    @staticmethod
    def backward(ctx, dout):
        x, tw, w_up, w_down, b_up, b_down, h = ctx.saved_tensors
        need = ctx.needs_input_grad
        dh, d_tw, dw_down, db_down = _down_backward(dout, h, tw, w_down, b_down, ctx.r, ctx.spec, need[3], need[5])
        dx, dw_up, db_up = _up_backward(dh, x, w_up, b_up, ctx.r, need[0], need[2], need[4])
        return dx, d_tw.to(tw.dtype) if need[1] else None, dw_up, dw_down, db_up, db_down, None, None, None


class _UpProj(torch.autograd.Function):
    """``h = x[token] @ W_up[e].T + b_up[e]`` in sorted row order (no activation)."""

    @staticmethod
    def forward(ctx, x, w_up, b_up, r: Routing):
        _, h = ops.up_proj(x, w_up, b_up, r, ActSpec(name="none"), store_h=False)
        ctx.save_for_backward(x, w_up, b_up)
        ctx.r = r
        return h

    @staticmethod
    def backward(ctx, dh):
        x, w_up, b_up = ctx.saved_tensors
        need = ctx.needs_input_grad
        dx, dw_up, db_up = _up_backward(dh.contiguous(), x, w_up, b_up, ctx.r, need[0], need[1], need[2])
        return dx, dw_up, db_up, None


class _DownProj(torch.autograd.Function):
    """``out[t] = sum_k w[t, k] * (a[row of (t, k)] @ W_down[e].T + b_down[e])``."""

    @staticmethod
    def forward(ctx, a, tw, w_down, b_down, r: Routing, drop_invalid: bool):
        a = a.contiguous()
        ctx.save_for_backward(a, tw, w_down, b_down)
        ctx.r = r
        return _down_forward(a, tw, w_down, b_down, r, drop_invalid)

    @staticmethod
    def backward(ctx, dout):
        a, tw, w_down, b_down = ctx.saved_tensors
        need = ctx.needs_input_grad
        da, d_tw, dw_down, db_down = _down_backward(dout, a, tw, w_down, b_down, ctx.r, ActSpec(name="none"),
                                                    need[2], need[3])
        return da, d_tw.to(tw.dtype) if need[1] else None, dw_down, db_down, None, None


def _down_forward(a: Tensor, tw: Tensor, w_down: Tensor, b_down: Tensor | None, r: Routing,
                  drop_invalid: bool) -> Tensor:
    return ops.down_combine(a, w_down, b_down, tw, r, None if drop_invalid else tw)


def _down_backward(dout, h, tw, w_down, b_down, r, spec, need_w, need_b):
    """``(d_h, d tw [N] float32, d W_down, d b_down)``; ``h`` is the activation's input."""
    dh, aw, d_tw = ops.act_grad(dout, w_down, b_down, h, tw, r, spec)
    dw = db = None
    if need_w or need_b:
        dw, db = ops.wgrad(dout, aw, lhs_by_token=True, rhs_by_token=False, scale=tw if need_b else None, r=r,
                           like_w=w_down, like_b=b_down if need_b else None)
    return dh, d_tw, dw if need_w else None, db


def _up_backward(dh, x, w_up, b_up, r, need_x, need_w, need_b):
    """``(dx [T, H], d W_up, d b_up)`` from ``d_h [N, N1]`` (sorted rows)."""
    dx = dw = db = None
    if need_x:
        dx = ops.down_combine(dh, w_up.mT, None, None, r, None)
    if need_w or need_b:
        dw, db = ops.wgrad(dh, x, lhs_by_token=False, rhs_by_token=True, scale=None, r=r, like_w=w_up,
                           like_b=b_up if need_b else None)
    return dx, dw if need_w else None, db
