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
   local experts rows ``[R, H]`` (R static) and each row's local expert (``E_l``: an empty row);
   with ``align > 1`` expert-major, each expert's rows padded to a multiple of ``align``;
3. combine: the exchange brings each pair's expert output back (``[T, K, H]``, zeros for dropped
   pairs), then each token's pairs are weighted and summed on its own rank.

The exchanges (:data:`EXCHANGE_IMPLS`, each an :class:`Exchange`):

- ``all_to_all`` (:func:`exchange_equal_splits`, :func:`combine_equal_splits`): every rank sends
  every peer a block of ``C`` rows, empty slots included, with ``all_to_all_single`` of equal static
  splits; the local expert ids travel with them (``E_l`` for an empty slot: this is how the counts
  travel); the received slots go to the experts as they are, or with ``align > 1`` a dispatch plan
  places them expert-major. Memory per rank: the send
  and the receive buffer of ``W * C`` rows each, i.e. ``2 * W * T_max * min(K, E_l) * H`` elements
  (plus the same again for the experts' output and its return), versus ``~2 * T * K * H`` for the
  exact all-to-all: ``W * min(K, E_l) / K`` times more (8x at W = 8, K = 8, E_l >= 8; W times more
  at E_l >= K), and as many bytes on the wire. Each direction is a send half and a receive half
  (:func:`pack_slots` / :func:`place_slots`, :func:`unplace_slots` / :func:`unpack_slots`) around
  one :func:`moeyard.parallel.comm.exchange`.
- ``symm_mem`` (:mod:`moeyard.parallel.symm_mem`): only the routed rows travel, through NVSHMEM
  symmetric buffers sized for the same worst case, counts exchanged on the device.
- ``p2p`` (:mod:`moeyard.parallel.p2p`): only the routed rows travel, copied by kernels straight out
  of and into the peers' symmetric buffers (torch's CUDA symmetric memory, NVLink), laid out
  expert-major as they are copied, counts exchanged on the device.
- ``auto``: ``p2p`` where it can run (CUDA, an NCCL group, torch's symmetric memory) and
  ``overlap_chunks == 1``, else ``all_to_all``. On 2 H200s at qwen3-30b-a3b (T = 32768 per rank,
  balanced) the layer's forward + backward took 20.6 ms with ``p2p``, 45.0 with the equal splits and
  26.4 with the host-sync ``all_to_all`` dispatcher (``benchmarks/NOTES.md``, round 34). The
  ``symm_mem`` path passes ``benchmarks/ep_symm_check.py`` on 2 H200s, but its forward exchange was
  no faster there (round 14): ``auto`` never takes it.

Stages (``overlap_chunks=N``: :mod:`.overlap` runs them over N chunks of the tokens, each chunk
with C at its own bound ``ceil(T_max / N)``, with the exchanges in flight): :func:`depart_dispatch`
(step 1 and the ``all_to_all`` exchange's send half), :func:`arrive_dispatch` (its receive half),
:func:`depart_combine`, :func:`arrive_combine`. They run the ``all_to_all`` exchange only: the
``symm_mem`` and ``p2p`` exchanges are kernels on the current stream sharing one set of symmetric
buffers, not collectives that can stay in flight per chunk, so ``overlap_chunks > 1`` with either
named raises ValueError (:func:`check_overlap`; ``auto`` then takes ``all_to_all``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..checks import UNWRITTEN
from ..dispatch import DispatchPlan, make_plan, permute, unpermute
from ..weighted_sum import weighted_sum
from . import comm, p2p, send_order, symm_mem
from .comm import EPGroup
from .common import Dispatched, EPOptions, Outgoing, chunk_bounds, local_experts, token_counts

Tensor = torch.Tensor
# the local experts' drop_invalid: every exchange's combine reads only the received rows, so the empty
# rows' outputs and input gradients may stay unwritten
EXPERTS_DROP_INVALID = UNWRITTEN
EXCHANGES = ("auto", "all_to_all", "symm_mem", "p2p")
DEVICE_EXCHANGES = ("symm_mem", "p2p")  # kernels on the current stream over one set of buffers


def block_rows(
    max_tokens: int, top_k: int, num_local_experts: int, world_size: int, capacity_factor: float | None
) -> int:
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
        pair_slot: ``[N]`` int64, the pair's slot in the ``[W * C]`` block layout (``W * C``: not sent);
            None when not asked for (:func:`route_pairs`).
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
    pair_slot: Tensor | None
    dropped: Tensor


def route_pairs(
    topk_ids: Tensor, num_experts: int, world_size: int, max_tokens: int, block: int, slots: bool = True
) -> Route:
    """The :class:`Route` of ``topk_ids [T, K]`` (global ids; others not sent) with ``C = block``.
    ``slots=False``: the caller needs no ``pair_slot`` (the symmetric-memory exchanges); when no
    destination can get more than ``C`` pairs (``C >= T * K``) the sort that counts them is skipped."""
    T, K = topk_ids.shape
    W, El, dev = world_size, num_experts // world_size, topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    valid = (flat >= 0) & (flat < num_experts)
    if not slots and block >= T * K:
        return Route(
            num_tokens=T,
            top_k=K,
            max_tokens=max_tokens,
            world_size=W,
            num_experts=num_experts,
            num_local_experts=El,
            block_rows=block,
            ids=torch.where(valid, flat, num_experts),
            pair_slot=None,
            dropped=torch.zeros((), dtype=torch.int64, device=dev),
        )
    dest = torch.where(valid, flat // El, W)  # [N], W: no rank
    plan = make_plan(dest.view(T, K), W)  # sorted by destination, token order within
    sorted_dest = dest.index_select(0, plan.sort_order)
    slot = torch.arange(T * K, device=dev) - plan.expert_offsets.to(torch.int64).index_select(0, sorted_dest)
    keep = (sorted_dest < W) & (slot < block)
    pair_slot = torch.where(keep, sorted_dest * block + slot, W * block).index_select(0, plan.pair_rows)
    sent = pair_slot < W * block
    return Route(
        num_tokens=T,
        top_k=K,
        max_tokens=max_tokens,
        world_size=W,
        num_experts=num_experts,
        num_local_experts=El,
        block_rows=block,
        ids=torch.where(sent, flat, num_experts),
        pair_slot=pair_slot,
        dropped=(valid & ~sent).sum(),
    )


def chunk_routes(
    topk_ids: Tensor, ep: EPGroup, options: EPOptions, chunks: int = 1, slots: bool = True
) -> list[tuple[slice, Route]]:
    """The tokens in ``chunks`` consecutive chunks of ``ceil(T_max / chunks)`` tokens (static; trailing
    ones may be empty), each with its :class:`Route` at C = :func:`block_rows` of the chunk's bound
    (``slots``: as :func:`route_pairs`)."""
    T, K = topk_ids.shape
    W, El = ep.world_size, local_experts(options, ep)
    T_chunk = -(-_max_tokens(T, ep, options, topk_ids.device) // chunks)
    C = block_rows(T_chunk, K, El, W, options.capacity_factor)
    return [
        (slice(a, b), route_pairs(topk_ids[a:b], options.num_experts, W, T_chunk, C, slots))
        for a, b in chunk_bounds(T, T_chunk, chunks)
    ]


@dataclass(frozen=True)
class Exchange:
    """One way to move the rows: ``dispatch(x [T, H], route, ep, align) -> (rows [R, H], row
    experts [R] int64, handle)``; ``combine(y [R, H], handle, weights [T, K]) -> [T, H]`` (each
    pair's row back home, zeros where not sent, weighted and summed per token); ``rows_sent(handle)
    -> int`` (rows put on the wire in dispatch; may read the device: for benchmarks)."""

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
    rows ``[R, H]`` (R static) with ``[R, 1]`` local ids (``E_l``: an empty row)."""
    name = resolve_exchange(options, ep)
    ((_, route),) = chunk_routes(topk_ids, ep, options, slots=name == "all_to_all")
    exchange = EXCHANGE_IMPLS[name]
    rows, row_experts, handle = exchange.dispatch(x, route, ep, options.align)
    return _dispatched(rows, row_experts, State(exchange, handle, topk_weights), route)


def combine(y: Tensor, dispatched: Dispatched) -> Tensor:
    """``y [R, H]`` (the experts' rows, as dispatched) -> ``[T, H]`` on the tokens' own rank."""
    state = dispatched.state
    return state.exchange.combine(y, state.handle, state.topk_weights)


def _dispatched(rows: Tensor, row_experts: Tensor, state: State, route: Route) -> Dispatched:
    return Dispatched(
        rows=rows,
        topk_ids=row_experts.unsqueeze(1),
        topk_weights=rows.new_ones(rows.shape[0], 1),
        state=state,
        dropped=route.dropped,
    )


def resolve_exchange(options: EPOptions, ep: EPGroup) -> str:
    """The exchange ``options.exchange`` names on ``ep``: ``auto`` is ``p2p`` where that can run and
    ``options.overlap_chunks == 1`` (the chunked stages run the ``all_to_all`` exchange), else
    ``all_to_all``. Host metadata only."""
    if options.exchange != "auto":
        return options.exchange
    if options.overlap_chunks == 1 and p2p.OPS.unavailable(ep) is None:
        return "p2p"
    return "all_to_all"


def check_exchange(ep: EPGroup, options: EPOptions) -> None:
    """Raise ValueError when the exchange ``options`` name cannot run on ``ep`` (host metadata only;
    no collective).

    Raises:
        ValueError: as :func:`check_overlap`; ``symm_mem`` without CUDA, an NCCL group, NVSHMEM, the
            ``torch.ops.symm_mem`` ops, or with more than 32 ranks (see
            :func:`moeyard.parallel.symm_mem.check_available`); ``p2p`` without CUDA or an NCCL group
            (:func:`moeyard.parallel.p2p.check_available`).
    """
    check_overlap(options.exchange, options.overlap_chunks)
    name = resolve_exchange(options, ep)
    if name == "symm_mem":
        symm_mem.check_available(ep)
    elif name == "p2p":
        p2p.check_available(ep)


def check_overlap(exchange: str, overlap_chunks: int) -> None:
    """Raise ValueError for ``overlap_chunks > 1`` with the ``symm_mem`` or ``p2p`` exchange named
    (options only; ``auto`` then takes ``all_to_all``).

    :mod:`.overlap` keeps each chunk's exchange in flight as an ``async_op=True`` collective and
    waits for it later; those two exchanges are kernels on the current stream, with a device barrier,
    that reuse one set of symmetric buffers per shape, so chunks could neither be in flight together
    nor keep their rows apart."""
    if overlap_chunks > 1 and exchange in DEVICE_EXCHANGES:
        raise ValueError(
            f"overlap_chunks: not with exchange={exchange!r} (its exchanges are kernels on the current "
            "stream sharing one set of symmetric buffers, not async collectives to keep in flight "
            "per chunk); use overlap_chunks=1 or exchange='all_to_all'"
        )


# ---------------------------------------------------------------- stages (overlap_chunks; all_to_all exchange)


def depart_dispatch(
    x: Tensor, topk_ids: Tensor, topk_weights: Tensor, ep: EPGroup, options: EPOptions, chunks: int = 1
) -> list[Outgoing]:
    """Per chunk of :func:`chunk_routes`: its route and the ``all_to_all`` exchange's send half
    (:func:`pack_slots`: ``[W * C, H]`` slot rows and ``[W * C]`` local ids).

    Raises:
        ValueError: ``options.exchange`` other than ``all_to_all`` / ``auto``."""
    if resolve_exchange(options, ep) != "all_to_all":
        raise ValueError(f"exchange: the sync_free stages run the all_to_all exchange only, got {options.exchange!r}")
    return [
        pack_slots(x[s], route, state=(route, topk_weights[s]))
        for s, route in chunk_routes(topk_ids, ep, options, chunks)
    ]


def arrive_dispatch(recv_x: Tensor, recv_ids: Tensor, out: Outgoing, ep: EPGroup, options: EPOptions) -> Dispatched:
    """The received slots ``[W * C, H]`` and ids ``[W * C]`` of ``out``'s exchange -> the
    :class:`Dispatched` for the local experts (:func:`place_slots`)."""
    route, topk_weights = out.state
    rows, row_experts, handle = place_slots(recv_x, recv_ids, route, ep.group, options.align)
    return _dispatched(rows, row_experts, State(EXCHANGE_IMPLS["all_to_all"], handle, topk_weights), route)


def depart_combine(y: Tensor, dispatched: Dispatched) -> Outgoing:
    """The experts' rows ``y [R, H]`` back to their ``[W * C, H]`` slots (:func:`unplace_slots`)."""
    return unplace_slots(y, dispatched.state.handle)


def arrive_combine(back: Tensor, dispatched: Dispatched) -> Tensor:
    """The returned slots ``[W * C, H]`` -> ``[T, H]``, each token's pairs weighted and summed."""
    state = dispatched.state
    return weighted_sum(unpack_slots(back, state.handle), state.topk_weights)


# ---------------------------------------------------------------- all_to_all: equal static splits


@dataclass(frozen=True)
class Slots:
    """The ``all_to_all`` exchange's handle: the plan over the received ``[W * C]`` slots (expert-major
    placement; None when the slots went to the experts as received), this rank's :class:`Route`, the
    process group."""

    plan: DispatchPlan | None
    route: Route
    group: object


def exchange_equal_splits(x: Tensor, route: Route, ep: EPGroup, align: int) -> tuple[Tensor, Tensor, Slots]:
    """The portable exchange: the slots ``[W * C, H]`` and their local ids ``[W * C]`` (``E_l``:
    empty) go out with ``all_to_all_single`` of equal static splits, then the received rows are
    given to the experts (:func:`place_slots`).

    Returns ``(rows [R, H], row experts [R], handle)`` (:func:`combine_equal_splits` undoes it)."""
    return place_slots(*comm.exchange(pack_slots(x, route), ep.group), route, ep.group, align)


def combine_equal_splits(y: Tensor, handle: Slots, weights: Tensor) -> Tensor:
    """``y [R, H]``, ``weights [T, K]`` -> ``[T, H]``: rows back to their slots, the reverse exchange,
    each pair's row (zeros where not sent), weighted and summed per token."""
    return weighted_sum(unpack_slots(comm.exchange(unplace_slots(y, handle), handle.group)[0], handle), weights)


def pack_slots(x: Tensor, route: Route, state: object = None) -> Outgoing:
    """Dispatch's send half: ``x [T, H]`` -> the ``[W * C, H]`` slot rows (zeros in empty slots) and
    their ``[W * C]`` local expert ids (``E_l``: empty), ``state`` passed along."""
    T, K, El = route.num_tokens, route.top_k, route.num_local_experts
    slots = route.world_size * route.block_rows
    slot_pair = torch.full((slots + 1,), T * K, device=x.device, dtype=torch.int64)
    slot_pair = slot_pair.index_copy(0, route.pair_slot, torch.arange(T * K, device=x.device))[:slots]
    slot_token = torch.where(slot_pair < T * K, slot_pair // K, T)
    send_x = torch.cat([x, x.new_zeros(1, x.shape[1])]).index_select(0, slot_token)  # [W * C, H]
    local = torch.cat([torch.where(route.ids < route.num_experts, route.ids % El, El), route.ids.new_full((1,), El)])
    return Outgoing(rows=send_x, ids=local.index_select(0, slot_pair), state=state)


def place_slots(recv_x: Tensor, recv_ids: Tensor, route: Route, group, align: int) -> tuple[Tensor, Tensor, Slots]:
    """Dispatch's receive half: the received slots ``[W * C, H]`` with local ids ``[W * C]`` ->
    ``(rows [R, H], row experts [R], handle)``. With ``align == 1`` the slots go to the experts as
    they arrive (``R = W * C``; every backend groups its rows by expert itself, the triton backend
    inside its GEMMs' loads), which saves a copy of the rows each way; otherwise they are placed
    expert-major, each expert's rows padded to a multiple of ``align``."""
    if align == 1:
        return recv_x, recv_ids, Slots(None, route, group)
    plan = make_plan(recv_ids.unsqueeze(1), route.num_local_experts, align=align)
    return permute(recv_x, plan), plan.row_experts(), Slots(plan, route, group)


def unplace_slots(y: Tensor, handle: Slots) -> Outgoing:
    """Combine's send half: ``y [R, H]`` back to the ``[W * C, H]`` slots they came in. Empty slots
    get the rows of local id ``E_l`` (the experts' output there is zero) and are not read on return
    (:func:`unpack_slots` selects the sent pairs' slots only), so no masking pass is needed. The
    receive buffer gets one zero row after the slots, for the pairs that were not sent."""
    rows = y if handle.plan is None else unpermute(y, handle.plan).squeeze(1)
    return Outgoing(rows=rows, pad_rows=1)


def unpack_slots(back: Tensor, handle: Slots) -> Tensor:
    """Combine's receive half: the returned slots and the zero row ``[W * C + 1, H]`` -> ``[T, K, H]``,
    each pair's row (the zero row where not sent)."""
    route = handle.route
    pairs = back.index_select(0, route.pair_slot)
    return pairs.view(route.num_tokens, route.top_k, back.shape[1])


EXCHANGE_IMPLS = {
    "all_to_all": Exchange(
        exchange_equal_splits, combine_equal_splits, lambda handle: handle.route.world_size * handle.route.block_rows
    ),  # empty slots too
    "symm_mem": Exchange(symm_mem.dispatch, symm_mem.combine, send_order.rows_sent),
    "p2p": Exchange(p2p.dispatch, p2p.combine, send_order.rows_sent),
}


def _max_tokens(T: int, ep: EPGroup, options: EPOptions, device: torch.device) -> int:
    """T_max, checked against every rank's count where that costs no device sync (CPU tensors)."""
    T_max = options.max_tokens if options.max_tokens is not None else T
    counts = token_counts(T, ep, device) if device.type == "cpu" else [T]
    if options.max_tokens is None and any(c != T for c in counts):
        raise ValueError(
            f"max_tokens: the sync_free dispatcher needs the same token count on every rank "
            f"or a static max_tokens; got {counts}"
        )
    if max(counts) > T_max:
        raise ValueError(f"max_tokens: a rank has {max(counts)} tokens, more than max_tokens={T_max}")
    return T_max
