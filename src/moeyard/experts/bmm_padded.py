"""``bmm_padded``: pad each expert's tokens to ``[E, C, H]`` and use ``torch.bmm``.

For devices without a grouped GEMM (XPU, MPS, older GPUs) and for float64. C is the largest number
of tokens any expert received, read once per call with a host sync (the buffer's size depends on
it). Memory: ``E * C * (2H + N1 + I)`` activation elements (N1 = 2I gated, else I), against
``N * (2H + N1 + I)`` for a grouped GEMM with N = T*K routed pairs: about the same under balanced
routing, up to E/K times more when one expert takes every token (C = T).
"""

from __future__ import annotations

import torch

from ..activations import Activation
from ..dispatch import make_plan
from .registry import ExpertBackend, floating_only, register_backend
from .scaled import Emulated, GroupedOps, scaled_linear
from .weights import ExpertWeights, Projection

Tensor = torch.Tensor


def bmm_padded_forward(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    weights: ExpertWeights,
    activation: Activation,
    *,
    drop_invalid: bool = False,
) -> Tensor:
    """Shapes as :func:`moeyard.experts`. Syncs once to size the padded buffer.

    Raises:
        ValueError: an expert id outside ``[0, E)`` when ``drop_invalid`` is False.
    """
    E = weights.num_experts
    T, K = topk_ids.shape
    plan = make_plan(topk_ids, E)
    num_invalid = (~plan.valid).sum()
    capacity, bad = torch.stack([plan.tokens_per_expert.max().to(num_invalid.dtype), num_invalid]).tolist()
    if bad and not drop_invalid:
        raise ValueError(f"topk_ids: expected expert ids in [0, {E}), got {bad} outside that range")
    flat = topk_ids.reshape(-1).to(torch.int64)
    # slot of each pair in the flat [E * C] buffer; invalid pairs go to the spare slot E * C
    rank = plan.pair_rows - plan.expert_offsets.to(torch.int64)[flat.clamp(0, E - 1)]
    slot = torch.where(plan.valid, flat * capacity + rank, E * capacity)
    tokens = torch.arange(T * K, device=x.device) // K
    x_pad = x.new_zeros(E * capacity + 1, x.shape[1]).index_copy(0, slot, x.index_select(0, tokens))
    x_pad = x_pad[:-1].view(E, capacity, x.shape[1])
    h = _bmm(x_pad, weights.up)
    a = activation(h, interleaved=weights.interleaved)
    y = _bmm(a, weights.down).reshape(E * capacity, x.shape[1])
    y = torch.cat([y, y.new_zeros(1, y.shape[1])])
    pairs = y.index_select(0, slot).view(T, K, x.shape[1])
    return torch.bmm(topk_weights.to(pairs.dtype).unsqueeze(1), pairs).squeeze(1)


def _bmm(a: Tensor, proj: Projection) -> Tensor:
    """``a [E, C, in] @ W[e].T (+ b[e]) (+ s (a A_e^T) B_e^T)`` with ``W [E, out, in]`` -> ``[E, C, out]``
    (``a @ W[e].T`` under ``proj.recipe``'s emulated FP8 GEMMs when it has one; the pad rows are zero, so
    they leave every block's scale as it is)."""
    w, b, lora = proj.weight, proj.bias, proj.lora
    if proj.recipe is not None:
        y = scaled_linear(a, w, None, proj.recipe, EMULATED)
        y = y if b is None else y + b.to(a.dtype).unsqueeze(1)
    else:
        y = torch.bmm(a, w.mT) if b is None else torch.baddbmm(b.to(a.dtype).unsqueeze(1), a, w.mT)
    if lora is not None:
        y = torch.baddbmm(y, torch.bmm(a, lora.a.mT), lora.b.mT, alpha=lora.scaling)
    return y


# a batch of experts: a [E, C, K], w [E, N, K]
EMULATED = Emulated(
    GroupedOps(mm=lambda a, w, offsets: torch.bmm(a, w.mT), kmm=lambda dy, a, offsets: torch.bmm(dy.mT, a))
)

register_backend(
    ExpertBackend(
        name="bmm_padded",
        forward=bmm_padded_forward,
        unsupported=floating_only,
        priority={"cuda": 10, "cpu": 10, "mps": 10, "xpu": 10},
        description="pads to [E, max_tokens, H] and uses torch.bmm; any device and float dtype; one host sync",
    )
)
