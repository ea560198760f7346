"""Triton kernel of :func:`moeyard.parallel.row_copy.copy_rows` (CUDA; CPU under ``TRITON_INTERPRET=1``).

Grid ``(W * ceil(C / BLOCK_M), ceil(H / BLOCK_H))``: a program copies ``BLOCK_M`` rows x ``BLOCK_H``
columns of one peer's window; it takes the peer's buffer address from a table (``int64`` -> pointer)
and returns at once when its first row is past the peer's count. The peer is the fastest-varying
part of the program id, so programs start in the order (peer 0, rows 0..), (peer 1, rows 0..), ...:
every peer's copy is in flight at once, the local one hidden under those over NVLink, and the load is
spread over every peer's links from the start. With the peer as the slowest part, each rank's copies
ran peer after peer, every rank starting at rank 0's buffer (whose links then served all of them):
208 against 370 GB/s on four H200s (``benchmarks/NOTES.md`` round 34). Bytes moved: ``sum(count) * H
* itemsize`` read and written, on NVLink for every peer but this rank (an indexed pull also reads
each row's 8-byte index there).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..launch import cached, cdiv, next_power_of_2

# Measured on an H200 (copy of 262144 x 2048 bf16 rows within one GPU, benchmarks/NOTES.md round 19): at
# 16 x 512 and 4 warps a pull moves 3.8 TB/s (4.2 indexed), a push 3.9, next to torch's copy_ at 4.2;
# the former 8 x 1024 ran 2.1-3.1 TB/s
BLOCK_M = 16
MAX_BLOCK_H = 512


@cached
@triton.jit
def copy_rows_kernel(
    local_ptr,
    table_ptr,
    rows_ptr,
    base_ptr,
    count_ptr,
    index_table_ptr,
    scale_table_ptr,
    H,
    C,
    W,
    stride_local,
    stride_peer,
    PULL: tl.constexpr,
    INDEXED: tl.constexpr,
    SCALED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Pull: ``local[rows[s, j]] = peer_s[base[s] + j]`` (``INDEXED``: ``peer_s[index_s[base[s] + j]]``,
    ``index_s`` at the address ``index_table[s]``; ``SCALED``: times ``scale_s[base[s] + j]`` (the
    rows' dtype, at ``scale_table[s]``; product in float32, float64 for float64 rows); push:
    ``peer_s[base[s] + j] = local[rows[s, j]]``."""
    pid = tl.program_id(0)
    s = pid % W
    count = tl.load(count_ptr + s)
    first = (pid // W) * BLOCK_M
    if first >= count:
        return
    peer_ptr = tl.load(table_ptr + s).to(tl.pointer_type(local_ptr.dtype.element_ty))
    j = first + tl.arange(0, BLOCK_M)
    m_j = j < count
    row = tl.load(rows_ptr + s.to(tl.int64) * C + j, mask=m_j, other=0).to(tl.int64)
    window = tl.load(base_ptr + s).to(tl.int64) + j.to(tl.int64)
    if SCALED:
        scale_ptr = tl.load(scale_table_ptr + s).to(tl.pointer_type(local_ptr.dtype.element_ty))
        factor = tl.load(scale_ptr + window, mask=m_j, other=0.0)
    if INDEXED:
        index_ptr = tl.load(index_table_ptr + s).to(tl.pointer_type(tl.int64))
        window = tl.load(index_ptr + window, mask=m_j, other=0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = m_j[:, None] & (cols < H)[None, :]
    p_local = local_ptr + row[:, None] * stride_local + cols[None, :]
    p_peer = peer_ptr + window[:, None] * stride_peer + cols[None, :]
    if PULL:
        got = tl.load(p_peer, mask=mask)
        if SCALED:
            if got.dtype == tl.float64:
                got = got * factor[:, None]
            else:
                got = (got.to(tl.float32) * factor.to(tl.float32)[:, None]).to(got.dtype)
        tl.store(p_local, got, mask=mask)
    else:
        tl.store(p_peer, tl.load(p_local, mask=mask), mask=mask)


def copy_rows_triton(local, peer, table, rows, base, count, *, pull: bool, index_table=None, scale_table=None) -> None:
    """Launch :func:`copy_rows_kernel` (arguments as :func:`moeyard.parallel.row_copy.copy_rows`;
    ``peer``: any one of the peers' tensors, for the shape and stride they share; ``index_table``,
    ``scale_table``: the index and scale tensors' addresses, for an indexed or scaled pull)."""
    W, C = rows.shape
    H = local.shape[1]
    if C == 0 or H == 0 or W == 0:
        return
    block_h = min(next_power_of_2(H), MAX_BLOCK_H)
    grid = (W * cdiv(C, BLOCK_M), cdiv(H, block_h))
    copy_rows_kernel[grid](
        local,
        table,
        rows,
        base,
        count,
        table if index_table is None else index_table,
        table if scale_table is None else scale_table,
        H,
        C,
        W,
        local.stride(0),
        peer.stride(0),
        PULL=pull,
        INDEXED=index_table is not None,
        SCALED=scale_table is not None,
        BLOCK_M=BLOCK_M,
        BLOCK_H=block_h,
        num_warps=4,
    )
