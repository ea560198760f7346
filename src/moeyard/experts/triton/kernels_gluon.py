"""The TMA-loaded down projection (forward ``y = a W_down^T`` and input gradient ``dx = d_h W_up``),
with or without its LoRA term, written in Gluon (Triton's tile-level language with explicit shared
memory, barriers, warp specialisation and Hopper tensor-core ops), for sm_90.

Why a second kernel: :func:`.kernels_tma.down_tma_kernel` is software-pipelined by Triton: every warp
issues TMA loads and MMAs in turn, behind four CTA-wide barriers per K step, and its LoRA term ``s z
Lb_e^T`` comes after the K loop, whose operands Triton's pipeliner does not prefetch (0.34 ms of the
down projection's 1.72 ms at Qwen3-30B-A3B on an H200, ``benchmarks/NOTES.md``, round 14). Here one
persistent program per SM is warp-specialised (``gl.warp_specialize``):

- a one-warp loader issues every (tile, K step)'s TMA loads into a ring of ``STAGES`` stages, each
  once every consumer has released it (``empty`` barriers), and each tile's LoRA boxes ``z`` and ``Lb``
  into a ring of two, ahead of that tile's K loop;
- ``BM / 64`` consumer warp groups (rows ``0 .. 63`` and, at ``BM = 128``, ``64 .. 127`` of each tile)
  wait for a stage (``ready``), run its MMA with one MMA in flight, release the stage the previous MMA
  read, add the LoRA product as one more MMA on the accumulator, then the epilogue (bias, routing
  weight, store by pair, moved to 16-byte row vectors within each warp: :func:`store_layout`).

So no consumer waits at a CTA-wide barrier, and the loads run ahead of the MMAs by the whole ring.
Measured on an H200 (``benchmarks/NOTES.md``, round 21; r = 16, ms, this kernel / the former single
partition Gluon kernel / the Triton kernel without LoRA): Qwen3.5-35B-A3B down 1.075 / 1.171 / 1.097,
input gradient 1.931 / 2.090 / 1.895; Qwen3-30B-A3B down 1.43-1.48 / 1.585 / 1.479, input gradient 2.664 /
2.956 / 2.669. Without a LoRA term (``lb`` None) it is a plain persistent down projection: faster than the
Triton kernel at 8-16 K steps (Qwen3.5-35B-A3B 1.021 against 1.097, 1.851 against 1.895 ms), within 5% of it
either way at 24-32 (call to call).

Operands (``N`` sorted rows, ``KA`` reduction, ``NY`` outputs, ``R`` rank, ``RP`` its padded size):
- ``a_desc``: rows ``[N, KA]``, boxes ``[BM, BK]``.
- ``w_desc``: ``W [E, NY, KA]`` (``W_KMAJOR``, boxes ``[1, BN, BK]``) or ``[E, KA, NY]`` (boxes ``[1, BK, BN]``).
- ``z_desc``: ``z [N, R]``, boxes ``[BM, RP]`` (columns past ``R`` zero-filled).
- ``lb_desc``: ``Lb [E, NY, R]`` (``LB_KMAJOR``, boxes ``[1, BN, RP]``) or ``[E, R, NY]`` (boxes ``[1, RP, BN]``).
A box past a tensor's end reads zeros, so the K tail, the last rows and the rank padding need no mask.
Rows of a tile past its expert's end belong to the next expert: computed, not stored.
"""

import functools

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ...launch import cached

# Triton renamed the TMA load after 3.6 (3.6: async_copy_global_to_shared; 3.9: async_load, the old name raises)
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
_tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global  # 3.6 / later


@gluon.jit
def _tile_of(t, pid, nprog, n_tiles_n, table_ptr, M, BN: gl.constexpr):
    """The program's ``t``-th tile: ``(expert, first row, first column)`` from the tile table."""
    tile = pid + t * nprog
    pid_m = tile // n_tiles_n
    e = gl.load(table_ptr + pid_m)
    row0 = gl.load(table_ptr + M + pid_m)
    return e, row0, (tile % n_tiles_n) * BN


@gluon.jit
def next_stage(s, phase, STAGES: gl.constexpr):
    """A ring's next ``(stage, phase)``: the phase flips each time the stage index wraps to 0."""
    s += 1
    if s == STAGES:
        s = 0
        phase ^= 1
    return s, phase


@gluon.jit
def scaled_z(z_s, lora_scale, layout: gl.constexpr, dtype: gl.constexpr):
    """A LoRA ``z`` box from shared memory times the LoRA scale (in float32, rounded to ``dtype``), in the
    MMA's register-operand ``layout``."""
    return (z_s.load(layout).to(gl.float32) * lora_scale).to(dtype)


@gluon.jit
def load_lora(
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
    LB_KMAJOR: gl.constexpr,
    TWO_B: gl.constexpr,
):
    """A loader's LoRA boxes of tile ``t`` (expert ``e``, rows ``row0 ...``, columns ``col0 ...``) into slot
    ``t % 2`` of their ring once both consumers released it: ``z``, ``Lb``'s box (and, ``TWO_B``, its box at
    ``col0 + up_offset``, the up rows of a gated projection)."""
    slot = t % 2
    mbarrier.wait(lempty.index(slot), ((t // 2) & 1) ^ 1)  # a fresh barrier passes phase 1
    lbar = lready.index(slot)
    mbarrier.expect(lbar, z_desc.block_type.nbytes + (1 + TWO_B) * lb_desc.block_type.nbytes)
    _tma_load(z_desc, [row0, 0], lbar, z_bufs.index(slot))
    if LB_KMAJOR:
        _tma_load(lb_desc, [e, col0, 0], lbar, lbg_bufs.index(slot))
        if TWO_B:
            _tma_load(lb_desc, [e, col0 + up_offset, 0], lbar, lbu_bufs.index(slot))
    else:
        _tma_load(lb_desc, [e, 0, col0], lbar, lbg_bufs.index(slot))
        if TWO_B:
            _tma_load(lb_desc, [e, 0, col0 + up_offset], lbar, lbu_bufs.index(slot))


@gluon.jit
def barrier_ring(n: gl.constexpr, ready_count: gl.constexpr, empty_count: gl.constexpr):
    """A ring of ``n`` slots' ``(ready, empty)`` mbarriers (``[n, 1]`` int64 in shared memory), initialised
    to complete after ``ready_count`` and ``empty_count`` arrivals."""
    ready = gl.allocate_shared_memory(gl.int64, [n, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [n, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(n):
        mbarrier.init(ready.index(i), count=ready_count)
        mbarrier.init(empty.index(i), count=empty_count)
    return ready, empty


@gluon.jit
def _store_tile(out, pair, rows_ok, c0, NY, y_ptr, BN: gl.constexpr, st: gl.constexpr):
    """Store the output tile (columns ``c0 ...``) by pair in 16-byte vectors: rounded to the output
    dtype, then moved from the MMA layout to the store layout ``st`` (:func:`store_layout`)."""
    out = gl.convert_layout(out.to(y_ptr.dtype.element_ty), st)
    pair = gl.convert_layout(pair, gl.SliceLayout(1, st))
    ok = gl.convert_layout(rows_ok, gl.SliceLayout(1, st))
    cols = c0 + gl.arange(0, BN, gl.SliceLayout(0, st))
    gl.store(y_ptr + pair[:, None] * NY + cols[None, :], out, mask=ok[:, None] & (cols < NY)[None, :])


@gluon.jit
def _my_tiles(table_ptr, M, NY, BN: gl.constexpr):
    """``(program, programs, column tiles, this program's tile count)``: tiles ``pid, pid + programs, ...``
    of the ``table[2M] * column tiles`` that exist."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    n_tiles_n = gl.cdiv(NY, BN)
    total = gl.load(table_ptr + 2 * M) * n_tiles_n
    return pid, nprog, n_tiles_n, gl.maximum(gl.cdiv(total - pid, nprog), 0)


@gluon.jit
def _loader(
    a_desc,
    w_desc,
    z_desc,
    lb_desc,
    a_bufs,
    w_bufs,
    z_bufs,
    lb_bufs,
    ready,
    empty,
    lready,
    lempty,
    table_ptr,
    KA,
    NY,
    M,
    W_KMAJOR: gl.constexpr,
    LB_KMAJOR: gl.constexpr,
    LORA: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
):
    """The loader partition (one warp): a tile's LoRA boxes into slot ``t % 2`` of their ring once both
    consumers released it, then each K step's boxes into the next stage once both released that."""
    pid, nprog, n_tiles_n, my_tiles = _my_tiles(table_ptr, M, NY, BN)
    k_steps = gl.cdiv(KA, BK)
    s = 0
    phase = 0
    for t in range(my_tiles):
        e, row0, col0 = _tile_of(t, pid, nprog, n_tiles_n, table_ptr, M, BN)
        if LORA:
            load_lora(z_desc, lb_desc, z_bufs, lb_bufs, lb_bufs, lready, lempty, t, e, row0, col0, 0, LB_KMAJOR, False)
        for kt in range(k_steps):
            mbarrier.wait(empty.index(s), phase ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes)
            _tma_load(a_desc, [row0, kt * BK], bar, a_bufs.index(s))
            if W_KMAJOR:
                _tma_load(w_desc, [e, col0, kt * BK], bar, w_bufs.index(s))
            else:
                _tma_load(w_desc, [e, kt * BK, col0], bar, w_bufs.index(s))
            s, phase = next_stage(s, phase, STAGES)


@gluon.jit
def _consumer(
    half,
    a_bufs,
    w_bufs,
    z_bufs,
    lb_bufs,
    ready,
    empty,
    lready,
    lempty,
    b_ptr,
    tw_ptr,
    sort_order_ptr,
    offsets_ptr,
    y_ptr,
    table_ptr,
    N,
    KA,
    NY,
    E,
    M,
    stride_be,
    stride_bn,
    lora_scale,
    W_KMAJOR: gl.constexpr,
    LB_KMAJOR: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    HAS_WEIGHT: gl.constexpr,
    LORA: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
):
    """A consumer partition (one warp group): rows ``64 half ... 64 half + 63`` of every tile. Each K step's MMA
    runs with one in flight; the stage the previous one read goes back to the loader. The stage index
    of the previous step is recomputed, not carried (a variable assigned only from another loop
    variable was not carried by Triton 3.6's loop lowering)."""
    HM: gl.constexpr = 64  # a warp group's MMA rows
    ST: gl.constexpr = store_layout(HM, BN, 4)
    dtype: gl.constexpr = a_bufs.dtype
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    z_reg: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    cols_l: gl.constexpr = gl.SliceLayout(0, mma)
    pid, nprog, n_tiles_n, my_tiles = _my_tiles(table_ptr, M, NY, BN)
    k_steps = gl.cdiv(KA, BK)
    s = 0
    phase = 0
    for t in range(my_tiles):
        e, row0, col0 = _tile_of(t, pid, nprog, n_tiles_n, table_ptr, M, BN)
        # the rows' pairs, end and routing weights, read before the K loop hides their latency
        rows = row0 + half * HM + gl.arange(0, HM, rows_l)
        pair = gl.load(sort_order_ptr + rows, mask=rows < N, other=0)
        ok = rows < gl.load(offsets_ptr + gl.minimum(e, E - 1) + 1)
        if HAS_WEIGHT:
            w = gl.load(tw_ptr + pair, mask=ok, other=0.0).to(gl.float32)
        acc = gl.zeros([HM, BN], gl.float32, mma)
        for kt in range(k_steps):
            mbarrier.wait(ready.index(s), phase)
            if W_KMAJOR:
                w_s = w_bufs.index(s).permute((1, 0))
            else:
                w_s = w_bufs.index(s)
            acc = warpgroup_mma(a_bufs.index(s).slice(half * HM, HM), w_s, acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=[acc])
            if kt > 0:  # the previous step's MMA has read its stage
                mbarrier.arrive(empty.index((s + STAGES - 1) % STAGES), count=1)
            s, phase = next_stage(s, phase, STAGES)
        if LORA:
            slot = t % 2
            mbarrier.wait(lready.index(slot), (t // 2) & 1)
            z = scaled_z(z_bufs.index(slot).slice(half * HM, HM), lora_scale, z_reg, dtype)
            if LB_KMAJOR:
                lb_s = lb_bufs.index(slot).permute((1, 0))
            else:
                lb_s = lb_bufs.index(slot)
            acc = warpgroup_mma(z, lb_s, acc)  # synchronous: every MMA of the tile has completed after it
            fence_async_shared()  # z's read through registers, before the loader's next TMA write of the slot
            mbarrier.arrive(lempty.index(slot), count=1)
        else:
            acc = warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(empty.index((s + STAGES - 1) % STAGES), count=1)  # the tile's last stage
        if HAS_BIAS:
            cols = col0 + gl.arange(0, BN, cols_l)
            bias = gl.load(b_ptr + e.to(gl.int64) * stride_be + cols * stride_bn, mask=cols < NY, other=0.0)
            acc = acc + bias.to(gl.float32)[None, :]
        if HAS_WEIGHT:
            acc = acc * w[:, None]
        _store_tile(acc, pair, ok, col0, NY, y_ptr, BN, ST)


@cached
@gluon.jit
def down_kernel(
    a_desc,
    w_desc,
    z_desc,
    lb_desc,
    b_ptr,  # [E, NY] bias (read if HAS_BIAS), strides (stride_be, stride_bn)
    tw_ptr,  # [N] routing weight by pair (read if HAS_WEIGHT)
    sort_order_ptr,  # [N] int64: sorted row -> pair
    offsets_ptr,  # [E + 1] int32: expert_offsets
    y_ptr,  # [N, NY] output by pair, contiguous (out)
    table_ptr,  # [2 * M + 1] int32 tile table (ops.Routing.tile_table)
    N,
    KA,
    NY,
    E,
    M,
    stride_be,
    stride_bn,
    lora_scale,
    W_KMAJOR: gl.constexpr,
    LB_KMAJOR: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    HAS_WEIGHT: gl.constexpr,
    LORA: gl.constexpr,
    BM: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    RP: gl.constexpr,
    STAGES: gl.constexpr,
    LOADER_REGS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
):
    """``y[pair] = w[pair] * (a[row] @ W[e].T + b[e] (+ s z[row] @ Lb_e^T with LORA))`` for every
    existing tile (see the module docstring); one program per SM, tiles ``pid, pid + programs, ...``;
    launched with 4 warps (the first consumer), plus one loader warp and, at ``BM = 128``, a second
    consumer warp group (``BM / 64`` consumers)."""
    CONSUMERS: gl.constexpr = BM // 64
    dtype: gl.constexpr = a_desc.dtype
    a_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    if W_KMAJOR:
        w_bufs = gl.allocate_shared_memory(dtype, [STAGES, BN, BK], a_sl)
    else:
        w_bufs = gl.allocate_shared_memory(dtype, [STAGES, BK, BN], a_sl)
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], a_sl)
    ready, empty = barrier_ring(STAGES, 1, CONSUMERS)  # the TMA's expect; one arrival per consumer
    if LORA:
        r_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(2 * RP, 128), element_bitwidth=16, rank=2)
        z_bufs = gl.allocate_shared_memory(dtype, [2, BM, RP], r_sl)
        if LB_KMAJOR:
            lb_bufs = gl.allocate_shared_memory(dtype, [2, BN, RP], r_sl)
        else:
            lb_bufs = gl.allocate_shared_memory(dtype, [2, RP, BN], a_sl)
    else:  # placeholders, never read
        z_bufs = a_bufs
        lb_bufs = a_bufs
    lready, lempty = barrier_ring(2, 1, CONSUMERS)
    # the partitions' argument tuples are written out in the call: a constexpr inside a concatenated tuple
    # reaches the partition as a runtime value, and a tuple holding a function cannot be built (Triton 3.6)
    if CONSUMERS == 2:
        gl.warp_specialize(
            [
                (
                    _consumer,
                    (
                        0,
                        a_bufs,
                        w_bufs,
                        z_bufs,
                        lb_bufs,
                        ready,
                        empty,
                        lready,
                        lempty,
                        b_ptr,
                        tw_ptr,
                        sort_order_ptr,
                        offsets_ptr,
                        y_ptr,
                        table_ptr,
                        N,
                        KA,
                        NY,
                        E,
                        M,
                        stride_be,
                        stride_bn,
                        lora_scale,
                        W_KMAJOR,
                        LB_KMAJOR,
                        HAS_BIAS,
                        HAS_WEIGHT,
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
                        a_bufs,
                        w_bufs,
                        z_bufs,
                        lb_bufs,
                        ready,
                        empty,
                        lready,
                        lempty,
                        b_ptr,
                        tw_ptr,
                        sort_order_ptr,
                        offsets_ptr,
                        y_ptr,
                        table_ptr,
                        N,
                        KA,
                        NY,
                        E,
                        M,
                        stride_be,
                        stride_bn,
                        lora_scale,
                        W_KMAJOR,
                        LB_KMAJOR,
                        HAS_BIAS,
                        HAS_WEIGHT,
                        LORA,
                        BN,
                        BK,
                        STAGES,
                    ),
                ),
                (
                    _loader,
                    (
                        a_desc,
                        w_desc,
                        z_desc,
                        lb_desc,
                        a_bufs,
                        w_bufs,
                        z_bufs,
                        lb_bufs,
                        ready,
                        empty,
                        lready,
                        lempty,
                        table_ptr,
                        KA,
                        NY,
                        M,
                        W_KMAJOR,
                        LB_KMAJOR,
                        LORA,
                        BN,
                        BK,
                        STAGES,
                    ),
                ),
            ],
            [4, 1],
            [CONSUMER_REGS, LOADER_REGS],
        )
    else:
        gl.warp_specialize(
            [
                (
                    _consumer,
                    (
                        0,
                        a_bufs,
                        w_bufs,
                        z_bufs,
                        lb_bufs,
                        ready,
                        empty,
                        lready,
                        lempty,
                        b_ptr,
                        tw_ptr,
                        sort_order_ptr,
                        offsets_ptr,
                        y_ptr,
                        table_ptr,
                        N,
                        KA,
                        NY,
                        E,
                        M,
                        stride_be,
                        stride_bn,
                        lora_scale,
                        W_KMAJOR,
                        LB_KMAJOR,
                        HAS_BIAS,
                        HAS_WEIGHT,
                        LORA,
                        BN,
                        BK,
                        STAGES,
                    ),
                ),
                (
                    _loader,
                    (
                        a_desc,
                        w_desc,
                        z_desc,
                        lb_desc,
                        a_bufs,
                        w_bufs,
                        z_bufs,
                        lb_bufs,
                        ready,
                        empty,
                        lready,
                        lempty,
                        table_ptr,
                        KA,
                        NY,
                        M,
                        W_KMAJOR,
                        LB_KMAJOR,
                        LORA,
                        BN,
                        BK,
                        STAGES,
                    ),
                ),
            ],
            [1],
            [LOADER_REGS],
        )


BN, BK = 256, 64  # the measured tile (as the Triton kernel's best config)
# pipeline depth: 4 stages of 48 KiB where the LoRA ring fits beside them (RP <= 16: 220 KiB of shared
# memory in all), else 3; the epilogue's layout conversion within warps (store_layout) takes no shared
# memory of its own (through a blocked layout it took 32 KiB: then 3 stages at most; NOTES round 16)
STAGES = 4
# Registers per thread of the loader and of the second consumer (setmaxnreg); the first consumer gets the
# rest of the 168 x 384 Triton launches the 12 warps with: 504 - 232 - 40 = 232. No spills (Triton 3.6, sm_90a).
LOADER_REGS, CONSUMER_REGS = 40, 232
# At 224 and 448 K steps (Mixtral-8x7B) this kernel gains nothing over the Triton kernel: H200, ms, Triton /
# Gluon without LoRA, down 11.41 / 11.46, input gradient 23.29 / 24.44; with LoRA 11.63 / 11.57, 23.41 / 23.77
# (benchmarks/NOTES.md, round 21); so long reductions stay with the Triton kernel
MAX_K_STEPS = 32
MAX_RP = 32  # the LoRA ring, 2 (BM + BN) RP * 2 bytes, is 48 KiB at RP = 32: 3 stages, 200 KiB in all


def stages(rp: int) -> int:
    """The pipeline's stages at padded rank ``rp`` (shared memory, see ``STAGES``)."""
    return STAGES if rp <= 16 else min(STAGES, 3)


def ready(rows, w, lb, z, rp: int, block_m: int) -> bool:
    """Whether :func:`launch` can run: Hopper (sm_90), row tiles of 64 or 128 (one or two consumer warp
    groups), 16-bit rows and ``W`` that suit TMA descriptors (:func:`.kernels_tma.tma_ready`), at most
    ``MAX_K_STEPS`` K steps of 64 (measured: much longer loops ran faster in the Triton kernel); with a
    LoRA term (``lb`` not None) also ``z [N, R]`` contiguous and ``Lb`` in the rows' dtype with a unit
    stride along ``R`` or ``NY`` (so ``R`` a multiple of 8) and ``RP <= 32``. Host metadata only."""
    import torch

    from .kernels_tma import rows_tma_ready, tma_ready, weight_tma_ready
    from .schedule import is_sm90

    if not (is_sm90(rows.device) and block_m in (64, 128)):
        return False
    if rows.dtype not in (torch.bfloat16, torch.float16) or not tma_ready(rows, w):
        return False
    if not 1 <= -(-rows.shape[1] // BK) <= MAX_K_STEPS:
        return False
    if lb is None:
        return True
    lb_ok = weight_tma_ready(lb) if lb.stride(2) == 1 else weight_tma_ready(lb.mT)
    return (
        z.dtype == rows.dtype
        and lb.dtype == rows.dtype
        and rows_tma_ready(z)
        and z.is_contiguous()
        and lb_ok
        and rp <= MAX_RP
    )


def launch(
    rows,
    w,
    b,
    topk_weights,
    sort_order,
    expert_offsets,
    y,
    lb,
    z,
    table,
    lora_scale: float,
    rp: int,
    block_m: int,
    num_sms: int,
) -> None:
    """:func:`down_kernel` over the tile ``table`` (rows of ``block_m``); one program per SM at
    most. Arguments as ``kernels_tma.down_tma_kernel``'s; :func:`ready` must hold (``lb`` and ``z``
    None: no LoRA term)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    E, NY, KA = w.shape
    N = rows.shape[0]
    M = table.shape[0] // 2
    wide = _layout(3, 128)
    a_d = TensorDescriptor(rows, [N, KA], [KA, 1], [block_m, BK], _layout(2, 128))
    w_kmajor = w.stride(2) == 1
    wt = w if w_kmajor else w.mT
    w_d = TensorDescriptor(wt, list(wt.shape), list(wt.stride()), [1, BN, BK] if w_kmajor else [1, BK, BN], wide)
    z_d, lb_d, lb_kmajor = a_d, w_d, True
    if lb is not None:
        R = z.shape[1]
        narrow = min(2 * rp, 128)
        z_d = TensorDescriptor(z, [N, R], [R, 1], [block_m, rp], _layout(2, narrow))
        lb_kmajor = lb.stride(2) == 1
        lbt = lb if lb_kmajor else lb.mT
        lb_d = TensorDescriptor(
            lbt,
            list(lbt.shape),
            list(lbt.stride()),
            [1, BN, rp] if lb_kmajor else [1, rp, BN],
            _layout(3, narrow) if lb_kmajor else wide,
        )
    bb = w if b is None else b
    grid = (min(M * -(-NY // BN), num_sms),)
    down_kernel[grid](
        a_d,
        w_d,
        z_d,
        lb_d,
        bb,
        rows if topk_weights is None else topk_weights,
        sort_order,
        expert_offsets,
        y,
        table,
        N,
        KA,
        NY,
        E,
        M,
        bb.stride(0),
        bb.stride(-1),
        lora_scale,
        W_KMAJOR=w_kmajor,
        LB_KMAJOR=lb_kmajor,
        HAS_BIAS=b is not None,
        HAS_WEIGHT=topk_weights is not None,
        LORA=lb is not None,
        BM=block_m,
        BN=BN,
        BK=BK,
        RP=rp,
        STAGES=stages(rp if lb is not None else 0),
        LOADER_REGS=LOADER_REGS,
        CONSUMER_REGS=CONSUMER_REGS,
        num_warps=4,
    )


@triton.constexpr_function
def store_layout(bm: int, bn: int, warps: int):
    """The epilogue's store layout for a ``[bm, bn]`` tile of ``warps`` warps (``bm = 16 warps``): each
    thread holds 8 consecutive columns of a row (16-byte stores). It is the MMA accumulator's layout
    (``instr_shape [16, bn]``: a thread holds column pairs ``2 (lane % 4) + 8 j`` of rows ``lane // 4``
    and ``+ 8``) with two lane bits (columns 2, 4) swapped for two register bits (columns 8, 16), so the
    conversion stays within each warp (no block-wide shared-memory buffer)."""
    cols = [[0, 1 << i] for i in range(5, bn.bit_length() - 1)]
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]] + cols,
        lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16 << i, 0] for i in range(warps.bit_length() - 1)],
        block_bases=[],
        shape=[bm, bn],
    )


@functools.cache
def _layout(rank: int, swizzle: int):
    """The NVMMA shared layout of a 16-bit TMA box of ``rank`` dimensions, built once per (rank, swizzle): a
    launch makes up to five descriptors, and building the (immutable) layout anew for each cost host time."""
    return gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=16, rank=rank)
