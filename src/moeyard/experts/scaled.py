"""An expert projection under an FP8 recipe: ``y = x W_e^T`` with every GEMM of forward and
backward on quantised operands (:mod:`moeyard.quant.recipe` says which blocks each operand is
scaled by).

One autograd function, :func:`scaled_linear`, serves every backend; what differs is its
:class:`RecipeGEMMs`, the three GEMMs (forward, dgrad, wgrad) of the recipe:

- :class:`Emulated`: quantise -> dequantise (:func:`moeyard.quant.fp8.fake_quantize`) -> the backend's
  own GEMMs (:class:`GroupedOps`) in the compute dtype. Any device and float dtype; the numerics of the
  recipe, not its speed.
- the Hopper fast path (:mod:`moeyard.experts.scaled_hopper`): FP8 operands and scales into
  ``torch._scaled_grouped_mm``.

Shapes: ``x [..., R, K]`` rows, ``w [..., N, K]`` (``[E, N, K]`` with ``offsets``). Three layouts:
one expert's rows and weight (``loop``: ``x [R, K]``, ``w [N, K]``, no offsets), a batch of experts
(``bmm_padded``: ``x [E, C, K]``, ``w [E, N, K]``, no offsets), or expert-major rows with ``offsets
[E + 1]`` (grouped GEMMs: ``x [R, K]``, ``w [E, N, K]``; rows of expert e are ``offsets[e]:offsets[e+1]``).
Kept for backward: ``x`` and ``w`` (the compute dtype; wgrad needs ``x`` scaled per channel over each
expert's tokens, which the forward's rowwise FP8 copy cannot give without a second rounding).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..quant.fp8 import fake_quantize
from ..quant.recipe import Recipe

Tensor = torch.Tensor


@dataclass(frozen=True)
class GroupedOps:
    """A backend's GEMMs in the compute dtype.

    Attributes:
        mm: ``(x [..., R, K], w [..., N, K], offsets | None) -> [..., R, N]``, each expert's rows times
            its ``w[e].T``.
        kmm: ``(dy [..., R, N], x [..., R, K], offsets | None) -> [..., N, K]`` (``[E, N, K]`` with
            offsets): ``dy_e^T x_e`` summed over each expert's rows.
    """

    mm: Callable[[Tensor, Tensor, Tensor | None], Tensor]
    kmm: Callable[[Tensor, Tensor, Tensor | None], Tensor]


class RecipeGEMMs:
    """The three GEMMs of a projection under a recipe (subclasses: :class:`Emulated`, the Hopper path)."""

    def forward(self, x: Tensor, w: Tensor, offsets: Tensor | None, recipe: Recipe) -> Tensor:
        """``y = x w_e^T`` ``[..., R, N]``."""
        raise NotImplementedError

    def dgrad(self, dy: Tensor, w: Tensor, offsets: Tensor | None, recipe: Recipe) -> Tensor:
        """``dx = dy w_e`` ``[..., R, K]``."""
        raise NotImplementedError

    def wgrad(self, dy: Tensor, x: Tensor, offsets: Tensor | None, recipe: Recipe) -> Tensor:
        """``dw_e = dy_e^T x_e`` ``[..., N, K]``."""
        raise NotImplementedError


@dataclass(frozen=True)
class Emulated(RecipeGEMMs):
    """The recipe's numerics on any device: each operand quantised and dequantised in its own dtype
    along the GEMM's contraction axis, then ``ops``."""

    ops: GroupedOps

    def forward(self, x, w, offsets, recipe):
        a, b = recipe.forward
        return self.ops.mm(fake_quantize(x, a, recipe.scale), fake_quantize(w, b, recipe.scale), offsets)

    def dgrad(self, dy, w, offsets, recipe):
        a, b = recipe.dgrad
        return self.ops.mm(fake_quantize(dy, a, recipe.scale), fake_quantize(w.mT, b, recipe.scale), offsets)

    def wgrad(self, dy, x, offsets, recipe):
        if recipe.wgrad is None:  # in the compute dtype
            return self.ops.kmm(dy, x, offsets)
        a, b = recipe.wgrad  # along the tokens: per expert (offsets) or the whole axis of one expert
        dy_t = fake_quantize(dy.mT, a, recipe.scale, offsets)
        x_t = fake_quantize(x.mT, b, recipe.scale, offsets)
        return self.ops.kmm(dy_t.mT, x_t.mT, offsets)


def scaled_linear(x: Tensor, w: Tensor, offsets: Tensor | None, recipe: Recipe, gemms: RecipeGEMMs) -> Tensor:
    """``y = x w_e^T`` under ``recipe`` (shapes in the module docstring), differentiable w.r.t. ``x``
    and ``w``: dgrad and wgrad run on quantised operands too. ``w`` frozen (``requires_grad=False``):
    no wgrad runs."""
    return _ScaledLinear.apply(x, w, offsets, recipe, gemms)


class _ScaledLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offsets, recipe, gemms):
        ctx.save_for_backward(x, w, offsets)
        ctx.recipe, ctx.gemms = recipe, gemms
        return gemms.forward(x, w, offsets, recipe)

    @staticmethod
    def backward(ctx, dy):
        x, w, offsets = ctx.saved_tensors
        recipe, gemms = ctx.recipe, ctx.gemms
        dy = dy.contiguous()
        dx = gemms.dgrad(dy, w, offsets, recipe) if ctx.needs_input_grad[0] else None
        dw = gemms.wgrad(dy, x, offsets, recipe) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None, None
