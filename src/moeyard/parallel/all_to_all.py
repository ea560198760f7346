"""The ``all_to_all`` dispatcher: exact-size exchanges, one host sync per layer call.

dispatch: a dispatch plan sorts this rank's pairs by global expert id (so by destination rank, then
by expert); the per-expert counts ``[E]`` go to their owners with one ``all_to_all_single`` of equal
splits (``E_l`` counts per peer); the send and receive sizes are then read on the host together
(the one device-to-host sync, as in torchtitan and Megatron), and the rows follow with the
differentiable ``all_to_all_single`` of exactly those sizes. Received rows are rank-major, expert
ids ascending within each source.

combine: the reverse all-to-all, then :func:`moeyard.unpermute` weights and sums each token's pairs
on its own rank (router gradients stay local).

Memory: exactly the routed rows, ``[N, H]`` sent and ``[R, H]`` received per rank.
"""
from __future__ import annotations

import torch

from ..dispatch import make_plan, permute, unpermute
from .comm import EPGroup, all_to_all
from .common import Dispatched, EPOptions, local_experts

Tensor = torch.Tensor


def dispatch(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, ep: EPGroup, options: EPOptions) -> Dispatched:
    """``x [T, H]``, ``topk_ids [T, K]`` (global ids; others dropped), ``topk_weights [T, K]`` ->
    the rows this rank's experts compute, ``[R, H]`` with ``[R, 1]`` local ids."""
    W, El = ep.world_size, local_experts(options, ep)
    plan = make_plan(topk_ids, options.num_experts)
    counts = plan.tokens_per_expert.to(torch.int64)  # [E]: to rank d, counts[d * El:(d + 1) * El]
    received = all_to_all(counts, None, None, ep.group).view(W, El)  # [W, E_l]: from each source
    sizes = torch.cat([counts.view(W, El).sum(1), received.sum(1)]).tolist()  # the host sync
    send, recv = sizes[:W], sizes[W:]
    rows = all_to_all(permute(x, plan)[:sum(send)], recv, send, ep.group)
    ids = torch.arange(El, device=x.device).repeat(W)
    row_ids = torch.repeat_interleave(ids, received.reshape(-1), output_size=sum(recv))
    return Dispatched(rows=rows, topk_ids=row_ids.unsqueeze(1), topk_weights=rows.new_ones(rows.shape[0], 1),
                      state=(plan, send, recv, topk_weights, ep.group))


def combine(y: Tensor, dispatched: Dispatched) -> Tensor:
    """``y [R, H]`` (the experts' rows) -> ``[T, H]`` on the tokens' own rank."""
    plan, send, recv, topk_weights, group = dispatched.state
    back = all_to_all(y, send, recv, group)  # [sum(send), H], in the plan's sorted order
    rows = torch.cat([back, back.new_zeros(plan.num_rows - back.shape[0], back.shape[1])])  # dropped ids: 0
    return unpermute(rows, plan, topk_weights)
