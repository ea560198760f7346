"""What every dispatcher shares: the options, the attribute a layer holds its expert-parallel call in
(the seam), and what dispatch hands to the local experts.

Legend: W ranks (EP size), E experts in all, E_l = E / W local experts (rank r owns the contiguous
block ``[r * E_l, (r + 1) * E_l)``), T tokens on this rank, K top-k, N = T * K routed pairs, H hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .comm import EPGroup, gather_ints

Tensor = torch.Tensor
# the attribute each kind of module reads instead of calling moeyard.experts itself
MOE_SEAM = "expert_parallel"  # moeyard.MoE
TRANSFORMERS_SEAM = "moeyard_expert_parallel"  # transformers experts modules (moeyard_experts_forward)


@dataclass(frozen=True, kw_only=True)
class EPOptions:
    """How one expert-parallel layer exchanges tokens.

    Attributes:
        num_experts: E, experts over all ranks.
        dispatcher: ``all_to_all``, ``sync_free`` or ``all_gather``.
        capacity_factor: ``sync_free`` only: rows each rank may send to one peer, as a multiple of the
            balanced load ``T_max * K / W`` (pairs past it are dropped and counted); None: lossless.
        max_tokens: ``sync_free`` / ``all_gather``: the static bound T_max on any rank's token count;
            None: ``sync_free`` needs the same T on every rank, ``all_gather`` agrees on the largest
            with one host sync per call.
        align: ``sync_free`` only: received rows of each local expert are padded to a multiple of this.
        exchange: ``sync_free`` only: how the rows travel (:data:`moeyard.parallel.sync_free.EXCHANGES`):
            ``all_to_all`` (worst-case blocks, ``all_to_all_single`` of equal splits), ``symm_mem``
            (exact rows through NVSHMEM symmetric memory, :mod:`moeyard.parallel.symm_mem`), ``p2p``
            (exact rows copied in the peers' symmetric buffers, :mod:`moeyard.parallel.p2p`) or
            ``auto`` (``p2p`` where it can run and ``overlap_chunks == 1``, else ``all_to_all``).
        overlap_chunks: ``all_to_all`` / ``sync_free``: the layer's tokens go in this many chunks, each
            chunk's exchanges in flight while another chunk's experts compute (:mod:`.overlap`); 1: one
            blocking exchange each way. ``sync_free`` overlaps the ``all_to_all`` exchange only.
        fp8_dispatch: ``all_to_all`` / ``all_gather`` with ``overlap_chunks == 1``: the dispatch carries
            each token row as e4m3 with one power-of-two scale (:mod:`.fp8_rows`: half the bytes of bf16);
            the combine and every backward exchange stay in the compute dtype.
    """

    num_experts: int
    dispatcher: str = "all_to_all"
    capacity_factor: float | None = None
    max_tokens: int | None = None
    align: int = 1
    exchange: str = "auto"
    overlap_chunks: int = 1
    fp8_dispatch: bool = False


@dataclass(kw_only=True)
class Outgoing:
    """One exchange's payload, as a dispatcher's stages hand it over (see :mod:`.overlap`).

    Attributes:
        rows: ``[N, H]`` rows sent with ``all_to_all_single`` (differentiable).
        out_splits, in_splits: host split sizes (rows from / to each rank); None: equal splits.
        ids: ``[N]`` int64 exchanged beside ``rows`` with equal splits (not differentiable), or None.
        state: what the receiving stage needs besides the received tensors.
        pad_rows: zero rows the receiver wants after the received rows, in the same buffer (host int).
    """

    rows: Tensor
    out_splits: list[int] | None = None
    in_splits: list[int] | None = None
    ids: Tensor | None = None
    state: object = None
    pad_rows: int = 0


@dataclass(kw_only=True)
class Dispatched:
    """The rows a dispatcher gives this rank's experts, and what its combine needs back.

    Attributes:
        rows: ``[R, H]`` received rows (R from the dispatcher: host counts, or a static worst case).
        topk_ids: ``[R, K']`` local expert ids in ``[0, E_l)``; others are dropped (no row computed).
        topk_weights: ``[R, K']`` weights applied by the local experts (ones where combine weights).
        state: the dispatcher's own record for its combine.
        dropped: ``[]`` int64 device tensor, pairs of this rank not computed (over capacity), or None.
    """

    rows: Tensor
    topk_ids: Tensor
    topk_weights: Tensor
    state: object
    dropped: Tensor | None = None


def chunk_bounds(num_tokens: int, chunk_tokens: int, chunks: int) -> list[tuple[int, int]]:
    """``[(start, stop)]`` of ``chunks`` consecutive chunks of at most ``chunk_tokens`` tokens each
    out of ``num_tokens`` (trailing chunks may be empty: every rank issues the same exchanges)."""
    return [(min(c * chunk_tokens, num_tokens), min((c + 1) * chunk_tokens, num_tokens)) for c in range(chunks)]


def local_experts(options: EPOptions, ep: EPGroup) -> int:
    """E_l, experts per rank."""
    return options.num_experts // ep.world_size


def token_counts(num_tokens: int, ep: EPGroup, device: torch.device) -> list[int]:
    """Every rank's token count, read on the host (a collective; one device-to-host copy on an
    accelerator)."""
    return gather_ints(torch.tensor([num_tokens], device=device, dtype=torch.int64), ep.group).tolist()
