"""The ``sync_free`` dispatcher: static shapes, no device-to-host sync.

The bound: every rank sends every peer at most ``C`` rows, fixed before any routing is known.
With distinct expert ids per token (a top-k), one token sends at most ``min(K, E_l)`` pairs to one
rank, so ``C = T_max * min(K, E_l)`` can never overflow (lossless; ``capacity_factor=None``).
``capacity_factor=c`` caps it at ``C = ceil(c * T_max * K / W)`` rows (c times the balanced load):
pairs past it are dropped (later tokens first, per destination) and counted in
``Dispatched.dropped``, a device tensor never read here.

T_max is ``max_tokens`` when given; otherwise every rank must pass the same token count (on CPU
tensors this is checked with one small all-gather; on an accelerator it cannot be checked without a
sync, and unequal counts fail in the collective).

Steps:

1. :func:`route_pairs`: each pair's destination rank and its slot among this rank's pairs to that
   rank (stable, so in token order), on the device; pairs past ``C`` are dropped;
2. the exchange (``EPOptions.exchange``, one of :data:`EXCHANGES`) moves the rows and gives the
   local experts expert-major rows ``[R, H]`` (R static) and each row's local expert (``E_l``: an
   empty row), each expert's rows padded to a multiple of ``align``;
3. combine: the exchange brings each pair's expert output back (``[T, K, H]``, zeros for dropped
   pairs), then each token's pairs are weighted and summed on its own rank.

The exchanges:

- ``all_to_all`` (:func:`exchange_equal_splits`): every rank sends every peer a block of ``C``
  rows, empty slots included, with ``all_to_all_single`` of equal static splits; the local expert
  ids travel with them (``E_l`` for an empty slot: this is how the counts travel); a dispatch plan
  then places the received rows expert-major. Memory per rank: the send and the receive buffer of
  ``W * C`` rows each, i.e. ``2 * W * T_max * min(K, E_l) * H`` elements (plus the same again for
  the experts' output and its return), versus ``~2 * T * K * H`` for the exact all-to-all:
  ``W * min(K, E_l) / K`` times more (8x at W = 8, K = 8, E_l >= 8; W times more at E_l >= K),
  and as many bytes on the wire.
- ``symm_mem`` (:mod:`moeyard.parallel.symm_mem`): only the routed rows travel, through NVSHMEM
  symmetric buffers sized for the same worst case, counts exchanged on the device.
- ``auto``: ``all_to_all``, until the ``symm_mem`` path has passed ``benchmarks/ep_symm_check.py``
  on GPUs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ..dispatch import make_plan, permute, unpermute
from . import symm_mem
from .comm import EPGroup, all_to_all
from .common import Dispatched, EPOptions, local_experts, token_counts, weighted_sum

Tensor = torch.Tensor
EXCHANGES = ("auto", "all_to_all", "symm_mem")


def block_rows(max_tokens: int, top_k: int, num_local_experts: int, world_size: int,
               capacity_factor: float | None) -> int:
    """C, rows each rank sends each peer: ``T_max * min(K, E_l)``, or ``ceil(c * T_max * K / W)``
    when smaller under ``capacity_factor=c``."""
    full = max_tokens * min(top_k, num_local_experts)
    if capacity_factor is None:
        return full
    return min(full, math.ceil(capacity_factor * max_tokens * top_k / world_size))


@dataclass(frozen=True, kw_only=True)
class Route:
    """Where this rank's pairs go (all tensors on the routing device; ``N = T * K`` pairs, flat
    token-major).

    Attributes:
        num_tokens, top_k, max_tokens: T, K, T_max. world_size, num_experts, num_local_experts: W, E, E_l.
        block_rows: C, the most rows this rank sends one peer.
        ids: ``[N]`` int64 global expert id of each pair where it is sent; ``E`` where it is not
            (an id outside ``[0, E)``, or past ``C`` for its destination).
        pair_slot: ``[N]`` int64, the pair's slot in the ``[W * C]`` block layout (``W * C``: not sent).
        dropped: ``[]`` int64, valid pairs not sent (over capacity).
    """

    num_tokens: int
    top_k: int
    max_tokens: int
    world_size: int
    num_experts: int
    num_local_experts: int
    block_rows: int
    ids: Tensor
    pair_slot: Tensor
    dropped: Tensor


def route_pairs(topk_ids: Tensor, num_experts: int, world_size: int, max_tokens: int, block: int) -> Route:
    """The :class:`Route` of ``topk_ids [T, K]`` (global ids; others not sent) with ``C = block``."""
    T, K = topk_ids.shape
    W, El, dev = world_size, num_experts // world_size, topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    valid = (flat >= 0) & (flat < num_experts)
    dest = torch.where(valid, flat // El, W)  # [N], W: no rank
    plan = make_plan(dest.view(T, K), W)      # sorted by destination, token order within
    sorted_dest = dest.index_select(0, plan.sort_order)
    slot = torch.arange(T * K, device=dev) - plan.expert_offsets.to(torch.int64).index_select(0, sorted_dest)
    keep = (sorted_dest < W) & (slot < block)
    pair_slot = torch.where(keep, sorted_dest * block + slot, W * block).index_select(0, plan.pair_rows)
    sent = pair_slot < W * block
    return Route(num_tokens=T, top_k=K, max_tokens=max_tokens, world_size=W, num_experts=num_experts,
                 num_local_experts=El, block_rows=block, ids=torch.where(sent, flat, num_experts),
                 pair_slot=pair_slot, dropped=(valid & ~sent).sum())


@dataclass(frozen=True)
class Exchange:
    """One way to move the rows: ``dispatch(x [T, H], route, ep, align) -> (rows [R, H], row
    experts [R] int64, handle)``; ``combine(y [R, H], handle) -> [T, K, H]`` (each pair's row, zeros
    where not sent); ``rows_sent(handle) -> int`` (rows put on the wire in dispatch; may read the
    device: for benchmarks)."""

    dispatch: Callable
    combine: Callable
    rows_sent: Callable


@dataclass(frozen=True)
class State:
    """``Dispatched.state`` of ``sync_free``: the exchange used, its handle, the routing weights."""

    exchange: Exchange
    handle: object
    topk_weights: Tensor


def dispatch(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, ep: EPGroup, options: EPOptions) -> Dispatched:
    """``x [T, H]``, ``topk_ids [T, K]`` (global ids; others dropped), ``topk_weights [T, K]`` ->
    expert-major rows ``[R, H]`` (R static) with ``[R, 1]`` local ids (``E_l``: an empty row)."""
    T, K = topk_ids.shape
    W, El = ep.world_size, local_experts(options, ep)
    T_max = _max_tokens(T, ep, options, x.device)
    route = route_pairs(topk_ids, options.num_experts, W, T_max, block_rows(T_max, K, El, W, options.capacity_factor))
    exchange = EXCHANGE_IMPLS[resolve_exchange(options.exchange)]
    rows, row_experts, handle = exchange.dispatch(x, route, ep, options.align)
    return Dispatched(rows=rows, topk_ids=row_experts.unsqueeze(1), topk_weights=rows.new_ones(rows.shape[0], 1),
                      state=State(exchange, handle, topk_weights), dropped=route.dropped)


def combine(y: Tensor, dispatched: Dispatched) -> Tensor:
    """``y [R, H]`` (the experts' expert-major rows) -> ``[T, H]`` on the tokens' own rank."""
    state = dispatched.state
    return weighted_sum(state.exchange.combine(y, state.handle), state.topk_weights)


def resolve_exchange(name: str) -> str:
    """The exchange ``EPOptions.exchange`` names: ``auto`` is ``all_to_all`` (equal splits) until the
    symmetric-memory path is verified on GPUs."""
    return "all_to_all" if name == "auto" else name


def check_exchange(ep: EPGroup, options: EPOptions) -> None:
    """Raise ValueError when the exchange ``options`` name cannot run on ``ep`` (host metadata only;
    no collective).

    Raises:
        ValueError: ``symm_mem`` without CUDA, an NCCL group, NVSHMEM, the ``torch.ops.symm_mem``
            ops, or with more than 32 ranks (see :func:`moeyard.parallel.symm_mem.check_available`).
    """
    if resolve_exchange(options.exchange) == "symm_mem":
        symm_mem.check_available(ep)


# ---------------------------------------------------------------- all_to_all: equal static splits

def exchange_equal_splits(x: Tensor, route: Route, ep: EPGroup, align: int):
    """The portable exchange: the slots ``[W * C, H]`` and their local ids ``[W * C]`` (``E_l``:
    empty) go out with ``all_to_all_single`` of equal static splits, then the received rows are
    placed expert-major (each expert's rows padded to ``align``).

    Returns ``(rows [R, H], row experts [R], (plan, route, group))``, the plan over the received
    slots (:func:`combine_equal_splits` undoes it)."""
    T, K, El = route.num_tokens, route.top_k, route.num_local_experts
    slots = route.world_size * route.block_rows
    slot_pair = torch.full((slots + 1,), T * K, device=x.device, dtype=torch.int64)
    slot_pair = slot_pair.index_copy(0, route.pair_slot, torch.arange(T * K, device=x.device))[:slots]
    slot_token = torch.where(slot_pair < T * K, slot_pair // K, T)
    send_x = torch.cat([x, x.new_zeros(1, x.shape[1])]).index_select(0, slot_token)  # [W * C, H]
    local = torch.cat([torch.where(route.ids < route.num_experts, route.ids % El, El), route.ids.new_full((1,), El)])
    recv_ids = all_to_all(local.index_select(0, slot_pair), None, None, ep.group)
    recv_x = all_to_all(send_x, None, None, ep.group)
    plan = make_plan(recv_ids.unsqueeze(1), El, align=align)
    return permute(recv_x, plan), plan.row_experts(), (plan, route, ep.group)


def combine_equal_splits(y: Tensor, handle) -> Tensor:
    """``y [R, H]`` -> ``[T, K, H]``: rows back to their slots, the reverse exchange, each pair's row
    (zeros where not sent)."""
    plan, route, group = handle
    slots = unpermute(y, plan, drop_invalid=True).squeeze(1)  # [W * C, H], empty slots 0
    back = all_to_all(slots, None, None, group)
    pairs = torch.cat([back, back.new_zeros(1, back.shape[1])]).index_select(0, route.pair_slot)
    return pairs.view(route.num_tokens, route.top_k, back.shape[1])


EXCHANGE_IMPLS = {
    "all_to_all": Exchange(exchange_equal_splits, combine_equal_splits,
                           lambda handle: handle[0].num_tokens),  # W * C slots, empty ones included
    "symm_mem": Exchange(symm_mem.dispatch, symm_mem.combine, symm_mem.rows_sent),
}


def _max_tokens(T: int, ep: EPGroup, options: EPOptions, device: torch.device) -> int:
    """T_max, checked against every rank's count where that costs no device sync (CPU tensors)."""
    T_max = options.max_tokens if options.max_tokens is not None else T
    counts = token_counts(T, ep, device) if device.type == "cpu" else [T]
    if options.max_tokens is None and any(c != T for c in counts):
        raise ValueError(f"max_tokens: the sync_free dispatcher needs the same token count on every rank "
                         f"or a static max_tokens; got {counts}")
    if max(counts) > T_max:
        raise ValueError(f"max_tokens: a rank has {max(counts)} tokens, more than max_tokens={T_max}")
    return T_max
