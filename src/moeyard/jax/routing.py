"""Routing on JAX arrays: router logits -> top-k expert ids and weights, plus the load-balancing
losses; every scheme and loss of :func:`moeyard.route`, from the same :class:`moeyard.MoEConfig`.

Legend: T tokens, H hidden size, E experts, K top-k, B sequences (T = B * S).

The formulas, their sources and the precision rules are those of :mod:`moeyard.routing` (its module
docstring): score then top-k (Qwen, OLMoE, Mixtral, DeepSeek-V3 with its selection-only correction bias
and grouped top-k), top-k then score (gpt-oss, Llama 4), renormalisation, ``routed_scaling_factor``;
``aux_loss`` (Switch/GShard), ``seq_aux_loss`` (DeepSeek-V3), ``z_loss`` (ST-MoE). Logits and
everything after them are float32, or float64 for float64 input. Ties in a top-k go to the lower
expert id (``jax.lax.top_k``).

Static shapes throughout: ``route`` traces under ``jax.jit`` and differentiates w.r.t. ``x``, the
router weight and bias (the ids and counts carry no gradient).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ..config import MoEConfig
from .checks import accumulation_dtype, check_float, is_array, kind, precision
from .losses import EPS, load_balancing_loss, sequence_balance_loss, z_loss

__all__ = ["RoutingOutput", "route", "select_experts", "update_correction_bias"]


@dataclass(frozen=True)
class RoutingOutput:
    """What the router returns (a pytree: ``jax.tree_util`` sees every field).

    Attributes:
        topk_ids: ``[T, K]`` int32 expert ids.
        topk_weights: ``[T, K]`` float32 routing weights (float64 for float64 input, as every
            floating field but ``tokens_per_expert``); differentiable.
        router_logits: ``[T, E]``.
        scores: ``[T, E]``, ``softmax`` or ``sigmoid`` of the logits.
        tokens_per_expert: ``[E]`` float32 counts of routed pairs (no gradient).
        aux_loss, seq_aux_loss, z_loss: unweighted scalar losses.
        loss: the coefficient-weighted sum of the three (from the config).
    """

    topk_ids: jax.Array
    topk_weights: jax.Array
    router_logits: jax.Array
    scores: jax.Array
    tokens_per_expert: jax.Array
    aux_loss: jax.Array
    seq_aux_loss: jax.Array
    z_loss: jax.Array
    loss: jax.Array


jax.tree_util.register_dataclass(RoutingOutput)


def route(
    x,
    weight,
    config: MoEConfig,
    *,
    bias=None,
    correction_bias=None,
    num_sequences: int = 1,
    training: bool = False,
    rng=None,
) -> RoutingOutput:
    """Route ``x [T, H]`` with router ``weight [E, H]`` (and ``bias [E]``) as ``config`` says.

    Args:
        x: ``[T, H]`` float.
        weight: ``[E, H]`` float (cast to ``x``'s dtype, as ``F.linear`` on the PyTorch side).
        config: the :class:`moeyard.MoEConfig`.
        bias: ``[E]`` router bias (gpt-oss), or None.
        correction_bias: ``[E]`` DeepSeek-V3 score-correction bias (selection only), or None.
        num_sequences: B, for the sequence-wise loss; T must be a multiple of it.
        training: enables ``config.router_jitter`` (multiplicative ``U(1 - eps, 1 + eps)`` noise on
            ``x``, Switch Transformer), drawn from ``rng``.
        rng: a ``jax.random`` key; needed when ``training`` and ``config.router_jitter > 0``.
    Returns:
        :class:`RoutingOutput`.
    Raises:
        TypeError: ``config`` not a MoEConfig, or a non-float array.
        ValueError: bad shapes, ``num_sequences``, or a missing ``rng``.
    """
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config: expected a moeyard.MoEConfig, got {type(config).__name__}")
    check_float("x", x, dim=2)
    check_float("weight", weight, dim=2)
    E, H, K = config.num_experts, config.hidden_size, config.top_k
    if tuple(weight.shape) != (E, H) or x.shape[1] != H:
        raise ValueError(
            f"weight: expected shape {(E, H)} with x [T, {H}], got {tuple(weight.shape)} and {tuple(x.shape)}"
        )
    for name, b in (("bias", bias), ("correction_bias", correction_bias)):
        if b is not None:
            check_float(name, b)
            if tuple(b.shape) != (E,):
                raise ValueError(f"{name}: expected shape {(E,)}, got {tuple(b.shape)}")
    T = x.shape[0]
    if isinstance(num_sequences, bool) or not isinstance(num_sequences, int) or num_sequences < 1 or T % num_sequences:
        raise ValueError(f"num_sequences: expected a positive divisor of T={T}, got {num_sequences!r}")
    if training and config.router_jitter > 0:
        if rng is None or not is_array(rng):
            raise ValueError(
                f"rng: expected a jax.random key for router_jitter={config.router_jitter} in training, got {kind(rng)}"
            )
        eps = config.router_jitter
        x = x * jax.random.uniform(rng, x.shape, x.dtype, 1 - eps, 1 + eps)
    logits = router_logits(x, weight, bias)
    scores = _score(logits, config.score_func)
    if config.topk_before_score:
        top_logits, ids = jax.lax.top_k(logits, K)
        w = _score(top_logits, config.score_func)
        if config.score_func == "sigmoid" and config.norm_topk_prob:
            w = w / (w.sum(-1, keepdims=True) + EPS)
    else:
        ids = select_experts(scores, config, correction_bias)
        w = jnp.take_along_axis(scores, ids, axis=1)
        if config.norm_topk_prob:
            w = w / (w.sum(-1, keepdims=True) + EPS)
    w = w * config.routed_scaling_factor
    ids = ids.astype(jnp.int32)
    counts = jnp.zeros(E, jnp.float32).at[ids.reshape(-1)].add(1)
    probs = scores if config.score_func == "softmax" else scores / (scores.sum(-1, keepdims=True) + EPS)
    aux = load_balancing_loss(probs, counts, K)
    # one sequence (B = 1, S = T): the sequence-wise loss is the aux loss itself
    seq = aux if num_sequences == 1 else sequence_balance_loss(probs, ids, E, K, num_sequences)
    z = z_loss(logits)
    loss = config.aux_loss_coef * aux + config.seq_aux_loss_coef * seq + config.z_loss_coef * z
    return RoutingOutput(
        topk_ids=ids,
        topk_weights=w,
        router_logits=logits,
        scores=scores,
        tokens_per_expert=counts,
        aux_loss=aux,
        seq_aux_loss=seq,
        z_loss=z,
        loss=loss,
    )


def router_logits(x, weight, bias=None):
    """``x W^T + b`` in ``x``'s dtype (one rounding, as ``F.linear``), returned in float32 (float64
    for float64 ``x``)."""
    acc = accumulation_dtype(x.dtype)
    y = jnp.dot(x, weight.astype(x.dtype).T, precision=precision(x.dtype), preferred_element_type=acc)
    if bias is not None:
        y = y + bias.astype(x.dtype).astype(acc)
    return y.astype(x.dtype).astype(acc)


def select_experts(scores, config: MoEConfig, correction_bias=None):
    """Top-k expert ids ``[T, K]`` int32 from ``scores [T, E]`` (+ the selection bias; grouped top-k:
    a group scores the sum of its top-2, only the best ``topk_group`` of ``n_group`` groups are
    eligible, DeepSeek-V3 report, arXiv 2412.19437, sec. 2.1.2)."""
    choice = scores if correction_bias is None else scores + correction_bias.astype(scores.dtype)
    if config.n_group > 1:
        T, E = choice.shape
        G = config.n_group
        grouped = choice.reshape(T, G, E // G)
        group_scores = jax.lax.top_k(grouped, min(2, E // G))[0].sum(-1)  # [T, G]
        keep = jax.lax.top_k(group_scores, config.topk_group)[1]  # [T, topk_group]
        mask = (keep[:, :, None] == jnp.arange(G)).any(1)  # [T, G]
        choice = jnp.where(mask[:, :, None], grouped, -jnp.inf).reshape(T, E)
    return jax.lax.top_k(choice, config.top_k)[1].astype(jnp.int32)


def update_correction_bias(bias, tokens_per_expert, rate: float = 1e-3):
    """DeepSeek-V3's auxiliary-loss-free balancing step (arXiv 2408.15664; DeepSeek-V3 report,
    sec. 2.1.2): ``b_e + rate * sign(mean_load - load_e)``. Returns a new ``[E]`` array in ``bias``'s
    dtype (JAX arrays are immutable: nothing is modified).

    Args:
        bias: ``[E]`` current score-correction bias.
        tokens_per_expert: ``[E]`` routed pairs per expert (summed over the steps since the last update).
        rate: the bias update speed ``gamma`` (DeepSeek-V3: 0.001).
    """
    load = tokens_per_expert.astype(bias.dtype)
    return bias + rate * jnp.sign(load.mean() - load)


def _score(logits, score_func: str):
    return jax.nn.softmax(logits, axis=-1) if score_func == "softmax" else jax.nn.sigmoid(logits)
