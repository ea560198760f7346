"""Triton kernels of the fused router (:mod:`moeyard.routing.fused`).

Legend: T tokens, H hidden, E experts (``E_P2`` padded to a power of two), K top-k (``K_P2``), B
sequences of S tokens, BM tokens per program, BK hidden columns per main-loop step.

Forward (one program per block of BM tokens of one sequence; all E columns in registers): the logits
GEMM ``x W^T (+ bias)`` accumulated in float32 and rounded to x's dtype (as ``F.linear`` returns
them), the scores, the top-k selection, the routing weights, and the program's partial statistics
(routed pairs per expert, column sums of the probabilities, ``sum_t logsumexp(l_t)^2``), written to
its own slot; the caller sums the slots in a fixed order (no atomics: bit-reproducible).

Top-k: K passes of a row-wise argmax; among equal keys the lowest expert id wins (``tl.max`` with
``return_indices_tie_break_left``), so the ids come out ordered by decreasing key, as ``torch.topk``.

Losses (one program): the per-program statistics summed in a fixed order, per sequence and over all,
and from them the three losses and their coefficient-weighted sum (:func:`router_losses_kernel`).

Backward (one program per block of BM tokens): ``d logits`` from the gradients of the weights, the
logits, the scores and the losses, recomputing scores and the selection mask from the logits and
ids (the per-sequence statistics are kept too).
"""

import triton
import triton.language as tl

from ..launch import cached
from . import losses

EPS = tl.constexpr(losses.EPS)  # the renormalisation guard, as a constexpr (kernels read no plain globals)


@triton.jit
def _logits(
    x_ptr,
    w_ptr,
    b_ptr,
    rows,
    m_mask,
    cols,
    e_mask,
    H,
    stride_xt,
    stride_xh,
    stride_we,
    stride_wh,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    BM: tl.constexpr,
    E_P2: tl.constexpr,
    BK: tl.constexpr,
):
    """``[BM, E_P2]`` float32 logits ``x W^T + b``, rounded to x's dtype; padded columns ``-inf``."""
    acc = tl.zeros((BM, E_P2), tl.float32)
    for k0 in range(0, H, BK):
        ks = k0 + tl.arange(0, BK)
        k_mask = ks < H
        a = tl.load(
            x_ptr + rows[:, None] * stride_xt + ks[None, :] * stride_xh,
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + cols[None, :] * stride_we + ks[:, None] * stride_wh,
            mask=e_mask[None, :] & k_mask[:, None],
            other=0.0,
        )
        acc = tl.dot(a, w.to(a.dtype), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=e_mask, other=0.0).to(x_ptr.dtype.element_ty).to(tl.float32)[None, :]
    acc = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    return tl.where(e_mask[None, :], acc, float("-inf"))


@triton.jit
def _softmax(l):
    """Row softmax of ``l [BM, E_P2]`` (padded columns ``-inf``) and the row ``logsumexp`` ``[BM]``."""
    m = tl.max(l, axis=1)
    p = tl.exp(l - m[:, None])
    den = tl.sum(p, axis=1)
    return p / den[:, None], m + tl.log(den)


@triton.jit
def _scores(l, sm, SIGMOID: tl.constexpr):
    """Scores from the logits: the softmax ``sm`` or ``sigmoid(l)`` (0 on padded columns)."""
    if SIGMOID:
        return 1.0 / (1.0 + tl.exp(-l))
    return sm


@triton.jit
def _topk(key, val, cols, K, K_P2: tl.constexpr, KEY_IS_VAL: tl.constexpr = False):
    """K passes of a row-wise argmax of ``key [BM, E_P2]`` -> ``(ids [BM, K_P2] int32,
    picked val [BM, K_P2] float32 (0 past K), selection mask [BM, E_P2])``. With ``KEY_IS_VAL`` (``val`` is
    ``key``: no selection-only bias) the picked value is the pass's maximum itself, one row reduction a pass
    instead of two."""
    kc = tl.arange(0, K_P2)[None, :]
    ids = tl.zeros((key.shape[0], K_P2), tl.int32)
    vals = tl.zeros((key.shape[0], K_P2), tl.float32)
    sel = tl.zeros(key.shape, tl.int1)
    for k in range(K):
        top, idx = tl.max(key, axis=1, return_indices=True, return_indices_tie_break_left=True)
        hit = cols[None, :] == idx[:, None]
        if KEY_IS_VAL:
            v = top
        else:
            v = tl.sum(tl.where(hit, val, 0.0), axis=1)
        ids = tl.where(kc == k, idx[:, None], ids)
        vals = tl.where(kc == k, v[:, None], vals)
        sel = sel | hit
        key = tl.where(hit, float("-inf"), key)
    return ids, vals, sel


@triton.jit
def _weights(vals, k_mask, scale, SIGMOID: tl.constexpr, TOPK_FIRST: tl.constexpr, NORM: tl.constexpr):
    """Routing weights ``[BM, K_P2]`` from the picked scores (or, ``TOPK_FIRST``, the picked logits)."""
    if TOPK_FIRST and not SIGMOID:
        v = tl.where(k_mask, vals, float("-inf"))
        p = tl.exp(v - tl.max(v, axis=1)[:, None])
        w = p / tl.sum(p, axis=1)[:, None]
    else:
        w = 1.0 / (1.0 + tl.exp(-vals)) if TOPK_FIRST else vals
        w = tl.where(k_mask, w, 0.0)
        if NORM:
            w = w / (tl.sum(w, axis=1)[:, None] + EPS)
    return w * scale


@triton.jit
def router_fwd_kernel(
    x_ptr,  # [T, H] float16/bfloat16/float32, strides (stride_xt, stride_xh)
    w_ptr,  # [E, H] router weight (cast to x's dtype), strides (stride_we, stride_wh)
    b_ptr,  # [E] router bias; read if HAS_BIAS
    corr_ptr,  # [E] selection-only correction bias; read if HAS_CORR (score-then-top-k only)
    logits_ptr,  # [T, E] float32, contiguous
    scores_ptr,  # [T, E] float32, contiguous
    ids_ptr,  # [T, K] int64, contiguous
    wts_ptr,  # [T, K] float32, contiguous
    stats_ptr,  # [B, NS, 2E + 1] float32: per-program counts [E], probability sums [E], sum lse^2
    H,
    E,
    K,
    S,
    NS,
    stride_xt,
    stride_xh,
    stride_we,
    stride_wh,
    scale,
    SIGMOID: tl.constexpr,
    TOPK_FIRST: tl.constexpr,
    NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_CORR: tl.constexpr,
    PRECISION: tl.constexpr,
    E_P2: tl.constexpr,
    K_P2: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
):
    """Program ``(j, b)``: tokens ``b S + j BM ...`` (at most BM, all in sequence b)."""
    scale = tl.cast(scale, tl.float32)  # float arguments reach Inductor's launch of this kernel as float64
    j = tl.program_id(0)
    b = tl.program_id(1)
    local = j * BM + tl.arange(0, BM)
    m_mask = local < S
    rows = b.to(tl.int64) * S + local
    cols = tl.arange(0, E_P2)
    e_mask = cols < E
    l = _logits(
        x_ptr,
        w_ptr,
        b_ptr,
        rows,
        m_mask,
        cols,
        e_mask,
        H,
        stride_xt,
        stride_xh,
        stride_we,
        stride_wh,
        HAS_BIAS,
        PRECISION,
        BM,
        E_P2,
        BK,
    )
    # each [BM, E_P2] tile is stored, and its statistics taken, as soon as it is made, so that few of them are
    # alive in registers through the top-k passes (at E_P2 = 256 they spilled)
    te = rows[:, None] * E + cols[None, :]
    te_mask = m_mask[:, None] & e_mask[None, :]
    tl.store(logits_ptr + te, l, mask=te_mask)
    sm, lse = _softmax(l)
    s = _scores(l, sm, SIGMOID)
    tl.store(scores_ptr + te, s, mask=te_mask)
    if SIGMOID:
        probs = s / (tl.sum(tl.where(e_mask[None, :], s, 0.0), axis=1)[:, None] + EPS)
    else:
        probs = s
    slot = stats_ptr + (b.to(tl.int64) * NS + j) * (2 * E + 1)
    tl.store(slot + E + cols, tl.sum(tl.where(te_mask, probs, 0.0), axis=0), mask=e_mask)
    tl.store(slot + 2 * E, tl.sum(tl.where(m_mask, lse * lse, 0.0), axis=0))
    if TOPK_FIRST:
        key = l
        val = l
    else:
        key = s
        if HAS_CORR:
            key = s + tl.load(corr_ptr + cols, mask=e_mask, other=0.0).to(tl.float32)[None, :]
        key = tl.where(e_mask[None, :], key, float("-inf"))
        val = s
    ids, vals, sel = _topk(key, val, cols, K, K_P2, TOPK_FIRST or not HAS_CORR)
    kcols = tl.arange(0, K_P2)
    k_mask = (kcols < K)[None, :]
    w = _weights(vals, k_mask, scale, SIGMOID, TOPK_FIRST, NORM)
    tk = rows[:, None] * K + kcols[None, :]
    tk_mask = m_mask[:, None] & k_mask
    tl.store(ids_ptr + tk, ids.to(tl.int64), mask=tk_mask)
    tl.store(wts_ptr + tk, w, mask=tk_mask)
    tl.store(slot + cols, tl.sum((sel & m_mask[:, None]).to(tl.float32), axis=0), mask=e_mask)


@cached
@triton.jit
def router_losses_kernel(
    stats_ptr,  # [B, NS, 2E + 1] float32 per-program statistics (router_fwd_kernel)
    seq_ptr,  # [B, 2E + 1] out: per-sequence statistics (counts, probability sums, sum lse^2)
    counts_ptr,  # [E] out: routed pairs per expert
    loss_ptr,  # [4] out: aux, seq_aux, z and their coefficient-weighted sum (w_aux, w_seq, w_z)
    B,
    NS,
    E,
    c_aux,
    c_seq,
    c_z,  # E / (T^2 K), E / (K S^2 B), 1 / T (0 for T = 0): the losses' scale factors
    w_aux,
    w_seq,
    w_z,
    E_P2: tl.constexpr,
    BJ: tl.constexpr,
):
    """One program: ``aux = c_aux sum_e counts_e P_e``, ``seq = c_seq sum_be counts_be P_be``,
    ``z = c_z sum_t lse_t^2`` (the formulas of :mod:`.losses`, factored), summing the NS slots of each
    sequence BJ at a time in a fixed order (bit-reproducible)."""
    # float arguments reach Inductor's launch of this kernel as float64
    c_aux, c_seq, c_z = tl.cast(c_aux, tl.float32), tl.cast(c_seq, tl.float32), tl.cast(c_z, tl.float32)
    w_aux, w_seq, w_z = tl.cast(w_aux, tl.float32), tl.cast(w_seq, tl.float32), tl.cast(w_z, tl.float32)
    cols = tl.arange(0, E_P2)
    e_mask = cols < E
    js = tl.arange(0, BJ)
    counts = tl.zeros((E_P2,), tl.float32)
    probs = tl.zeros((E_P2,), tl.float32)
    seq = tl.zeros((E_P2,), tl.float32)
    z = tl.zeros((E_P2,), tl.float32)
    for b in range(B):
        cb = tl.zeros((BJ, E_P2), tl.float32)
        pb = tl.zeros((BJ, E_P2), tl.float32)
        zb = tl.zeros((BJ, E_P2), tl.float32)
        for j0 in range(0, NS, BJ):
            j_mask = (j0 + js) < NS
            slot = stats_ptr + ((b * NS + j0 + js).to(tl.int64) * (2 * E + 1))[:, None]
            mask = j_mask[:, None] & e_mask[None, :]
            cb += tl.load(slot + cols[None, :], mask=mask, other=0.0)
            pb += tl.load(slot + E + cols[None, :], mask=mask, other=0.0)
            zb += tl.load(slot + 2 * E + cols[None, :] * 0, mask=j_mask[:, None] & (cols == 0)[None, :], other=0.0)
        cs, ps, zs = tl.sum(cb, axis=0), tl.sum(pb, axis=0), tl.sum(zb, axis=0)
        out = seq_ptr + b * (2 * E + 1)
        tl.store(out + cols, cs, mask=e_mask)
        tl.store(out + E + cols, ps, mask=e_mask)
        tl.store(out + 2 * E + cols, zs, mask=cols == 0)
        counts += cs
        probs += ps
        seq += cs * ps
        z += zs
    tl.store(counts_ptr + cols, counts, mask=e_mask)
    aux = c_aux * tl.sum(counts * probs, axis=0)
    seq_aux = c_seq * tl.sum(seq, axis=0)
    z_loss = c_z * tl.sum(z, axis=0)
    tl.store(loss_ptr, aux)
    tl.store(loss_ptr + 1, seq_aux)
    tl.store(loss_ptr + 2, z_loss)
    tl.store(loss_ptr + 3, w_aux * aux + w_seq * seq_aux + w_z * z_loss)


@triton.jit
def _dense_grad(ids_ptr, gw_ptr, rows, m_mask, cols, K, scale, HAS_GW: tl.constexpr):
    """``d topk_weights * scale`` scattered to ``[BM, E_P2]`` (0 where not selected) and the
    selection mask, from ``ids [T, K]`` and ``gw [T, K]`` (contiguous)."""
    g = tl.zeros((rows.shape[0], cols.shape[0]), tl.float32)
    sel = tl.zeros((rows.shape[0], cols.shape[0]), tl.int1)
    for k in range(K):
        idk = tl.load(ids_ptr + rows * K + k, mask=m_mask, other=-1)
        hit = cols[None, :] == idk[:, None]
        sel = sel | hit
        if HAS_GW:
            gk = tl.load(gw_ptr + rows * K + k, mask=m_mask, other=0.0).to(tl.float32)
            g = tl.where(hit, gk[:, None] * scale, g)
    return g, sel


@triton.jit
def _renorm_grad(g, w, sel, NORM: tl.constexpr):
    """Gradient w.r.t. the raw picked weights ``w`` (dense, 0 off ``sel``) of ``w / (sum w + eps)``
    (or the identity without ``NORM``), given the output gradient ``g``."""
    if NORM:
        den = tl.sum(w, axis=1)[:, None] + EPS
        g = g / den - tl.sum(g * w, axis=1)[:, None] / (den * den)
    return tl.where(sel, g, 0.0)


@cached
@triton.jit
def router_bwd_kernel(
    logits_ptr,  # [T, E] float32, contiguous (the forward's router_logits)
    ids_ptr,  # [T, K] int64, contiguous
    gw_ptr,  # [T, K] d topk_weights, contiguous; read if HAS_GW
    gl_ptr,  # [T, E] d router_logits, contiguous; read if HAS_GL
    gs_ptr,  # [T, E] d scores, contiguous; read if HAS_GS
    gloss_ptr,  # [4] d (aux, seq_aux, z, weighted sum), float32; read if HAS_GLOSS
    counts_ptr,  # [E] float32 routed pairs per expert (router_losses_kernel); read if HAS_GLOSS
    seq_ptr,  # [B, 2E + 1] float32 per-sequence statistics (router_losses_kernel); read if HAS_GLOSS
    dl_ptr,  # [T, E] out: d logits (x's dtype), contiguous
    T,
    E,
    K,
    S,
    scale,
    c_aux,
    c_seq,
    c_z,
    w_aux,
    w_seq,
    w_z,  # as router_losses_kernel
    SIGMOID: tl.constexpr,
    TOPK_FIRST: tl.constexpr,
    NORM: tl.constexpr,
    HAS_GW: tl.constexpr,
    HAS_GL: tl.constexpr,
    HAS_GS: tl.constexpr,
    HAS_GLOSS: tl.constexpr,
    E_P2: tl.constexpr,
    BM: tl.constexpr,
):
    """``d logits`` of the tokens ``pid BM ...``: chain rule through the routing weights, the scores,
    the losses (through the per-sequence probability sums and ``sum logsumexp^2``), plus the direct
    logits gradient."""
    scale = tl.cast(scale, tl.float32)  # float arguments reach Inductor's launch of this kernel as float64
    c_aux, c_seq, c_z = tl.cast(c_aux, tl.float32), tl.cast(c_seq, tl.float32), tl.cast(c_z, tl.float32)
    w_aux, w_seq, w_z = tl.cast(w_aux, tl.float32), tl.cast(w_seq, tl.float32), tl.cast(w_z, tl.float32)
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    m_mask = rows < T
    cols = tl.arange(0, E_P2)
    e_mask = cols < E
    te = rows[:, None] * E + cols[None, :]
    te_mask = m_mask[:, None] & e_mask[None, :]
    l = tl.load(logits_ptr + te, mask=te_mask, other=0.0)
    l = tl.where(e_mask[None, :], l, float("-inf"))
    sm, lse = _softmax(l)
    s = _scores(l, sm, SIGMOID)
    g, sel = _dense_grad(ids_ptr, gw_ptr, rows, m_mask, cols, K, scale, HAS_GW)
    ds = tl.zeros((BM, E_P2), tl.float32)
    dl = tl.zeros((BM, E_P2), tl.float32)
    if HAS_GW:
        if TOPK_FIRST and not SIGMOID:
            v = tl.where(sel, l, float("-inf"))
            mx = tl.max(v, axis=1)
            p = tl.exp(v - tl.where(m_mask, mx, 0.0)[:, None])  # rows past T select nothing
            wk = p / tl.where(m_mask, tl.sum(p, axis=1), 1.0)[:, None]
            dl += wk * (g - tl.sum(g * wk, axis=1)[:, None])
        elif TOPK_FIRST:
            dl += _renorm_grad(g, tl.where(sel, s, 0.0), sel, NORM) * s * (1.0 - s)
        else:
            ds += _renorm_grad(g, tl.where(sel, s, 0.0), sel, NORM)
    if HAS_GS:
        ds += tl.load(gs_ptr + te, mask=te_mask, other=0.0).to(tl.float32)
    if HAS_GLOSS:
        g_sum = tl.load(gloss_ptr + 3)
        g_aux = (tl.load(gloss_ptr) + w_aux * g_sum) * c_aux  # aux = c_aux sum_e counts_e P_e
        g_seq = (tl.load(gloss_ptr + 1) + w_seq * g_sum) * c_seq  # seq = c_seq sum_be counts_be P_be
        gz = (tl.load(gloss_ptr + 2) + w_z * g_sum) * c_z  # z = c_z sum_t lse_t^2
        counts = tl.load(counts_ptr + cols, mask=e_mask, other=0.0)
        counts_seq = tl.load(seq_ptr + (rows // S)[:, None] * (2 * E + 1) + cols[None, :], mask=te_mask, other=0.0)
        gp = g_aux * counts[None, :] + g_seq * counts_seq  # d loss / d probs[t, e]
        if SIGMOID:
            q = tl.sum(s, axis=1)[:, None] + EPS
            gp = gp / q - tl.sum(gp * s, axis=1)[:, None] / (q * q)
        ds += gp
        dl += (2.0 * gz * lse)[:, None] * sm
    if SIGMOID:
        dl += ds * s * (1.0 - s)
    else:
        dl += s * (ds - tl.sum(ds * s, axis=1)[:, None])
    if HAS_GL:
        dl += tl.load(gl_ptr + te, mask=te_mask, other=0.0).to(tl.float32)
    tl.store(dl_ptr + te, dl.to(dl_ptr.dtype.element_ty), mask=te_mask)
