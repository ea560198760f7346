"""The router's load-balancing losses, from dense ``[T, E]`` tensors or from their sufficient statistics.

Formulas and sources: the :mod:`moeyard.routing` module docstring. The ``*_from_stats`` forms take
per-expert sums (counts of routed pairs, column sums of the probabilities, the sum of
``logsumexp^2``) without keeping a ``[T, E]`` one-hot; the dense forms compute those sums and call them,
so the torch path has one formula. The fused router computes the same formulas from the same sums in its
losses kernel, with the constant factors folded (:class:`moeyard.routing.fused.LossSpec`); its tests
compare every loss and gradient with the torch path.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor
EPS = 1e-20  # the guard of every renormalisation by a sum of scores (torch path and fused kernels)


def balance_loss_from_stats(counts: Tensor, prob_sum: Tensor, num_tokens: int, top_k: int) -> Tensor:
    """Switch/GShard aux loss ``E * sum_e f_e * P_e`` with ``f_e = counts_e / (T K)`` and
    ``P_e = prob_sum_e / T``; 0 for T = 0.

    Args:
        counts: ``[E]`` float32 routed pairs per expert.
        prob_sum: ``[E]`` float32 ``sum_t probs[t, e]``.
    """
    if num_tokens == 0:
        return prob_sum.sum() * 0
    E = prob_sum.shape[-1]
    f = counts.to(prob_sum.dtype) / (num_tokens * top_k)  # float64 probabilities: f in float64 too
    return E * (f * (prob_sum / num_tokens)).sum()


def sequence_balance_from_stats(counts: Tensor, prob_sum: Tensor, seq_len: int, top_k: int) -> Tensor:
    """DeepSeek-V3 sequence-wise loss ``mean_b sum_e f_be P_be`` with ``f_be = E / (K S) * counts_be``
    and ``P_be = prob_sum_be / S``; 0 when there are no tokens.

    Args:
        counts: ``[B, E]`` float32 routed pairs per sequence and expert.
        prob_sum: ``[B, E]`` float32 ``sum_{t in b} probs[t, e]`` (probs normalised per token).
        seq_len: S tokens per sequence.
    """
    if seq_len == 0 or prob_sum.shape[0] == 0:
        return prob_sum.sum() * 0
    E = prob_sum.shape[-1]
    f = counts.to(prob_sum.dtype) * (E / (top_k * seq_len))
    return (f * (prob_sum / seq_len)).sum(-1).mean()


def z_loss_from_stats(lse_sq_sum: Tensor, num_tokens: int) -> Tensor:
    """Router z-loss ``mean_t logsumexp(l_t)^2`` from ``lse_sq_sum = sum_t logsumexp(l_t)^2`` (a
    scalar); 0 for T = 0."""
    return lse_sq_sum * 0 if num_tokens == 0 else lse_sq_sum / num_tokens


def load_balancing_loss(probs: Tensor, tokens_per_expert: Tensor, top_k: int) -> Tensor:
    """Switch/GShard aux loss ``E * sum_e f_e * P_e`` (module docstring); 0 for T = 0."""
    return balance_loss_from_stats(tokens_per_expert, probs.sum(0), probs.shape[0], top_k)


def sequence_balance_loss(probs: Tensor, topk_ids: Tensor, num_experts: int, top_k: int, num_sequences: int) -> Tensor:
    """DeepSeek-V3 sequence-wise balance loss (module docstring); 0 for T = 0.

    Args:
        probs: ``[T, E]`` float32 probabilities (normalised per token), T = B * S in sequence order.
        topk_ids: ``[T, K]`` integer expert ids.
        num_sequences: B.
    """
    T = probs.shape[0]
    B, S = num_sequences, T // num_sequences
    seq = torch.arange(T, device=topk_ids.device).div_(max(S, 1), rounding_mode="floor").unsqueeze(1)
    slots = (seq * num_experts + topk_ids).reshape(-1)  # (sequence, expert) of every pair: no [T, E] one-hot
    counts = torch.zeros(B * num_experts, device=probs.device, dtype=probs.dtype).index_add_(
        0, slots, torch.ones(slots.numel(), device=probs.device, dtype=probs.dtype)
    )
    return sequence_balance_from_stats(counts.view(B, num_experts), probs.view(B, S, num_experts).sum(1), S, top_k)


def z_loss(logits: Tensor) -> Tensor:
    """Router z-loss ``mean_t logsumexp(logits_t)^2`` (ST-MoE); 0 for T = 0."""
    return z_loss_from_stats(torch.logsumexp(logits, dim=-1).square().sum(), logits.shape[0])
