"""Routing: router logits -> top-k expert ids and weights, plus the load-balancing losses.

Legend: T tokens, H hidden size, E experts, K top-k, B sequences (T = B * S).

Schemes (see :class:`moeyard.MoEConfig`):
- score then top-k (Qwen2/3-MoE, OLMoE, Mixtral, DeepSeek-V3): ``s = softmax(l)`` or ``sigmoid(l)``;
  ids = top-k of ``s + b`` (``b``: DeepSeek-V3's score-correction bias, for selection only), within the
  best ``topk_group`` of ``n_group`` expert groups when grouped (a group's score is the sum of its top-2
  ``s + b``; DeepSeek-V3 report, arXiv 2412.19437, sec. 2.1.2); weights ``w = s[ids]``.
- top-k then score (gpt-oss: softmax over the top-k logits; Llama 4: sigmoid of the top-1 logit).
- ``norm_topk_prob``: ``w / sum(w)``; then ``w * routed_scaling_factor``.

Precision: logits, scores, weights and losses are float32, or float64 for float64 input (the
float64 oracle routes in float64 too, so a float64 layer is float64 end to end).

Losses (all scalars, float32 (float64 for float64 input), differentiable w.r.t. the router weight):
- ``aux_loss``, the Switch/GShard load-balancing loss generalised to top-k (Switch Transformer,
  arXiv 2101.03961, eq. 4; DeepSeekMoE's expert-level form, arXiv 2401.06066, eq. 12-14):
  ``E * sum_e f_e * P_e`` with ``f_e`` the fraction of the T*K routed pairs sent to expert e and
  ``P_e`` the mean routing probability of e. It is 1 under perfectly uniform routing. (transformers'
  ``load_balancing_loss_func`` for Mixtral/Qwen is K times this value.)
- ``seq_aux_loss``, DeepSeek-V3's sequence-wise balance loss (arXiv 2412.19437, eq. 17-20):
  per sequence ``sum_e f_e * P_e`` with ``f_e = E / (K * S) * count_e`` and ``P_e`` the mean of the
  normalised scores ``s_e / sum_j s_j``, averaged over the B sequences.
- ``z_loss``, the router z-loss (ST-MoE, arXiv 2202.08906, eq. 5): ``mean_t logsumexp(l_t)^2``.

Implementations (:mod:`.options`): the torch path below (the reference), and a fused Triton router
(:mod:`.fused`: logits GEMM, scores, top-k, weights and the loss statistics in one kernel, its
backward in one more). The default, ``auto``, runs the fused router on CUDA when triton is installed
and the torch path elsewhere; ``MOEYARD_ROUTER=torch|fused`` or ``use_router(...)`` choose one.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..checks import check_float
from ..config import MoEConfig
from .losses import EPS, load_balancing_loss, sequence_balance_loss, z_loss
from .options import router_impl, use_router
from .output import RoutingOutput, finish

Tensor = torch.Tensor
__all__ = [
    "Router",
    "RoutingOutput",
    "route",
    "select_experts",
    "update_correction_bias",
    "load_balancing_loss",
    "sequence_balance_loss",
    "z_loss",
    "router_impl",
    "use_router",
]


def route(
    x: Tensor,
    weight: Tensor,
    config: MoEConfig,
    *,
    bias: Tensor | None = None,
    correction_bias: Tensor | None = None,
    num_sequences: int = 1,
    training: bool = False,
) -> RoutingOutput:
    """Route ``x [T, H]`` with router ``weight [E, H]`` (and ``bias [E]``) as ``config`` says.

    Runs the fused Triton router where the implementation in force (:mod:`.options`; default
    ``auto``: CUDA tensors with triton installed) picks it and it applies (float16/bfloat16/float32,
    ``E <= 512``, ``K <= 16``, no grouped top-k, no jitter: :func:`moeyard.routing.fused.unsupported`);
    else the torch ops below.

    Args:
        correction_bias: ``[E]`` DeepSeek-V3 score-correction bias (selection only), or None.
        num_sequences: B, for the sequence-wise loss; T must be a multiple of it.
        training: enables ``config.router_jitter``.
    Raises:
        TypeError / ValueError: bad shapes, dtypes or ``num_sequences``.
        ImportError: ``MOEYARD_ROUTER=fused`` without triton.
    """
    check_float("x", x, dim=2)
    check_float("weight", weight, dim=2)
    E, H = config.num_experts, config.hidden_size
    if tuple(weight.shape) != (E, H) or x.shape[1] != H:
        raise ValueError(
            f"weight: expected shape {(E, H)} with x [T, {H}], got {tuple(weight.shape)} and {tuple(x.shape)}"
        )
    T = x.shape[0]
    if not isinstance(num_sequences, int) or num_sequences < 1 or T % num_sequences:
        raise ValueError(f"num_sequences: expected a positive divisor of T={T}, got {num_sequences!r}")
    fused = _pick_fused(x)
    if fused is not None:
        if fused.unsupported(x, config, training=training) is None:
            return fused.route_fused(
                x, weight, config, bias=bias, correction_bias=correction_bias, num_sequences=num_sequences
            )
    if training and config.router_jitter > 0:
        eps = config.router_jitter
        x = x * torch.empty_like(x).uniform_(1 - eps, 1 + eps)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    logits = F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype)).to(acc)
    scores = _score(logits, config.score_func)
    if config.topk_before_score:
        top_logits, ids = logits.topk(config.top_k, dim=-1)
        w = _score(top_logits, config.score_func)
        if config.score_func == "sigmoid" and config.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + EPS)
    else:
        ids = select_experts(scores, config, correction_bias)
        w = scores.gather(1, ids)
        if config.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + EPS)
    w = w * config.routed_scaling_factor
    counts = torch.zeros(E, device=x.device, dtype=torch.float32).index_add_(
        0, ids.reshape(-1), torch.ones(ids.numel(), device=x.device, dtype=torch.float32)
    )
    probs = scores if config.score_func == "softmax" else scores / (scores.sum(-1, keepdim=True) + EPS)
    aux = load_balancing_loss(probs, counts, config.top_k)
    # one sequence (B = 1, S = T): E / (K T^2) * sum_e counts_e * prob_sum_e, the aux loss itself
    seq = aux if num_sequences == 1 else sequence_balance_loss(probs, ids, E, config.top_k, num_sequences)
    z = z_loss(logits)
    return finish(config, ids, w, logits, scores, counts, aux, seq, z)


def _pick_fused(x: Tensor):
    """:mod:`.fused` when the implementation in force picks it for ``x``, else None."""
    impl = router_impl()
    if impl == "fused":
        return _fused_module()
    global _triton_missing
    if impl == "auto" and x.is_cuda and not _triton_missing:
        try:
            return _fused_module()
        except ImportError:  # no triton: the torch path, without retrying the import on every call
            _triton_missing = True
    return None


_triton_missing = False  # set once the fused router failed to import under ``auto``


def _fused_module():
    """:mod:`.fused`, imported on first use (it needs triton)."""
    try:
        from . import fused
    except ImportError as e:
        raise ImportError(
            "MOEYARD_ROUTER=fused needs triton (pip install 'moeyard[triton]'), or use MOEYARD_ROUTER=torch"
        ) from e
    return fused


def select_experts(scores: Tensor, config: MoEConfig, correction_bias: Tensor | None = None) -> Tensor:
    """Top-k expert ids ``[T, K]`` from ``scores [T, E]`` (+ selection bias, grouped top-k)."""
    choice = scores if correction_bias is None else scores + correction_bias.to(scores.dtype)
    if config.n_group > 1:
        T, E = choice.shape
        grouped = choice.view(T, config.n_group, E // config.n_group)
        group_scores = grouped.topk(min(2, E // config.n_group), dim=-1).values.sum(-1)  # [T, n_group]
        keep = group_scores.topk(config.topk_group, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).view(T, E)
    return choice.topk(config.top_k, dim=-1).indices


def update_correction_bias(bias: Tensor, tokens_per_expert: Tensor, rate: float = 1e-3) -> Tensor:
    """DeepSeek-V3's auxiliary-loss-free balancing step (arXiv 2408.15664; DeepSeek-V3 report,
    sec. 2.1.2): ``b_e + rate * sign(mean_load - load_e)`` — overloaded experts become less likely
    to be selected. Returns a new ``[E]`` tensor; ``bias`` is not modified.

    Args:
        bias: ``[E]`` current score-correction bias.
        tokens_per_expert: ``[E]`` routed pairs per expert (summed over the steps since the last update).
        rate: the bias update speed ``gamma`` (DeepSeek-V3: 0.001).
    """
    load = tokens_per_expert.to(bias.dtype)
    return bias + rate * torch.sign(load.mean() - load)


def _score(logits: Tensor, score_func: str) -> Tensor:
    return logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()


class Router(nn.Module):
    """The router: ``weight [E, H]`` (``bias [E]`` if ``config.router_bias``) and DeepSeek-V3's
    ``e_score_correction_bias [E]`` buffer if ``config.score_correction_bias``."""

    def __init__(self, config: MoEConfig, *, device=None, dtype=None):
        super().__init__()
        self.config = config
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, **kw))
        self.bias = nn.Parameter(torch.zeros(config.num_experts, **kw)) if config.router_bias else None
        if config.score_correction_bias:
            self.register_buffer(
                "e_score_correction_bias", torch.zeros(config.num_experts, device=device, dtype=torch.float32)
            )
        else:
            self.e_score_correction_bias = None
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: Tensor, num_sequences: int = 1) -> RoutingOutput:
        """``x [T, H]`` -> :class:`RoutingOutput`."""
        return route(
            x,
            self.weight,
            self.config,
            bias=self.bias,
            correction_bias=self.e_score_correction_bias,
            num_sequences=num_sequences,
            training=self.training,
        )
