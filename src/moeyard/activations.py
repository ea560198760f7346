"""Expert activations: gated (GLU family) and plain.

A gated activation takes the up projection's output ``h [R, 2I]`` (gate rows then up rows, or
interleaved ``gate0, up0, gate1, ...`` as in gpt-oss) and returns ``[R, I]``; a plain one maps
``h [R, I] -> [R, I]``.

Sources: GLU variants (Shazeer 2020, arXiv 2002.05202: SwiGLU, GeGLU, ReGLU); ReLU² (So et al.
2021, arXiv 2109.08668); gpt-oss's clamped SwiGLU (alpha 1.702, limit 7.0, ``(up + 1) * glu``) from
the gpt-oss model card and transformers' ``GptOssExperts._apply_gate``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

Tensor = torch.Tensor

GATED = ("swiglu", "geglu", "reglu", "clamped_swiglu")
PLAIN = ("gelu", "relu", "relu2", "silu")


@dataclass(frozen=True, kw_only=True)
class Activation:
    """An expert activation, by name.

    Attributes:
        name: one of ``swiglu`` (default), ``geglu``, ``reglu``, ``clamped_swiglu`` (gpt-oss),
            ``gelu``, ``relu``, ``relu2``, ``silu``.
        alpha: sigmoid slope of ``clamped_swiglu`` (gpt-oss: 1.702).
        limit: clamp of ``clamped_swiglu``: gate to ``(-inf, limit]``, up to ``[-limit, limit]``
            (gpt-oss: 7.0).
        fn: optional callable that replaces the named function (e.g. a transformers
            ``_apply_gate`` override or ``act_fn``): ``h [R, 2I] -> [R, I]`` when ``fn_gated``
            (it then sees ``h`` as stored, so ``interleaved`` is its business), else
            ``h [R, I] -> [R, I]``. A custom ``fn`` cannot be fused into kernels; the name is then
            only a label.
        fn_gated: whether ``fn`` is a gated function (takes ``2I`` columns).
    """

    name: str = "swiglu"
    alpha: float = 1.702
    limit: float = 7.0
    fn: Callable[[Tensor], Tensor] | None = None
    fn_gated: bool = True

    def __post_init__(self):
        if self.fn is None and self.name not in GATED + PLAIN:
            raise ValueError(f"activation: expected one of {GATED + PLAIN}, got {self.name!r}")
        if self.fn is not None and not callable(self.fn):
            raise TypeError(f"activation.fn: expected a callable, got {type(self.fn).__name__}")

    @property
    def gated(self) -> bool:
        """True when the up projection has ``2I`` output rows (gate and up)."""
        return self.fn_gated if self.fn is not None else self.name in GATED

    def __call__(self, h: Tensor, *, interleaved: bool = False) -> Tensor:
        """Apply to ``h [..., 2I]`` (gated) or ``h [..., I]`` (plain); returns ``[..., I]``."""
        if self.fn is not None:
            return self.fn(h)
        if not self.gated:
            return _plain(self.name, h)
        gate, up = split_gate_up(h, interleaved=interleaved)
        return glu(self.name, gate, up, alpha=self.alpha, limit=self.limit)


def split_gate_up(h: Tensor, *, interleaved: bool) -> tuple[Tensor, Tensor]:
    """``h [..., 2I]`` -> ``(gate, up)``, each ``[..., I]`` (views, no copy)."""
    if interleaved:
        return h[..., 0::2], h[..., 1::2]
    return h.chunk(2, dim=-1)


def glu(name: str, gate: Tensor, up: Tensor, *, alpha: float = 1.702, limit: float = 7.0) -> Tensor:
    """The gated function ``act(gate) * up`` (or gpt-oss's clamped form) on ``[..., I]`` inputs of one
    float dtype; returns ``[..., I]`` in that dtype.

    Raises:
        ValueError: ``name`` is not a gated activation (swiglu, geglu, reglu, clamped_swiglu).
    """
    if name == "swiglu":
        return F.silu(gate) * up
    if name == "geglu":
        return F.gelu(gate) * up
    if name == "reglu":
        return F.relu(gate) * up
    if name == "clamped_swiglu":
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    raise ValueError(f"activation: {name!r} is not gated")


def _plain(name: str, h: Tensor) -> Tensor:
    if name == "gelu":
        return F.gelu(h)
    if name == "relu":
        return F.relu(h)
    if name == "relu2":
        return F.relu(h).square()
    if name == "silu":
        return F.silu(h)
    raise ValueError(f"activation: {name!r} is not a plain activation")


def get_activation(activation: str | Activation | Callable[[Tensor], Tensor]) -> Activation:
    """Normalise ``activation`` (a name, an :class:`Activation`, or a gated callable
    ``h [R, 2I] -> [R, I]``, as stored) to an :class:`Activation`.

    Raises:
        ValueError: unknown name. TypeError: anything else.
    """
    if isinstance(activation, Activation):
        return activation
    if isinstance(activation, str):
        return Activation(name=activation)
    if callable(activation):
        return Activation(name="custom", fn=activation)
    raise TypeError(f"activation: expected a name, moeyard.Activation or callable, got {type(activation).__name__}")
