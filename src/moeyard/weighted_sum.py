"""The combine's weighted sum: ``out[t] = sum_k w[t, k] * pairs[t, k]``, and its gradients.

Every combine that gathers each token's pair rows ends here (:func:`moeyard.dispatch.unpermute`, the
expert-parallel combines). A ``bmm`` of ``[T, 1, K] x [T, K, H]`` does it in one call, but cuBLAS runs
it as a GEMM with an 8-wide tile and reached 1.0 TB/s on an H100 at Qwen3-30B-A3B's 1.07 GB of pairs
(1.06 ms; ``benchmarks/NOTES.md`` round 18), a third of the memory's rate. On CUDA, Triton kernels
(:mod:`.weighted_sum_triton`) touch the pairs once each way instead (H100, that shape: forward 0.40 ms,
backward 0.85 ms against the ``bmm``'s 2.57 ms):

- forward: ``out [T, H]``, float32 sums over k in order 0..K-1, one rounding to the output dtype;
- backward: ``d pairs[t, k] = w[t, k] * d out[t]`` (float32 product, rounded once) and
  ``d w[t, k] = <d out[t], pairs[t, k]>`` (float32 sums in a fixed order over H).

Deterministic (no atomics). Elsewhere (CPU) the ``bmm``, which is also the tests' reference.

:func:`gathered_sum` is the forward for pairs that sit in a buffer at the rows an index names (the
symmetric-memory combines): one pass reads each row, sums, and writes the ``[T, K, H]`` copy only
when backward needs it (one H200, qwen3-30b-a3b: the ``p2p`` combine 1.41 -> 0.84 ms against a gather
then the sum; ``benchmarks/NOTES.md`` round 19). :func:`gathered_weighted_sum` is the same with autograd,
its backward writing each pair's gradient row straight to the row it came from (``unpermute``; one H200,
qwen3-30b-a3b, the ``grouped_mm`` backend's forward + backward 25.5 -> 20.7 ms, round 20).
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def weighted_sum(pairs: Tensor, weights: Tensor) -> Tensor:
    """``pairs [T, K, H]``, ``weights [T, K]`` (cast to ``pairs.dtype``) -> ``[T, H]`` in
    ``pairs.dtype``. Differentiable w.r.t. both. No host sync. Shapes are not checked here (the
    callers, :func:`moeyard.dispatch.unpermute` and the combines, hold them by construction)."""
    weights = weights.to(pairs.dtype)
    if _on_kernels(pairs):
        return _WeightedSum.apply(pairs, weights)
    return weighted_sum_reference(pairs, weights)


def weighted_sum_reference(pairs: Tensor, weights: Tensor) -> Tensor:
    """The same as one ``bmm`` per token."""
    return torch.bmm(weights.to(pairs.dtype).unsqueeze(1), pairs).squeeze(1)


def gathered_sum(
    src: Tensor,
    index: Tensor,
    weights: Tensor | None = None,
    *,
    keep: bool = False,
    row0: int = 0,
    into: Tensor | None = None,
    row_terms: Tensor | None = None,
    out: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``out[t] = sum_k w[t, k] * src[index[t, k] - row0]`` (``w = 1`` when ``weights`` is None), outside
    autograd, with each gathered row read once: ``src [n, H]`` holds rows ``row0 .. row0 + n - 1`` of the
    numbering ``index [T, K]`` int64 uses (an index outside them, e.g. < 0, names no row: that pair adds
    nothing, whatever its weight), ``weights [T, K]`` in ``src.dtype``. Returns ``(out [T, H], pairs [T,
    K, H] | None)`` in ``src.dtype``; with ``keep`` the gathered rows ``src[index]`` too (for a backward
    that needs them), written by the same pass. ``into [T, H]`` (``src.dtype``, contiguous): the sum is
    added to it (in float32, rounded once) and it is returned as ``out``; so a sum over rows that come a
    window at a time (``row0``) never needs them all at once. ``row_terms [T]`` float32: ``row_terms[t]``
    is added to every element of ``out[t]`` in the same float32 sum (e.g. 0, or NaN for a token whose
    routing is invalid, without a pass over ``[T, H]`` of its own). ``out [T, H]`` (``src.dtype``, unit
    column stride, e.g. a column window of a wider tensor): the sum is written there (not added: ``into``)
    and it is returned. Sums as :func:`weighted_sum`. For the
    combines that read their pairs out of a buffer (:mod:`moeyard.parallel.send_order`), saving the
    ``[T, K, H]`` copy a gather then a sum would write and read again. No host sync; index ranges are not
    checked (the callers hold them by construction: a check would read the device).

    Raises:
        ValueError: ``into`` not a contiguous ``[T, H]`` tensor of ``src``'s dtype and device, ``out`` not a
            ``[T, H]`` one with unit column stride or given with ``into``, ``row0`` negative, or ``row_terms``
            not a ``[T]`` float32 tensor on ``src``'s device.
    """
    if out is not None and (
        into is not None
        or out.shape != (index.shape[0], src.shape[1])
        or out.dtype != src.dtype
        or out.device != src.device
        or (out.numel() and out.stride(1) != 1)
    ):
        raise ValueError(
            f"out: expected a [{index.shape[0]}, {src.shape[1]}] {src.dtype} tensor on {src.device} with unit "
            f"column stride (and no into), got {tuple(out.shape)} {out.dtype} on {out.device}"
            + (" with into" if into is not None else "")
        )
    if into is not None and (
        into.shape != (index.shape[0], src.shape[1])
        or into.dtype != src.dtype
        or into.device != src.device
        or not into.is_contiguous()
    ):
        raise ValueError(
            f"into: expected a contiguous [{index.shape[0]}, {src.shape[1]}] {src.dtype} tensor on {src.device}, "
            f"got {tuple(into.shape)} {into.dtype} on {into.device}"
        )
    if row0 < 0:
        raise ValueError(f"row0: expected a row number >= 0, got {row0}")
    if row_terms is not None and (
        row_terms.shape != (index.shape[0],) or row_terms.dtype != torch.float32 or row_terms.device != src.device
    ):
        raise ValueError(
            f"row_terms: expected a [{index.shape[0]}] float32 tensor on {src.device}, "
            f"got {tuple(row_terms.shape)} {row_terms.dtype} on {row_terms.device}"
        )
    if _on_kernels(src) and index.numel() and src.stride(1) == 1:
        from .weighted_sum_triton import gathered_sum as kernel

        w = None if weights is None else weights.contiguous()
        terms = None if row_terms is None else row_terms.contiguous()
        return kernel(src, index.contiguous(), w, keep, row0, into, terms, out)
    T, K = index.shape
    rows = index - row0
    named = (rows >= 0) & (rows < src.shape[0])
    pairs = src.index_select(0, rows.clamp(0, max(src.shape[0] - 1, 0)).reshape(-1)).view(T, K, src.shape[1])
    pairs = pairs.masked_fill(~named.unsqueeze(2), 0)
    if into is None and row_terms is None:
        total = pairs.sum(1) if weights is None else weighted_sum_reference(pairs, weights)
    else:  # the sum, into's values and the row terms added in float32, rounded once (as the kernel does)
        p32 = pairs.float()
        total = p32.sum(1) if weights is None else weighted_sum_reference(p32, weights)
        total = total if into is None else total + into.float()
        total = total if row_terms is None else total + row_terms[:, None]
        total = total.to(src.dtype) if into is None else into.copy_(total)
    if out is not None:
        total = out.copy_(total)
    return total, pairs if keep else None


def gathered_weighted_sum(src: Tensor, index: Tensor, weights: Tensor) -> Tensor:
    """``out[t] = sum_k w[t, k] * src[index[t, k]]``, differentiable w.r.t. ``src`` and ``weights``:
    ``src [R, H]``, ``index [T, K]`` int64 naming distinct rows of ``src`` (as
    :attr:`moeyard.dispatch.DispatchPlan.pair_rows` does), ``weights [T, K]`` (cast to ``src.dtype``) ->
    ``[T, H]`` in ``src.dtype``. Each gathered row is read once (:func:`gathered_sum`; the ``[T, K, H]``
    copy is written only when ``weights`` needs a gradient, which reads it). Backward: ``d src[index[t,
    k]] = w[t, k] * d out[t]`` written straight to its row, zero in the rows no pair names; ``d w`` as
    :func:`weighted_sum`'s. Against a gather then :func:`weighted_sum`: one pass over the pairs less each
    way (``benchmarks/NOTES.md``, round 20). No host sync; rows are not checked for distinctness."""
    return _GatheredSum.apply(src, index, weights.to(src.dtype))


def weights_grad(pairs: Tensor, grad_out: Tensor) -> Tensor:
    """``d weights [T, K]`` in ``pairs.dtype``: ``<grad_out[t], pairs[t, k]>`` (``grad_out [T, H]``)."""
    if _on_kernels(pairs):
        from .weighted_sum_triton import weights_grad as kernel

        return kernel(pairs.contiguous(), grad_out.contiguous())
    return torch.bmm(pairs, grad_out.to(pairs.dtype).unsqueeze(2)).squeeze(2)


def _on_kernels(pairs: Tensor) -> bool:
    return pairs.is_cuda and pairs.dtype in (torch.float32, torch.float16, torch.bfloat16) and pairs.numel() > 0


class _WeightedSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pairs, weights):
        from .weighted_sum_triton import weighted_sum_forward

        pairs, weights = pairs.contiguous(), weights.contiguous()
        ctx.save_for_backward(pairs, weights)
        return weighted_sum_forward(pairs, weights)

    @staticmethod
    def backward(ctx, grad_out):
        from .weighted_sum_triton import pairs_grad

        pairs, weights = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        d_pairs = pairs_grad(weights, grad_out) if ctx.needs_input_grad[0] else None
        d_w = weights_grad(pairs, grad_out) if ctx.needs_input_grad[1] else None
        return d_pairs, d_w


class _GatheredSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, src, index, weights):
        keep = ctx.needs_input_grad[2]
        out, pairs = gathered_sum(src, index, weights, keep=keep)
        ctx.save_for_backward(index, weights, pairs)
        ctx.num_rows = src.shape[0]
        return out

    @staticmethod
    def backward(ctx, grad_out):
        index, weights, pairs = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        d_src = d_w = None
        if ctx.needs_input_grad[0]:
            d_src = _scattered_pairs_grad(weights, grad_out, index, ctx.num_rows)
        if ctx.needs_input_grad[2]:
            d_w = weights_grad(pairs, grad_out)
        return d_src, None, d_w


def _scattered_pairs_grad(weights: Tensor, grad_out: Tensor, index: Tensor, num_rows: int) -> Tensor:
    """``[num_rows, H]``: row ``index[t, k]`` holds ``weights[t, k] * grad_out[t]``, the other rows zero."""
    if _on_kernels(grad_out):
        from .weighted_sum_triton import scattered_pairs_grad

        return scattered_pairs_grad(weights.contiguous(), grad_out, index.contiguous(), num_rows)
    d_pairs = weights.unsqueeze(2) * grad_out.unsqueeze(1)
    d_src = grad_out.new_zeros(num_rows, grad_out.shape[1])
    return d_src.index_copy_(0, index.reshape(-1), d_pairs.reshape(-1, grad_out.shape[1]))
