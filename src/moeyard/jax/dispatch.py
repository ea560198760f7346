"""Dispatch on JAX arrays: from ``topk_ids`` to a plan, then ``permute`` tokens into expert-major rows
and ``unpermute`` (weighted combine) them back; the functions of :mod:`moeyard.dispatch`.

Legend: T tokens, H hidden size, E experts, K top-k, N = T*K routed (token, slot) pairs, flattened
token-major (pair ``n`` is token ``n // K``, slot ``n % K``), R rows of the permuted buffer (R = N, or
the worst case ``N + E * (align - 1)`` rounded up to a multiple of ``align`` with alignment padding).

Static shapes only (every size above is known at trace time), no host sync: the plan is a pytree
(MaxText's typed route metadata) that ``jax.jit``, ``jax.lax.scan`` and ``jax.shard_map`` carry::

    plan = make_plan(topk_ids, num_experts)
    rows = permute(x, plan)                                  # [R, H], expert-major
    ... grouped up-proj -> activation -> grouped down-proj on rows (jax.lax.ragged_dot) ...
    out = unpermute(rows_out, plan, topk_weights)            # [T, H]
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from .checks import accumulation_dtype, check_float, is_integer, kind, precision

__all__ = ["DispatchPlan", "make_plan", "permute", "unpermute", "weighted_sum"]


@dataclass(frozen=True, kw_only=True)
class DispatchPlan:
    """Routing metadata (a pytree: the sizes are static, the arrays its leaves).

    Attributes:
        num_tokens, top_k, num_experts: T, K, E (static).
        align: rows per expert are padded to a multiple of this (1 = no padding; static).
        num_rows: R, rows of the permuted buffer (static worst case when ``align > 1``).
        tokens_per_expert: ``[E]`` int32, valid pairs routed to each expert.
        expert_offsets: ``[E + 1]`` int32, start of each expert's pairs in sorted order;
            ``expert_offsets[E]`` is the number of valid pairs.
        padded_offsets: ``[E + 1]`` int32, start of each expert's rows in the permuted buffer
            (multiples of ``align``; equal to ``expert_offsets`` when ``align == 1``).
        sort_order: ``[N]`` int32, sorted position -> flat pair index (stable, expert-major).
        pair_rows: ``[N]`` int32, flat pair index -> its row in the permuted buffer; pairs with an
            invalid expert id map to rows past ``padded_offsets[E]``.
        valid: ``[N]`` bool, pair's expert id lies in ``[0, E)``.
    """

    num_tokens: int
    top_k: int
    num_experts: int
    align: int
    num_rows: int
    tokens_per_expert: jax.Array
    expert_offsets: jax.Array
    padded_offsets: jax.Array
    sort_order: jax.Array
    pair_rows: jax.Array
    valid: jax.Array

    @property
    def num_pairs(self) -> int:
        return self.num_tokens * self.top_k

    @property
    def group_sizes(self):
        """``[E]`` int32 rows per expert in the permuted buffer (padded to ``align``): the
        ``group_sizes`` of ``jax.lax.ragged_dot``."""
        return jnp.diff(self.padded_offsets)

    def row_tokens(self):
        """``[R]`` int32: the token each row holds (pad rows and invalid pairs: ``T``, one past the end)."""
        tokens = jnp.arange(self.num_pairs, dtype=jnp.int32) // self.top_k
        rows = jnp.full((self.num_rows,), self.num_tokens, jnp.int32)
        return rows.at[self.pair_rows].set(jnp.where(self.valid, tokens, self.num_tokens))

    def row_experts(self):
        """``[R]`` int32: the expert owning each row; rows past the last expert's: ``E``."""
        rows = jnp.arange(self.num_rows, dtype=jnp.int32)
        return jnp.searchsorted(self.padded_offsets[1:], rows, side="right").astype(jnp.int32)


jax.tree_util.register_dataclass(
    DispatchPlan,
    data_fields=["tokens_per_expert", "expert_offsets", "padded_offsets", "sort_order", "pair_rows", "valid"],
    meta_fields=["num_tokens", "top_k", "num_experts", "align", "num_rows"],
)


def make_plan(topk_ids, num_experts: int, *, align: int = 1) -> DispatchPlan:
    """Build the dispatch plan for ``topk_ids [T, K]`` (any integer dtype).

    A stable sort groups pairs by expert; the offsets are the cumulative counts (deterministic, static
    shapes, no host sync). Pairs whose id is outside ``[0, E)`` sort to the tail and belong to no
    expert (``valid`` is False for them).

    Args:
        topk_ids: ``[T, K]`` integer expert ids.
        num_experts: E.
        align: pad each expert's rows to a multiple of ``align``; the buffer then has the worst-case
            ``N + E * (align - 1)`` rows, rounded up to a multiple of ``align``; pad rows are zero
            after :func:`permute`.
    Raises:
        TypeError: ``topk_ids`` is not an integer array. ValueError: not 2-D, or bad E / align.
    """
    if not is_integer(topk_ids):
        raise TypeError(f"topk_ids: expected an integer array [T, K], got {kind(topk_ids)}")
    if topk_ids.ndim != 2:
        raise ValueError(f"topk_ids: expected shape [T, K], got {tuple(topk_ids.shape)}")
    for name, v in (("num_experts", num_experts), ("align", align)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: expected a positive int, got {v!r}")
    return plan_unchecked(topk_ids, num_experts, align)


def plan_unchecked(topk_ids, num_experts: int, align: int = 1) -> DispatchPlan:
    """:func:`make_plan` without its argument checks (for callers that made them)."""
    T, K = topk_ids.shape
    N, E = T * K, num_experts
    ids = topk_ids.reshape(-1)
    valid = (ids >= 0) & (ids < E)
    keys = jnp.where(valid, ids, E).astype(jnp.int32)
    sort_order = jnp.argsort(keys, stable=True).astype(jnp.int32)
    tokens_per_expert = jnp.zeros(E + 1, jnp.int32).at[keys].add(1)[:E]
    zero = jnp.zeros(1, jnp.int32)
    expert_offsets = jnp.concatenate([zero, jnp.cumsum(tokens_per_expert, dtype=jnp.int32)])
    positions = jnp.arange(N, dtype=jnp.int32)
    if align == 1:
        padded_offsets, sorted_rows, num_rows = expert_offsets, positions, N
    else:
        padded = (tokens_per_expert + (align - 1)) // align * align
        padded_offsets = jnp.concatenate([zero, jnp.cumsum(padded, dtype=jnp.int32)])
        shift = padded_offsets - expert_offsets  # [E + 1]; the tail (invalid pairs) keeps the last shift
        sorted_rows = positions + shift[keys[sort_order]]
        num_rows = -(-(N + E * (align - 1)) // align) * align
    pair_rows = jnp.zeros(N, jnp.int32).at[sort_order].set(sorted_rows)
    return DispatchPlan(
        num_tokens=T,
        top_k=K,
        num_experts=E,
        align=align,
        num_rows=num_rows,
        tokens_per_expert=tokens_per_expert,
        expert_offsets=expert_offsets,
        padded_offsets=padded_offsets,
        sort_order=sort_order,
        pair_rows=pair_rows,
        valid=valid,
    )


def permute(x, plan: DispatchPlan):
    """Gather token rows into expert-major order: ``x [T, H] -> rows [R, H]``.

    Row ``plan.pair_rows[n]`` holds ``x[n // K]``; pad rows (``align > 1``) are zero. Differentiable
    (the gradient is a scatter-add into ``[T, H]``).

    Raises:
        TypeError: ``x`` is not a float array. ValueError: ``x`` is not ``[T, H]``.
    """
    check_float("x", x)
    if x.ndim != 2 or x.shape[0] != plan.num_tokens:
        raise ValueError(f"x: expected shape [{plan.num_tokens}, H], got {tuple(x.shape)}")
    return permute_unchecked(x, plan)


def permute_unchecked(x, plan: DispatchPlan):
    if plan.align == 1:
        return x[plan.sort_order // plan.top_k]
    x_pad = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])  # row T is the zero row
    return x_pad[plan.row_tokens()]


def unpermute(rows, plan: DispatchPlan, topk_weights=None, *, drop_invalid: bool = False):
    """Weighted combine: ``rows [R, H]`` -> ``[T, H]`` with
    ``out[t] = sum_k topk_weights[t, k] * rows[pair_rows[t * K + k]]`` (float32 sums, float64 for
    float64 rows, one rounding to ``rows.dtype``; weights cast to ``rows.dtype`` first).

    Without ``topk_weights`` it returns the unweighted ``[T, K, H]`` pairs. With ``drop_invalid`` the
    pairs of invalid expert ids contribute zero. Differentiable w.r.t. ``rows`` and ``topk_weights``.

    Raises:
        ValueError: ``rows`` is not ``[plan.num_rows, H]`` or ``topk_weights`` not ``[T, K]``.
    """
    T, K = plan.num_tokens, plan.top_k
    check_float("rows", rows)
    if rows.ndim != 2 or rows.shape[0] != plan.num_rows:
        raise ValueError(f"rows: expected shape [{plan.num_rows}, H], got {tuple(rows.shape)}")
    if topk_weights is not None:
        check_float("topk_weights", topk_weights)
        if tuple(topk_weights.shape) != (T, K):
            raise ValueError(f"topk_weights: expected shape {(T, K)}, got {tuple(topk_weights.shape)}")
    return unpermute_unchecked(rows, plan, topk_weights, drop_invalid)


def unpermute_unchecked(rows, plan: DispatchPlan, topk_weights=None, drop_invalid: bool = False):
    T, K = plan.num_tokens, plan.top_k
    pairs = rows[plan.pair_rows].reshape(T, K, rows.shape[1])
    if drop_invalid:
        pairs = jnp.where(plan.valid.reshape(T, K, 1), pairs, 0)
    return pairs if topk_weights is None else weighted_sum(pairs, topk_weights)


def weighted_sum(pairs, weights):
    """``pairs [T, K, H]``, ``weights [T, K]`` (cast to ``pairs.dtype``) -> ``[T, H]`` in ``pairs.dtype``,
    summed in float32 (float64 for float64) with one rounding, as :func:`moeyard.weighted_sum.weighted_sum`."""
    acc = accumulation_dtype(pairs.dtype)
    out = jnp.einsum(
        "tk,tkh->th", weights.astype(pairs.dtype), pairs, preferred_element_type=acc, precision=precision(pairs.dtype)
    )
    return out.astype(pairs.dtype)
