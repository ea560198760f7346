"""The FP8 casts of :mod:`moeyard.quant.fp8` on JAX arrays, for the FP8 recipes emulated on the JAX side.

:func:`fake_quantize` is :func:`moeyard.quant.fp8.fake_quantize` operation for operation: an operand
``t [..., M, K]`` (K the contraction axis) in blocks of ``Blocks.m`` rows by ``Blocks.k`` columns (``k`` None:
the whole row; along K the blocks restart at segment bounds ``offsets``), one scale per block from its
largest magnitude (modes ``float``, ``pow2``, ``e8m0``, ``e8m0_floor``: that module's docstring gives each
rule and its source), the values stored as ``clamp(t / s, -448, 448)`` in ``float8_e4m3fn`` and read back
as ``q * s`` in ``t``'s dtype. The same blocks and scales as the PyTorch side, so the same values with the
power-of-two scales (``pow2``, ``e8m0*``: every division exact). With ``float`` scales (``fp8_blockwise``) the
scale can differ in its last bit or two, and a value that lies on an e4m3 rounding boundary then rounds to the
next step (about 1 in 60,000 here). The cause is that XLA's float32 division on a CPU is not always correctly
rounded: about half the quotients by 448 differ from IEEE's in the last bit.

:func:`moeyard.jax.ffn.scaled_mm` is the expert projection whose GEMMs read such operands under a recipe.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..quant.fp8 import E4M3_EMAX, E4M3_MAX, POW2_EPS, Blocks, check_scale_mode

__all__ = ["fake_quantize"]


def column_blocks(K: int, block_k: int | None, offsets) -> tuple[jax.Array, int]:
    """``(ids [K] int32, count)``: each column's block along K and a static bound on the blocks; with
    ``offsets [G + 1]`` blocks restart at each segment start and columns past ``offsets[G]`` form blocks of
    their own (:func:`moeyard.quant.fp8.column_blocks`)."""
    k = jnp.arange(K, dtype=jnp.int32)
    if offsets is None:
        if block_k is None:
            return jnp.zeros(K, jnp.int32), 1
        return k // block_k, -(-K // block_k)
    offsets = offsets.astype(jnp.int32)
    G = offsets.shape[0] - 1
    seg = jnp.searchsorted(offsets[1:], k, side="right").astype(jnp.int32)  # [K] in [0, G]
    if block_k is None:
        return seg, G + 1
    starts = jnp.concatenate([offsets[:-1], offsets[-1:]])
    lengths = jnp.concatenate([jnp.diff(offsets), jnp.maximum(K - offsets[-1:], 0)])
    tiles = (lengths + block_k - 1) // block_k
    base = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(tiles)[:-1].astype(jnp.int32)])
    return base[seg] + (k - starts[seg]) // block_k, -(-K // block_k) + G + 1


def scales_from_amax(amax, mode: str):
    """Dequantisation scales (float32) of blocks of largest magnitude ``amax``
    (:func:`moeyard.quant.fp8.scales_from_amax`)."""
    check_scale_mode(mode)
    finite = jnp.isfinite(amax)
    if mode == "float":
        return jnp.where(amax > 0, amax / E4M3_MAX, jnp.ones_like(amax))
    if mode == "pow2":
        _, e = jnp.frexp(E4M3_MAX / jnp.maximum(amax, POW2_EPS))
        return jnp.where(finite, jnp.ldexp(jnp.ones_like(amax), 1 - e), amax)
    if mode == "e8m0":
        exponent = jnp.clip(jnp.ceil(jnp.log2(amax / E4M3_MAX)), -127, 127).astype(jnp.int32)
        return jnp.where(finite, jnp.ldexp(jnp.ones_like(amax), exponent), amax)
    _, e = jnp.frexp(amax)
    s = jnp.ldexp(jnp.ones_like(amax), jnp.maximum(e - 1 - E4M3_EMAX, -127))
    s = jnp.where(amax > 0, s, jnp.ldexp(jnp.ones_like(amax), jnp.full_like(e, -127)))
    return jnp.where(finite, s, amax)


def fake_quantize(t, blocks: Blocks, mode: str, offsets=None):
    """``t [..., M, K]`` cast to e4m3 per block and read back in ``t``'s dtype (module docstring); no
    gradient flows through it (:func:`moeyard.jax.ffn.scaled_mm` gives the GEMMs their own).

    Raises:
        ValueError: ``t`` of fewer than 2 dimensions, or an unknown mode.
    """
    if t.ndim < 2:
        raise ValueError(f"t: expected at least 2 dimensions [..., M, K], got shape {tuple(t.shape)}")
    check_scale_mode(mode)
    *lead, M, K = t.shape
    t32 = jax.lax.stop_gradient(t).astype(jnp.float32)
    bm = blocks.m
    Mb = -(-M // bm)
    a = jnp.abs(t32)
    if Mb * bm != M:
        a = jnp.concatenate([a, jnp.zeros((*lead, Mb * bm - M, K), jnp.float32)], axis=-2)
    a = a.reshape(*lead, Mb, bm, K)
    has_nan = jnp.isnan(a).any(axis=-2).astype(jnp.float32)  # XLA's max over rows may drop a NaN; torch's keeps it
    ids, count = column_blocks(K, blocks.k, offsets)
    amax = jnp.zeros((*lead, Mb, count), jnp.float32).at[..., ids].max(a.max(axis=-2))
    nan = jnp.zeros((*lead, Mb, count), jnp.float32).at[..., ids].max(has_nan)
    amax = jnp.where(nan > 0, jnp.nan, amax)  # a block holding a NaN: NaN scale, NaN values
    full = scales_from_amax(amax, mode)[..., ids]  # [..., Mb, K]
    if bm > 1:
        full = jnp.repeat(full, bm, axis=-2)[..., :M, :]
    # a scale below float32's normal range (e8m0's 2^-127 for a block of zeros) reads as 0 where XLA flushes
    # subnormals: its block's values are then 0 (what they round to anyway), not 0 / 0
    q = jnp.clip(t32 / jnp.where(full == 0, 1.0, full), -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return (q.astype(jnp.float32) * full).astype(t.dtype)
