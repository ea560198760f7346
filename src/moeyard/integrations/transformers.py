"""The transformers experts implementation ``"moeyard"``.

transformers (v5) decorates each MoE experts module with ``@use_experts_implementation`` and picks
its forward from ``ExpertsInterface`` by ``config._experts_implementation``. :func:`register` adds
:func:`moeyard_experts_forward` there under the name ``"moeyard"``, so that::

    AutoModelForCausalLM.from_pretrained(name, experts_implementation="moeyard")
    model.set_experts_implementation("moeyard")

run every such architecture on :func:`moeyard.experts`, with the backend of
:func:`moeyard.get_backend` (``moeyard.set_backend`` / ``MOEYARD_BACKEND``, else ``auto``) and the FP8
recipe of :func:`moeyard.get_recipe` (``moeyard.set_recipe`` / ``moeyard.use_recipe`` / ``MOEYARD_RECIPE``,
else none).

The decorator's flags on the module are honoured: ``is_transposed``, ``is_concatenated`` (False:
interleaved gate/up columns), ``has_bias``, ``has_gate`` (False: ``up_proj`` and a plain
``act_fn``), a custom ``_apply_gate``, ``has_post_expert_norm`` and ``_is_expert_parallel``
(expert ids ``>= num_experts`` are sentinels that contribute nothing). Flags a transformers release
does not set take that release's behaviour (before ``_is_expert_parallel`` existed, sentinels were
always dropped).

PEFT LoRA adapters on the expert parameters (``LoraConfig(target_parameters=[...])``) run inside
moeyard's kernels: see :mod:`moeyard.integrations.peft`.
"""

from __future__ import annotations

import functools
import importlib
import sys

import torch
import torch.nn.functional as F

from ..activations import Activation
from ..experts import experts
from ..quant.fp8_checkpoint import fp8_experts_weight
from ..quant.recipe import get_recipe

Tensor = torch.Tensor
NAME = "moeyard"

# act_fn class name -> (gated name, plain name); matched on the exact class, never a subclass
_GATED_BY_ACT = {
    "SiLU": "swiglu",
    "SiLUActivation": "swiglu",
    "GELU": "geglu",
    "GELUActivation": "geglu",
    "ReLU": "reglu",
}
_PLAIN_BY_ACT = {
    "SiLU": "silu",
    "SiLUActivation": "silu",
    "GELU": "gelu",
    "GELUActivation": "gelu",
    "ReLU": "relu",
    "ReLUSquaredActivation": "relu2",
}
_ACT_MODULES = ("torch.nn.modules.activation", "transformers.activations")
_PLAIN = Activation()  # the named activations' default constants (alpha, limit: used by clamped_swiglu only)


def _moe_module():
    """``transformers.integrations.moe``, imported once (by :func:`register`: torch.compile cannot trace an import).

    Raises:
        ImportError: transformers is missing or has no experts registry.
    """
    if not _MOE:
        try:
            _MOE.append(importlib.import_module("transformers.integrations.moe"))
        except ImportError as ex:
            raise ImportError(
                "moeyard's transformers integration needs transformers >= 5 with "
                "transformers.integrations.moe (pip install 'transformers>=5')"
            ) from ex
    return _MOE[0]


_MOE: list = []


def register() -> None:
    """Register :func:`moeyard_experts_forward` as transformers' experts implementation ``"moeyard"``.

    Idempotent; touches only transformers' public experts registry.

    Raises:
        ImportError: transformers is missing or has no experts registry.
    """
    interface = _moe_module().ExpertsInterface
    if interface._global_mapping.get(NAME) is not moeyard_experts_forward:
        interface.register(NAME, moeyard_experts_forward)
    if "transformers.integrations.finegrained_fp8" in sys.modules:
        register_fp8()


def register_fp8() -> None:
    """Register :func:`moeyard_experts_forward` with transformers' FP8 experts too
    (``FP8ExpertsInterface``, used by the ``FP8Experts`` modules its FineGrainedFP8 integration builds
    on a GPU), so ``from_pretrained(fp8_checkpoint, experts_implementation="moeyard")`` runs their
    float8 weights and ``*_scale_inv`` scales on moeyard (:func:`moeyard.quant.fp8_checkpoint.fp8_experts_weight`).

    Imports ``transformers.integrations.finegrained_fp8`` (about a second: transformers' quantizers),
    so :func:`register` does this only when that module is already imported. Idempotent.

    Raises:
        ImportError: transformers has no FineGrainedFP8 integration.
    """
    try:
        fp8 = importlib.import_module("transformers.integrations.finegrained_fp8")
    except ImportError as ex:
        raise ImportError("register_fp8 needs transformers >= 5 with its FineGrainedFP8 integration") from ex
    if fp8.FP8ExpertsInterface._global_mapping.get(NAME) is not moeyard_experts_forward:
        fp8.FP8ExpertsInterface.register(NAME, moeyard_experts_forward)


def moeyard_experts_forward(
    self: torch.nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor
) -> Tensor:
    """Experts forward for a ``@use_experts_implementation`` module, on :func:`moeyard.experts`.

    Args:
        self: the experts module (``gate_up_proj`` or ``up_proj``, ``down_proj``, optional biases).
        hidden_states: ``[T, H]`` float.
        top_k_index: ``[T, K]`` integer expert ids (``>= num_experts``: expert-parallel sentinels
            when the module is expert parallel).
        top_k_weights: ``[T, K]`` float routing weights (any float dtype; cast to the weights').

    Returns:
        ``[T, H]`` in ``hidden_states.dtype``.

    Raises:
        ValueError, TypeError: as :func:`moeyard.experts` (shapes, ids out of range, backend).
    """
    has_gate = getattr(self, "has_gate", True)
    up_name = "gate_up_proj" if has_gate else "up_proj"
    w_up, w_down, lora = _weights_and_lora(self, up_name)
    w_up = fp8_experts_weight(self, up_name, w_up, hidden_states.dtype)  # FP8 checkpoint weights: FP8BlockExperts
    w_down = fp8_experts_weight(self, "down_proj", w_down, hidden_states.dtype)
    b_up = b_down = None
    if getattr(self, "has_bias", False):
        b_up = self.gate_up_proj_bias if has_gate else self.up_proj_bias
        b_down = self.down_proj_bias
    x = hidden_states.to(w_up.dtype)
    activation = module_activation(self)
    interleaved = activation.fn is None and activation.gated and not getattr(self, "is_concatenated", True)
    kwargs = dict(
        activation=activation,
        backend=None,
        gate_up_bias=b_up,
        down_bias=b_down,
        transposed=getattr(self, "is_transposed", False),
        interleaved=interleaved,
        drop_invalid=getattr(self, "_is_expert_parallel", True),
        lora=lora,
        recipe=get_recipe(),
    )
    run = getattr(self, "moeyard_expert_parallel", None) or experts  # set by moeyard.parallel
    if getattr(self, "has_post_expert_norm", False):
        out = _experts_with_post_norm(self.post_expert_norm, x, top_k_index, top_k_weights, w_up, w_down, kwargs, run)
    else:
        out = run(x, top_k_index, top_k_weights.to(x.dtype), w_up, w_down, **kwargs)
    return out.to(hidden_states.dtype)


def _weights_and_lora(self: torch.nn.Module, up_name: str) -> tuple[Tensor, Tensor, dict | None]:
    """``(up weight, down weight, lora)``: adapters handed over by :func:`moeyard.integrations.peft.fuse_lora`,
    else those of PEFT parametrizations on the weights (read without evaluating the fold), else none."""
    fused = getattr(self, "_moeyard_lora", None)
    if fused is not None or not torch.nn.utils.parametrize.is_parametrized(self):
        return getattr(self, up_name), self.down_proj, fused
    for name in (up_name, "down_proj"):
        if (
            torch.nn.utils.parametrize.is_parametrized(self, name)
            and self.parametrizations[name].original.dtype == torch.float8_e4m3fn
        ):
            raise TypeError(
                f"{name}: PEFT's W + dW fold cannot run on FP8 block-scaled weights; call "
                "moeyard.integrations.peft.fuse_lora(model) after peft.get_peft_model"
            )
    from .peft import weight_and_lora

    w_up, lora_up = weight_and_lora(self, up_name)
    w_down, lora_down = weight_and_lora(self, "down_proj")
    lora = {k: v for k, v in (("gate_up_proj", lora_up), ("down_proj", lora_down)) if v is not None}
    return w_up, w_down, lora or None


def _experts_with_post_norm(
    norm, x: Tensor, ids: Tensor, weights: Tensor, w_up: Tensor, w_down: Tensor, kwargs: dict, run=experts
) -> Tensor:
    """``sum_k w[t, k] * norm(FFN_e(x[t]))``: the unweighted pair outputs come from one
    :func:`moeyard.experts` call with one slot per pair (``[T*K, H]``), then norm, weight, sum."""
    T, K = ids.shape
    pairs_x = x.repeat_interleave(K, dim=0)  # [T*K, H], pair n = token n // K
    ones = torch.ones(T * K, 1, dtype=x.dtype, device=x.device)
    y = run(pairs_x, ids.reshape(T * K, 1), ones, w_up, w_down, **kwargs)  # [T*K, H]
    y = norm(y).view(T, K, -1)
    w = weights.to(y.dtype)
    if kwargs["drop_invalid"]:
        w = w.masked_fill((ids < 0) | (ids >= getattr(run, "num_experts", w_up.shape[0])), 0)
    return torch.bmm(w.unsqueeze(1), y).squeeze(1)


def module_activation(self: torch.nn.Module) -> Activation:
    """The :class:`moeyard.Activation` equivalent to the module's gate (or plain ``act_fn``).

    A named activation (fusable into kernels) when equivalence is established
    (:func:`_named_activation`); otherwise the module's own callable (its gate, or ``act_fn``).
    """
    named = _named_activation(self)
    if named is not None:
        name, alpha, limit = named
        return Activation(name=name, alpha=alpha, limit=limit)
    if not getattr(self, "has_gate", True):
        return Activation(name="custom", fn=self.act_fn, fn_gated=False)
    return Activation(name="custom", fn=self._apply_gate, fn_gated=True)


def _named_activation(self: torch.nn.Module) -> tuple[str, float, float] | None:
    """``(name, alpha, limit)`` of the named activation equivalent to the module's gate, or None: the default
    ``_apply_gate`` with an ``act_fn`` of exactly SiLU, exact GELU or ReLU (without a gate: ``act_fn`` alone);
    gpt-oss's clamped SwiGLU when ``alpha``/``limit`` attributes exist and a probe on a float64 grid agrees.

    Written so that ``torch.compile`` traces it to the same answer: the gate's function is looked up on the
    instance and its class (traced, a bound method's ``__func__`` was not found, so every compiled module took the
    unfused custom path; ``benchmarks/NOTES.md``, round 32), transformers' module is imported at registration,
    and the probe runs eagerly (:func:`_matches_clamped_swiglu`).
    """
    if not getattr(self, "has_gate", True):
        name = _act_name(self.act_fn, _PLAIN_BY_ACT)
        return (name, _PLAIN.alpha, _PLAIN.limit) if name else None
    gate_fn = _gate_function(self)
    default_gate = gate_fn is not None and gate_fn is getattr(_moe_module(), "_default_apply_gate", None)
    name = _act_name(getattr(self, "act_fn", None), _GATED_BY_ACT) if default_gate else None
    if name and getattr(self, "is_concatenated", True):  # the default gate splits gate-then-up
        return name, _PLAIN.alpha, _PLAIN.limit
    return _as_clamped_swiglu(self, gate_fn)


def _gate_function(self: torch.nn.Module):
    """The function behind ``self._apply_gate``: an instance's own (a bound method's function), else the class's."""
    own = self.__dict__.get("_apply_gate")
    if own is not None:
        return getattr(own, "__func__", own)
    return getattr(type(self), "_apply_gate", None)


def _act_name(act, table: dict[str, str]) -> str | None:
    fn_names = {F.silu: "SiLU", F.gelu: "GELU", F.relu: "ReLU"}  # plain functions (LFM2's F.silu)
    if callable(act) and not isinstance(act, torch.nn.Module):
        return table.get(fn_names.get(act, ""))
    cls = type(act)
    if cls.__module__ not in _ACT_MODULES or cls.__name__ not in table:
        return None
    if cls.__name__ == "GELU" and getattr(act, "approximate", "none") != "none":
        return None
    if cls.__name__ == "GELUActivation" and getattr(act, "act", None) is not F.gelu:
        return None
    return table[cls.__name__]


def _as_clamped_swiglu(self, gate_fn) -> tuple[str, float, float] | None:
    alpha, limit = getattr(self, "alpha", None), getattr(self, "limit", None)
    if gate_fn is None or not all(isinstance(v, (int, float)) for v in (alpha, limit)):
        return None
    interleaved = not getattr(self, "is_concatenated", True)
    if not _matches_clamped_swiglu(gate_fn, float(alpha), float(limit), interleaved):
        return None
    return "clamped_swiglu", float(alpha), float(limit)


@torch.compiler.assume_constant_result  # run eagerly while torch.compile traces: a constant of the graph
def _matches_clamped_swiglu(gate_fn, alpha: float, limit: float, interleaved: bool) -> bool:
    """Whether ``gate_fn`` is the clamped SwiGLU of these constants (:func:`_probe_clamped_swiglu`)."""
    return _probe_clamped_swiglu(gate_fn, alpha, limit, interleaved)


@functools.lru_cache(maxsize=64)
def _probe_clamped_swiglu(gate_fn, alpha: float, limit: float, interleaved: bool) -> bool:
    """Run ``gate_fn`` once on a CPU float64 grid spanning both clamps and compare."""
    probe = _GateProbe(alpha=alpha, limit=limit)
    g = torch.Generator().manual_seed(0)
    h = (torch.rand(64, 32, generator=g, dtype=torch.float64) - 0.5) * (6 * limit + 6)
    try:
        got = gate_fn(probe, h)
    except Exception:  # a gate that needs more of the module than alpha/limit: not the clamped form
        return False
    want = Activation(name="clamped_swiglu", alpha=alpha, limit=limit)(h, interleaved=interleaved)
    return isinstance(got, Tensor) and got.shape == want.shape and torch.allclose(got, want, rtol=1e-12, atol=1e-12)


class _GateProbe:
    """Stands in for the module when probing ``_apply_gate``: only ``alpha`` and ``limit``."""

    def __init__(self, *, alpha: float, limit: float):
        self.alpha, self.limit = alpha, limit
