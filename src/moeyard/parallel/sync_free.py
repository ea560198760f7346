"""The ``sync_free`` dispatcher: static shapes, no device-to-host sync.

The bound: every rank sends every peer a block of ``C`` rows, fixed before any routing is known.
With distinct expert ids per token (a top-k), one token sends at most ``min(K, E_l)`` pairs to one
rank, so ``C = T_max * min(K, E_l)`` can never overflow (lossless; ``capacity_factor=None``).
Memory per rank: the send and the receive buffer of ``W * C`` rows each, i.e.
``2 * W * T_max * min(K, E_l) * H`` elements (plus the same again for the experts' output and its
return), versus ``~2 * T * K * H`` for the exact all-to-all: ``W * min(K, E_l) / K`` times more
(8x at W = 8, K = 8, E_l >= 8; W times more at E_l >= K). ``capacity_factor=c`` caps the block at
``C = ceil(c * T_max * K / W)`` rows (c times the balanced load): pairs past it are dropped (later
tokens first, per destination) and counted in ``Dispatched.dropped``, a device tensor never read here.

T_max is ``max_tokens`` when given; otherwise every rank must pass the same token count (on CPU
tensors this is checked with one small all-gather; on an accelerator it cannot be checked without a
sync, and unequal counts fail in the collective).

Steps (the exchange is one function, :func:`exchange_equal_splits`, so a symmetric-memory
exchange can take its place: :func:`exchange_symm_mem`):

1. dispatch plan over destination ranks: each pair's slot in its peer's block (stable, so in token
   order), on the device;
2. the slots' rows ``[W * C, H]`` and local expert ids ``[W * C]`` (``E_l`` for an empty slot: this
   is how the counts travel) are exchanged with ``all_to_all_single`` of equal, static splits;
3. the received rows are placed expert-major by a dispatch plan over the local experts, each
   expert's rows padded to a multiple of ``align``; the local experts compute them;
4. combine: rows back to their slots, the reverse exchange, then each token's pairs are weighted and
   summed on its own rank.

Stages (:mod:`.overlap` runs them over chunks of the tokens, each chunk with C at its own bound
``ceil(T_max / chunks)``, with the exchanges in flight): :func:`depart_dispatch` (steps 1-2's
sends), :func:`arrive_dispatch` (step 3), :func:`depart_combine`, :func:`arrive_combine`.
"""
from __future__ import annotations

import math

import torch

from ..dispatch import DispatchPlan, make_plan, permute, unpermute
from .comm import EPGroup, exchange
from .common import Dispatched, EPOptions, Outgoing, chunk_bounds, local_experts, token_counts, weighted_sum

Tensor = torch.Tensor


def block_rows(max_tokens: int, top_k: int, num_local_experts: int, world_size: int,
               capacity_factor: float | None) -> int:
    """C, rows each rank sends each peer: ``T_max * min(K, E_l)``, or ``ceil(c * T_max * K / W)``
    when smaller under ``capacity_factor=c``."""
    full = max_tokens * min(top_k, num_local_experts)
    if capacity_factor is None:
        return full
    return min(full, math.ceil(capacity_factor * max_tokens * top_k / world_size))


def dispatch(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, ep: EPGroup, options: EPOptions) -> Dispatched:
    """``x [T, H]``, ``topk_ids [T, K]`` (global ids; others dropped), ``topk_weights [T, K]`` ->
    expert-major rows ``[R, H]`` (R static) with ``[R, 1]`` local ids (``E_l``: an empty row)."""
    out, = depart_dispatch(x, topk_ids, topk_weights, ep, options)
    return arrive_dispatch(*exchange(out, ep.group), out, ep, options)


def combine(y: Tensor, dispatched: Dispatched) -> Tensor:
    """``y [R, H]`` (the experts' expert-major rows) -> ``[T, H]`` on the tokens' own rank."""
    out = depart_combine(y, dispatched)
    return arrive_combine(exchange(out, dispatched.state[-1])[0], dispatched)


def depart_dispatch(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, ep: EPGroup, options: EPOptions,
                    chunks: int = 1) -> list[Outgoing]:
    """The tokens in ``chunks`` consecutive chunks of ``ceil(T_max / chunks)`` (static); per chunk
    the ``[W * C, H]`` slot rows and ``[W * C]`` local ids (``E_l``: empty) of steps 1-2, C from
    :func:`block_rows` at the chunk's bound."""
    T, K = topk_ids.shape
    T_chunk = -(-_max_tokens(T, ep, options, x.device) // chunks)
    C = block_rows(T_chunk, K, local_experts(options, ep), ep.world_size, options.capacity_factor)
    return [_slots(x[a:b], topk_ids[a:b], topk_weights[a:b], ep, options, C)
            for a, b in chunk_bounds(T, T_chunk, chunks)]


def _slots(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, ep: EPGroup, options: EPOptions, C: int) -> Outgoing:
    """Step 1: each pair's slot in its destination's block of C rows (stable: in token order)."""
    T, K = topk_ids.shape
    W, El = ep.world_size, local_experts(options, ep)
    flat = topk_ids.reshape(-1).to(torch.int64)
    valid = (flat >= 0) & (flat < options.num_experts)
    dest = torch.where(valid, flat // El, W)  # [N], W: no rank
    plan = make_plan(dest.view(T, K), W)      # sorted by destination, token order within
    sorted_dest = dest.index_select(0, plan.sort_order)
    slot = torch.arange(T * K, device=x.device) - plan.expert_offsets.to(torch.int64).index_select(0, sorted_dest)
    keep = (sorted_dest < W) & (slot < C)
    pair_slot = torch.where(keep, sorted_dest * C + slot, W * C).index_select(0, plan.pair_rows)  # [N]
    slot_pair = torch.full((W * C + 1,), T * K, device=x.device, dtype=torch.int64)
    slot_pair = slot_pair.index_copy(0, pair_slot, torch.arange(T * K, device=x.device))[:W * C]
    slot_token = torch.where(slot_pair < T * K, slot_pair // K, T)
    send_x = torch.cat([x, x.new_zeros(1, x.shape[1])]).index_select(0, slot_token)  # [W * C, H]
    local = torch.cat([torch.where(valid, flat % El, El), flat.new_full((1,), El)])
    dropped = (valid & (pair_slot == W * C)).sum()
    return Outgoing(rows=send_x, ids=local.index_select(0, slot_pair), state=(pair_slot, topk_weights, dropped))


def arrive_dispatch(recv_x: Tensor, recv_ids: Tensor, out: Outgoing, ep: EPGroup, options: EPOptions) -> Dispatched:
    """Step 3: the received slots placed expert-major for the local experts."""
    rows, row_plan = place(recv_x, recv_ids, local_experts(options, ep), options.align)
    pair_slot, topk_weights, dropped = out.state
    return Dispatched(rows=rows, topk_ids=row_plan.row_experts().unsqueeze(1),
                      topk_weights=rows.new_ones(rows.shape[0], 1),
                      state=(row_plan, pair_slot, topk_weights, ep.group), dropped=dropped)


def depart_combine(y: Tensor, dispatched: Dispatched) -> Outgoing:
    """Step 4, first half: the experts' rows back to their ``[W * C, H]`` slots (empty slots 0)."""
    return Outgoing(rows=unpermute(y, dispatched.state[0], drop_invalid=True).squeeze(1))


def arrive_combine(back: Tensor, dispatched: Dispatched) -> Tensor:
    """Step 4, second half: the returned slots ``[W * C, H]`` -> ``[T, H]``, each token's pairs
    weighted and summed."""
    _, pair_slot, topk_weights, _ = dispatched.state
    T, K = topk_weights.shape
    pairs = torch.cat([back, back.new_zeros(1, back.shape[1])]).index_select(0, pair_slot)  # dropped: 0
    return weighted_sum(pairs.view(T, K, back.shape[1]), topk_weights)


def exchange_equal_splits(send_x: Tensor, send_ids: Tensor, ep: EPGroup, num_local_experts: int,
                          align: int) -> tuple[Tensor, DispatchPlan]:
    """The portable exchange: ``all_to_all_single`` with equal static splits of the slots
    ``send_x [W * C, H]`` and their local ids ``send_ids [W * C]`` (``E_l``: empty), then the received
    rows placed expert-major (each expert's rows padded to ``align``).

    Returns ``(rows [R, H], plan)``, the plan over the received slots (``plan.row_experts()``: the
    expert of each row; :func:`combine` undoes it)."""
    recv_x, recv_ids = exchange(Outgoing(rows=send_x, ids=send_ids), ep.group)
    return place(recv_x, recv_ids, num_local_experts, align)


def place(recv_x: Tensor, recv_ids: Tensor, num_local_experts: int, align: int) -> tuple[Tensor, DispatchPlan]:
    """Received slots ``[W * C, H]`` with local ids ``[W * C]`` -> expert-major rows and their plan."""
    plan = make_plan(recv_ids.unsqueeze(1), num_local_experts, align=align)
    return permute(recv_x, plan), plan


def exchange_symm_mem(send_x: Tensor, send_ids: Tensor, ep: EPGroup, num_local_experts: int,
                      align: int) -> tuple[Tensor, DispatchPlan]:
    """Placeholder for the NVSHMEM exchange (``torch.ops.symm_mem.all_to_all_vdev_2d``, rank-major in,
    expert-major out with ``major_align`` padding, counts on the device; its reverse is
    ``all_to_all_vdev_2d_offset``). It would replace :func:`exchange_equal_splits` and return the
    same ``(rows, plan)``. Not implemented: its limits (world size <= 32, at most 16 experts per
    rank) and symmetric-memory buffers need a GPU to build and test on.

    Raises:
        NotImplementedError: always.
    """
    raise NotImplementedError("the symmetric-memory (NVSHMEM) exchange is not implemented; "
                              "the sync_free dispatcher uses exchange_equal_splits")


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
