"""An expert backend in one file: ``gather_bmm``, each routed row times its own expert's weights.

A teaching example of the registry's contract (``moeyard.experts.registry``), not a fast path: it
gathers one ``[out, in]`` weight per row (memory ``R * out * in``). Built on
``moeyard.experts.pipeline.routed_ffn`` (permute -> up projection -> activation -> down projection ->
unpermute, biases and LoRA applied there), it needs only a grouped GEMM: ``rows [R, in]`` times
``w[e].T`` for each row's expert ``e``, with no host sync. After ``import custom_backend``::

    moeyard.experts(x, topk_ids, topk_weights, gate_up_proj, down_proj, backend="gather_bmm")
    moeyard.MoE(config, backend="gather_bmm")
"""

from __future__ import annotations

import torch

from moeyard.experts.pipeline import routed_ffn
from moeyard.experts.registry import ExpertBackend, floating_only, register_backend


def gathered_gemm(rows: torch.Tensor, w: torch.Tensor, plan) -> torch.Tensor:
    """``rows [R, in]`` -> ``[R, out]``: each row times its expert's ``w[e].T`` (``w [E, out, in]``).
    Rows past the last expert (pairs with an invalid id, dropped by the combine) use expert E - 1."""
    experts = plan.row_experts().clamp(max=w.shape[0] - 1)  # [R], on the device
    return torch.bmm(rows.unsqueeze(1), w.index_select(0, experts).mT).squeeze(1)


def gather_bmm_forward(x, topk_ids, topk_weights, weights, activation, *, drop_invalid=False):
    """The routed expert FFN, shapes as :func:`moeyard.experts`: ``x [T, H]`` -> ``[T, H]``."""
    return routed_ffn(x, topk_ids, topk_weights, weights, activation, gathered_gemm, drop_invalid=drop_invalid)


register_backend(
    ExpertBackend(
        name="gather_bmm",
        forward=gather_bmm_forward,
        unsupported=floating_only,  # None where it runs, else the reason: any device, any float dtype
        priority={},  # device type -> rank for `auto`; empty: runs only when named
        description="each row times its expert's gathered weights; any device and float dtype; no host sync",
    )
)
