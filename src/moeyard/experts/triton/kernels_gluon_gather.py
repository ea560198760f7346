"""The two grouped GEMMs that gather their rows by token, written in Gluon for sm_90: the up projection
``h = x[token] W_up^T``, ``a = act(h)`` (``DH`` false) and the activation gradient ``g = d_out[token]
W_down`` with the activation's derivative in its epilogue (``DH``), each with or without a split LoRA term.
The gathered counterparts of :mod:`.kernels_gluon`'s down projection.

Why: the Triton kernels (:func:`.kernels_fwd.up_kernel`, :func:`.kernels_bwd.dh_kernel`) gather their rows
with pointer loads that every warp issues between its MMAs, behind CTA-wide barriers: 55-67% and 36-59% of
the dense rate where the TMA-loaded down projection reached 65-79% (H100, ``benchmarks/NOTES.md``, round
13). A Hopper TMA box cannot gather rows, but ``cp.async`` can. Here one persistent program per SM is
warp-specialised (``gl.warp_specialize``):

- a loader partition of ``LOADER_WARPS`` warps (``DH_LOADER_WARPS`` for dh at 128-row tiles), for every
  (tile, K step): the expert's weight box(es) through TMA (the gate and up boxes of the up projection), and
  the tile's rows gathered by token with ``cp.async`` (16 bytes per thread and instruction; rows past their
  expert's end and columns past ``K`` zero-filled, not read), into a ring of ``STAGES`` stages. A stage's
  ``ready`` barrier completes once the TMA bytes have landed and each loader thread's copies have
  (``cp.async.mbarrier.arrive.noinc``: one arrival per thread); each tile's LoRA boxes ``z`` and ``Lb`` go
  into a ring of two ahead of its K loop;
- ``BM / 64`` consumer warp groups, each on 64 rows of every tile: wait for a stage, make the copies
  visible to the tensor cores (``fence.proxy.async``), run the MMA(s) with one K step in flight, release
  the stage the previous step read, then the LoRA MMA(s) and the epilogue, stored by sorted row in
  16-byte vectors: up, bias, the rounding backward relies on, ``h`` and ``a = act(h)``; dh, ``d_h = act'(h)
  w g``, ``w act(h)`` and the routing weight's gradient ``sum_cols g act(h)`` per column tile, with ``h``
  read from shared memory: the loader loads it by TMA into the ring as two more entries after each tile's
  last K step, so it lands while the consumers run the last steps and takes no shared memory of its own.
  dh's ring is of 6 stages where the up projection's is of 4 (32 KiB stages against 48): this kernel is
  limited by its gathered loads, so the gathered bytes in flight set its speed (H100, ``benchmarks/NOTES.md``,
  round 25: 2.26 ms at 4 stages, 2.03 at 6; 256-column tiles, 4 stages of 48 KiB: 3.04).

Operands (``N`` sorted rows, ``K`` reduction, ``NA`` output columns, ``N1 = 2 NA`` gated or ``NA``):
- ``x_ptr``: the gathered rows ``[T, K]``, unit stride along ``K``, row stride ``stride_xt``; row ``r`` reads
  token ``sort_order[r] // top_k`` (``x`` for up, ``d_out`` for dh).
- ``w_desc``: ``W [E, N1, K]`` (``W_KMAJOR``, boxes ``[1, BN, BK]``; up: transformers' ``gate_up_proj``, the
  gate rows of output column ``j`` at ``j``, the up rows at ``j + up_offset``) or ``[E, K, NA]`` (boxes
  ``[1, BK, BN]``; dh: ``down_proj [E, H, I]``). Boxes past the weight's end read zeros.
- ``h_desc`` (dh): ``h [N, N1]``, boxes ``[BM, BK]``.
- ``z_desc``: ``z [N, R]``, boxes ``[BM, RP]``; ``lb_desc``: ``Lb [E, N1, R]`` (``LB_KMAJOR``, boxes
  ``[1, BN, RP]``) or ``[E, R, N1]`` (boxes ``[1, RP, BN]``).
Rows of a tile past its expert's end are computed on zeros and not stored.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ...launch import cached
from .act import act_fwd, act_grad
from .kernels_gluon import (
    _layout,
    _my_tiles,
    _tile_of,
    _tma_load,
    barrier_ring,
    load_lora,
    next_stage,
    scaled_z,
    store_layout,
)

# Triton renamed cp.async's copy after 3.6 (3.6: async_copy_global_to_shared; 3.9: async_load, the old name raises)
_cp_async = async_copy.async_load if hasattr(async_copy, "async_load") else async_copy.async_copy_global_to_shared
# and made a shared-memory view's reinterpretation public (3.6: _reinterpret; 3.9: reinterpret)
_PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))


@gluon.jit
def _loader(
    x_ptr,
    w_desc,
    z_desc,
    lb_desc,
    h_desc,
    x_bufs,
    wg_bufs,
    wu_bufs,
    z_bufs,
    lbg_bufs,
    lbu_bufs,
    ready,
    empty,
    lready,
    lempty,
    sort_order_ptr,
    offsets_ptr,
    table_ptr,
    K,
    NA,
    E,
    M,
    top_k,
    stride_xt,
    up_offset,
    DUAL: gl.constexpr,
    DH: gl.constexpr,
    W_KMAJOR: gl.constexpr,
    LB_KMAJOR: gl.constexpr,
    LORA: gl.constexpr,
    BM: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    WARPS: gl.constexpr,
):
    """The loader partition: per tile, its LoRA boxes into slot ``t % 2`` once both consumers released it,
    the rows' tokens, then each K step's weight boxes (TMA) and gathered rows (``cp.async``) into the next
    stage once both consumers released that; dh: then the tile's ``h`` boxes (:func:`_load_h`)."""
    TWO_B: gl.constexpr = DUAL and not DH  # the up projection's gate and up boxes
    ld: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 8], threads_per_warp=[32 * 8 // BK, BK // 8], warps_per_cta=[WARPS, 1], order=[1, 0]
    )
    pid, nprog, n_tiles_n, my_tiles = _my_tiles(table_ptr, M, NA, BN)
    k_steps = gl.cdiv(K, BK)
    ks = gl.arange(0, BK, gl.SliceLayout(0, ld))
    s = 0
    phase = 0
    for t in range(my_tiles):
        e, row0, col0 = _tile_of(t, pid, nprog, n_tiles_n, table_ptr, M, BN)
        if LORA:
            load_lora(
                z_desc,
                lb_desc,
                z_bufs,
                lbg_bufs,
                lbu_bufs,
                lready,
                lempty,
                t,
                e,
                row0,
                col0,
                up_offset,
                LB_KMAJOR,
                TWO_B,
            )
        rows = row0 + gl.arange(0, BM, gl.SliceLayout(1, ld))
        ok = rows < gl.load(offsets_ptr + gl.minimum(e, E - 1) + 1)
        pair = gl.load(sort_order_ptr + rows, mask=ok, other=0)
        # token = pair // top_k in 32 bits (pairs < 2**31: rows_ready); the 64-bit division spilled registers
        ptrs = x_ptr + ((pair.to(gl.int32) // top_k).to(gl.int64) * stride_xt)[:, None] + ks[None, :]
        for kt in range(k_steps):
            mbarrier.wait(empty.index(s), phase ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, (1 + TWO_B) * w_desc.block_type.nbytes)
            if W_KMAJOR:
                _tma_load(w_desc, [e, col0, kt * BK], bar, wg_bufs.index(s))
                if TWO_B:
                    _tma_load(w_desc, [e, col0 + up_offset, kt * BK], bar, wu_bufs.index(s))
            else:
                _tma_load(w_desc, [e, kt * BK, col0], bar, wg_bufs.index(s))
            _cp_async(x_bufs.index(s), ptrs + kt * BK, mask=ok[:, None] & ((ks + kt * BK) < K)[None, :])
            async_copy.mbarrier_arrive(bar, increment_count=False)
            s, phase = next_stage(s, phase, STAGES)
        if DH:
            s, phase = _load_h(h_desc, x_bufs, wg_bufs, ready, empty, s, phase, row0, col0, up_offset, DUAL, BN, STAGES)


@gluon.jit
def _h_up_view(wg_bufs, x_bufs, s):
    """Stage ``s``'s weight buffer seen as a ``[BM, BK]`` box like its rows buffer: where an ``h`` entry of
    the ring puts its up columns (the gate's go to the rows buffer)."""
    if _PUBLIC_REINTERPRET:
        view = wg_bufs.index(s).reinterpret(x_bufs.dtype, [x_bufs.shape[1], x_bufs.shape[2]], x_bufs.layout)
    else:
        view = wg_bufs.index(s)._reinterpret(x_bufs.dtype, [x_bufs.shape[1], x_bufs.shape[2]], x_bufs.layout)
    return view


@gluon.jit
def _load_h(
    h_desc,
    x_bufs,
    wg_bufs,
    ready,
    empty,
    s,
    phase,
    row0,
    col0,
    up_offset,
    DUAL: gl.constexpr,
    BN: gl.constexpr,
    STAGES: gl.constexpr,
):
    """dh: the tile's ``h`` rows as ``BN / BK`` more entries of the ring, after its last K step: entry ``q``
    holds the gate's columns ``col0 + q BK ...`` (in the rows buffer) and the up's (in the weight buffer,
    :func:`_h_up_view`), ``[BM, BK]`` boxes each. So they land while the consumers run the tile's last K
    steps, take no shared memory of their own, and the next tile's K steps follow them in the ring. Returns
    the ring's next ``(stage, phase)``."""
    HW: gl.constexpr = h_desc.block_type.shape[1]
    for q in gl.static_range(BN // HW):
        mbarrier.wait(empty.index(s), phase ^ 1)
        bar = ready.index(s)
        mbarrier.expect(bar, (1 + DUAL) * h_desc.block_type.nbytes)
        _tma_load(h_desc, [row0, col0 + q * HW], bar, x_bufs.index(s))
        if DUAL:
            _tma_load(h_desc, [row0, col0 + q * HW + up_offset], bar, _h_up_view(wg_bufs, x_bufs, s))
        async_copy.mbarrier_arrive(bar, increment_count=False)  # each loader thread's arrival, as a K step's
        s, phase = next_stage(s, phase, STAGES)
    return s, phase


@gluon.jit
def _consumer(
    half,
    x_bufs,
    wg_bufs,
    wu_bufs,
    z_bufs,
    lbg_bufs,
    lbu_bufs,
    ready,
    empty,
    lready,
    lempty,
    b_ptr,
    h_ptr,
    a_ptr,
    dh_ptr,
    tw_ptr,
    dw_ptr,
    sort_order_ptr,
    offsets_ptr,
    table_ptr,
    K,
    NA,
    N1,
    N,
    E,
    M,
    stride_be,
    stride_bn,
    up_offset,
    alpha,
    limit,
    lora_scale,
    ACT: gl.constexpr,
    DUAL: gl.constexpr,
    DH: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    STORE_H: gl.constexpr,
    W_KMAJOR: gl.constexpr,
    LB_KMAJOR: gl.constexpr,
    LORA: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
):
    """A consumer partition (one warp group): rows ``64 half ... 64 half + 63`` of every tile (see the
    module docstring). As in :mod:`.kernels_gluon`, the previous step's stage index is recomputed, not
    carried."""
    HM: gl.constexpr = 64  # a warp group's MMA rows
    ST: gl.constexpr = store_layout(HM, BN, 4)
    dtype: gl.constexpr = x_bufs.dtype
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    z_reg: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    TWO_B: gl.constexpr = DUAL and not DH  # the up projection's gate and up accumulators
    pid, nprog, n_tiles_n, my_tiles = _my_tiles(table_ptr, M, NA, BN)
    k_steps = gl.cdiv(K, BK)
    IN_FLIGHT: gl.constexpr = 1 + TWO_B  # one K step's MMAs
    s = 0
    phase = 0
    for t in range(my_tiles):
        e, row0, col0 = _tile_of(t, pid, nprog, n_tiles_n, table_ptr, M, BN)
        rows = row0 + half * HM + gl.arange(0, HM, gl.SliceLayout(1, ST))
        ok = rows < gl.load(offsets_ptr + gl.minimum(e, E - 1) + 1)
        if DH:  # the rows' pairs and routing weights, loaded before the K loop hides their latency
            pair = gl.load(sort_order_ptr + rows, mask=ok, other=0)
            w = gl.load(tw_ptr + pair, mask=ok, other=0.0).to(gl.float32)
        acc_g = gl.zeros([HM, BN], gl.float32, mma)
        acc_u = gl.zeros([HM, BN], gl.float32, mma)
        for kt in range(k_steps):
            mbarrier.wait(ready.index(s), phase)
            fence_async_shared()  # the cp.async rows (generic proxy) before the MMA's reads (async proxy)
            x_s = x_bufs.index(s).slice(half * HM, HM)
            if W_KMAJOR:
                acc_g = warpgroup_mma(x_s, wg_bufs.index(s).permute((1, 0)), acc_g, is_async=True)
                if TWO_B:
                    acc_u = warpgroup_mma(x_s, wu_bufs.index(s).permute((1, 0)), acc_u, is_async=True)
            else:
                acc_g = warpgroup_mma(x_s, wg_bufs.index(s), acc_g, is_async=True)
            acc_g, acc_u = warpgroup_mma_wait(IN_FLIGHT, deps=[acc_g, acc_u])
            if kt > 0:  # the previous step's MMAs have read its stage
                mbarrier.arrive(empty.index((s + STAGES - 1) % STAGES), count=1)
            s, phase = next_stage(s, phase, STAGES)
        if LORA:
            slot = t % 2
            mbarrier.wait(lready.index(slot), (t // 2) & 1)
            z = scaled_z(z_bufs.index(slot).slice(half * HM, HM), lora_scale, z_reg, dtype)
            if LB_KMAJOR:
                acc_g = warpgroup_mma(z, lbg_bufs.index(slot).permute((1, 0)), acc_g, is_async=True)
                if TWO_B:
                    acc_u = warpgroup_mma(z, lbu_bufs.index(slot).permute((1, 0)), acc_u, is_async=True)
            else:
                acc_g = warpgroup_mma(z, lbg_bufs.index(slot), acc_g, is_async=True)
                if TWO_B:
                    acc_u = warpgroup_mma(z, lbu_bufs.index(slot), acc_u, is_async=True)
            acc_g, acc_u = warpgroup_mma_wait(0, deps=[acc_g, acc_u])  # every MMA of the tile has completed
            fence_async_shared()  # z's read through registers, before the loader's next TMA write of the slot
            mbarrier.arrive(lempty.index(slot), count=1)
        else:
            acc_g, acc_u = warpgroup_mma_wait(0, deps=[acc_g, acc_u])
        mbarrier.arrive(empty.index((s + STAGES - 1) % STAGES), count=1)  # the tile's last stage
        if DH:
            s, phase = _dh_epilogue(
                gl.convert_layout(acc_g, ST),
                w,
                pair,
                rows,
                ok,
                col0,
                x_bufs,
                wg_bufs,
                ready,
                empty,
                s,
                phase,
                half,
                a_ptr,
                dh_ptr,
                dw_ptr,
                NA,
                N1,
                N,
                up_offset,
                alpha,
                limit,
                ACT,
                DUAL,
                BN,
                STAGES,
            )
        else:
            cols = col0 + gl.arange(0, BN, gl.SliceLayout(0, ST))
            _up_epilogue(
                gl.convert_layout(acc_g, ST),
                gl.convert_layout(acc_u, ST),
                e,
                rows,
                ok[:, None] & (cols < NA)[None, :],
                cols,
                b_ptr,
                h_ptr,
                a_ptr,
                NA,
                N1,
                stride_be,
                stride_bn,
                up_offset,
                alpha,
                limit,
                ACT,
                DUAL,
                HAS_BIAS,
                STORE_H,
            )


@gluon.jit
def _up_epilogue(
    g,
    u,
    e,
    rows,
    mask,
    cols,
    b_ptr,
    h_ptr,
    a_ptr,
    NA,
    N1,
    stride_be,
    stride_bn,
    up_offset,
    alpha,
    limit,
    ACT: gl.constexpr,
    DUAL: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    STORE_H: gl.constexpr,
):
    """Bias, rounding to the stored dtype (backward recomputes the activation from the stored ``h``), ``h``
    and ``a = act(h)`` stored by sorted row (``g``, ``u``: the gate and up tiles in the store layout)."""
    if HAS_BIAS:
        b_row = b_ptr + e.to(gl.int64) * stride_be
        g = g + gl.load(b_row + cols * stride_bn, mask=cols < NA, other=0.0).to(gl.float32)[None, :]
        if DUAL:
            u = u + gl.load(b_row + (cols + up_offset) * stride_bn, mask=cols < NA, other=0.0).to(gl.float32)[None, :]
    g = g.to(a_ptr.dtype.element_ty).to(gl.float32)
    u = u.to(a_ptr.dtype.element_ty).to(gl.float32)
    if STORE_H:
        h_rows = h_ptr + rows.to(gl.int64)[:, None] * N1
        gl.store(h_rows + cols[None, :], g.to(h_ptr.dtype.element_ty), mask=mask)
        if DUAL:
            gl.store(h_rows + (cols + up_offset)[None, :], u.to(h_ptr.dtype.element_ty), mask=mask)
    a = act_fwd(g, u, alpha, limit, ACT)
    gl.store(a_ptr + rows.to(gl.int64)[:, None] * NA + cols[None, :], a.to(a_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _dh_epilogue(
    acc,
    w,
    pair,
    rows,
    ok,
    col0,
    x_bufs,
    wg_bufs,
    ready,
    empty,
    s,
    phase,
    half,
    aw_ptr,
    dh_ptr,
    dw_ptr,
    NA,
    N1,
    N,
    up_offset,
    alpha,
    limit,
    ACT: gl.constexpr,
    DUAL: gl.constexpr,
    BN: gl.constexpr,
    STAGES: gl.constexpr,
):
    """For ``acc = d_out[token] @ W_down[e]`` over columns ``col0 ... col0 + BN - 1`` (the store layout) and
    the routing weights ``w``: ``d_h`` and ``w act(h)`` stored by sorted row, and these columns' share of
    ``d w = sum_cols acc act(h)`` into row ``col0 / BN`` of the partials ``dw [tiles, N]`` (as
    :func:`.kernels_bwd._dh_epilogue`); ``h`` is read from the ring's next two entries (:func:`_load_h`; this
    consumer's rows ``64 half ...``). In two column halves, as the Triton kernel's: the whole tile's ``acc``,
    ``h`` gate and up and ``act(h)`` at once spilled some 250 registers (sm_90a, Triton 3.6). The halves are
    register bits of the store layout: the split moves no data. Returns the ring's next ``(stage, phase)``."""
    acc0, acc1 = _halves(acc, BN)
    HL: gl.constexpr = acc0.type.layout
    rows = gl.convert_layout(rows, gl.SliceLayout(1, HL))
    ok = gl.convert_layout(ok, gl.SliceLayout(1, HL))
    w = gl.convert_layout(w, gl.SliceLayout(1, HL))
    c = col0 + gl.arange(0, BN // 2, gl.SliceLayout(0, HL))
    d_w, s, phase = _dh_half(
        acc0,
        w,
        rows,
        ok,
        c,
        x_bufs,
        wg_bufs,
        ready,
        empty,
        s,
        phase,
        half,
        aw_ptr,
        dh_ptr,
        NA,
        N1,
        up_offset,
        alpha,
        limit,
        ACT,
        DUAL,
        STAGES,
    )
    d_w1, s, phase = _dh_half(
        acc1,
        w,
        rows,
        ok,
        c + BN // 2,
        x_bufs,
        wg_bufs,
        ready,
        empty,
        s,
        phase,
        half,
        aw_ptr,
        dh_ptr,
        NA,
        N1,
        up_offset,
        alpha,
        limit,
        ACT,
        DUAL,
        STAGES,
    )
    gl.store(dw_ptr + (col0 // BN) * N + gl.convert_layout(pair, gl.SliceLayout(1, HL)), d_w + d_w1, mask=ok)
    return s, phase


@gluon.jit
def _halves(x, BN: gl.constexpr):
    """A ``[64, BN]`` tile as its two column halves (in the store layout and in the MMA layout a thread holds
    columns ``j`` and ``j + BN/2`` alike: register bits, no data moves; also :mod:`.kernels_gluon_wgrad`'s)."""
    return gl.split(gl.permute(gl.reshape(x, [x.shape[0], 2, BN // 2]), [0, 2, 1]))


@gluon.jit
def _dh_half(
    acc,
    w,
    rows,
    ok,
    cols,
    x_bufs,
    wg_bufs,
    ready,
    empty,
    s,
    phase,
    half,
    aw_ptr,
    dh_ptr,
    NA,
    N1,
    up_offset,
    alpha,
    limit,
    ACT: gl.constexpr,
    DUAL: gl.constexpr,
    STAGES: gl.constexpr,
):
    """Column half of :func:`_dh_epilogue` with its ``h`` from ring stage ``s``: stores ``d_h`` and ``w
    act(h)``, releases the stage, returns ``(sum_cols acc act(h), next stage, phase)`` (``h`` from shared
    memory: in registers from before the K loop it spilled 17-38 registers at 128-row tiles, and loaded from
    global memory here its latency was not hidden)."""
    HM: gl.constexpr = acc.shape[0]
    mask = ok[:, None] & (cols < NA)[None, :]
    rows64 = rows.to(gl.int64)
    mbarrier.wait(ready.index(s), phase)
    g = x_bufs.index(s).slice(half * HM, HM).load(acc.type.layout).to(gl.float32)
    u = g
    if DUAL:
        u = _h_up_view(wg_bufs, x_bufs, s).slice(half * HM, HM).load(acc.type.layout).to(gl.float32)
    fence_async_shared()  # the stage's reads, before the loader's next TMA write of it
    mbarrier.arrive(empty.index(s), count=1)
    a, da_dg, da_du = act_grad(g, u, alpha, limit, ACT)
    d_a = acc * w[:, None]
    dh_rows = dh_ptr + rows64[:, None] * N1
    gl.store(dh_rows + cols[None, :], (d_a * da_dg).to(dh_ptr.dtype.element_ty), mask=mask)
    if DUAL:
        gl.store(dh_rows + (cols + up_offset)[None, :], (d_a * da_du).to(dh_ptr.dtype.element_ty), mask=mask)
    gl.store(aw_ptr + rows64[:, None] * NA + cols[None, :], (a * w[:, None]).to(aw_ptr.dtype.element_ty), mask=mask)
    s, phase = next_stage(s, phase, STAGES)
    return gl.sum(gl.where(mask, acc * a, 0.0), axis=1), s, phase


@cached
@gluon.jit
def gathered_kernel(
    x_ptr,
    w_desc,
    z_desc,
    lb_desc,
    h_desc,  # dh: h [N, N1], boxes [BM, BK] (up: a placeholder)
    b_ptr,  # up: [E, N1] bias (read if HAS_BIAS), strides (stride_be, stride_bn)
    h_ptr,  # up: [N, N1] pre-activation rows, sorted, contiguous (written if STORE_H)
    a_ptr,  # [N, NA] sorted, contiguous (out): up a = act(h); dh w * act(h)
    dh_ptr,  # dh: [N, N1] d loss / d h, sorted, contiguous (out)
    tw_ptr,  # dh: [N] routing weight by pair
    dw_ptr,  # dh: [tiles, N] float32, zero-filled: the routing weight's gradient by (column tile, pair) (out)
    sort_order_ptr,  # [N] int64: sorted row -> pair
    offsets_ptr,  # [E + 1] int32: expert_offsets
    table_ptr,  # [2 * M + 1] int32 tile table (ops.Routing.tile_table)
    K,
    NA,
    N1,
    N,
    E,
    M,
    top_k,
    stride_xt,
    stride_be,
    stride_bn,
    up_offset,
    alpha,
    limit,
    lora_scale,
    ACT: gl.constexpr,
    DUAL: gl.constexpr,
    DH: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    STORE_H: gl.constexpr,
    W_KMAJOR: gl.constexpr,
    LB_KMAJOR: gl.constexpr,
    LORA: gl.constexpr,
    BM: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    RP: gl.constexpr,
    STAGES: gl.constexpr,
    LOADER_WARPS: gl.constexpr,
    LOADER_REGS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
):
    """Up (``DH`` false): ``h = x[token] @ W[e].T + b[e] (+ s z Lb_e^T)``, ``a = act(h)``; dh: ``g =
    d_out[token] @ W_down[e] (+ s z Lb_e^T)`` and its epilogue; for every existing tile (see the module
    docstring); one program per SM, tiles ``pid, pid + programs, ...``; launched with 4 warps (the first
    consumer), plus ``LOADER_WARPS`` loader warps and, at ``BM = 128``, a second consumer."""
    CONSUMERS: gl.constexpr = BM // 64
    TWO_B: gl.constexpr = DUAL and not DH  # the up projection's gate and up boxes
    dtype: gl.constexpr = w_desc.dtype
    sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    x_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], sl)
    if W_KMAJOR:
        wg_bufs = gl.allocate_shared_memory(dtype, [STAGES, BN, BK], sl)
    else:
        wg_bufs = gl.allocate_shared_memory(dtype, [STAGES, BK, BN], sl)
    if TWO_B:
        wu_bufs = gl.allocate_shared_memory(dtype, [STAGES, BN, BK], sl)
    else:  # placeholder, never read
        wu_bufs = wg_bufs
    # ready: the TMA's expect + each loader thread's copies; empty: one arrival per consumer
    ready, empty = barrier_ring(STAGES, 1 + 32 * LOADER_WARPS, CONSUMERS)
    if LORA:
        r_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(2 * RP, 128), element_bitwidth=16, rank=2)
        z_bufs = gl.allocate_shared_memory(dtype, [2, BM, RP], r_sl)
        if LB_KMAJOR:
            lbg_bufs = gl.allocate_shared_memory(dtype, [2, BN, RP], r_sl)
        else:
            lbg_bufs = gl.allocate_shared_memory(dtype, [2, RP, BN], sl)
        if TWO_B:
            lbu_bufs = gl.allocate_shared_memory(dtype, lbg_bufs.shape, lbg_bufs.layout)
        else:  # placeholder, never read
            lbu_bufs = lbg_bufs
    else:  # placeholders, never read
        z_bufs = x_bufs
        lbg_bufs = x_bufs
        lbu_bufs = x_bufs
    lready, lempty = barrier_ring(2, 1, CONSUMERS)
    # argument tuples written out in each call (see kernels_gluon.down_kernel: Triton 3.6 passes a constexpr
    # inside a concatenated tuple as a runtime value)
    if CONSUMERS == 2:
        gl.warp_specialize(
            [
                (
                    _consumer,
                    (
                        0,
                        x_bufs,
                        wg_bufs,
                        wu_bufs,
                        z_bufs,
                        lbg_bufs,
                        lbu_bufs,
                        ready,
                        empty,
                        lready,
                        lempty,
                        b_ptr,
                        h_ptr,
                        a_ptr,
                        dh_ptr,
                        tw_ptr,
                        dw_ptr,
                        sort_order_ptr,
                        offsets_ptr,
                        table_ptr,
                        K,
                        NA,
                        N1,
                        N,
                        E,
                        M,
                        stride_be,
                        stride_bn,
                        up_offset,
                        alpha,
                        limit,
                        lora_scale,
                        ACT,
                        DUAL,
                        DH,
                        HAS_BIAS,
                        STORE_H,
                        W_KMAJOR,
                        LB_KMAJOR,
                        LORA,
                        BN,
                        BK,
                        STAGES,
                    ),
                ),
                (
                    _consumer,
                    (
                        1,
                        x_bufs,
                        wg_bufs,
                        wu_bufs,
                        z_bufs,
                        lbg_bufs,
                        lbu_bufs,
                        ready,
                        empty,
                        lready,
                        lempty,
                        b_ptr,
                        h_ptr,
                        a_ptr,
                        dh_ptr,
                        tw_ptr,
                        dw_ptr,
                        sort_order_ptr,
                        offsets_ptr,
                        table_ptr,
                        K,
                        NA,
                        N1,
                        N,
                        E,
                        M,
                        stride_be,
                        stride_bn,
                        up_offset,
                        alpha,
                        limit,
                        lora_scale,
                        ACT,
                        DUAL,
                        DH,
                        HAS_BIAS,
                        STORE_H,
                        W_KMAJOR,
                        LB_KMAJOR,
                        LORA,
                        BN,
                        BK,
                        STAGES,
                    ),
                ),
                (
                    _loader,
                    (
                        x_ptr,
                        w_desc,
                        z_desc,
                        lb_desc,
                        h_desc,
                        x_bufs,
                        wg_bufs,
                        wu_bufs,
                        z_bufs,
                        lbg_bufs,
                        lbu_bufs,
                        ready,
                        empty,
                        lready,
                        lempty,
                        sort_order_ptr,
                        offsets_ptr,
                        table_ptr,
                        K,
                        NA,
                        E,
                        M,
                        top_k,
                        stride_xt,
                        up_offset,
                        DUAL,
                        DH,
                        W_KMAJOR,
                        LB_KMAJOR,
                        LORA,
                        BM,
                        BN,
                        BK,
                        STAGES,
                        LOADER_WARPS,
                    ),
                ),
            ],
            [4, LOADER_WARPS],
            [CONSUMER_REGS, LOADER_REGS],
        )
    else:
        gl.warp_specialize(
            [
                (
                    _consumer,
                    (
                        0,
                        x_bufs,
                        wg_bufs,
                        wu_bufs,
                        z_bufs,
                        lbg_bufs,
                        lbu_bufs,
                        ready,
                        empty,
                        lready,
                        lempty,
                        b_ptr,
                        h_ptr,
                        a_ptr,
                        dh_ptr,
                        tw_ptr,
                        dw_ptr,
                        sort_order_ptr,
                        offsets_ptr,
                        table_ptr,
                        K,
                        NA,
                        N1,
                        N,
                        E,
                        M,
                        stride_be,
                        stride_bn,
                        up_offset,
                        alpha,
                        limit,
                        lora_scale,
                        ACT,
                        DUAL,
                        DH,
                        HAS_BIAS,
                        STORE_H,
                        W_KMAJOR,
                        LB_KMAJOR,
                        LORA,
                        BN,
                        BK,
                        STAGES,
                    ),
                ),
                (
                    _loader,
                    (
                        x_ptr,
                        w_desc,
                        z_desc,
                        lb_desc,
                        h_desc,
                        x_bufs,
                        wg_bufs,
                        wu_bufs,
                        z_bufs,
                        lbg_bufs,
                        lbu_bufs,
                        ready,
                        empty,
                        lready,
                        lempty,
                        sort_order_ptr,
                        offsets_ptr,
                        table_ptr,
                        K,
                        NA,
                        E,
                        M,
                        top_k,
                        stride_xt,
                        up_offset,
                        DUAL,
                        DH,
                        W_KMAJOR,
                        LB_KMAJOR,
                        LORA,
                        BM,
                        BN,
                        BK,
                        STAGES,
                        LOADER_WARPS,
                    ),
                ),
            ],
            [LOADER_WARPS],
            [LOADER_REGS],
        )


BN, BK = 128, 64  # up: gate + up accumulators of [64, 128] float32, 128 registers per consumer thread
STAGES = 4  # up: 48 KiB per stage (rows, gate and up boxes), 196 KiB, the LoRA ring beside it at RP <= 16
DH_STAGES = 6  # dh: 32 KiB per stage (rows, one weight box), at most 6 (the shared-memory budget)
SMEM_BUDGET = 220 * 1024  # the ring and the LoRA ring (sm_90: 227 KiB per block; 4 KiB of layout scratch beside)
LOADER_WARPS = 4  # cp.async of a [128, 64] tile: 8 rows of 16 bytes per thread and stage
LOADER_REGS, CONSUMER_REGS = 56, 224  # 2 * 128 * 224 + 128 * 56 <= 64K registers; no spills (sm_90a, Triton 3.6)
# dh at 128-row tiles: eight loader warps (4 rows of 16 bytes per thread and stage; 2 * 128 * 224 + 256 * 32 = 64K
# registers): its main loop waits on issuing the gathered copies (H200, benchmarks/NOTES.md, round 46: 3-7% faster
# at four anchor shapes in two calls, qwen3.5-35b-a3b 2% either way; the up projection lost 11% there, so it keeps 4)
DH_LOADER_WARPS, DH_LOADER_REGS = 8, 32
MAX_RP = 32
# the activations whose epilogues fit the consumers' registers (compiled for sm_90a with Triton 3.6: GeGLU's erf
# spilled 16 registers in the up projection at 128-row tiles, 4 at 64, clamped SwiGLU's derivative one in dh;
# those stay with the Triton kernels)
ACTS = {
    "up": ("swiglu", "reglu", "clamped_swiglu", "silu", "gelu", "relu", "relu2"),
    "dh": ("swiglu", "reglu", "silu", "gelu", "relu", "relu2"),
}


def stages(block_m: int, rp: int, two_b: bool, most: int) -> int:
    """The ring's stages: as many as ``SMEM_BUDGET`` holds beside the LoRA ring, at most ``most``. A stage
    holds ``[block_m, BK]`` rows and one or (``two_b``) two weight boxes of ``BK x BN``; the LoRA ring two
    slots of ``z [block_m, rp]`` and one or two ``Lb`` boxes of ``rp x BN`` (``rp`` 0: none), 16-bit. So
    the up projection (48 KiB stages at 128-row tiles) keeps 4 stages up to ``rp`` 16 and 3 at 32; dh's
    32 KiB stages 6 (5 at ``rp`` 32)."""
    boxes = 1 + two_b
    stage = 2 * BK * (block_m + boxes * BN)
    lora = 2 * 2 * rp * (block_m + boxes * BN)
    return min(most, (SMEM_BUDGET - lora) // stage)


def gathered_ready(x, pairs: int) -> bool:
    """What a Gluon kernel needs of rows ``x [T, K]`` it gathers by token with ``cp.async`` (also
    :mod:`.kernels_gluon_wgrad`'s): Hopper (sm_90), fewer than ``2**31`` ``pairs`` (pair ids and sorted rows in
    32 bits), 16-bit ``x`` with unit stride along ``K``, ``K`` and the row stride multiples of 16 (so Triton
    knows the copies' 16-byte alignment; at ``K`` = 328 or 40 the copies would be of 2 bytes, which ``cp.async``
    has not) and a 16-byte aligned base. Host metadata only."""
    import torch

    from .schedule import is_sm90

    if not (is_sm90(x.device) and pairs < 2**31):
        return False
    return (
        x.dtype in (torch.bfloat16, torch.float16)
        and x.dim() == 2
        and x.stride(1) == 1
        and x.shape[1] % 16 == 0
        and x.stride(0) % 16 == 0
        and x.data_ptr() % 16 == 0
    )


def rows_ready(x, pairs: int, act: str, gate_step: int, block_m: int, kind: str) -> bool:
    """What both kernels need of the gathered rows ``x [T, K]`` and the layout: :func:`gathered_ready`, row
    tiles of 64 or 128, ``act`` in ``ACTS[kind]`` (``kind`` "up" or "dh"), gate and up not interleaved
    (``gate_step == 1``). Host metadata only."""
    return block_m in (64, 128) and act in ACTS[kind] and gate_step == 1 and gathered_ready(x, pairs)


def lora_ready(x, lb, z, rp: int) -> bool:
    """With a LoRA term (``lb`` not None): ``z [N, R]`` contiguous and ``Lb`` in x's dtype with a unit stride
    along ``R`` or the outputs, readable by TMA descriptors, ``RP <= MAX_RP``. Host metadata only."""
    from .kernels_tma import rows_tma_ready, weight_tma_ready

    if lb is None:
        return True
    lb_ok = weight_tma_ready(lb) if lb.stride(2) == 1 else weight_tma_ready(lb.mT)
    return (
        z.dtype == x.dtype
        and lb.dtype == x.dtype
        and rows_tma_ready(z)
        and z.is_contiguous()
        and lb_ok
        and rp <= MAX_RP
    )


def up_ready(x, w, lb, z, act: str, gate_step: int, gather: bool, rp: int, block_m: int, pairs: int) -> bool:
    """Whether :func:`launch_up` can run: rows gathered by token (``gather``), :func:`rows_ready`,
    :func:`lora_ready`, and ``w [E, N1, H]`` in x's dtype readable by a TMA descriptor with unit stride
    along ``H`` (:func:`.kernels_tma.weight_tma_ready`). Host metadata only."""
    from .kernels_tma import weight_tma_ready

    return (
        gather
        and rows_ready(x, pairs, act, gate_step, block_m, "up")
        and w.dtype == x.dtype
        and weight_tma_ready(w)
        and lora_ready(x, lb, z, rp)
    )


def dh_ready(dout, w, b, h, lb, z, act: str, gate_step: int, rp: int, block_m: int, pairs: int) -> bool:
    """Whether :func:`launch_dh` can run: no down bias (its gradient term is not in this kernel),
    :func:`rows_ready` for ``d_out``, :func:`lora_ready`, ``w [E, H, I]`` in d_out's dtype readable by a
    TMA descriptor with unit stride along ``I`` or ``H``, and ``h [N, N1]`` in d_out's dtype, contiguous and
    readable by a TMA descriptor. Host metadata only."""
    from .kernels_tma import rows_tma_ready, weight_tma_ready

    w_ok = weight_tma_ready(w) or weight_tma_ready(w.mT)
    return (
        b is None
        and rows_ready(dout, pairs, act, gate_step, block_m, "dh")
        and w.dtype == dout.dtype
        and w_ok
        and h.dtype == dout.dtype
        and h.is_contiguous()
        and rows_tma_ready(h)
        and lora_ready(dout, lb, z, rp)
    )


def _lora_descriptors(lb, z, rp: int, block_m: int):
    """``(z descriptor, Lb descriptor, Lb K-major)`` of a split LoRA term."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    N, R = z.shape
    narrow = min(2 * rp, 128)
    z_d = TensorDescriptor(z, [N, R], [R, 1], [block_m, rp], _layout(2, narrow))
    lb_kmajor = lb.stride(2) == 1
    lbt = lb if lb_kmajor else lb.mT
    lb_d = TensorDescriptor(
        lbt,
        list(lbt.shape),
        list(lbt.stride()),
        [1, BN, rp] if lb_kmajor else [1, rp, BN],
        _layout(3, narrow) if lb_kmajor else _layout(3, 128),
    )
    return z_d, lb_d, lb_kmajor


def launch_up(
    x,
    w,
    b,
    sort_order,
    expert_offsets,
    top_k: int,
    act: str,
    alpha: float,
    limit: float,
    up_offset: int,
    h,
    a,
    lb,
    z,
    table,
    lora_scale: float,
    rp: int,
    block_m: int,
    num_sms: int,
) -> None:
    """The up projection over the tile ``table`` (rows of ``block_m``); one program per SM at most. ``h``
    may be None (not stored); ``lb`` and ``z`` None: no LoRA term. :func:`up_ready` must hold."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    E, N1, H = w.shape
    NA = a.shape[1]
    w_d = TensorDescriptor(w, [E, N1, H], list(w.stride()), [1, BN, BK], _layout(3, 128))
    z_d, lb_d, lb_kmajor = _lora_descriptors(lb, z, rp, block_m) if lb is not None else (w_d, w_d, True)
    bb = w if b is None else b
    dual = NA != N1
    _launch(
        x,
        w_d,
        z_d,
        lb_d,
        w_d,
        bb,
        a if h is None else h,
        a,
        a,
        a,
        a,
        sort_order,
        expert_offsets,
        table,
        H,
        NA,
        N1,
        top_k,
        bb.stride(0),
        bb.stride(-1),
        up_offset,
        alpha,
        limit,
        lora_scale,
        num_sms,
        ACT=act,
        DUAL=dual,
        DH=False,
        HAS_BIAS=b is not None,
        STORE_H=h is not None,
        W_KMAJOR=True,
        LB_KMAJOR=lb_kmajor,
        LORA=lb is not None,
        BM=block_m,
        RP=rp,
        STAGES=stages(block_m, rp if lb is not None else 0, dual, STAGES),
        LOADER_WARPS=LOADER_WARPS,
        LOADER_REGS=LOADER_REGS,
    )


def launch_dh(
    dout,
    w,
    h,
    topk_weights,
    sort_order,
    expert_offsets,
    top_k: int,
    act: str,
    alpha: float,
    limit: float,
    up_offset: int,
    dh,
    aw,
    dw,
    lb,
    z,
    table,
    lora_scale: float,
    rp: int,
    block_m: int,
    num_sms: int,
) -> None:
    """The activation gradient over the tile ``table``: ``d_h [N, N1]``, ``aw = w act(h) [N, I]`` and the
    routing weight's gradient partials ``dw [tiles >= cdiv(I, BN), N]`` (zero-filled; row ``c`` for
    column tile ``c``) from ``d_out [T, H]``, ``w = W_down [E, H, I]`` and ``h [N, N1]``; ``lb``, ``z``
    as in :func:`launch_up` (``lb = A_down^T [E, I, R]``). :func:`dh_ready` must hold."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    E, H, I = w.shape
    N1 = h.shape[1]
    w_kmajor = w.stride(1) == 1  # [E, H, I] with unit stride along H: boxes [1, BN, BK] of its [E, I, H] view
    wt = w.mT if w_kmajor else w
    w_d = TensorDescriptor(
        wt, list(wt.shape), list(wt.stride()), [1, BN, BK] if w_kmajor else [1, BK, BN], _layout(3, 128)
    )
    z_d, lb_d, lb_kmajor = _lora_descriptors(lb, z, rp, block_m) if lb is not None else (w_d, w_d, True)
    h_d = TensorDescriptor(h, list(h.shape), [N1, 1], [block_m, BK], _layout(2, 128))
    _launch(
        dout,
        w_d,
        z_d,
        lb_d,
        h_d,
        h,
        h,
        aw,
        dh,
        topk_weights,
        dw,
        sort_order,
        expert_offsets,
        table,
        H,
        I,
        N1,
        top_k,
        0,
        0,
        up_offset,
        alpha,
        limit,
        lora_scale,
        num_sms,
        ACT=act,
        DUAL=N1 != I,
        DH=True,
        HAS_BIAS=False,
        STORE_H=False,
        W_KMAJOR=w_kmajor,
        LB_KMAJOR=lb_kmajor,
        LORA=lb is not None,
        BM=block_m,
        RP=rp,
        STAGES=stages(block_m, rp if lb is not None else 0, False, DH_STAGES),
        LOADER_WARPS=DH_LOADER_WARPS if block_m == 128 else LOADER_WARPS,
        LOADER_REGS=DH_LOADER_REGS if block_m == 128 else LOADER_REGS,
    )


def _launch(
    x,
    w_d,
    z_d,
    lb_d,
    h_d,
    b,
    h,
    a,
    dh,
    tw,
    dw,
    sort_order,
    expert_offsets,
    table,
    K,
    NA,
    N1,
    top_k,
    stride_be,
    stride_bn,
    up_offset,
    alpha,
    limit,
    lora_scale,
    num_sms,
    **meta,
) -> None:
    """:func:`gathered_kernel` over every (row tile of ``table``, column tile of ``NA``), one program per SM at
    most; ``meta``: the constexprs that differ between the up projection and dh."""
    M = table.shape[0] // 2
    grid = (min(M * -(-NA // BN), num_sms),)
    gathered_kernel[grid](
        x,
        w_d,
        z_d,
        lb_d,
        h_d,
        b,
        h,
        a,
        dh,
        tw,
        dw,
        sort_order,
        expert_offsets,
        table,
        K,
        NA,
        N1,
        sort_order.shape[0],
        w_d.shape[0],
        M,
        top_k,
        x.stride(0),
        stride_be,
        stride_bn,
        up_offset,
        alpha,
        limit,
        lora_scale,
        BN=BN,
        BK=BK,
        CONSUMER_REGS=CONSUMER_REGS,
        num_warps=4,
        **meta,
    )
