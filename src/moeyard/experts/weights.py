"""Expert weights as every backend sees them: views of the user's tensors (no copies), except
``lora_B``, relaid out expert-major once per call (``out * r * E`` elements, e.g. 6 MB at
Qwen3-30B-A3B, r = 16) so every expert's ``[out, r]`` block is contiguous for the kernels' loads.

Legend: E experts, H hidden size, I expert intermediate size, N1 = 2I (gated) or I (plain).

Layouts accepted (transformers v5):
- standard: ``gate_up_proj [E, 2I, H]`` (gate rows then up rows) or ``up_proj [E, I, H]``, and
  ``down_proj [E, H, I]``; ``y = x @ W.T`` per expert (``F.linear`` convention).
- transposed (gpt-oss): ``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``; ``y = x @ W``.
- interleaved gate/up columns (gpt-oss: ``gate0, up0, gate1, up1, ...``) with ``interleaved=True``.
Optional biases: ``gate_up_bias [E, N1]``, ``down_bias [E, H]``.

LoRA adapters (:class:`ExpertLoRA`, one per projection) come in PEFT's layout for 3-D expert
parameters (PEFT >= 0.17 ``target_parameters``), whatever the weight layout: ``lora_A [r*E, in]``
(rows expert-major) and ``lora_B [out, r*E]`` (columns rank-major), ``in``/``out`` the projection's
true input and output sizes. Each expert's projection becomes
``y = x W_e^T + b_e + scaling * (x A_e^T) B_e^T`` with ``A_e = lora_A.view(E, r, in)[e]`` and
``B_e = lora_B.view(out, r, E)[:, :, e]`` (Hu et al., LoRA, arXiv 2106.09685). ``W + dW`` is never formed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..checks import check_float, kind
from ..quant.recipe import Recipe, resolve_recipe
from .quantized import is_quantized
from .relayout import expert_major

Tensor = torch.Tensor


@dataclass(frozen=True, kw_only=True)
class ExpertLoRA:
    """A LoRA adapter of one expert projection, in PEFT's layout (see the module docstring).

    Attributes:
        lora_A: ``[r*E, in]`` float (PEFT's ``lora_A[name].weight``), rows expert-major.
        lora_B: ``[out, r*E]`` float (PEFT's ``lora_B[name].weight``), columns rank-major.
        scaling: the factor ``s`` of ``s * B A`` (PEFT: ``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA).
        num_experts: the number of experts the factors cover, when the caller knows it (an adapter
            module does); None: as many as the expert weights. Checked against the weights, so an
            expert-parallel rank cannot mistake the factors of all E experts for its own block
            (``r*E`` rows read as rank ``r*W`` over ``E/W`` experts).

    Factors in another float dtype than the expert weights (PEFT keeps adapters in float32 by
    default) are cast to the weights' dtype on each call; their gradients come back in their own dtype.
    """

    lora_A: Tensor
    lora_B: Tensor
    scaling: float = 1.0
    num_experts: int | None = None


@dataclass(frozen=True, kw_only=True)
class LowRank:
    """Canonical forms of one projection's LoRA factors.

    Attributes:
        a: ``[E, r, in]`` (a view of ``lora_A``; contiguous for PEFT's layout).
        b: ``[E, out, r]``, contiguous: PEFT's ``lora_B [out, r*E]`` (rank-major columns) relaid out
            expert-major, the one per-call copy of an adapter (``out * r * E`` elements, e.g. 6 MB
            for Qwen3-30B-A3B's gate_up at r = 16; autograd routes its gradient back to ``lora_B``).
            As a view its strides would be ``(1, r*E, E)``: no unit stride within one expert, so
            GEMMs could not load its tiles in vectors (in the Triton kernels compiled for sm_90, the
            main loops with such a tile waited on every MMA group; ``benchmarks/NOTES.md``, round 5
            preparation) and ``torch._grouped_mm`` could not read it at all.
        scaling: ``s``.
    """

    a: Tensor
    b: Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[1]


@dataclass(frozen=True, kw_only=True)
class Projection:
    """One expert projection as a backend applies it: ``y = x W_e^T + b_e (+ s (x A_e^T) B_e^T)``.

    Attributes: weight ``[E, out, in]``, bias ``[E, out]`` or None, lora :class:`LowRank` or None,
    recipe: the FP8 :class:`moeyard.quant.Recipe` of ``x W_e^T`` (its three GEMMs), or None. The bias
    and the LoRA term stay in the compute dtype.
    """

    weight: Tensor
    bias: Tensor | None = None
    lora: LowRank | None = None
    recipe: Recipe | None = None


@dataclass(frozen=True, kw_only=True)
class ExpertWeights:
    """Canonical ``[out, in]`` views of the expert weights.

    Attributes:
        w_up: ``[E, N1, H]`` (a view; for transposed layouts a ``.mT`` view, non-contiguous); or, where an FP8
            recipe's fused Hopper form reads it in its weight casts, frozen NF4 storage
            (:class:`moeyard.quant.NF4Experts`, standard layout).
        w_down: ``[E, H, I]`` (a view, likewise; or NF4 storage).
        b_up: ``[E, N1]`` or None.
        b_down: ``[E, H]`` or None.
        interleaved: gate/up rows of ``w_up`` alternate (gpt-oss) instead of gate-then-up.
        lora_up, lora_down: :class:`LowRank` adapters of the two projections, or None.
        recipe: the FP8 training recipe both projections' base GEMMs run under
            (:mod:`moeyard.quant.recipe`: operands' blocks and scale format), or None (the compute
            dtype's own GEMMs).
    """

    w_up: Tensor
    w_down: Tensor
    b_up: Tensor | None = None
    b_down: Tensor | None = None
    interleaved: bool = False
    lora_up: LowRank | None = None
    lora_down: LowRank | None = None
    recipe: Recipe | None = None

    @property
    def up(self) -> Projection:
        return Projection(weight=self.w_up, bias=self.b_up, lora=self.lora_up, recipe=self.recipe)

    @property
    def down(self) -> Projection:
        return Projection(weight=self.w_down, bias=self.b_down, lora=self.lora_down, recipe=self.recipe)

    @property
    def max_rank(self) -> int:
        """The largest LoRA rank (0 without adapters)."""
        return max([0] + [lr.rank for lr in (self.lora_up, self.lora_down) if lr is not None])  # (Dynamo: no default=)

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
    lora: dict[str, ExpertLoRA] | None = None,
    recipe: str | Recipe | None = None,
) -> ExpertWeights:
    """Check the weights and return their canonical views (no copies but ``lora_B``'s relayout).

    Args:
        gate_up_proj: ``[E, N1, H]`` (or ``[E, H, N1]`` if ``transposed``); ``N1 = 2I`` when
            ``gated`` else ``I`` (then it is transformers' ``up_proj``).
        down_proj: ``[E, H, I]`` (or ``[E, I, H]`` if ``transposed``).
        gate_up_bias, down_bias: ``[E, N1]`` and ``[E, H]``, optional.
        lora: optional ``{"gate_up_proj": ExpertLoRA, "down_proj": ExpertLoRA}`` (either key may be
            absent): ``gate_up_proj``'s factors are ``[r*E, H]`` and ``[N1, r*E]``, ``down_proj``'s
            ``[r*E, I]`` and ``[H, r*E]``, in every weight layout.
        recipe: an FP8 recipe name or :class:`moeyard.quant.Recipe` (:mod:`moeyard.quant.recipe`), or None.
    Raises:
        TypeError: a weight or factor is not a floating-point tensor, a weight is float8 (raw values
            without their scales), dtypes differ, or ``lora`` is not a dict of :class:`ExpertLoRA`.
        ValueError: shapes do not agree (the message names the argument and the expected shape), or an
            unknown recipe name.
    """
    recipe = resolve_recipe(recipe)
    for name, t in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        if is_quantized(t) and not transposed:  # storage the FP8 fast path reads (moeyard.experts' rule)
            if len(t.shape) != 3:
                raise ValueError(f"{name}: expected a 3-D weight [E, out, in], got shape {tuple(t.shape)}")
            continue
        check_float(name, t)
        if t.element_size() == 1:
            raise TypeError(
                f"{name}: {t.dtype} values need their block scales: pass "
                "moeyard.quant.FP8BlockExperts.from_fp8(weight, weight_scale_inv, dtype=...)"
            )
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
        raise ValueError(
            f"down_proj: expected shape {shown} to match gate_up_proj {tuple(gate_up_proj.shape)}, "
            f"got {tuple(down_proj.shape)}"
        )
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
    lora_up, lora_down = _lora_views(lora, E, (N1, H), (H, I), w_up)
    return ExpertWeights(
        w_up=w_up,
        w_down=w_down,
        b_up=gate_up_bias,
        b_down=down_bias,
        interleaved=interleaved,
        lora_up=lora_up,
        lora_down=lora_down,
        recipe=recipe,
    )


LORA_KEYS = ("gate_up_proj", "down_proj")


def _lora_views(
    lora, E: int, up_shape: tuple[int, int], down_shape: tuple[int, int], like: Tensor
) -> tuple[LowRank | None, LowRank | None]:
    up, down = adapters_by_projection(lora)
    return (
        None if up is None else low_rank(up, E, *up_shape, like, "lora['gate_up_proj']"),
        None if down is None else low_rank(down, E, *down_shape, like, "lora['down_proj']"),
    )


def adapters_by_projection(lora) -> tuple:
    """``(lora["gate_up_proj"], lora["down_proj"])``, None where absent (both for ``lora`` None), after checking
    that ``lora`` is a dict with keys among :data:`LORA_KEYS`. Shared by both sides' ``lora=`` arguments
    (:mod:`moeyard.jax.lora`).

    Raises:
        TypeError: ``lora`` is not such a dict.
    """
    if lora is None:
        return None, None
    if not isinstance(lora, dict) or set(lora) - set(LORA_KEYS):
        raise TypeError(
            f"lora: expected a dict with keys among {LORA_KEYS} of moeyard.ExpertLoRA, got {kind(lora)}"
            + (f" with keys {sorted(lora)}" if isinstance(lora, dict) else "")
        )
    return lora.get("gate_up_proj"), lora.get("down_proj")


def low_rank(adapter: ExpertLoRA, E: int, out: int, inp: int, like: Tensor, name: str = "lora") -> LowRank:
    """Check one adapter against an ``[E, out, in]`` projection: ``A [E, r, in]`` (a view, cast to
    ``like``'s dtype if needed) and ``B [E, out, r]`` (one contiguous copy in ``like``'s dtype).

    Raises:
        TypeError: not an :class:`ExpertLoRA`, non-float factors, non-numeric scaling.
        ValueError: shapes (``lora_A [r*E, in]``, ``lora_B [out, r*E]``) or devices disagree, or the
            adapter's ``num_experts`` is not E.
    """
    r, s = adapter_rank(adapter, E, out, inp, name, check_float)
    A, B = adapter.lora_A, adapter.lora_B
    for n, t in (("lora_A", A), ("lora_B", B)):
        if t.device != like.device:
            raise ValueError(f"{name}.{n}: expected device {like.device} (as the expert weights), got {t.device}")
    A = A.to(like.dtype)
    # lora_B relaid out expert-major in one copy (cast included): [out, r*E] -> [E, out, r] contiguous
    b = expert_major(B, r, E, like.dtype)
    return LowRank(a=A.view(E, r, inp) if A.is_contiguous() else A.reshape(E, r, inp), b=b, scaling=s)


def adapter_rank(adapter: ExpertLoRA, E: int, out: int, inp: int, name: str, check_float) -> tuple[int, float]:
    """``(r, s)`` of an :class:`ExpertLoRA`, after checking it against an ``[E, out, in]`` projection: float
    matrices (``check_float(name, t, dim=2)``, the framework's own check), ``lora_A [r*E, in]``, ``lora_B [out,
    r*E]``, the adapter's ``num_experts`` E if given, a finite ``scaling``. Shared by :func:`low_rank` and the
    JAX side's (:mod:`moeyard.jax.lora`).

    Raises:
        TypeError: not an :class:`ExpertLoRA`, non-float factors (``check_float``'s), a non-numeric scaling.
        ValueError: the shapes, or ``num_experts`` not E.
    """
    if not isinstance(adapter, ExpertLoRA):
        raise TypeError(f"{name}: expected a moeyard.ExpertLoRA, got {kind(adapter)}")
    A, B = adapter.lora_A, adapter.lora_B
    check_float(f"{name}.lora_A", A, dim=2)
    check_float(f"{name}.lora_B", B, dim=2)
    if adapter.num_experts is not None and adapter.num_experts != E:
        raise ValueError(f"{name}: the adapter covers num_experts={adapter.num_experts} experts, the weights {E}")
    rE = A.shape[0]
    if rE == 0 or rE % E or A.shape[1] != inp:
        raise ValueError(f"{name}.lora_A: expected shape [r*{E}, {inp}] (r >= 1), got {tuple(A.shape)}")
    if tuple(B.shape) != (out, rE):
        raise ValueError(
            f"{name}.lora_B: expected shape [{out}, {rE}] (the rank of lora_A, r = {rE // E}), got {tuple(B.shape)}"
        )
    s = adapter.scaling
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s):
        raise TypeError(f"{name}.scaling: expected a finite float, got {s!r}")
    return rE // E, float(s)
