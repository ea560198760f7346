"""FP8 casts with per-block scales: the reference every FP8 path is tested against.

A GEMM operand ``t [..., M, K]`` (K, the last axis, is the GEMM's contraction axis) is split into
blocks of ``Blocks.m`` rows by ``Blocks.k`` columns; each block gets one scale ``s`` and its values
are stored as ``clamp(t / s, -448, 448)`` in ``float8_e4m3fn`` (saturating: OCP 8-bit floating point
specification, OFP8 rev. 1.0, E4M3 max normal 448). Dequantised: ``q * s``. ``Blocks.k = None`` is the
whole row: "rowwise" (per-channel) scaling. Along K, blocks may restart at segment bounds
(``offsets``): the weight gradient of a grouped GEMM contracts over each expert's tokens, so its
scales are per expert ("per token group", torchao's rowwise MoE recipe) and never straddle two experts.

Scale modes (``s`` from the block's largest magnitude ``amax``, computed in float32):

- ``"float"``: ``s = amax / 448`` (DeepSeek-V3, arXiv 2412.19437, section 3.3: tile/block scales).
- ``"pow2"``: ``s = 2^-floor(log2(448 / max(amax, 1e-12)))``, the float scale rounded up to a power of two, so
  scaling is exact in binary (torchao's ``round_scales_to_power_of_2``, used by its rowwise MoE recipe).
- ``"e8m0"``: ``s = 2^ceil(log2(amax / 448))``, clamped to e8m0's ``2^-127 .. 2^127``: a power-of-two
  shared scale in the MX format (OCP Microscaling Formats v1.0, 8-bit exponent ``E8M0``) rounded up, so
  no element saturates (the "RCEIL" derivation of cuBLAS's MXFP8 block quantisation and torchao's
  ``ScaleCalculationMode.RCEIL``, its MXFP8 training default).
- ``"e8m0_floor"``: ``s = 2^(floor(log2(amax)) - 8)``, the MX v1.0 spec's own rule (section 6.3: shared
  exponent ``floor(log2(amax)) - emax_elem``, ``emax_elem = 8`` for E4M3); a block's largest values may
  exceed 448 s and saturate (torchao's ``ScaleCalculationMode.FLOOR``).

A block of zeros gets ``s = 1`` (``float``, ``pow2``) or ``2^-127`` (``e8m0*``) and stays zero; NaN or
infinity in a block makes its values NaN (never a silent finite result). Everything runs on the
device with static shapes (no host sync).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
E4M3_EMAX = 8  # OCP MX v1.0, table 1: emax_elem of FP8 E4M3
SCALE_MODES = ("float", "pow2", "e8m0", "e8m0_floor")
POW2_EPS = 1e-12  # torchao's floor on amax before a power-of-two scale


@dataclass(frozen=True)
class Blocks:
    """The scaling blocks of one GEMM operand ``[..., M, K]`` (K the contraction axis).

    Attributes:
        k: elements per block along K (within each segment when the cast is given ``offsets``), or
            None for the whole axis (the whole segment).
        m: rows per block (1: one scale per row; 128: DeepSeek-V3's 128 x 128 weight blocks).
    """

    k: int | None
    m: int = 1

    def __post_init__(self):
        for name, v in (("k", self.k), ("m", self.m)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(
                    f"Blocks.{name}: expected a positive int{' or None' if name == 'k' else ''}, got {v!r}"
                )

    def transposed(self) -> Blocks:
        """The same blocks seen from the transposed operand (``[K, M]`` contracting over M): only
        square blocks, or whole-axis rows of single elements, keep their meaning."""
        return Blocks(k=self.m, m=self.k) if self.k is not None else self


def check_scale_mode(mode: str) -> None:
    if mode not in SCALE_MODES:
        raise ValueError(f"scale mode: expected one of {SCALE_MODES}, got {mode!r}")


def column_blocks(K: int, block_k: int | None, offsets: Tensor | None, device) -> tuple[Tensor, int]:
    """``(ids [K] int64, count)``: the block of each column along K and a static bound on the number
    of blocks. With ``offsets`` (``[G + 1]`` int, non-decreasing, ``offsets[0] == 0``), blocks restart at
    each segment start; columns past ``offsets[G]`` form blocks of their own. No host sync."""
    k = torch.arange(K, device=device)
    if offsets is None:
        if block_k is None:
            return torch.zeros(K, dtype=torch.int64, device=device), 1
        return k // block_k, -(-K // block_k)
    offsets = offsets.to(device=device, dtype=torch.int64)
    G = offsets.numel() - 1
    seg = torch.searchsorted(offsets[1:], k, right=True)  # [K] in [0, G]; G: past the last segment
    if block_k is None:
        return seg, G + 1
    starts = torch.cat([offsets[:-1], offsets[-1:]])  # start of each segment, the tail's too: [G + 1]
    lengths = torch.cat([offsets.diff(), (K - offsets[-1:]).clamp(min=0)])
    tiles = (lengths + block_k - 1) // block_k
    base = torch.cat([tiles.new_zeros(1), tiles.cumsum(0)[:-1]])
    return base[seg] + (k - starts[seg]) // block_k, -(-K // block_k) + G + 1


def block_amax(t: Tensor, blocks: Blocks, offsets: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(amax [..., ceil(M / m), count] float32, column ids [K])`` of ``|t|`` per block."""
    *lead, M, K = t.shape
    a = t.detach().abs().float()
    bm = blocks.m
    Mb = -(-M // bm)
    if Mb * bm != M:
        a = torch.cat([a, a.new_zeros(*lead, Mb * bm - M, K)], dim=-2)
    a = a.reshape(*lead, Mb, bm, K).amax(dim=-2)  # [..., Mb, K]
    ids, count = column_blocks(K, blocks.k, offsets, t.device)
    out = a.new_zeros(*lead, Mb, count)
    return out.scatter_reduce_(-1, ids.expand_as(a), a, "amax"), ids


def scales_from_amax(amax: Tensor, mode: str) -> Tensor:
    """Dequantisation scales ``s`` (float32) for blocks of largest magnitude ``amax`` (module docstring)."""
    check_scale_mode(mode)
    if mode == "float":
        return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    if mode == "pow2":
        inv = E4M3_MAX / amax.clamp(min=POW2_EPS)  # torchao's quantisation scale (float8_utils.EPS floor)
        _, e = torch.frexp(inv)  # inv = m * 2^e, m in [0.5, 1): floor(log2(inv)) = e - 1
        s = torch.ldexp(torch.ones_like(amax), 1 - e)
        return torch.where(torch.isfinite(amax), s, amax)  # NaN / inf stay visible
    if mode == "e8m0":  # torchao's RCEIL fallback, operation for operation (bit-equal scales)
        exponent = torch.ceil(torch.log2(amax / E4M3_MAX)).clamp(-127, 127)
        s = torch.exp2(exponent)
        return torch.where(torch.isfinite(amax), s, amax)
    _, e = torch.frexp(amax)
    exponent = (e - 1 - E4M3_EMAX).clamp(min=-127)  # e8m0 holds 2^-127 .. 2^127
    s = torch.ldexp(torch.ones_like(amax), exponent)
    s = torch.where(amax > 0, s, torch.full_like(amax, 2.0**-127))
    return torch.where(torch.isfinite(amax), s, amax)


def expand_scales(scale: Tensor, ids: Tensor, blocks: Blocks, M: int) -> Tensor:
    """``[..., Mb, count]`` block scales -> ``[..., M, K]``, each element's scale."""
    full = scale.index_select(-1, ids)  # [..., Mb, K]
    if blocks.m > 1:
        full = full.repeat_interleave(blocks.m, dim=-2)[..., :M, :]
    return full


def quantize(t: Tensor, blocks: Blocks, mode: str, offsets: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Cast ``t [..., M, K]`` (float) to e4m3 with one scale per block.

    Args:
        t: the operand; K (last axis) is the contraction axis.
        blocks: the scaling blocks (:class:`Blocks`).
        mode: ``"float"``, ``"pow2"`` or ``"e8m0"`` (module docstring).
        offsets: optional ``[G + 1]`` segment bounds along K (blocks never straddle them).
    Returns:
        ``(q [..., M, K] float8_e4m3fn, scale [..., ceil(M / m), count] float32)``; ``count`` is a
        static bound (:func:`column_blocks`), so blocks past the data hold scale 1 / 2^-127.
    Raises:
        TypeError: ``t`` not a floating-point tensor. ValueError: ``t`` of fewer than 2 dimensions,
        an unknown mode.
    """
    if not isinstance(t, Tensor) or not t.is_floating_point():
        raise TypeError(f"t: expected a floating-point tensor, got {type(t).__name__}")
    if t.dim() < 2:
        raise ValueError(f"t: expected at least 2 dimensions [..., M, K], got shape {tuple(t.shape)}")
    amax, ids = block_amax(t, blocks, offsets)
    scale = scales_from_amax(amax, mode)
    full = expand_scales(scale, ids, blocks, t.shape[-2])
    q = (t.float() / full).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale


def dequantize(
    q: Tensor, scale: Tensor, blocks: Blocks, offsets: Tensor | None = None, dtype: torch.dtype = torch.float32
) -> Tensor:
    """The inverse of :func:`quantize`: ``q * s`` per block, in ``dtype``."""
    ids, _ = column_blocks(q.shape[-1], blocks.k, offsets, q.device)
    return (q.float() * expand_scales(scale, ids, blocks, q.shape[-2])).to(dtype)


def fake_quantize(t: Tensor, blocks: Blocks, mode: str, offsets: Tensor | None = None) -> Tensor:
    """``dequantize(quantize(t))`` in ``t``'s dtype: the values an FP8 GEMM sees, for emulation."""
    q, scale = quantize(t, blocks, mode, offsets)
    return dequantize(q, scale, blocks, offsets, dtype=t.dtype)
