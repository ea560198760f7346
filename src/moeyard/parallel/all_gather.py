"""The ``all_gather`` dispatcher: every rank sees every token (MaxText's ring of experts,
Megatron's all-gather dispatcher).

dispatch: all-gather the tokens ``[T_max, H]``, ids and weights of every rank (padded to T_max);
each rank runs its local experts on the pairs routed to them (ids shifted by the rank's first
expert; the others fall outside ``[0, E_l)`` and are dropped). combine: a reduce-scatter (sum) gives
each rank the sum over all experts for its own tokens.

No routing metadata is exchanged and the shapes are static, but every rank moves and stores
``W * T_max`` tokens: ``W * T_max * H`` elements gathered and reduce-scattered, versus about
``T * K * H`` for the all-to-all dispatchers; it suits small W or K close to E_l.

Uneven token counts: rows are padded to T_max, ``max_tokens`` when given (static), else the
largest count over ranks, agreed with one all-gather read on the host per call (a device-to-host
sync on an accelerator).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import fp8_rows
from .comm import EPGroup, all_gather, gather_ints, reduce_scatter
from .common import Dispatched, EPOptions, local_experts, token_counts

Tensor = torch.Tensor
# the local experts' drop_invalid: the reduce-scatter sums every gathered row, so rows of pairs routed
# elsewhere must be zeros
EXPERTS_DROP_INVALID = True


def dispatch(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, ep: EPGroup, options: EPOptions) -> Dispatched:
    """``x [T, H]``, ``topk_ids [T, K]`` (global ids), ``topk_weights [T, K]`` -> ``[W * T_max, H]``
    rows with ``[W * T_max, K]`` local ids and the routing weights. ``T_max`` is
    ``options.max_tokens``, or else every rank's token count read on the host (one device-to-host
    sync per call: set ``max_tokens`` to avoid it).

    Raises:
        ValueError: this rank has more than ``options.max_tokens`` tokens.
    """
    T = x.shape[0]
    T_max = options.max_tokens if options.max_tokens is not None else max(token_counts(T, ep, x.device))
    if T > T_max:
        raise ValueError(f"max_tokens: this rank has {T} tokens, more than max_tokens={T_max}")
    pad = T_max - T
    first = ep.rank * local_experts(options, ep)
    ids = gather_ints(F.pad(topk_ids.to(torch.int64), (0, 0, 0, pad), value=-1), ep.group)
    ids = torch.where(ids >= 0, ids - first, -1)  # others' and pad ids fall outside [0, E_l)
    gather = fp8_rows.all_gather if options.fp8_dispatch else all_gather  # e4m3 rows: .fp8_rows
    return Dispatched(
        rows=gather(F.pad(x, (0, 0, 0, pad)), ep.group),
        topk_ids=ids,
        topk_weights=all_gather(F.pad(topk_weights, (0, 0, 0, pad)), ep.group),
        state=(T, ep.group),
    )


def combine(y: Tensor, dispatched: Dispatched) -> Tensor:
    """``y [W * T_max, H]`` (this rank's experts' share for every token) -> ``[T, H]``."""
    T, group = dispatched.state
    return reduce_scatter(y, group)[:T]
