"""The shared experts' MLP added to the routed output in one autograd function (CUDA, or Triton's interpreter):
``routed + sigmoid(x w_g^T) * down(act(gate_up(x)))`` (the gate optional), as :class:`moeyard.layer.SharedExpert`
writes it in torch ops, with fewer passes over ``[T, H]`` and ``[T, 2I]``:

- the gate's logit is one more output column of the ``gate_up`` GEMM (its weight row appended, padded with zero
  rows to 8 columns so the output rows stay 16-byte aligned), not a GEMM of its own;
- the sigmoid multiplies the activation's rows, ``a = sigmoid(logit) act(h)`` (exact: the gate is a scalar per
  token, so ``s (act(h) W_d^T) = (s act(h)) W_d^T``), written by one Triton pass over ``h`` that reads the logit
  column itself (:func:`moeyard.quant.fp8_triton.act_rows` with ``gate_logits``), in float32 with one rounding;
- the down GEMM adds its product into the routed output in place (``addmm_``, its epilogue's ``beta = 1``), so
  no ``[T, H]`` product and sum are written apart;
- the backward is one Triton pass over ``h`` and ``da = dy W_d`` (:func:`moeyard.quant.fp8_triton.act_backward`:
  ``d h``, the logit's gradient ``s (1 - s) sum_i da act(h)`` with the zeros of the padding columns, and ``a``
  again for ``dW_d``) and one GEMM each for ``dx``, ``d [W_gu; w_g]`` and ``dW_d``; ``a`` is not kept from the
  forward.

In torch ops the same MLP takes six elementwise passes, three more passes over ``[T, H]`` (the gate's product, the
sum with the routed output and the gate's input gradient) and two GEMMs of one column for the gate: about 1 ms of kernels
per forward + backward at qwen3.5-35b-a3b's sizes on an H200 (``benchmarks/NOTES.md``, round 51).
"""

from __future__ import annotations

import torch
from torch import nn

from .activations import Activation
from .kernel_op import have_triton, interpreting

Tensor = torch.Tensor

GATE_COLUMNS = 8  # the gate's logit and 7 zero columns: rows of N1 + 8 two-byte values stay 16-byte aligned
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _plain(t: Tensor) -> bool:
    """``t`` is a plain tensor or parameter (not a DTensor or other tensor subclass, whose ops dispatch apart)."""
    return type(t.data) is torch.Tensor


def _plain_linear(m: nn.Module | None) -> bool:
    """``m`` is None or an ``nn.Linear`` itself (not a subclass, e.g. a PEFT wrapper) with no bias and no hooks
    of its own, so reading its weight computes what calling it would."""
    if m is None:
        return True
    return (
        type(m) is nn.Linear
        and m.bias is None
        and _plain(m.weight)
        and not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)
    )


def fused_ready(shared: nn.Module, x: Tensor, routed: Tensor) -> bool:
    """Whether :func:`add_shared` serves ``shared`` (a :class:`moeyard.layer.SharedExpert`) on ``x [T, H]`` and the
    routed output ``routed [T, H]``: CUDA tensors with Triton installed (or Triton's interpreter), a named
    activation, bf16 / fp16 / fp32 in one dtype with the weights, plain bias-free ``nn.Linear`` projections whose
    weights are plain tensors (not DTensors: a sharded shared expert runs the torch form), no autocast, not under
    ``torch.compile`` (whose own fusions serve the torch form there)."""
    if not (x.is_cuda and have_triton()) and not (interpreting() and x.device.type == "cpu"):
        return False
    if torch.compiler.is_compiling() or torch.is_autocast_enabled(x.device.type):
        return False
    if shared.activation.fn is not None or x.dtype not in DTYPES or routed.dtype != x.dtype:
        return False
    if x.dim() != 2 or routed.shape != x.shape or not (_plain(x) and _plain(routed)):
        return False
    mods = (shared.gate_up_proj, shared.down_proj, shared.gate)
    return all(_plain_linear(m) for m in mods) and all(m is None or m.weight.dtype == x.dtype for m in mods)


def add_shared(shared: nn.Module, x: Tensor, routed: Tensor, *, inplace: bool = False) -> Tensor:
    """``routed + shared(x)`` for a :class:`moeyard.layer.SharedExpert` where :func:`fused_ready` holds: ``x [T,
    H]``, ``routed [T, H]`` in ``x``'s dtype; returns ``[T, H]``, a new tensor, or with ``inplace`` (for a caller
    that owns ``routed``, as ``MoE`` owns its routed output) written over ``routed`` and returned where
    ``routed`` is contiguous and not a view or a leaf requiring grad (autograd then checks that nothing saved
    ``routed`` for its backward). Gradients for ``x``, ``routed`` and the three weights; no host sync.

    Raises:
        ValueError: :func:`fused_ready` does not hold (``SharedExpert.add_to`` then runs the torch form)."""
    if not fused_ready(shared, x, routed):
        raise ValueError(
            "add_shared: the fused form cannot serve this call (see moeyard.shared_triton.fused_ready: CUDA or "
            "Triton's interpreter, 2-D x and routed of one float dtype with the weights, plain bias-free nn.Linear "
            "projections); use SharedExpert.add_to, which falls back to torch ops"
        )
    return _add_shared(shared, x, routed, inplace=inplace)


def _add_shared(shared: nn.Module, x: Tensor, routed: Tensor, *, inplace: bool = False) -> Tensor:
    """:func:`add_shared` for a caller that has checked :func:`fused_ready` itself (``SharedExpert.add_to``)."""
    w_g = None if shared.gate is None else shared.gate.weight
    w_gu, w_d = shared.gate_up_proj.weight, shared.down_proj.weight
    return _SharedMLP.apply(x, routed, w_gu, w_d, w_g, shared.activation, inplace)


_ZERO_ROWS: dict = {}  # (device, dtype, H) -> [GATE_COLUMNS - 1, H] zeros, never written


def _stacked(w_gu: Tensor, w_g: Tensor | None) -> Tensor:
    """``[W_gu; w_g; 0]`` ``[N1 + GATE_COLUMNS, H]`` (``W_gu`` itself without a gate). The zero rows are made
    once per device, dtype and width (one op less on the host per forward)."""
    if w_g is None:
        return w_gu
    key = (w_gu.device, w_gu.dtype, w_gu.shape[1])
    zeros = _ZERO_ROWS.get(key)
    if zeros is None:
        zeros = _ZERO_ROWS[key] = w_gu.new_zeros(GATE_COLUMNS - 1, w_gu.shape[1])
    return torch.cat([w_gu, w_g, zeros])


class _SharedMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, routed, w_gu, w_d, w_g, act: Activation, inplace: bool):
        from .quant.fp8_triton import act_rows

        n1 = w_gu.shape[0]
        w = _stacked(w_gu, w_g)
        hg = x @ w.t()  # [T, N1] or [T, N1 + GATE_COLUMNS]: the gate's logit in column N1
        logit = None if w_g is None else hg[:, n1]
        a = act_rows(hg[:, :n1], act, gate_logits=logit)  # [T, I]: sigmoid(logit) * act(h), one rounding
        if (
            inplace
            and routed._base is None
            and routed.is_contiguous()
            and not (routed.is_leaf and routed.requires_grad)
        ):
            out = routed.addmm_(a, w_d.t())
            ctx.mark_dirty(out)
        else:
            out = torch.addmm(routed, a, w_d.t())
        ctx.save_for_backward(x, hg, w, w_d)
        ctx.act, ctx.n1, ctx.gated = act, n1, w_g is not None
        return out

    @staticmethod
    def backward(ctx, dy):
        from .quant.fp8_triton import act_backward

        x, hg, w, w_d = ctx.saved_tensors
        n1 = ctx.n1
        need_x, _, need_gu, need_d, need_g = ctx.needs_input_grad[:5]
        dy = dy.contiguous()
        da = dy @ w_d  # [T, I]: the gradient of s * act(h)
        d_hg = torch.empty_like(hg)
        gate = dict(gate_logits=hg[:, n1], gate_grad=d_hg[:, n1:]) if ctx.gated else {}
        # the gate's columns of d_hg: d logit = d s * s (1 - s), then zeros
        g = act_backward(hg[:, :n1], da, ctx.act, with_act_rows=need_d, out=d_hg[:, :n1], **gate)
        dx = d_hg @ w if need_x else None
        dw = d_hg.t() @ x if (need_gu or need_g) else None
        dw_d = dy.t() @ g.act_rows if need_d else None
        dw_gu = dw[:n1] if need_gu else None
        dw_g = dw[n1 : n1 + 1] if need_g else None
        return dx, dy, dw_gu, dw_d, dw_g, None, None
