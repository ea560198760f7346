"""Expert weights as every backend sees them: views of the user's tensors, never copies.

Legend: E experts, H hidden size, I expert intermediate size, N1 = 2I (gated) or I (plain).

Layouts accepted (transformers v5):
- standard: ``gate_up_proj [E, 2I, H]`` (gate rows then up rows) or ``up_proj [E, I, H]``, and
  ``down_proj [E, H, I]``; ``y = x @ W.T`` per expert (``F.linear`` convention).
- transposed (gpt-oss): ``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``; ``y = x @ W``.
- interleaved gate/up columns (gpt-oss: ``gate0, up0, gate1, up1, ...``) with ``interleaved=True``.
Optional biases: ``gate_up_bias [E, N1]``, ``down_bias [E, H]``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import check_float

Tensor = torch.Tensor


@dataclass(frozen=True, kw_only=True)
class ExpertWeights:
    """Canonical ``[out, in]`` views of the expert weights.

    Attributes:
        w_up: ``[E, N1, H]`` (a view; for transposed layouts a ``.mT`` view, non-contiguous).
        w_down: ``[E, H, I]`` (a view, likewise).
        b_up: ``[E, N1]`` or None.
        b_down: ``[E, H]`` or None.
        interleaved: gate/up rows of ``w_up`` alternate (gpt-oss) instead of gate-then-up.
    """

    w_up: Tensor
    w_down: Tensor
    b_up: Tensor | None = None
    b_down: Tensor | None = None
    interleaved: bool = False

    @property
    def num_experts(self) -> int:
        return self.w_up.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w_up.shape[2]

    @property
    def intermediate_size(self) -> int:
        return self.w_down.shape[2]


def expert_weights(
    gate_up_proj: Tensor,
    down_proj: Tensor,
    *,
    gate_up_bias: Tensor | None = None,
    down_bias: Tensor | None = None,
    transposed: bool = False,
    interleaved: bool = False,
    gated: bool = True,
) -> ExpertWeights:
    """Check the weights and return their canonical views (no copies).

    Args:
        gate_up_proj: ``[E, N1, H]`` (or ``[E, H, N1]`` if ``transposed``); ``N1 = 2I`` when
            ``gated`` else ``I`` (then it is transformers' ``up_proj``).
        down_proj: ``[E, H, I]`` (or ``[E, I, H]`` if ``transposed``).
        gate_up_bias, down_bias: ``[E, N1]`` and ``[E, H]``, optional.
    Raises:
        TypeError: a weight is not a floating-point tensor, or dtypes differ.
        ValueError: shapes do not agree (the message names the argument and the expected shape).
    """
    for name, t in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        check_float(name, t)
        if t.dim() != 3:
            raise ValueError(f"{name}: expected a 3-D tensor [E, out, in], got shape {tuple(t.shape)}")
    if gate_up_proj.dtype != down_proj.dtype:
        raise TypeError(f"down_proj: expected dtype {gate_up_proj.dtype} (as gate_up_proj), got {down_proj.dtype}")
    w_up = gate_up_proj.mT if transposed else gate_up_proj
    w_down = down_proj.mT if transposed else down_proj
    E, N1, H = w_up.shape
    I = N1 // 2 if gated else N1
    if gated and N1 % 2:
        raise ValueError(f"gate_up_proj: gated activation needs an even output size 2I, got {N1}")
    want_down = (E, H, I)
    if tuple(w_down.shape) != want_down:
        shown = (E, I, H) if transposed else want_down
        raise ValueError(f"down_proj: expected shape {shown} to match gate_up_proj {tuple(gate_up_proj.shape)}, "
                         f"got {tuple(down_proj.shape)}")
    if interleaved and not gated:
        raise ValueError("interleaved: only meaningful for a gated activation")
    for name, b, shape in (("gate_up_bias", gate_up_bias, (E, N1)), ("down_bias", down_bias, (E, H))):
        if b is None:
            continue
        check_float(name, b)
        if tuple(b.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(b.shape)}")
        if b.device != w_up.device:
            raise ValueError(f"{name}: expected device {w_up.device}, got {b.device}")
    if w_down.device != w_up.device:
        raise ValueError(f"down_proj: expected device {w_up.device}, got {w_down.device}")
    return ExpertWeights(w_up=w_up, w_down=w_down, b_up=gate_up_bias, b_down=down_bias, interleaved=interleaved)
