"""The FP8 weight gradients of ``fp8_rowwise`` as an e4m3 grouped GEMM over each expert's rows, written in Gluon
for sm_90: ``dW[e][m, n] = sl[e, m] sr[e, n] sum_{r of e} lq[m, r] rq[n, r]``, from the per-expert column
casts of both operands in the padded layout (:func:`.fp8_colwise.colwise_per_group` with ``padded``: each
expert's rows start at a multiple of ``BK`` columns, zeros after its rows), so every K step reads whole TMA
boxes of one expert and needs no mask. The up projection's ``dW_up = d h^T x[token]`` takes ``lq`` from ``d h``
and ``rq`` from the gathered ``x``; the down projection's ``dW_down = d out[token]^T (w act(h))`` the gathered
``d out`` and ``w act(h)``.

Why: the weight gradients' GEMMs reduce over each expert's rows (a K-grouped GEMM), which e4m3 MMAs can only
read K-major: both operands transposed. On ``torch._scaled_grouped_mm`` they ran at 44-54% of the dense e4m3
rate on an H200, on a plain Triton kernel at 51-58% (``benchmarks/NOTES.md``, round 50), where the rows-grouped
Gluon GEMM of :mod:`.fp8_gluon` reaches 72-84%. This kernel keeps that one's warp-specialised schedule with the
tile order of :mod:`moeyard.experts.triton.kernels_gluon_wgrad`:

- one persistent program per SM over the output tiles (expert, ``BM`` rows of ``NL``, ``BN`` columns of ``NR``),
  expert-major, so an expert's operands are read from HBM about once;
- a loader warp issues each K step's boxes ``lq [BM, BK]`` and ``rq [BN, BK]`` through TMA into a ring of
  ``STAGES`` stages, each once both consumers released it;
- two consumer warp groups (rows ``0 .. 63`` and ``64 .. 127`` of the tile) run the e4m3 MMAs with one in flight
  (fast accumulation over an expert's rows, as ``torch._scaled_grouped_mm`` does), then multiply the float32
  accumulator by both scales, round it to ``dW``'s dtype and store it: a 16-bit ``dW`` a TMA descriptor takes
  goes out through shared memory and a TMA store that runs on under the next tile's MMAs (as :mod:`.fp8_gluon`'s
  output), any other by row from registers. Rows past ``NL`` and columns past ``NR`` read zeros and are not stored. An
  expert without rows gets a zero tile. Deterministic: each tile is one program's, summed in row order.

The default for ``fp8_rowwise``'s weight gradients on sm_90 (:func:`moeyard.experts.scaled_hopper.wgrad_gemm`;
``MOEYARD_FP8_WGRAD=cutlass`` takes ``torch._scaled_grouped_mm``). Measured on an H200 (2026-11-29,
``benchmarks/fp8_wgrad_probe.py``, ``benchmarks/NOTES.md`` round 55): 80-90% of the dense e4m3 rate at sonic-120b,
qwen3-30b-a3b and sonic-30b-a (e.g. sonic-120b's ``dW_up`` 3.45 ms, 1,281 TFLOP/s, against 5.40 on
``torch._scaled_grouped_mm`` and 7.06 for bf16's ``torch._grouped_mm``), 73-77% at qwen3.5-35b-a3b's smaller
tiles; relative error against float64 1.86e-3 with a bf16 ``dW`` (CUTLASS's exact accumulation: 1.66e-3).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from ..experts.triton.kernels_gluon import LOADER_REGS, _tma_load, _tma_store, barrier_ring, next_stage
from ..experts.triton.kernels_gluon_wgrad import _store, _tile_of, _tiles
from ..launch import cached, cdiv
from .fp8_gluon import _layout, mma_steps

Tensor = torch.Tensor

BM, BN, BK = 128, 256, 128  # a stage: (128 + 256) x 128 bytes = 48 KiB
STAGES = 3  # 144 KiB, and 64 KiB for the two consumers' output tiles: 208 of the 227 KiB, as fp8_gluon's
HM = gl.constexpr(64)  # a consumer warp group's rows of a tile
CONSUMER_REGS = 232  # as fp8_gluon's: the same [64, 256] float32 accumulator


@gluon.jit
def _loader(
    l_desc,
    r_desc,
    l_bufs,
    r_bufs,
    ready,
    empty,
    starts_ptr,
    NL,
    NR,
    E,
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
):
    """The loader partition: each (tile, K step)'s two boxes through TMA into the next stage once both
    consumers released it."""
    pid, nprog, tiles_m, tiles_n, my_tiles = _tiles(NL, NR, E, 2 * HM, BN)
    s = 0
    phase = 0
    for t in range(my_tiles):
        e, m0, n0, start, end = _tile_of(t, pid, nprog, tiles_m, tiles_n, starts_ptr, 2 * HM, BN)
        for k in range(start, end, BK):
            mbarrier.wait(empty.index(s), phase ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, l_desc.block_type.nbytes + r_desc.block_type.nbytes)
            _tma_load(l_desc, [m0, k], bar, l_bufs.index(s))
            _tma_load(r_desc, [n0, k], bar, r_bufs.index(s))
            s, phase = next_stage(s, phase, STAGES)


@gluon.jit
def _consumer(
    half,
    l_bufs,
    r_bufs,
    ready,
    empty,
    sl_ptr,
    sr_ptr,
    starts_ptr,
    dw_ptr,
    dw_desc,
    c_bufs,
    NL,
    NR,
    E,
    stride_de,
    stride_dl,
    stride_dr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    TMA_STORE: gl.constexpr,
):
    """A consumer partition (one warp group): rows ``64 half ...`` of every tile, as
    :func:`.fp8_gluon._consumer` runs its K loop, with both operands K-major and the scales in the epilogue."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    cols_l: gl.constexpr = gl.SliceLayout(0, mma)
    compact: gl.constexpr = gl.BlockedLayout([BN // 128], [32], [4], [0])
    pid, nprog, tiles_m, tiles_n, my_tiles = _tiles(NL, NR, E, 2 * HM, BN)
    s = 0
    phase = 0
    for t in range(my_tiles):
        e, m0, n0, start, end = _tile_of(t, pid, nprog, tiles_m, tiles_n, starts_ptr, 2 * HM, BN)
        row0 = m0 + half * HM
        # both scales read before the K loop hides their latency; the columns' held two per thread through it
        rows = row0 + gl.arange(0, HM, rows_l)
        sl = gl.load(sl_ptr + e.to(gl.int64) * NL + rows, mask=rows < NL, other=0.0)
        cols = n0 + gl.arange(0, BN, compact)
        sr = gl.load(sr_ptr + e.to(gl.int64) * NR + cols, mask=cols < NR, other=0.0)
        acc = gl.zeros([HM, BN], gl.float32, mma)
        acc, s, phase = mma_steps(
            acc, l_bufs, r_bufs, ready, empty, s, phase, gl.cdiv(end - start, BK), half, STAGES, False, True
        )
        acc = acc * sl[:, None] * gl.convert_layout(sr, cols_l)[None, :]
        if TMA_STORE:  # waited for only before the buffer is written again (the next tile's epilogue)
            c_buf = c_bufs.index(half)
            tma.store_wait(0)
            c_buf.store(acc.to(dw_desc.dtype))
            fence_async_shared()  # the tile's writes (generic proxy) before the TMA's reads (async proxy)
            _tma_store(dw_desc, [e, row0, n0], c_buf)
        else:
            _store(acc, 1.0, dw_ptr, e, row0, n0, NL, NR, stride_de, stride_dl, stride_dr, BN)
    if TMA_STORE:
        tma.store_wait(0)


@cached
@gluon.jit
def fp8_wgrad_kernel(
    l_desc,  # lq [NL, W] e4m3, K-major (the padded column cast), boxes [BM, BK]
    r_desc,  # rq [NR, W] e4m3, boxes [BN, BK]
    sl_ptr,  # [E, NL] float32, contiguous
    sr_ptr,  # [E, NR] float32, contiguous
    starts_ptr,  # [E + 1] int32: expert e's columns of lq and rq are starts[e] .. starts[e + 1] (multiples of BK)
    dw_ptr,  # [E, NL, NR] weight gradient, strides (stride_de, stride_dl, stride_dr) (out)
    dw_desc,  # TMA_STORE: its descriptor, boxes [1, 64, BN] (otherwise a placeholder, not used)
    NL,
    NR,
    E,
    stride_de,
    stride_dl,
    stride_dr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    TMA_STORE: gl.constexpr,
    LOADER_REGS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
):
    """The module docstring's product for every output tile ``[128, BN]``; one program per SM, tiles ``pid, pid
    + programs, ...``; launched with 4 warps (the first consumer), plus the second consumer and a loader warp."""
    dtype: gl.constexpr = l_desc.dtype
    sl8: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    l_bufs = gl.allocate_shared_memory(dtype, [STAGES, 2 * HM, BK], sl8)
    r_bufs = gl.allocate_shared_memory(dtype, [STAGES, BN, BK], sl8)
    ready, empty = barrier_ring(STAGES, 1, 2)  # ready: the TMA's expect; empty: one arrival per consumer
    if TMA_STORE:  # each consumer's output tile [64, BN] on its way out
        sl16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        c_bufs = gl.allocate_shared_memory(dw_desc.dtype, [2, HM, BN], sl16)
    else:
        c_bufs = l_bufs  # not used
    # the partitions' argument tuples written out in the call (a tuple built in the kernel loses constexprs)
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
                    sl_ptr,
                    sr_ptr,
                    starts_ptr,
                    dw_ptr,
                    dw_desc,
                    c_bufs,
                    NL,
                    NR,
                    E,
                    stride_de,
                    stride_dl,
                    stride_dr,
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
                    sl_ptr,
                    sr_ptr,
                    starts_ptr,
                    dw_ptr,
                    dw_desc,
                    c_bufs,
                    NL,
                    NR,
                    E,
                    stride_de,
                    stride_dl,
                    stride_dr,
                    BN,
                    BK,
                    STAGES,
                    TMA_STORE,
                ),
            ),
            (_loader, (l_desc, r_desc, l_bufs, r_bufs, ready, empty, starts_ptr, NL, NR, E, BN, BK, STAGES)),
        ],
        [4, 1],
        [CONSUMER_REGS, LOADER_REGS],
    )


def ready(lq: Tensor, rq: Tensor, dw_dtype: torch.dtype, experts: int) -> bool:
    """Whether :func:`launch` can run for ``dw [experts, NL, NR]`` of ``dw_dtype``: an sm_90 GPU, both casts e4m3
    on it with unit stride along their columns, row strides and base addresses multiples of 16 bytes (TMA), no
    empty operand, at least one expert and a float ``dw_dtype``. Host metadata only; raises nothing."""
    from ..experts.triton.schedule import is_sm90

    def tma_rows(t: Tensor) -> bool:
        return t.dim() == 2 and t.numel() > 0 and t.stride(1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0

    e4m3 = torch.float8_e4m3fn
    return (
        lq.is_cuda
        and is_sm90(lq.device)
        and lq.dtype == rq.dtype == e4m3
        and tma_rows(lq)
        and tma_rows(rq)
        and dw_dtype.is_floating_point
        and experts > 0
    )


def launch(lq: Tensor, sl: Tensor, rq: Tensor, sr: Tensor, starts: Tensor, dw: Tensor) -> None:
    """``dw [E, NL, NR]``: ``dw[e] = diag(sl[e]) lq[:, cols of e] rq[:, cols of e]^T diag(sr[e])`` from the padded
    column casts ``lq [NL, W]`` and ``rq [NR, W]`` (e4m3; ``starts [E + 1]`` int32 their experts' first columns,
    multiples of ``BK``: :func:`.fp8_colwise.padded_offsets`) with their scales ``sl [E, NL]`` and ``sr [E, NR]``
    (float32, contiguous). :func:`ready` must hold. One launch, no host sync."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from ..experts.triton.kernels_gluon import _layout as _layout16
    from ..experts.triton.kernels_tma import weight_tma_ready
    from ..experts.triton.ops import num_sms

    E, NL, NR = dw.shape
    l_d = TensorDescriptor(lq, list(lq.shape), [lq.stride(0), 1], [BM, BK], _layout(2))
    r_d = TensorDescriptor(rq, list(rq.shape), [rq.stride(0), 1], [BN, BK], _layout(2))
    tma_store = weight_tma_ready(dw)
    dw_d = (
        TensorDescriptor(dw, [E, NL, NR], list(dw.stride()), [1, HM.value, BN], _layout16(3, 128)) if tma_store else l_d
    )
    grid = (max(min(E * cdiv(NL, BM) * cdiv(NR, BN), num_sms(dw.device)), 1),)
    fp8_wgrad_kernel[grid](
        l_d,
        r_d,
        sl,
        sr,
        starts,
        dw,
        dw_d,
        NL,
        NR,
        E,
        dw.stride(0),
        dw.stride(1),
        dw.stride(2),
        BN=BN,
        BK=BK,
        STAGES=STAGES,
        TMA_STORE=tma_store,
        LOADER_REGS=LOADER_REGS,
        CONSUMER_REGS=CONSUMER_REGS,
        num_warps=4,
    )
