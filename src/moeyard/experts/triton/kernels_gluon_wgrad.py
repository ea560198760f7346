"""The grouped weight gradient ``dW[e] = alpha * L[rows of e]^T R[rows of e]`` with one operand gathered by
token, written in Gluon for sm_90: the up projection's ``dW_up[e] = d_h^T x[token]`` (``R`` gathered) and the
down projection's ``dW_down[e] = d_out[token]^T (w act(h))`` (``L`` gathered). The weight-gradient counterpart
of :mod:`.kernels_gluon_gather`.

Why: the Triton kernel (:func:`.kernels_bwd.wgrad_kernel`) gathers its rows with pointer loads that every
warp issues between its MMAs: 63% of the dense rate for ``dW_up`` (3.35 ms) and 67% for ``dW_down`` (1.57 ms)
at Qwen3-30B-A3B on an H100 (``benchmarks/NOTES.md``, round 22), the largest kernel of the backward pass.

One persistent program per SM over the output tiles (expert, ``128 MH`` rows of ``NL``, ``BN`` columns of
``NR``), expert-major (an expert's tiles run on neighbouring SMs at once, so its rows are read from HBM about
once). Each tile's reduction runs over its expert's rows in steps of ``BK``:

- a loader partition of ``LOADER_WARPS`` warps, per step: the sorted operand's box(es) through TMA, and the
  gathered operand's rows by token with ``cp.async`` (16 bytes per thread and instruction) into a ring of
  ``STAGES`` stages; a stage's ``ready`` barrier completes once the TMA bytes and each loader thread's
  copies have landed (as in :mod:`.kernels_gluon_gather`). The next step's tokens are loaded one step ahead.
- two consumer warp groups, each on ``64 MH`` of the tile's rows of ``NL`` (``MH`` MMAs of ``[64, BN]`` per
  step): ``acc += L_s^T R_s``, both operands read from shared memory as stored (rows of the step by columns:
  wgmma's transposed 16-bit forms, ``L`` M-major, ``R`` N-major), one step in flight, the previous step's
  stage released; then ``alpha``, rounding to ``dW``'s dtype and the store. A ``dW`` a TMA descriptor can
  take (:func:`.kernels_tma.weight_tma_ready`: 16-bit, unit stride along ``NR``) goes out in blocks of
  ``[64, 128]`` through one shared-memory block per consumer and TMA stores, which run on under the next
  tile's MMAs (a block's store is waited for only before the block is written again; boxes past ``NL`` or
  ``NR`` are clipped by the TMA unit). Any other ``dW`` is stored from registers by row (16-byte vectors
  along ``NR`` when its stride is 1). The blocks take 32 KiB beside the 4 stages (224 of the 227 KiB).
  Measured on an H200 against the stores from registers (``benchmarks/NOTES.md``, round 45), time ratios at
  the five anchor shapes: ``dW_up`` 0.97-1.00x, ``dW_down`` 0.95-1.00x; a first form with 3 stages and a
  block per ``[64, BN]`` was no better.

Tiles are 256 x 128 outputs whichever operand is gathered (``CONFIGS``): the gathered operand is on the
128-wide side, so a step gathers 16 KiB of rows for 48 KiB of stage (``dW_down``: ``MH`` 1, ``BN`` 256;
``dW_up``: ``MH`` 2, ``BN`` 128). Measured on an H100 (``benchmarks/NOTES.md``, round 24), Triton / Gluon ms:
``dW_up`` 3.069 / 2.972 at Qwen3-30B-A3B, 2.330 / 2.021 at Qwen3.5-35B-A3B; ``dW_down`` 1.386 / 1.221, 1.085 /
0.901.

Rows outside the expert are never summed and the sorted operand is never read past the expert's end (rows
there may be unwritten: the expert-parallel layouts leave the rows past the received ones unwritten, and
``0 * NaN`` is NaN): a step whose rows would run past the end reads the window ``[end - BK, end)`` instead,
and the gathered rows of that window already summed by the previous step, or before the expert's start, are
zero-filled, not read (a window starting before row 0 reads zeros from the TMA box). An expert without rows
gets a zero tile. Deterministic: every tile is one program's, summed in row order; no atomics.

Operands (``N`` sorted rows; ``NG`` the gathered operand's width, ``NL`` or ``NR``):
- ``g_ptr``: the gathered rows ``[T, NG]``, unit stride along ``NG``, row stride ``stride_gt``; sorted row ``r``
  reads row ``sorted_token[r]``.
- ``s_desc``: the sorted operand ``[N, NL]`` (``L``; boxes ``[BK, 64]``, ``2 MH`` per step) or ``[N, NR]``
  (``R``, with ``L_GATHER``; boxes ``[BK, BN]``).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ...launch import cached, cdiv
from .kernels_gluon import _tma_load, _tma_store, barrier_ring, next_stage, store_layout
from .kernels_gluon_gather import _cp_async, _halves

HM = gl.constexpr(64)  # rows of NL in one MMA of a consumer warp group
SB = gl.constexpr(128)  # columns of one TMA store block


@gluon.jit
def _tiles(NL, NR, E, BM: gl.constexpr, BN: gl.constexpr):
    """``(program, programs, row tiles, column tiles, this program's tile count)``: tiles ``pid, pid +
    programs, ...`` of ``E * row tiles * column tiles``."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    tiles_m = gl.cdiv(NL, BM)
    tiles_n = gl.cdiv(NR, BN)
    total = E * tiles_m * tiles_n
    return pid, nprog, tiles_m, tiles_n, gl.maximum(gl.cdiv(total - pid, nprog), 0)


@gluon.jit
def _tile_of(t, pid, nprog, tiles_m, tiles_n, offsets_ptr, BM: gl.constexpr, BN: gl.constexpr):
    """The program's ``t``-th tile: ``(expert, first row of NL, first column of NR, expert's first row, end)``."""
    tile = pid + t * nprog
    per_expert = tiles_m * tiles_n
    e = tile // per_expert
    rem = tile % per_expert
    return (e, (rem // tiles_n) * BM, (rem % tiles_n) * BN, gl.load(offsets_ptr + e), gl.load(offsets_ptr + e + 1))


@gluon.jit
def _window(lo, end, BK: gl.constexpr):
    """A step's first row: ``lo``, or ``end - BK`` when the step would run past the expert's end."""
    return gl.minimum(lo, end - BK)


@gluon.jit
def _loader(
    g_ptr,
    s_desc,
    l_bufs,
    r_bufs,
    ready,
    empty,
    token_ptr,
    offsets_ptr,
    NL,
    NR,
    E,
    stride_gt,
    L_GATHER: gl.constexpr,
    MH: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    WARPS: gl.constexpr,
):
    """The loader partition: for every (tile, step), the sorted operand's box(es) by TMA and the gathered
    rows by ``cp.async`` into the next stage once both consumers released it. ``L``'s ``[BK, 128 MH]`` are
    stored as ``2 MH`` blocks of ``[BK, 64]``, one per MMA of a consumer."""
    LB: gl.constexpr = 2 * MH  # L blocks per stage
    GC: gl.constexpr = HM if L_GATHER else BN  # columns of one gathered copy
    NG = NL if L_GATHER else NR
    ld: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 8], threads_per_warp=[32 * 8 // GC, GC // 8], warps_per_cta=[WARPS, 1], order=[1, 0]
    )
    cs = gl.arange(0, GC, gl.SliceLayout(0, ld))
    steps = gl.arange(0, BK, gl.SliceLayout(1, ld))
    pid, nprog, tiles_m, tiles_n, my_tiles = _tiles(NL, NR, E, LB * HM, BN)
    s = 0
    phase = 0
    for t in range(my_tiles):
        e, m0, n0, start, end = _tile_of(t, pid, nprog, tiles_m, tiles_n, offsets_ptr, LB * HM, BN)
        c0 = m0 if L_GATHER else n0
        rows = _window(start, end, BK) + steps
        ok = (rows >= start) & (rows < end)
        token = gl.load(token_ptr + rows, mask=ok, other=0)
        for lo in range(start, end, BK):
            r0 = _window(lo, end, BK)
            # the next step's tokens, loaded now: their latency hides behind this step
            nxt = _window(lo + BK, end, BK) + steps
            nok = (nxt >= lo + BK) & (nxt < end)
            next_token = gl.load(token_ptr + nxt, mask=nok, other=0)
            mbarrier.wait(empty.index(s), phase ^ 1)
            bar = ready.index(s)
            base = g_ptr + (token.to(gl.int64) * stride_gt)[:, None]
            if L_GATHER:
                mbarrier.expect(bar, s_desc.block_type.nbytes)
                _tma_load(s_desc, [r0, n0], bar, r_bufs.index(s))
                for h in gl.static_range(LB):
                    c = c0 + h * HM + cs
                    _cp_async(l_bufs.index(LB * s + h), base + c[None, :], mask=ok[:, None] & (c < NG)[None, :])
            else:
                mbarrier.expect(bar, LB * s_desc.block_type.nbytes)
                for h in gl.static_range(LB):
                    _tma_load(s_desc, [r0, m0 + h * HM], bar, l_bufs.index(LB * s + h))
                c = c0 + cs
                _cp_async(r_bufs.index(s), base + c[None, :], mask=ok[:, None] & (c < NG)[None, :])
            async_copy.mbarrier_arrive(bar, increment_count=False)
            s, phase = next_stage(s, phase, STAGES)
            token = next_token
            ok = nok


@gluon.jit
def _consumer(
    half,
    l_bufs,
    r_bufs,
    ready,
    empty,
    dw_ptr,
    dw_desc,
    c_bufs,
    offsets_ptr,
    NL,
    NR,
    E,
    alpha,
    stride_de,
    stride_dl,
    stride_dr,
    MH: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    TMA_STORE: gl.constexpr,
):
    """A consumer partition (one warp group): rows ``64 MH half ...`` of every tile's ``128 MH`` rows of ``NL``,
    in ``MH`` accumulators of ``[64, BN]``. As in :mod:`.kernels_gluon`, the previous step's stage index is
    recomputed, not carried. With ``TMA_STORE`` the tile goes out through shared memory and TMA stores that
    run on under the next tile's MMAs (waited for only before the buffers are written again; a box past
    ``NL`` or ``NR`` is clipped by the TMA unit), otherwise by row from registers."""
    LB: gl.constexpr = 2 * MH
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    pid, nprog, tiles_m, tiles_n, my_tiles = _tiles(NL, NR, E, LB * HM, BN)
    s = 0
    phase = 0
    for t in range(my_tiles):
        e, m0, n0, start, end = _tile_of(t, pid, nprog, tiles_m, tiles_n, offsets_ptr, LB * HM, BN)
        acc0 = gl.zeros([HM, BN], gl.float32, mma)
        acc1 = gl.zeros([HM, BN], gl.float32, mma)  # MH == 2 only
        n_steps = gl.cdiv(end - start, BK)
        for j in range(n_steps):
            mbarrier.wait(ready.index(s), phase)
            fence_async_shared()  # the cp.async rows (generic proxy) before the MMA's reads (async proxy)
            b = LB * s + MH * half
            acc0 = warpgroup_mma(l_bufs.index(b).permute((1, 0)), r_bufs.index(s), acc0, is_async=True)
            if MH == 2:
                acc1 = warpgroup_mma(l_bufs.index(b + 1).permute((1, 0)), r_bufs.index(s), acc1, is_async=True)
            acc0, acc1 = warpgroup_mma_wait(MH, deps=[acc0, acc1])  # one step's MMAs in flight
            if j > 0:  # the previous step's MMAs have read its stage
                mbarrier.arrive(empty.index((s + STAGES - 1) % STAGES), count=1)
            s, phase = next_stage(s, phase, STAGES)
        acc0, acc1 = warpgroup_mma_wait(0, deps=[acc0, acc1])
        if n_steps > 0:  # the tile's last stage
            mbarrier.arrive(empty.index((s + STAGES - 1) % STAGES), count=1)
        row0 = m0 + half * MH * HM
        if TMA_STORE:
            c_buf = c_bufs.index(half)
            if MH == 2:
                _tma_store_block(acc0 * alpha, c_buf, dw_desc, e, row0, n0)
                _tma_store_block(acc1 * alpha, c_buf, dw_desc, e, row0 + HM, n0)
            else:
                left, right = _halves(acc0 * alpha, BN)
                _tma_store_block(left, c_buf, dw_desc, e, row0, n0)
                _tma_store_block(right, c_buf, dw_desc, e, row0, n0 + BN // 2)
        else:
            _store(acc0, alpha, dw_ptr, e, row0, n0, NL, NR, stride_de, stride_dl, stride_dr, BN)
            if MH == 2:
                _store(acc1, alpha, dw_ptr, e, row0 + HM, n0, NL, NR, stride_de, stride_dl, stride_dr, BN)
    if TMA_STORE:
        tma.store_wait(0)


@gluon.jit
def _tma_store_block(out, c_buf, dw_desc, e, row0, n0):
    """``out [64, 128]`` rounded to ``dW``'s dtype, through the consumer's shared-memory block and a TMA store
    to rows ``row0 ...`` and columns ``n0 ...`` of ``dW[e]`` (clipped at ``NL`` and ``NR`` by the TMA unit). Waits
    first for the block's previous store to have read it."""
    tma.store_wait(0)
    c_buf.store(out.to(dw_desc.dtype))
    fence_async_shared()  # the block's writes (generic proxy) before the TMA's reads (async proxy)
    _tma_store(dw_desc, [e, row0, n0], c_buf)


@gluon.jit
def _store(acc, alpha, dw_ptr, e, row0, n0, NL, NR, stride_de, stride_dl, stride_dr, BN: gl.constexpr):
    """``alpha acc`` rounded to ``dW``'s dtype, stored at rows ``row0 ...`` and columns ``n0 ...`` of ``dW[e]`` (in
    16-byte vectors along a unit-stride ``NR``: :func:`.kernels_gluon.store_layout`)."""
    ST: gl.constexpr = store_layout(HM, BN, 4)
    out = gl.convert_layout((acc * alpha).to(dw_ptr.dtype.element_ty), ST)
    rows = row0 + gl.arange(0, HM, gl.SliceLayout(1, ST))
    cols = n0 + gl.arange(0, BN, gl.SliceLayout(0, ST))
    ptrs = dw_ptr + e.to(gl.int64) * stride_de + (rows.to(gl.int64) * stride_dl)[:, None] + (cols * stride_dr)[None, :]
    gl.store(ptrs, out, mask=(rows < NL)[:, None] & (cols < NR)[None, :])


@cached
@gluon.jit
def wgrad_kernel(
    g_ptr,  # [T, NG] gathered operand (16-bit), unit stride along NG, row stride stride_gt
    s_desc,  # TMA descriptor of the sorted operand [N, NL] (boxes [BK, 64]) or [N, NR] (L_GATHER: [BK, BN])
    token_ptr,  # [N] int32: sorted row -> token (ops.Routing.sorted_token)
    offsets_ptr,  # [E + 1] int32: expert_offsets
    dw_ptr,  # [E, NL, NR] weight gradient, strides (stride_de, stride_dl, stride_dr) (out)
    dw_desc,  # TMA_STORE: its descriptor, boxes [1, 64, BN] (otherwise a placeholder, not used)
    NL,
    NR,
    E,
    stride_gt,
    alpha,
    stride_de,
    stride_dl,
    stride_dr,
    L_GATHER: gl.constexpr,
    MH: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    TMA_STORE: gl.constexpr,
    LOADER_WARPS: gl.constexpr,
    LOADER_REGS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
):
    """``dW[e] = alpha * L[rows of e]^T R[rows of e]`` for every output tile ``[128 MH, BN]`` (module docstring);
    one program per SM, tiles ``pid, pid + programs, ...``; launched with 4 warps (the first consumer), plus the
    second consumer and ``LOADER_WARPS`` loader warps."""
    dtype: gl.constexpr = s_desc.dtype
    sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    l_bufs = gl.allocate_shared_memory(dtype, [2 * MH * STAGES, BK, HM], sl)  # stage s: blocks 2 MH s ...
    r_bufs = gl.allocate_shared_memory(dtype, [STAGES, BK, BN], sl)
    # ready: the TMA's expect + each loader thread's copies; empty: one arrival per consumer
    ready, empty = barrier_ring(STAGES, 1 + 32 * LOADER_WARPS, 2)
    if TMA_STORE:  # each consumer's output block [64, 128] on its way out
        c_bufs = gl.allocate_shared_memory(dw_desc.dtype, [2, HM, SB], sl)
    else:
        c_bufs = r_bufs  # not used
    gl.warp_specialize(
        [
            (
                _consumer,
                (
                    0,
                    l_bufs,
                    r_bufs,
                    ready,
                    empty,
                    dw_ptr,
                    dw_desc,
                    c_bufs,
                    offsets_ptr,
                    NL,
                    NR,
                    E,
                    alpha,
                    stride_de,
                    stride_dl,
                    stride_dr,
                    MH,
                    BN,
                    BK,
                    STAGES,
                    TMA_STORE,
                ),
            ),
            (
                _consumer,
                (
                    1,
                    l_bufs,
                    r_bufs,
                    ready,
                    empty,
                    dw_ptr,
                    dw_desc,
                    c_bufs,
                    offsets_ptr,
                    NL,
                    NR,
                    E,
                    alpha,
                    stride_de,
                    stride_dl,
                    stride_dr,
                    MH,
                    BN,
                    BK,
                    STAGES,
                    TMA_STORE,
                ),
            ),
            (
                _loader,
                (
                    g_ptr,
                    s_desc,
                    l_bufs,
                    r_bufs,
                    ready,
                    empty,
                    token_ptr,
                    offsets_ptr,
                    NL,
                    NR,
                    E,
                    stride_gt,
                    L_GATHER,
                    MH,
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


BK = 64
# L_GATHER: (MH, BN, stages, loader registers). Both tiles have 256 x 128 outputs (128 accumulator registers per
# consumer thread) and 48 KiB stages, with the gathered operand on the tile's 128-wide side: 16 KiB of gathered
# rows per step. (Measured on an H100 at qwen3-30b-a3b, 128 x 128 tiles and 6 stages of 32 KiB: dW_down 1.736
# against 1.214 ms; a 128 x 256 tile gathering 32 KiB of x per step: dW_up 3.639 ms against the Triton kernel's
# 3.079.) The loader holds 8 gathered rows per thread; 64 registers (sm_90a, Triton 3.6: no spills).
CONFIGS = {True: (1, 256, 4, 64), False: (2, 128, 4, 64)}
LOADER_WARPS = 4
CONSUMER_REGS = 224  # 2 * 128 * 224 + 128 * 64 <= 64K registers


def ready(lhs, rhs, lhs_by_token: bool, rhs_by_token: bool, dw, pairs: int) -> bool:
    """Whether :func:`launch` can run: exactly one operand read by token, both in one dtype; the gathered one
    as :func:`.kernels_gluon_gather.gathered_ready` asks (sm_90, 16-bit, widths and row stride multiples of
    16, fewer than ``2**31`` ``pairs``); the sorted operand readable by a TMA descriptor; ``dw`` any float dtype
    and strides. Host metadata only."""
    from .kernels_gluon_gather import gathered_ready
    from .kernels_tma import rows_tma_ready

    if lhs_by_token == rhs_by_token or lhs.dtype != rhs.dtype:
        return False
    g, srt = (lhs, rhs) if lhs_by_token else (rhs, lhs)
    return gathered_ready(g, pairs) and rows_tma_ready(srt) and dw.dtype.is_floating_point


def launch(lhs, rhs, lhs_by_token: bool, sorted_token, expert_offsets, dw, alpha: float, num_sms: int) -> None:
    """``dw [E, NL, NR] = alpha * lhs[rows of e]^T rhs[rows of e]``: ``lhs`` ``[T, NL]`` read by token
    (``lhs_by_token``) and ``rhs [N, NR]`` by sorted row, or ``lhs [N, NL]`` by sorted row and ``rhs [T, NR]``
    by token. One program per SM at most. :func:`ready` must hold."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .kernels_gluon import _layout
    from .kernels_tma import weight_tma_ready

    E, NL, NR = dw.shape
    mh, bn, stages, loader_regs = CONFIGS[lhs_by_token]
    g, srt = (lhs, rhs) if lhs_by_token else (rhs, lhs)
    box = [BK, bn] if lhs_by_token else [BK, HM.value]
    s_d = TensorDescriptor(srt, list(srt.shape), list(srt.stride()), box, _layout(2, 128))
    tma_store = weight_tma_ready(dw)  # 16-bit, unit stride along NR, 16-byte aligned
    dw_d = (
        TensorDescriptor(dw, [E, NL, NR], list(dw.stride()), [1, HM.value, SB.value], _layout(3, 128))
        if tma_store
        else s_d
    )
    grid = (max(min(E * cdiv(NL, 128 * mh) * cdiv(NR, bn), num_sms), 1),)
    wgrad_kernel[grid](
        g,
        s_d,
        sorted_token,
        expert_offsets,
        dw,
        dw_d,
        NL,
        NR,
        E,
        g.stride(0),
        alpha,
        dw.stride(0),
        dw.stride(1),
        dw.stride(2),
        L_GATHER=lhs_by_token,
        MH=mh,
        BN=bn,
        BK=BK,
        STAGES=stages,
        TMA_STORE=tma_store,
        LOADER_WARPS=LOADER_WARPS,
        LOADER_REGS=loader_regs,
        CONSUMER_REGS=CONSUMER_REGS,
        num_warps=4,
    )
