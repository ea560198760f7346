"""The up projection ``h = x[token] W_up^T``, ``a = act(h)``, with or without its LoRA term, written in
Gluon for sm_90: the gathered counterpart of :mod:`.kernels_gluon`'s down projection.

Why: the Triton kernel (:func:`.kernels_fwd.up_kernel`) gathers its ``x`` rows by token with pointer
loads that every warp issues between its MMAs, behind CTA-wide barriers, and reached 55-67% of the dense
rate where the TMA-loaded down projection reached 65-79% (H100, ``benchmarks/NOTES.md``, round 13). A
Hopper TMA box cannot gather rows, but ``cp.async`` can. Here one persistent program per SM is
warp-specialised (``gl.warp_specialize``):

- a loader partition of ``LOADER_WARPS`` warps, for every (tile, K step): the gate (and up) boxes of
  the expert's weight through TMA, and the tile's ``x`` rows gathered by token with ``cp.async`` (16 bytes
  per thread and instruction; rows past their expert's end and columns past ``H`` zero-filled, not read),
  into a ring of ``STAGES`` stages. A stage's ``ready`` barrier completes once the TMA bytes have landed
  and each loader thread's copies have (``cp.async.mbarrier.arrive.noinc``: one arrival per thread);
  each tile's LoRA boxes ``z`` and ``Lb`` (gate, up) go into a ring of two ahead of its K loop;
- ``BM / 64`` consumer warp groups, each on 64 rows of every tile: wait for a stage, make the copies
  visible to the tensor cores (``fence.proxy.async``), run the gate and up MMAs with one K step in
  flight, release the stage the previous step read, then the LoRA MMAs and the epilogue (bias, the
  rounding backward relies on, ``h`` and ``a = act(h)`` stored by sorted row in 16-byte vectors).

Operands (``N`` sorted rows, ``H`` reduction, ``NA`` output columns, ``N1 = 2 NA`` gated or ``NA``):
- ``x_ptr``: ``x [T, H]``, unit stride along ``H``, row stride ``stride_xt``; row ``r`` reads token
  ``sort_order[r] // top_k``.
- ``w_desc``: ``W [E, N1, H]`` (unit stride along ``H``), boxes ``[1, BN, BK]``; the gate rows of output
  column ``j`` at ``j``, the up rows at ``j + up_offset``. Boxes past ``N1`` or ``H`` read zeros.
- ``z_desc``: ``z [N, R]``, boxes ``[BM, RP]``; ``lb_desc``: ``Lb [E, N1, R]`` (``LB_KMAJOR``, boxes
  ``[1, BN, RP]``) or ``[E, R, N1]`` (boxes ``[1, RP, BN]``).
Rows of a tile past its expert's end are computed on zeros and not stored.
"""
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma, \
    warpgroup_mma_wait

from .act import act_fwd
from .kernels_gluon import _layout, _my_tiles, _tile_of, _tma_load, store_layout

# Triton renamed cp.async's copy after 3.6 (3.6: async_copy_global_to_shared; 3.9: async_load, the old name raises)
_cp_async = async_copy.async_load if hasattr(async_copy, "async_load") else async_copy.async_copy_global_to_shared


@gluon.jit
def _loader(x_ptr, w_desc, z_desc, lb_desc, x_bufs, wg_bufs, wu_bufs, z_bufs, lbg_bufs, lbu_bufs, ready, empty,
            lready, lempty, sort_order_ptr, offsets_ptr, table_ptr, H, NA, E, M, top_k, stride_xt, up_offset,
            DUAL: gl.constexpr, LB_KMAJOR: gl.constexpr, LORA: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
            BK: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr):
    """The loader partition: per tile, its LoRA boxes into slot ``t % 2`` once both consumers released it,
    the rows' tokens, then each K step's weight boxes (TMA) and ``x`` rows (``cp.async``) into the next
    stage once both consumers released that."""
    ld: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 * 8 // BK, BK // 8],
                                        warps_per_cta=[WARPS, 1], order=[1, 0])
    pid, nprog, n_tiles_n, my_tiles = _my_tiles(table_ptr, M, NA, BN)
    k_steps = gl.cdiv(H, BK)
    ks = gl.arange(0, BK, gl.SliceLayout(0, ld))
    s = 0
    phase = 0
    for t in range(my_tiles):
        e, row0, col0 = _tile_of(t, pid, nprog, n_tiles_n, table_ptr, M, BN)
        if LORA:
            slot = t % 2
            mbarrier.wait(lempty.index(slot), ((t // 2) & 1) ^ 1)  # a fresh barrier passes phase 1
            lbar = lready.index(slot)
            mbarrier.expect(lbar, z_desc.block_type.nbytes + (1 + DUAL) * lb_desc.block_type.nbytes)
            _tma_load(z_desc, [row0, 0], lbar, z_bufs.index(slot))
            if LB_KMAJOR:
                _tma_load(lb_desc, [e, col0, 0], lbar, lbg_bufs.index(slot))
                if DUAL:
                    _tma_load(lb_desc, [e, col0 + up_offset, 0], lbar, lbu_bufs.index(slot))
            else:
                _tma_load(lb_desc, [e, 0, col0], lbar, lbg_bufs.index(slot))
                if DUAL:
                    _tma_load(lb_desc, [e, 0, col0 + up_offset], lbar, lbu_bufs.index(slot))
        rows = row0 + gl.arange(0, BM, gl.SliceLayout(1, ld))
        ok = rows < gl.load(offsets_ptr + gl.minimum(e, E - 1) + 1)
        pair = gl.load(sort_order_ptr + rows, mask=ok, other=0)
        ptrs = x_ptr + (pair // top_k * stride_xt)[:, None] + ks[None, :]
        for kt in range(k_steps):
            mbarrier.wait(empty.index(s), phase ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, (1 + DUAL) * w_desc.block_type.nbytes)
            _tma_load(w_desc, [e, col0, kt * BK], bar, wg_bufs.index(s))
            if DUAL:
                _tma_load(w_desc, [e, col0 + up_offset, kt * BK], bar, wu_bufs.index(s))
            _cp_async(x_bufs.index(s), ptrs + kt * BK, mask=ok[:, None] & ((ks + kt * BK) < H)[None, :])
            async_copy.mbarrier_arrive(bar, increment_count=False)
            s += 1
            if s == STAGES:
                s = 0
                phase ^= 1


@gluon.jit
def _consumer(half, x_bufs, wg_bufs, wu_bufs, z_bufs, lbg_bufs, lbu_bufs, ready, empty, lready, lempty, b_ptr,
              offsets_ptr, h_ptr, a_ptr, table_ptr, H, NA, N1, E, M, stride_be, stride_bn, up_offset, alpha, limit,
              lora_scale, ACT: gl.constexpr, DUAL: gl.constexpr, HAS_BIAS: gl.constexpr, STORE_H: gl.constexpr,
              LB_KMAJOR: gl.constexpr, LORA: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
              STAGES: gl.constexpr):
    """A consumer partition (one warp group): rows ``64 half ... 64 half + 63`` of every tile (see the
    module docstring). As in :mod:`.kernels_gluon`, the previous step's stage index is recomputed, not
    carried."""
    HM: gl.constexpr = 64  # a warp group's MMA rows
    ST: gl.constexpr = store_layout(HM, BN, 4)
    dtype: gl.constexpr = x_bufs.dtype
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    z_reg: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    pid, nprog, n_tiles_n, my_tiles = _my_tiles(table_ptr, M, NA, BN)
    k_steps = gl.cdiv(H, BK)
    IN_FLIGHT: gl.constexpr = 1 + DUAL  # one K step's MMAs
    s = 0
    phase = 0
    for t in range(my_tiles):
        e, row0, col0 = _tile_of(t, pid, nprog, n_tiles_n, table_ptr, M, BN)
        rows = row0 + half * HM + gl.arange(0, HM, gl.SliceLayout(1, ST))
        ok = rows < gl.load(offsets_ptr + gl.minimum(e, E - 1) + 1)
        acc_g = gl.zeros([HM, BN], gl.float32, mma)
        acc_u = gl.zeros([HM, BN], gl.float32, mma)
        for kt in range(k_steps):
            mbarrier.wait(ready.index(s), phase)
            fence_async_shared()  # the cp.async rows (generic proxy) before the MMA's reads (async proxy)
            x_s = x_bufs.index(s).slice(half * HM, HM)
            acc_g = warpgroup_mma(x_s, wg_bufs.index(s).permute((1, 0)), acc_g, is_async=True)
            if DUAL:
                acc_u = warpgroup_mma(x_s, wu_bufs.index(s).permute((1, 0)), acc_u, is_async=True)
            acc_g, acc_u = warpgroup_mma_wait(IN_FLIGHT, deps=[acc_g, acc_u])
            if kt > 0:  # the previous step's MMAs have read its stage
                mbarrier.arrive(empty.index((s + STAGES - 1) % STAGES), count=1)
            s += 1
            if s == STAGES:
                s = 0
                phase ^= 1
        if LORA:
            slot = t % 2
            mbarrier.wait(lready.index(slot), (t // 2) & 1)
            z = z_bufs.index(slot).slice(half * HM, HM).load(z_reg)
            z = (z.to(gl.float32) * lora_scale).to(dtype)
            if LB_KMAJOR:
                acc_g = warpgroup_mma(z, lbg_bufs.index(slot).permute((1, 0)), acc_g, is_async=True)
                if DUAL:
                    acc_u = warpgroup_mma(z, lbu_bufs.index(slot).permute((1, 0)), acc_u, is_async=True)
            else:
                acc_g = warpgroup_mma(z, lbg_bufs.index(slot), acc_g, is_async=True)
                if DUAL:
                    acc_u = warpgroup_mma(z, lbu_bufs.index(slot), acc_u, is_async=True)
            acc_g, acc_u = warpgroup_mma_wait(0, deps=[acc_g, acc_u])  # every MMA of the tile has completed
            fence_async_shared()  # z's read through registers, before the loader's next TMA write of the slot
            mbarrier.arrive(lempty.index(slot), count=1)
        else:
            acc_g, acc_u = warpgroup_mma_wait(0, deps=[acc_g, acc_u])
        mbarrier.arrive(empty.index((s + STAGES - 1) % STAGES), count=1)  # the tile's last stage
        _epilogue(acc_g, acc_u, e, rows, ok, col0, b_ptr, h_ptr, a_ptr, NA, N1, stride_be, stride_bn, up_offset,
                  alpha, limit, ACT, DUAL, HAS_BIAS, STORE_H, BN, ST)


@gluon.jit
def _epilogue(acc_g, acc_u, e, rows, ok, col0, b_ptr, h_ptr, a_ptr, NA, N1, stride_be, stride_bn, up_offset, alpha,
              limit, ACT: gl.constexpr, DUAL: gl.constexpr, HAS_BIAS: gl.constexpr, STORE_H: gl.constexpr,
              BN: gl.constexpr, ST: gl.constexpr):
    """Bias, rounding to the stored dtype (backward recomputes the activation from the stored ``h``), ``h``
    and ``a = act(h)`` stored by sorted row in the store layout ``ST`` (16-byte vectors)."""
    cols = col0 + gl.arange(0, BN, gl.SliceLayout(0, ST))
    mask = ok[:, None] & (cols < NA)[None, :]
    g = gl.convert_layout(acc_g, ST)
    u = gl.convert_layout(acc_u, ST)
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
def up_kernel(
    x_ptr, w_desc, z_desc, lb_desc,
    b_ptr,            # [E, N1] bias (read if HAS_BIAS), strides (stride_be, stride_bn)
    sort_order_ptr,   # [N] int64: sorted row -> pair
    offsets_ptr,      # [E + 1] int32: expert_offsets
    h_ptr,            # [N, N1] pre-activation rows, sorted, contiguous (written if STORE_H)
    a_ptr,            # [N, NA] activation rows, sorted, contiguous (out)
    table_ptr,        # [2 * M + 1] int32 tile table (ops.Routing.tile_table)
    H, NA, N1, E, M, top_k, stride_xt, stride_be, stride_bn, up_offset, alpha, limit, lora_scale,
    ACT: gl.constexpr, DUAL: gl.constexpr, HAS_BIAS: gl.constexpr, STORE_H: gl.constexpr, LB_KMAJOR: gl.constexpr,
    LORA: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, RP: gl.constexpr,
    STAGES: gl.constexpr, LOADER_WARPS: gl.constexpr, LOADER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
):
    """``h = x[token] @ W[e].T + b[e] (+ s z Lb_e^T with LORA)``, ``a = act(h)`` for every existing tile (see
    the module docstring); one program per SM, tiles ``pid, pid + programs, ...``; launched with 4 warps
    (the first consumer), plus ``LOADER_WARPS`` loader warps and, at ``BM = 128``, a second consumer."""
    CONSUMERS: gl.constexpr = BM // 64
    dtype: gl.constexpr = w_desc.dtype
    sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    x_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], sl)
    wg_bufs = gl.allocate_shared_memory(dtype, [STAGES, BN, BK], sl)
    if DUAL:
        wu_bufs = gl.allocate_shared_memory(dtype, [STAGES, BN, BK], sl)
    else:  # placeholder, never read
        wu_bufs = wg_bufs
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1 + 32 * LOADER_WARPS)  # the TMA's expect + each loader thread's copies
        mbarrier.init(empty.index(i), count=CONSUMERS)  # one arrival per consumer
    if LORA:
        r_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(2 * RP, 128), element_bitwidth=16, rank=2)
        z_bufs = gl.allocate_shared_memory(dtype, [2, BM, RP], r_sl)
        if LB_KMAJOR:
            lbg_bufs = gl.allocate_shared_memory(dtype, [2, BN, RP], r_sl)
            lbu_bufs = gl.allocate_shared_memory(dtype, [2, BN, RP], r_sl)
        else:
            lbg_bufs = gl.allocate_shared_memory(dtype, [2, RP, BN], sl)
            lbu_bufs = gl.allocate_shared_memory(dtype, [2, RP, BN], sl)
    else:  # placeholders, never read
        z_bufs = x_bufs
        lbg_bufs = x_bufs
        lbu_bufs = x_bufs
    lready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    lempty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(lready.index(i), count=1)
        mbarrier.init(lempty.index(i), count=CONSUMERS)
    # argument tuples written out in each call (see kernels_gluon.down_kernel: Triton 3.6 passes a constexpr
    # inside a concatenated tuple as a runtime value)
    if CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (0, x_bufs, wg_bufs, wu_bufs, z_bufs, lbg_bufs, lbu_bufs, ready, empty, lready, lempty,
                         b_ptr, offsets_ptr, h_ptr, a_ptr, table_ptr, H, NA, N1, E, M, stride_be, stride_bn,
                         up_offset, alpha, limit, lora_scale, ACT, DUAL, HAS_BIAS, STORE_H, LB_KMAJOR, LORA, BN, BK,
                         STAGES)),
            (_consumer, (1, x_bufs, wg_bufs, wu_bufs, z_bufs, lbg_bufs, lbu_bufs, ready, empty, lready, lempty,
                         b_ptr, offsets_ptr, h_ptr, a_ptr, table_ptr, H, NA, N1, E, M, stride_be, stride_bn,
                         up_offset, alpha, limit, lora_scale, ACT, DUAL, HAS_BIAS, STORE_H, LB_KMAJOR, LORA, BN, BK,
                         STAGES)),
            (_loader, (x_ptr, w_desc, z_desc, lb_desc, x_bufs, wg_bufs, wu_bufs, z_bufs, lbg_bufs, lbu_bufs, ready,
                       empty, lready, lempty, sort_order_ptr, offsets_ptr, table_ptr, H, NA, E, M, top_k, stride_xt,
                       up_offset, DUAL, LB_KMAJOR, LORA, BM, BN, BK, STAGES, LOADER_WARPS)),
        ], [4, LOADER_WARPS], [CONSUMER_REGS, LOADER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (0, x_bufs, wg_bufs, wu_bufs, z_bufs, lbg_bufs, lbu_bufs, ready, empty, lready, lempty,
                         b_ptr, offsets_ptr, h_ptr, a_ptr, table_ptr, H, NA, N1, E, M, stride_be, stride_bn,
                         up_offset, alpha, limit, lora_scale, ACT, DUAL, HAS_BIAS, STORE_H, LB_KMAJOR, LORA, BN, BK,
                         STAGES)),
            (_loader, (x_ptr, w_desc, z_desc, lb_desc, x_bufs, wg_bufs, wu_bufs, z_bufs, lbg_bufs, lbu_bufs, ready,
                       empty, lready, lempty, sort_order_ptr, offsets_ptr, table_ptr, H, NA, E, M, top_k, stride_xt,
                       up_offset, DUAL, LB_KMAJOR, LORA, BM, BN, BK, STAGES, LOADER_WARPS)),
        ], [LOADER_WARPS], [LOADER_REGS])


BN, BK = 128, 64  # gate + up accumulators of [64, 128] float32: 128 registers per consumer thread
STAGES = 4  # 48 KiB per stage (x rows, gate and up boxes): 192 KiB, the LoRA ring beside it at RP <= 16
LOADER_WARPS = 4  # cp.async of a [128, 64] tile: 8 rows of 16 bytes per thread and stage
LOADER_REGS, CONSUMER_REGS = 56, 224  # 2 * 128 * 224 + 128 * 56 <= 64K registers; no spills (sm_90a, Triton 3.6)
MAX_RP = 32
# the activations whose epilogue fits the consumers' registers (compiled for sm_90a with Triton 3.6: GeGLU's erf
# spilled 16 registers at 128-row tiles, 4 at 64, so it stays with the Triton kernel)
ACTS = ("swiglu", "reglu", "clamped_swiglu", "silu", "gelu", "relu", "relu2")


def stages(rp: int, dual: bool) -> int:
    """The pipeline's stages at padded rank ``rp`` (0: no LoRA): 4 stages of 48 KiB (gated) or 32 KiB, 3
    when a LoRA ring of ``rp > 16`` would not fit beside four gated ones."""
    return STAGES if rp <= 16 or not dual else 3


def ready(x, w, lb, z, act: str, gate_step: int, gather: bool, rp: int, block_m: int) -> bool:
    """Whether :func:`launch` can run: Hopper (sm_90), row tiles of 64 or 128, rows gathered by token
    (``gather``), ``act`` in ``ACTS``, gate and up rows not interleaved (``gate_step == 1``), ``x [T, H]``
    16-bit with unit stride along ``H``, ``H`` and the row stride multiples of 16 (so Triton knows the copies'
    16-byte alignment; at ``H`` = 328 or 40 the copies would be of 2 bytes, which ``cp.async`` has not),
    ``w [E, N1, H]`` in x's dtype readable by a TMA descriptor with unit stride along ``H``
    (:func:`.kernels_tma.weight_tma_ready`); with a LoRA term (``lb`` not None) also ``z [N, R]`` contiguous
    and ``Lb`` in x's dtype with a unit stride along ``R`` or ``N1``, ``RP <= MAX_RP``. Host metadata only."""
    import torch

    from .kernels_tma import rows_tma_ready, weight_tma_ready
    if not (x.is_cuda and torch.cuda.get_device_capability(x.device) == (9, 0) and block_m in (64, 128)):
        return False
    if not (gather and act in ACTS and gate_step == 1 and x.dtype in (torch.bfloat16, torch.float16)):
        return False
    if not (x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % 16 == 0 and x.stride(0) % 16 == 0
            and x.data_ptr() % 16 == 0 and w.dtype == x.dtype and weight_tma_ready(w)):
        return False
    if lb is None:
        return True
    lb_ok = weight_tma_ready(lb) if lb.stride(2) == 1 else weight_tma_ready(lb.mT)
    return (z.dtype == x.dtype and lb.dtype == x.dtype and rows_tma_ready(z) and z.is_contiguous() and lb_ok
            and rp <= MAX_RP)


def launch(x, w, b, sort_order, expert_offsets, top_k: int, act: str, alpha: float, limit: float, up_offset: int,
           h, a, lb, z, table, lora_scale: float, rp: int, block_m: int, num_sms: int) -> None:
    """:func:`up_kernel` over the tile ``table`` (rows of ``block_m``); one program per SM at most. ``h``
    may be None (not stored); ``lb`` and ``z`` None: no LoRA term. :func:`ready` must hold."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    E, N1, H = w.shape
    N = sort_order.shape[0]
    NA = a.shape[1]
    M = table.shape[0] // 2
    dual = NA != N1
    w_d = TensorDescriptor(w, [E, N1, H], list(w.stride()), [1, BN, BK], _layout(3, 128))
    z_d, lb_d, lb_kmajor = w_d, w_d, True
    if lb is not None:
        R = z.shape[1]
        narrow = min(2 * rp, 128)
        z_d = TensorDescriptor(z, [N, R], [R, 1], [block_m, rp], _layout(2, narrow))
        lb_kmajor = lb.stride(2) == 1
        lbt = lb if lb_kmajor else lb.mT
        lb_d = TensorDescriptor(lbt, list(lbt.shape), list(lbt.stride()), [1, BN, rp] if lb_kmajor else [1, rp, BN],
                                _layout(3, narrow) if lb_kmajor else _layout(3, 128))
    bb = w if b is None else b
    grid = (min(M * -(-NA // BN), num_sms),)
    up_kernel[grid](
        x, w_d, z_d, lb_d, bb, sort_order, expert_offsets, a if h is None else h, a, table,
        H, NA, N1, E, M, top_k, x.stride(0), bb.stride(0), bb.stride(-1), up_offset, alpha, limit, lora_scale,
        ACT=act, DUAL=dual, HAS_BIAS=b is not None, STORE_H=h is not None, LB_KMAJOR=lb_kmajor, LORA=lb is not None,
        BM=block_m, BN=BN, BK=BK, RP=rp, STAGES=stages(rp if lb is not None else 0, dual), LOADER_WARPS=LOADER_WARPS,
        LOADER_REGS=LOADER_REGS, CONSUMER_REGS=CONSUMER_REGS, num_warps=4)
