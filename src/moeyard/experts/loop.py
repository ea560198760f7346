"""``loop``: the reference backend, one expert at a time in plain PyTorch.

Any device, any floating dtype (float64 included); it is the oracle every other backend is tested
against. It finds each expert's tokens with ``torch.where`` and checks the expert ids on the host,
so it synchronises with the device: a reference, not a training path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..activations import Activation
from ..checks import raise_invalid_ids
from .registry import ExpertBackend, floating_only, register_backend
from .scaled import Emulated, GroupedOps, scaled_linear
from .weights import ExpertWeights, Projection

Tensor = torch.Tensor


def loop_forward(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    weights: ExpertWeights,
    activation: Activation,
    *,
    drop_invalid: bool = False,
) -> Tensor:
    """``out[t] = sum_k topk_weights[t, k] * down_e(act(up_e(x[t])))`` with ``e = topk_ids[t, k]``.

    Shapes: ``x [T, H]``, ``topk_ids [T, K]``, ``topk_weights [T, K]`` -> ``[T, H]`` in ``x.dtype``
    (accumulated in float32, or float64 for float64 input).
    Raises:
        ValueError: an expert id outside ``[0, E)`` when ``drop_invalid`` is False (host check).
    """
    E = weights.num_experts
    if not drop_invalid:
        raise_invalid_ids(topk_ids, E)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    out = torch.zeros(x.shape, dtype=acc, device=x.device)
    for e in range(E):
        token, slot = torch.where(topk_ids == e)
        h = expert_linear(x[token], weights.up, e)
        a = activation(h, interleaved=weights.interleaved)
        y = expert_linear(a, weights.down, e)
        out = out.index_add(0, token, (y * topk_weights[token, slot, None].to(y.dtype)).to(acc))
    return out.to(x.dtype)


def expert_linear(x: Tensor, proj: Projection, e: int) -> Tensor:
    """Expert ``e``'s projection of ``x [R, in]``: ``x W_e^T + b_e + s (x A_e^T) B_e^T`` -> ``[R, out]``
    (``x W_e^T`` under ``proj.recipe``'s emulated FP8 GEMMs when it has one)."""
    if proj.recipe is not None:
        y = scaled_linear(x, proj.weight[e], None, proj.recipe, EMULATED)
        y = y if proj.bias is None else y + proj.bias[e]
    else:
        y = F.linear(x, proj.weight[e], None if proj.bias is None else proj.bias[e])
    if proj.lora is not None:
        y = y + proj.lora.scaling * F.linear(F.linear(x, proj.lora.a[e]), proj.lora.b[e])
    return y


# one expert's rows [R, K] and weight [N, K]: plain matrix products
EMULATED = Emulated(GroupedOps(mm=lambda x, w, offsets: x @ w.mT, kmm=lambda dy, x, offsets: dy.mT @ x))

register_backend(
    ExpertBackend(
        name="loop",
        forward=loop_forward,
        unsupported=floating_only,
        priority={},
        description="reference: per-expert loop, any device and float dtype (float64 too); host syncs",
    )
)
