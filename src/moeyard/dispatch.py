"""Dispatch: from ``topk_ids`` to a plan, then ``permute`` tokens into expert-major rows and
``unpermute`` (weighted combine) them back.

Legend: T tokens, H hidden size, E experts, K top-k, N = T*K routed (token, slot) pairs, flattened
token-major (pair ``n`` is token ``n // K``, slot ``n % K``), R rows of the permuted buffer
(R = N, or the worst case ``N + E * (align - 1)`` with alignment padding).

Everything here runs on the device with static shapes: no ``.item()``, ``.tolist()``, ``.cpu()``,
``nonzero`` or data-dependent sizes, so it is safe under CUDA graphs and expert parallelism.
The pipeline (the MaxText decomposition, separate composable steps so backends can fuse them)::

    plan = make_plan(topk_ids, num_experts)
    rows = permute(x, plan)                  # [R, H], expert-major
    ... grouped up-proj -> activation -> grouped down-proj on rows ...
    out = unpermute(rows_out, plan, topk_weights)   # [T, H]
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .checks import kind
from .kernel_op import have_triton, interpreting
from .weighted_sum import gathered_sum, gathered_weighted_sum, weighted_sum

Tensor = torch.Tensor


@dataclass(frozen=True, kw_only=True)
class DispatchPlan:
    """Frozen routing metadata; all tensors live on the routing device.

    Attributes:
        num_tokens, top_k, num_experts: T, K, E.
        align: rows per expert are padded to a multiple of this (1 = no padding).
        num_rows: R, rows of the permuted buffer (a static worst case when ``align > 1``).
        tokens_per_expert: ``[E]`` int32, valid pairs routed to each expert.
        expert_offsets: ``[E + 1]`` int32, start of each expert's pairs in sorted order;
            ``expert_offsets[E]`` is the number of valid pairs.
        padded_offsets: ``[E + 1]`` int32, start of each expert's rows in the permuted buffer
            (multiples of ``align``; equal to ``expert_offsets`` when ``align == 1``).
        sort_order: ``[N]`` int64, sorted position -> flat pair index (stable, expert-major).
        pair_rows: ``[N]`` int64, flat pair index -> its row in the permuted buffer (the inverse
            of the permutation); pairs with an invalid expert id map to rows past
            ``padded_offsets[E]``.
        valid: ``[N]`` bool, pair's expert id lies in ``[0, E)``.
    """

    num_tokens: int
    top_k: int
    num_experts: int
    align: int
    num_rows: int
    tokens_per_expert: Tensor
    expert_offsets: Tensor
    padded_offsets: Tensor
    sort_order: Tensor
    pair_rows: Tensor
    valid: Tensor

    @property
    def num_pairs(self) -> int:
        return self.num_tokens * self.top_k

    def row_tokens(self) -> Tensor:
        """``[R]`` int64: the token each row holds (pad rows and invalid pairs: ``T``, one past the end)."""
        rows = torch.full((self.num_rows,), self.num_tokens, dtype=torch.int64, device=self.pair_rows.device)
        tokens = torch.arange(self.num_pairs, device=rows.device) // self.top_k
        return rows.index_copy(0, self.pair_rows, torch.where(self.valid, tokens, self.num_tokens))

    def row_experts(self) -> Tensor:
        """``[R]`` int64: the expert owning each row; rows past the last expert's (the spare worst-case
        rows and those of invalid pairs): ``E``."""
        rows = torch.arange(self.num_rows, device=self.padded_offsets.device, dtype=torch.int32)
        return torch.searchsorted(self.padded_offsets[1:], rows, right=True)


def _key_dtype(num_experts: int) -> torch.dtype:
    """The narrowest integer dtype that holds the sort keys ``0 .. E``: a radix sort makes one pass per
    key byte, so ``uint8`` keys (up to 255 experts) sort in one pass where ``int64`` took eight (H100,
    ``benchmarks/NOTES.md`` round 25: 196608 keys, GPU 250 -> 53 us, host 144 -> 50 us)."""
    return torch.uint8 if num_experts <= 255 else torch.int16 if num_experts <= 32767 else torch.int32


def _sort_keys(topk_ids: Tensor, num_experts: int) -> Tensor:
    """``[N]`` sort keys of the flattened ids: the id, or E for an id outside ``[0, E)``, in
    :func:`_key_dtype`."""
    keys = topk_ids.reshape(-1).to(torch.int64).clamp(-1, num_experts).remainder(num_experts + 1)
    return keys.to(_key_dtype(num_experts))


def sort_by_expert(topk_ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """The core of :func:`make_plan` in a few device ops (a backend that needs no more calls it
    directly): ``(sorted_keys [N], sort_order [N] int64, expert_offsets [E + 1] int32)`` for
    ``topk_ids [T, K]`` (any integer dtype); the keys are the ids in the narrowest integer dtype that
    holds ``E`` (``uint8`` up to 255 experts). Pairs with an id outside ``[0, E)`` sort to the tail, past
    ``expert_offsets[E]``. Up to :data:`moeyard.dispatch_triton.MAX_PAIRS` pairs on CUDA (or under
    ``TRITON_INTERPRET=1``) with Triton installed, one kernel launch instead of six ops
    (:mod:`moeyard.dispatch_triton`; the same values). No host sync. Its arguments are not checked
    (:func:`make_plan` and :func:`moeyard.experts` check theirs before calling it)."""
    if one_launch(topk_ids, num_experts):
        from .dispatch_triton import sort_by_expert_small

        return sort_by_expert_small(topk_ids, num_experts, _key_dtype(num_experts))
    return _sort(_sort_keys(topk_ids, num_experts), num_experts)


def one_launch(topk_ids: Tensor, num_experts: int) -> bool:
    """Whether :func:`sort_by_expert` takes the one-launch kernel (:mod:`moeyard.dispatch_triton`) for these
    ids. Host metadata only."""
    if not have_triton() or not (topk_ids.is_cuda or (topk_ids.is_cpu and interpreting())):
        return False
    from .dispatch_triton import fits

    return fits(topk_ids.numel(), num_experts)


def _sort(keys: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    sorted_keys, sort_order = torch.sort(keys, stable=True)
    bounds = _bounds(num_experts, keys.device, keys.dtype)
    return sorted_keys, sort_order, torch.searchsorted(sorted_keys, bounds, out_int32=True)


def _bounds(num_experts: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """``arange(E + 1)`` in the keys' ``dtype`` on ``device``: searchsorted's needles (each expert's first
    row). Made once per (E, device, dtype) in eager mode; fresh while ``torch.compile`` traces (a traced
    tensor must not be kept) or a CUDA graph is being captured (a captured ``arange`` fills its tensor only
    when the graph replays)."""
    if torch.compiler.is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return torch.arange(num_experts + 1, device=device, dtype=dtype)
    return _cached_bounds(num_experts, device, dtype)


@functools.lru_cache(maxsize=64)
def _cached_bounds(num_experts: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    return torch.arange(num_experts + 1, device=device, dtype=dtype)


def make_plan(topk_ids: Tensor, num_experts: int, *, align: int = 1) -> DispatchPlan:
    """Build the dispatch plan for ``topk_ids [T, K]`` (any integer dtype) on its device.

    A stable sort groups pairs by expert; ``searchsorted`` on the sorted ids gives the offsets
    (deterministic, no atomics, no host sync). Pairs whose id is outside ``[0, E)`` sort to the tail
    and belong to no expert (``valid`` is False for them); backends treat them as the caller asked
    (an error, NaN output or dropped: see :func:`moeyard.experts`). On CUDA (:func:`one_pass`) the sort is
    :func:`sort_by_expert` (one launch for few pairs) and the rest one launch
    (:func:`moeyard.dispatch_triton.plan_`), where the torch path takes about 15 ops (25 with ``align``): the
    same values.

    Args:
        topk_ids: ``[T, K]`` integer expert ids.
        num_experts: E.
        align: pad each expert's rows to a multiple of ``align`` (e.g. 16 or 32 for quantized
            grouped GEMMs). The buffer has the worst-case ``N + E * (align - 1)`` rows, rounded up to
            a multiple of ``align``; pad rows are zero after :func:`permute`.
    Raises:
        TypeError: ``topk_ids`` is not an integer tensor. ValueError: not 2-D, or bad E / align.
    """
    if not isinstance(topk_ids, Tensor) or topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise TypeError(f"topk_ids: expected an integer tensor [T, K], got {kind(topk_ids)}")
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids: expected shape [T, K], got {tuple(topk_ids.shape)}")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts: expected a positive int, got {num_experts!r}")
    if not isinstance(align, int) or align < 1:
        raise ValueError(f"align: expected a positive int, got {align!r}")
    T, K = topk_ids.shape
    N, E, dev = T * K, num_experts, topk_ids.device
    num_rows = N if align == 1 else padded_rows(N, E, align)
    if one_pass(topk_ids):
        sorted_keys, sort_order, expert_offsets = sort_by_expert(topk_ids, E)
        padded_offsets = expert_offsets if align == 1 else pad_offsets(expert_offsets.diff(), align)
        pair_rows = torch.empty(N, device=dev, dtype=torch.int64)
        valid = torch.empty(N, device=dev, dtype=torch.bool)
        tokens_per_expert = torch.empty(E, device=dev, dtype=torch.int32)
        from .dispatch_triton import plan_

        plan_(sorted_keys, sort_order, expert_offsets, padded_offsets, pair_rows, valid.view(torch.uint8),
              tokens_per_expert)  # fmt: skip
    else:
        keys = _sort_keys(topk_ids, E)
        sorted_keys, sort_order, expert_offsets = _sort(keys, E)
        valid = keys < E
        tokens_per_expert = expert_offsets.diff()
        positions = torch.arange(N, device=dev, dtype=torch.int64)
        if align == 1:
            padded_offsets, sorted_rows = expert_offsets, positions
        else:
            padded_offsets = pad_offsets(tokens_per_expert, align)
            shift = (padded_offsets - expert_offsets).to(torch.int64)  # [E + 1]; tail keeps its shift
            sorted_rows = positions + shift[sorted_keys.to(torch.int64)]  # uint8 would index as a mask
        pair_rows = torch.empty_like(sorted_rows).index_copy_(0, sort_order, sorted_rows)
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


def one_pass(topk_ids: Tensor) -> bool:
    """Whether :func:`make_plan` and :func:`plan_rows` take their Triton kernels
    (:mod:`moeyard.dispatch_triton`): Triton installed, at least one pair, on CUDA (or on CPU under
    ``TRITON_INTERPRET=1``), in eager mode (while ``torch.compile`` traces, the torch ops: Inductor fuses
    them, and it cannot lower the kernels' byte view of a bool tensor). Host metadata only."""
    if not have_triton() or topk_ids.numel() == 0 or torch.compiler.is_compiling():
        return False
    return topk_ids.is_cuda or (topk_ids.is_cpu and interpreting())


def pad_offsets(tokens_per_expert: Tensor, align: int) -> Tensor:
    """``[E + 1]`` int32: each expert's first row when every expert's ``tokens_per_expert [E]`` rows are padded
    to a multiple of ``align`` (on the device, no host sync). Also the FP8 weight gradients' padded column
    casts' (:func:`moeyard.quant.fp8_colwise.padded_offsets`)."""
    padded = (tokens_per_expert + (align - 1)) // align * align
    return torch.cat([padded.new_zeros(1), padded.cumsum(0, dtype=torch.int32)])


def padded_rows(num_pairs: int, num_experts: int, align: int) -> int:
    """A static bound on the rows of ``num_pairs`` pairs over ``num_experts`` experts each padded to a multiple
    of ``align`` (:func:`pad_offsets`): ``align - 1`` more per expert, rounded up to ``align``."""
    return -(-(num_pairs + num_experts * (align - 1)) // align) * align


def plan_rows(
    plan: DispatchPlan, topk_weights: Tensor, *, nan_terms: bool = False
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """What a backend that reads token rows in the plan's row order needs of it, in one launch on CUDA
    (:func:`one_pass`; torch ops otherwise, the same values):

    - ``row_tokens [R]`` int64: :meth:`DispatchPlan.row_tokens` (``T`` for a padding row or an invalid pair's);
    - ``live_rows [T, K]`` int64: each pair's row, -1 for an invalid pair;
    - ``row_weights [R]`` float32: each valid pair's ``topk_weights`` at its row, 0 elsewhere (no autograd);
    - with ``nan_terms``, ``[T]`` float32: 0 times the sum of each token's invalid pairs' weights (NaN where
      one is NaN or infinite: what :func:`moeyard.experts` puts there), else None.

    ``topk_weights [T, K]``: any float dtype and strides. No host sync.

    Raises:
        ValueError: ``topk_weights`` is not ``[T, K]`` of ``plan``.
    """
    T, K = plan.num_tokens, plan.top_k
    if not isinstance(topk_weights, Tensor) or tuple(topk_weights.shape) != (T, K):
        raise ValueError(f"topk_weights: expected a tensor of shape {(T, K)}, got {kind(topk_weights)}")
    if one_pass(topk_weights):
        from .dispatch_triton import rows_

        dev, R = topk_weights.device, plan.num_rows
        row_tokens = torch.empty(R, device=dev, dtype=torch.int64)
        row_weights = torch.empty(R, device=dev, dtype=torch.float32)
        live_rows = torch.empty(T, K, device=dev, dtype=torch.int64)
        terms = torch.empty(T, device=dev, dtype=torch.float32) if nan_terms else None
        rows_(plan.pair_rows, plan.valid.view(torch.uint8), plan.expert_offsets, plan.padded_offsets,
              topk_weights, plan.align, row_tokens, row_weights, live_rows, terms)  # fmt: skip
        return row_tokens, live_rows, row_weights, terms
    live = plan.valid.view(T, K)
    w = topk_weights.detach().float()
    row_weights = w.new_zeros(plan.num_rows).index_put((plan.pair_rows,), w.masked_fill(~live, 0).reshape(-1))
    terms = 0 * w.masked_fill(live, 0).sum(1) if nan_terms else None
    return plan.row_tokens(), plan.pair_rows.view(T, K).masked_fill(~live, -1), row_weights, terms


def permute(x: Tensor, plan: DispatchPlan) -> Tensor:
    """Gather token rows into expert-major order: ``x [T, H] -> rows [R, H]``.

    Row ``plan.pair_rows[n]`` holds ``x[n // K]``; pad rows (``align > 1``) are zero. Differentiable:
    the backward sums each token's K rows, read where they lie (``pair_rows``), in a fixed order
    (:func:`moeyard.weighted_sum.gathered_sum`: float32 sums, no atomics, deterministic; on an H100 at
    qwen3-30b-a3b's 262144 rows the scatter-add it replaces took 4.6 ms). With ``align > 1`` a pair whose
    id is invalid holds the zero row, so it contributes no gradient.
    """
    _check_x(x, plan)
    T, K = plan.num_tokens, plan.top_k
    if plan.align == 1:
        return _Permute.apply(x, plan.sort_order // K, plan.pair_rows.view(T, K), None)
    return _Permute.apply(x, plan.row_tokens(), plan.pair_rows.view(T, K), plan.valid.view(T, K))


def rows_by_token(x: Tensor, index: Tensor) -> Tensor:
    """``[x; 0][index]``: ``x [T, H]``'s rows at ``index [R]`` (int64), where ``T`` names a zero row (pad
    rows, invalid pairs: :meth:`DispatchPlan.row_tokens`); no autograd of its own, any dtype (e4m3 included)."""
    # float8: torch.cat has no kernel for it on every device; its bytes gather alike
    if x.dtype.is_floating_point and x.dtype.itemsize == 1:
        return rows_by_token(x.view(torch.uint8), index).view(x.dtype)
    return torch.cat([x, x.new_zeros(1, x.shape[1])]).index_select(0, index)


class _Permute(torch.autograd.Function):
    """``rows = [x; 0][index]`` (``index`` may name the zero row ``T``); backward: ``dx[t] = sum_k
    live[t, k] * d rows[pair_rows[t, k]]`` (``live`` None: every pair)."""

    @staticmethod
    def forward(ctx, x, index, pair_rows, live):
        ctx.save_for_backward(pair_rows, live)
        return x.index_select(0, index) if live is None else rows_by_token(x, index)

    @staticmethod
    def backward(ctx, d_rows):
        pair_rows, live = ctx.saved_tensors
        weights = None if live is None else live.to(d_rows.dtype)
        dx, _ = gathered_sum(d_rows.contiguous(), pair_rows, weights)
        return dx, None, None, None


def unpermute(
    rows: Tensor, plan: DispatchPlan, topk_weights: Tensor | None = None, *, drop_invalid: bool = False
) -> Tensor:
    """Weighted combine: ``rows [R, H]`` -> ``[T, H]`` with
    ``out[t] = sum_k topk_weights[t, k] * rows[pair_rows[t * K + k]]``.

    Without ``topk_weights`` it returns the unweighted ``[T, K, H]`` pairs instead. The weighted sum
    reads each pair's row where it is (:func:`moeyard.weighted_sum.gathered_weighted_sum`; with
    ``drop_invalid`` a gather, then :func:`moeyard.weighted_sum.weighted_sum`): float32 accumulation,
    deterministic, no atomics.
    Rows of pairs with an invalid expert id may hold anything (a grouped GEMM does not write them):
    with ``drop_invalid`` they are zeroed first (one extra pass over the pairs), otherwise the caller
    must keep them out. Differentiable w.r.t. ``rows`` and ``topk_weights``.

    Raises:
        ValueError: ``rows`` is not ``[plan.num_rows, H]`` or ``topk_weights`` not ``[T, K]``.
    """
    T, K = plan.num_tokens, plan.top_k
    if rows.dim() != 2 or rows.shape[0] != plan.num_rows:
        raise ValueError(f"rows: expected shape [{plan.num_rows}, H], got {tuple(rows.shape)}")
    if topk_weights is not None and tuple(topk_weights.shape) != (T, K):
        raise ValueError(f"topk_weights: expected shape {(T, K)}, got {tuple(topk_weights.shape)}")
    if topk_weights is not None and not drop_invalid:  # each pair's row read once, no [T, K, H] round trip
        return gathered_weighted_sum(rows, plan.pair_rows.view(T, K), topk_weights)
    pairs = rows.index_select(0, plan.pair_rows).view(T, K, rows.shape[1])
    if drop_invalid:
        pairs = pairs.masked_fill(~plan.valid.view(T, K, 1), 0)
    if topk_weights is None:
        return pairs
    return weighted_sum(pairs, topk_weights)


def _check_x(x: Tensor, plan: DispatchPlan) -> None:
    if x.dim() != 2 or x.shape[0] != plan.num_tokens:
        raise ValueError(f"x: expected shape [{plan.num_tokens}, H], got {tuple(x.shape)}")
