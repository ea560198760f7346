"""The symmetric-memory (NVSHMEM) exchange of the ``sync_free`` dispatcher: only the routed rows
travel, counts and offsets never leave the device.

Selected with ``expert_parallel(model, dispatcher="sync_free", exchange="symm_mem")``. It uses the
device-driven all-to-alls of ``torch.distributed._symmetric_memory`` (torch >= 2.8 with NVSHMEM),
which read the splits from device tensors, exchange them inside the kernel and pull each peer's
rows (the receiver reads the sender's buffer):

- ``all_to_all_vdev_2d(input, out, in_splits [W * E_l], out_splits_offsets [2, E_l * W], group,
  major_align)``: ``input`` rank-major (rows for rank d's expert e at chunk ``d * E_l + e``, chunks
  back to back), ``out`` expert-major (expert e's block holds its rows from rank 0, 1, ... back to
  back, padded at its end to a multiple of ``major_align``; an empty expert still gets
  ``major_align`` rows); ``out_splits_offsets`` gets the received splits and their row offsets,
  both indexed ``e * W + s``. Its reverse, ``all_to_all_vdev_2d_offset(input, out,
  in_splits_offsets [2, E_l * W], out_splits_offsets [2, W * E_l], group)``, sends those chunks back
  and writes them rank-major, back to back (no padding). Limits in their source (pytorch #167966):
  E_l <= 16 and W <= 32 for the first, W <= 16 for the reverse.
- ``all_to_all_vdev(input, out, in_splits [W], out_splits_offsets [2, W], group)``: the 1-D
  variable all-to-all (rank-major in and out, back to back); it is its own reverse.

Two paths (:func:`use_2d`):

- **2-D** (E_l <= 16 and W <= 16): dispatch is ``all_to_all_vdev_2d`` with ``major_align = align``,
  so the received rows land expert-major and padded, as the grouped GEMM reads them; combine is
  ``all_to_all_vdev_2d_offset`` with the dispatch's received splits and offsets.
- **1-D** (E_l > 16 or W > 16; W <= 32): ``all_to_all_vdev`` both ways; the per-(source, expert)
  counts go with one ``all_to_all_single`` of ``W * E_l`` int64 (equal splits, no host read) and a
  dispatch plan places the received rows expert-major on the device.

Why 1-D rather than calls over chunks of <= 16 local experts when E_l > 16 (e.g. E = 128 on 2
ranks: E_l = 64): both move exactly the routed rows (``N_recv * H`` elements in, the same out in
combine), but chunks need ``ceil(E_l / 16)`` calls each way, each with its own split exchange and
barrier, and each chunk's input must be a separate rank-major buffer: the rows are packed once per
chunk and the worst-case buffers exist once per chunk (4x the symmetric memory at E_l = 64), or the
chunks reuse one buffer with a barrier between calls. The 1-D path moves the same bytes in one call
each way and pays one local gather of the received rows (``R * H`` read and written on the
device), which the 2-D path pays as well: the received rows are copied out of the reused
symmetric buffer before the experts see them (:func:`dispatch`).

Buffers (:class:`Buffers`), allocated once per (group, device, dtype, H, S, R, path) and kept for
the process (:func:`release_buffers` frees them): ``send [S + 2, H]`` and ``recv [R + 2, H]`` with

- ``S = T_max * K``: this rank's pairs;
- ``R = W * C`` (+ ``E_l * align`` on the 2-D path, its padding): every peer sends at most
  ``C = T_max * min(K, E_l)`` rows (``sync_free.block_rows``; less with a ``capacity_factor``);
- the last two rows of each: a zero row (gathers of empty rows read it) and a spare row.

So ``(S + R + 4) * H * itemsize`` bytes of NVSHMEM heap per key, e.g. 3.0 GiB at qwen3-30b-a3b on 2
ranks (T_max = 32768, K = 8, E_l = 64, H = 2048, bf16): set ``NVSHMEM_SYMMETRIC_SIZE`` (default
1 GiB) above the sum over keys before the first call. Every rank must use the same keys, so T_max
must agree (``max_tokens``, or the same T everywhere).

Ordering: the ops pull from the peers' input buffer, so a rank must not rewrite a buffer that peers
may still read. Every op starts with a barrier inside its split exchange; an op reads ``send`` and
writes ``recv`` (dispatch, combine's backward) or the other way round (combine, dispatch's
backward), so as long as the directions alternate, the previous op's barrier orders every rewrite
after the peers' reads. Two ops of the same direction in a row (a backward that skips the
dispatch's gradient, e.g. when the layer's input needs none) get an extra stream-ordered barrier
(a one-element NCCL all-reduce) first.

No host sync on the way: the splits are written into symmetric tensors on the device, the layouts
come from ``searchsorted`` on the returned offsets; the first call per key allocates and
registers the buffers (a host-side collective, once).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..dispatch import make_plan
from . import comm, send_order
from .comm import EPGroup, all_to_all
from .send_order import SendOrder

Tensor = torch.Tensor
MAX_WORLD = 32  # all_to_all_vdev_2d: one warp scans a rank's splits
MAX_2D_WORLD = 16  # all_to_all_vdev_2d_offset: one tile per rank, 16 tiles
MAX_2D_EXPERTS = 16  # all_to_all_vdev_2d: one tile per local expert, 16 tiles (pytorch #167966)
ROW_BYTES = 64  # all_to_all_vdev: each peer's bytes split evenly over <= 64 blocks


def use_2d(world_size: int, num_local_experts: int) -> bool:
    """True where the 2-D ops take the shape (E_l <= 16 and W <= 16), else the 1-D path."""
    return num_local_experts <= MAX_2D_EXPERTS and world_size <= MAX_2D_WORLD


class TorchSymmOps:
    """The ``torch.ops.symm_mem`` NVSHMEM ops and their symmetric allocations (the one place that
    touches them; tests substitute an emulation with the same contract for :data:`OPS`)."""

    def unavailable(self, ep: EPGroup) -> str | None:
        """Why the ops cannot run on ``ep`` (a phrase), or None. Host metadata only."""
        reason = comm.symmetric_memory_unavailable(ep, "2.8")
        if reason:
            return reason
        import torch.distributed._symmetric_memory as symm

        if not hasattr(torch.ops.symm_mem, "all_to_all_vdev_2d"):
            return f"needs torch.ops.symm_mem.all_to_all_vdev_2d (torch >= 2.8), torch {torch.__version__} has none"
        if not symm.is_nvshmem_available():
            return (
                "needs NVSHMEM, not found by this torch build (install the nvidia-nvshmem wheel of torch's "
                "CUDA version, e.g. nvidia-nvshmem-cu13)"
            )
        return None

    def prepare(self, group, device: torch.device) -> str:
        """Select the NVSHMEM backend (before the first symmetric allocation) and register
        ``group``; returns its name.

        Raises:
            ValueError: another symmetric-memory backend already holds allocations.
        """
        import torch.distributed._symmetric_memory as symm

        current = symm.get_backend(device) if hasattr(symm, "get_backend") else None
        if current != "NVSHMEM":
            try:
                symm.set_backend("NVSHMEM")
            except RuntimeError as ex:
                raise ValueError(
                    f"exchange: 'symm_mem' needs the NVSHMEM symmetric-memory backend, but "
                    f"{current!r} already has allocations in this process"
                ) from ex
        name = group.group_name
        comm.enable_symmetric_memory(name)
        return name

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, group_name: str) -> Tensor:
        """A symmetric tensor, registered with the group (collective: same shape on every rank)."""
        import torch.distributed._symmetric_memory as symm

        t = symm.empty(shape, dtype=dtype, device=device)
        symm.rendezvous(t, group_name)
        return t

    def all_to_all_vdev_2d(self, input, out, in_splits, out_splits_offsets, group_name, major_align) -> None:
        torch.ops.symm_mem.all_to_all_vdev_2d(input, out, in_splits, out_splits_offsets, group_name, major_align)

    def all_to_all_vdev_2d_offset(self, input, out, in_splits_offsets, out_splits_offsets, group_name) -> None:
        torch.ops.symm_mem.all_to_all_vdev_2d_offset(input, out, in_splits_offsets, out_splits_offsets, group_name)

    def all_to_all_vdev(self, input, out, in_splits, out_splits_offsets, group_name) -> None:
        torch.ops.symm_mem.all_to_all_vdev(input, out, in_splits, out_splits_offsets, group_name)

    def barrier(self, group, device: torch.device) -> None:
        """A barrier ordered on the current stream, no host wait: a one-element all-reduce."""
        dist.all_reduce(torch.zeros(1, device=device), group=group)


OPS = TorchSymmOps()


def check_available(ep: EPGroup) -> None:
    """Raise ValueError when the symmetric-memory exchange cannot run on ``ep`` (host metadata only).

    Raises:
        ValueError: more than 32 ranks, not an NCCL group, no CUDA, no ``torch.ops.symm_mem`` ops, no
            NVSHMEM (the message says which).
    """
    if ep.world_size > MAX_WORLD:
        raise ValueError(
            f"exchange: 'symm_mem' supports at most {MAX_WORLD} ranks (the NVSHMEM all-to-all "
            f"kernels), got a group of {ep.world_size}; use exchange='all_to_all'"
        )
    reason = OPS.unavailable(ep)
    if reason:
        raise ValueError(f"exchange: 'symm_mem' {reason}; use exchange='all_to_all'")


# ---------------------------------------------------------------- buffers


@dataclass(eq=False)
class Buffers:
    """One key's symmetric tensors (module docstring: sizes and ordering).

    Attributes:
        send: ``[S + 2, H]`` this rank's rows in send order (dispatch in, combine out); row S zero.
        recv: ``[R + 2, H]`` the received rows (dispatch out, combine in); row R zero.
        splits_fwd: ``[W * E_l]`` (2-D) or ``[W]`` (1-D) int64, the splits of a send -> recv op.
        splits_rev: ``[2, E_l * W]`` (2-D: splits and offsets) or ``[W]`` (1-D), of a recv -> send op.
        meta_fwd, meta_rev: ``[2, E_l * W]`` / ``[2, W * E_l]`` (2-D) or ``[2, W]`` (1-D) int64, the
            received splits and offsets each op writes (peers write them: one per direction).
        group, group_name, device: where they live. last: ``"fwd"`` / ``"rev"``, the last op's direction.
    """

    send: Tensor
    recv: Tensor
    splits_fwd: Tensor
    splits_rev: Tensor
    meta_fwd: Tensor
    meta_rev: Tensor
    group: object
    group_name: str
    device: torch.device
    last: str = ""

    def enter(self, direction: str) -> None:
        """Before an op's first write: a barrier when the previous op on these buffers went the
        same way (module docstring, ordering)."""
        if self.last == direction:
            OPS.barrier(self.group, self.device)
        self.last = direction


_BUFFERS: dict[tuple, Buffers] = {}


def buffers(
    ep: EPGroup,
    device: torch.device,
    dtype: torch.dtype,
    hidden: int,
    send_rows: int,
    recv_rows: int,
    num_local_experts: int,
    two_d: bool,
) -> Buffers:
    """The cached :class:`Buffers` of this key, allocated on first use (collective: every rank in
    the same order)."""
    name = ep.group.group_name
    key = (name, device, dtype, hidden, send_rows, recv_rows, num_local_experts, two_d)
    if key not in _BUFFERS:
        OPS.prepare(ep.group, device)
        W, n = ep.world_size, ep.world_size * num_local_experts
        i64 = torch.int64

        def empty(shape, dt=dtype):
            return OPS.empty(shape, dt, device, name)

        b = Buffers(
            send=empty((send_rows + 2, hidden)),
            recv=empty((recv_rows + 2, hidden)),
            splits_fwd=empty((n,) if two_d else (W,), i64),
            splits_rev=empty((2, n) if two_d else (W,), i64),
            meta_fwd=empty((2, n if two_d else W), i64),
            meta_rev=empty((2, n if two_d else W), i64),
            group=ep.group,
            group_name=name,
            device=device,
        )
        b.send[send_rows].zero_()
        b.recv[recv_rows].zero_()
        _BUFFERS[key] = b
    return _BUFFERS[key]


def release_buffers() -> None:
    """Drop every cached symmetric buffer (call on every rank, between steps, when no exchange is
    in flight; the memory returns to the symmetric heap's pool)."""
    _BUFFERS.clear()


# ---------------------------------------------------------------- the exchange


@dataclass(eq=False, kw_only=True)
class Handle(SendOrder):
    """What one dispatch leaves for its combine and both backwards (device tensors), besides the
    send order (:class:`moeyard.parallel.send_order.SendOrder`: ``pair_row`` is each pair's row of
    ``send``).

    Attributes:
        bufs: the :class:`Buffers`. two_d: the path. align: as given.
        recv_meta: 2-D: ``[2, E_l * W]`` the received splits and offsets; 1-D: ``[W]`` rows from each rank.
        gather: ``[R']`` int64, expert-major row -> its ``recv`` row (R, the zero row, when empty).
        inverse: 1-D: ``[R]`` int64, ``recv`` row -> its expert-major row; 2-D: None (the same rows).
        row_experts: ``[R']`` int64 local expert of each expert-major row (``E_l``: none).
    """

    bufs: Buffers
    two_d: bool
    align: int
    recv_meta: Tensor | None = None
    gather: Tensor | None = None
    inverse: Tensor | None = None
    row_experts: Tensor | None = None


def dispatch(x: Tensor, route, ep: EPGroup, align: int) -> tuple[Tensor, Tensor, Handle]:
    """``x [T, H]`` and a ``sync_free.Route`` -> ``(rows [R', H], row experts [R'] int64, handle)``:
    the rows this rank's experts compute, expert-major, each expert's rows padded to a multiple of
    ``align`` (R' static: ``W * C + E_l * align`` on the 2-D path, the dispatch plan's worst case
    ``W * C + E_l * (align - 1)`` rounded up on the 1-D path). Differentiable w.r.t. ``x``.

    Raises:
        ValueError: as :func:`check_available`; on the 1-D path, rows of ``x`` not a multiple of 64
            bytes (``all_to_all_vdev`` splits each peer's bytes evenly over up to 64 thread blocks and
            asserts on the device otherwise). Raised before any collective.
    """
    check_available(ep)
    K, W, El = route.top_k, route.world_size, route.num_local_experts
    two_d = use_2d(W, El)
    if not two_d and (x.shape[1] * x.element_size()) % ROW_BYTES:
        raise ValueError(
            f"hidden_states: the symmetric-memory exchange at E_l={El} > {MAX_2D_EXPERTS} needs rows of "
            f"a multiple of {ROW_BYTES} bytes; got H={x.shape[1]} in {x.dtype}"
        )
    S = route.max_tokens * K
    R = W * route.block_rows + (El * align if two_d else 0)
    bufs = buffers(ep, x.device, x.dtype, x.shape[1], S, R, El, two_d)
    h = Handle(**send_order.order_pairs(route), bufs=bufs, two_d=two_d, align=align)
    rows = send_order.dispatch(x, h, _send, _send_reverse)
    return rows, h.row_experts, h


def combine(y: Tensor, h: Handle, weights: Tensor) -> Tensor:
    """``y [R', H]`` (the experts' rows, as :func:`dispatch` gave them), ``weights [T, K]`` -> ``[T, H]``:
    each pair's row back on its own rank (zeros where not sent), weighted and summed per token
    (:func:`moeyard.parallel.send_order.combine`). Differentiable w.r.t. ``y`` and ``weights``."""
    return send_order.combine(y, weights, h, _send, _send_reverse)


def _send(h: Handle, src: Tensor, index: Tensor, scale: Tensor | None = None) -> Tensor:
    """``send`` -> ``recv`` (:func:`_send_forward`), then the expert-major rows out of ``recv`` (the
    layout made on the handle's first send)."""
    _send_forward(h, src, index, scale)
    if h.gather is None:
        _recv_layout(h)
    return h.bufs.recv.index_select(0, h.gather)


def _send_forward(h: Handle, src: Tensor, index: Tensor, scale: Tensor | None) -> None:
    """``send`` -> ``recv``: this rank's rows in send order (``src[index]``, times ``scale``) into
    ``send``, then the op."""
    b = h.bufs
    b.enter("fwd")
    rows = b.send[: index.shape[0]]
    torch.index_select(src, 0, index, out=rows)
    if scale is not None:
        rows.mul_(scale.unsqueeze(1))
    if h.two_d:
        b.splits_fwd.copy_(h.send_counts)
        OPS.all_to_all_vdev_2d(b.send, b.recv, b.splits_fwd, b.meta_fwd, b.group_name, h.align)
    else:
        W = h.route.world_size
        b.splits_fwd.copy_(h.send_counts.view(W, -1).sum(1))
        OPS.all_to_all_vdev(b.send, b.recv, b.splits_fwd, b.meta_fwd, b.group_name)


def _send_reverse(h: Handle, rows: Tensor) -> tuple[Tensor, Tensor]:
    """``recv`` -> ``send``: ``rows [R', H]`` (expert-major, as dispatched) back to the ranks they
    came from; returns ``(send, pair_row)``: each pair's row is ``send[pair_row]`` (zeros where not
    sent)."""
    b = h.bufs
    b.enter("rev")
    R = b.recv.shape[0] - 2
    if h.inverse is None:
        b.recv[:R].copy_(rows)
    else:
        torch.index_select(rows, 0, h.inverse, out=b.recv[:R])
    b.splits_rev.copy_(h.recv_meta)
    if h.two_d:
        OPS.all_to_all_vdev_2d_offset(b.recv, b.send, b.splits_rev, b.meta_rev, b.group_name)
    else:
        OPS.all_to_all_vdev(b.recv, b.send, b.splits_rev, b.meta_rev, b.group_name)
    return b.send, h.pair_row


def _recv_layout(h: Handle) -> None:
    """After the dispatch op: where each received row goes (``gather``, ``inverse``,
    ``row_experts``, ``recv_meta``), from the offsets the op wrote."""
    b, route, align = h.bufs, h.route, h.align
    W, El = route.world_size, route.num_local_experts
    R = b.recv.shape[0] - 2
    r = torch.arange(R, device=b.device)
    if h.two_d:
        h.recv_meta = b.meta_fwd.clone()  # [2, E_l * W], index e * W + s
        counts = h.recv_meta[0].view(El, W).sum(1)  # [E_l] rows per expert
        start = h.recv_meta[1].view(El, W)[:, 0].contiguous()  # [E_l] block starts
        last = ((counts[-1] + align - 1) // align * align).clamp(min=align)  # the op pads empty blocks too
        inside = r < start[-1] + last
        e = (torch.searchsorted(start, r, right=True) - 1).clamp(min=0)
        data = inside & (r - start.index_select(0, e) < counts.index_select(0, e))
        h.gather = torch.where(data, r, R)
        h.row_experts = torch.where(inside, e, El)
        return
    h.recv_meta = b.meta_fwd[0].clone()  # [W] rows from each rank
    received = all_to_all(h.send_counts, None, None, b.group)  # [W * E_l], (source, expert)
    chunk = torch.searchsorted(received.cumsum(0), r, right=True)  # rank-major chunk of each row
    local = torch.where(chunk < W * El, chunk % El, El)
    plan = make_plan(local.view(R, 1), El, align=align)
    h.gather, h.inverse, h.row_experts = plan.row_tokens(), plan.pair_rows, plan.row_experts()
