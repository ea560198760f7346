"""Grouped (ragged) GEMMs written with Pallas, lowered to Triton on GPUs: the three products of the routed
expert FFN without XLA's GPU lowering of ``jax.lax.ragged_dot`` (which rewrites it into a dense,
zero-padded GEMM on jax 0.11).

Legend: R rows (expert-major: the first ``group_sizes[0]`` rows belong to expert 0, and so on), E experts,
``in`` / ``out`` the weight's input and output sizes.

- :func:`gmm`: ``rows [R, in]`` -> ``[R, out]``, the rows of group e times expert e's weight
  (``w [E, out, in]``, or ``[E, in, out]`` when ``transposed``);
- :func:`gmm_t`: ``g [R, out]`` -> ``[R, in]``, the input gradient of :func:`gmm`;
- :func:`tgmm`: ``lhs [R, in]``, ``ct [R, out]`` -> ``dw [E, out, in]`` (``[E, in, out]`` when
  ``transposed``), ``dw_e = ct_e^T lhs_e``: the weight gradient of :func:`gmm`.

Rows past the last group (``R > sum(group_sizes)``) give zero rows; experts with no rows give zero weight
gradients; ``group_sizes`` past ``R`` are cut at ``R`` (negative sizes count as zero).

How: static shapes, no host sync. A tile table built in JAX from ``group_sizes`` (cumsum, searchsorted)
lists, for each of ``cdiv(R, BM) + E`` entries, the expert, first row and row end of a tile of at most BM
rows that starts at its group's start (the tail past the last group is one more group, whose tiles write
zeros; unused entries write nothing), so every output row is written exactly once. :func:`gmm` runs one
program per (output column tile, table entry), looping over ``in`` in BK steps with masked loads and a
float32 accumulator; :func:`tgmm` runs one program per (out tile, in tile, expert), looping over the
expert's rows in BK-row chunks. Sizes need not be multiples of the tiles (masks).

Dtypes: bfloat16, float16 or float32 operands (the weight is cast to the rows' dtype), float32
accumulation, output in the operand dtype (:func:`tgmm`: ``out_dtype``). moeyard's FFN uses these for
bfloat16 / float16 only (:mod:`.ffn`): a float32 Pallas-Triton dot is not PyTorch's float32 product.

Off GPUs the kernels run in Pallas's interpret mode (``interpret=None`` decides from the default backend):
correct and slow, for tests; inside ``jax.shard_map`` that mode cannot run on operands varying over a
mesh axis (JAX's interpreter mixes them with the invariant program ids) and raises NotImplementedError.
Compiled for a GPU, the output is typed varying over the union of the operands' mesh axes (the weight's
gradient summed over the axes the weight does not vary over). :func:`gmm` and :func:`gmm_t` are differentiable (a ``jax.custom_vjp``: the
rows' gradient is the other one of the two, the weight's :func:`tgmm`; ``group_sizes`` gets none);
:func:`tgmm` is not.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .checks import match_varying, to_varying, varying_axes

__all__ = ["TileConfig", "GPU_CONFIG", "INTERPRET_CONFIG", "gmm", "gmm_t", "tgmm", "tile_table", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes and Triton launch parameters (hashable: a static argument).

    Attributes:
        block_m: rows per tile (:func:`gmm`), or rows of ``dw``'s tile (:func:`tgmm`).
        block_n: output columns per tile.
        block_k: contraction step: columns of the rows (:func:`gmm`), rows of the group (:func:`tgmm`).
        num_warps, num_stages: Triton's (ignored in interpret mode).

    Triton needs powers of two of at least 16 for the blocks of its dots.
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k", "num_warps", "num_stages"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected a positive int, got {v!r}")
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v & (v - 1):
                raise ValueError(f"{name}: expected a power of two, got {v}")


# 128 x 256 tiles: 1.1-1.2x the 128 x 128 ones at qwen3-30b-a3b's three up-projection GEMMs on an H100 (up 1.80
# against 2.19 ms, its input gradient 1.99 against 2.20, its weight gradient 1.78 against 1.98;
# benchmarks/jax_gmm_probe.py, benchmarks/NOTES.md round 40)
GPU_CONFIG = TileConfig(block_n=256)
INTERPRET_CONFIG = TileConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=1)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _interpret(interpret) -> bool:
    """Interpret mode unless asked otherwise or on a GPU backend."""
    return jax.default_backend() != "gpu" if interpret is None else bool(interpret)


def _config(config, interpret: bool) -> TileConfig:
    if config is None:
        return INTERPRET_CONFIG if interpret else GPU_CONFIG
    if not isinstance(config, TileConfig):
        raise TypeError(f"config: expected a TileConfig, got a {type(config).__name__}")
    return config


def _launch(kernel, out_shape, dtype, grid, config: TileConfig, interpret: bool, name: str, *args):
    """``pallas_call`` of ``kernel`` over ``grid`` on ``args``; inside ``jax.shard_map`` the inputs are
    typed varying over the union of their mesh axes and so is the output (``pallas_call`` needs its
    output's type there)."""
    axes = frozenset().union(*(varying_axes(a) for a in args))
    if interpret and axes:
        raise NotImplementedError(
            "moeyard.jax.gmm: Pallas's interpret mode cannot run on operands varying over the mesh axes "
            f"{sorted(axes)} inside jax.shard_map (use jax.lax.ragged_dot there, or a GPU)"
        )
    args = [to_varying(a, axes) for a in args]
    return pl.pallas_call(
        kernel,
        out_shape=_shape_struct(out_shape, dtype, axes),
        grid=grid,
        interpret=interpret,
        compiler_params=_compiler_params(config),
        name=name,
    )(*args)


def _shape_struct(shape, dtype, axes: frozenset):
    """A ``jax.ShapeDtypeStruct`` varying over mesh ``axes`` (none: a plain one)."""
    if not axes:
        return jax.ShapeDtypeStruct(shape, dtype)
    manual = getattr(jax.sharding, "ManualAxisType", None)
    if manual is not None:
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=manual(varying=axes))
    return jax.ShapeDtypeStruct(shape, dtype, vma=axes)  # releases before ManualAxisType


def _compiler_params(config: TileConfig):
    return plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)


# ---- the tile table ---------------------------------------------------------------------------------


def group_bounds(group_sizes, num_rows: int):
    """``[E + 2]`` int32: each group's first row, then the end of the last group, then ``num_rows`` (the
    tail past the last group is group E). Sizes are clipped at zero, the bounds at ``num_rows``."""
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes, dtype=jnp.int32), num_rows)
    zero, last = jnp.zeros(1, jnp.int32), jnp.full((1,), num_rows, jnp.int32)
    return jnp.concatenate([zero, ends, last])


def tile_table(group_sizes, num_rows: int, block_m: int):
    """Row tiles of the groups: ``(expert, start, end)``, three ``[cdiv(R, BM) + E]`` int32 arrays.

    Entry i covers rows ``[start, end)`` (at most ``block_m``, all of one group; tiles start at their
    group's first row). ``expert`` is the group (0..E-1), E for the tail past the last group (zeros to
    write), E + 1 for an unused entry (``start == end == 0``). Every row in ``[0, R)`` lies in exactly
    one entry: the groups' tiles number ``sum_g cdiv(n_g, BM) <= cdiv(R, BM) + E`` over the E + 1 groups.
    """
    E = group_sizes.shape[0]
    bounds = group_bounds(group_sizes, num_rows)
    starts, ends = bounds[:-1], bounds[1:]  # [E + 1]
    counts = (ends - starts + block_m - 1) // block_m
    tile_end = jnp.cumsum(counts, dtype=jnp.int32)
    i = jnp.arange(_cdiv(num_rows, block_m) + E, dtype=jnp.int32)
    group = jnp.searchsorted(tile_end, i, side="right").astype(jnp.int32)  # E + 1: unused
    used = group <= E
    g = jnp.minimum(group, E)
    start = starts[g] + (i - (tile_end[g] - counts[g])) * block_m
    end = jnp.minimum(start + block_m, ends[g])
    return group, jnp.where(used, start, 0), jnp.where(used, end, 0)


# ---- the kernels --------------------------------------------------------------------------------------


def _gmm_kernel(expert_ref, start_ref, end_ref, lhs_ref, w_ref, out_ref, *, w_kn, num_experts, k_size, n_size, cfg):
    """One (column tile, table entry): ``out[start:end, n0:n0+BN] = lhs[start:end] @ w_e`` (``w_e`` read
    ``[K, N]`` when ``w_kn`` else ``[N, K]``), zeros for the tail, nothing for unused entries."""
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    t = pl.program_id(1)
    e, start, end = expert_ref[t], start_ref[t], end_ref[t]
    n0 = pl.program_id(0) * bn
    row_ok = (start + jnp.arange(bm, dtype=jnp.int32)) < end
    col_ok = (n0 + jnp.arange(bn, dtype=jnp.int32)) < n_size
    out_mask = row_ok[:, None] & col_ok[None, :]
    out_at = out_ref.at[pl.ds(start, bm), pl.ds(n0, bn)]

    @pl.when(e < num_experts)
    def _():
        def body(i, acc):
            k0 = i * bk
            k_ok = (k0 + jnp.arange(bk, dtype=jnp.int32)) < k_size
            a = plgpu.load(lhs_ref.at[pl.ds(start, bm), pl.ds(k0, bk)], mask=row_ok[:, None] & k_ok[None, :], other=0)
            if w_kn:
                b = plgpu.load(w_ref.at[e, pl.ds(k0, bk), pl.ds(n0, bn)], mask=k_ok[:, None] & col_ok[None, :], other=0)
                dims = ((1,), (0,))
            else:
                b = plgpu.load(w_ref.at[e, pl.ds(n0, bn), pl.ds(k0, bk)], mask=col_ok[:, None] & k_ok[None, :], other=0)
                dims = ((1,), (1,))
            return acc + jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, _cdiv(k_size, bk), body, jnp.zeros((bm, bn), jnp.float32))
        plgpu.store(out_at, acc.astype(out_ref.dtype), mask=out_mask)

    @pl.when(e == num_experts)
    def _():
        plgpu.store(out_at, jnp.zeros((bm, bn), out_ref.dtype), mask=out_mask)


def _tgmm_kernel(bounds_ref, a_ref, b_ref, out_ref, *, m_size, n_size, cfg):
    """One (n tile, m tile, expert e): ``out[e, m tile, n tile] = a_e^T b_e`` over the expert's rows
    ``[bounds[e], bounds[e + 1])`` in BK-row chunks; zeros for an expert without rows."""
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    n0, m0, e = pl.program_id(0) * bn, pl.program_id(1) * bm, pl.program_id(2)
    start, end = bounds_ref[e], bounds_ref[e + 1]
    m_ok = (m0 + jnp.arange(bm, dtype=jnp.int32)) < m_size
    n_ok = (n0 + jnp.arange(bn, dtype=jnp.int32)) < n_size

    def body(i, acc):
        r0 = start + i * bk
        r_ok = (r0 + jnp.arange(bk, dtype=jnp.int32)) < end
        a = plgpu.load(a_ref.at[pl.ds(r0, bk), pl.ds(m0, bm)], mask=r_ok[:, None] & m_ok[None, :], other=0)
        b = plgpu.load(b_ref.at[pl.ds(r0, bk), pl.ds(n0, bn)], mask=r_ok[:, None] & n_ok[None, :], other=0)
        return acc + jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    steps = (end - start + bk - 1) // bk
    acc = jax.lax.fori_loop(jnp.int32(0), steps, body, jnp.zeros((bm, bn), jnp.float32))
    mask = m_ok[:, None] & n_ok[None, :]
    plgpu.store(out_ref.at[e, pl.ds(m0, bm), pl.ds(n0, bn)], acc.astype(out_ref.dtype), mask=mask)


# ---- the calls ----------------------------------------------------------------------------------------


def _check(name: str, a, ndim: int) -> None:
    if not isinstance(a, (jax.Array, jax.core.Tracer)) and not hasattr(a, "dtype"):
        raise TypeError(f"{name}: expected an array, got a {type(a).__name__}")
    if jnp.dtype(a.dtype) not in [jnp.dtype(d) for d in SUPPORTED_DTYPES]:
        raise TypeError(f"{name}: expected bfloat16, float16 or float32, got {a.dtype}")
    if a.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D array, got shape {tuple(a.shape)}")


def _check_groups(group_sizes, num_experts: int) -> None:
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer) or group_sizes.shape != (num_experts,):
        raise ValueError(
            f"group_sizes: expected an integer array of shape ({num_experts},), got {group_sizes.dtype} "
            f"{tuple(group_sizes.shape)}"
        )


def _grouped(lhs, w, group_sizes, w_kn: bool, config: TileConfig, interpret: bool):
    """``lhs [R, K]`` -> ``[R, N]`` with expert e's ``w[e]`` stored ``[K, N]`` (``w_kn``) or ``[N, K]``."""
    R, K = lhs.shape
    E = w.shape[0]
    N = w.shape[2] if w_kn else w.shape[1]
    w = w.astype(lhs.dtype)
    if R == 0 or N == 0:
        return jnp.zeros((R, N), lhs.dtype)
    expert, start, end = tile_table(group_sizes, R, config.block_m)
    kernel = partial(_gmm_kernel, w_kn=w_kn, num_experts=E, k_size=K, n_size=N, cfg=config)
    grid = (_cdiv(N, config.block_n), expert.shape[0])
    return _launch(kernel, (R, N), lhs.dtype, grid, config, interpret, "moeyard_gmm", expert, start, end, lhs, w)


def _tgmm(a, b, group_sizes, out_dtype, config: TileConfig, interpret: bool):
    """``a [R, M]``, ``b [R, N]`` -> ``[E, M, N]``: ``a_e^T b_e`` per group, in ``out_dtype``."""
    R, M = a.shape
    N = b.shape[1]
    E = group_sizes.shape[0]
    b = b.astype(a.dtype)
    if E == 0 or M == 0 or N == 0 or R == 0:
        return jnp.zeros((E, M, N), out_dtype)
    bounds = group_bounds(group_sizes, R)
    kernel = partial(_tgmm_kernel, m_size=M, n_size=N, cfg=config)
    grid = (_cdiv(N, config.block_n), _cdiv(M, config.block_m), E)
    return _launch(kernel, (E, M, N), out_dtype, grid, config, interpret, "moeyard_tgmm", bounds, a, b)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _grouped_vjp(lhs, w, group_sizes, w_kn, config, interpret):
    return _grouped(lhs, w, group_sizes, w_kn, config, interpret)


def _grouped_fwd(lhs, w, group_sizes, w_kn, config, interpret):
    return _grouped(lhs, w, group_sizes, w_kn, config, interpret), (lhs, w, group_sizes)


def _grouped_bwd(w_kn, config, interpret, res, ct):
    lhs, w, group_sizes = res
    ct = ct.astype(lhs.dtype)
    d_lhs = _grouped(ct, w, group_sizes, not w_kn, config, interpret)
    if w_kn:  # w_e [K, N]: dw_e = lhs_e^T ct_e
        dw = _tgmm(lhs, ct, group_sizes, w.dtype, config, interpret)
    else:  # w_e [N, K]: dw_e = ct_e^T lhs_e
        dw = _tgmm(ct, lhs, group_sizes, w.dtype, config, interpret)
    # inside jax.shard_map: an input the same on every device gets the sum of the devices' gradients
    return match_varying(d_lhs, varying_axes(lhs)), match_varying(dw, varying_axes(w)), None


_grouped_vjp.defvjp(_grouped_fwd, _grouped_bwd)


def _prepare(lhs, w, group_sizes, transposed: bool, config, interpret, lhs_name: str, size_dim: int):
    """Check the arguments of :func:`gmm` / :func:`gmm_t`; returns ``(config, interpret)``."""
    _check(lhs_name, lhs, 2)
    _check("w", w, 3)
    _check_groups(group_sizes, w.shape[0])
    if lhs.shape[1] != w.shape[size_dim]:
        raise ValueError(
            f"{lhs_name}: expected shape [R, {w.shape[size_dim]}] for w of shape {tuple(w.shape)} "
            f"(transposed={transposed}), got {tuple(lhs.shape)}"
        )
    interpret = _interpret(interpret)
    return _config(config, interpret), interpret


def gmm(rows, w, group_sizes, transposed: bool = False, *, config: TileConfig | None = None, interpret=None):
    """``rows [R, in]`` -> ``[R, out]`` in ``rows.dtype``: the rows of group e times expert e's weight.

    Args:
        rows: ``[R, in]`` bfloat16 / float16 / float32, expert-major.
        w: ``[E, out, in]``, or ``[E, in, out]`` when ``transposed`` (cast to ``rows.dtype``).
        group_sizes: ``[E]`` integer, rows per expert; rows past their sum give zeros.
        transposed: the weight layout.
        config: tiles (default :data:`GPU_CONFIG`, :data:`INTERPRET_CONFIG` in interpret mode).
        interpret: run in Pallas's interpret mode (None: off GPUs).
    Raises:
        TypeError: an operand of another dtype, ``config`` not a :class:`TileConfig`.
        ValueError: ranks or shapes disagree.
    """
    config, interpret = _prepare(rows, w, group_sizes, transposed, config, interpret, "rows", 1 if transposed else 2)
    return _grouped_vjp(rows, w, group_sizes, transposed, config, interpret)


def gmm_t(g, w, group_sizes, transposed: bool = False, *, config: TileConfig | None = None, interpret=None):
    """``g [R, out]`` -> ``[R, in]`` in ``g.dtype``: the rows of group e times expert e's weight transposed
    (the input gradient of :func:`gmm`). Arguments and errors as :func:`gmm`'s."""
    config, interpret = _prepare(g, w, group_sizes, transposed, config, interpret, "g", 2 if transposed else 1)
    return _grouped_vjp(g, w, group_sizes, not transposed, config, interpret)


def tgmm(
    lhs,
    ct,
    group_sizes,
    transposed: bool = False,
    *,
    out_dtype=None,
    config: TileConfig | None = None,
    interpret=None,
):
    """The weight gradient of :func:`gmm`: ``lhs [R, in]``, ``ct [R, out]`` -> ``dw [E, out, in]``
    (``[E, in, out]`` when ``transposed``), ``dw_e = ct_e^T lhs_e`` over the rows of group e, summed in
    float32, in ``out_dtype`` (default ``lhs.dtype``; ``ct`` is cast to ``lhs.dtype``). Experts without
    rows, and rows past the last group, contribute nothing.

    Raises:
        TypeError: an operand of another dtype. ValueError: ranks or row counts disagree.
    """
    _check("lhs", lhs, 2)
    _check("ct", ct, 2)
    if ct.shape[0] != lhs.shape[0]:
        raise ValueError(f"ct: expected {lhs.shape[0]} rows (as lhs), got shape {tuple(ct.shape)}")
    if group_sizes.ndim != 1:
        raise ValueError(f"group_sizes: expected a 1-D integer array, got shape {tuple(group_sizes.shape)}")
    _check_groups(group_sizes, group_sizes.shape[0])
    interpret = _interpret(interpret)
    config = _config(config, interpret)
    out_dtype = lhs.dtype if out_dtype is None else out_dtype
    if transposed:
        return _tgmm(lhs, ct, group_sizes, out_dtype, config, interpret)
    return _tgmm(ct, lhs, group_sizes, out_dtype, config, interpret)
