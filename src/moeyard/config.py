"""MoE layer configuration.

Field names follow transformers' MoE configs (``num_experts``, ``top_k`` = ``num_experts_per_tok``,
``norm_topk_prob``, ``n_group``, ``topk_group``, ``routed_scaling_factor``); formulas and defaults are
sourced in :mod:`moeyard.routing`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .activations import GATED, PLAIN

SCORE_FUNCS = ("softmax", "sigmoid")


@dataclass(kw_only=True)
class MoEConfig:
    """Configuration of one MoE layer (router + routed experts + optional shared experts).

    Attributes:
        num_experts: E, routed experts.
        hidden_size: H, model width.
        intermediate_size: I, each routed expert's intermediate size.
        top_k: K, experts per token (``1 <= K <= E``).
        score_func: ``softmax`` (Qwen, OLMoE, Mixtral, gpt-oss) or ``sigmoid`` (DeepSeek-V3, Llama 4).
        topk_before_score: take the top-k of the logits, then score only those (gpt-oss: softmax over the
            top-k logits; Llama 4: sigmoid of the top-1 logit). Default: score all, then top-k.
        norm_topk_prob: renormalise the top-k weights to sum to 1.
        n_group, topk_group: DeepSeek-V3 grouped top-k: experts split into ``n_group`` groups, a group
            scores the sum of its top-2 scores, only the best ``topk_group`` groups are eligible.
        score_correction_bias: add a learned-free per-expert bias to the scores for *selection only*
            (DeepSeek-V3's ``e_score_correction_bias``, updated by :func:`moeyard.routing.update_correction_bias`).
        routed_scaling_factor: multiplies the final top-k weights (DeepSeek-V3: 2.5).
        router_bias: the router linear has a bias (gpt-oss).
        router_jitter: multiplicative jitter ``U(1 - eps, 1 + eps)`` on the router input in training
            (Switch Transformer); 0 disables it.
        activation: expert activation name (:mod:`moeyard.activations`); ``clamped_swiglu`` is gpt-oss's.
        activation_alpha, activation_limit: ``clamped_swiglu`` parameters (gpt-oss: 1.702, 7.0).
        expert_bias: routed experts have biases (gpt-oss).
        num_shared_experts: shared experts applied to every token (DeepSeek: 1), fused into one MLP of
            ``num_shared_experts * shared_intermediate_size``.
        shared_intermediate_size: the shared expert's intermediate size (default: ``intermediate_size``).
        shared_expert_gate: scale the shared output by ``sigmoid(x @ w_gate)`` (Qwen2-MoE, Qwen3-Next, Qwen3.5).
        aux_loss_coef: weight of the Switch/GShard load-balancing loss.
        seq_aux_loss_coef: weight of DeepSeek-V3's sequence-wise balance loss.
        z_loss_coef: weight of the router z-loss (ST-MoE).
    """

    num_experts: int
    hidden_size: int
    intermediate_size: int
    top_k: int
    score_func: str = "softmax"
    topk_before_score: bool = False
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    score_correction_bias: bool = False
    routed_scaling_factor: float = 1.0
    router_bias: bool = False
    router_jitter: float = 0.0
    activation: str = "swiglu"
    activation_alpha: float = 1.702
    activation_limit: float = 7.0
    expert_bias: bool = False
    num_shared_experts: int = 0
    shared_intermediate_size: int | None = None
    shared_expert_gate: bool = False
    aux_loss_coef: float = 0.0
    seq_aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0

    def __post_init__(self):
        validate(self)


def validate(cfg: MoEConfig) -> None:
    """State every constraint of a :class:`MoEConfig` in one place.

    Raises:
        ValueError: the first violated constraint, naming the field.
    """
    for name in ("num_experts", "hidden_size", "intermediate_size", "top_k", "n_group", "topk_group"):
        v = getattr(cfg, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}: expected a positive int, got {v!r}")
    if cfg.top_k > cfg.num_experts:
        raise ValueError(f"top_k: expected at most num_experts={cfg.num_experts}, got {cfg.top_k}")
    if cfg.score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func: expected one of {SCORE_FUNCS}, got {cfg.score_func!r}")
    if cfg.num_experts % cfg.n_group:
        raise ValueError(f"n_group: expected a divisor of num_experts={cfg.num_experts}, got {cfg.n_group}")
    if cfg.topk_group > cfg.n_group:
        raise ValueError(f"topk_group: expected at most n_group={cfg.n_group}, got {cfg.topk_group}")
    if cfg.n_group > 1:
        per_group = cfg.num_experts // cfg.n_group
        if cfg.topk_group * per_group < cfg.top_k:
            raise ValueError(
                f"topk_group: {cfg.topk_group} groups of {per_group} experts cannot hold top_k={cfg.top_k}"
            )
        if cfg.topk_before_score:
            raise ValueError("n_group: grouped top-k needs topk_before_score=False")
    if cfg.activation not in GATED + PLAIN:
        raise ValueError(f"activation: expected one of {GATED + PLAIN}, got {cfg.activation!r}")
    for name in ("num_shared_experts",):
        v = getattr(cfg, name)
        if not isinstance(v, int) or v < 0:
            raise ValueError(f"{name}: expected a non-negative int, got {v!r}")
    if cfg.shared_intermediate_size is not None and cfg.shared_intermediate_size < 1:
        raise ValueError(f"shared_intermediate_size: expected a positive int, got {cfg.shared_intermediate_size!r}")
    if cfg.shared_expert_gate and cfg.num_shared_experts == 0:
        raise ValueError("shared_expert_gate: needs num_shared_experts >= 1")
    for name in ("routed_scaling_factor",):
        if getattr(cfg, name) <= 0:
            raise ValueError(f"{name}: expected a positive number, got {getattr(cfg, name)!r}")
    for name in ("router_jitter", "aux_loss_coef", "seq_aux_loss_coef", "z_loss_coef"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"{name}: expected a non-negative number, got {getattr(cfg, name)!r}")
