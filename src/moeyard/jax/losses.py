"""The router's load-balancing losses on JAX arrays: the formulas of :mod:`moeyard.routing.losses`
(Switch/GShard aux loss, DeepSeek-V3's sequence-wise loss, ST-MoE's z-loss; sources in the
:mod:`moeyard.routing` module docstring), from the same sufficient statistics."""

from __future__ import annotations

import jax
import jax.numpy as jnp

EPS = 1e-20  # the guard of every renormalisation by a sum of scores (as moeyard.routing.losses.EPS)


def balance_loss_from_stats(counts, prob_sum, num_tokens: int, top_k: int):
    """``E * sum_e f_e * P_e`` with ``f_e = counts_e / (T K)``, ``P_e = prob_sum_e / T``; 0 for T = 0.
    ``counts [E]`` float32, ``prob_sum [E]`` (the result takes its dtype)."""
    if num_tokens == 0:
        return prob_sum.sum() * 0
    E = prob_sum.shape[-1]
    f = counts.astype(prob_sum.dtype) / (num_tokens * top_k)
    return E * (f * (prob_sum / num_tokens)).sum()


def sequence_balance_from_stats(counts, prob_sum, seq_len: int, top_k: int):
    """``mean_b sum_e f_be P_be`` with ``f_be = E / (K S) * counts_be``, ``P_be = prob_sum_be / S``
    (``counts``, ``prob_sum``: ``[B, E]``); 0 without tokens."""
    if seq_len == 0 or prob_sum.shape[0] == 0:
        return prob_sum.sum() * 0
    E = prob_sum.shape[-1]
    f = counts.astype(prob_sum.dtype) * (E / (top_k * seq_len))
    return (f * (prob_sum / seq_len)).sum(-1).mean()


def load_balancing_loss(probs, tokens_per_expert, top_k: int):
    """Switch/GShard aux loss from ``probs [T, E]`` (normalised per token) and ``tokens_per_expert [E]``."""
    return balance_loss_from_stats(tokens_per_expert, probs.sum(0), probs.shape[0], top_k)


def sequence_balance_loss(probs, topk_ids, num_experts: int, top_k: int, num_sequences: int):
    """DeepSeek-V3 sequence-wise loss from ``probs [T, E]`` (T = B * S in sequence order) and
    ``topk_ids [T, K]``; the per-(sequence, expert) counts without a ``[T, E]`` one-hot."""
    T = probs.shape[0]
    B, S = num_sequences, T // num_sequences
    seq = (jnp.arange(T, dtype=jnp.int32) // max(S, 1))[:, None]
    slots = (seq * num_experts + topk_ids.astype(jnp.int32)).reshape(-1)
    counts = jnp.zeros(B * num_experts, probs.dtype).at[slots].add(1)
    return sequence_balance_from_stats(
        counts.reshape(B, num_experts), probs.reshape(B, S, num_experts).sum(1), S, top_k
    )


def z_loss(logits):
    """Router z-loss ``mean_t logsumexp(logits_t)^2`` (ST-MoE, arXiv 2202.08906, eq. 5); 0 for T = 0."""
    T = logits.shape[0]
    lse_sq = jnp.square(jax.nn.logsumexp(logits, axis=-1)).sum()
    return lse_sq * 0 if T == 0 else lse_sq / T
