"""Triton kernels of :mod:`moeyard.weighted_sum` (CUDA; CPU under ``TRITON_INTERPRET=1``).

``weighted_sum_kernel``: grid ``(ceil(T / BT), ceil(H / BH))``, a program sums the K pair rows of
``BT`` tokens over ``BH`` columns in float32 (or, gathering, the rows an index names, optionally
keeping a copy of them); ``pairs_grad_kernel`` (same grid) writes them the
gradient's K scaled copies (a torch broadcast multiply took 1.32 ms at the shape below on an H100), in
pair order or, scattering, at the rows an index names. ``weights_grad_kernel``: grid ``(ceil(T / BT),)``, a
program walks H in ``GRAD_BH`` steps for all K slots of ``BT`` tokens. Each reads the pairs once:
``T * K * H * itemsize`` bytes (1.07 GB at Qwen3-30B-A3B's T = 32768, K = 8, H = 2048, bf16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kernel_op import kernel_op
from .launch import cached, cdiv, next_power_of_2

Tensor = torch.Tensor
BT, BH, GRAD_BH = 4, 512, 128


@triton.jit
def _token_tile(T, H, BT: tl.constexpr, BH: tl.constexpr):
    """This program's ``BT`` tokens (int64) and ``BH`` columns, the token mask and the tile's mask."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    m_t = t < T
    return t.to(tl.int64), h, m_t, m_t[:, None] & (h < H)[None, :]


@cached
@triton.jit
def weighted_sum_kernel(
    pairs_ptr,
    w_ptr,
    out_ptr,
    index_ptr,
    keep_ptr,
    terms_ptr,  # [T] float32: added to every column of out[t]; read if ROW_TERMS
    T,
    H,
    stride_src,
    stride_out,
    row0,
    n_rows,
    K: tl.constexpr,
    HAS_W: tl.constexpr,
    GATHER: tl.constexpr,
    KEEP: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BT: tl.constexpr,
    BH: tl.constexpr,
    ROW_TERMS: tl.constexpr = False,
):
    """``out[t, h] = sum_k w[t, k] * pairs[t, k, h]`` (float32 sums, k in order; ``w = 1`` without
    ``HAS_W``). ``GATHER``: pair ``(t, k)``'s row is ``pairs[index[t, k] - row0]`` (rows ``stride_src``
    apart; zeros for an index outside ``[row0, row0 + n_rows)``, whatever its weight), and with ``KEEP``
    it is also copied to ``keep[t, k]``; otherwise ``pairs [T, K, H]`` contiguous. ``ACCUMULATE``: the
    sum is added to ``out`` (in float32, rounded once). ``ROW_TERMS``: ``terms[t]`` is added to row ``t``
    (in float32, before the rounding). ``out``'s rows are ``stride_out`` apart."""
    t64, h, m_t, mask = _token_tile(T, H, BT, BH)
    acc = tl.zeros((BT, BH), tl.float32)
    for k in tl.static_range(K):
        pair = t64 * K + k
        if GATHER:  # an index outside the window names no row: the pair adds nothing
            row = tl.load(index_ptr + pair, mask=m_t, other=-1) - row0
            ok = (row >= 0) & (row < n_rows)
            src = tl.where(ok, row, 0) * stride_src
            m_p = mask & ok[:, None]
        else:
            src = pair * H
            m_p = mask
        p = tl.load(pairs_ptr + src[:, None] + h[None, :], mask=m_p, other=0.0)
        if KEEP:
            tl.store(keep_ptr + pair[:, None] * H + h[None, :], p, mask=mask)
        if HAS_W:
            acc += tl.load(w_ptr + pair, mask=m_t, other=0.0).to(tl.float32)[:, None] * p.to(tl.float32)
        else:
            acc += p.to(tl.float32)
    if ROW_TERMS:
        acc += tl.load(terms_ptr + t64, mask=m_t, other=0.0)[:, None]
    out = out_ptr + t64[:, None] * stride_out + h[None, :]
    if ACCUMULATE:
        acc += tl.load(out, mask=mask, other=0.0).to(tl.float32)
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@cached
@triton.jit
def pairs_grad_kernel(
    w_ptr, g_ptr, dp_ptr, index_ptr, T, H, K: tl.constexpr, SCATTER: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr
):
    """``dp[t, k, h] = w[t, k] * g[t, h]`` (the product in float32, rounded once), ``g`` read once.
    ``SCATTER``: pair ``(t, k)``'s row goes to ``dp[index[t, k]]`` (rows ``H`` apart) instead."""
    t64, h, m_t, mask = _token_tile(T, H, BT, BH)
    g = tl.load(g_ptr + t64[:, None] * H + h[None, :], mask=mask, other=0.0).to(tl.float32)
    for k in tl.static_range(K):
        pair = t64 * K + k
        w = tl.load(w_ptr + pair, mask=m_t, other=0.0).to(tl.float32)
        row = tl.load(index_ptr + pair, mask=m_t, other=0) if SCATTER else pair
        tl.store(dp_ptr + row[:, None] * H + h[None, :], (w[:, None] * g).to(dp_ptr.dtype.element_ty), mask=mask)


@cached
@triton.jit
def weights_grad_kernel(
    pairs_ptr, g_ptr, dw_ptr, T, H, K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr
):
    """``dw[t, k] = sum_h g[t, h] * pairs[t, k, h]`` (float32 sums over H in BH steps, in order; each
    ``g`` tile read once for all K slots, ``KP`` = K rounded up to a power of two)."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    k = tl.arange(0, KP)
    m_t = t < T
    m_tk = m_t[:, None] & (k < K)[None, :]  # [BT, KP]
    row = t.to(tl.int64)[:, None] * K + k[None, :]  # [BT, KP] pair rows
    acc = tl.zeros((BT, KP, BH), tl.float32)
    for h0 in range(0, H, BH):
        h = h0 + tl.arange(0, BH)
        m_h = h < H
        g = tl.load(g_ptr + t.to(tl.int64)[:, None] * H + h[None, :], mask=m_t[:, None] & m_h[None, :], other=0.0)
        p = tl.load(
            pairs_ptr + row[:, :, None] * H + h[None, None, :], mask=m_tk[:, :, None] & m_h[None, None, :], other=0.0
        )
        acc += g.to(tl.float32)[:, None, :] * p.to(tl.float32)
    tl.store(dw_ptr + row, tl.sum(acc, axis=2).to(dw_ptr.dtype.element_ty), mask=m_tk)


@kernel_op("moeyard::weighted_sum_", mutates_args=("out",))
def weighted_sum_(pairs: Tensor, weights: Tensor, out: Tensor) -> None:
    T, K, H = pairs.shape
    weighted_sum_kernel[(cdiv(T, BT), cdiv(H, BH))](
        pairs,
        weights,
        out,
        out,
        out,
        out,
        T,
        H,
        H,
        H,
        0,
        T * K,
        K=K,
        HAS_W=True,
        GATHER=False,
        KEEP=False,
        ACCUMULATE=False,
        BT=BT,
        BH=BH,
        num_warps=4,
    )


@kernel_op("moeyard::gathered_sum_", mutates_args=("out", "keep"))
def gathered_sum_(
    src: Tensor,
    index: Tensor,
    weights: Tensor | None,
    out: Tensor,
    keep: Tensor | None,
    row0: int = 0,
    accumulate: bool = False,
    row_terms: Tensor | None = None,
) -> None:
    T, K = index.shape
    H = out.shape[1]
    weighted_sum_kernel[(cdiv(T, BT), cdiv(H, BH))](
        src,
        out if weights is None else weights,
        out,
        index,
        out if keep is None else keep,
        out if row_terms is None else row_terms,
        T,
        H,
        src.stride(0),
        out.stride(0),
        row0,
        src.shape[0],
        K=K,
        HAS_W=weights is not None,
        GATHER=True,
        KEEP=keep is not None,
        ACCUMULATE=accumulate,
        BT=BT,
        BH=BH,
        ROW_TERMS=row_terms is not None,
        num_warps=4,
    )


@kernel_op("moeyard::pairs_grad_", mutates_args=("dp",))
def pairs_grad_(weights: Tensor, grad_out: Tensor, dp: Tensor) -> None:
    T, K, H = dp.shape
    pairs_grad_kernel[(cdiv(T, BT), cdiv(H, BH))](
        weights, grad_out, dp, dp, T, H, K=K, SCATTER=False, BT=BT, BH=BH, num_warps=4
    )


@kernel_op("moeyard::scattered_pairs_grad_", mutates_args=("d_src",))
def scattered_pairs_grad_(weights: Tensor, grad_out: Tensor, index: Tensor, d_src: Tensor) -> None:
    T, K = weights.shape
    H = d_src.shape[1]
    pairs_grad_kernel[(cdiv(T, BT), cdiv(H, BH))](
        weights, grad_out, d_src, index, T, H, K=K, SCATTER=True, BT=BT, BH=BH, num_warps=4
    )


@kernel_op("moeyard::weights_grad_", mutates_args=("dw",))
def weights_grad_(pairs: Tensor, grad_out: Tensor, dw: Tensor) -> None:
    T, K, H = pairs.shape
    weights_grad_kernel[(cdiv(T, BT),)](
        pairs, grad_out, dw, T, H, K=K, KP=next_power_of_2(K), BT=BT, BH=GRAD_BH, num_warps=4
    )


def gathered_sum(
    src: Tensor,
    index: Tensor,
    weights: Tensor | None,
    keep: bool,
    row0: int = 0,
    into: Tensor | None = None,
    row_terms: Tensor | None = None,
    out: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``([T, H], [T, K, H] | None)`` in ``src.dtype`` (``src [*, H]`` unit column stride, contiguous
    ``index [T, K]`` int64, ``weights [T, K]`` and ``row_terms [T]`` float32; ``out`` ``[T, H]``, unit
    column stride): see :func:`moeyard.weighted_sum.gathered_sum`."""
    T, K = index.shape
    if out is None:
        out = src.new_empty(T, src.shape[1]) if into is None else into
    pairs = src.new_empty(T, K, src.shape[1]) if keep else None
    gathered_sum_(src, index, weights, out, pairs, row0, into is not None, row_terms)
    return out, pairs


def weighted_sum_forward(pairs: Tensor, weights: Tensor) -> Tensor:
    """``[T, H]`` in ``pairs.dtype`` (contiguous ``pairs [T, K, H]``, ``weights [T, K]``)."""
    out = pairs.new_empty(pairs.shape[0], pairs.shape[2])
    weighted_sum_(pairs, weights, out)
    return out


def pairs_grad(weights: Tensor, grad_out: Tensor) -> Tensor:
    """``[T, K, H]`` in ``grad_out.dtype``: ``weights [T, K]`` times each token's ``grad_out [T, H]``."""
    dp = grad_out.new_empty(weights.shape[0], weights.shape[1], grad_out.shape[1])
    pairs_grad_(weights, grad_out, dp)
    return dp


def scattered_pairs_grad(weights: Tensor, grad_out: Tensor, index: Tensor, num_rows: int) -> Tensor:
    """``[num_rows, H]`` in ``grad_out.dtype``: row ``index[t, k]`` is ``weights[t, k] * grad_out[t]``; rows no
    pair names are zero (when ``num_rows > T * K``; ``index`` must name distinct rows)."""
    T, K = weights.shape
    fill = torch.zeros if num_rows > T * K else torch.empty
    d_src = fill(num_rows, grad_out.shape[1], dtype=grad_out.dtype, device=grad_out.device)
    if T * K:
        scattered_pairs_grad_(weights, grad_out, index, d_src)
    return d_src


def weights_grad(pairs: Tensor, grad_out: Tensor) -> Tensor:
    """``[T, K]`` in ``pairs.dtype``: each pair row's dot product with its token's ``grad_out [T, H]``."""
    dw = pairs.new_empty(pairs.shape[0], pairs.shape[1])
    weights_grad_(pairs, grad_out, dw)
    return dw
