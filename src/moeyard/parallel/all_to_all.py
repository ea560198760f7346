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

Stages (:mod:`.overlap` runs them over chunks of the tokens with the exchanges in flight):
:func:`depart_dispatch` (every chunk's plan, one counts exchange and one host sync for all chunks),
:func:`arrive_dispatch`, :func:`depart_combine`, :func:`arrive_combine`.
"""

from __future__ import annotations

import torch

from ..dispatch import make_plan, permute, unpermute
from . import fp8_rows
from .comm import EPGroup, all_to_all, exchange
from .common import Dispatched, EPOptions, Outgoing, chunk_bounds, local_experts

Tensor = torch.Tensor
EXPERTS_DROP_INVALID = True  # the local experts' drop_invalid (the received rows are exactly the routed ones)


def dispatch(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, ep: EPGroup, options: EPOptions) -> Dispatched:
    """``x [T, H]``, ``topk_ids [T, K]`` (global ids; others dropped), ``topk_weights [T, K]`` ->
    the rows this rank's experts compute, ``[R, H]`` with ``[R, 1]`` local ids (with
    ``options.fp8_dispatch`` sent as e4m3 rows, :mod:`.fp8_rows`)."""
    (out,) = depart_dispatch(x, topk_ids, topk_weights, ep, options)
    if options.fp8_dispatch:
        rows = fp8_rows.all_to_all(out.rows, out.out_splits, out.in_splits, ep.group, pad_rows=out.pad_rows)
        return arrive_dispatch(rows, None, out, ep, options)
    return arrive_dispatch(*exchange(out, ep.group), out, ep, options)


def combine(y: Tensor, dispatched: Dispatched) -> Tensor:
    """``y [R, H]`` (the experts' rows) -> ``[T, H]`` on the tokens' own rank."""
    out = depart_combine(y, dispatched)
    return arrive_combine(exchange(out, dispatched.state[-1])[0], dispatched)


def depart_dispatch(
    x: Tensor, topk_ids: Tensor, topk_weights: Tensor, ep: EPGroup, options: EPOptions, chunks: int = 1
) -> list[Outgoing]:
    """The tokens in ``chunks`` consecutive chunks of ``ceil(T / chunks)`` (any count per rank); per
    chunk the rows sorted by global expert id and their exact split sizes. One ``all_to_all_single``
    of every chunk's per-expert counts and one host read of all sizes (the host sync)."""
    W, El, n = ep.world_size, local_experts(options, ep), chunks
    bounds = chunk_bounds(x.shape[0], -(-x.shape[0] // n), n)
    chunks = [(x[a:b], topk_ids[a:b], topk_weights[a:b]) for a, b in bounds]
    plans = [make_plan(ids, options.num_experts) for _, ids, _ in chunks]
    counts = torch.stack([p.tokens_per_expert.to(torch.int64) for p in plans])  # [n, E]
    by_peer = counts.view(n, W, El).transpose(0, 1).contiguous()  # [W, n, E_l]: to each peer
    received = all_to_all(by_peer.view(-1), None, None, ep.group).view(W, n, El)  # from each source
    sizes = torch.cat([by_peer.sum(2).reshape(-1), received.sum(2).reshape(-1)]).view(2, W, n)
    send, recv = sizes.transpose(1, 2).tolist()  # the host sync: [n][W] each
    return [
        Outgoing(
            rows=permute(x, plan)[: sum(send[c])],
            out_splits=recv[c],
            in_splits=send[c],
            state=(plan, received[:, c], w),
        )
        for c, ((x, _, w), plan) in enumerate(zip(chunks, plans, strict=True))
    ]


def arrive_dispatch(rows: Tensor, ids, out: Outgoing, ep: EPGroup, options: EPOptions) -> Dispatched:
    """The received rows ``[R, H]`` (rank-major, expert ids ascending within each source) -> the
    :class:`Dispatched` for the local experts."""
    plan, received, topk_weights = out.state
    El = local_experts(options, ep)
    local = torch.arange(El, device=rows.device).repeat(ep.world_size)
    row_ids = torch.repeat_interleave(local, received.reshape(-1), output_size=rows.shape[0])
    return Dispatched(
        rows=rows,
        topk_ids=row_ids.unsqueeze(1),
        topk_weights=rows.new_ones(rows.shape[0], 1),
        state=(plan, out.in_splits, out.out_splits, topk_weights, ep.group),
    )


def depart_combine(y: Tensor, dispatched: Dispatched) -> Outgoing:
    """The experts' rows ``y [R, H]`` back to their sources: the dispatch's splits swapped."""
    plan, send, recv, _, _ = dispatched.state
    return Outgoing(rows=y, out_splits=send, in_splits=recv, pad_rows=plan.num_rows - sum(send))


def arrive_combine(back: Tensor, dispatched: Dispatched) -> Tensor:
    """``back [plan.num_rows, H]`` in the plan's sorted order (the returned rows, then zero rows in
    the places of pairs with ids outside ``[0, E)``) -> ``[T, H]`` (pairs weighted and summed)."""
    plan, _, _, topk_weights, _ = dispatched.state
    return unpermute(back, plan, topk_weights)
