"""The composed routed FFN: permute -> grouped up-proj -> activation -> grouped down-proj ->
unpermute, around one ``grouped_gemm`` primitive that backends supply. Biases and LoRA adapters are
applied here, once, for every backend built on it (:func:`project`).

Legend: T tokens, H hidden, I intermediate, N1 = 2I (gated) or I, E experts, K top-k, R rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..activations import Activation
from ..dispatch import DispatchPlan, make_plan, permute, unpermute
from .scaled import RecipeGEMMs, scaled_linear
from .weights import ExpertWeights, Projection

Tensor = torch.Tensor
# grouped_gemm(rows [R, in], w [E, out, in] (any strides), plan) -> [R, out]: rows of expert e times w[e].T
GroupedGEMM = Callable[[Tensor, Tensor, DispatchPlan], Tensor]


def project(
    rows: Tensor, proj: Projection, gemm: GroupedGEMM, plan: DispatchPlan, recipe_gemms: RecipeGEMMs | None = None
) -> Tensor:
    """``rows [R, in]`` -> ``[R, out]``: ``rows W_e^T + b_e + s (rows A_e^T) B_e^T`` per expert's rows
    (the LoRA term as two thin grouped GEMMs through an ``[R, r]`` intermediate; ``rows W_e^T`` through
    ``recipe_gemms`` under ``proj.recipe``, when it has one)."""
    if proj.recipe is not None:
        base = scaled_linear(rows, proj.weight, plan.padded_offsets, proj.recipe, recipe_gemms)
    else:
        base = gemm(rows, proj.weight, plan)
    y = add_row_bias(base, proj.bias, plan)
    if proj.lora is not None:
        lora = proj.lora
        y = y + lora.scaling * gemm(gemm(rows, lora.a, plan), lora.b, plan)
    return y


def routed_ffn(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    weights: ExpertWeights,
    activation: Activation,
    gemm: GroupedGEMM,
    *,
    drop_invalid: bool = False,
    align: int = 1,
    recipe_gemms: RecipeGEMMs | None = None,
) -> Tensor:
    """``[T, H] -> [T, H]``: the whole routed expert FFN built from ``gemm`` (and ``recipe_gemms`` for
    the base GEMMs under ``weights.recipe``)."""
    plan = make_plan(topk_ids, weights.num_experts, align=align)
    rows = permute(x, plan)
    if drop_invalid:
        # rows of dropped pairs sit past the last expert; a grouped GEMM leaves their gradient
        # unwritten, so cut them out of the graph (masked_fill: its backward writes zeros there)
        live = torch.arange(plan.num_rows, device=x.device) < plan.padded_offsets[-1]
        rows = rows.masked_fill(~live.unsqueeze(-1), 0)
    h = project(rows, weights.up, gemm, plan, recipe_gemms)
    a = activation(h, interleaved=weights.interleaved)
    y = project(a, weights.down, gemm, plan, recipe_gemms)
    return unpermute(y, plan, topk_weights, drop_invalid=drop_invalid)


def add_row_bias(y: Tensor, bias: Tensor | None, plan: DispatchPlan) -> Tensor:
    """``y [R, out] + bias[expert of each row]`` (no-op without a bias; rows past the last expert get
    none). The bias gradient is summed in float64 for float64 (``y`` or ``bias``), else in float32: a
    bf16 scatter-add over thousands of rows per expert would lose most of its precision."""
    if bias is None:
        return y
    return _RowBias.apply(y, bias, plan.row_experts())


class _RowBias(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: Tensor, bias: Tensor, row_experts: Tensor) -> Tensor:
        ctx.save_for_backward(row_experts)
        ctx.bias_shape, ctx.bias_dtype = bias.shape, bias.dtype
        padded = torch.cat([bias.to(y.dtype), y.new_zeros(1, bias.shape[1])])  # row E: no bias
        return y + padded.index_select(0, row_experts)

    @staticmethod
    def backward(ctx, dy: Tensor):
        (row_experts,) = ctx.saved_tensors
        E, out = ctx.bias_shape
        acc = torch.float64 if torch.float64 in (dy.dtype, ctx.bias_dtype) else torch.float32
        db = dy.new_zeros(E + 1, out, dtype=acc).index_add_(0, row_experts, dy.to(acc))
        return dy, db[:E].to(ctx.bias_dtype), None
