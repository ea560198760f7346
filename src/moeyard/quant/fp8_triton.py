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
- With ``act`` (an :class:`moeyard.activations.Activation` by name), :func:`rowwise` and
  :func:`colwise_per_group` cast ``act(h)`` computed in float32 from the up projection's output ``h``
  (``[R, 2I]`` gated, gate then up columns or interleaved; ``[R, I]`` plain) as they load it, so the
  activation's output is never written in the compute dtype; :func:`act_backward` gives ``d h`` from ``h``
  and ``d act(h)``. The activations are those of the ``triton`` backend's epilogues
  (:mod:`moeyard.experts.triton.act`).

Under Triton's CPU interpreter, whose float8 conversion does not round to nearest (seen with triton 3.9:
127.6 became 64), the kernels store the scaled float32 values and the wrapper casts them with torch;
on CUDA the kernels cast (``cvt.rn.satfinite``, the same rounding as torch's). No host sync.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..activations import Activation
from ..experts.triton.act import act_fwd, act_grad
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
def _load(x_ptr, rows, cols, mask, stride_r, K, alpha, limit,
          ACT: tl.constexpr, GATED: tl.constexpr, INTERLEAVED: tl.constexpr):
    """``x[rows, cols]`` as float32, or with ``ACT`` the activation's output there (``x`` is then the up
    projection's output: gate at ``cols`` and up at ``cols + K``, or at ``2 cols`` and ``2 cols + 1``)."""
    base = x_ptr + rows[:, None].to(tl.int64) * stride_r
    if ACT == "none":
        return tl.load(base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if GATED:
        if INTERLEAVED:
            g = tl.load(base + 2 * cols[None, :], mask=mask, other=0.0).to(tl.float32)
            u = tl.load(base + 2 * cols[None, :] + 1, mask=mask, other=0.0).to(tl.float32)
        else:
            g = tl.load(base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            u = tl.load(base + cols[None, :] + K, mask=mask, other=0.0).to(tl.float32)
    else:
        g = tl.load(base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        u = g
    return tl.where(mask, act_fwd(g, u, alpha, limit, ACT), 0.0)


@triton.jit
def _rowwise_kernel(
    x_ptr,      # [M, K] float (with ACT: the up projection's output [M, 2K] or [M, K]), row stride stride_xm
    q_ptr,      # [M, K] e4m3 (float32 under the interpreter), contiguous
    s_ptr,      # [M] float32
    M, K, stride_xm, alpha, limit,
    ACT: tl.constexpr, GATED: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_rows = rows < M
    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = m_rows[:, None] & (cols < K)[None, :]
        b_x = _load(x_ptr, rows, cols, mask, stride_xm, K, alpha, limit, ACT, GATED, INTERLEAVED)
        amax = tl.maximum(amax, tl.max(tl.abs(b_x), axis=1))
    scale = _pow2_scale(amax)
    tl.store(s_ptr + rows, scale, mask=m_rows)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = m_rows[:, None] & (cols < K)[None, :]
        b_x = _load(x_ptr, rows, cols, mask, stride_xm, K, alpha, limit, ACT, GATED, INTERLEAVED)
        b_q = tl.clamp(b_x / scale[:, None], -448.0, 448.0)
        tl.store(q_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], b_q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _colwise_kernel(
    x_ptr,        # [R, N] float (with ACT: the up projection's output [R, 2N] or [R, N]), row stride stride_xr
    offsets_ptr,  # [G + 1] int32: rows of group g are offsets[g] .. offsets[g + 1]
    q_ptr,        # transposed e4m3 output (float32 under the interpreter); element (g, n, r) at
                  # g * stride_qg + n * stride_qn + (r - offsets[g] if LOCAL else r)
    s_ptr,        # [G, N] float32
    N, stride_xr, stride_qg, stride_qn, alpha, limit,
    ACT: tl.constexpr, GATED: tl.constexpr, INTERLEAVED: tl.constexpr,
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
        b_x = _load(x_ptr, rows, cols, mask, stride_xr, N, alpha, limit, ACT, GATED, INTERLEAVED)
        amax = tl.maximum(amax, tl.max(tl.abs(b_x), axis=0))
    scale = _pow2_scale(amax)
    tl.store(s_ptr + g * N + cols, scale, mask=m_cols)
    base = q_ptr + g.to(tl.int64) * stride_qg
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        mask = (rows < end)[:, None] & m_cols[None, :]
        b_x = _load(x_ptr, rows, cols, mask, stride_xr, N, alpha, limit, ACT, GATED, INTERLEAVED)
        b_q = tl.clamp(b_x / scale[None, :], -448.0, 448.0).to(q_ptr.dtype.element_ty)
        at = rows - start if LOCAL else rows
        tl.store(base + cols[None, :].to(tl.int64) * stride_qn + at[:, None], b_q, mask=mask)


def _out(shape, device) -> Tensor:
    """The kernels' output: e4m3 on CUDA, float32 (cast afterwards) under the interpreter."""
    return torch.empty(shape, device=device, dtype=torch.float32 if interpreting() else E4M3)


def _cast(q: Tensor) -> Tensor:
    return q.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3) if q.dtype != E4M3 else q


def _act_args(act: Activation | None, interleaved: bool) -> dict:
    """The kernels' activation arguments for ``act`` (None: the identity)."""
    if act is None:
        return dict(alpha=0.0, limit=0.0, ACT="none", GATED=False, INTERLEAVED=False)
    if act.fn is not None:
        raise ValueError("act: a custom activation callable cannot run inside a cast kernel")
    return dict(alpha=float(act.alpha), limit=float(act.limit), ACT=act.name, GATED=act.gated,
                INTERLEAVED=bool(interleaved and act.gated))


def _out_columns(t: Tensor, act: Activation | None) -> int:
    return t.shape[1] // 2 if act is not None and act.gated else t.shape[1]


def rowwise(t: Tensor, act: Activation | None = None, *, interleaved: bool = False) -> tuple[Tensor, Tensor]:
    """``t [M, K]`` (unit column stride) -> ``(q [M, K] e4m3 contiguous, s [M] float32)``: one power-of-two
    scale per row (:func:`moeyard.quant.fp8.quantize` with ``Blocks(None, 1)``, mode ``pow2``). With
    ``act``: of ``act(t)`` (``t`` the up projection's output, ``K`` its output columns; module docstring)."""
    M = t.shape[0]
    K = _out_columns(t, act)
    if t.stride(1) != 1:
        t = t.contiguous()
    q, s = _out((M, K), t.device), torch.empty(M, device=t.device, dtype=torch.float32)
    if M:
        _rowwise_kernel[(triton.cdiv(M, 16),)](t, q, s, M, K, t.stride(0), **_act_args(act, interleaved),
                                               BLOCK_M=16, BLOCK_K=128)
    return _cast(q), s


def colwise_per_group(t: Tensor, offsets: Tensor, act: Activation | None = None, *,
                      interleaved: bool = False) -> tuple[Tensor, Tensor]:
    """``t [R, N]`` (unit column stride), ``offsets [G + 1]`` int32 -> ``(q [N, R] e4m3, s [G, N] float32)``:
    ``q[n, r] = t[r, n] / s[g, n]`` for the rows of each group ``g``, ``s[g, n]`` the power-of-two scale of
    column ``n`` over the group's rows (:func:`moeyard.quant.fp8.quantize` of ``t^T`` with offsets). Columns
    ``r`` of ``q`` past ``offsets[G]`` are left unwritten. With ``act``: of ``act(t)`` (module docstring)."""
    R = t.shape[0]
    N = _out_columns(t, act)
    if t.stride(1) != 1:
        t = t.contiguous()
    G = offsets.numel() - 1
    q, s = _out((N, R), t.device), torch.empty(G, N, device=t.device, dtype=torch.float32)
    if G and N:
        _colwise_kernel[(G, triton.cdiv(N, 64))](t, offsets, q, s, N, t.stride(0), 0, R,
                                                 **_act_args(act, interleaved), LOCAL=False, BLOCK_R=64, BLOCK_N=64)
    return _cast(q), s


@triton.jit
def _act_backward_kernel(
    h_ptr,   # [R, 2I] gated (gate then up, or interleaved) or [R, I] plain, float, unit column stride
    da_ptr,  # [R, I] float, the gradient of act(h), unit column stride
    dh_ptr,  # [R, 2I] or [R, I], h's dtype, contiguous
    R, I, stride_h, stride_da, alpha, limit,
    ACT: tl.constexpr, GATED: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows < R)[:, None] & (cols < I)[None, :]
    r64 = rows[:, None].to(tl.int64)
    if GATED:
        gcol = 2 * cols if INTERLEAVED else cols
        ucol = 2 * cols + 1 if INTERLEAVED else cols + I
    else:
        gcol = cols
        ucol = cols
    g = tl.load(h_ptr + r64 * stride_h + gcol[None, :], mask=mask, other=0.0).to(tl.float32)
    u = g
    if GATED:
        u = tl.load(h_ptr + r64 * stride_h + ucol[None, :], mask=mask, other=0.0).to(tl.float32)
    da = tl.load(da_ptr + r64 * stride_da + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    _, dg, du = act_grad(g, u, alpha, limit, ACT)
    width = 2 * I if GATED else I
    tl.store(dh_ptr + r64 * width + gcol[None, :], (da * dg).to(dh_ptr.dtype.element_ty), mask=mask)
    if GATED:
        tl.store(dh_ptr + r64 * width + ucol[None, :], (da * du).to(dh_ptr.dtype.element_ty), mask=mask)


def act_backward(h: Tensor, da: Tensor, act: Activation, *, interleaved: bool = False) -> Tensor:
    """``d h`` (``h``'s shape and dtype) of ``a = act(h)`` given ``da [R, I]``, the derivatives in float32
    (:func:`moeyard.experts.triton.act.act_grad`; torch autograd's conventions at kinks)."""
    R, I = da.shape
    if h.stride(1) != 1:
        h = h.contiguous()
    if da.stride(1) != 1:
        da = da.contiguous()
    dh = torch.empty(h.shape, device=h.device, dtype=h.dtype)
    if R and I:
        _act_backward_kernel[(triton.cdiv(R, 32), triton.cdiv(I, 128))](
            h, da, dh, R, I, h.stride(0), da.stride(0), **_act_args(act, interleaved), BLOCK_R=32, BLOCK_I=128)
    return dh


def colwise_per_expert(w: Tensor) -> tuple[Tensor, Tensor]:
    """``w [E, N, K]`` (contiguous) -> ``(q [E, K, N] e4m3, s [E, K] float32)``: ``w_e^T`` with one power-of-two
    scale per (expert, column of ``w_e``) over its ``N`` rows."""
    E, N, K = w.shape
    w = w.contiguous()
    q, s = _out((E, K, N), w.device), torch.empty(E, K, device=w.device, dtype=torch.float32)
    if E and K and N:
        _colwise_kernel[(E, triton.cdiv(K, 64))](w.view(E * N, K), _equal_offsets(E, N, w.device), q, s, K, K,
                                                 K * N, N, **_act_args(None, False), LOCAL=True, BLOCK_R=64,
                                                 BLOCK_N=64)
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
