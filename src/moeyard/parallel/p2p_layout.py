"""The layout of the rows the ``p2p`` exchange (:mod:`.p2p`) receives, in torch ops: where each row a
peer sends lands among this rank's expert-major rows. Its one-launch kernel (CUDA) is
:mod:`.p2p_layout_triton`, checked against :func:`layout_reference`.

Legend: W ranks, E_l local experts, C rows a peer may send this rank (the static block), R received
rows with padding.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def num_rows(world_size: int, block: int, num_local_experts: int, align: int) -> int:
    """R: ``W * C`` received rows at most, plus ``align - 1`` pad rows per expert, rounded up to ``align``."""
    return -(-(world_size * block + num_local_experts * (align - 1)) // align) * align


def layout_reference(all_counts: Tensor, me: int, align: int, C: int, R: int) -> tuple:
    """``(dst_rows [W, C], window [W], received [W], pad_rows [E_l * (align - 1)] | None, row_experts
    [R])`` (int64, as :class:`moeyard.parallel.p2p.Handle`) of rank ``me`` from ``all_counts [W, W, E_l]``
    (rows from s to rank d's expert e), in torch ops. Each local expert's rows come from rank 0, 1, ...
    back to back, its block padded to a multiple of ``align``; ``dst_rows[s, j]`` for ``j`` past
    ``received[s]`` is unused."""
    W, _, El = all_counts.shape
    dev = all_counts.device
    cin = all_counts[:, me, :]  # [W, E_l] rows from s to my expert e
    per_expert = cin.sum(0)
    padded = (per_expert + align - 1) // align * align
    ends = padded.cumsum(0)
    starts = ends - padded  # [E_l] block starts
    inside = cin.cumsum(1)  # [W, E_l] ends of e in s's window
    j = torch.arange(C, device=dev).expand(W, C).contiguous()
    e = torch.searchsorted(inside, j, right=True).clamp(max=El - 1)  # [W, C] expert of window row j
    before = cin.cumsum(0) - cin  # [W, E_l] rows from ranks < s
    dst_rows = (
        starts.index_select(0, e.view(-1)).view(W, C) + before.gather(1, e) + j - (inside - cin).gather(1, e)
    ).contiguous()
    window = all_counts[:, :me, :].sum((1, 2))
    received = cin.sum(1)
    row_experts = torch.searchsorted(ends, torch.arange(R, device=dev), right=True)
    pad_rows = None
    if align > 1:
        q = torch.arange(align - 1, device=dev)
        pad = (starts + per_expert).unsqueeze(1) + q  # [E_l, align - 1]
        pad_rows = torch.where(pad < ends.unsqueeze(1), pad, R).view(-1)
    return dst_rows, window, received, pad_rows, row_experts
