"""The column casts of the FP8 weight gradients' operands, per expert (power-of-two scales; their reference
:func:`moeyard.quant.fp8.quantize` with offsets): ``t [R, N]`` with expert offsets -> e4m3 ``t^T`` with one scale
per column and expert, the K-major layout e4m3 MMAs read for a GEMM that reduces over each expert's rows
(``dW_e = dy_e^T x_e``). The operand is read as :mod:`.fp8_triton`'s casts read it: ``act(h)`` from the up
projection's output, rows gathered by an index, row weights.

- Unpadded (``torch._scaled_grouped_mm``'s layout): one program per (expert, ``BLOCK_N`` columns), looping over
  the expert's rows twice (their ``amax``, then the cast).
- Padded (:func:`padded_offsets`: each expert from a multiple of 128 columns, zeros after its rows; the layout of
  :mod:`.fp8_gluon_wgrad`): each expert's columns' amax by tiles (an atomic max on the float bits) unless given,
  then the cast by tiles of the padded output, one tile a program. On an H200 (``benchmarks/NOTES.md``, round 55)
  the cast alone runs at 4.0 TB/s (3 bytes an element), the unpadded kernel at 1.5.

Under Triton's CPU interpreter the kernels store float32 and the wrapper casts with torch (:mod:`.fp8_triton`).
No host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..activations import Activation
from ..kernel_op import interpreting
from ..launch import cached, cdiv, next_power_of_2
from .fp8_triton import _act_args, _cast, _load, _out, _out_columns, _pow2_scale, _source

Tensor = torch.Tensor


@cached
@triton.jit
def _colwise_kernel(
    x_ptr,
    idx_ptr,
    rw_ptr,
    n_src,  # the operand (see _load): rows r of the groups, unit column stride
    offsets_ptr,  # [G + 1] int32: rows of group g are offsets[g] .. offsets[g + 1]
    q_ptr,  # transposed e4m3 output (float32 under the interpreter); element (n, c) at n * stride_qn + c
    s_ptr,  # [G, N] float32
    N,
    stride_xr,
    stride_qn,
    alpha,
    limit,
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    HAS_RW: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    g = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_cols = cols < N
    start = tl.load(offsets_ptr + g)
    end = tl.load(offsets_ptr + g + 1)
    amax = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        b_x = _load(
            x_ptr, idx_ptr, rw_ptr, n_src, rows, rows < end, cols, m_cols, stride_xr, N, alpha, limit,
            ACT, GATED, INTERLEAVED, HAS_INDEX, HAS_RW,
        )  # fmt: skip
        amax = tl.maximum(amax, tl.max(tl.abs(b_x), axis=0))
    scale = _pow2_scale(amax)
    tl.store(s_ptr + g * N + cols, scale, mask=m_cols)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        b_x = _load(
            x_ptr, idx_ptr, rw_ptr, n_src, rows, rows < end, cols, m_cols, stride_xr, N, alpha, limit,
            ACT, GATED, INTERLEAVED, HAS_INDEX, HAS_RW,
        )  # fmt: skip
        b_q = tl.clamp(b_x / scale[None, :], -448.0, 448.0).to(q_ptr.dtype.element_ty)
        tl.store(
            q_ptr + cols[None, :].to(tl.int64) * stride_qn + rows[:, None],
            b_q,
            mask=(rows < end)[:, None] & m_cols[None, :],
        )


@cached
@triton.jit
def _colwise_tiles_kernel(
    x_ptr,
    idx_ptr,
    rw_ptr,
    n_src,  # the operand (see _load): rows r of the groups, unit column stride
    offsets_ptr,  # [G + 1] int32: rows of group g are offsets[g] .. offsets[g + 1]
    padded_ptr,  # [G + 1] int32, group g's first output column, multiples of BLOCK_R
    amax_ptr,  # the columns' amax, float32: group g's at amax_ptr + g * stride_ag (0: one for all groups)
    q_ptr,  # transposed e4m3 output (float32 under the interpreter); element (n, c) at n * stride_qn + c
    s_ptr,  # [G, N] float32
    G,
    N,
    stride_xr,
    stride_qn,
    stride_ag,
    alpha,
    limit,
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    HAS_RW: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    """One tile of the padded output: ``BLOCK_R`` output columns (all of one group: its first column and the
    padded starts are multiples of ``BLOCK_R``) by ``BLOCK_N`` channels, read once. The first column of tiles
    also writes every group's scales."""
    c0 = tl.program_id(0) * BLOCK_R
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_cols = cols < N
    if tl.program_id(0) == 0:
        for gg in range(G):
            a = tl.load(amax_ptr + gg * stride_ag + cols, mask=m_cols, other=0.0)
            tl.store(s_ptr + gg * N + cols, _pow2_scale(a), mask=m_cols)
    gs = tl.arange(0, BLOCK_G)
    ends = tl.load(padded_ptr + 1 + gs, mask=gs < G, other=2147483647)
    g = tl.sum((ends <= c0).to(tl.int32), axis=0)  # the group whose padded columns hold c0; G: past them all
    if g < G:
        p0 = tl.load(padded_ptr + g)
        start = tl.load(offsets_ptr + g)
        end = tl.load(offsets_ptr + g + 1)
        rows = start + (c0 - p0) + tl.arange(0, BLOCK_R)
        inv = 1.0 / _pow2_scale(tl.load(amax_ptr + g * stride_ag + cols, mask=m_cols, other=0.0))  # exact: 2^k
        b_x = _load(
            x_ptr, idx_ptr, rw_ptr, n_src, rows, rows < end, cols, m_cols, stride_xr, N, alpha, limit,
            ACT, GATED, INTERLEAVED, HAS_INDEX, HAS_RW,
        )  # fmt: skip
        b_q = tl.clamp(b_x * inv[None, :], -448.0, 448.0).to(q_ptr.dtype.element_ty)
        out = c0 + tl.arange(0, BLOCK_R)
        tl.store(q_ptr + cols[None, :].to(tl.int64) * stride_qn + out[:, None], b_q, mask=m_cols[None, :])


@cached
@triton.jit
def _colwise_amax_kernel(
    x_ptr,
    idx_ptr,
    rw_ptr,
    n_src,  # the operand (see _load): rows r of the groups, unit column stride
    offsets_ptr,  # [G + 1] int32: rows of group g are offsets[g] .. offsets[g + 1]
    amax_ptr,  # [G, N] int32, zeros: each group's column amax, as the bits of a non-negative float32
    N,
    split,  # programs per group and column block
    stride_xr,
    alpha,
    limit,
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    HAS_RW: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The columns' amax of every ``split``-th block of ``BLOCK_R`` rows of a group, merged into the group's by
    an atomic max on the float bits (ordered as integers for non-negative floats): exact, order-free, and one
    atomic per column and program. The blocks are folded element by element and reduced over rows once, at
    the end (a reduction across warps per block held the kernel to 2.6 TB/s)."""
    g = tl.program_id(0) // split
    first = tl.program_id(0) % split
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_cols = cols < N
    start = tl.load(offsets_ptr + g)
    end = tl.load(offsets_ptr + g + 1)
    acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
    for r0 in range(start + first * BLOCK_R, end, split * BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        b_x = _load(
            x_ptr, idx_ptr, rw_ptr, n_src, rows, rows < end, cols, m_cols, stride_xr, N, alpha, limit,
            ACT, GATED, INTERLEAVED, HAS_INDEX, HAS_RW,
        )  # fmt: skip
        acc = tl.maximum(acc, tl.abs(b_x))
    amax = tl.max(acc, axis=0)
    tl.atomic_max(amax_ptr + g * N + cols, amax.to(tl.int32, bitcast=True), mask=m_cols)


COLWISE_TILES = (64, 128, 4)  # the tile kernels: output columns (rows of t), channels, warps
AMAX_BLOCKS = 8  # _colwise_amax_kernel: blocks of rows per program, for evenly spread rows (4: 2% slower, H200)


COLWISE_BLOCKS = (128, 64, 4)  # colwise_per_group: (rows, columns) of a program's tile, warps (NOTES round 50)


def colwise_per_group(
    t: Tensor,
    offsets: Tensor,
    act: Activation | None = None,
    *,
    interleaved: bool = False,
    index: Tensor | None = None,
    row_weights: Tensor | None = None,
    padded: tuple[Tensor, int] | None = None,
    amax: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``t [R, N]`` (unit column stride), ``offsets [G + 1]`` int32 -> ``(q [N, R] e4m3, s [G, N] float32)``:
    ``q[n, r] = t[r, n] / s[g, n]`` for the rows of each group ``g``, ``s[g, n]`` the power-of-two scale of
    column ``n`` over the group's rows (:func:`moeyard.quant.fp8.quantize` of ``t^T`` with offsets). Columns
    ``r`` of ``q`` past ``offsets[G]`` are left unwritten. ``act``, ``index [R]`` and ``row_weights [R]`` as
    :func:`rowwise`'s (then ``R`` is the index's length).

    With ``padded = (starts, width)`` (:func:`padded_offsets`), ``q`` is ``[N, width]`` and group ``g``'s rows
    go to columns ``starts[g] ...``, followed by zeros up to ``starts[g + 1]`` (columns past ``starts[G]``
    unwritten): every block of a group's columns that the starts are multiples of holds that group's rows only,
    as a K-major grouped GEMM reading whole TMA boxes needs (:mod:`.fp8_gluon_wgrad`).

    ``amax`` (with ``padded``, whose starts are then multiples of 64): the columns' absolute maxima (read in
    float32), ``[G, N]`` per group or ``[N]`` for every group (e.g. over all rows, made by the kernel that
    wrote ``t``): the scales come from it and ``t`` is read once, by tiles of the padded output, instead of
    twice, a group at a time; a value below a column's true maximum saturates there at 448.

    Raises:
        ValueError: ``amax`` without ``padded``, or of another shape."""
    if padded is not None:
        return _colwise_tiles(t, offsets, act, interleaved, index, row_weights, padded, amax)
    if amax is not None:
        raise ValueError("colwise_per_group: amax needs padded")
    R = t.shape[0] if index is None else index.shape[0]
    N = _out_columns(t, act)
    if t.stride(1) != 1:
        t = t.contiguous()
    G = offsets.numel() - 1
    q, s = _out((N, R), t.device), torch.empty(G, N, device=t.device, dtype=torch.float32)
    if G and N:
        br, bn, warps = COLWISE_BLOCKS
        _colwise_kernel[(G, cdiv(N, bn))](
            **_source(t, index, row_weights),
            offsets_ptr=offsets,
            q_ptr=q,
            s_ptr=s,
            N=N,
            stride_xr=t.stride(0),
            stride_qn=R,
            **_act_args(act, interleaved),
            BLOCK_R=br,
            BLOCK_N=bn,
            num_warps=warps,
        )
    return _cast(q), s


def _colwise_tiles(t, offsets, act, interleaved, index, row_weights, padded, amax) -> tuple[Tensor, Tensor]:
    """:func:`colwise_per_group` with ``padded``: each group's column amax by tiles (:func:`_colwise_amax_kernel`)
    unless given, then the cast by tiles (:func:`_colwise_tiles_kernel`)."""
    N = _out_columns(t, act)
    G = offsets.numel() - 1
    if amax is not None and tuple(amax.shape) not in ((N,), (G, N)):
        raise ValueError(f"colwise_per_group: amax: expected shape ({N},) or ({G}, {N}), got {tuple(amax.shape)}")
    if t.stride(1) != 1:
        t = t.contiguous()
    width = padded[1]
    q, s = _out((N, width), t.device), torch.empty(G, N, device=t.device, dtype=torch.float32)
    br, bn, warps = (16, 16, 1) if interpreting() else COLWISE_TILES
    common = dict(
        **_source(t, index, row_weights),
        offsets_ptr=offsets,
        N=N,
        stride_xr=t.stride(0),
        **_act_args(act, interleaved),
        BLOCK_R=br,
        BLOCK_N=bn,
        num_warps=warps,
    )
    if amax is None:
        bits = torch.zeros(G, N, device=t.device, dtype=torch.int32)
        # about AMAX_BLOCKS blocks of rows per program for rows spread evenly over the groups
        split = max(1, cdiv(width, max(G, 1) * br * AMAX_BLOCKS))
        if G and N and width:
            _colwise_amax_kernel[(G * split, cdiv(N, bn))](amax_ptr=bits, split=split, **common)
        amax = bits.view(torch.float32)
    if G and N and width:
        _colwise_tiles_kernel[(cdiv(width, br), cdiv(N, bn))](
            padded_ptr=padded[0],
            amax_ptr=amax.to(torch.float32).contiguous(),
            q_ptr=q,
            s_ptr=s,
            G=G,
            stride_qn=width,
            stride_ag=N if amax.dim() == 2 else 0,
            BLOCK_G=next_power_of_2(max(G, 1)),
            **common,
        )
    return _cast(q), s


def padded_offsets(offsets: Tensor, rows: int, block: int) -> tuple[Tensor, int]:
    """``(starts [G + 1] int32, width)`` for :func:`colwise_per_group`'s ``padded``: each group's ``offsets[g
    + 1] - offsets[g]`` rows rounded up to a multiple of ``block``, their running sum from 0
    (:func:`moeyard.dispatch.pad_offsets`), and ``width`` a static bound on ``starts[G]`` for ``rows`` rows in
    all (:func:`moeyard.dispatch.padded_rows`). No host sync."""
    from ..dispatch import pad_offsets, padded_rows

    return pad_offsets(offsets.diff(), block), padded_rows(rows, offsets.numel() - 1, block)
