"""The rowwise-scaled e4m3 grouped GEMM of :mod:`.fp8_grouped` written in Gluon for sm_90: the four FP8
GEMMs of the ``fp8_rowwise`` recipes' forward and input gradients. Rows in expert order (the down
projection ``y = act(h) W_down^T``, the up projection's input gradient ``d h W_up``) come through TMA; rows
gathered by token (the up projection ``x[token] W_up^T``, the down projection's input gradient ``d
out[token] W_down``) are copied by ``cp.async``, as Hopper's TMA cannot gather rows.

Why a second kernel: :func:`.fp8_grouped.grouped_kernel` loads both operands with pointer loads that every
warp issues between its MMAs (64% of the dense e4m3 rate at qwen3-30b-a3b, H100, ``benchmarks/NOTES.md``,
round 39). This kernel keeps the schedule of the bf16 Gluon kernels (:mod:`moeyard.experts.triton.kernels_gluon`,
:mod:`~moeyard.experts.triton.kernels_gluon_gather`): one persistent program per SM, warp-specialised
(``gl.warp_specialize``):

- a loader partition issues each (tile, K step)'s weight box ``b_e [BN, BK]`` through TMA and the rows
  ``[BM, BK]`` through TMA (one warp) or gathered (``LOADER_WARPS`` warps, 16 bytes per thread and copy;
  a stage's ``ready`` barrier then also counts one arrival per loader thread) into a ring of ``STAGES``
  stages, each once both consumers released it; both operands K-major, as e4m3 MMAs need;
- two consumer warp groups (rows ``0 .. 63`` and ``64 .. 127`` of each tile) wait for a stage, run its MMA
  with one in flight, release the stage the previous one read; the epilogue multiplies the float32
  accumulator by the rows' and the columns' scales and writes the tile to shared memory, whence a TMA
  store takes it out while the consumer goes on to the next tile's MMAs (a tile that crosses its expert's
  end, or an output TMA cannot take, is stored by row from registers in 16-byte vectors).

``out[r] = (a[src(r)] * scale_a[src(r)]) @ (b[e] * scale_b[e][:, None])^T`` for the rows ``r`` of expert
``e`` (``offsets[e] <= r < offsets[e + 1]``), ``src(r) = index[r]`` (gathered; an index ``>= M`` reads a
zero row) or ``r``; rows past ``offsets[E]`` are not written. A tile's rows past its expert's end belong to
the next expert: computed, not stored. A box past a tensor's end reads zeros, so the K tail and the last
rows need no mask.

With a low-rank term (``LORA``, :class:`.fp8_grouped.LowRankTerm`: LoRA on an FP8 base) each tile also gets
``s z[rows] lb_e^T`` after the scales, as one more MMA in the compute dtype on the float32 accumulator, as
the bf16 kernels add theirs (:mod:`moeyard.experts.triton.kernels_gluon`): the loader brings the tile's
boxes ``z [BM, RP]`` and ``lb_e [BN, RP]`` (or ``[RP, BN]``) through TMA into one slot, after the tile's K
steps (so they arrive while its last MMAs run, and the slot, released by the previous tile's consumers
long before, costs no wait); ``RP`` is the rank padded to 16, 32 or 64 (zeros past the rank).
"""

import functools

import torch
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

from ..experts.triton.kernels_gluon import (
    LOADER_REGS,
    _layout as _layout16,
    _my_tiles,
    _store_tile,
    _tile_of,
    _tma_load,
    _tma_store,
    barrier_ring,
    next_stage,
    scaled_z,
    store_layout,
)
from ..experts.triton.kernels_gluon_gather import LOADER_REGS as GATHER_LOADER_REGS, LOADER_WARPS, _cp_async
from ..launch import cached, cdiv

Tensor = torch.Tensor

BM, BN, BK = 128, 256, 128  # a stage: (128 + 256) x 128 bytes = 48 KiB
STAGES = 3  # 144 KiB, and 64 KiB for the two consumers' output tiles: 208 of the 227 KiB a Hopper block may hold
# a low-rank term's slot takes (BM + BN) RP 2 bytes more: 12 KiB at RP = 16 (220 KiB in all); at RP = 32 and 64
# (24 and 48 KiB) the output tiles make room for it (stored by row from registers instead)
MAX_RP = 64
SMEM_BUDGET = 232448 - 4096  # bytes: sm_90's 227 KiB a block, less room for the barriers and layout scratch
HM = gl.constexpr(64)  # a consumer warp group's rows of a tile
CONSUMER_REGS = 232  # as the bf16 down projection's (its accumulator is the same [64, 256] float32)
# gathering: LOADER_WARPS loader warps copy the rows (8 of 16 bytes per thread and stage), as the bf16
# gathering kernels' (2 * 128 * 224 + 128 * 56 registers <= 64K)
GATHER_CONSUMER_REGS = 224


@gluon.jit
def _loader(
    a_desc,
    b_desc,
    z_desc,
    lb_desc,
    a_ptr,
    index_ptr,
    a_bufs,
    b_bufs,
    z_bufs,
    lb_bufs,
    ready,
    empty,
    lready,
    lempty,
    offsets_ptr,
    table_ptr,
    MA,
    K,
    N,
    E,
    M,
    stride_am,
    GATHER: gl.constexpr,
    LORA: gl.constexpr,
    LB_KMAJOR: gl.constexpr,
    BM: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    WARPS: gl.constexpr,
):
    """The loader partition: each K step's weight box (TMA) and rows (TMA, or with ``GATHER`` copied from
    their source rows by ``cp.async``, 16 bytes per thread and copy, zero past the expert's end, past ``K``
    and for a source row ``>= MA``) into the next stage once both consumers released it; with ``LORA`` then
    the tile's low-rank boxes into their slot once both consumers released it."""
    ld: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 16], threads_per_warp=[32 * 16 // BK, BK // 16], warps_per_cta=[WARPS, 1], order=[1, 0]
    )
    pid, nprog, n_tiles_n, my_tiles = _my_tiles(table_ptr, M, N, BN)
    k_steps = gl.cdiv(K, BK)
    ks = gl.arange(0, BK, gl.SliceLayout(0, ld))
    s = 0
    phase = 0
    for t in range(my_tiles):
        e, row0, col0 = _tile_of(t, pid, nprog, n_tiles_n, table_ptr, M, BN)
        if GATHER:
            rows = row0 + gl.arange(0, BM, gl.SliceLayout(1, ld))
            src = gl.load(index_ptr + rows, mask=rows < gl.load(offsets_ptr + e + 1), other=MA)
            ok = src < MA
            ptrs = a_ptr + (src.to(gl.int64) * stride_am)[:, None] + ks[None, :]
        for kt in range(k_steps):
            mbarrier.wait(empty.index(s), phase ^ 1)
            bar = ready.index(s)
            if GATHER:
                mbarrier.expect(bar, b_desc.block_type.nbytes)
                _tma_load(b_desc, [e, col0, kt * BK], bar, b_bufs.index(s))
                _cp_async(a_bufs.index(s), ptrs + kt * BK, mask=ok[:, None] & ((ks + kt * BK) < K)[None, :])
                async_copy.mbarrier_arrive(bar, increment_count=False)
            else:
                mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                _tma_load(a_desc, [row0, kt * BK], bar, a_bufs.index(s))
                _tma_load(b_desc, [e, col0, kt * BK], bar, b_bufs.index(s))
            s, phase = next_stage(s, phase, STAGES)
        if LORA:
            mbarrier.wait(lempty.index(0), (t & 1) ^ 1)  # a fresh barrier passes phase 1
            lbar = lready.index(0)
            mbarrier.expect(lbar, z_desc.block_type.nbytes + lb_desc.block_type.nbytes)
            _tma_load(z_desc, [row0, 0], lbar, z_bufs.index(0))
            if LB_KMAJOR:
                _tma_load(lb_desc, [e, col0, 0], lbar, lb_bufs.index(0))
            else:
                _tma_load(lb_desc, [e, 0, col0], lbar, lb_bufs.index(0))


@gluon.jit
def mma_steps(
    acc,
    a_bufs,
    b_bufs,
    ready,
    empty,
    s,
    phase,
    steps,
    half,
    STAGES: gl.constexpr,
    FENCE: gl.constexpr,
    EMPTY: gl.constexpr,
):
    """A consumer's K loop over ``steps`` ring stages from ``(s, phase)``: ``acc += a[64 half ...] b^T`` per stage
    (both K-major, e4m3), one MMA in flight, each stage released once the next MMA is issued (the last after the
    final wait); ``FENCE``: the stage's rows came by ``cp.async`` (generic proxy), fenced before the MMA reads
    them (async proxy); ``EMPTY``: ``steps`` may be 0 (then no stage is released). Returns ``(acc, s, phase)``
    after the loop. Also :mod:`.fp8_gluon_wgrad`'s."""
    for j in range(steps):
        mbarrier.wait(ready.index(s), phase)
        if FENCE:
            fence_async_shared()
        acc = warpgroup_mma(a_bufs.index(s).slice(half * HM, HM), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=[acc])
        if j > 0:  # the previous step's MMA has read its stage
            mbarrier.arrive(empty.index((s + STAGES - 1) % STAGES), count=1)
        s, phase = next_stage(s, phase, STAGES)
    acc = warpgroup_mma_wait(0, deps=[acc])
    if EMPTY:
        if steps > 0:  # the last stage
            mbarrier.arrive(empty.index((s + STAGES - 1) % STAGES), count=1)
    else:
        mbarrier.arrive(empty.index((s + STAGES - 1) % STAGES), count=1)
    return acc, s, phase


@gluon.jit
def _consumer(
    half,
    a_bufs,
    b_bufs,
    z_bufs,
    lb_bufs,
    ready,
    empty,
    lready,
    lempty,
    index_ptr,
    a_scale_ptr,
    b_scale_ptr,
    offsets_ptr,
    out_ptr,
    out_desc,
    c_bufs,
    table_ptr,
    MA,
    K,
    N,
    E,
    M,
    lora_scale,
    GATHER: gl.constexpr,
    TMA_STORE: gl.constexpr,
    LORA: gl.constexpr,
    LB_KMAJOR: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
):
    """A consumer partition (one warp group): rows ``64 half ... 64 half + 63`` of every tile (as
    :func:`moeyard.experts.triton.kernels_gluon._consumer`, with the scales in the epilogue). With
    ``TMA_STORE`` a tile whose 64 rows all belong to its expert goes out through shared memory and a TMA
    store that runs on while the next tile's MMAs do (waited for only before the buffer is written again);
    a tile that crosses its expert's end is stored by row from registers (its rows past the end are the
    next expert's). With ``LORA`` the low-rank product follows the scales, one synchronous MMA in the
    compute dtype on the same float32 accumulator (the two MMA layouts place it alike)."""
    ST: gl.constexpr = store_layout(HM, BN, 4)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
    mma16: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    z_reg: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma16, k_width=2)
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    cols_l: gl.constexpr = gl.SliceLayout(0, mma)
    compact: gl.constexpr = gl.BlockedLayout([BN // 128], [32], [4], [0])
    pid, nprog, n_tiles_n, my_tiles = _my_tiles(table_ptr, M, N, BN)
    k_steps = gl.cdiv(K, BK)
    s = 0
    phase = 0
    for t in range(my_tiles):
        e, row0, col0 = _tile_of(t, pid, nprog, n_tiles_n, table_ptr, M, BN)
        # the rows' end and both scales, read before the K loop hides their latency
        rows = row0 + half * HM + gl.arange(0, HM, rows_l)
        ok = rows < gl.load(offsets_ptr + e + 1)
        if GATHER:
            src = gl.load(index_ptr + rows, mask=ok, other=MA)
            sa = gl.load(a_scale_ptr + src, mask=src < MA, other=0.0)
        else:
            sa = gl.load(a_scale_ptr + rows, mask=ok, other=0.0)
        # the columns' scales held two per thread through the K loop, spread to the MMA layout after it
        cols = col0 + gl.arange(0, BN, compact)
        sb = gl.load(b_scale_ptr + e.to(gl.int64) * N + cols, mask=cols < N, other=0.0)
        acc = gl.zeros([HM, BN], gl.float32, mma)
        acc, s, phase = mma_steps(acc, a_bufs, b_bufs, ready, empty, s, phase, k_steps, half, STAGES, GATHER, False)
        acc = acc * sa[:, None] * gl.convert_layout(sb, cols_l)[None, :]
        if LORA:
            mbarrier.wait(lready.index(0), t & 1)
            z = scaled_z(z_bufs.index(0).slice(half * HM, HM), lora_scale, z_reg, z_bufs.dtype)
            if LB_KMAJOR:
                lb_s = lb_bufs.index(0).permute((1, 0))
            else:
                lb_s = lb_bufs.index(0)
            acc = gl.convert_layout(warpgroup_mma(z, lb_s, gl.convert_layout(acc, mma16)), mma)  # synchronous
            fence_async_shared()  # z's read through registers, before the loader's next TMA write of the slot
            mbarrier.arrive(lempty.index(0), count=1)
        if TMA_STORE:
            c_buf = c_bufs.index(half)
            tma.store_wait(0)  # the previous tile's store has read the buffer
            c_buf.store(acc.to(out_desc.dtype))
            fence_async_shared()
            if row0 + (half + 1) * HM <= gl.load(offsets_ptr + e + 1):
                _tma_store(out_desc, [row0 + half * HM, col0], c_buf)
            else:  # rows past the expert's end are the next expert's: read back, stored by row, masked
                _store_tile(c_buf.load(ST), rows.to(gl.int64), ok, col0, N, out_ptr, BN, ST)
        else:
            _store_tile(acc, rows.to(gl.int64), ok, col0, N, out_ptr, BN, ST)
    if TMA_STORE:
        tma.store_wait(0)


@cached
@gluon.jit
def gluon_grouped_kernel(
    a_desc,  # rows [R, K] e4m3, boxes [BM, BK] (read unless GATHER)
    b_desc,  # b [E, N, K] e4m3 (rows contiguous), boxes [1, BN, BK]
    a_ptr,  # GATHER: the source rows [MA, K] e4m3, unit stride along K, row stride stride_am
    index_ptr,  # GATHER: [R] int64, each output row's source row (>= MA: a zero row)
    a_scale_ptr,  # [R] float32, or GATHER [MA]
    b_scale_ptr,  # [E, N] float32, contiguous
    offsets_ptr,  # [E + 1] int32
    out_ptr,  # [R, N], contiguous
    out_desc,  # TMA_STORE: out, boxes [64, BN]
    table_ptr,  # [2 * M + 1] int32 tile table (moeyard.experts.triton.schedule.fill_tile_table)
    z_desc,  # LORA: z [R, rank], boxes [BM, RP]
    lb_desc,  # LORA: lb [E, N, rank] (LB_KMAJOR, boxes [1, BN, RP]) or its [E, rank, N] (boxes [1, RP, BN])
    MA,
    K,
    N,
    E,
    M,
    stride_am,
    lora_scale,
    GATHER: gl.constexpr,
    TMA_STORE: gl.constexpr,
    LORA: gl.constexpr,
    LB_KMAJOR: gl.constexpr,
    RP: gl.constexpr,
    BM: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    LOADER_WARPS: gl.constexpr,
    LOADER_REGS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
):
    """The module docstring's product for every tile of the table; one program per SM, tiles ``pid, pid +
    programs, ...``; launched with 4 warps (the first consumer), plus the second consumer and the loader
    (one warp, or ``LOADER_WARPS`` with ``GATHER``)."""
    dtype: gl.constexpr = b_desc.dtype
    sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], sl)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BN, BK], sl)
    # ready: the TMA's expect, and with GATHER one arrival per loader thread; empty: one per consumer
    ready, empty = barrier_ring(STAGES, 1 + 32 * LOADER_WARPS * GATHER, 2)
    if TMA_STORE:  # each consumer's output tile on its way out
        c_bufs = gl.allocate_shared_memory(out_desc.dtype, [2, 64, BN], out_desc.layout)
    else:
        c_bufs = a_bufs  # not read
    if LORA:  # one slot of the low-rank boxes (16-bit; as the descriptors' layouts, in two dimensions)
        r_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(2 * RP, 128), element_bitwidth=16, rank=2)
        z_bufs = gl.allocate_shared_memory(z_desc.dtype, [1, BM, RP], r_sl)
        if LB_KMAJOR:
            lb_bufs = gl.allocate_shared_memory(lb_desc.dtype, [1, BN, RP], r_sl)
        else:
            w_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
            lb_bufs = gl.allocate_shared_memory(lb_desc.dtype, [1, RP, BN], w_sl)
    else:  # placeholders, never read
        z_bufs = a_bufs
        lb_bufs = b_bufs
    lready, lempty = barrier_ring(1, 1, 2)  # the TMA's expect; one arrival per consumer
    # the partitions' argument tuples are written out in the call (see kernels_gluon.down_kernel)
    gl.warp_specialize(
        [
            (
                _consumer,
                (
                    0,
                    a_bufs,
                    b_bufs,
                    z_bufs,
                    lb_bufs,
                    ready,
                    empty,
                    lready,
                    lempty,
                    index_ptr,
                    a_scale_ptr,
                    b_scale_ptr,
                    offsets_ptr,
                    out_ptr,
                    out_desc,
                    c_bufs,
                    table_ptr,
                    MA,
                    K,
                    N,
                    E,
                    M,
                    lora_scale,
                    GATHER,
                    TMA_STORE,
                    LORA,
                    LB_KMAJOR,
                    BN,
                    BK,
                    STAGES,
                ),
            ),
            (
                _consumer,
                (
                    1,
                    a_bufs,
                    b_bufs,
                    z_bufs,
                    lb_bufs,
                    ready,
                    empty,
                    lready,
                    lempty,
                    index_ptr,
                    a_scale_ptr,
                    b_scale_ptr,
                    offsets_ptr,
                    out_ptr,
                    out_desc,
                    c_bufs,
                    table_ptr,
                    MA,
                    K,
                    N,
                    E,
                    M,
                    lora_scale,
                    GATHER,
                    TMA_STORE,
                    LORA,
                    LB_KMAJOR,
                    BN,
                    BK,
                    STAGES,
                ),
            ),
            (
                _loader,
                (
                    a_desc,
                    b_desc,
                    z_desc,
                    lb_desc,
                    a_ptr,
                    index_ptr,
                    a_bufs,
                    b_bufs,
                    z_bufs,
                    lb_bufs,
                    ready,
                    empty,
                    lready,
                    lempty,
                    offsets_ptr,
                    table_ptr,
                    MA,
                    K,
                    N,
                    E,
                    M,
                    stride_am,
                    GATHER,
                    LORA,
                    LB_KMAJOR,
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


def ready(a: Tensor, b: Tensor, index: Tensor | None = None, lora=None) -> bool:
    """Whether :func:`launch` can run: Hopper (sm_90), ``a [M, K]`` and ``b [E, N, K]`` e4m3, 16-byte aligned,
    ``K`` a multiple of 16 (TMA strides and 16-byte copies), ``b``'s ``[N, K]`` rows contiguous and its experts
    a multiple of 16 bytes apart (a slice of a wider ``[E, N', K]`` is taken as is); ``a`` contiguous, or with
    ``index`` a unit stride along ``K`` and a row stride that is a multiple of 16; a low-rank term ``lora``
    (:class:`.fp8_grouped.LowRankTerm`, or None) in 16 bits with ``z`` and ``lb`` TMA-readable (the rank a
    multiple of 8) and the rank at most :data:`MAX_RP`. Host metadata only; raises nothing (False for
    anything it cannot serve)."""
    from ..experts.triton.kernels_tma import rows_tma_ready, weight_tma_ready
    from ..experts.triton.schedule import is_sm90, rank_block

    if lora is not None:
        z, lb = lora.z, lora.lb
        lb_ok = weight_tma_ready(lb) if lb.stride(2) == 1 else weight_tma_ready(lb.mT)
        if not (z.dtype in (torch.bfloat16, torch.float16) and rows_tma_ready(z) and lb_ok):
            return False
        if rank_block(z.shape[1]) > MAX_RP:
            return False

    if not (a.is_cuda and is_sm90(a.device)):
        return False
    if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
        return False
    rows_ok = a.is_contiguous() if index is None else (a.stride(1) == 1 and a.stride(0) % 16 == 0)
    b_ok = b.stride(2) == 1 and b.stride(1) == b.shape[2] and b.stride(0) % 16 == 0
    return rows_ok and b_ok and a.shape[1] % 16 == 0 and a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0


def tile_table(offsets: Tensor, rows: int) -> Tensor:
    """The tile table :func:`launch` reads for ``rows`` output rows split by ``offsets [E + 1]`` int32 into
    tiles of ``BM`` rows (:func:`moeyard.experts.triton.schedule.fill_tile_table`: one launch, no host sync)."""
    from ..experts.triton.schedule import fill_tile_table, max_row_tiles

    table = torch.empty(2 * max_row_tiles(rows, offsets.shape[0] - 1, BM) + 1, dtype=torch.int32, device=offsets.device)
    fill_tile_table(offsets, BM, table)
    return table


def launch(
    a: Tensor,
    scale_a: Tensor,
    b: Tensor,
    scale_b: Tensor,
    offsets: Tensor,
    out: Tensor,
    index: Tensor | None = None,
    table: Tensor | None = None,
    lora=None,
) -> None:
    """:func:`gluon_grouped_kernel` into ``out [R, N]``: ``a [M, K]`` e4m3 with ``scale_a [M]`` (rows in order:
    ``R = M``; or read through ``index [R]`` int64, an index ``>= M`` a zero row), ``b [E, N, K]`` e4m3 with
    ``scale_b [E, N]`` (float32, contiguous), ``offsets [E + 1]`` int32, ``table`` :func:`tile_table` of
    these offsets and ``R`` rows (None: made here), ``lora`` a :class:`.fp8_grouped.LowRankTerm` or None.
    :func:`ready` must hold. One launch (two when the table is made here), no host sync. It checks nothing
    itself (its caller, :func:`.fp8_grouped.grouped_mm`, raises TypeError / ValueError for bad operands);
    operands :func:`ready` rejects fail inside Triton's descriptor set-up or launch."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from ..experts.triton.kernels_tma import rows_tma_ready
    from ..experts.triton.ops import num_sms
    from ..experts.triton.schedule import rank_block

    MA, K = a.shape
    E, N, _ = b.shape
    R = out.shape[0]
    table = tile_table(offsets, R) if table is None else table
    M = (table.shape[0] - 1) // 2
    b_d = TensorDescriptor(b, [E, N, K], [b.stride(0), K, 1], [1, BN, BK], _layout(3))
    gather = index is not None
    a_d = b_d if gather else TensorDescriptor(a, [MA, K], [K, 1], [BM, BK], _layout(2))  # placeholder: not read
    rp = rank_block(lora.z.shape[1]) if lora is not None else 0
    smem = STAGES * (BM + BN) * BK + 2 * HM.value * BN * out.element_size() + (BM + BN) * rp * 2
    # the masked store reads rows N apart; with a wide low-rank slot the output tiles give it their room
    tma_store = out.is_contiguous() and rows_tma_ready(out) and smem <= SMEM_BUDGET
    out_d = TensorDescriptor(out, [R, N], [N, 1], [HM.value, BN], _out_layout()) if tma_store else b_d
    z_d, lb_d, lb_kmajor = b_d, b_d, True  # placeholders without a low-rank term: not read
    if lora is not None:
        z, lb = lora.z, lora.lb
        narrow = min(2 * rp, 128)
        z_d = TensorDescriptor(z, list(z.shape), [z.stride(0), 1], [BM, rp], _layout16(2, narrow))
        lb_kmajor = lb.stride(2) == 1
        lbt = lb if lb_kmajor else lb.mT
        box = [1, BN, rp] if lb_kmajor else [1, rp, BN]
        lb_d = TensorDescriptor(
            lbt, list(lbt.shape), list(lbt.stride()), box, _layout16(3, narrow if lb_kmajor else 128)
        )
    grid = (min(M * cdiv(N, BN), num_sms(a.device)),)
    gluon_grouped_kernel[grid](
        a_d,
        b_d,
        a,
        index if gather else offsets,
        scale_a,
        scale_b,
        offsets,
        out,
        out_d,
        table,
        z_d,
        lb_d,
        MA,
        K,
        N,
        E,
        M,
        a.stride(0),
        lora.scale if lora is not None else 0.0,
        GATHER=gather,
        TMA_STORE=tma_store,
        LORA=lora is not None,
        LB_KMAJOR=lb_kmajor,
        RP=max(rp, 16),
        BM=BM,
        BN=BN,
        BK=BK,
        STAGES=STAGES,
        LOADER_WARPS=LOADER_WARPS if gather else 1,
        LOADER_REGS=GATHER_LOADER_REGS if gather else LOADER_REGS,
        CONSUMER_REGS=GATHER_CONSUMER_REGS if gather else CONSUMER_REGS,
        num_warps=4,
    )


@functools.cache
def _layout(rank: int):
    """The NVMMA shared layout of an e4m3 TMA box of ``rank`` dimensions (128-byte rows: BK = 128)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=rank)


@functools.cache
def _out_layout():
    """The NVMMA shared layout of a consumer's output tile ``[64, BN]`` (16-bit, 128-byte swizzle)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
