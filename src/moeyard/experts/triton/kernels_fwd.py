"""Forward kernels: gathered up projection with the activation in its epilogue, grouped down
projection with bias and routing weight in its epilogue (also used for the input gradient; as an
option it adds rows into tokens with float32 atomics), and the deterministic combine of pair rows
into tokens.

Legend: T tokens, H hidden, I intermediate, N1 = 2I (gated) or I, E experts, K top-k, N = T*K
pairs. "Sorted" rows are in expert-major order (``sort_order``); "pair" rows in token-major order.

LoRA (``LORA`` 1 = split, 2 = fused; 0 = none): a GEMM ``Y = A W_e^T`` gains ``s * z Lb_e^T`` with
``z = A La_e`` (``[rows, R]``) and two factors given as expert-strided views ``La [E, K, R]`` and
``Lb [E, NOUT, R]`` (any strides: PEFT's layout is read in place). Split: ``z`` comes from an earlier
launch of the same kernel (``[N, R]``, sorted rows); fused: the main loop computes it from the A tiles
it already loads, and the first column tile stores it (backward needs it).
"""

import triton
import triton.language as tl

from ...launch import cached
from .act import act_fwd
from .gemm import gathered_mainloop, gathered_mainloop_tma_b, lora_epilogue, lora_z, row_col_tile


@triton.jit
def up_kernel(
    x_ptr,  # [T, H] input dtype, strides (stride_xt, stride_xh)
    w_ptr,  # [E, N1, H] input dtype, strides (stride_we, stride_wn, stride_wh)
    b_ptr,  # [E, N1] bias (any float dtype), strides (stride_be, stride_bn); read if HAS_BIAS
    sort_order_ptr,  # [N] int64: sorted position -> flat pair index
    offsets_ptr,  # [E + 1] int32: expert_offsets
    h_ptr,  # [N, N1] input dtype, contiguous: pre-activation rows, sorted; written if STORE_H
    a_ptr,  # [N, NA] input dtype, contiguous: activation rows, sorted (NA = I; = N1 for ACT "none")
    la_ptr,  # [E, H, R] LoRA factor La (input dtype), strides (stride_lae, stride_lak, stride_lar); if LORA == 2
    lb_ptr,  # [E, N1, R] LoRA factor Lb (input dtype), strides (stride_lbe, stride_lbn, stride_lbr); if LORA
    z_ptr,  # [N, R] input dtype, contiguous: x[token] @ La_e, sorted (read if LORA == 1, written if 2)
    H,
    NA,
    N1,
    E,
    top_k,
    R,
    band_bits,
    stride_xt,
    stride_xh,
    stride_we,
    stride_wn,
    stride_wh,
    stride_be,
    stride_bn,
    stride_lae,
    stride_lak,
    stride_lar,
    stride_lbe,
    stride_lbn,
    stride_lbr,
    gate_step,
    up_offset,  # output column j reads gate row j * gate_step, up row j * gate_step + up_offset
    alpha,
    limit,
    lora_scale,
    ACT: tl.constexpr,
    DUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    STORE_H: tl.constexpr,
    GATHER: tl.constexpr,
    LORA: tl.constexpr,
    RP: tl.constexpr,
    PRECISION: tl.constexpr,
    E_P2: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    W_TMA: tl.constexpr = False,
    BAND: tl.constexpr = False,
):
    """``h = x[token] @ W_up[e].T + b (+ s z Lb_e^T)``, ``a = act(h)`` for one (row tile, column
    tile). ``GATHER``: row r reads ``x[token of r]``; else ``x[r]`` (x already in sorted order).
    ``W_TMA``: W's tiles come through a TMA descriptor (``stride_wh == 1``, ``gate_step == 1``, no fused
    LoRA; 16-byte aligned strides and base), the rows of x by pointer loads as before.
    ``BAND``: the row tiles in band-major order (:func:`.schedule.band_tile`, ``band_bits`` steps)."""
    e, rows, m_mask, pair, token, cols, n_mask = row_col_tile(
        NA, offsets_ptr, sort_order_ptr, E, top_k, BM, BN, E_P2, band_bits, BAND
    )
    if e >= E:
        return
    e64 = e.to(tl.int64)
    col_g = cols.to(tl.int64) * gate_step
    col_u = col_g + up_offset
    r_offs = tl.arange(0, RP)
    acc_g = tl.zeros((BM, BN), tl.float32)
    acc_u = tl.zeros((BM, BN), tl.float32)
    acc_z = tl.zeros((BM, RP), tl.float32)
    a_row_off = (token if GATHER else rows) * stride_xt
    if W_TMA:
        w_desc = tl.make_tensor_descriptor(
            w_ptr, shape=[E, N1, H], strides=[stride_we, stride_wn, 1], block_shape=[1, BN, BK]
        )
        col0 = (tl.program_id(0) % tl.cdiv(NA, BN)) * BN
        acc_g, acc_u = gathered_mainloop_tma_b(
            acc_g,
            acc_u,
            x_ptr,
            a_row_off,
            m_mask,
            stride_xh,
            w_desc,
            e,
            col0,
            col0 + up_offset,
            H,
            BN,
            BK,
            DUAL,
            PRECISION,
        )
    else:
        acc_g, acc_u, acc_z = gathered_mainloop(
            acc_g,
            acc_u,
            acc_z,
            x_ptr,
            a_row_off,
            m_mask,
            stride_xh,
            w_ptr + e64 * stride_we,
            col_g * stride_wn,
            col_u * stride_wn,
            n_mask,
            stride_wh,
            la_ptr + e64 * stride_lae,
            r_offs.to(tl.int64) * stride_lar,
            r_offs < R,
            stride_lak,
            H,
            BK,
            DUAL,
            LORA == 2,
            PRECISION,
        )
    if LORA:
        z = lora_z(acc_z, z_ptr, rows, m_mask, R, tl.program_id(0) % tl.cdiv(NA, BN), RP, LORA)
        lb_e = lb_ptr + e64 * stride_lbe
        acc_g = lora_epilogue(acc_g, z, lb_e, col_g * stride_lbn, n_mask, stride_lbr, R, lora_scale, PRECISION, RP)
        if DUAL:
            acc_u = lora_epilogue(acc_u, z, lb_e, col_u * stride_lbn, n_mask, stride_lbr, R, lora_scale, PRECISION, RP)
    if HAS_BIAS:
        b_row = b_ptr + e64 * stride_be
        acc_g += tl.load(b_row + col_g * stride_bn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if DUAL:
            acc_u += tl.load(b_row + col_u * stride_bn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    # round to the stored dtype first: backward recomputes the activation from the stored h
    g = acc_g.to(a_ptr.dtype.element_ty).to(tl.float32)
    u = acc_u.to(a_ptr.dtype.element_ty).to(tl.float32)
    mask = m_mask[:, None] & n_mask[None, :]
    if STORE_H:
        h_rows = h_ptr + rows[:, None] * N1
        tl.store(h_rows + col_g[None, :], g.to(h_ptr.dtype.element_ty), mask=mask)
        if DUAL:
            tl.store(h_rows + col_u[None, :], u.to(h_ptr.dtype.element_ty), mask=mask)
    a = act_fwd(g, u, alpha, limit, ACT)
    tl.store(a_ptr + rows[:, None] * NA + cols[None, :], a.to(a_ptr.dtype.element_ty), mask=mask)


@triton.jit
def down_kernel(
    a_ptr,  # [N, KA] input dtype, contiguous: rows in sorted order
    w_ptr,  # [E, NY, KA] input dtype, strides (stride_we, stride_wn, stride_wk): y = a @ W[e].T
    b_ptr,  # [E, NY] bias (any float dtype), strides (stride_be, stride_bn); read if HAS_BIAS
    tw_ptr,  # [N] routing weight of each pair (any float dtype), by pair; read if HAS_WEIGHT
    sort_order_ptr,  # [N] int64: sorted position -> flat pair index
    offsets_ptr,  # [E + 1] int32: expert_offsets
    y_ptr,  # [N, NY] output dtype, contiguous: rows by pair (token-major);
    # with ATOMIC: [T, NY] float32, contiguous, rows by token (added into)
    la_ptr,  # [E, KA, R] LoRA factor La (input dtype), strides (stride_lae, stride_lak, stride_lar); if LORA == 2
    lb_ptr,  # [E, NY, R] LoRA factor Lb (input dtype), strides (stride_lbe, stride_lbn, stride_lbr); if LORA
    z_ptr,  # [N, R] input dtype, contiguous: a[row] @ La_e, sorted (read if LORA == 1, written if 2)
    KA,
    NY,
    E,
    top_k,
    R,
    stride_we,
    stride_wn,
    stride_wk,
    stride_be,
    stride_bn,
    stride_lae,
    stride_lak,
    stride_lar,
    stride_lbe,
    stride_lbn,
    stride_lbr,
    lora_scale,
    HAS_BIAS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    ATOMIC: tl.constexpr,
    LORA: tl.constexpr,
    RP: tl.constexpr,
    PRECISION: tl.constexpr,
    E_P2: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """``y[pair] = w[pair] * (a[row] @ W[e].T + b[e] (+ s z Lb_e^T))`` for one (row tile, column
    tile); with ``ATOMIC`` the row is added into ``y[token]`` with float32 atomics instead (the
    combine fused, order of a token's pairs not fixed)."""
    e, rows, m_mask, pair, token, cols, n_mask = row_col_tile(NY, offsets_ptr, sort_order_ptr, E, top_k, BM, BN, E_P2)
    if e >= E:
        return
    e64 = e.to(tl.int64)
    col_off = cols.to(tl.int64) * stride_wn
    r_offs = tl.arange(0, RP)
    acc = tl.zeros((BM, BN), tl.float32)
    acc_z = tl.zeros((BM, RP), tl.float32)
    acc, _, acc_z = gathered_mainloop(
        acc,
        acc,
        acc_z,
        a_ptr,
        rows * KA,
        m_mask,
        1,
        w_ptr + e64 * stride_we,
        col_off,
        col_off,
        n_mask,
        stride_wk,
        la_ptr + e64 * stride_lae,
        r_offs.to(tl.int64) * stride_lar,
        r_offs < R,
        stride_lak,
        KA,
        BK,
        False,
        LORA == 2,
        PRECISION,
    )
    down_epilogue(
        acc,
        acc_z,
        e64,
        rows,
        m_mask,
        pair,
        token,
        cols,
        n_mask,
        tl.program_id(0) % tl.cdiv(NY, BN),
        b_ptr,
        tw_ptr,
        y_ptr,
        lb_ptr,
        z_ptr,
        NY,
        R,
        stride_be,
        stride_bn,
        stride_lbe,
        stride_lbn,
        stride_lbr,
        lora_scale,
        HAS_BIAS,
        HAS_WEIGHT,
        ATOMIC,
        LORA,
        RP,
        PRECISION,
    )


@triton.jit
def down_epilogue(
    acc,
    acc_z,
    e64,
    rows,
    m_mask,
    pair,
    token,
    cols,
    n_mask,
    pid_n,
    b_ptr,
    tw_ptr,
    y_ptr,
    lb_ptr,
    z_ptr,
    NY,
    R,
    stride_be,
    stride_bn,
    stride_lbe,
    stride_lbn,
    stride_lbr,
    lora_scale,
    HAS_BIAS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    ATOMIC: tl.constexpr,
    LORA: tl.constexpr,
    RP: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """The down projection's epilogue for the tile ``acc = a[rows] @ W[e].T`` (``[BM, BN]`` float32):
    LoRA term, bias, routing weight, then the store by pair (or the atomic add by token)."""
    if LORA:
        z = lora_z(acc_z, z_ptr, rows, m_mask, R, pid_n, RP, LORA)
        acc = lora_epilogue(
            acc,
            z,
            lb_ptr + e64 * stride_lbe,
            cols.to(tl.int64) * stride_lbn,
            n_mask,
            stride_lbr,
            R,
            lora_scale,
            PRECISION,
            RP,
        )
    if HAS_BIAS:
        bias = tl.load(b_ptr + e64 * stride_be + cols * stride_bn, mask=n_mask, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    if HAS_WEIGHT:
        acc *= tl.load(tw_ptr + pair, mask=m_mask, other=0.0).to(tl.float32)[:, None]
    mask = m_mask[:, None] & n_mask[None, :]
    if ATOMIC:
        tl.atomic_add(y_ptr + token[:, None] * NY + cols[None, :], acc, mask=mask, sem="relaxed")
    else:
        tl.store(y_ptr + pair[:, None] * NY + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


@cached
@triton.jit
def combine_kernel(
    y_ptr,  # [N, H] rows by pair (token-major), contiguous; rows of invalid pairs are not read
    ids_ptr,  # [T, K] integer expert ids, contiguous
    tw_ptr,  # [T, K] routing weights, contiguous; read if NAN_INVALID
    out_ptr,  # [T, H] output dtype, contiguous
    H,
    E,
    top_k,
    NAN_INVALID: tl.constexpr,
    BH: tl.constexpr,
):
    """``out[t] = sum_k y[t * K + k]`` in float32, fixed order (deterministic). A pair whose id
    lies outside ``[0, E)`` adds 0, or ``w * 0`` with ``NAN_INVALID`` (NaN for a NaN weight)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    c_mask = cols < H
    acc = tl.zeros((BH,), tl.float32)
    for k in range(top_k):
        pair = t * top_k + k
        eid = tl.load(ids_ptr + pair + tl.zeros_like(cols))  # the pair's id, broadcast over the columns
        valid = (eid >= 0) & (eid < E)
        acc += tl.load(y_ptr + pair * H + cols, mask=c_mask & valid, other=0.0).to(tl.float32)
        if NAN_INVALID:
            acc += tl.where(valid, 0.0, tl.load(tw_ptr + pair + tl.zeros_like(cols)).to(tl.float32) * 0.0)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=c_mask)


@cached
@triton.jit
def fill_invalid_kernel(
    y_ptr,  # [T, H] the output rows (K == 1), contiguous; written only where the id is invalid
    ids_ptr,  # [T] integer expert ids, contiguous
    tw_ptr,  # [T] routing weights; read if NAN_INVALID
    T,
    H,
    E,
    NAN_INVALID: tl.constexpr,
    BT: tl.constexpr,
    BH: tl.constexpr,
):
    """The combine at ``K == 1``, in place: a valid pair's row already is its token's row and is left
    alone; the rows of pairs whose id lies outside ``[0, E)`` (never written by the down projection)
    are set to 0, or ``w * 0`` with ``NAN_INVALID``. A program covers ``BT`` rows x ``BH`` columns and
    returns after reading its ``BT`` ids when none of them is invalid."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    r_mask = rows < T
    eid = tl.load(ids_ptr + rows, mask=r_mask, other=0)
    invalid = r_mask & ((eid < 0) | (eid >= E))
    if tl.max(invalid.to(tl.int32), axis=0) == 0:
        return
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    fill = tl.zeros((BT, BH), tl.float32)
    if NAN_INVALID:
        fill += (tl.load(tw_ptr + rows, mask=invalid, other=0.0).to(tl.float32) * 0.0)[:, None]
    mask = invalid[:, None] & (cols < H)[None, :]
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * H + cols[None, :], fill.to(y_ptr.dtype.element_ty), mask=mask)
