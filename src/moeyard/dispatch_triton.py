"""Triton kernels of :mod:`moeyard.dispatch` (CUDA; CPU under ``TRITON_INTERPRET=1``): the sort of few
pairs, the plan after the sort, and the plan's rows.

The torch path makes its sort keys, sorts them and finds the experts' offsets in six device ops (a
widening cast, clamp, remainder, a narrowing cast, ``torch.sort``, ``searchsorted``): on the host,
six dispatches of 10-70 us each, which is what a decoding step or a small fine-tuning batch waits on
(``benchmarks/NOTES.md``, round 29). :func:`sort_by_expert_small` does it in one launch of one
program: each pair's key (its id, or E for an id outside ``[0, E)``) packed above its position into
one int32, ``tl.sort`` over all of them (so equal keys keep their order: a stable sort), and the
offsets from a histogram of the keys. Up to :data:`MAX_PAIRS` pairs, in registers; the torch path
beyond (its radix sort is then quicker on the device).

After the sort, :func:`plan_` writes the rest of :class:`moeyard.dispatch.DispatchPlan` (each pair's row and
validity, the experts' counts) and :func:`rows_` what a backend reading token rows in the plan's order needs
(:func:`moeyard.dispatch.plan_rows`), one launch each over blocks of :data:`PLAN_BLOCK` indices, where the torch
path takes 10 and 18 ops: at few tokens per call the host's time, not the GPU's (``benchmarks/NOTES.md``, round
53).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kernel_op import kernel_op
from .launch import cached, cdiv, next_power_of_2

Tensor = torch.Tensor
# one program sorts them in registers (bitonic: N log2(N)^2 / 2 exchanges). Device time on an H100 against the
# torch path: -20 us at 64 pairs, -27 us at 512, +12 us at 4096 (NOTES round 29), so up to 2048
MAX_PAIRS = 2048
MAX_EXPERTS = 1022  # the histogram's E + 2 bins in registers, at most 1024


def fits(num_pairs: int, num_experts: int) -> bool:
    """Whether :func:`sort_by_expert_small` takes ``num_pairs`` pairs over ``num_experts`` experts: at least
    one and at most :data:`MAX_PAIRS` pairs, at most :data:`MAX_EXPERTS` experts (so the packed ``(key,
    position)`` fits 31 bits)."""
    return 0 < num_pairs <= MAX_PAIRS and num_experts <= MAX_EXPERTS


@cached
@triton.jit
def sort_small_kernel(
    ids_ptr, keys_ptr, order_ptr, offsets_ptr, N, E, N_P2: tl.constexpr, SHIFT: tl.constexpr, E_P2: tl.constexpr
):
    """One program: :func:`sort_pairs`."""
    sort_pairs(ids_ptr, keys_ptr, order_ptr, offsets_ptr, N, E, N_P2, SHIFT, E_P2, True)


@triton.jit
def sort_pairs(
    ids_ptr,
    keys_ptr,
    order_ptr,
    offsets_ptr,
    N,
    E,
    N_P2: tl.constexpr,
    SHIFT: tl.constexpr,
    E_P2: tl.constexpr,
    KEYS: tl.constexpr,
):
    """The whole sort in the calling program: ``keys[i]`` = the i-th key in sorted order (written if
    ``KEYS``), ``order[i]`` = its pair (stable), ``offsets[e]`` = pairs with a key below ``e`` for ``e <= E``. A
    key is the pair's id, or E for an id outside ``[0, E)``; padding positions (``i >= N``) get ``E + 1`` and
    sort past every pair."""
    i = tl.arange(0, N_P2)
    live = i < N
    ids = tl.load(ids_ptr + i, mask=live, other=0).to(tl.int64)
    key = tl.where((ids >= 0) & (ids < E), ids, E).to(tl.int32)
    key = tl.where(live, key, E + 1)
    packed = tl.sort((key << SHIFT) | i)
    if KEYS:
        tl.store(keys_ptr + i, (packed >> SHIFT).to(keys_ptr.dtype.element_ty), mask=live)
    tl.store(order_ptr + i, (packed & (N_P2 - 1)).to(tl.int64), mask=live)
    counts = tl.histogram(key, E_P2)
    e = tl.arange(0, E_P2)
    tl.store(offsets_ptr + e, (tl.cumsum(counts, 0) - counts).to(tl.int32), mask=e <= E)


@kernel_op("moeyard::sort_small", mutates_args=("keys", "order", "offsets"))
def sort_small_(ids: Tensor, num_experts: int, keys: Tensor, order: Tensor, offsets: Tensor) -> None:
    """Write ``keys [N]``, ``order [N]`` int64 and ``offsets [E + 1]`` int32 for the flat ``ids [N]``."""
    N = ids.shape[0]
    sort_small_kernel[(1,)](ids, keys, order, offsets, N, num_experts, **sort_meta(N, num_experts))


def sort_meta(num_pairs: int, num_experts: int) -> dict:
    """The constexprs and warps of a one-program sort (:func:`sort_pairs`) of ``num_pairs`` over
    ``num_experts``."""
    n_p2 = next_power_of_2(max(num_pairs, 2))
    return dict(
        N_P2=n_p2,
        SHIFT=n_p2.bit_length() - 1,
        E_P2=next_power_of_2(num_experts + 2),
        num_warps=8 if n_p2 > 1024 else 4,
    )


@sort_small_.register_fake
def _(ids, num_experts, keys, order, offsets):
    return None


def sort_by_expert_small(topk_ids: Tensor, num_experts: int, key_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`moeyard.dispatch.sort_by_expert` in one launch: ``(sorted_keys [N] key_dtype, sort_order [N]
    int64, expert_offsets [E + 1] int32)`` for ``topk_ids [T, K]`` (any integer dtype), the same values.
    No host sync.

    Raises:
        ValueError: ``N = T * K`` and ``num_experts`` outside :func:`fits` (0 or more than :data:`MAX_PAIRS`
            pairs, more than :data:`MAX_EXPERTS` experts: use :func:`moeyard.dispatch.sort_by_expert`).
    """
    ids = topk_ids.reshape(-1)
    N, dev = ids.shape[0], ids.device
    if not fits(N, num_experts):
        raise ValueError(
            f"topk_ids: expected 1 to {MAX_PAIRS} pairs over at most {MAX_EXPERTS} experts, got {N} "
            f"pairs over {num_experts} (use moeyard.dispatch.sort_by_expert)"
        )
    keys = torch.empty(N, device=dev, dtype=key_dtype)
    order = torch.empty(N, device=dev, dtype=torch.int64)
    offsets = torch.empty(num_experts + 1, device=dev, dtype=torch.int32)
    sort_small_(ids, num_experts, keys, order, offsets)
    return keys, order, offsets


PLAN_BLOCK = 1024  # pairs (or rows) per program of the plan kernels


@cached
@triton.jit
def plan_kernel(keys_ptr, order_ptr, eo_ptr, po_ptr, pair_rows_ptr, valid_ptr, tpe_ptr, N, E, BLOCK: tl.constexpr):
    """:func:`plan_`: each sorted position ``i`` puts its pair's row (``i`` shifted by its expert's padding) and
    validity where the pair is; the first ``E`` positions also each expert's count."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    key = tl.load(keys_ptr + i, mask=m, other=0).to(tl.int32)  # in [0, E]: E for an invalid id
    pair = tl.load(order_ptr + i, mask=m, other=0)
    shift = tl.load(po_ptr + key, mask=m, other=0) - tl.load(eo_ptr + key, mask=m, other=0)
    tl.store(pair_rows_ptr + pair, i.to(tl.int64) + shift.to(tl.int64), mask=m)
    tl.store(valid_ptr + pair, (key < E).to(tl.uint8), mask=m)
    me = i < E
    count = tl.load(eo_ptr + i + 1, mask=me, other=0) - tl.load(eo_ptr + i, mask=me, other=0)
    tl.store(tpe_ptr + i, count, mask=me)


@kernel_op("moeyard::plan", mutates_args=("pair_rows", "valid", "tokens_per_expert"))
def plan_(
    sorted_keys: Tensor,
    sort_order: Tensor,
    expert_offsets: Tensor,
    padded_offsets: Tensor,
    pair_rows: Tensor,
    valid: Tensor,
    tokens_per_expert: Tensor,
) -> None:
    """Write ``pair_rows [N]`` int64, ``valid [N]`` (uint8 view of bool) and ``tokens_per_expert [E]`` int32 of
    :class:`moeyard.dispatch.DispatchPlan` from the sort (:func:`moeyard.dispatch.sort_by_expert`) and the
    padded offsets."""
    N, E = sort_order.shape[0], expert_offsets.shape[0] - 1
    grid = (cdiv(max(N, E), PLAN_BLOCK),)
    plan_kernel[grid](
        sorted_keys, sort_order, expert_offsets, padded_offsets, pair_rows, valid, tokens_per_expert, N, E,
        BLOCK=PLAN_BLOCK,
    )  # fmt: skip


@plan_.register_fake
def _(sorted_keys, sort_order, expert_offsets, padded_offsets, pair_rows, valid, tokens_per_expert):
    return None


@cached
@triton.jit
def rows_kernel(
    pair_rows_ptr,
    valid_ptr,
    eo_ptr,
    po_ptr,
    w_ptr,
    stride_t,
    stride_k,
    row_tokens_ptr,
    row_w_ptr,
    live_rows_ptr,
    nan_ptr,
    T,
    K,
    E,
    R,
    ALIGN: tl.constexpr,
    NAN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """:func:`rows_`, over indices ``idx`` of this program's block: as pairs (their rows' token and weight,
    their row or -1), as rows (those past the last expert's hold no token), as experts (their padding rows
    hold no token) and as tokens (the NaN terms of their invalid pairs)."""
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mp = idx < T * K
    row = tl.load(pair_rows_ptr + idx, mask=mp, other=0)
    live = tl.load(valid_ptr + idx, mask=mp, other=0) != 0
    tl.store(live_rows_ptr + idx, tl.where(live, row, -1), mask=mp)
    lm = mp & live
    t, k = idx // K, idx % K
    tl.store(row_tokens_ptr + row, t.to(tl.int64), mask=lm)
    w = tl.load(w_ptr + t.to(tl.int64) * stride_t + k * stride_k, mask=lm, other=0.0).to(tl.float32)
    tl.store(row_w_ptr + row, w, mask=lm)
    none = tl.zeros([BLOCK], dtype=tl.int64) + T
    zero = tl.zeros([BLOCK], dtype=tl.float32)
    tail = (idx < R) & (idx >= tl.load(po_ptr + E))
    tl.store(row_tokens_ptr + idx, none, mask=tail)
    tl.store(row_w_ptr + idx, zero, mask=tail)
    if ALIGN > 1:
        me = idx < E
        start = tl.load(po_ptr + idx, mask=me, other=0) + tl.load(eo_ptr + idx + 1, mask=me, other=0)
        start -= tl.load(eo_ptr + idx, mask=me, other=0)
        stop = tl.load(po_ptr + idx + 1, mask=me, other=0)
        for j in tl.static_range(ALIGN - 1):
            pad = me & (start + j < stop)
            tl.store(row_tokens_ptr + start + j, none, mask=pad)
            tl.store(row_w_ptr + start + j, zero, mask=pad)
    if NAN:
        mt = idx < T
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for kk in range(K):
            dead = mt & (tl.load(valid_ptr + idx * K + kk, mask=mt, other=1) == 0)
            acc += (
                tl.load(w_ptr + idx.to(tl.int64) * stride_t + kk * stride_k, mask=dead, other=0.0).to(tl.float32) * 0.0
            )
        tl.store(nan_ptr + idx, acc, mask=mt)


@kernel_op("moeyard::plan_rows", mutates_args=("row_tokens", "row_weights", "live_rows", "nan_terms"))
def rows_(
    pair_rows: Tensor,
    valid: Tensor,
    expert_offsets: Tensor,
    padded_offsets: Tensor,
    topk_weights: Tensor,
    align: int,
    row_tokens: Tensor,
    row_weights: Tensor,
    live_rows: Tensor,
    nan_terms: Tensor | None,
) -> None:
    """Write ``row_tokens [R]`` int64, ``row_weights [R]`` float32, ``live_rows [N]`` int64 and, when given,
    ``nan_terms [T]`` float32 (:func:`moeyard.dispatch.plan_rows`)."""
    T, K = topk_weights.shape
    E, R = expert_offsets.shape[0] - 1, row_tokens.shape[0]
    grid = (cdiv(max(R, E), PLAN_BLOCK),)
    rows_kernel[grid](
        pair_rows, valid, expert_offsets, padded_offsets, topk_weights, topk_weights.stride(0),
        topk_weights.stride(1), row_tokens, row_weights, live_rows, row_weights if nan_terms is None else nan_terms,
        T, K, E, R, ALIGN=align, NAN=nan_terms is not None, BLOCK=PLAN_BLOCK,
    )  # fmt: skip


@rows_.register_fake
def _(
    pair_rows, valid, expert_offsets, padded_offsets, topk_weights, align, row_tokens, row_weights, live_rows, nan_terms
):
    return None
