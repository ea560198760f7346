"""Rowwise-scaled e4m3 grouped GEMM in Triton (``tl.dot`` on float8 operands, float32 accumulation), with
the row gather folded into the A loads: the forward and input-gradient GEMMs of the ``fp8_rowwise``
recipes on Hopper (:mod:`moeyard.experts.scaled_hopper`). CUDA; on a CPU under ``TRITON_INTERPRET=1``.

``out[r] = (a[src(r)] * scale_a[src(r)]) @ (b[e] * scale_b[e][:, None])^T`` for the rows
``r`` of expert ``e`` (``offsets[e] <= r < offsets[e + 1]``), with ``src(r) = index[r]`` (``index`` given:
the gather; an index ``>= M`` reads a zero row) or ``r``. Rows past ``offsets[E]`` are not written (as
``torch._scaled_grouped_mm`` leaves them). With a low-rank term (LoRA on an FP8 base: :class:`LowRankTerm`)
each row also gains ``s * z[r] @ lb[e]^T`` after the scales, from ``z [R, rank]`` and ``lb [E, N, rank]`` in
the compute dtype (``z`` rounded to it after the multiplication by ``s``, as the ``triton`` backend's kernels
do): the adapter's product in the compute dtype, added in the float32 accumulator.

Why not ``torch._scaled_grouped_mm`` (CUTLASS): it takes its A rows contiguous, so a gathered operand
costs a copy of its e4m3 rows first. Measured on an H200 (``benchmarks/fp8_triton_probe.py``, the up
projection ``[N, H] x [H, 2I]`` gathered by token, 2026-11-27), ms: qwen3-30b-a3b 1.86 here against 2.23
(gather + CUTLASS), sonic-120b 4.11 against 4.89, sonic-7b 0.54 against 1.25.

On Hopper the warp-specialised Gluon kernel of :mod:`.fp8_gluon` runs instead where it applies (the weight
through TMA, the rows through TMA or gathered by ``cp.async``); ``gluon=False`` (``MOEYARD_FP8_GEMM=triton``
for the recipes, :func:`moeyard.experts.scaled_hopper.gemm_backend`) keeps this kernel.

The reference is :func:`reference` (float32 on the dequantised operands, one GEMM per expert).
Legend: M source rows, R output rows, K reduction, N output columns, E experts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..experts.triton.schedule import dot_precision, expert_tile, max_row_tiles, rank_block, tuned
from ..kernel_op import interpreting
from ..launch import cdiv, next_power_of_2

Tensor = torch.Tensor

CONFIGS = [  # (BN, BK, stages), 8 warps, BM 128: each fits Hopper's shared memory
    triton.Config({"BM": 128, "BN": bn, "BK": bk}, num_warps=8, num_stages=s)
    for bn, bk, s in ((128, 128, 3), (128, 128, 4), (256, 64, 3), (256, 128, 3))
]


@triton.jit
def grouped_kernel(
    a_ptr,  # [M, K] e4m3, unit stride along K, row stride stride_am
    a_scale_ptr,  # [M] float32
    index_ptr,  # [R] int64: source row of each output row (read if GATHER)
    b_ptr,  # [E, N, K] e4m3, rows contiguous, experts stride_be apart
    b_scale_ptr,  # [E, N] float32, contiguous
    offsets_ptr,  # [E + 1] int32: expert e's rows [offsets[e], offsets[e + 1])
    out_ptr,  # [R, N], contiguous
    z_ptr,  # LORA: [R, RANK] rows, row stride stride_zr, unit stride along RANK
    lb_ptr,  # LORA: [E, N, RANK], strides stride_le, stride_ln, stride_lr
    M,
    K,
    N,
    E,
    stride_am,
    stride_be,
    RANK,
    stride_zr,
    stride_le,
    stride_ln,
    stride_lr,
    lora_scale,
    GATHER: tl.constexpr,
    LORA: tl.constexpr,
    RP: tl.constexpr,
    DOT_PREC: tl.constexpr,
    E_P2: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """One (row tile, column tile) of the module docstring's product (``LORA``: with its low-rank term)."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BN)
    e, row0, row_end = expert_tile(pid // n_tiles, offsets_ptr, E, BM, E_P2)
    if e >= E:
        return
    rows = row0 + tl.arange(0, BM)
    m_mask = rows < row_end
    if GATHER:
        src = tl.load(index_ptr + rows, mask=m_mask, other=M)
        a_mask = m_mask & (src < M)
    else:
        src = rows.to(tl.int64)
        a_mask = m_mask
    cols = (pid % n_tiles) * BN + tl.arange(0, BN)
    n_mask = cols < N
    ks = tl.arange(0, BK)
    a_ptrs = a_ptr + src[:, None] * stride_am + ks[None, :]
    b_ptrs = b_ptr + e.to(tl.int64) * stride_be + cols.to(tl.int64)[None, :] * K + ks[:, None]
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, K, BK):
        k_mask = (k0 + ks) < K
        a = tl.load(a_ptrs, mask=a_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BK
        b_ptrs += BK
    sa = tl.load(a_scale_ptr + src, mask=a_mask, other=0.0)
    sb = tl.load(b_scale_ptr + e * N + cols, mask=n_mask, other=0.0)
    acc = acc * sa[:, None] * sb[None, :]
    if LORA:
        rk = tl.arange(0, RP)
        r_mask = rk < RANK
        z = tl.load(
            z_ptr + rows.to(tl.int64)[:, None] * stride_zr + rk[None, :], mask=m_mask[:, None] & r_mask[None, :]
        )
        z = (z.to(tl.float32) * lora_scale).to(z_ptr.dtype.element_ty)
        lb = tl.load(
            lb_ptr + e.to(tl.int64) * stride_le + cols.to(tl.int64)[None, :] * stride_ln + rk[:, None] * stride_lr,
            mask=r_mask[:, None] & n_mask[None, :],
        )
        acc = tl.dot(z, lb, acc, input_precision=DOT_PREC)
    out = out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


SMALL = {"BM": 16, "BN": 32, "BK": 32}  # the interpreter's tile
RANK_MULTIPLE = 8  # a low-rank term's rank is padded to a multiple of this (16-byte rows of z for TMA)
FIXED = {"BM": 128, "BN": 128, "BK": 128, "num_warps": 8, "num_stages": 3}  # MOEYARD_TRITON_AUTOTUNE=0


@functools.cache
def _launcher():
    """The kernel autotuned over ``CONFIGS`` (every one fits Hopper's shared memory), or one fixed config
    under the interpreter and with ``MOEYARD_TRITON_AUTOTUNE=0`` (:func:`moeyard.experts.triton.schedule.tuned`)."""
    return tuned(
        grouped_kernel,
        CONFIGS,
        ["K", "N", "GATHER", "LORA"],
        prune=lambda configs, named_args, **kw: configs,
        fixed=SMALL if interpreting() else FIXED,
    )


@dataclass(frozen=True)
class LowRankTerm:
    """The low-rank term ``s * z[r] @ lb[e]^T`` that :func:`grouped_mm` adds to each row ``r`` of expert ``e``
    (LoRA on an FP8 base: ``z = x A_e^T`` and ``lb = B`` for a forward GEMM, ``z = dy B_e`` and ``lb = A^T``
    for an input gradient; Hu et al., LoRA, arXiv 2106.09685).

    Attributes: z ``[R, rank]`` (the output's rows, unit stride along rank), lb ``[E, N, rank]`` (any
    strides), both in the output dtype; scale ``s``."""

    z: Tensor
    lb: Tensor
    scale: float


def grouped_mm(
    a: Tensor,
    scale_a: Tensor,
    b: Tensor,
    scale_b: Tensor,
    offsets: Tensor,
    out_dtype: torch.dtype,
    *,
    index: Tensor | None = None,
    gluon: bool = True,
    tiles: TileTable | None = None,
    lora: LowRankTerm | None = None,
) -> Tensor:
    """The module docstring's product: ``a [M, K]`` e4m3 (unit stride along K) with ``scale_a [M]``,
    ``b [E, N, K]`` e4m3 with ``scale_b [E, N]`` (a ``b`` whose experts' ``[N, K]`` are each contiguous and
    do not overlap, e.g. a slice of a wider ``[E, N', K]``, is read as is; else copied), ``offsets [E + 1]``
    int32, optional ``index [R]`` int64, optional low-rank term ``lora`` (:class:`LowRankTerm`) -> ``[R, N]``
    ``out_dtype`` (``R = index.numel()``, else M). ``offsets[E] <= R`` is the caller's to keep (checking it
    would need a host sync). On Hopper the Gluon kernel of :mod:`.fp8_gluon` runs where it applies (module
    docstring; ``gluon=False``: the Triton kernel everywhere), with its tile table from ``tiles`` when given
    (:class:`TileTable`: one per step's offsets, shared by its GEMMs). No host sync.

    Raises:
        TypeError: ``a`` or ``b`` not float8_e4m3fn, a scale not float32, or the low-rank term's tensors not
            in ``out_dtype``.
        ValueError: shapes that do not agree (named).
    """
    for name, t in (("a", a), ("b", b)):
        if t.dtype != torch.float8_e4m3fn:
            raise TypeError(f"grouped_mm: {name} must be float8_e4m3fn, got {t.dtype}")
    for name, t in (("scale_a", scale_a), ("scale_b", scale_b)):
        if t.dtype != torch.float32:
            raise TypeError(f"grouped_mm: {name} must be float32, got {t.dtype}")
    M, K = a.shape
    E, N, Kb = b.shape
    if Kb != K or a.stride(1) != 1:
        raise ValueError(
            f"grouped_mm: a [M, K] (unit stride along K) and b [E, N, K] must share K, got {a.shape}, {b.shape}"
        )
    if scale_a.shape != (M,) or scale_b.shape != (E, N) or offsets.shape != (E + 1,):
        raise ValueError(
            f"grouped_mm: expected scale_a [{M}], scale_b [{E}, {N}], offsets [{E + 1}], got "
            f"{tuple(scale_a.shape)}, {tuple(scale_b.shape)}, {tuple(offsets.shape)}"
        )
    R = index.numel() if index is not None else M
    lora = _checked_term(lora, R, E, N, out_dtype)
    out = torch.empty(R, N, dtype=out_dtype, device=a.device)
    if R == 0 or N == 0:
        return out
    rows_kept = b.stride(2) == 1 and b.stride(1) == K and b.stride(0) >= N * K  # e.g. a slice of experts' rows
    b = b if rows_kept else b.contiguous()
    scale_b, scale_a = scale_b.contiguous(), scale_a.contiguous()
    if gluon and _gluon_ready(a, b, index, lora):
        from . import fp8_gluon

        table = tiles.get(offsets, R) if tiles is not None else None
        fp8_gluon.launch(a, scale_a, b, scale_b, offsets, out, index, table, lora)
        return out
    z, lb = (lora.z, lora.lb) if lora is not None else (out, out)  # placeholders when there is no term
    args = (
        a,
        scale_a,
        index if index is not None else scale_a,
        b,
        scale_b,
        offsets,
        out,
        z,
        lb,
        M,
        K,
        N,
        E,
        a.stride(0),
        b.stride(0),
        lora.z.shape[1] if lora is not None else 0,
        z.stride(0),
        *(lb.stride() if lora is not None else (0, 0, 0)),
        lora.scale if lora is not None else 0.0,
    )
    meta = dict(
        GATHER=index is not None,
        LORA=lora is not None,
        RP=rank_block(lora.z.shape[1]) if lora is not None else 16,
        DOT_PREC=dot_precision(out_dtype),
        E_P2=next_power_of_2(max(E, 2)),
    )
    _launcher()[lambda m: (max_row_tiles(R, E, m["BM"]) * cdiv(N, m["BN"]),)](*args, **meta)
    return out


def _checked_term(lora: LowRankTerm | None, R: int, E: int, N: int, dtype: torch.dtype) -> LowRankTerm | None:
    """``lora`` with ``z``'s rows made unit-stride along the rank if they were not (a copy), and a rank that is
    no multiple of :data:`RANK_MULTIPLE` padded with zeros up to one (copies of ``z`` and ``lb``, a few MB),
    after checking its shapes and dtypes against the product's ``R`` rows, ``E`` experts, ``N`` columns and
    output ``dtype``."""
    if lora is None:
        return None
    z, lb = lora.z, lora.lb
    if z.dim() != 2 or z.shape[0] != R or lb.shape[:2] != (E, N) or lb.shape[2] != z.shape[1]:
        raise ValueError(
            f"grouped_mm: expected lora.z [{R}, rank] and lora.lb [{E}, {N}, rank], got {tuple(z.shape)}, "
            f"{tuple(lb.shape)}"
        )
    if z.dtype != dtype or lb.dtype != dtype:
        raise TypeError(f"grouped_mm: lora.z and lora.lb must be {dtype} (the output's), got {z.dtype}, {lb.dtype}")
    pad = -z.shape[1] % RANK_MULTIPLE
    if pad:  # zero columns: the same product, rows 16-byte strided as the Gluon kernel's TMA boxes need
        return LowRankTerm(torch.nn.functional.pad(z, (0, pad)), torch.nn.functional.pad(lb, (0, pad)), lora.scale)
    return lora if z.stride(1) == 1 else LowRankTerm(z.contiguous(), lb, lora.scale)


class TileTable:
    """The Gluon kernel's tile table (:func:`.fp8_gluon.tile_table`) for the GEMMs of one step that share
    their offsets: made on the first :meth:`get` and handed out again while the same offsets tensor (the
    same object, not modified in place since) and row count come back; other offsets get a table of their
    own, not kept."""

    def __init__(self):
        self._key: tuple | None = None
        self._offsets: Tensor | None = None  # held, so its memory cannot carry other offsets meanwhile
        self._table: Tensor | None = None

    def get(self, offsets: Tensor, rows: int) -> Tensor:
        """The table for ``offsets [E + 1]`` int32 and ``rows`` output rows."""
        from . import fp8_gluon

        key = (offsets._version, rows)
        if self._table is None or offsets is not self._offsets or key != self._key:
            if self._table is not None:  # other offsets: their own table, this one kept
                return fp8_gluon.tile_table(offsets, rows)
            self._key, self._offsets, self._table = key, offsets, fp8_gluon.tile_table(offsets, rows)
        return self._table


def _gluon_ready(a: Tensor, b: Tensor, index: Tensor | None, lora: LowRankTerm | None = None) -> bool:
    """Whether :func:`grouped_mm` can run on :mod:`.fp8_gluon`: not under the interpreter (Gluon has none),
    and :func:`.fp8_gluon.ready`."""
    if interpreting() or not a.is_cuda:
        return False
    try:
        from . import fp8_gluon
    except ImportError:  # a Triton without Gluon
        return False
    return fp8_gluon.ready(a, b, index, lora)


def reference(
    a: Tensor,
    scale_a: Tensor,
    b: Tensor,
    scale_b: Tensor,
    offsets: Tensor,
    out_dtype: torch.dtype,
    *,
    index: Tensor | None = None,
    lora: LowRankTerm | None = None,
) -> Tensor:
    """:func:`grouped_mm` in float32 on the dequantised operands, one GEMM per expert (host sync; rows past
    ``offsets[E]`` zero); the low-rank term's ``s z`` rounded to the output dtype first, as the kernels do."""
    M = a.shape[0]
    ad = torch.cat([a.float() * scale_a[:, None], a.new_zeros(1, a.shape[1], dtype=torch.float32)])
    src = index.clamp(max=M) if index is not None else torch.arange(M)
    rows = ad[src.to(a.device)]
    out = torch.zeros(rows.shape[0], b.shape[1], device=a.device)
    bounds = offsets.tolist()
    for e in range(b.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        out[lo:hi] = rows[lo:hi] @ (b[e].float() * scale_b[e][:, None]).t()
        if lora is not None:
            z = (lora.z[lo:hi].float() * lora.scale).to(out_dtype).float()
            out[lo:hi] += z @ lora.lb[e].float().t()
    return out.to(out_dtype)
