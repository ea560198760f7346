"""Triton kernels for the FP8 casts of the rowwise recipe's fast path (power-of-two scales), beside
their reference, :func:`moeyard.quant.fp8.quantize` (same values: the tests compare them).

- :func:`rowwise`: ``t [M, K]`` -> e4m3 ``[M, K]`` with one scale per row (forward and dgrad operands:
  token rows, ``W_e`` rows). One program per ``BLOCK_M`` rows; a row block that fits
  ``ONE_PASS_ELEMENTS`` is read once (held whole in registers), a wider one twice (the rows' ``amax``,
  then scale and cast). With :func:`act_backward` casting ``d h`` in the same pass, the row casts and
  the activation's backward of a qwen3-30b-a3b ``fp8_rowwise_gw_hp`` step went from 3.73 to 2.32 ms on an
  H100 (``benchmarks/NOTES.md``, round 39).
- The weight gradients' column casts, per expert: :mod:`.fp8_colwise`, on this module's loads.
- :func:`rowwise_per_expert`: ``w [E, N, K]`` -> e4m3 with one scale per row (``W_e`` for the forward), and
  from the same read each column's ``amax`` over the expert's rows (atomic max).
- :func:`colwise_per_expert`: ``w [E, N, K]`` -> e4m3 ``w^T [E, K, N]`` with one scale per (expert,
  column) (``W_e^T`` for dgrad): 64 x 64 tiles stored transposed, reading ``w`` once given the forward's
  ``amax``.
- Both weight casts also read NF4 storage (:class:`NF4Source`, :func:`nf4_source`): the codes and block scales
  decoded in their loads to the values the dequantisation writes, only for the active experts, so no dense
  weight is written (:func:`moeyard.experts.scaled_hopper.nf4_mode`). A byte tile of codes per load, one
  block scale per segment of a block where rows start on one (as the dequantisation reads them).
- With ``act`` (an :class:`moeyard.activations.Activation` by name), :func:`rowwise` (and
  :func:`.fp8_colwise.colwise_per_group`) cast ``act(h)`` computed in float32 from the up projection's output ``h``
  (``[R, 2I]`` gated, gate then up columns or interleaved; ``[R, I]`` plain) as they load it, so the
  activation's output is never written in the compute dtype; :func:`act_backward` gives ``d h`` from ``h``
  and ``d act(h)`` (and, from the same pass, ``d h``'s rowwise cast and ``rw * act(h)``). The
  activations are those of the ``triton`` backend's epilogues (:mod:`moeyard.experts.triton.act`).

Under Triton's CPU interpreter, whose float8 conversion does not round to nearest (seen with triton 3.9:
127.6 became 64), the kernels store the scaled float32 values and the wrapper casts them with torch;
on CUDA the kernels cast (``cvt.rn.satfinite``, the same rounding as torch's). No host sync.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..activations import Activation
from ..experts.triton.act import act_fwd, act_grad
from ..kernel_op import interpreting
from ..launch import cached, cdiv, next_power_of_2
from ._bnb import NESTED_BLOCKSIZE
from .fp8 import E4M3, E4M3_MAX
from .triton_nf4 import _round_bf16, block_scales

Tensor = torch.Tensor
_NESTED_BS = tl.constexpr(NESTED_BLOCKSIZE)  # a kernel reads a global only as a constexpr


@triton.jit
def _pow2_scale(amax):
    """``2^-floor(log2(448 / max(amax, EPS)))`` from the float32 exponent bits (exact)."""
    inv = 448.0 / tl.maximum(amax, 1e-12)
    e = ((inv.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2(inv)): inv is a normal float
    return ((127 - e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _load(
    x_ptr,
    idx_ptr,
    rw_ptr,
    n_src,
    rows,
    m_rows,
    cols,
    m_cols,
    stride_r,
    K,
    alpha,
    limit,
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    HAS_RW: tl.constexpr,
    stride_rw=1,
    RW_SIGMOID: tl.constexpr = False,
):
    """The float32 block ``[rows, cols]`` of the operand a cast reads (``_source`` in the wrappers):
    ``x[rows]``, or ``x[idx[rows]]`` with ``HAS_INDEX`` (an index ``>= n_src`` reads zeros: pad rows); with
    ``ACT`` the activation's output there (``x`` is then the up projection's output: gate at ``cols``
    and up at ``cols + K``, or at ``2 cols`` and ``2 cols + 1``); with ``HAS_RW`` times ``rw[rows]`` (``rw``
    ``stride_rw`` elements apart; with ``RW_SIGMOID`` times ``sigmoid(rw[rows])``, in float32)."""
    m = m_rows
    src = rows
    if HAS_INDEX:
        src = tl.load(idx_ptr + rows, mask=m_rows, other=n_src)
        m = m_rows & (src < n_src)
    mask = m[:, None] & m_cols[None, :]
    base = x_ptr + src[:, None].to(tl.int64) * stride_r
    if ACT == "none":
        v = tl.load(base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    else:
        if GATED:
            if INTERLEAVED:
                g = tl.load(base + 2 * cols[None, :], mask=mask, other=0.0).to(tl.float32)
                u = tl.load(base + 2 * cols[None, :] + 1, mask=mask, other=0.0).to(tl.float32)
            else:
                g = tl.load(base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                u = tl.load(base + cols[None, :] + K, mask=mask, other=0.0).to(tl.float32)
        else:
            g = tl.load(base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            u = g
        v = tl.where(mask, act_fwd(g, u, alpha, limit, ACT), 0.0)
    if HAS_RW:
        v = v * _row_weights(rw_ptr, rows, m_rows, stride_rw, RW_SIGMOID)[:, None]
    return v


@triton.jit
def _row_weights(rw_ptr, rows, m_rows, stride_rw, RW_SIGMOID: tl.constexpr):
    """The rows' float32 weights ``rw[rows]`` (``stride_rw`` apart), or with ``RW_SIGMOID`` their sigmoid."""
    rw = tl.load(rw_ptr + rows.to(tl.int64) * stride_rw, mask=m_rows, other=0.0).to(tl.float32)
    if RW_SIGMOID:
        rw = tl.sigmoid(rw)
    return rw


@cached
@triton.jit
def _rowwise_kernel(
    x_ptr,
    idx_ptr,
    rw_ptr,
    n_src,  # the operand (see _load): x [n_src or M, *] float, unit column stride
    q_ptr,  # [M, K] e4m3 (float32 under the interpreter), unit column stride, row stride stride_qm
    s_ptr,  # [M] float32, stride stride_s
    M,
    K,
    stride_xm,
    stride_qm,
    stride_s,
    alpha,
    limit,
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    HAS_RW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    QUANT: tl.constexpr = True,  # False: store the operand itself in q's dtype (no scale, no s)
    ONE_PASS: tl.constexpr = False,  # BLOCK_K >= K: each row read once
    r_ptr=None,  # WITH_ROWS: [M, K] the operand times rrw[rows], in r's dtype, row stride stride_rm
    rrw_ptr=None,  # WITH_ROWS: [M] float32
    stride_rm=0,
    WITH_ROWS: tl.constexpr = False,
    stride_rw=1,  # the row weights' stride (HAS_RW)
    RW_SIGMOID: tl.constexpr = False,  # the row weights are sigmoid(rw) (HAS_RW)
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_rows = rows < M
    if WITH_ROWS:
        r_w = tl.load(rrw_ptr + rows, mask=m_rows, other=0.0)
    if ONE_PASS:  # the whole row in one block: read once
        cols = tl.arange(0, BLOCK_K)
        b_x = _load(
            x_ptr, idx_ptr, rw_ptr, n_src, rows, m_rows, cols, cols < K, stride_xm, K, alpha, limit,
            ACT, GATED, INTERLEAVED, HAS_INDEX, HAS_RW, stride_rw, RW_SIGMOID,
        )  # fmt: skip
        scale = _row_scale(s_ptr, tl.max(tl.abs(b_x), axis=1), rows, m_rows, stride_s, QUANT)
        _store_rows(q_ptr, b_x, scale, rows, m_rows, cols, K, stride_qm, QUANT)
        if WITH_ROWS:
            _store_rows(r_ptr, b_x * r_w[:, None], scale, rows, m_rows, cols, K, stride_rm, False)
    else:
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K if QUANT else 0, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            b_x = _load(
                x_ptr, idx_ptr, rw_ptr, n_src, rows, m_rows, cols, cols < K, stride_xm, K, alpha, limit,
                ACT, GATED, INTERLEAVED, HAS_INDEX, HAS_RW, stride_rw, RW_SIGMOID,
            )  # fmt: skip
            amax = tl.maximum(amax, tl.max(tl.abs(b_x), axis=1))
        scale = _row_scale(s_ptr, amax, rows, m_rows, stride_s, QUANT)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            b_x = _load(
                x_ptr, idx_ptr, rw_ptr, n_src, rows, m_rows, cols, cols < K, stride_xm, K, alpha, limit,
                ACT, GATED, INTERLEAVED, HAS_INDEX, HAS_RW, stride_rw, RW_SIGMOID,
            )  # fmt: skip
            _store_rows(q_ptr, b_x, scale, rows, m_rows, cols, K, stride_qm, QUANT)
            if WITH_ROWS:
                _store_rows(r_ptr, b_x * r_w[:, None], scale, rows, m_rows, cols, K, stride_rm, False)


@triton.jit
def _row_scale(s_ptr, amax, rows, m_rows, stride_s, QUANT: tl.constexpr):
    """The rows' power-of-two scales from their ``amax``, stored (``QUANT``; else ones, not stored)."""
    if QUANT:
        scale = _pow2_scale(amax)
        tl.store(s_ptr + rows.to(tl.int64) * stride_s, scale, mask=m_rows)
    else:
        scale = tl.full(amax.shape, 1.0, tl.float32)
    return scale


@triton.jit
def _store_rows(q_ptr, b_x, scale, rows, m_rows, cols, K, stride_qm, QUANT: tl.constexpr):
    """Store the block ``b_x [rows, cols]`` divided by the rows' ``scale`` and cast to ``q``'s dtype, or as
    is (``QUANT`` false)."""
    if QUANT:
        b_x = tl.clamp(b_x / scale[:, None], -448.0, 448.0)
    tl.store(
        q_ptr + rows[:, None].to(tl.int64) * stride_qm + cols[None, :],
        b_x.to(q_ptr.dtype.element_ty),
        mask=m_rows[:, None] & (cols < K)[None, :],
    )


def _out(shape, device) -> Tensor:
    """The kernels' output: e4m3 on CUDA, float32 (cast afterwards) under the interpreter."""
    return torch.empty(shape, device=device, dtype=torch.float32 if interpreting() else E4M3)


def _cast(q: Tensor) -> Tensor:
    return q.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3) if q.dtype != E4M3 else q


def _act_args(act: Activation | None, interleaved: bool) -> dict:
    """The kernels' activation arguments for ``act`` (None: the identity)."""
    if act is None:
        return dict(alpha=0.0, limit=0.0, ACT="none", GATED=False, INTERLEAVED=False)
    if act.fn is not None:
        raise ValueError("act: a custom activation callable cannot run inside a cast kernel")
    return dict(
        alpha=float(act.alpha),
        limit=float(act.limit),
        ACT=act.name,
        GATED=act.gated,
        INTERLEAVED=bool(interleaved and act.gated),
    )


def _out_columns(t: Tensor, act: Activation | None) -> int:
    return t.shape[1] // 2 if act is not None and act.gated else t.shape[1]


def _source(t: Tensor, index: Tensor | None, row_weights: Tensor | None) -> dict:
    """The operand arguments of the kernels (``_load``): ``t`` (unit column stride), an optional row
    ``index`` (int64 or int32, ``>= t.shape[0]``: a zero row) and optional ``row_weights`` (float32, or the
    gate logits :func:`act_rows` takes, in any float dtype: the kernels read them in float32)."""
    return dict(
        x_ptr=t,
        idx_ptr=t if index is None else index,
        rw_ptr=t if row_weights is None else row_weights,
        n_src=t.shape[0],
        HAS_INDEX=index is not None,
        HAS_RW=row_weights is not None,
    )


ONE_PASS_ELEMENTS = 8192  # per program and operand: a row block this size is held in registers
INTERPRETER_ONE_PASS = 512  # the same under the interpreter (small tiles)


def _row_blocks(K: int, act: Activation | None) -> dict:
    """The row kernel's tile for ``K`` output columns: the whole row in one block (read once) where
    ``BLOCK_M`` rows of it fit ``ONE_PASS_ELEMENTS`` (halved for a gated activation, which loads two
    operands), else 16 rows by 128 columns in two passes (the row's ``amax``, then the cast). The
    interpreter's tile is small either way."""
    budget = (INTERPRETER_ONE_PASS if interpreting() else ONE_PASS_ELEMENTS) // (
        2 if act is not None and act.gated else 1
    )
    width = next_power_of_2(max(K, 1))
    if width <= budget:
        return dict(BLOCK_M=min(16, budget // width), BLOCK_K=width, ONE_PASS=True)
    return dict(BLOCK_M=16, BLOCK_K=128, ONE_PASS=False)


def rowwise(
    t: Tensor,
    act: Activation | None = None,
    *,
    interleaved: bool = False,
    index: Tensor | None = None,
    row_weights: Tensor | None = None,
    out: tuple[Tensor, Tensor] | None = None,
    weighted_rows: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """``t [M, K]`` (unit column stride) -> ``(q [M, K] e4m3 contiguous, s [M] float32)``: one power-of-two
    scale per row (:func:`moeyard.quant.fp8.quantize` with ``Blocks(None, 1)``, mode ``pow2``). With
    ``act``: of ``act(t)`` (``t`` the up projection's output, ``K`` its output columns; module docstring);
    with ``index [M]``: of ``t[index]`` (an index ``>= len(t)`` gives a zero row); with ``row_weights [M]``
    (float32): of each row times its weight. ``out``: ``(q [M, K] e4m3 with a unit column stride, s [M]
    float32)`` views to write into (any row strides, e.g. the columns of a packed row), returned.
    ``weighted_rows``: ``(rows [M, K] in a float dtype with a unit column stride, w [M] float32)``: the same
    read also writes the operand times ``w`` into ``rows`` (as :func:`act_rows` would with ``row_weights=w``,
    bit for bit: one rounding), e.g. the rows a LoRA factor multiplies.

    Raises:
        ValueError: ``act`` is a custom callable (the kernel computes named activations only)."""
    M = t.shape[0] if index is None else index.shape[0]
    K = _out_columns(t, act)
    if t.stride(1) != 1:
        t = t.contiguous()
    q_out = None
    if out is None:
        q, s = _out((M, K), t.device), torch.empty(M, device=t.device, dtype=torch.float32)
    else:
        q, s = out
        if interpreting():  # the interpreter stores float32 (module docstring): a float32 view of q's strides
            q_out, q = q, torch.empty(M, q.stride(0), device=t.device, dtype=torch.float32)[:, :K]
    if M:
        blocks = _row_blocks(K, act)
        extra = {}
        if weighted_rows is not None:
            rows, w = weighted_rows
            extra = dict(r_ptr=rows, rrw_ptr=w, stride_rm=rows.stride(0), WITH_ROWS=True)
        _rowwise_kernel[(cdiv(M, blocks["BLOCK_M"]),)](
            **_source(t, index, row_weights),
            q_ptr=q,
            s_ptr=s,
            M=M,
            K=K,
            stride_xm=t.stride(0),
            stride_qm=q.stride(0),
            stride_s=s.stride(0),
            **_act_args(act, interleaved),
            **blocks,
            **extra,
        )
    q = _cast(q)
    return (q, s) if q_out is None else (q_out.copy_(q), s)


def act_rows(
    h: Tensor,
    act: Activation,
    *,
    interleaved: bool = False,
    row_weights: Tensor | None = None,
    gate_logits: Tensor | None = None,
) -> Tensor:
    """``act(h) [R, I]`` in ``h``'s dtype (times ``row_weights [R]`` float32 when given) from the up
    projection's output ``h [R, 2I]`` (gated) or ``[R, I]``: the operand :func:`rowwise` would cast, stored
    as is (activation and row weight in float32, one rounding). ``gate_logits [R]`` (any float dtype and
    stride, e.g. a column of a wider buffer; instead of ``row_weights``): the rows times ``sigmoid(gate_logits)``,
    taken in float32 in the same pass.

    Raises:
        ValueError: both ``row_weights`` and ``gate_logits`` given."""
    if row_weights is not None and gate_logits is not None:
        raise ValueError("act_rows: pass row_weights or gate_logits, not both")
    R, K = h.shape[0], _out_columns(h, act)
    if h.stride(1) != 1:
        h = h.contiguous()
    out = torch.empty(R, K, device=h.device, dtype=h.dtype)
    if R and K:
        blocks = _row_blocks(K, act)
        gate = {} if gate_logits is None else dict(stride_rw=gate_logits.stride(0), RW_SIGMOID=True)
        _rowwise_kernel[(cdiv(R, blocks["BLOCK_M"]),)](
            **_source(h, None, row_weights if gate_logits is None else gate_logits),
            **gate,
            q_ptr=out,
            s_ptr=out,
            M=R,
            K=K,
            stride_xm=h.stride(0),
            stride_qm=out.stride(0),
            stride_s=0,
            **_act_args(act, interleaved),
            **blocks,
            QUANT=False,
        )
    return out


@cached
@triton.jit
def _dequantize_rows_kernel(
    q_ptr,  # [M, K] e4m3 (float32 under the interpreter), unit column stride
    s_ptr,  # [M] float32
    out_ptr,  # [M, K], unit column stride
    M,
    K,
    stride_qm,
    stride_s,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    r64 = rows[:, None].to(tl.int64)
    q = tl.load(q_ptr + r64 * stride_qm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + rows.to(tl.int64) * stride_s, mask=rows < M, other=0.0)
    tl.store(out_ptr + r64 * stride_om + cols[None, :], (q * s[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_rows(q: Tensor, s: Tensor, out: Tensor) -> Tensor:
    """``out[m] = q[m] * s[m]`` rounded once to ``out``'s dtype: ``q [M, K]`` e4m3 and ``s [M]`` float32 (any
    row strides, unit column stride: e.g. views of packed rows), ``out [M, K]`` (unit column stride), returned."""
    M, K = q.shape
    if interpreting():  # the interpreter's float8 loads: widen with torch first
        q = q.float()
    if M and K:
        _dequantize_rows_kernel[(cdiv(M, 16), cdiv(K, 256))](
            q, s, out, M, K, q.stride(0), s.stride(0), out.stride(0), BLOCK_M=16, BLOCK_K=256
        )
    return out


@cached
@triton.jit
def _act_backward_kernel(
    h_ptr,  # [R, 2I] gated (gate then up, or interleaved) or [R, I] plain, float, unit column stride
    g_ptr,  # [R, I] float, unit column stride: the gradient of act(h) (HAS_RW: of rw * act(h), before rw)
    rw_ptr,  # [R] float32 row weights (HAS_RW)
    dh_ptr,  # [R, 2I] or [R, I], h's dtype, unit column stride, row stride stride_dh
    drw_ptr,  # [R] float32: sum_i g[r, i] * act(h)[r, i] (HAS_RW)
    q_ptr,  # [R, 2I] or [R, I] e4m3 (float32 under the interpreter), contiguous: dh cast per row (QUANT)
    s_ptr,  # [R] float32: its power-of-two scales (QUANT)
    a_ptr,  # [R, I] h's dtype, contiguous: rw * act(h) (ACT_OUT)
    R,
    I,
    stride_h,
    stride_g,
    stride_dh,
    alpha,
    limit,
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_RW: tl.constexpr,
    QUANT: tl.constexpr,
    ACT_OUT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_I: tl.constexpr,
    stride_rw=1,  # the row weights' stride (HAS_RW)
    RW_SIGMOID: tl.constexpr = False,  # the row weights are sigmoid(rw); drw then gets the gradient of rw
    stride_drw=1,  # DRW_COLS: drw's row stride
    n_drw=1,  # DRW_COLS: drw's columns
    DRW_COLS: tl.constexpr = 0,  # > 0 (a power of two >= n_drw): drw [R, n_drw] in its dtype, the gradient in
    # column 0, zeros after
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    m_rows = rows < R
    r64 = rows[:, None].to(tl.int64)
    if HAS_RW:
        rw = _row_weights(rw_ptr, rows, m_rows, stride_rw, RW_SIGMOID)
    else:
        rw = tl.zeros([BLOCK_R], tl.float32)
    dot = tl.zeros([BLOCK_R], dtype=tl.float32)
    amax = tl.zeros([BLOCK_R], dtype=tl.float32)
    width = 2 * I if GATED else I
    for i0 in range(0, I, BLOCK_I):  # the whole row in one program: the row sums in a fixed order
        cols = i0 + tl.arange(0, BLOCK_I)
        mask = m_rows[:, None] & (cols < I)[None, :]
        if GATED:
            gcol = 2 * cols if INTERLEAVED else cols
            ucol = 2 * cols + 1 if INTERLEAVED else cols + I
        else:
            gcol = cols
            ucol = cols
        g_in = tl.load(h_ptr + r64 * stride_h + gcol[None, :], mask=mask, other=0.0).to(tl.float32)
        u_in = g_in
        if GATED:
            u_in = tl.load(h_ptr + r64 * stride_h + ucol[None, :], mask=mask, other=0.0).to(tl.float32)
        da = tl.load(g_ptr + r64 * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        a, dg, du = act_grad(g_in, u_in, alpha, limit, ACT)
        if HAS_RW:
            dot += tl.sum(tl.where(mask, da * a, 0.0), axis=1)
            da = da * rw[:, None]
        if ACT_OUT:
            aw = a * rw[:, None] if HAS_RW else a
            tl.store(a_ptr + r64 * I + cols[None, :], aw.to(a_ptr.dtype.element_ty), mask=mask)
        d_g = (da * dg).to(dh_ptr.dtype.element_ty)
        tl.store(dh_ptr + r64 * stride_dh + gcol[None, :], d_g, mask=mask)
        amax = tl.maximum(amax, tl.max(tl.abs(d_g.to(tl.float32)), axis=1))
        if GATED:
            d_u = (da * du).to(dh_ptr.dtype.element_ty)
            tl.store(dh_ptr + r64 * stride_dh + ucol[None, :], d_u, mask=mask)
            amax = tl.maximum(amax, tl.max(tl.abs(d_u.to(tl.float32)), axis=1))
    if HAS_RW:
        if RW_SIGMOID:
            dot = dot * rw * (1.0 - rw)  # d logit = d s * s (1 - s)
        if DRW_COLS > 0:
            dc = tl.arange(0, DRW_COLS)
            d_rw = tl.where((dc == 0)[None, :], dot[:, None], 0.0).to(drw_ptr.dtype.element_ty)
            tl.store(drw_ptr + r64 * stride_drw + dc[None, :], d_rw, mask=m_rows[:, None] & (dc < n_drw)[None, :])
        else:
            tl.store(drw_ptr + rows, dot, mask=m_rows)
    if QUANT:  # cast the rows of d h just written (still in cache) with the scale of their rounded amax
        tl.debug_barrier()
        scale = _pow2_scale(amax)
        tl.store(s_ptr + rows, scale, mask=m_rows)
        for c0 in range(0, width, BLOCK_I):
            cols = c0 + tl.arange(0, BLOCK_I)
            mask = m_rows[:, None] & (cols < width)[None, :]
            d = tl.load(dh_ptr + r64 * stride_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            d = tl.clamp(d / scale[:, None], -448.0, 448.0)
            tl.store(q_ptr + r64 * width + cols[None, :], d.to(q_ptr.dtype.element_ty), mask=mask)


def _q_buffer(h: Tensor, da: Tensor, overwrite_da: bool) -> Tensor:
    """:func:`act_backward`'s e4m3 output ``[R, 2I]``: ``da``'s memory viewed as e4m3 when allowed and the
    bytes match (gated ``h``, contiguous 2-byte ``da``, a real e4m3 output), else a new buffer."""
    R, I = da.shape
    fits = overwrite_da and not interpreting() and da.is_contiguous() and da.element_size() == 2
    if fits and h.shape == (R, 2 * I):
        return da.view(E4M3)
    return _out(h.shape, h.device)


class ActGrads(NamedTuple):
    """:func:`act_backward`'s results: ``dh`` in ``h``'s shape and dtype; ``d_row_weights [R]`` float32 (None
    without row weights); ``dh_fp8``, ``dh`` cast per row as :func:`rowwise` casts it (``(q, s)``; None unless
    asked); ``act_rows`` ``[R, I]`` as :func:`act_rows` gives it (None unless asked)."""

    dh: Tensor
    d_row_weights: Tensor | None
    dh_fp8: tuple[Tensor, Tensor] | None = None
    act_rows: Tensor | None = None


def _check_gate(row_weights: Tensor | None, gate_logits: Tensor | None, gate_grad: Tensor | None, R: int) -> None:
    """:func:`act_backward`'s gate arguments (its docstring); raises ValueError."""
    if row_weights is not None and gate_logits is not None:
        raise ValueError("act_backward: pass row_weights or gate_logits, not both")
    if gate_grad is None:
        return
    if gate_logits is None:
        raise ValueError("act_backward: gate_grad needs gate_logits")
    P = gate_grad.shape[1] if gate_grad.dim() == 2 else 0
    if gate_grad.dim() != 2 or gate_grad.shape[0] != R or not 1 <= P <= 16 or gate_grad.stride(1) != 1:
        raise ValueError(
            f"gate_grad: expected [{R}, P] with 1 <= P <= 16 and a unit column stride, got shape "
            f"{tuple(gate_grad.shape)}, strides {tuple(gate_grad.stride())}"
        )


def act_backward(
    h: Tensor,
    da: Tensor,
    act: Activation,
    *,
    interleaved: bool = False,
    row_weights: Tensor | None = None,
    quantize: bool = False,
    with_act_rows: bool = False,
    overwrite_da: bool = False,
    overwrite_h: bool = False,
    out: Tensor | None = None,
    gate_logits: Tensor | None = None,
    gate_grad: Tensor | None = None,
) -> ActGrads:
    """The backward of ``y = row_weights * act(h)`` (``row_weights`` None: ``y = act(h)``) given ``da = d y /
    row_weights`` (``[R, I]``, the gradient before the row weight): ``d h`` in ``h``'s shape and dtype with
    ``d act = row_weights * da``, and ``d row_weights [R]`` float32 ``= sum_i da * act(h)`` (:class:`ActGrads`).
    With ``quantize``, also ``d h``'s rowwise e4m3 cast (the input-gradient GEMM's operand; equal to
    ``rowwise(dh)``), cast from the rows just written while they are in cache; with ``with_act_rows``, also
    ``row_weights * act(h)`` in ``h``'s dtype (the high-precision weight gradient's operand; equal to
    :func:`act_rows`), from the same read of ``h``. With ``overwrite_da`` (for a caller that drops ``da``
    afterwards) the e4m3 cast is written over ``da``'s memory where ``da`` is contiguous in a 2-byte dtype
    (each row of ``[R, I]`` 2-byte values has the bytes of a row of ``[R, 2I]`` e4m3, and each program reads
    its rows of ``da`` whole before it writes their cast), so the step holds one ``R x 2I``-byte buffer less;
    ``da`` then holds garbage. With ``overwrite_h`` (for a caller that needs ``h`` no more) ``d h`` is written
    over ``h``'s memory where ``h`` is contiguous (each program reads each element of ``h`` before it writes
    ``d h`` there, and no other program touches its rows), so the step holds one ``[R, 2I]`` buffer less; the
    returned ``dh`` then shares ``h``'s storage. With ``out`` (``h``'s shape and dtype, unit column stride, any
    row stride: e.g. the columns of a wider buffer) ``d h`` is written there and returned. With ``gate_logits
    [R]`` (instead of ``row_weights``; any float dtype and stride, as :func:`act_rows` takes them) the row weights
    are ``sigmoid(gate_logits)`` and ``d_row_weights`` is the logits' gradient ``d s * s (1 - s)``; with
    ``gate_grad [R, P]`` (unit column stride, any row stride and float dtype, ``1 <= P <= 16``) that gradient is
    written into its column 0 and zeros into the others, and ``d_row_weights`` is that column. Derivatives in
    float32 (:func:`moeyard.experts.triton.act.act_grad`; torch autograd's conventions at kinks); one program
    per 32 rows (8 with ``quantize``), each row's sums in a fixed order.

    Raises:
        ValueError: ``act`` is a custom callable (the kernel computes named activations only); ``out`` not
            of ``h``'s shape and dtype with unit column stride; both ``row_weights`` and ``gate_logits``;
            ``gate_grad`` without ``gate_logits`` or not ``[R, P]`` with a unit column stride."""
    R, I = da.shape
    if out is not None and (out.shape != h.shape or out.dtype != h.dtype or (out.numel() and out.stride(1) != 1)):
        raise ValueError(
            f"out: expected shape {tuple(h.shape)}, dtype {h.dtype}, unit column stride; got {tuple(out.shape)}, "
            f"{out.dtype}, strides {tuple(out.stride())}"
        )
    _check_gate(row_weights, gate_logits, gate_grad, R)
    if h.stride(1) != 1:
        h = h.contiguous()
    if da.stride(1) != 1:
        da = da.contiguous()
    if out is not None:
        dh = out
    elif overwrite_h and h.is_contiguous():
        dh = h.detach()
    else:
        dh = torch.empty(h.shape, device=h.device, dtype=h.dtype)
    weights = row_weights if gate_logits is None else gate_logits
    gate = {} if gate_logits is None else dict(stride_rw=gate_logits.stride(0), RW_SIGMOID=True)
    if gate_grad is not None:
        drw = gate_grad
        P = gate_grad.shape[1]
        gate.update(stride_drw=gate_grad.stride(0), n_drw=P, DRW_COLS=next_power_of_2(P))
    else:
        drw = None if weights is None else torch.empty(R, device=h.device, dtype=torch.float32)
    q, s = (
        (_q_buffer(h, da, overwrite_da), torch.empty(R, device=h.device, dtype=torch.float32)) if quantize else (dh, dh)
    )
    a = torch.empty(R, I, device=h.device, dtype=h.dtype) if with_act_rows else dh
    # with quantize each program reads back the d h rows it wrote: fewer rows per program keep less in flight,
    # so the read-back finds them in L2 (qwen3-30b-a3b, H100: 1.28 ms with 32 rows against 0.70 without the cast)
    block_r = 8 if quantize else 32
    if R and I:
        _act_backward_kernel[(cdiv(R, block_r),)](
            h,
            da,
            h if weights is None else weights,
            dh,
            dh if drw is None else drw,
            q,
            s,
            a,
            R,
            I,
            h.stride(0),
            da.stride(0),
            dh.stride(0),
            **_act_args(act, interleaved),
            HAS_RW=weights is not None,
            QUANT=quantize,
            ACT_OUT=with_act_rows,
            BLOCK_R=block_r,
            BLOCK_I=128,
            **gate,
        )
    elif drw is not None:
        drw.zero_()
    return ActGrads(
        dh,
        drw if gate_grad is None else gate_grad[:, 0],
        (_cast(q), s) if quantize else None,
        a if with_act_rows else None,
    )


@triton.jit
def _weight_block(
    w_ptr,
    code_ptr,
    absmax_ptr,
    absmax2_ptr,
    code2_ptr,
    offset_ptr,
    row0,  # [R] int64: each row's first element (offset into [E, N, K])
    m_rows,
    ncol,  # the block's valid columns
    BLOCK_C: tl.constexpr,
    NF4: tl.constexpr,
    NESTED: tl.constexpr,
    BS: tl.constexpr,
    ROUND: tl.constexpr,
    TILE: tl.constexpr,
    SEG: tl.constexpr,
):
    """The float32 block ``[R, BLOCK_C]`` of a weight at ``row0 + 0 .. BLOCK_C - 1`` (columns past ``ncol``:
    zero): the weight's own elements, or with ``NF4`` the values the dequantisation writes
    (:class:`NF4Source`: ``code[q] * absmax[block]`` in float32, rounded to the compute dtype: ``ROUND``
    "bf16_hw" by the conversion, "bf16_bits" on the bits as the interpreter needs, "f16" by the conversion,
    "none" for float32). ``TILE`` (even ``row0``): the codes loaded as ``[R, BLOCK_C / 2]`` bytes, each byte's
    two nibbles decoded with one scale; else per element (any offsets). ``SEG`` (with ``TILE``; ``row0`` a
    multiple of it, which divides ``BS`` and ``BLOCK_C``): one scale read per ``SEG`` elements, as the
    dequantisation reads one per block; 0: one per element."""
    cols = tl.arange(0, BLOCK_C)
    mask = m_rows[:, None] & (cols < ncol)[None, :]
    if not NF4:
        v = tl.load(w_ptr + row0[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    elif TILE:
        half = tl.arange(0, BLOCK_C // 2)
        m_half = m_rows[:, None] & (2 * half < ncol)[None, :]
        byte = tl.load(w_ptr + (row0 // 2)[:, None] + half[None, :], mask=m_half, other=0).to(tl.int32)
        if SEG:
            seg = tl.arange(0, BLOCK_C // SEG)
            blk = (row0[:, None] + SEG * seg[None, :]) // BS
            m_seg = m_rows[:, None] & (SEG * seg < ncol)[None, :]
            s = block_scales(absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, blk, m_seg, NESTED, _NESTED_BS)
            s = tl.broadcast_to(tl.reshape(s, [s.shape[0], BLOCK_C // SEG, 1]), [s.shape[0], BLOCK_C // SEG, SEG // 2])
            scale = tl.reshape(s, [s.shape[0], BLOCK_C // 2])
        else:
            blk = (row0[:, None] + 2 * half[None, :]) // BS
            scale = block_scales(absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, blk, m_half, NESTED, _NESTED_BS)
        hi = tl.load(code_ptr + (byte >> 4)) * scale  # element 2i: the high nibble of byte i
        v = tl.where(mask, tl.interleave(hi, tl.load(code_ptr + (byte & 0xF)) * scale), 0.0)
    else:
        flat = row0[:, None] + cols[None, :]
        byte = tl.load(w_ptr + flat // 2, mask=mask, other=0).to(tl.int32)
        q = tl.where((flat & 1) == 0, byte >> 4, byte & 0xF)
        scale = block_scales(absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, flat // BS, mask, NESTED, _NESTED_BS)
        v = tl.load(code_ptr + q, mask=mask, other=0.0) * scale
    if not NF4:
        pass
    elif ROUND == "bf16_hw":
        v = v.to(tl.bfloat16).to(tl.float32)
    elif ROUND == "bf16_bits":
        v = _round_bf16(v).to(tl.float32)
    elif ROUND == "f16":
        v = v.to(tl.float16).to(tl.float32)
    return v


@cached
@triton.jit
def _weight_rows_kernel(
    w_ptr,  # [E, N, K] float, contiguous; with NF4 the packed codes [E * N * K / 2] uint8
    code_ptr,  # NF4: [16] float32, the table
    absmax_ptr,  # NF4: [E * N * K / BS] block scales, float32 or (NESTED) uint8 codes of code2
    absmax2_ptr,  # NESTED: [ceil(E * N * K / BS / 256)] float32
    code2_ptr,  # NESTED: [256] float32
    offset_ptr,  # NESTED: [] float32
    active_ptr,  # [E] bool as uint8: expert e is cast iff nonzero; read if HAS_ACTIVE
    q_ptr,  # [E, N, K] e4m3 (float32 under the interpreter), contiguous
    s_ptr,  # [E, N] float32
    amax_ptr,  # [E, K] float32, zero-filled: max over n of |w[e, n, k]| (atomic max)
    N,
    K,
    ROWS: tl.constexpr,  # rows of one expert per program
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,  # >= K: each row read once
    NF4: tl.constexpr,
    NESTED: tl.constexpr,
    BS: tl.constexpr,
    ROUND: tl.constexpr,
    HAS_ACTIVE: tl.constexpr,
    TILE: tl.constexpr,
    SEG: tl.constexpr,
):
    """``ROWS`` rows of ``w_e`` cast per row (as :func:`rowwise`), ``BLOCK_M`` at a time, their columns'
    ``amax`` folded into ``amax[e]``; nothing for an inactive expert."""
    e = tl.program_id(0).to(tl.int64)
    if HAS_ACTIVE:
        if tl.load(active_ptr + e) == 0:
            return
    n0 = tl.program_id(1) * ROWS
    cols = tl.arange(0, BLOCK_K)
    m_cols = cols < K
    col_max = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)  # reduced over rows once, after the loop
    for c in range(0, ROWS, BLOCK_M):
        rows = n0 + c + tl.arange(0, BLOCK_M)
        m_rows = rows < N
        row0 = e * N * K + rows.to(tl.int64) * K
        b = _weight_block(
            w_ptr,
            code_ptr,
            absmax_ptr,
            absmax2_ptr,
            code2_ptr,
            offset_ptr,
            row0,
            m_rows,
            K,
            BLOCK_K,
            NF4,
            NESTED,
            BS,
            ROUND,
            TILE,
            SEG,
        )
        a = tl.abs(b)
        scale = _row_scale(s_ptr + e * N, tl.max(a, axis=1), rows, m_rows, 1, True)
        _store_rows(q_ptr + e * N * K, b, scale, rows, m_rows, cols, K, K, True)
        col_max = tl.maximum(col_max, a)
    tl.atomic_max(amax_ptr + e * K + cols, tl.max(col_max, axis=0), mask=m_cols)


@cached
@triton.jit
def _transpose_cast_kernel(
    w_ptr,  # [E, N, K] float, contiguous; with NF4 the packed codes (as _weight_rows_kernel)
    code_ptr,
    absmax_ptr,
    absmax2_ptr,
    code2_ptr,
    offset_ptr,
    active_ptr,
    amax_ptr,  # [E, KW] float32: the window's columns' amax over N
    q_ptr,  # [E, KW, N] e4m3 (float32 under the interpreter), contiguous
    s_ptr,  # [E, KW] float32: the power-of-two scales
    N,
    K,
    K0,  # the window's first column of w
    KW,  # the window's columns
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NF4: tl.constexpr,
    NESTED: tl.constexpr,
    BS: tl.constexpr,
    ROUND: tl.constexpr,
    HAS_ACTIVE: tl.constexpr,
    TILE: tl.constexpr,
    SEG: tl.constexpr,
):
    """One ``[BLOCK_N, BLOCK_K]`` tile of columns ``K0 .. K0 + KW - 1`` of ``w_e``, scaled per column, stored
    transposed; nothing for an inactive expert."""
    e = tl.program_id(0).to(tl.int64)
    if HAS_ACTIVE:
        if tl.load(active_ptr + e) == 0:
            return
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)  # of the window
    m_rows, m_cols = rows < N, cols < KW
    scale = _pow2_scale(tl.load(amax_ptr + e * KW + cols, mask=m_cols, other=0.0))
    if tl.program_id(1) == 0:
        tl.store(s_ptr + e * KW + cols, scale, mask=m_cols)
    c0 = tl.program_id(2) * BLOCK_K
    row0 = e * N * K + rows.to(tl.int64) * K + K0 + c0
    b = _weight_block(
        w_ptr,
        code_ptr,
        absmax_ptr,
        absmax2_ptr,
        code2_ptr,
        offset_ptr,
        row0,
        m_rows,
        KW - c0,
        BLOCK_K,
        NF4,
        NESTED,
        BS,
        ROUND,
        TILE,
        SEG,
    )
    q = tl.clamp(b / scale[None, :], -448.0, 448.0).to(q_ptr.dtype.element_ty)
    tl.store(
        q_ptr + e * KW * N + cols[:, None].to(tl.int64) * N + rows[None, :],
        tl.trans(q),
        mask=m_cols[:, None] & m_rows[None, :],
    )


class NF4Source(NamedTuple):
    """NF4 expert storage (:class:`moeyard.quant.NF4Experts`, ``[E, N, K]`` as stored) as the weight casts read
    it, so that the FP8 casts decode it in their loads (block scales, double quantisation included) and no dense
    weight is written (:func:`nf4_source`).

    Attributes: ``storage``; ``active [E]`` bool or None: only those experts are cast (the others' rows are
    left unwritten)."""

    storage: object
    active: Tensor | None

    @property
    def shape(self) -> torch.Size:
        return self.storage.shape

    @property
    def device(self) -> torch.device:
        return self.storage.device

    def dense(self) -> Tensor:
        """The active experts dequantised (the casts' path for rows wider than one block)."""
        return self.storage.dequantize(self.active)


def nf4_source(storage, active: Tensor | None = None) -> NF4Source:
    """:class:`NF4Source` of an :class:`moeyard.quant.NF4Experts` and the experts to cast (``active [E]`` bool,
    None: all)."""
    return NF4Source(storage, active)


NF4_TILES = True  # NF4 codes read as byte tiles where rows start on a byte (else per element)
NF4_SEGMENTS = True  # with tiles, one block scale read per segment of a block (else one per element)


def _weight_args(w, block: int, k0: int = 0) -> dict:
    """The weight kernels' operand arguments (and launch options) for a dense ``[E, N, K]`` tensor (contiguous)
    or an :class:`NF4Source`, read ``block`` columns at a time from column ``k0`` on: byte tiles of codes where
    every row starts on a whole byte, and one scale per ``min(blocksize, block)`` elements where every row
    starts on such a segment (``_weight_block``'s ``TILE`` and ``SEG``)."""
    if not isinstance(w, NF4Source):
        return dict(
            w_ptr=w, code_ptr=w, absmax_ptr=w, absmax2_ptr=w, code2_ptr=w, offset_ptr=w, active_ptr=w, NF4=False,
            NESTED=False, BS=1, ROUND="none", HAS_ACTIVE=False, TILE=False, SEG=0,
        )  # fmt: skip
    K = w.shape[-1]
    tile = K % 2 == 0 and k0 % 2 == 0 and NF4_TILES
    seg = min(w.storage.blocksize, block)
    seg = seg if tile and NF4_SEGMENTS and seg >= 2 and K % seg == 0 and k0 % seg == 0 else 0
    st, dtype = w.storage, w.storage.dtype
    if dtype == torch.bfloat16:
        rnd = "bf16_bits" if interpreting() else "bf16_hw"
    else:
        rnd = "f16" if dtype == torch.float16 else "none"
    nested = st.compress_statistics
    return dict(
        w_ptr=st.data,
        code_ptr=st.code,
        absmax_ptr=st.absmax,
        absmax2_ptr=st.absmax2 if nested else st.code,
        code2_ptr=st.code2 if nested else st.code,
        offset_ptr=st.offset if nested else st.code,
        active_ptr=st.data if w.active is None else w.active.view(torch.uint8),
        NF4=True,
        NESTED=nested,
        BS=st.blocksize,
        ROUND=rnd,
        HAS_ACTIVE=w.active is not None,
        TILE=tile,
        SEG=seg,
        enable_fp_fusion=False,  # the nested scales rounded twice, as the dequantisation does
    )


WEIGHT_PROGRAMS = 1024  # rowwise_per_expert: about this many programs (fewer rows each: more atomics)
# rowwise_per_expert: rows of about this many elements per step (at least 4 rows, at most the row kernel's
# block): 1.1-1.2x faster than whole 8192-element blocks for rows of 256-768 (H200, NOTES round 50)
WEIGHT_STEP_ELEMENTS = 4096


def rowwise_per_expert(w, *, rows: int | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """``w [E, N, K]`` (any float dtype, or NF4 storage as an :class:`NF4Source`) -> ``(q [E, N, K] e4m3, s [E,
    N] float32, amax [E, K] float32 or None)``: the forward's cast of each expert weight, one power-of-two scale
    per row (output channel), equal to ``rowwise(w.view(E * N, K))`` (for NF4, to that of the dequantised
    weight, bit for bit, read from its 4-bit codes); and, from the same read, each column's ``max |w_e[:,
    k]|`` (``amax``), with which :func:`colwise_per_expert` makes the transposed cast for the input gradient
    reading ``w`` once. Rows wider than one block (:data:`ONE_PASS_ELEMENTS`) take :func:`rowwise` (NF4
    dequantised first), and ``amax`` is then None. ``rows``: rows per program (default: about
    :data:`WEIGHT_PROGRAMS` programs)."""
    E, N, K = w.shape
    blocks = _row_blocks(K, None)
    if not blocks["ONE_PASS"] or not (E and N and K):
        w = w.dense() if isinstance(w, NF4Source) else w
        q, s = rowwise(w.reshape(E * N, K))
        return q.view(E, N, K), s.view(E, N), None
    w = w if isinstance(w, NF4Source) else w.contiguous()
    q, s = _out((E, N, K), w.device), torch.empty(E, N, device=w.device, dtype=torch.float32)
    amax = torch.zeros(E, K, device=w.device, dtype=torch.float32)
    bk = blocks["BLOCK_K"]
    bm = min(blocks["BLOCK_M"], max(4, WEIGHT_STEP_ELEMENTS // bk))
    rows = rows or min(next_power_of_2(cdiv(E * N, WEIGHT_PROGRAMS)), 1024)
    rows = max(bm, rows)
    _weight_rows_kernel[(E, cdiv(N, rows))](
        q_ptr=q, s_ptr=s, amax_ptr=amax, N=N, K=K, ROWS=rows, BLOCK_M=bm, BLOCK_K=bk, **_weight_args(w, bk)
    )
    return _cast(q), s, amax


def colwise_per_expert(w, amax: Tensor | None = None, *, cols: tuple[int, int] | None = None) -> tuple[Tensor, Tensor]:
    """``w [E, N, K]`` (or NF4 storage as an :class:`NF4Source`) -> ``(q [E, K, N] e4m3, s [E, K] float32)``:
    ``w_e^T`` with one power-of-two scale per (expert, column of ``w_e``) over its ``N`` rows. ``amax [E,
    K]``: those columns' ``max |w|``, from :func:`rowwise_per_expert` (then ``w`` is read once; else its
    ``amax`` is computed first, one more read, and NF4 storage is dequantised for it). ``cols = (k0, k1)``:
    only columns ``k0 .. k1 - 1`` (``q [E, k1 - k0, N]``, ``s [E, k1 - k0]``, equal to those rows of the whole
    cast), for a GEMM made a column window at a time.
    Tiles of 64 x 64 stored transposed; on an H100 about 2x the strip kernel it replaced with ``amax`` given,
    1.2-1.3x without (``benchmarks/NOTES.md``, round 40).

    Raises:
        ValueError: ``cols`` not ``0 <= k0 <= k1 <= K``.
    """
    E, N, K = w.shape
    k0, k1 = (0, K) if cols is None else cols
    if not 0 <= k0 <= k1 <= K:
        raise ValueError(f"cols: expected (k0, k1) with 0 <= k0 <= k1 <= {K}, got {cols}")
    KW = k1 - k0
    if isinstance(w, NF4Source) and amax is None:
        w = w.dense()
    w = w if isinstance(w, NF4Source) else w.contiguous()
    q, s = _out((E, KW, N), w.device), torch.empty(E, KW, device=w.device, dtype=torch.float32)
    if not (E and KW and N):
        return _cast(q), s
    if amax is None:
        amax = torch.linalg.vector_norm(w[:, :, k0:k1], ord=float("inf"), dim=1, dtype=torch.float32)
    else:
        amax = amax[:, k0:k1].contiguous()
    block = 16 if interpreting() else 64
    _transpose_cast_kernel[(E, cdiv(N, block), cdiv(KW, block))](
        amax_ptr=amax, q_ptr=q, s_ptr=s, N=N, K=K, K0=k0, KW=KW, BLOCK_N=block, BLOCK_K=block,
        **_weight_args(w, block, k0),
    )  # fmt: skip
    return _cast(q), s
