"""Autograd for the ``triton`` backend.

Fused path (named activations): forward = gathered up projection with the activation in its
epilogue (keeps ``h [N, N1]`` for backward), down projection with bias and routing weight in its
epilogue, deterministic combine (or, with ``options().atomic_combine``, float32 atomics in the down
projection's epilogue, also for the input gradient). Backward = activation-gradient kernel (recomputes ``act(h)``,
yields ``d_h``, ``w * a`` and ``d topk_weights``), then grouped weight gradients and the input
gradient (``d_h @ W_up`` per pair, combined per token). Kept for backward: ``h`` plus the inputs. Two
autograd functions, the up projection (``x -> (h, a)``) and the down projection with the combine (``(h,
a) -> out``, keeping ``h``): ``h`` is freed once the down projection's backward has made ``d_h``.

Custom activation callables run in torch between the same two functions (``h``, then ``a = act(h)`` in
torch, then the down projection with ``NONE``, keeping ``a``).

LoRA (``y = x W_e^T + s (x A_e^T) B_e^T`` per projection): every GEMM that touches a projection adds
its low-rank term in the epilogue (:class:`.ops.LoRATerm`): the forward GEMM with ``La = A^T``,
``Lb = B``; the input-gradient GEMM (``d_h`` for the down projection, ``dx`` for the up projection)
with ``La = B``, ``Lb = A^T``. Each GEMM also yields its low-rank rows ``z = rows @ La_e`` (``[N, R]``),
from which the factor gradients are thin grouped weight gradients (deterministic, no atomics):
``dA_e = s (d_y B_e)^T x`` and ``dB_e = s d_y^T (x A_e^T)``. Kept for backward: the forward ``z`` rows.
In split mode the up projection's input-gradient rows ``d_h B_e`` come from the same pass over ``d_h``
as ``dB_e`` (:func:`.ops.wgrad_rows`); ``d out``, read at each pair's token, takes two (:func:`_one_pass`).
No ``W + dW`` is formed, and with frozen base weights no base weight gradient is computed.

Legend: T tokens, H hidden, I intermediate, N1 = 2I (gated) or I, E experts, K top-k, N = T*K, R rank.
"""

from __future__ import annotations

import torch

from ...activations import Activation
from ...checks import UNWRITTEN
from ...kernel_op import records_graph
from ..weights import ExpertWeights, LowRank
from . import ops
from .ops import ActSpec, LoRATerm, Routing
from .options import read_once
from .tuning import LORA_SPLIT

Tensor = torch.Tensor
NONE = ActSpec(name="none")


# the options read once for the forward's launches here, and once in each backward method (not on the
# autograd functions' forward methods: Dynamo does not trace those through a decorator)
@read_once
def triton_experts(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    weights: ExpertWeights,
    activation: Activation,
    *,
    drop_invalid: bool | str = False,
) -> Tensor:
    """The routed expert FFN (shapes and semantics as :func:`moeyard.experts`)."""
    r = ops.routing(topk_ids, weights.num_experts, zero_invalid=drop_invalid != UNWRITTEN)
    tw = topk_weights.reshape(-1)
    a_up, b_up, s_up = _factors(weights.lora_up)
    a_dn, b_dn, s_dn = _factors(weights.lora_down)
    train = records_graph(x, tw, weights.w_up, weights.w_down, weights.b_up, weights.b_down, a_up, b_up, a_dn, b_dn)
    if activation.fn is None:
        spec = ActSpec(
            name=activation.name, alpha=activation.alpha, limit=activation.limit, interleaved=weights.interleaved
        )
        if not train:  # no graph to record: the kernels without the autograd functions' host time
            _, a, _ = ops.up_proj(
                x, weights.w_up, weights.b_up, r, spec, store_h=False, lora=_forward_term(a_up, b_up, s_up)
            )
            return _down_forward(
                a, tw, weights.w_down, weights.b_down, r, drop_invalid, _forward_term(a_dn, b_dn, s_dn)
            )[0]
        h, a = _UpProj.apply(x, weights.w_up, weights.b_up, a_up, b_up, r, s_up, spec, train)
        return _DownProj.apply(h, a, tw, weights.w_down, weights.b_down, a_dn, b_dn, r, s_dn, spec, drop_invalid)
    h = _UpProj.apply(x, weights.w_up, weights.b_up, a_up, b_up, r, s_up, NONE, False)
    a = activation(h, interleaved=weights.interleaved)
    return _DownProj.apply(None, a, tw, weights.w_down, weights.b_down, a_dn, b_dn, r, s_dn, NONE, drop_invalid)


def _factors(lora: LowRank | None) -> tuple[Tensor | None, Tensor | None, float]:
    """``(A [E, R, in], B [E, out, R] contiguous, s)`` or ``(None, None, 0.0)``."""
    return (None, None, 0.0) if lora is None else (lora.a, lora.b, lora.scaling)


def _forward_term(a: Tensor | None, b: Tensor | None, s: float) -> LoRATerm | None:
    """The LoRA term of ``rows W_e^T``: ``s (rows A_e^T) B_e^T``."""
    return None if a is None else LoRATerm(la=a.mT, lb=b, scale=s)


def _input_grad_term(a: Tensor | None, b: Tensor | None, s: float) -> LoRATerm | None:
    """The LoRA term of the input gradient ``d_y W_e``: ``s (d_y B_e) A_e``."""
    return None if a is None else LoRATerm(la=b, lb=a.mT, scale=s)


class _UpProj(torch.autograd.Function):
    """``h = x[token] @ W_up[e].T + b_up[e] (+ LoRA)`` in sorted row order. With a named activation
    (``spec``): ``(h, a = act(h))`` from one kernel, ``a`` not differentiable (the down projection's backward
    gives ``d h`` through the activation), ``h`` made only when ``store_h`` (for that backward); with
    ``NONE``: ``h`` alone."""

    @staticmethod
    def forward(ctx, x, w_up, b_up, a_up, bl_up, r: Routing, s_up: float, spec: ActSpec, store_h: bool):
        fused = spec is not NONE
        h, a, z_up = ops.up_proj(
            x, w_up, b_up, r, spec, store_h=fused and store_h, lora=_forward_term(a_up, bl_up, s_up)
        )
        ctx.save_for_backward(x, w_up, b_up, a_up, bl_up, z_up)
        ctx.r, ctx.s = r, s_up
        if not fused:
            return a  # the pre-activation itself
        ctx.mark_non_differentiable(a)
        # a's gradient stays undefined, not a zero [N, NA] tensor made and filled before each backward (384 MiB
        # at qwen3-30b-a3b's 262144 pairs, alive at the eager peak: 2.78 -> 2.41 GiB, NOTES round 28)
        ctx.set_materialize_grads(False)
        return h, a

    @staticmethod
    @read_once
    def backward(ctx, dh, *_):
        if dh is None:  # h unused
            return (None,) * 9
        x, w_up, b_up, a_up, bl_up, z_up = ctx.saved_tensors
        need = ctx.needs_input_grad
        dx, dw_up, db_up, da_up, dbl_up = _up_backward(
            dh.contiguous(),
            x,
            w_up,
            b_up,
            (a_up, bl_up, ctx.s, z_up),
            ctx.r,
            need[0],
            need[1],
            need[2],
            need[3],
            need[4],
        )
        return dx, dw_up, db_up, da_up, dbl_up, None, None, None, None


class _DownProj(torch.autograd.Function):
    """``out[t] = sum_k w[t, k] * (a[row of (t, k)] @ W_down[e].T + b_down[e] (+ LoRA))`` with ``a =
    act(h)``; backward gives ``d h`` through the activation (``spec``; ``NONE``: ``h`` is None, ``a`` is kept
    and gets the gradient: Dynamo cannot trace one tensor passed as two inputs). It keeps
    ``h``, not ``a``, so ``h`` is freed when this backward ends, before the up projection's (whose
    input-gradient rows and weight gradients then run without it: peak memory of forward+backward at
    qwen3-30b-a3b 3.13 -> 2.75 GiB on an H100, ``benchmarks/NOTES.md`` round 27; 2.41 GiB since the up
    projection's ``a`` gets no zero gradient, round 28)."""

    @staticmethod
    def forward(ctx, h, a, tw, w_down, b_down, a_dn, bl_dn, r: Routing, s_dn: float, spec: ActSpec, drop_invalid: bool):
        a = a.contiguous()
        out, z_dn = _down_forward(a, tw, w_down, b_down, r, drop_invalid, _forward_term(a_dn, bl_dn, s_dn))
        ctx.save_for_backward(a if spec is NONE else h, tw, w_down, b_down, a_dn, bl_dn, z_dn)
        ctx.r, ctx.s, ctx.spec = r, s_dn, spec
        return out

    @staticmethod
    @read_once
    def backward(ctx, dout):
        h, tw, w_down, b_down, a_dn, bl_dn, z_dn = ctx.saved_tensors
        need = ctx.needs_input_grad
        dh, d_tw, dw_down, db_down, da_dn, dbl_dn = _down_backward(
            dout, h, tw, w_down, b_down, (a_dn, bl_dn, ctx.s, z_dn), ctx.r, ctx.spec, need[3], need[4], need[5], need[6]
        )
        d_inputs = (None, dh) if ctx.spec is NONE else (dh, None)
        d_tw = d_tw.to(tw.dtype) if need[2] else None
        return *d_inputs, d_tw, dw_down, db_down, da_dn, dbl_dn, None, None, None, None


def _down_forward(
    a: Tensor, tw: Tensor, w_down: Tensor, b_down: Tensor | None, r: Routing, drop_invalid: bool, lora: LoRATerm | None
) -> tuple[Tensor, Tensor | None]:
    return ops.down_combine(a, w_down, b_down, tw, r, None if drop_invalid else tw, lora)


def _down_backward(dout, h, tw, w_down, b_down, lora, r, spec, need_w, need_b, need_a, need_bl):
    """``(d_h, d tw [N] float32, d W_down, d b_down, d A_down, d B_down)``; ``h`` is the activation's
    input; ``lora = (A, B, s, z)`` with ``z = a @ A_e^T`` from the forward."""
    a_dn, bl_dn, s, z_dn = lora
    dbl = g_dn = zw = None
    if need_bl:  # dB_e = s (w * dout)^T (a A_e^T), from zw = w * (a A_e^T)
        zw = z_dn * tw.index_select(0, r.sort_order).to(z_dn.dtype).unsqueeze(1)
    # dout is read by token: its rows dout B_e come from a band-major thin GEMM (in act_grad) and dB_e from a
    # tile-major weight gradient, two passes that ran faster than one (see _one_pass)
    dh, aw, d_tw, g_dn = ops.act_grad(dout, w_down, b_down, h, tw, r, spec, _input_grad_term(a_dn, bl_dn, s))
    dw = db = da = None
    if need_w or need_b:
        dw, db = ops.wgrad(
            dout,
            aw,
            lhs_by_token=True,
            rhs_by_token=False,
            scale=tw if need_b else None,
            r=r,
            like_w=w_down,
            like_b=b_down if need_b else None,
        )
    if need_a:  # dA_e = s (w * dout B_e)^T a = s (dout B_e)^T (w a)
        da = _thin_wgrad(g_dn, aw, False, False, r, a_dn, s)
    if need_bl:
        dbl = _thin_wgrad(dout, zw, True, False, r, bl_dn, s)
    return dh, d_tw, dw if need_w else None, db, da, dbl


def _up_backward(dh, x, w_up, b_up, lora, r, need_x, need_w, need_b, need_a, need_bl):
    """``(dx [T, H], d W_up, d b_up, d A_up, d B_up)`` from ``d_h [N, N1]`` (sorted rows);
    ``lora = (A, B, s, z)`` with ``z = x @ A_e^T`` from the forward."""
    a_up, bl_up, s, z_up = lora
    dx = dw = db = da = dbl = g_up = None
    if need_bl and (need_x or need_a) and _one_pass(bl_up, r):  # dB_e = s d_h^T (x A_e^T) and the rows d_h B_e
        dbl, g_up = ops.wgrad_rows(dh, z_up, bl_up, lhs_by_token=False, r=r, alpha=s)
    if need_x:
        dx, g_up = ops.down_combine(dh, w_up.mT, None, None, r, None, _input_grad_term(a_up, bl_up, s), g_up)
    elif need_a and g_up is None:
        g_up = ops.low_rank_rows(dh, bl_up, r, gather=False)
    if need_w or need_b:
        dw, db = ops.wgrad(
            dh, x, lhs_by_token=False, rhs_by_token=True, scale=None, r=r, like_w=w_up, like_b=b_up if need_b else None
        )
    if need_a:  # dA_e = s (d_h B_e)^T x
        da = _thin_wgrad(g_up, x, False, True, r, a_up, s)
    if need_bl and dbl is None:  # dB_e = s d_h^T (x A_e^T)
        dbl = _thin_wgrad(dh, z_up, False, False, r, bl_up, s)
    return dx, dw if need_w else None, db, da, dbl


def _one_pass(b: Tensor | None, r: Routing) -> bool:
    """Whether ``dB`` and the rows ``d_h B_e`` come from one pass over ``d_h`` (sorted rows; ``b = B [E,
    out, R]``): a LoRA term in split mode (its rows made before the GEMM that reads them) whose float32
    partials fit the budget (:func:`.ops.wgrad_rows_fits`). ``d out``, read at each pair's token, always
    takes two passes, a band-major thin GEMM for the rows and a tile-major weight gradient for ``dB``:
    together faster than one pass, whose programs each read ``d out`` for one expert only (H200, r = 16:
    0.30 against 0.34 ms at qwen3.5-35b-a3b, 0.28 against 0.32 at qwen3-30b-a3b; over ``d_h`` one pass
    stays faster, 0.19 against 0.27 and 0.27 against 0.38; ``benchmarks/NOTES.md``, round 20)."""
    return b is not None and LoRATerm.mode() == LORA_SPLIT and ops.wgrad_rows_fits(r.num_pairs, b.shape[1], b.shape[2])


def _thin_wgrad(
    lhs: Tensor, rhs: Tensor, lhs_by_token: bool, rhs_by_token: bool, r: Routing, like: Tensor, s: float
) -> Tensor:
    """``s * lhs[rows of e]^T @ rhs[rows of e]`` shaped like the LoRA factor ``like`` (an operand
    ``*_by_token`` is ``[T, *]`` read at each row's token, else ``[N, *]`` in sorted rows)."""
    return ops.wgrad(
        lhs,
        rhs,
        lhs_by_token=lhs_by_token,
        rhs_by_token=rhs_by_token,
        scale=None,
        r=r,
        like_w=like,
        like_b=None,
        low_rank=True,
        alpha=s,
    )[0]
