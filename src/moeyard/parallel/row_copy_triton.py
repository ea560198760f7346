"""Triton kernel of :func:`moeyard.parallel.row_copy.copy_rows` (CUDA; CPU under ``TRITON_INTERPRET=1``).

Grid ``(ceil(C / BLOCK_M), ceil(H / BLOCK_H), W)``: a program copies ``BLOCK_M`` rows x ``BLOCK_H``
columns of one peer's window; it takes the peer's buffer address from a table (``int64`` -> pointer)
and returns at once when its first row is past the peer's count. Bytes moved: ``sum(count) * H *
itemsize`` read and written, on NVLink for every peer but this rank.
"""
from __future__ import annotations

import triton
import triton.language as tl

BLOCK_M = 8
MAX_BLOCK_H = 1024


@triton.jit
def copy_rows_kernel(local_ptr, table_ptr, rows_ptr, base_ptr, count_ptr, H, C, stride_local, stride_peer,
                     PULL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    """Pull: ``local[rows[s, j]] = peer_s[base[s] + j]``; push: ``peer_s[base[s] + j] = local[rows[s, j]]``."""
    s = tl.program_id(2)
    count = tl.load(count_ptr + s)
    first = tl.program_id(0) * BLOCK_M
    if first >= count:
        return
    peer_ptr = tl.load(table_ptr + s).to(tl.pointer_type(local_ptr.dtype.element_ty))
    j = first + tl.arange(0, BLOCK_M)
    m_j = j < count
    row = tl.load(rows_ptr + s.to(tl.int64) * C + j, mask=m_j, other=0).to(tl.int64)
    window = tl.load(base_ptr + s).to(tl.int64) + j.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = m_j[:, None] & (cols < H)[None, :]
    p_local = local_ptr + row[:, None] * stride_local + cols[None, :]
    p_peer = peer_ptr + window[:, None] * stride_peer + cols[None, :]
    if PULL:
        tl.store(p_local, tl.load(p_peer, mask=mask), mask=mask)
    else:
        tl.store(p_peer, tl.load(p_local, mask=mask), mask=mask)


def copy_rows_triton(local, peer, table, rows, base, count, *, pull: bool) -> None:
    """Launch :func:`copy_rows_kernel` (arguments as :func:`moeyard.parallel.row_copy.copy_rows`;
    ``peer``: any one of the peers' tensors, for the shape and stride they share)."""
    W, C = rows.shape
    H = local.shape[1]
    if C == 0 or H == 0 or W == 0:
        return
    block_h = min(triton.next_power_of_2(H), MAX_BLOCK_H)
    grid = (triton.cdiv(C, BLOCK_M), triton.cdiv(H, block_h), W)
    copy_rows_kernel[grid](local, table, rows, base, count, H, C, local.stride(0), peer.stride(0),
                           PULL=pull, BLOCK_M=BLOCK_M, BLOCK_H=block_h, num_warps=4)
