"""Triton kernels for the FP8 casts of the rowwise recipe's fast path (power-of-two scales), beside
their reference, :func:`moeyard.quant.fp8.quantize` (same values: the tests compare them).

- :func:`rowwise`: ``t [M, K]`` -> e4m3 ``[M, K]`` with one scale per row (forward and dgrad operands:
  token rows, ``W_e`` rows). One program per ``BLOCK_M`` rows: a pass for the rows' ``amax``, a pass to
  scale and cast.
- :func:`colwise_per_group`: ``t [R, N]`` with expert offsets -> e4m3 ``t^T [N, R]`` with one scale per
  column and expert (the wgrad operands ``dy^T`` and ``x^T``, transposed as ``torch._scaled_grouped_mm``
  reads them). One program per (expert, ``BLOCK_N`` columns), looping over the expert's rows twice.
- :func:`colwise_per_expert`: ``w [E, N, K]`` -> e4m3 ``w^T [E, K, N]`` with one scale per (expert,
  column) (``W_e^T`` for dgrad), the same kernel with the experts as equal groups.

Under Triton's CPU interpreter, whose float8 conversion does not round to nearest (seen with triton 3.9:
127.6 became 64), the kernels store the scaled float32 values and the wrapper casts them with torch;
on CUDA the kernels cast (``cvt.rn.satfinite``, the same rounding as torch's). No host sync.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..kernel_op import interpreting
from .fp8 import E4M3, E4M3_MAX

Tensor = torch.Tensor


@triton.jit
def _pow2_scale(amax):
    """``2^-floor(log2(448 / max(amax, EPS)))`` from the float32 exponent bits (exact)."""
    inv = 448.0 / tl.maximum(amax, 1e-12)
    e = ((inv.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2(inv)): inv is a normal float
    return ((127 - e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _rowwise_kernel(
    x_ptr,      # [M, K] float, row stride stride_xm, unit column stride
    q_ptr,      # [M, K] e4m3 (float32 under the interpreter), contiguous
    s_ptr,      # [M] float32
    M, K, stride_xm,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_rows = rows < M
    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = m_rows[:, None] & (cols < K)[None, :]
        b_x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(b_x), axis=1))
    scale = _pow2_scale(amax)
    tl.store(s_ptr + rows, scale, mask=m_rows)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = m_rows[:, None] & (cols < K)[None, :]
        b_x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        b_q = tl.clamp(b_x / scale[:, None], -448.0, 448.0)
        tl.store(q_ptr + rows[:, None] * K + cols[None, :], b_q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _colwise_kernel(
    x_ptr,        # [R, N] float, row stride stride_xr, unit column stride
    offsets_ptr,  # [G + 1] int32: rows of group g are offsets[g] .. offsets[g + 1]
    q_ptr,        # transposed e4m3 output (float32 under the interpreter); element (g, n, r) at
                  # g * stride_qg + n * stride_qn + (r - offsets[g] if LOCAL else r)
    s_ptr,        # [G, N] float32
    N, stride_xr, stride_qg, stride_qn,
    LOCAL: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    g = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_cols = cols < N
    start = tl.load(offsets_ptr + g)
    end = tl.load(offsets_ptr + g + 1)
    amax = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        mask = (rows < end)[:, None] & m_cols[None, :]
        b_x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xr + cols[None, :], mask=mask, other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(b_x.to(tl.float32)), axis=0))
    scale = _pow2_scale(amax)
    tl.store(s_ptr + g * N + cols, scale, mask=m_cols)
    base = q_ptr + g.to(tl.int64) * stride_qg
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        mask = (rows < end)[:, None] & m_cols[None, :]
        b_x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xr + cols[None, :], mask=mask, other=0.0)
        b_q = tl.clamp(b_x.to(tl.float32) / scale[None, :], -448.0, 448.0).to(q_ptr.dtype.element_ty)
        at = rows - start if LOCAL else rows
        tl.store(base + cols[None, :].to(tl.int64) * stride_qn + at[:, None], b_q, mask=mask)


def _out(shape, device) -> Tensor:
    """The kernels' output: e4m3 on CUDA, float32 (cast afterwards) under the interpreter."""
    return torch.empty(shape, device=device, dtype=torch.float32 if interpreting() else E4M3)


def _cast(q: Tensor) -> Tensor:
    return q.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3) if q.dtype != E4M3 else q


def rowwise(t: Tensor) -> tuple[Tensor, Tensor]:
    """``t [M, K]`` (unit column stride) -> ``(q [M, K] e4m3 contiguous, s [M] float32)``: one power-of-two
    scale per row (:func:`moeyard.quant.fp8.quantize` with ``Blocks(None, 1)``, mode ``pow2``)."""
    M, K = t.shape
    if t.stride(1) != 1:
        t = t.contiguous()
    q, s = _out((M, K), t.device), torch.empty(M, device=t.device, dtype=torch.float32)
    if M:
        _rowwise_kernel[(triton.cdiv(M, 16),)](t, q, s, M, K, t.stride(0), BLOCK_M=16, BLOCK_K=128)
    return _cast(q), s


def colwise_per_group(t: Tensor, offsets: Tensor) -> tuple[Tensor, Tensor]:
    """``t [R, N]`` (unit column stride), ``offsets [G + 1]`` int32 -> ``(q [N, R] e4m3, s [G, N] float32)``:
    ``q[n, r] = t[r, n] / s[g, n]`` for the rows of each group ``g``, ``s[g, n]`` the power-of-two scale of
    column ``n`` over the group's rows (:func:`moeyard.quant.fp8.quantize` of ``t^T`` with offsets). Columns
    ``r`` of ``q`` past ``offsets[G]`` are left unwritten."""
    R, N = t.shape
    if t.stride(1) != 1:
        t = t.contiguous()
    G = offsets.numel() - 1
    q, s = _out((N, R), t.device), torch.empty(G, N, device=t.device, dtype=torch.float32)
    if G and N:
        _colwise_kernel[(G, triton.cdiv(N, 64))](t, offsets, q, s, N, t.stride(0), 0, R,
                                                 LOCAL=False, BLOCK_R=64, BLOCK_N=64)
    return _cast(q), s


def colwise_per_expert(w: Tensor) -> tuple[Tensor, Tensor]:
    """``w [E, N, K]`` (contiguous) -> ``(q [E, K, N] e4m3, s [E, K] float32)``: ``w_e^T`` with one power-of-two
    scale per (expert, column of ``w_e``) over its ``N`` rows."""
    E, N, K = w.shape
    w = w.contiguous()
    q, s = _out((E, K, N), w.device), torch.empty(E, K, device=w.device, dtype=torch.float32)
    if E and K and N:
        _colwise_kernel[(E, triton.cdiv(K, 64))](w.view(E * N, K), _equal_offsets(E, N, w.device), q, s, K, K,
                                                 K * N, N, LOCAL=True, BLOCK_R=64, BLOCK_N=64)
    return _cast(q), s


def _equal_offsets(E: int, N: int, device: torch.device) -> Tensor:
    """``[0, N, 2N, ..., EN]`` int32: made once per (E, N, device) eagerly, fresh while a CUDA graph is
    captured (a captured ``arange`` fills its tensor only when the graph replays)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.arange(0, (E + 1) * N, N, device=device, dtype=torch.int32)
    return _cached_offsets(E, N, device)


@functools.lru_cache(maxsize=32)
def _cached_offsets(E: int, N: int, device: torch.device) -> Tensor:
    return torch.arange(0, (E + 1) * N, N, device=device, dtype=torch.int32)
