"""What the router returns: :class:`RoutingOutput`, and :func:`finish`, which both router
implementations (the torch path in :mod:`moeyard.routing`, the fused kernels in :mod:`.fused`) end with."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import MoEConfig

Tensor = torch.Tensor


@dataclass(frozen=True)
class RoutingOutput:
    """What the router returns.

    Attributes:
        topk_ids: ``[T, K]`` int64 expert ids.
        topk_weights: ``[T, K]`` float32 routing weights (differentiable); float64 for float64 input,
            as every floating field here.
        router_logits: ``[T, E]`` float32 (float64).
        scores: ``[T, E]`` float32 (float64), ``softmax`` or ``sigmoid`` of the logits.
        tokens_per_expert: ``[E]`` float32 counts of routed pairs (no gradient), for monitoring and
            :func:`update_correction_bias`.
        aux_loss, seq_aux_loss, z_loss: unweighted scalar losses (:mod:`moeyard.routing`).
        loss: the coefficient-weighted sum of the three (from the config).
    """

    topk_ids: Tensor
    topk_weights: Tensor
    router_logits: Tensor
    scores: Tensor
    tokens_per_expert: Tensor
    aux_loss: Tensor
    seq_aux_loss: Tensor
    z_loss: Tensor
    loss: Tensor


# A pytree node, so that torch.utils._pytree (FSDP2's pre-backward hooks, torch.compile, export) sees
# its tensors: before torch 2.13, FSDP2 found no tensor in a router's output that it did not flatten,
# hooked none, and its backward read the router's freed (resharded) weight.
torch.utils._pytree.register_dataclass(RoutingOutput)


def finish(
    config: MoEConfig,
    ids: Tensor,
    w: Tensor,
    logits: Tensor,
    scores: Tensor,
    counts: Tensor,
    aux: Tensor,
    seq: Tensor,
    z: Tensor,
    loss: Tensor | None = None,
) -> RoutingOutput:
    """The :class:`RoutingOutput` of these tensors, with the coefficient-weighted ``loss`` (computed
    here unless given)."""
    if loss is None:
        loss = config.aux_loss_coef * aux + config.seq_aux_loss_coef * seq + config.z_loss_coef * z
    return RoutingOutput(
        topk_ids=ids,
        topk_weights=w,
        router_logits=logits,
        scores=scores,
        tokens_per_expert=counts,
        aux_loss=aux,
        seq_aux_loss=seq,
        z_loss=z,
        loss=loss,
    )
