"""The down projection (forward ``y = a W_down^T`` and input gradient ``dx = d_h W_up``) with its
operands loaded by the Hopper tensor-memory accelerator (TMA), optionally persistent.

Both operands of this GEMM are dense: the rows ``a [N, KA]`` are in sorted (expert-major) order and
each expert's weight is one ``[NY, KA]`` (or ``[KA, NY]``) block, so a row tile is a plain 2-D box at
``(row0, k0)`` and a weight tile a box of the 3-D weight at ``(e, col0, k0)``; the boxes' bounds
zero-fill the K tail and the last rows. Rows of a tile past its expert's end belong to the next expert:
they are computed and not stored. The epilogue (LoRA term, bias, routing weight, store by pair) is
:func:`.kernels_fwd.down_epilogue`, shared with the pointer-loaded kernel.

Not warp-specialised: Triton 3.6 compiles this kernel with ``tl.range(..., warp_specialize=True)``
for sm_90a (one producer, two consumer warp groups) but on an H200 its output was wrong (relative
error 37 against float32) and it was slower (``benchmarks/NOTES.md``, round 6). The gathered GEMMs (up
projection, activation gradient, weight gradients) read rows at each pair's token, which a Hopper TMA
box cannot do; the weight gradients load their sorted operand through TMA (``kernels_bwd``), the up
projection its weight (``kernels_fwd.up_kernel`` with ``W_TMA``, :func:`weight_tma_ready`).

Device-side descriptors need a small global scratch per launch: :func:`ensure_allocator`.
"""

import torch
import triton
import triton.language as tl

from .kernels_fwd import down_epilogue


@triton.jit
def down_tma_kernel(
    a_ptr,  # [N, KA] input dtype, contiguous: rows in sorted order
    w_ptr,  # [E, NY, KA] input dtype, strides (stride_we, stride_wn, stride_wk); stride_wk == 1
    # (W_KMAJOR) or stride_wn == 1
    b_ptr,
    tw_ptr,
    sort_order_ptr,
    offsets_ptr,
    y_ptr,
    lb_ptr,
    z_ptr,  # as kernels_fwd.down_kernel
    table_ptr,  # [2 * M + 1] int32: row tile -> expert (>= E: none), -> first row, tiles (ops.Routing.tile_table)
    N,
    KA,
    NY,
    E,
    top_k,
    R,
    M,
    stride_we,
    stride_wn,
    stride_wk,
    stride_be,
    stride_bn,
    stride_lbe,
    stride_lbn,
    stride_lbr,
    lora_scale,
    W_KMAJOR: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    LORA: tl.constexpr,
    RP: tl.constexpr,
    PRECISION: tl.constexpr,
    PERSISTENT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """``y[pair] = w[pair] * (a[row] @ W[e].T + b[e] (+ s z Lb_e^T))`` for one (row tile, column
    tile), as :func:`.kernels_fwd.down_kernel` without the atomic and fused-LoRA variants; with
    ``PERSISTENT`` one program per SM loops over the existing tiles ``pid, pid + programs, ...``, all
    with the same K steps, so Triton flattens the tile and K loops into one pipeline (checked in the
    sm_90a code of Triton 3.6: one loop, the next tile's loads issued before a tile's epilogue)."""
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[N, KA], strides=[KA, 1], block_shape=[BM, BK])
    if W_KMAJOR:
        w_desc = tl.make_tensor_descriptor(
            w_ptr, shape=[E, NY, KA], strides=[stride_we, stride_wn, 1], block_shape=[1, BN, BK]
        )
    else:
        w_desc = tl.make_tensor_descriptor(
            w_ptr, shape=[E, KA, NY], strides=[stride_we, stride_wk, 1], block_shape=[1, BK, BN]
        )
    n_tiles = tl.cdiv(NY, BN)
    if PERSISTENT:  # over the tiles that exist (table[2M]): every tile runs the same K steps
        for tile in tl.range(tl.program_id(0), tl.load(table_ptr + 2 * M) * n_tiles, tl.num_programs(0), flatten=True):
            _down_tile(
                tile,
                n_tiles,
                a_desc,
                w_desc,
                b_ptr,
                tw_ptr,
                sort_order_ptr,
                offsets_ptr,
                y_ptr,
                lb_ptr,
                z_ptr,
                table_ptr,
                KA,
                NY,
                E,
                top_k,
                R,
                M,
                stride_be,
                stride_bn,
                stride_lbe,
                stride_lbn,
                stride_lbr,
                lora_scale,
                W_KMAJOR,
                HAS_BIAS,
                HAS_WEIGHT,
                LORA,
                RP,
                PRECISION,
                True,
                BM,
                BN,
                BK,
            )
    else:
        _down_tile(
            tl.program_id(0),
            n_tiles,
            a_desc,
            w_desc,
            b_ptr,
            tw_ptr,
            sort_order_ptr,
            offsets_ptr,
            y_ptr,
            lb_ptr,
            z_ptr,
            table_ptr,
            KA,
            NY,
            E,
            top_k,
            R,
            M,
            stride_be,
            stride_bn,
            stride_lbe,
            stride_lbn,
            stride_lbr,
            lora_scale,
            W_KMAJOR,
            HAS_BIAS,
            HAS_WEIGHT,
            LORA,
            RP,
            PRECISION,
            False,
            BM,
            BN,
            BK,
        )


@triton.jit
def _down_tile(
    tile,
    n_tiles,
    a_desc,
    w_desc,
    b_ptr,
    tw_ptr,
    sort_order_ptr,
    offsets_ptr,
    y_ptr,
    lb_ptr,
    z_ptr,
    table_ptr,
    KA,
    NY,
    E,
    top_k,
    R,
    M,
    stride_be,
    stride_bn,
    stride_lbe,
    stride_lbn,
    stride_lbr,
    lora_scale,
    W_KMAJOR: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    LORA: tl.constexpr,
    RP: tl.constexpr,
    PRECISION: tl.constexpr,
    ALL_LIVE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """One (row tile, column tile) of :func:`down_tma_kernel`. A tile that does not exist (expert
    ``>= E`` in the table) runs no K step and stores nothing (``ALL_LIVE``: the caller visits only
    tiles that exist). The tile's expert and first row come from a table (a persistent program
    visits many tiles; no search per tile)."""
    pid_n = tile % n_tiles
    pid_m = tile // n_tiles
    e = tl.load(table_ptr + pid_m)
    live = e < E
    e = tl.minimum(e, E - 1)
    row0 = tl.load(table_ptr + M + pid_m)
    row_end = tl.where(live, tl.load(offsets_ptr + e + 1), row0)
    if ALL_LIVE:  # the caller visits existing tiles only: the same K steps for all (a loop Triton can flatten)
        k_steps = tl.cdiv(KA, BK)
    else:
        k_steps = tl.where(live, tl.cdiv(KA, BK), 0)
    col0 = pid_n * BN
    acc = tl.zeros((BM, BN), tl.float32)
    for kt in range(0, k_steps):
        a = a_desc.load([row0, kt * BK])
        if W_KMAJOR:
            b = tl.trans(tl.reshape(w_desc.load([e, col0, kt * BK]), (BN, BK)))
        else:
            b = tl.reshape(w_desc.load([e, kt * BK, col0]), (BK, BN))
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    rows = (row0 + tl.arange(0, BM)).to(tl.int64)
    m_mask = rows < row_end
    pair = tl.load(sort_order_ptr + rows, mask=m_mask, other=0)
    cols = col0 + tl.arange(0, BN)
    down_epilogue(
        acc,
        acc,
        e.to(tl.int64),
        rows,
        m_mask,
        pair,
        pair // top_k,
        cols,
        cols < NY,
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
        HAS_BIAS,
        HAS_WEIGHT,
        False,
        LORA,
        RP,
        PRECISION,
    )


def tma_ready(rows: torch.Tensor, w: torch.Tensor, float32: bool = False) -> bool:
    """Whether :func:`down_tma_kernel` can read ``rows [N, KA]`` and ``w [E, NY, KA]``: ``rows``
    contiguous and :func:`rows_tma_ready`, ``w`` in its dtype with unit stride along NY or KA and the
    descriptor's other rules (:func:`_descriptor_ready`). Host metadata only."""
    return (
        rows.is_contiguous()
        and rows_tma_ready(rows, float32)
        and w.dtype == rows.dtype
        and w.dim() == 3
        and (_descriptor_ready(w, 2, float32) or _descriptor_ready(w, 1, float32))
    )


def weight_tma_ready(w: torch.Tensor, float32: bool = False) -> bool:
    """Whether a 3-D weight can be read through a TMA descriptor over its own layout, unit stride along
    its last dimension (:func:`_descriptor_ready`). Host metadata only."""
    return w.dim() == 3 and _descriptor_ready(w, 2, float32)


def rows_tma_ready(rows: torch.Tensor, float32: bool = False) -> bool:
    """Whether rows ``[N, C]`` can be read through a TMA descriptor, unit stride along C
    (:func:`_descriptor_ready`). Host metadata only."""
    return rows.dim() == 2 and _descriptor_ready(rows, 1, float32)


def _descriptor_ready(t: torch.Tensor, unit_dim: int, float32: bool) -> bool:
    """The TMA descriptor's rules for ``t`` as laid out (CUDA driver API ``cuTensorMapEncodeTiled``): no
    empty dimension (a rank of an expert-parallel layer can receive no rows), a 16-bit float dtype (or
    float32 with ``float32``: the CPU interpreter's tests), unit stride along ``unit_dim``, every other
    stride and the base address multiples of 16 bytes."""
    if t.numel() == 0 or t.dtype not in (torch.bfloat16, torch.float16) + ((torch.float32,) if float32 else ()):
        return False
    size = t.element_size()
    return (
        t.stride(unit_dim) == 1
        and t.data_ptr() % 16 == 0
        and all(t.stride(d) * size % 16 == 0 for d in range(t.dim()) if d != unit_dim)
    )


def _torch_scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device=torch.cuda.current_device())


def ensure_allocator() -> None:
    """Give Triton an allocator for the descriptors' global scratch (CUDA caching allocator, so
    CUDA-graph capture works) unless one is set already."""
    try:
        from triton.runtime._allocation import _NULL_ALLOCATOR, _allocator
    except ImportError:  # a Triton without the context variable: set ours
        triton.set_allocator(_torch_scratch)
        return
    if _allocator.get() is _NULL_ALLOCATOR:
        triton.set_allocator(_torch_scratch)
