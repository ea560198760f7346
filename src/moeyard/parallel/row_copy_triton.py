"""Triton kernel of :func:`moeyard.parallel.row_copy.copy_rows` (CUDA; CPU under ``TRITON_INTERPRET=1``).

Grid ``(ceil(C / BLOCK_M), ceil(H / BLOCK_H))``: a program copies ``BLOCK_M`` rows x ``BLOCK_H``
columns; programs whose first row is past ``count`` read two scalars and return. Bytes moved:
``count * H * itemsize`` read and written (on NVLink when one side is a peer's memory).
"""
from __future__ import annotations

import triton
import triton.language as tl

BLOCK_M = 8
MAX_BLOCK_H = 1024


@triton.jit
def copy_rows_kernel(dst_ptr, src_ptr, rows_ptr, base_ptr, count_ptr, H, stride_dst, stride_src,
                     INDEXED_DST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    """``dst[rows[j]] = src[base + j]`` (INDEXED_DST) or ``dst[base + j] = src[rows[j]]``, j < count."""
    count = tl.load(count_ptr)
    first = tl.program_id(0) * BLOCK_M
    if first >= count:
        return
    j = first + tl.arange(0, BLOCK_M)
    m_j = j < count
    row = tl.load(rows_ptr + j, mask=m_j, other=0).to(tl.int64)
    window = tl.load(base_ptr).to(tl.int64) + j.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = m_j[:, None] & (cols < H)[None, :]
    if INDEXED_DST:
        d_row, s_row = row, window
    else:
        d_row, s_row = window, row
    vals = tl.load(src_ptr + s_row[:, None] * stride_src + cols[None, :], mask=mask)
    tl.store(dst_ptr + d_row[:, None] * stride_dst + cols[None, :], vals, mask=mask)


def copy_rows_triton(dst, src, rows, base, count, *, indexed: str) -> None:
    """Launch :func:`copy_rows_kernel` (arguments as :func:`moeyard.parallel.row_copy.copy_rows`)."""
    if indexed not in ("dst", "src"):
        raise ValueError(f"indexed: expected 'dst' or 'src', got {indexed!r}")
    C, H = rows.numel(), dst.shape[1]
    if C == 0 or H == 0:
        return
    block_h = min(triton.next_power_of_2(H), MAX_BLOCK_H)
    grid = (triton.cdiv(C, BLOCK_M), triton.cdiv(H, block_h))
    copy_rows_kernel[grid](dst, src, rows, base, count, H, dst.stride(0), src.stride(0),
                           INDEXED_DST=indexed == "dst", BLOCK_M=BLOCK_M, BLOCK_H=block_h, num_warps=4)
