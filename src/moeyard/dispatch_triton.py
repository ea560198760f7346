"""Triton kernel of :func:`moeyard.dispatch.sort_by_expert` for few pairs (CUDA; CPU under
``TRITON_INTERPRET=1``).

The torch path makes its sort keys, sorts them and finds the experts' offsets in six device ops (a
widening cast, clamp, remainder, a narrowing cast, ``torch.sort``, ``searchsorted``): on the host,
six dispatches of 10-70 us each, which is what a decoding step or a small fine-tuning batch waits on
(``benchmarks/NOTES.md``, round 29). :func:`sort_by_expert_small` does it in one launch of one
program: each pair's key (its id, or E for an id outside ``[0, E)``) packed above its position into
one int32, ``tl.sort`` over all of them (so equal keys keep their order: a stable sort), and the
offsets from a histogram of the keys. Up to :data:`MAX_PAIRS` pairs, in registers; the torch path
beyond (its radix sort is then quicker on the device).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kernel_op import kernel_op

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
    n_p2 = triton.next_power_of_2(max(num_pairs, 2))
    return dict(
        N_P2=n_p2,
        SHIFT=n_p2.bit_length() - 1,
        E_P2=triton.next_power_of_2(num_experts + 2),
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
