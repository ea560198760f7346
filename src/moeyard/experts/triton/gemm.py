"""The shared main loop of every grouped GEMM here: ``acc += A[rows, :] @ B[:, cols]`` for one
expert's weight ``B``, with the row gather folded into the A loads (rows given as element offsets).

Loads use 64-bit row offsets (``T * K * H`` may exceed 2**31). ``tl.dot`` accumulates in float32.
"""

import triton
import triton.language as tl

from .schedule import band_tile, expert_tile


@triton.jit
def gathered_mainloop(
    acc_g,
    acc_u,
    acc_z,
    a_ptr,  # A base pointer (any float dtype); row r's element k at a_ptr + r_off + k * stride_ak
    a_row_off,  # [BM] int64 element offsets of the A rows (gathered or sorted)
    m_mask,  # [BM] bool, rows that exist
    stride_ak,
    b_ptr,  # one expert's B: element (k, col) at b_ptr + col_off + k * stride_bk
    b_off_g,  # [BN] int64 column offsets of B for acc_g
    b_off_u,  # [BN] int64 column offsets of B for acc_u (read when DUAL)
    n_mask,  # [BN] bool, columns that exist
    stride_bk,
    la_ptr,  # one expert's LoRA factor L [K, R]: element (k, j) at la_ptr + la_off_r[j] + k * stride_lak
    la_off_r,  # [RP] int64 offsets of L's rank columns (read when LORA_FUSED)
    r_mask,  # [RP] bool, rank columns that exist
    stride_lak,
    K,  # reduction length
    BK: tl.constexpr,
    DUAL: tl.constexpr,
    LORA_FUSED: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Returns ``(acc_g, acc_u, acc_z)`` after the K loop; ``acc_u`` is only updated when ``DUAL``
    (gated layers: the gate and up columns of the same output tile share the A loads) and
    ``acc_z [BM, RP] += A @ L`` only when ``LORA_FUSED`` (the LoRA down-projection of the same rows,
    sharing the A loads)."""
    ks = tl.arange(0, BK)
    a_ptrs = a_ptr + a_row_off[:, None] + ks[None, :] * stride_ak
    bg_ptrs = b_ptr + b_off_g[None, :] + ks[:, None] * stride_bk
    bu_ptrs = b_ptr + b_off_u[None, :] + ks[:, None] * stride_bk
    la_ptrs = la_ptr + la_off_r[None, :] + ks[:, None] * stride_lak
    for k0 in range(0, K, BK):
        k_mask = (k0 + ks) < K
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(bg_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc_g = tl.dot(a, b, acc_g, input_precision=PRECISION)
        if DUAL:
            b = tl.load(bu_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc_u = tl.dot(a, b, acc_u, input_precision=PRECISION)
            bu_ptrs += BK * stride_bk
        if LORA_FUSED:
            la = tl.load(la_ptrs, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
            acc_z = tl.dot(a, la, acc_z, input_precision=PRECISION)
            la_ptrs += BK * stride_lak
        a_ptrs += BK * stride_ak
        bg_ptrs += BK * stride_bk
    return acc_g, acc_u, acc_z


@triton.jit
def gathered_mainloop_tma_b(
    acc_g,
    acc_u,
    a_ptr,
    a_row_off,
    m_mask,
    stride_ak,
    b_desc,  # descriptor of B [E, NB, K] (unit stride along K), boxes [1, BN, BK]
    e,
    col_g0,
    col_u0,  # B rows col_g0 ... (acc_g) and col_u0 ... (acc_u, when DUAL)
    K,
    BN: tl.constexpr,
    BK: tl.constexpr,
    DUAL: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """:func:`gathered_mainloop` (no fused LoRA) with B's tiles loaded through a TMA descriptor: boxes
    past B's rows or K are zero-filled; columns past the output's end are computed and not stored."""
    ks = tl.arange(0, BK)
    a_ptrs = a_ptr + a_row_off[:, None] + ks[None, :] * stride_ak
    for k0 in range(0, K, BK):
        a = tl.load(a_ptrs, mask=m_mask[:, None] & ((k0 + ks) < K)[None, :], other=0.0)
        b = tl.trans(tl.reshape(b_desc.load([e, col_g0, k0]), (BN, BK)))
        acc_g = tl.dot(a, b, acc_g, input_precision=PRECISION)
        if DUAL:
            b = tl.trans(tl.reshape(b_desc.load([e, col_u0, k0]), (BN, BK)))
            acc_u = tl.dot(a, b, acc_u, input_precision=PRECISION)
        a_ptrs += BK * stride_ak
    return acc_g, acc_u


@triton.jit
def lora_z(acc_z, z_ptr, rows, m_mask, R, pid_n, RP: tl.constexpr, LORA: tl.constexpr):
    """The tile's LoRA rows ``z [BM, RP]`` (float32): with ``LORA == 1`` (split) read from
    ``z [N, R]`` (sorted rows, computed by an earlier launch); with ``LORA == 2`` (fused) the
    main loop's ``acc_z``, which the first column tile stores to ``z`` for backward."""
    r_offs = tl.arange(0, RP)
    mask = m_mask[:, None] & (r_offs < R)[None, :]
    z_ptrs = z_ptr + rows[:, None] * R + r_offs[None, :]
    if LORA == 1:
        z = tl.load(z_ptrs, mask=mask, other=0.0).to(tl.float32)
    else:
        z = acc_z
        if pid_n == 0:
            tl.store(z_ptrs, z.to(z_ptr.dtype.element_ty), mask=mask)
    return z


@triton.jit
def lora_epilogue(acc, z, lb_ptr, col_off, n_mask, stride_lbr, R, scale, PRECISION: tl.constexpr, RP: tl.constexpr):
    """``acc [BM, BN] += scale * z [BM, RP] @ Lb[cols, :]^T`` for one expert's LoRA factor ``Lb``:
    element (col, j) at ``lb_ptr + col_off[col] + j * stride_lbr``. ``scale * z`` is rounded to the
    factor's dtype for the tensor-core product (float32 accumulation)."""
    r_offs = tl.arange(0, RP)
    lb = tl.load(
        lb_ptr + col_off[None, :] + r_offs[:, None].to(tl.int64) * stride_lbr,
        mask=(r_offs < R)[:, None] & n_mask[None, :],
        other=0.0,
    )  # [RP, BN]
    return tl.dot((z * scale).to(lb.dtype), lb, acc, input_precision=PRECISION)


@triton.jit
def sorted_rows(
    pid_m,
    offsets_ptr,
    sort_order_ptr,
    E,
    top_k,
    band_bits,
    BM: tl.constexpr,
    E_P2: tl.constexpr,
    BAND: tl.constexpr = False,
):
    """The rows of row tile ``pid_m``: ``(e, rows, m_mask, pair, token)`` with ``rows`` [BM] int64
    sorted positions, ``pair`` the flat pair index and ``token = pair // top_k`` (masked rows: 0).
    ``e >= E``: the tile does not exist. ``BAND``: tiles in band-major order (:func:`.schedule.band_tile`,
    ``band_bits`` steps), else expert-major."""
    if BAND:
        e, row0, row_end = band_tile(pid_m, offsets_ptr, E, band_bits, BM, E_P2)
    else:
        e, row0, row_end = expert_tile(pid_m, offsets_ptr, E, BM, E_P2)
    rows = row0 + tl.arange(0, BM)
    m_mask = rows < row_end
    rows = rows.to(tl.int64)
    pair = tl.load(sort_order_ptr + rows, mask=m_mask, other=0)
    return e, rows, m_mask, pair, pair // top_k


@triton.jit
def row_col_tile(
    NC,
    offsets_ptr,
    sort_order_ptr,
    E,
    top_k,
    BM: tl.constexpr,
    BN: tl.constexpr,
    E_P2: tl.constexpr,
    band_bits=0,
    BAND: tl.constexpr = False,
):
    """This program's (row tile, column tile) of a grouped GEMM over sorted rows with ``NC`` output
    columns: ``(e, rows, m_mask, pair, token, cols, n_mask)`` (see :func:`sorted_rows`); ``e >= E``:
    the tile does not exist and the program should exit."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(NC, BN)
    e, rows, m_mask, pair, token = sorted_rows(
        pid // n_tiles, offsets_ptr, sort_order_ptr, E, top_k, band_bits, BM, E_P2, BAND
    )
    cols = (pid % n_tiles) * BN + tl.arange(0, BN)
    return e, rows, m_mask, pair, token, cols, cols < NC


@triton.jit
def weight_tile(NL, NR, BN: tl.constexpr, BK: tl.constexpr, TILE_MAJOR: tl.constexpr = False):
    """This program's (work item, L tile, R tile) of a weight-gradient grid over ``[NL, NR]`` outputs:
    ``(item, cl [BN], cr [BK], pid_r, pid_l)``, the tile's L and R columns and its R- and L-tile index.
    Programs run item-major (all tiles of one expert, then the next: concurrent programs share the
    expert's rows in L2), or with ``TILE_MAJOR`` tile-major (one tile of every item, then the next
    tile: concurrent programs read the same columns of an operand gathered by token, so a token's
    slice read by one expert is in L2 for its others; used by the thin LoRA-factor gradients,
    ``options().wgrad_tile_major``)."""
    pid = tl.program_id(0)
    tiles_l = tl.cdiv(NL, BN)
    tiles_r = tl.cdiv(NR, BK)
    if TILE_MAJOR:
        items = tl.num_programs(0) // (tiles_l * tiles_r)
        item = pid % items
        tile = pid // items
    else:
        item = pid // (tiles_l * tiles_r)
        tile = pid % (tiles_l * tiles_r)
    pid_l = tile // tiles_r
    pid_r = tile % tiles_r
    return item, pid_l * BN + tl.arange(0, BN), pid_r * BK + tl.arange(0, BK), pid_r, pid_l
