"""Exchanges overlapped with expert compute (``overlap_chunks=N``, ``all_to_all`` and ``sync_free``).

The layer's tokens go in N chunks through the dispatcher's stages (``depart_dispatch``,
``arrive_dispatch``, ``depart_combine``, ``arrive_combine``); every exchange is an
``all_to_all_single(async_op=True)`` waited just before its result is used. Forward, for N = 3::

    send d0, send d1 | wait d0, experts 0, send c0, send d2 | wait d1, experts 1, send c1
                     | wait d2, experts 2, send c2 | wait c0, c1, c2

so chunk c + 1's dispatch and chunk c's combine are in flight while chunk c + 1's experts compute.
Backward mirrors it: each receive's backward issues the reverse exchange of its gradient and each
send's backward waits for it, so chunk c's reverse combine is in flight during chunk c + 1's
expert backward and chunk c + 1's reverse dispatch during chunk c's.

Order: every send and receive takes and returns an empty "order" tensor, chained in the forward
order above. The chain is an autograd dependency, so backward runs these nodes in exactly the
reverse order on every rank, and every rank issues its collectives in the same order (which a
process group needs) whatever else the autograd engine schedules in between.

Tensor lifetimes: a pending exchange keeps its send and receive buffers referenced until
``wait()`` (on NCCL the collective runs on its own stream; ``wait()`` makes the current stream wait
for it, with no host sync, and the buffers are only released afterwards).

On gloo the collectives run on gloo's own threads; on NCCL on the communicator's stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .comm import EPGroup, receive_buffer
from .common import EPOptions, Outgoing

Tensor = torch.Tensor


@dataclass
class Pending:
    """An exchange in flight: its ``Work`` handles, the received rows (and ids), and every buffer
    referenced until :meth:`wait`."""

    works: list = field(default_factory=list)
    rows: Tensor | None = None
    ids: Tensor | None = None
    buffers: list = field(default_factory=list)

    def wait(self) -> tuple[Tensor, Tensor | None]:
        for work in self.works:
            work.wait()
        rows, ids = self.rows, self.ids
        self.works, self.buffers, self.rows, self.ids = [], [], None, None
        return rows, ids


def start(
    x: Tensor, out_splits, in_splits, group, out_rows: int | None = None, ids: Tensor | None = None, pad_rows: int = 0
) -> Pending:
    """Issue ``all_to_all_single(async_op=True)`` of ``ids`` (equal splits; first) and of ``x``
    (``in_splits`` rows to each rank, ``out_splits`` from each; None: equal, ``out_rows`` rows),
    received into a buffer with ``pad_rows`` trailing zero rows."""
    p = Pending()
    if ids is not None:
        p.ids = _issue(p, ids, None, None, group, None, 0)
    p.rows = _issue(p, x, out_splits, in_splits, group, out_rows, pad_rows)
    return p


def _issue(p: Pending, x: Tensor, out_splits, in_splits, group, out_rows, pad_rows) -> Tensor:
    src = x.contiguous()
    buffer, received = receive_buffer(src, out_splits, out_rows, pad_rows)
    p.works.append(dist.all_to_all_single(received, src, out_splits, in_splits, group=group, async_op=True))
    p.buffers += [src, buffer]
    return buffer


@dataclass
class Link:
    """What a :class:`_Send` and its :class:`_Receive` share: the exchange's payload until it is sent
    (then only its splits are kept, so the sent rows are not held until backward), the forward
    exchange in flight, and in backward the reverse exchange of the gradient."""

    out: Outgoing | None
    group: object
    out_splits: list[int] | None = None
    in_splits: list[int] | None = None
    pad_rows: int = 0
    forward: Pending | None = None
    backward: Pending | None = None
    rows_sent: int = 0
    needs_grad: bool = False


class _Send(torch.autograd.Function):
    """Forward: issue the exchange of ``rows``. Backward: wait for the reverse exchange that the
    matching :class:`_Receive`'s backward issued; it is the gradient of ``rows``."""

    @staticmethod
    def forward(ctx, order, rows, link):
        out, link.out = link.out, None
        link.out_splits, link.in_splits, link.pad_rows = out.out_splits, out.in_splits, out.pad_rows
        link.forward = start(rows, out.out_splits, out.in_splits, link.group, ids=out.ids, pad_rows=out.pad_rows)
        link.rows_sent, link.needs_grad = rows.shape[0], ctx.needs_input_grad[1]
        ctx.link = link
        return order.new_empty(0)

    @staticmethod
    def backward(ctx, d_order):
        pending, ctx.link.backward = ctx.link.backward, None
        return d_order, (pending.wait()[0] if pending is not None else None), None


class _Receive(torch.autograd.Function):
    """Forward: wait for the exchange; returns ``(rows, ids, order)`` (``ids`` empty when none were
    sent). Backward: issue the reverse exchange of the rows' gradient (when the sent rows need one)."""

    @staticmethod
    def forward(ctx, order, link):
        rows, ids = link.forward.wait()
        link.forward = None
        ids = order.new_empty(0, dtype=torch.int64) if ids is None else ids
        ctx.mark_non_differentiable(ids)
        if not link.needs_grad:
            ctx.mark_non_differentiable(rows)
        ctx.set_materialize_grads(False)  # no zero gradients made for ids, nor for rows that need none
        ctx.link, ctx.rows_like, ctx.num_rows = link, rows.new_empty((0, *rows.shape[1:])), rows.shape[0]
        next_order = order.new_empty(0)
        ctx.order_like = next_order.detach()
        return rows, ids, next_order

    @staticmethod
    def backward(ctx, d_rows, d_ids, d_order):
        link = ctx.link
        if link.needs_grad:  # the peers wait for this exchange: send zeros if the rows got no gradient
            if d_rows is None:
                d_rows = ctx.rows_like.new_zeros((ctx.num_rows, *ctx.rows_like.shape[1:]))
            received = d_rows.shape[0] - link.pad_rows
            link.backward = start(d_rows[:received], link.in_splits, link.out_splits, link.group, link.rows_sent)
        return ctx.order_like if d_order is None else d_order, None


def send(out: Outgoing, group, order: Tensor) -> tuple[Link, Tensor]:
    """Issue ``out``'s exchange; returns its link and the next order tensor."""
    link = Link(out=out, group=group)
    return link, _Send.apply(order, out.rows, link)


def receive(link: Link, order: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Wait for ``link``'s exchange: ``(rows, ids, next order)``."""
    return _Receive.apply(order, link)


def pipelined(
    dispatcher, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, ep: EPGroup, options: EPOptions, compute
) -> tuple[Tensor, Tensor | None]:
    """``dispatcher`` (the ``all_to_all`` or ``sync_free`` module) over ``options.overlap_chunks``
    chunks, ``compute(dispatched) -> y`` running the local experts. Returns ``(out [T, H], dropped)``,
    ``dropped`` summed over chunks (None for ``all_to_all``)."""
    outs = dispatcher.depart_dispatch(x, topk_ids, topk_weights, ep, options, options.overlap_chunks)
    order = x.new_empty(0)
    links = [None] * len(outs)
    links[0], order = send(outs[0], ep.group, order)
    combines = []
    for c in range(len(outs)):
        if c + 1 < len(outs):
            links[c + 1], order = send(outs[c + 1], ep.group, order)
        rows, ids, order = receive(links[c], order)
        d = dispatcher.arrive_dispatch(rows, ids, outs[c], ep, options)
        link, order = send(dispatcher.depart_combine(compute(d), d), ep.group, order)
        combines.append((link, d))
    results = []
    for link, d in combines:
        back, _, order = receive(link, order)
        results.append(dispatcher.arrive_combine(back, d))
    # overlap is refused with capacity_factor, so no chunk drops pairs: the first chunk's count (0) stands for all
    return torch.cat(results), combines[0][1].dropped
