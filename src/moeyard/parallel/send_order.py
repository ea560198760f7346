"""What the two symmetric-memory exchanges of ``sync_free`` share (:mod:`.symm_mem`, :mod:`.p2p`):
each rank's pairs in send order, and the autograd around an exchange's two directions.

An exchange gives two functions of its handle ``h`` (a :class:`SendOrder`):

- ``send(h, fill) -> rows [R, H]``: ``fill(buf)`` writes this rank's rows in send order into
  ``buf[:N]``; the exchange moves them to the ranks owning their experts and returns the fresh
  expert-major rows there;
- ``back(h, rows [R, H]) -> [N, H]``: the reverse, each of this rank's pairs' rows (zeros where not
  sent).

Dispatch is ``send`` forward and ``back`` backward (each token's pair gradients summed); combine the
other way round.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..dispatch import make_plan

Tensor = torch.Tensor


@dataclass(eq=False, kw_only=True)
class SendOrder:
    """A rank's pairs sorted by global expert (so by destination rank, then local expert; token order
    within). All tensors on the device; ``N = T * K``.

    Attributes:
        route: the ``sync_free.Route``.
        send_counts: ``[W * E_l]`` int64, rows to rank d's expert e at ``d * E_l + e``.
        sort_order: ``[N]`` int64, send row -> its pair (sent pairs first).
        pair_row: ``[N]`` int64, pair -> its send row (``S = T_max * K``, the buffer's zero row, where
            not sent).
    """

    route: object
    send_counts: Tensor
    sort_order: Tensor
    pair_row: Tensor


def order_pairs(route) -> dict:
    """The :class:`SendOrder` fields of a ``sync_free.Route`` (keyword arguments for a handle)."""
    T, K, E = route.num_tokens, route.top_k, route.num_experts
    plan = make_plan(route.ids.view(T, K), E)
    return dict(route=route, send_counts=plan.tokens_per_expert.to(torch.int64), sort_order=plan.sort_order,
                pair_row=torch.where(route.ids < E, plan.pair_rows, route.max_tokens * K))


def dispatch(x: Tensor, h: SendOrder, send, back) -> Tensor:
    """``x [T, H]`` -> the expert-major rows ``send`` returns. Differentiable w.r.t. ``x``."""
    return _Dispatch.apply(x, h, send, back)


def combine(y: Tensor, h: SendOrder, send, back) -> Tensor:
    """``y [R, H]`` (as dispatched) -> ``[T, K, H]``, each pair's row back on its own rank (zeros where
    not sent). Differentiable w.r.t. ``y``."""
    return _Combine.apply(y, h, send, back)


def rows_sent(h: SendOrder) -> int:
    """Rows this rank sent in the dispatch (reads the device: benchmarks only)."""
    return int(h.send_counts.sum())


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, h, send, back):
        ctx.h, ctx.back = h, back
        N, K = h.sort_order.numel(), h.route.top_k
        return send(h, lambda buf: torch.index_select(x, 0, h.sort_order // K, out=buf[:N]))

    @staticmethod
    def backward(ctx, grad_rows):
        h = ctx.h
        pairs = ctx.back(h, grad_rows)
        return pairs.view(h.route.num_tokens, h.route.top_k, pairs.shape[1]).sum(1), None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, h, send, back):
        ctx.h, ctx.send = h, send
        pairs = back(h, y)
        return pairs.view(h.route.num_tokens, h.route.top_k, pairs.shape[1])

    @staticmethod
    def backward(ctx, grad_pairs):
        h = ctx.h
        flat = grad_pairs.reshape(-1, grad_pairs.shape[-1])
        rows = ctx.send(h, lambda buf: torch.index_select(flat, 0, h.sort_order, out=buf[:flat.shape[0]]))
        return rows, None, None, None
