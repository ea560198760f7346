"""Triton kernel of :func:`moeyard.parallel.p2p_layout.layout_reference` (CUDA; CPU under ``TRITON_INTERPRET=1``).

The ``p2p`` dispatch lays out the rows a rank receives from every peer's counts ``[W, W, E_l]``: some
30 small torch launches, whose host time showed in the dispatch's timing (``benchmarks/NOTES.md``,
round 19). One launch does it: grid ``(ceil(max(C, R) / BJ), W + 1)`` (``BJ`` up to 256, fewer for
many local experts); program ``(p, s)`` with
``s < W`` writes ``BJ`` entries of ``dst_rows[s]`` (and, for ``p == 0``, ``window[s]`` and
``received[s]``), program ``(p, W)`` ``BJ`` entries of ``row_experts`` (and, for ``p == 0``, the pad
rows). Every program recomputes the per-expert sums it needs from the counts (``W * E_l`` values: a
few KiB at most). Each row's expert is a count of block ends at or below it over a ``[BJ, E_l]`` tile,
its destination one lookup of a per-expert base (``starts + before - inside + cin``) plus the row: the
tiles in int32 (sums and rows below 2**31, checked by :func:`layout_triton`), the outputs int64. Three
lookups per row in int64 took 0.64 ms per dispatch at qwen3-30b-a3b on 2 H200s (``benchmarks/NOTES.md``,
round 33).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launch import cached, cdiv, next_power_of_2
from .p2p_layout import layout_reference

MAX_TILE = 2048  # BJ * E_P2: the [BJ, E_l] comparisons stay in registers (sm_90a, int64: no spills up to E_l 512)

Tensor = torch.Tensor


@triton.jit
def _pick(values, e_idx, e):
    """``values[e]`` for a vector of indices ``e [BJ]`` (``values``, ``e_idx`` ``[E_P2]``)."""
    return tl.sum(tl.where(e_idx[None, :] == e[:, None], values[None, :], 0), axis=1)


@cached
@triton.jit
def layout_kernel(
    counts_ptr,
    dst_ptr,
    window_ptr,
    received_ptr,
    pad_ptr,
    row_experts_ptr,
    W,
    El,
    me,
    align,
    C,
    R,
    W_P2: tl.constexpr,
    E_P2: tl.constexpr,
    A_P2: tl.constexpr,
    HAS_PAD: tl.constexpr,
    BJ: tl.constexpr,
):
    """See the module docstring (``counts [W, W, E_l]`` int64 contiguous: rows from s to rank d's
    expert e at ``(s * W + d) * E_l + e``)."""
    p = tl.program_id(0)
    s = tl.program_id(1)
    ws = tl.arange(0, W_P2)
    e_idx = tl.arange(0, E_P2)
    m_we = (ws < W)[:, None] & (e_idx < El)[None, :]
    cin = tl.load(counts_ptr + (ws[:, None] * W + me) * El + e_idx[None, :], mask=m_we, other=0).to(tl.int32)
    per_expert = tl.sum(cin, axis=0)  # [E_P2] rows to my expert e
    padded = (per_expert + align - 1) // align * align
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    j = p * BJ + tl.arange(0, BJ)  # int32
    if s < W:
        mine = ws[:, None] == s
        cin_s = tl.sum(tl.where(mine, cin, 0), axis=0)  # [E_P2] rows from s to e
        before = tl.sum(tl.where(ws[:, None] < s, cin, 0), axis=0)  # rows to e from ranks < s
        inside = tl.cumsum(cin_s, 0)  # ends of e in s's window
        m_j = j < C
        last = tl.where(e_idx < El, inside, C + BJ)
        e = tl.minimum(tl.sum((last[None, :] <= j[:, None]).to(tl.int32), axis=1), El - 1)
        base = starts + before - (inside - cin_s)  # dst of e's first row from s, less its j
        dst = _pick(base, e_idx, e) + j
        tl.store(dst_ptr + s.to(tl.int64) * C + j, dst.to(tl.int64), mask=m_j)
        if p == 0:
            row = tl.load(
                counts_ptr + (s * W + ws[:, None]) * El + e_idx[None, :], mask=m_we & (ws < me)[:, None], other=0
            )  # rows from s to ranks < me
            tl.store(window_ptr + s, tl.sum(tl.sum(row, axis=1), axis=0))
            tl.store(received_ptr + s, tl.sum(cin_s, axis=0).to(tl.int64))
    else:
        m_r = j < R
        last = tl.where(e_idx < El, ends, R + BJ)
        e = tl.sum((last[None, :] <= j[:, None]).to(tl.int32), axis=1)
        tl.store(row_experts_ptr + j, e.to(tl.int64), mask=m_r)
        if HAS_PAD:
            if p == 0:
                q = tl.arange(0, A_P2)
                pad = (starts + per_expert)[:, None] + q[None, :]  # [E_P2, A_P2]
                pad = tl.where(pad < ends[:, None], pad, R)
                m_pad = (e_idx < El)[:, None] & (q < align - 1)[None, :]
                tl.store(pad_ptr + e_idx[:, None] * (align - 1) + q[None, :], pad.to(tl.int64), mask=m_pad)


def layout_triton(all_counts: Tensor, me: int, align: int, C: int, R: int) -> tuple:
    """As :func:`moeyard.parallel.p2p_layout.layout_reference`, in one launch (``all_counts`` int64)."""
    W, _, El = all_counts.shape
    if max(C, R) + MAX_TILE >= 2**31:  # the kernel's rows and sums are int32
        return layout_reference(all_counts, me, align, C, R)
    dev, i64 = all_counts.device, torch.int64
    dst_rows = torch.empty(W, C, device=dev, dtype=i64)
    window = torch.empty(W, device=dev, dtype=i64)
    received = torch.empty(W, device=dev, dtype=i64)
    row_experts = torch.empty(R, device=dev, dtype=i64)
    pad_rows = torch.empty(El * (align - 1), device=dev, dtype=i64) if align > 1 else None
    e_p2 = next_power_of_2(El)
    bj = max(16, min(256, MAX_TILE // e_p2))
    grid = (cdiv(max(C, R, 1), bj), W + 1)
    pad = row_experts if pad_rows is None else pad_rows
    layout_kernel[grid](
        all_counts.contiguous(),
        dst_rows,
        window,
        received,
        pad,
        row_experts,
        W,
        El,
        me,
        align,
        C,
        R,
        W_P2=next_power_of_2(W),
        E_P2=e_p2,
        A_P2=next_power_of_2(max(align - 1, 1)),
        HAS_PAD=align > 1,
        BJ=bj,
        num_warps=4,
    )
    return dst_rows, window, received, pad_rows, row_experts
