"""The peer-to-peer exchange of the ``sync_free`` dispatcher: only the routed rows travel, read and
written straight in the peers' memory, counts and offsets never leave the device.

Selected with ``expert_parallel(model, dispatcher="sync_free", exchange="p2p")``. Every rank holds one
symmetric buffer ``X`` (``[S + 2, H]``, ``S = T_max * K``, the largest seen: room for this rank's pairs,
then a zero row and a scratch row), an index (``[S]`` int64), a scale (``[S]``, ``X``'s dtype) and a count
vector (``[W * E_l]`` int64), allocated with ``torch.distributed._symmetric_memory`` (CUDA; every peer's
buffer is mapped into this process, so a kernel reads and writes it over NVLink). Each exchange op is:
device barrier (every peer has finished reading ``X`` in the previous op), writes, device barrier (every
write has landed), reads; no host wait, and nothing depends on which op came before, so it holds for any
order of ops, ops skipped (an input without gradient) and CUDA-graph replays between eager calls:

- **dispatch** (pull): the rank copies its tokens ``x [T, H]`` into its own ``X``, writes each pair's
  token into the index in send order (sorted by destination rank, local expert, token), and its
  counts; barrier; it reads every peer's counts (``[W, W, E_l]``: rows from s to rank d's expert e),
  lays out its expert-major rows (each expert's rows from rank 0, 1, ... back to back, padded to a
  multiple of ``align``) and copies each peer's window of pairs for it, each row read at the token
  the peer's index names, out of the peer's ``X`` into a fresh ``[R, H]`` tensor (one
  :func:`moeyard.parallel.row_copy.copy_rows` for all peers, ``direction="pull"`` with ``index``).
  A token routed to several experts is written to ``X`` once (``T`` rows, not ``T * K``);
- **combine** (push): the rank copies the experts' output rows into the ``X`` of the rank each row
  came from, at the row's position in that rank's sorted order (``direction="push"``); barrier; each
  rank reads its pairs' rows out of its own ``X`` (the zero row for pairs not sent) and sums each
  token's, weighted.

The backward of dispatch is a combine (the rows' gradients pushed home, each token's pairs
summed), the backward of combine a dispatch that reuses the forward's layout: ``d out [T, H]`` is
copied into ``X``, the index names each pair's token and the scale its routing weight, so a pull
reads ``w * d out[token]`` and no ``[T * K, H]`` pair gradient is formed.

Against the ``all_to_all`` exchange (equal splits) this moves ``N_recv * H`` elements each way
instead of ``W * C * H`` (half at W = 2, K = 8, E_l >= 8); against the NVSHMEM ``symm_mem``
exchange it needs no ``torch.ops.symm_mem`` all-to-all and lays the rows out as it copies them.

Memory per rank (symmetric heap): ``(S + 2) * H * itemsize`` for the buffer, e.g. 1.07 GB at
qwen3-30b-a3b on 2 ranks (T_max = 32768, K = 8, H = 2048, bf16), and ``(8 + itemsize) S`` bytes for
the index and scale (2.5 MiB there), plus the fresh ``[R, H]`` rows
(``R = W * C + E_l * (align - 1)``, rounded up to ``align``: the static worst case of
:func:`moeyard.parallel.sync_free.block_rows`). Rows past the received ones (and their pad) are
not written: they belong to no expert (local id ``E_l``), which every backend skips, so no pass
writes bytes that carry nothing. Pad rows inside an expert's block are zeroed.

Buffers are allocated on first use per (group, device, dtype, H, E_l) (a host-side collective, once;
again only when a call needs a larger S) and kept for the process (:func:`buffers`,
:func:`release_buffers`). Tested with torch's default (CUDA)
symmetric-memory backend; ``benchmarks/ep_symm_check.py`` checks it on two GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import comm, send_order
from .comm import EPGroup
from .p2p_layout import layout_reference, num_rows
from .row_copy import copy_rows
from .send_order import SendOrder

Tensor = torch.Tensor


class TorchPeerOps:
    """Symmetric tensors of ``torch.distributed._symmetric_memory`` and their device barrier (the one
    place that touches them; tests substitute an emulation with the same contract for :data:`OPS`)."""

    def unavailable(self, ep: EPGroup) -> str | None:
        """Why the exchange cannot run on ``ep`` (a phrase), or None. Host metadata only."""
        return comm.symmetric_memory_unavailable(ep, "2.5")

    def symmetric(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, group
    ) -> tuple[list[Tensor], object]:
        """``(views, handle)``: a symmetric tensor of ``shape`` on every rank (collective), ``views[s]``
        rank s's copy as mapped into this process (``views[rank]`` the local one)."""
        import torch.distributed._symmetric_memory as symm

        name = group.group_name
        comm.enable_symmetric_memory(name)
        local = symm.empty(shape, dtype=dtype, device=device)
        handle = symm.rendezvous(local, name)
        views = [
            local if s == handle.rank else handle.get_buffer(s, list(shape), dtype) for s in range(handle.world_size)
        ]
        return views, handle

    def barrier(self, handle) -> None:
        """Every rank of the group reaches this point of its stream (a device barrier, no host wait)."""
        handle.barrier(channel=0)


OPS = TorchPeerOps()


def check_available(ep: EPGroup) -> None:
    """Raise ValueError when the exchange cannot run on ``ep`` (host metadata only).

    Raises:
        ValueError: not an NCCL group, no CUDA, no ``torch.distributed._symmetric_memory``.
    """
    reason = OPS.unavailable(ep)
    if reason:
        raise ValueError(f"exchange: 'p2p' {reason}; use exchange='all_to_all'")


# ---------------------------------------------------------------- buffers


@dataclass(eq=False)
class Buffers:
    """One key's symmetric tensors (module docstring).

    Attributes:
        rows: ``[S + 2, H]`` views by rank: row S zero, row S + 1 scratch.
        table: ``[W]`` int64, the views' addresses on this device (for the row-copy kernel).
        index: ``[S]`` int64 views by rank: the row of ``rows`` each send row reads.
        index_table: ``[W]`` int64, their addresses.
        scale: ``[S]`` views by rank (``rows``' dtype): the factor of each send row (a scaled pull).
        scale_table: ``[W]`` int64, their addresses.
        counts: ``[W * E_l]`` int64 views by rank: rows to rank d's expert e at ``d * E_l + e``.
        handle: what :meth:`TorchPeerOps.barrier` takes.
        capacity: S, the pairs' rows ``rows`` holds (row S is the zero row).
    """

    rows: list[Tensor]
    table: Tensor
    index: list[Tensor]
    index_table: Tensor
    scale: list[Tensor]
    scale_table: Tensor
    counts: list[Tensor]
    handle: object
    capacity: int


_BUFFERS: dict[tuple, Buffers] = {}
_RETIRED: list[Buffers] = []  # outgrown buffers, kept mapped (a captured graph or a step in flight may use them)


def buffers(
    ep: EPGroup, device: torch.device, dtype: torch.dtype, hidden: int, pairs: int, num_local_experts: int
) -> Buffers:
    """The cached :class:`Buffers` of ``(group, device, dtype, H, E_l)`` with room for ``pairs`` rows
    (S); allocated on first use and again, at exactly ``pairs``, when a call needs more rows than the
    cached one has (collective: every rank passes the same ``pairs``, as ``sync_free``'s ``T_max``
    is the same on every rank). A call needing fewer rows reuses the larger buffer. Outgrown buffers
    stay allocated until :func:`release_buffers`: a process whose token count keeps growing without
    ``max_tokens`` holds one buffer per increase, so pass ``max_tokens`` to hold one."""
    key = (ep.group.group_name, device, dtype, hidden, num_local_experts)
    cached = _BUFFERS.get(key)
    if cached is None or cached.capacity < pairs:
        if cached is not None:
            _RETIRED.append(cached)
        rows, handle = OPS.symmetric((pairs + 2, hidden), dtype, device, ep.group)
        index, _ = OPS.symmetric((pairs,), torch.int64, device, ep.group)
        scale, _ = OPS.symmetric((pairs,), dtype, device, ep.group)
        counts, _ = OPS.symmetric((ep.world_size * num_local_experts,), torch.int64, device, ep.group)
        rows[ep.rank][pairs].zero_()
        _BUFFERS[key] = Buffers(
            rows=rows,
            table=_addresses(rows, device),
            index=index,
            index_table=_addresses(index, device),
            scale=scale,
            scale_table=_addresses(scale, device),
            counts=counts,
            handle=handle,
            capacity=pairs,
        )
    return _BUFFERS[key]


def _addresses(views: list[Tensor], device: torch.device) -> Tensor:
    return torch.tensor([v.data_ptr() for v in views], dtype=torch.int64, device=device)


def release_buffers() -> None:
    """Drop every cached symmetric buffer, outgrown ones included (call on every rank, between steps,
    when no exchange is in flight and no captured CUDA graph that used them will be replayed)."""
    _BUFFERS.clear()
    _RETIRED.clear()


# ---------------------------------------------------------------- the layout


@dataclass(eq=False, kw_only=True)
class Handle(SendOrder):
    """What one dispatch leaves for its combine and both backwards (device tensors), besides the
    send order (:class:`moeyard.parallel.send_order.SendOrder`: ``pair_row`` is each pair's row of
    ``X``).

    Attributes:
        bufs: the :class:`Buffers`. rank, align: as given.
        num_rows: R, the static expert-major rows.
        dst_rows: ``[W, C]`` int64, row j of the window peer s sends here -> its expert-major row.
        window: ``[W]`` int64, where that window starts in peer s's sorted order.
        received: ``[W]`` int64, rows peer s sends here.
        pad_rows: ``[E_l * (align - 1)]`` int64, the pad rows inside the experts' blocks (R: none).
        row_experts: ``[R]`` int64, local expert of each row (``E_l``: none).
    """

    bufs: Buffers
    rank: int
    align: int
    num_rows: int = 0
    dst_rows: Tensor | None = None
    window: Tensor | None = None
    received: Tensor | None = None
    pad_rows: Tensor | None = None
    row_experts: Tensor | None = None


def layout(h: Handle, all_counts: Tensor) -> None:
    """Fill ``h``'s layout from ``all_counts [W, W, E_l]`` (rows from s to rank d's expert e): one
    Triton launch on CUDA (:mod:`.p2p_layout_triton`), :func:`layout_reference` elsewhere."""
    route = h.route
    h.num_rows = R = num_rows(route.world_size, route.block_rows, route.num_local_experts, h.align)
    fn = layout_reference
    if all_counts.is_cuda:
        from .p2p_layout_triton import layout_triton as fn
    h.dst_rows, h.window, h.received, h.pad_rows, h.row_experts = fn(all_counts, h.rank, h.align, route.block_rows, R)


# ---------------------------------------------------------------- the exchange


def dispatch(x: Tensor, route, ep: EPGroup, align: int) -> tuple[Tensor, Tensor, Handle]:
    """``x [T, H]`` and a ``sync_free.Route`` -> ``(rows [R, H], row experts [R] int64, handle)``:
    the rows this rank's experts compute, expert-major, each expert's rows padded to a multiple of
    ``align`` (pad rows zero; rows past the last block unwritten, local id ``E_l``). Differentiable
    w.r.t. ``x``.

    Raises:
        ValueError: as :func:`check_available`. Raised before any collective.
    """
    check_available(ep)
    bufs = buffers(ep, x.device, x.dtype, x.shape[1], route.max_tokens * route.top_k, route.num_local_experts)
    h = Handle(**send_order.order_pairs(route, zero_row=bufs.capacity), bufs=bufs, rank=ep.rank, align=align)
    rows = send_order.dispatch(x, h, _pull, _push)
    return rows, h.row_experts, h


def combine(y: Tensor, h: Handle, weights: Tensor) -> Tensor:
    """``y [R, H]`` (the experts' rows, as :func:`dispatch` gave them), ``weights [T, K]`` -> ``[T, H]``:
    each pair's row back on its own rank (zeros where not sent), weighted and summed per token
    (:func:`moeyard.parallel.send_order.combine`). Differentiable w.r.t. ``y`` and ``weights``."""
    return send_order.combine(y, weights, h, _pull, _push)


def new_rows(rows: int, like: Tensor) -> Tensor:
    """The fresh expert-major rows (plus a scratch row), left unwritten but for what the copies and
    the pad fill write (tests substitute a NaN-filled tensor to check no backend reads the rest)."""
    return like.new_empty(rows + 1, like.shape[1])


def _pull(h: Handle, src: Tensor, index: Tensor, scale: Tensor | None = None) -> Tensor:
    """Barrier, write ``src [n, H]`` (``n <= S``) into this rank's buffer, ``index [N]`` (the row
    of ``src`` of each send row) into its index and ``scale [N]`` (if given) into its scale,
    barrier, copy each peer's window for this rank into fresh expert-major rows ``[R, H]``. The first
    pull of a handle (dispatch's forward) also sends the counts and lays out the rows."""
    b = h.bufs
    me, W = h.rank, h.route.world_size
    OPS.barrier(b.handle)
    b.rows[me][: src.shape[0]].copy_(src)
    b.index[me][: index.shape[0]].copy_(index)
    if scale is not None:
        b.scale[me][: scale.shape[0]].copy_(scale)
    first = h.dst_rows is None
    if first:
        b.counts[me].copy_(h.send_counts)
    OPS.barrier(b.handle)
    if first:
        layout(h, torch.stack(b.counts).view(W, W, h.route.num_local_experts))
    out = new_rows(h.num_rows, b.rows[me])
    copy_rows(
        out,
        b.rows,
        b.table,
        h.dst_rows,
        h.window,
        h.received,
        direction="pull",
        index=(b.index, b.index_table),
        scale=None if scale is None else (b.scale, b.scale_table),
    )
    if h.pad_rows is not None:
        out.index_fill_(0, h.pad_rows, 0)
    return out[: h.num_rows]


def _push(h: Handle, rows: Tensor) -> tuple[Tensor, Tensor]:
    """Barrier, copy ``rows [R, H]`` (expert-major, as dispatched) into the buffers of the ranks they
    came from, barrier; returns ``(X, pair_row)``: each of this rank's pairs' rows is ``X[pair_row]``
    (the zero row where not sent)."""
    b = h.bufs
    rows = rows.contiguous()
    OPS.barrier(b.handle)
    copy_rows(rows, b.rows, b.table, h.dst_rows, h.window, h.received, direction="push")
    OPS.barrier(b.handle)
    return b.rows[h.rank], h.pair_row
