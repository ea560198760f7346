"""LoRA adapters a :class:`moeyard.MoE` carries on its expert projections, in PEFT's layout.

One :class:`LoRAAdapter` per projection holds ``lora_A`` (an ``nn.Linear(in, r*E)``: weight
``[r*E, in]``, rows expert-major) and ``lora_B`` (an ``nn.Linear(r*E, out)``: weight ``[out, r*E]``,
columns rank-major), exactly the parameters PEFT (>= 0.17) creates for a 3-D expert parameter with
``LoraConfig(target_parameters=...)``, initialised as PEFT does (A: Kaiming-uniform with
``a = sqrt(5)``, B: zeros, so a fresh adapter changes nothing). The layer's state dict then holds
``lora.gate_up_proj.lora_A.weight`` etc. Scaling ``alpha / r`` (Hu et al., arXiv 2106.09685) or
``alpha / sqrt(r)`` with rsLoRA (Kalajdzievski, arXiv 2312.03732).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from .weights import ExpertLoRA

Tensor = torch.Tensor


def adapter_scaling(
    num_experts: int, in_features: int, out_features: int, rank: int, alpha: float | None, rslora: bool
) -> tuple[float, float]:
    """``(alpha, s)`` of an adapter after checking its sizes: ``alpha`` (default ``rank``) and the scale ``s =
    alpha / r`` (Hu et al., arXiv 2106.09685), or ``alpha / sqrt(r)`` with ``rslora`` (arXiv 2312.03732). Shared
    by :class:`LoRAAdapter` and the JAX layer's.

    Raises:
        ValueError: a size or rank that is not a positive int, or an alpha that is not a positive number.
    """
    for name, v in (
        ("num_experts", num_experts),
        ("in_features", in_features),
        ("out_features", out_features),
        ("rank", rank),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: expected a positive int, got {v!r}")
    alpha = float(rank if alpha is None else alpha)
    if not alpha > 0 or not math.isfinite(alpha):
        raise ValueError(f"alpha: expected a positive number, got {alpha!r}")
    return alpha, alpha / (math.sqrt(rank) if rslora else rank)


def check_new_adapters(has_adapters: bool, targets: tuple, sizes: dict) -> None:
    """``add_lora``'s checks (both layers'): no adapters yet, and ``targets`` a non-empty subset of ``sizes``'
    keys (the projections).

    Raises:
        ValueError: adapters already present, or a bad target.
    """
    if has_adapters:
        raise ValueError("add_lora: this layer already has LoRA adapters (merge_lora() or drop self.lora first)")
    if not targets or any(t not in sizes for t in targets):
        raise ValueError(f"targets: expected a non-empty subset of {tuple(sizes)}, got {targets!r}")


class LoRAAdapter(nn.Module):
    """``s * B_e A_e`` for an ``[E, out, in]`` expert projection (see the module docstring).

    Args:
        num_experts, in_features, out_features: E and the projection's true input / output sizes.
        rank: r >= 1. alpha: ``lora_alpha`` (default r, so s = 1). rslora: s = alpha / sqrt(r).
    Raises:
        ValueError: a size, rank or alpha that is not positive.
    """

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        rank: int,
        *,
        alpha: float | None = None,
        rslora: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        alpha, self.scaling = adapter_scaling(num_experts, in_features, out_features, rank, alpha, rslora)
        kw = {"device": device, "dtype": dtype}
        self.num_experts, self.rank, self.alpha = num_experts, rank, alpha
        self.lora_A = nn.Linear(in_features, rank * num_experts, bias=False, **kw)
        self.lora_B = nn.Linear(rank * num_experts, out_features, bias=False, **kw)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def expert_lora(self) -> ExpertLoRA:
        """The adapter as :func:`moeyard.experts` takes it."""
        return ExpertLoRA(
            lora_A=self.lora_A.weight, lora_B=self.lora_B.weight, scaling=self.scaling, num_experts=self.num_experts
        )

    def delta_weight(self) -> Tensor:
        """``[E, out, in]``: ``s * B_e @ A_e`` (for merging; the forward never forms it)."""
        E, r = self.num_experts, self.rank
        A = self.lora_A.weight.view(E, r, -1)
        B = self.lora_B.weight.view(-1, r, E).permute(2, 0, 1)
        return self.scaling * (B @ A)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, rank={self.rank}, alpha={self.alpha:g}, scaling={self.scaling:g}"
