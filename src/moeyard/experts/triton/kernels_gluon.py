"""The TMA-loaded down projection with its LoRA term, written in Gluon (Triton's tile-level language
with explicit shared memory, barriers and Hopper tensor-core ops), for sm_90.

Why a second kernel: :func:`.kernels_tma.down_tma_kernel` adds the LoRA term ``s z Lb_e^T`` after its
K loop, and Triton's pipeliner does not prefetch operands used only there, so every tile waited on its
``z [BM, R]`` and ``Lb [BN, R]`` loads and the extra MMA in series (0.34 ms of the down projection's
1.72 ms and 0.36 ms of the input gradient's at Qwen3-30B-A3B on an H200, ``benchmarks/NOTES.md``,
round 14). Measured on an H200: down 1.79 -> 1.51 ms, input gradient 2.83 -> 2.78 ms (round 15); with
the in-warp epilogue and 4 stages, in the step, 1.44 and 2.55 ms against the frozen step's 1.37 and 2.32
(round 16); at OLMoE-1B-7B's input gradient (32 K steps) 3.69 -> 3.60 ms. Here
one persistent program per SM runs a software pipeline over all its (tile, K step)
pairs: the TMA loads of ``STAGES - 1`` steps ahead are in flight while the tensor cores work, the
first step of each tile also loads that tile's ``z`` and ``Lb`` boxes (a ring of two), so by the
tile's last step they have long arrived, and the LoRA product is one more MMA on the accumulator.
Same contract and epilogue as the Triton kernel (bias, routing weight, store by pair); the epilogue
moves the accumulator to 16-byte row vectors within each warp (:func:`store_layout`), so 4 stages fit.
Without a LoRA term (``lb`` None) it is a plain persistent down projection, timed against the Triton
kernel in ``benchmarks/lora_kernels.py``.

Operands (``N`` sorted rows, ``KA`` reduction, ``NY`` outputs, ``R`` rank, ``RP`` its padded size):
- ``a_desc``: rows ``[N, KA]``, boxes ``[BM, BK]``.
- ``w_desc``: ``W [E, NY, KA]`` (``W_KMAJOR``, boxes ``[1, BN, BK]``) or ``[E, KA, NY]`` (boxes ``[1, BK, BN]``).
- ``z_desc``: ``z [N, R]``, boxes ``[BM, RP]`` (columns past ``R`` zero-filled).
- ``lb_desc``: ``Lb [E, NY, R]`` (``LB_KMAJOR``, boxes ``[1, BN, RP]``) or ``[E, R, NY]`` (boxes ``[1, RP, BN]``).
A box past a tensor's end reads zeros, so the K tail, the last rows and the rank padding need no mask.
Rows of a tile past its expert's end belong to the next expert: computed, not stored.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait


@gluon.jit
def _tile_of(t, pid, nprog, n_tiles_n, table_ptr, M, BN: gl.constexpr):
    """The program's ``t``-th tile: ``(expert, first row, first column)`` from the tile table."""
    tile = pid + t * nprog
    pid_m = tile // n_tiles_n
    e = gl.load(table_ptr + pid_m)
    row0 = gl.load(table_ptr + M + pid_m)
    return e, row0, (tile % n_tiles_n) * BN


@gluon.jit
def _issue_step(s, k0, slot, e, row0, col0, a_desc, w_desc, z_desc, lb_desc, a_bufs, w_bufs, z_bufs, lb_bufs,
                bars, lbars, pred, W_KMAJOR: gl.constexpr, LB_KMAJOR: gl.constexpr, LORA: gl.constexpr):
    """Issue the TMA loads of one pipeline step (K offset ``k0`` of the tile at ``(e, row0, col0)``)
    into stage ``s``; at a tile's first step (``k0 == 0``) also its LoRA boxes into ring slot ``slot``.
    ``pred``: the step exists."""
    bar = bars.index(s)
    mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(a_desc, [row0, k0], bar, a_bufs.index(s), pred)
    if W_KMAJOR:
        tma.async_copy_global_to_shared(w_desc, [e, col0, k0], bar, w_bufs.index(s), pred)
    else:
        tma.async_copy_global_to_shared(w_desc, [e, k0, col0], bar, w_bufs.index(s), pred)
    if LORA and pred & (k0 == 0):
        lbar = lbars.index(slot)
        mbarrier.expect(lbar, z_desc.block_type.nbytes + lb_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(z_desc, [row0, 0], lbar, z_bufs.index(slot))
        if LB_KMAJOR:
            tma.async_copy_global_to_shared(lb_desc, [e, col0, 0], lbar, lb_bufs.index(slot))
        else:
            tma.async_copy_global_to_shared(lb_desc, [e, 0, col0], lbar, lb_bufs.index(slot))


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
def down_lora_kernel(
    a_desc, w_desc, z_desc, lb_desc,
    b_ptr,            # [E, NY] bias (read if HAS_BIAS), strides (stride_be, stride_bn)
    tw_ptr,           # [N] routing weight by pair (read if HAS_WEIGHT)
    sort_order_ptr,   # [N] int64: sorted row -> pair
    offsets_ptr,      # [E + 1] int32: expert_offsets
    y_ptr,            # [N, NY] output by pair, contiguous (out)
    table_ptr,        # [2 * M + 1] int32 tile table (ops.Routing.tile_table)
    N, KA, NY, E, M, stride_be, stride_bn, lora_scale,
    W_KMAJOR: gl.constexpr, LB_KMAJOR: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_WEIGHT: gl.constexpr,
    LORA: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, RP: gl.constexpr,
    STAGES: gl.constexpr, ST: gl.constexpr, num_warps: gl.constexpr,
):
    """``y[pair] = w[pair] * (a[row] @ W[e].T + b[e] (+ s z[row] @ Lb_e^T with LORA))`` for every
    existing tile (see the module docstring); one program per SM, tiles ``pid, pid + programs, ...``.
    Needs ``cdiv(KA, BK) >= STAGES - 1`` (the LoRA ring holds two tiles)."""
    dtype: gl.constexpr = a_desc.dtype
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BN, 16])
    z_reg: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    cols_l: gl.constexpr = gl.SliceLayout(0, mma)
    a_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    if W_KMAJOR:
        w_bufs = gl.allocate_shared_memory(dtype, [STAGES, BN, BK], a_sl)
    else:
        w_bufs = gl.allocate_shared_memory(dtype, [STAGES, BK, BN], a_sl)
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], a_sl)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    if LORA:
        r_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(2 * RP, 128), element_bitwidth=16, rank=2)
        z_bufs = gl.allocate_shared_memory(dtype, [2, BM, RP], r_sl)
        if LB_KMAJOR:
            lb_bufs = gl.allocate_shared_memory(dtype, [2, BN, RP], r_sl)
        else:
            lb_bufs = gl.allocate_shared_memory(dtype, [2, RP, BN], a_sl)
        lbars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(lbars.index(i), count=1)
    else:  # placeholders, never read
        z_bufs = a_bufs
        lb_bufs = a_bufs
        lbars = bars

    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    n_tiles_n = gl.cdiv(NY, BN)
    total = gl.load(table_ptr + 2 * M) * n_tiles_n
    my_tiles = gl.maximum(gl.cdiv(total - pid, nprog), 0)
    k_steps = gl.cdiv(KA, BK)
    steps = my_tiles * k_steps

    # producer: the tile it loads and the one after (table entries read one tile ahead), its K step,
    # stage and LoRA ring slot; prologue: the first STAGES - 1 steps (all of tile 0: k_steps >= STAGES - 1)
    last_t = gl.maximum(my_tiles - 1, 0)
    pe, prow0, pcol0 = _tile_of(0, pid, nprog, n_tiles_n, table_ptr, M, BN)
    ne, nrow0, ncol0 = _tile_of(gl.minimum(1, last_t), pid, nprog, n_tiles_n, table_ptr, M, BN)
    for q in gl.static_range(STAGES - 1):
        _issue_step(q, q * BK, 0, pe, prow0, pcol0, a_desc, w_desc, z_desc, lb_desc, a_bufs, w_bufs, z_bufs,
                    lb_bufs, bars, lbars, q < steps, W_KMAJOR, LB_KMAJOR, LORA)
    pk = STAGES - 1
    ptile = 0
    ps = STAGES - 1
    pslot = 0

    # consumer: the tile it computes (table entries read one tile ahead), its rows' pairs, end and
    # routing weights read at its first steps, long before the epilogue uses them
    ce, crow0, ccol0 = pe, prow0, pcol0
    nce, ncrow0, nccol0 = ne, nrow0, ncol0
    pair = gl.zeros([BM], gl.int64, rows_l)
    row_end = crow0
    w = gl.zeros([BM], gl.float32, rows_l)
    acc = gl.zeros([BM, BN], gl.float32, mma)
    kt = 0
    t = 0
    cs = 0
    phase = 0
    lslot = 0
    lphase = 0
    for c in range(steps):
        if kt == 0:
            if t > 0:
                ce, crow0, ccol0 = nce, ncrow0, nccol0
                nce, ncrow0, nccol0 = _tile_of(gl.minimum(t + 1, last_t), pid, nprog, n_tiles_n, table_ptr, M, BN)
            rows = crow0 + gl.arange(0, BM, rows_l)
            pair = gl.load(sort_order_ptr + rows, mask=rows < N, other=0)
            row_end = gl.load(offsets_ptr + gl.minimum(ce, E - 1) + 1)
        mbarrier.wait(bars.index(cs), phase)
        a_s = a_bufs.index(cs)
        if W_KMAJOR:
            w_s = w_bufs.index(cs).permute((1, 0))
        else:
            w_s = w_bufs.index(cs)
        acc = warpgroup_mma(a_s, w_s, acc, use_acc=kt > 0, is_async=True)
        acc = warpgroup_mma_wait(1, deps=[acc])
        # the stage the previous MMA read is free: the producer's next step goes there
        if pk == k_steps:  # the producer moves to its next tile
            pk = 0
            ptile += 1
            pslot ^= 1
            pe, prow0, pcol0 = ne, nrow0, ncol0
            ne, nrow0, ncol0 = _tile_of(gl.minimum(ptile + 1, last_t), pid, nprog, n_tiles_n, table_ptr, M, BN)
        _issue_step(ps, pk * BK, pslot, pe, prow0, pcol0, a_desc, w_desc, z_desc, lb_desc, a_bufs, w_bufs, z_bufs,
                    lb_bufs, bars, lbars, c + STAGES - 1 < steps, W_KMAJOR, LB_KMAJOR, LORA)
        pk += 1
        ps += 1
        if ps == STAGES:
            ps = 0
        if HAS_WEIGHT:
            if kt == gl.minimum(1, k_steps - 1):  # the pairs have arrived by the second step
                rows = crow0 + gl.arange(0, BM, rows_l)
                w = gl.load(tw_ptr + pair, mask=rows < row_end, other=0.0).to(gl.float32)
        if kt == k_steps - 1:
            if LORA:
                mbarrier.wait(lbars.index(lslot), lphase)
                z = z_bufs.index(lslot).load(z_reg)
                z = (z.to(gl.float32) * lora_scale).to(dtype)
                if LB_KMAJOR:
                    lb_s = lb_bufs.index(lslot).permute((1, 0))
                else:
                    lb_s = lb_bufs.index(lslot)
                # synchronous (z's registers are free after it); the result stays in acc's registers (the
                # next tile's first MMA ignores them), so no second accumulator is live
                acc = warpgroup_mma(z, lb_s, acc)
                lslot ^= 1
                if lslot == 0:
                    lphase ^= 1
            else:
                acc = warpgroup_mma_wait(0, deps=[acc])
            rows = crow0 + gl.arange(0, BM, rows_l)
            if HAS_BIAS:
                cols = ccol0 + gl.arange(0, BN, cols_l)
                bias = gl.load(b_ptr + ce.to(gl.int64) * stride_be + cols * stride_bn, mask=cols < NY, other=0.0)
                acc = acc + bias.to(gl.float32)[None, :]
            if HAS_WEIGHT:
                acc = acc * w[:, None]
            _store_tile(acc, pair, rows < row_end, ccol0, NY, y_ptr, BN, ST)
        kt += 1
        cs += 1
        if cs == STAGES:
            cs = 0
            phase ^= 1
        if kt == k_steps:
            kt = 0
            t += 1
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    if LORA:
        for i in gl.static_range(2):
            mbarrier.invalidate(lbars.index(i))


BN, BK = 256, 64  # the measured tile (as the Triton kernel's best config)
# pipeline depth: 4 stages of 48 KiB where the LoRA ring fits beside them (RP <= 16: 220 KiB of shared
# memory in all), else 3; the epilogue's layout conversion within warps (store_layout) takes no shared
# memory of its own (through a blocked layout it took 32 KiB: then 3 stages at most; NOTES round 16)
STAGES = 4
# Measured on an H200 (benchmarks/NOTES.md, rounds 15 and 16): against the Triton kernel with its LoRA epilogue
# this kernel saves 0.28 ms at 12 K steps (Qwen3-30B-A3B's down projection), 0.05-0.12 ms at 24 (its input
# gradient) and 0.09 ms at 32 (OLMoE-1B-7B's input gradient); at 224 and 448 (Mixtral-8x7B) its main loop
# is the slower (down 11.5 -> 12.7 ms, input gradient 22.7 -> 26.1 ms)
MAX_K_STEPS = 32
MAX_RP = 32  # the LoRA ring, 2 (BM + BN) RP * 2 bytes, is 48 KiB at RP = 32: 3 stages, 200 KiB in all


def stages(rp: int) -> int:
    """The pipeline's stages at padded rank ``rp`` (shared memory, see ``STAGES``)."""
    return STAGES if rp <= 16 else min(STAGES, 3)


def ready(rows, w, lb, z, rp: int) -> bool:
    """Whether :func:`launch` can run: Hopper (sm_90), 16-bit rows, ``W`` and LoRA factors
    that suit TMA descriptors (:func:`.kernels_tma.tma_ready`; ``z [N, R]`` and ``Lb`` with a unit
    stride along ``R`` or ``NY``, so ``R`` a multiple of 8), ``RP <= 32`` and from ``stages(RP) - 1`` (the
    pipeline's depth) to ``MAX_K_STEPS`` K steps of 64 (measured: much longer loops run faster in the
    Triton kernel).
    Host metadata only."""
    import torch

    from .kernels_tma import rows_tma_ready, tma_ready, weight_tma_ready
    if not (rows.is_cuda and torch.cuda.get_device_capability(rows.device) == (9, 0)):
        return False
    if rows.dtype not in (torch.bfloat16, torch.float16) or z.dtype != rows.dtype or lb.dtype != rows.dtype:
        return False
    lb_ok = weight_tma_ready(lb) if lb.stride(2) == 1 else weight_tma_ready(lb.mT)
    return (tma_ready(rows, w) and rows_tma_ready(z) and z.is_contiguous() and lb_ok and rp <= MAX_RP
            and stages(rp) - 1 <= -(-rows.shape[1] // BK) <= MAX_K_STEPS)


def launch(rows, w, b, topk_weights, sort_order, expert_offsets, y, lb, z, table, lora_scale: float, rp: int,
           block_m: int, num_sms: int) -> None:
    """:func:`down_lora_kernel` over the tile ``table`` (rows of ``block_m``); one program per SM at
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
        lb_d = TensorDescriptor(lbt, list(lbt.shape), list(lbt.stride()), [1, BN, rp] if lb_kmajor else [1, rp, BN],
                                _layout(3, narrow) if lb_kmajor else wide)
    bb = w if b is None else b
    grid = (min(M * -(-NY // BN), num_sms),)
    warps = 8 if block_m >= 128 else 4
    down_lora_kernel[grid](
        a_d, w_d, z_d, lb_d, bb, rows if topk_weights is None else topk_weights, sort_order, expert_offsets, y,
        table, N, KA, NY, E, M, bb.stride(0), bb.stride(-1), lora_scale,
        W_KMAJOR=w_kmajor, LB_KMAJOR=lb_kmajor, HAS_BIAS=b is not None, HAS_WEIGHT=topk_weights is not None,
        LORA=lb is not None, BM=block_m, BN=BN, BK=BK, RP=rp, STAGES=stages(rp),
        ST=store_layout(block_m, BN, warps),
        num_warps=warps)


def store_layout(bm: int, bn: int, warps: int):
    """The epilogue's store layout for a ``[bm, bn]`` tile of ``warps`` warps (``bm = 16 warps``): each
    thread holds 8 consecutive columns of a row (16-byte stores). It is the MMA accumulator's layout
    (``instr_shape [16, bn]``: a thread holds column pairs ``2 (lane % 4) + 8 j`` of rows ``lane // 4``
    and ``+ 8``) with two lane bits (columns 2, 4) swapped for two register bits (columns 8, 16), so the
    conversion stays within each warp (no block-wide shared-memory buffer)."""
    cols = [[0, 1 << i] for i in range(5, bn.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]] + cols,
                                      lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[16 << i, 0] for i in range(warps.bit_length() - 1)],
                                      block_bases=[], shape=[bm, bn])


def _layout(rank: int, swizzle: int):
    return gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=16, rank=rank)
