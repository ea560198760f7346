"""Backward kernels: the activation gradient (gathered ``dout @ W_down`` with the activation's
derivative in its epilogue) and the grouped weight gradient (one program per expert, or per chunk
of an expert's rows, and output tile; chunk partials summed by a second kernel in a fixed order:
deterministic, no atomics). The input gradient reuses
``kernels_fwd.down_kernel`` and ``combine_kernel``.

Legend as in :mod:`.kernels_fwd`.
"""

import triton
import triton.language as tl

from ...launch import cached
from .act import act_grad
from .gemm import gathered_mainloop, lora_epilogue, lora_z, row_col_tile, weight_tile
from .schedule import expert_piece, expert_slots


@triton.jit
def dh_kernel(
    dout_ptr,  # [T, H] output-gradient dtype, strides (stride_dt, stride_dh)
    w_ptr,  # [E, H, I] down weight, strides (stride_we, stride_wh, stride_wi)
    b_ptr,  # [E, H] down bias, strides (stride_be, stride_bh); read if HAS_BIAS
    h_ptr,  # [N, N1] input dtype, contiguous: pre-activation rows, sorted
    tw_ptr,  # [N] routing weight of each pair (any float dtype), by pair
    sort_order_ptr,  # [N] int64: sorted position -> flat pair index
    offsets_ptr,  # [E + 1] int32: expert_offsets
    dh_ptr,  # [N, N1] input dtype, contiguous: d loss / d h, sorted (out)
    aw_ptr,  # [N, I] input dtype, contiguous: w * act(h), sorted (out)
    dw_ptr,  # [n_col_tiles_max, N] float32, zero-filled: partial d loss / d w by (column tile, pair) (out)
    la_ptr,  # [E, H, R] LoRA factor La = B_down (input dtype), strides (stride_lae, stride_lak, stride_lar)
    lb_ptr,  # [E, I, R] LoRA factor Lb = A_down^T (input dtype), strides (stride_lbe, stride_lbn, stride_lbr)
    z_ptr,  # [N, R] input dtype, contiguous: dout[token] @ B_down_e, sorted (read if LORA == 1, written if 2)
    H,
    I,
    N1,
    N,
    E,
    top_k,
    R,
    stride_dt,
    stride_dh,
    stride_we,
    stride_wh,
    stride_wi,
    stride_be,
    stride_bh,
    stride_lae,
    stride_lak,
    stride_lar,
    stride_lbe,
    stride_lbn,
    stride_lbr,
    gate_step,
    up_offset,
    alpha,
    limit,
    lora_scale,
    ACT: tl.constexpr,
    DUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    LORA: tl.constexpr,
    RP: tl.constexpr,
    PRECISION: tl.constexpr,
    E_P2: tl.constexpr,
    PREFETCH: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """``g = dout[token] @ W_down[e] (+ s (dout[token] @ B_e) A_e)``; ``d_a = w * g``;
    ``d_h = act'(h) * d_a``; ``d_w = g . act(h) (+ dout[token] . b_down[e])`` split over column tiles.
    ``PREFETCH``: the tile's ``h`` rows are prefetched into L2 before the main loop (:func:`_prefetch_h`)."""
    e, rows, m_mask, pair, token, cols, n_mask = row_col_tile(I, offsets_ptr, sort_order_ptr, E, top_k, BM, BN, E_P2)
    if e >= E:
        return
    e64 = e.to(tl.int64)
    pid_n = tl.program_id(0) % tl.cdiv(I, BN)  # column tile: one d_w partial per tile
    if PREFETCH:
        _prefetch_h(h_ptr, rows, m_mask, pid_n * BN, N1, gate_step, up_offset, DUAL, BN)
    col_off = cols.to(tl.int64) * stride_wi
    r_offs = tl.arange(0, RP)
    acc = tl.zeros((BM, BN), tl.float32)
    acc_z = tl.zeros((BM, RP), tl.float32)
    acc, _, acc_z = gathered_mainloop(
        acc,
        acc,
        acc_z,
        dout_ptr,
        token * stride_dt,
        m_mask,
        stride_dh,
        w_ptr + e64 * stride_we,
        col_off,
        col_off,
        n_mask,
        stride_wh,
        la_ptr + e64 * stride_lae,
        r_offs.to(tl.int64) * stride_lar,
        r_offs < R,
        stride_lak,
        H,
        BK,
        False,
        LORA == 2,
        PRECISION,
    )
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
    w = tl.load(tw_ptr + pair, mask=m_mask, other=0.0).to(tl.float32)[:, None]
    if BN >= 128:  # the epilogue in two column halves: half the live registers (no spills at wide tiles)
        acc0, acc1 = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
        cols0 = pid_n * BN + tl.arange(0, BN // 2)
        d_w = _dh_epilogue(
            acc0,
            w,
            cols0,
            rows,
            m_mask,
            h_ptr,
            dh_ptr,
            aw_ptr,
            I,
            N1,
            gate_step,
            up_offset,
            alpha,
            limit,
            ACT,
            DUAL,
            PREFETCH,
        )
        d_w += _dh_epilogue(
            acc1,
            w,
            cols0 + BN // 2,
            rows,
            m_mask,
            h_ptr,
            dh_ptr,
            aw_ptr,
            I,
            N1,
            gate_step,
            up_offset,
            alpha,
            limit,
            ACT,
            DUAL,
            PREFETCH,
        )
    else:
        d_w = _dh_epilogue(
            acc,
            w,
            cols,
            rows,
            m_mask,
            h_ptr,
            dh_ptr,
            aw_ptr,
            I,
            N1,
            gate_step,
            up_offset,
            alpha,
            limit,
            ACT,
            DUAL,
            PREFETCH,
        )
    if HAS_BIAS:
        if pid_n == 0:
            d_w += _rows_dot_bias(
                dout_ptr, token * stride_dt, m_mask, stride_dh, b_ptr + e64 * stride_be, stride_bh, H, BM, BK
            )
    tl.store(dw_ptr + pid_n.to(tl.int64) * N + pair, d_w, mask=m_mask)


@triton.jit
def _prefetch_l2(ptrs):
    """``prefetch.global.L2::evict_last`` of every address in ``ptrs`` (PTX ISA 7.4+, sm_80+,
    "prefetch"): a hint, no result; the lines are kept ahead of streamed data until read."""
    tl.inline_asm_elementwise(
        "mov.u32 $0, 0;\n\tprefetch.global.L2::evict_last [$1];", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _prefetch_h(h_ptr, rows, m_mask, c0, N1, gate_step, up_offset, DUAL: tl.constexpr, BN: tl.constexpr):
    """Prefetch into L2 the 128-byte lines of ``h`` the epilogue of the column tile starting at ``c0``
    reads: its ``[BM, BN]`` gate (and up) columns of the tile's sorted ``rows``. Issued before the main
    loop, these reads overlap it instead of stalling the epilogue (one CTA per SM leaves nothing else
    to run meanwhile). The lines are prefetched ``evict_last`` (the main loop streams more gathered rows
    than L2 holds) and read ``evict_first`` by the epilogue, which releases them. Masked-off addresses
    become ``h``'s first element, so none lies outside ``h``."""
    LINE: tl.constexpr = 1024 // h_ptr.dtype.element_ty.primitive_bitwidth  # elements per 128 bytes
    SPAN: tl.constexpr = 2 * BN if DUAL else BN  # elements per row: gate and up, adjacent or apart
    NL: tl.constexpr = (SPAN + LINE - 1) // LINE
    j = tl.arange(0, NL) * LINE
    if DUAL:  # interleaved (gate_step 2): one span of 2 BN; else two spans of BN, up_offset apart
        half = j >= BN
        col = tl.where(gate_step == 2, c0 * 2 + j, c0 + j + tl.where(half, up_offset - BN, 0))
    else:
        col = c0 + j
    ok = m_mask[:, None] & (col < N1)[None, :]
    _prefetch_l2(h_ptr + tl.where(ok, rows.to(tl.int64)[:, None] * N1 + col[None, :], 0))


@triton.jit
def _dh_epilogue(
    acc,
    w,
    cols,
    rows,
    m_mask,
    h_ptr,
    dh_ptr,
    aw_ptr,
    I,
    N1,
    gate_step,
    up_offset,
    alpha,
    limit,
    ACT: tl.constexpr,
    DUAL: tl.constexpr,
    PREFETCHED: tl.constexpr,
):
    """For the output columns ``cols`` of ``acc = dout[token] @ W_down[e]`` (``[BM, len(cols)]``
    float32) and routing weights ``w [BM, 1]``: store ``d_h`` and ``w * act(h)``; return this
    block's ``[BM]`` share of ``d w = sum_cols acc * act(h)``."""
    mask = m_mask[:, None] & (cols < I)[None, :]
    col_g = cols.to(tl.int64) * gate_step
    h_rows = h_ptr + rows[:, None] * N1
    # PREFETCHED: the rows were prefetched evict_last (_prefetch_h); read once, here, evict_first releases them
    policy: tl.constexpr = "evict_first" if PREFETCHED else ""
    g = tl.load(h_rows + col_g[None, :], mask=mask, other=0.0, eviction_policy=policy).to(tl.float32)
    u = g
    if DUAL:
        u = tl.load(h_rows + (col_g + up_offset)[None, :], mask=mask, other=0.0, eviction_policy=policy).to(tl.float32)
    a, da_dg, da_du = act_grad(g, u, alpha, limit, ACT)
    d_a = acc * w
    dh_rows = dh_ptr + rows[:, None] * N1
    tl.store(dh_rows + col_g[None, :], (d_a * da_dg).to(dh_ptr.dtype.element_ty), mask=mask)
    if DUAL:
        tl.store(dh_rows + (col_g + up_offset)[None, :], (d_a * da_du).to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(aw_ptr + rows[:, None] * I + cols[None, :], (a * w).to(aw_ptr.dtype.element_ty), mask=mask)
    return tl.sum(tl.where(mask, acc * a, 0.0), 1)


@triton.jit
def _rows_dot_bias(d_ptr, row_off, m_mask, stride_dh, b_ptr, stride_bh, H, BM: tl.constexpr, BK: tl.constexpr):
    """``[BM]`` float32: ``dout[row] . b`` for the tile's rows."""
    acc = tl.zeros((BM,), tl.float32)
    for k0 in range(0, H, BK):
        ks = k0 + tl.arange(0, BK)
        k_mask = ks < H
        d = tl.load(
            d_ptr + row_off[:, None] + ks[None, :] * stride_dh, mask=m_mask[:, None] & k_mask[None, :], other=0.0
        ).to(tl.float32)
        b = tl.load(b_ptr + ks * stride_bh, mask=k_mask, other=0.0).to(tl.float32)
        acc += tl.sum(d * b[None, :], 1)
    return acc


@triton.jit
def wgrad_kernel(
    l_ptr,  # rows of L [*, NL]: row r's column n at l_ptr + r_off + n * stride_ln (input dtype)
    r_ptr,  # rows of R [*, NR], likewise with stride_rn
    scale_ptr,  # [N] routing weight by sorted row (any float dtype); read if DB_SCALE
    token_ptr,  # [N] int32: sorted position -> token (sort_order // top_k)
    offsets_ptr,  # [E + 1] int32: expert_offsets
    dw_ptr,  # [E, NL, NR] weight gradient, strides (stride_de, stride_dl, stride_dr) (out)
    db_ptr,  # [E, NL] bias gradient, strides (stride_be, stride_bl); written if HAS_DB (out)
    part_ptr,  # [S, NL, NR] float32, contiguous: partial dW of split experts' chunks (out, if CHUNKED)
    part_b_ptr,  # [S, NL] float32, contiguous: partial db likewise (out, if CHUNKED and HAS_DB)
    f_ptr,  # [E, NL, NR] factor F, strides (stride_fe, stride_fl, stride_fr); read if ROWS
    rows_ptr,  # [cdiv(NL, BN), N, NR] float32, contiguous: row-product partials by L tile (out, if ROWS)
    NL,
    NR,
    E,
    chunk_rows,
    alpha,
    stride_lm,
    stride_ln,
    stride_rm,
    stride_rn,
    stride_de,
    stride_dl,
    stride_dr,
    stride_be,
    stride_bl,
    stride_fe,
    stride_fl,
    stride_fr,
    stride_pl,
    L_GATHER: tl.constexpr,
    R_GATHER: tl.constexpr,
    HAS_DB: tl.constexpr,
    DB_SCALE: tl.constexpr,
    CHUNKED: tl.constexpr,
    PRECISION: tl.constexpr,
    E_P2: tl.constexpr,
    TMA: tl.constexpr,
    ROWS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    TILE_MAJOR: tl.constexpr = False,
):
    """``dW[e] = alpha * L[rows of e]^T @ R[rows of e]`` and ``db[e] = alpha * sum_rows s * L`` (``s`` =
    routing weight with ``DB_SCALE``, else 1). A gathered operand is indexed by token, else by sorted row.

    ``ROWS``: the same pass over ``L`` also yields the row product ``L[row] @ F_e`` (``[N, NR]``, e.g.
    the LoRA rows ``d_y B_e`` next to ``dB_e``), as float32 partials over this program's ``BN`` columns
    of ``L`` (``rows_ptr[pid_l]``, stride ``stride_pl``), which the caller sums in L-tile order.

    One program per (work item, L tile, R tile). A work item is an expert, or with ``CHUNKED`` a
    chunk of ``chunk_rows`` of an expert's rows: an expert with one chunk writes ``dW`` directly,
    the chunks of a longer expert write float32 partials that :func:`wgrad_reduce_kernel` sums.

    ``TMA``: an operand in sorted rows (not gathered) is loaded by a Hopper TMA descriptor made for
    this program's rows, ``[end, NL]`` (or ``NR``): the box zero-fills the rows past the work item's
    end, so no mask and no per-element address arithmetic (the gathered operand keeps its pointer loads).

    ``TILE_MAJOR``: the programs' order (:func:`.gemm.weight_tile`)."""
    item, cl, cr, pid_r, pid_l = weight_tile(NL, NR, BN, BK, TILE_MAJOR)
    if CHUNKED:
        e, start, end, j, n, slot0 = expert_piece(item, offsets_ptr, E, chunk_rows, E_P2, True)
        end = tl.minimum(end, start + chunk_rows)
    else:
        e, j, n, slot0 = item, 0, 1, 0
        start = tl.load(offsets_ptr + e)
        end = tl.load(offsets_ptr + e + 1)
    if e >= E:
        return
    l_mask = cl < NL
    r_mask = cr < NR
    if TMA and not L_GATHER:
        l_desc = tl.make_tensor_descriptor(
            l_ptr, shape=[tl.maximum(end, 1), NL], strides=[stride_lm, 1], block_shape=[BM, BN]
        )
    if TMA and not R_GATHER:
        r_desc = tl.make_tensor_descriptor(
            r_ptr, shape=[tl.maximum(end, 1), NR], strides=[stride_rm, 1], block_shape=[BM, BK]
        )
    acc = tl.zeros((BN, BK), tl.float32)
    acc_b = tl.zeros((BN,), tl.float32)
    if ROWS:  # F_e's tile, read once
        f = tl.load(
            f_ptr + e.to(tl.int64) * stride_fe + cl[:, None] * stride_fl + cr[None, :] * stride_fr,
            mask=l_mask[:, None] & r_mask[None, :],
            other=0.0,
        )  # [BN, BK]
        rows_ptr += pid_l.to(tl.int64) * stride_pl
    # the gather index of the next row step is loaded one step ahead (a loop-carried value), so
    # Triton pipelines the gathered loads with all of num_stages' buffers; it is used as loaded (a
    # precomputed token, no division), so nothing in the step waits for that load
    next_rows = (start + tl.arange(0, BM)).to(tl.int64)
    next_token = tl.load(token_ptr + next_rows, mask=next_rows < end, other=0)
    for r0 in range(start, end, BM):
        rows = next_rows
        m_mask = rows < end
        token = next_token.to(tl.int64)
        next_rows = rows + BM
        next_token = tl.load(token_ptr + next_rows, mask=next_rows < end, other=0)
        l_rows = token if L_GATHER else rows
        r_rows = token if R_GATHER else rows
        if TMA and not L_GATHER:
            lt = tl.trans(l_desc.load([r0, pid_l * BN]))  # [BN, BM]
        else:
            lt = tl.load(
                l_ptr + l_rows[None, :] * stride_lm + cl[:, None] * stride_ln,
                mask=l_mask[:, None] & m_mask[None, :],
                other=0.0,
            )  # [BN, BM]
        if TMA and not R_GATHER:
            r = r_desc.load([r0, pid_r * BK])  # [BM, BK]
        else:
            r = tl.load(
                r_ptr + r_rows[:, None] * stride_rm + cr[None, :] * stride_rn,
                mask=m_mask[:, None] & r_mask[None, :],
                other=0.0,
            )  # [BM, BK]
        acc = tl.dot(lt, r, acc, input_precision=PRECISION)
        if ROWS:
            p = tl.dot(tl.trans(lt), f, input_precision=PRECISION)  # [BM, BK]
            tl.store(rows_ptr + rows[:, None] * NR + cr[None, :], p, mask=m_mask[:, None] & r_mask[None, :])
        if HAS_DB:
            if pid_r == 0:
                s = lt.to(tl.float32)
                if DB_SCALE:
                    s *= tl.load(scale_ptr + rows, mask=m_mask, other=0.0).to(tl.float32)[None, :]
                acc_b += tl.sum(s, 1)
    mask = l_mask[:, None] & r_mask[None, :]
    if n > 1:  # a chunk of a split expert (only with CHUNKED): float32 partial in slot slot0 + j
        slot = (slot0 + j).to(tl.int64)
        tl.store(part_ptr + slot * NL * NR + cl[:, None] * NR + cr[None, :], acc, mask=mask)
        if HAS_DB:
            if pid_r == 0:
                tl.store(part_b_ptr + slot * NL + cl, acc_b, mask=l_mask)
    else:
        _store_expert_grads(
            dw_ptr,
            db_ptr,
            e,
            acc * alpha,
            acc_b * alpha,
            cl,
            cr,
            mask,
            l_mask,
            pid_r,
            stride_de,
            stride_dl,
            stride_dr,
            stride_be,
            stride_bl,
            HAS_DB,
        )


@cached
@triton.jit
def wgrad_reduce_kernel(
    part_ptr,  # [S, NL, NR] float32, contiguous: chunk partials of dW
    part_b_ptr,  # [S, NL] float32, contiguous: chunk partials of db; read if HAS_DB
    offsets_ptr,  # [E + 1] int32: expert_offsets
    dw_ptr,  # [E, NL, NR] weight gradient, strides (stride_de, stride_dl, stride_dr) (out)
    db_ptr,  # [E, NL] bias gradient, strides (stride_be, stride_bl); written if HAS_DB (out)
    NL,
    NR,
    E,
    chunk_rows,
    alpha,
    stride_de,
    stride_dl,
    stride_dr,
    stride_be,
    stride_bl,
    HAS_DB: tl.constexpr,
    E_P2: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """``dW[e] = alpha * sum_j part[slot0 + j]`` in chunk order (deterministic) for every expert cut into
    more than one chunk; programs of the other experts exit at once."""
    e, cl, cr, pid_r, _ = weight_tile(NL, NR, BN, BK)
    n, slot0 = expert_slots(e, offsets_ptr, E, chunk_rows, E_P2)
    if n <= 1:
        return
    l_mask = cl < NL
    mask = l_mask[:, None] & (cr < NR)[None, :]
    acc = tl.zeros((BN, BK), tl.float32)
    acc_b = tl.zeros((BN,), tl.float32)
    for j in range(0, n):
        slot = (slot0 + j).to(tl.int64)
        acc += tl.load(part_ptr + slot * NL * NR + cl[:, None] * NR + cr[None, :], mask=mask, other=0.0)
        if HAS_DB:
            if pid_r == 0:  # the bias row is summed by the first column tile
                acc_b += tl.load(part_b_ptr + slot * NL + cl, mask=l_mask, other=0.0)
    _store_expert_grads(
        dw_ptr,
        db_ptr,
        e,
        acc * alpha,
        acc_b * alpha,
        cl,
        cr,
        mask,
        l_mask,
        pid_r,
        stride_de,
        stride_dl,
        stride_dr,
        stride_be,
        stride_bl,
        HAS_DB,
    )


@triton.jit
def _store_expert_grads(
    dw_ptr,
    db_ptr,
    e,
    acc,
    acc_b,
    cl,
    cr,
    mask,
    l_mask,
    pid_r,
    stride_de,
    stride_dl,
    stride_dr,
    stride_be,
    stride_bl,
    HAS_DB: tl.constexpr,
):
    """Store expert ``e``'s ``dW`` tile ``acc [BN, BK]`` (and, from the first R tile, ``db`` = ``acc_b [BN]``)."""
    e64 = e.to(tl.int64)
    tl.store(
        dw_ptr + e64 * stride_de + cl[:, None] * stride_dl + cr[None, :] * stride_dr,
        acc.to(dw_ptr.dtype.element_ty),
        mask=mask,
    )
    if HAS_DB:
        if pid_r == 0:
            tl.store(db_ptr + e64 * stride_be + cl * stride_bl, acc_b.to(db_ptr.dtype.element_ty), mask=l_mask)
