"""What the two symmetric-memory exchanges of ``sync_free`` share (:mod:`.symm_mem`, :mod:`.p2p`):
each rank's pairs in send order, and the autograd around an exchange's two directions.

An exchange gives two functions of its handle ``h`` (a :class:`SendOrder`):

- ``send(h, src, index, scale=None) -> rows [R, H]``: this rank's rows in send order are
  ``src[index]`` (``src [*, H]``, ``index [N]`` int64 rows of ``src``), each times ``scale[j]``
  (``[N]`` in ``src``'s dtype; product in float32, float64 for float64, rounded once) when given;
  the exchange moves them to the ranks owning their experts and returns the fresh expert-major rows
  there. Dispatch sends ``x`` at each
  pair's token; combine's backward ``d out`` at each pair's token scaled by the pair's weight;
- ``back(h, rows [R, H]) -> (src [*, H], index [N])``: the reverse, each of this rank's pairs' rows
  as ``src[index]`` (a zero row where not sent); ``src`` is the exchange's buffer, read at once.

Dispatch is ``send`` forward and ``back`` backward (each token's pair gradients summed); combine the
other way round, with the weighted sum over each token's pairs inside: its backward sends ``d out``
with the weights as ``scale``, so no ``[T, K, H]`` gradient of the pairs is formed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..dispatch import make_plan
from ..weighted_sum import gathered_sum, weights_grad

Tensor = torch.Tensor


@dataclass(eq=False, kw_only=True)
class SendOrder:
    """A rank's pairs sorted by global expert (so by destination rank, then local expert; token order
    within). All tensors on the device; ``N = T * K``.

    Attributes:
        route: the ``sync_free.Route``.
        send_counts: ``[W * E_l]`` int64, rows to rank d's expert e at ``d * E_l + e``.
        sort_order: ``[N]`` int64, send row -> its pair (sent pairs first).
        pair_row: ``[N]`` int64, pair -> its send row (the buffer's zero row, ``S = T_max * K`` unless
            the exchange's buffer is larger, where not sent).
    """

    route: object
    send_counts: Tensor
    sort_order: Tensor
    pair_row: Tensor


def order_pairs(route, zero_row: int | None = None) -> dict:
    """The :class:`SendOrder` fields of a ``sync_free.Route`` (keyword arguments for a handle);
    ``pair_row`` of a pair not sent is ``zero_row`` (default ``S = T_max * K``), the buffer's zero row."""
    T, K, E = route.num_tokens, route.top_k, route.num_experts
    plan = make_plan(route.ids.view(T, K), E)
    zero = route.max_tokens * K if zero_row is None else zero_row
    return dict(
        route=route,
        send_counts=plan.tokens_per_expert.to(torch.int64),
        sort_order=plan.sort_order,
        pair_row=torch.where(route.ids < E, plan.pair_rows, zero),
    )


def dispatch(x: Tensor, h: SendOrder, send, back) -> Tensor:
    """``x [T, H]`` -> the expert-major rows ``send`` returns. Differentiable w.r.t. ``x``."""
    return _Dispatch.apply(x, h, send, back)


def combine(y: Tensor, weights: Tensor, h: SendOrder, send, back) -> Tensor:
    """``y [R, H]`` (as dispatched), ``weights [T, K]`` -> ``[T, H]``: ``sum_k w[t, k] * row(t, k)``,
    each pair's row back on its own rank (zeros where not sent), summed as
    :func:`moeyard.weighted_sum.weighted_sum`. Differentiable w.r.t. ``y`` and ``weights``."""
    return _Combine.apply(y, weights, h, send, back)


def rows_sent(h: SendOrder) -> int:
    """Rows this rank sent in the dispatch (reads the device: benchmarks only)."""
    return int(h.send_counts.sum())


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, h, send, back):
        ctx.h, ctx.back = h, back
        K = h.route.top_k
        return send(h, x, h.sort_order // K)

    @staticmethod
    def backward(ctx, grad_rows):
        h = ctx.h
        src, index = ctx.back(h, grad_rows)
        return gathered_sum(src, index.view(h.route.num_tokens, h.route.top_k))[0], None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, weights, h, send, back):
        ctx.h, ctx.send, ctx.weights_dtype = h, send, weights.dtype
        src, index = back(h, y)
        w = weights.to(src.dtype)
        out, pairs = gathered_sum(src, index.view(h.route.num_tokens, h.route.top_k), w, keep=ctx.needs_input_grad[1])
        ctx.save_for_backward(pairs, w)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        h = ctx.h
        pairs, w = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        rows = d_w = None
        if ctx.needs_input_grad[0]:  # each sent pair's row: d out[token] * w[pair]
            scale = w.reshape(-1).index_select(0, h.sort_order)
            rows = ctx.send(h, grad_out, h.sort_order // h.route.top_k, scale)
        if ctx.needs_input_grad[1]:
            d_w = weights_grad(pairs, grad_out).to(ctx.weights_dtype)
        return rows, d_w, None, None, None
