"""The MoE layer in flax NNX: router -> dispatch -> routed experts -> combine, plus optional shared
experts; :class:`moeyard.MoE` on JAX, parameter for parameter.

Parameter names and layouts are those of the PyTorch layer (transformers v5's): ``router.weight [E, H]``,
``router.bias [E]``, ``router.e_score_correction_bias [E]`` (a :class:`Buffer`, not trained),
``gate_up_proj [E, 2I, H]`` (``[E, I, H]`` for a plain activation), ``down_proj [E, H, I]``,
``gate_up_proj_bias``, ``down_proj_bias``, ``shared_expert.{gate_up_proj,down_proj,gate}.weight``
(``[out, in]``), and after :meth:`MoE.add_lora` ``lora.<target>.lora_A.weight [r*E, in]`` and
``lora.<target>.lora_B.weight [out, r*E]`` (``nnx.LoRAParam``). :func:`state_dict` and :func:`load_state_dict`
move weights between the two sides by those names (``moeyard.MoE.state_dict()`` loads as is).
"""

from __future__ import annotations

import math
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..activations import Activation
from ..config import MoEConfig
from ..experts.lora import adapter_scaling, check_new_adapters
from ..experts.weights import ExpertLoRA
from ..quant.recipe import resolve_recipe
from .activations import apply_activation
from .checks import check_bool, check_float, precision
from .experts import experts
from .routing import RoutingOutput, route

__all__ = ["Buffer", "LoRAAdapter", "Linear", "MoE", "Router", "SharedExpert", "load_state_dict", "state_dict"]

INIT_STD = 0.02  # every weight ~ N(0, 0.02), as the PyTorch layer initialises them


class Buffer(nnx.Variable):
    """Layer state that is not trained (``nnx.grad`` leaves it alone): DeepSeek-V3's correction bias."""


def _normal(rngs: nnx.Rngs, shape, dtype):
    return INIT_STD * jax.random.normal(rngs.params(), shape, dtype)


class Linear(nnx.Module):
    """``x [..., in] -> x W^T [..., out]`` with ``weight [out, in]`` (``torch.nn.Linear``'s layout), no bias."""

    def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.weight = nnx.Param(_normal(rngs, (out_features, in_features), dtype))

    def __call__(self, x):
        return jnp.dot(x, self.weight[...].astype(x.dtype).T, precision=precision(x.dtype))


class _Factor(nnx.Module):
    """One LoRA factor, ``weight [out, in]`` an ``nnx.LoRAParam`` (so an optimizer can train only the adapters:
    ``nnx.Optimizer(layer, tx, wrt=nnx.LoRAParam)``)."""

    def __init__(self, weight):
        self.weight = nnx.LoRAParam(weight)


class LoRAAdapter(nnx.Module):
    """``s * B_e A_e`` for an ``[E, out, in]`` expert projection: :class:`moeyard.experts.lora.LoRAAdapter` on
    JAX, with PEFT's layout and initialisation (``lora_A.weight [r*E, in]`` uniform in ``+-1/sqrt(in)``,
    PyTorch's ``kaiming_uniform_(a=sqrt(5))``; ``lora_B.weight [out, r*E]`` zeros; Hu et al., arXiv
    2106.09685).

    Args:
        num_experts, in_features, out_features: E and the projection's input / output sizes.
        rank: r >= 1. alpha: ``lora_alpha`` (default r, so s = 1). rslora: s = alpha / sqrt(r).
        rngs: ``nnx.Rngs`` for ``lora_A``. dtype: the factors' dtype.
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
        rngs: nnx.Rngs,
        dtype=jnp.float32,
    ):
        alpha, self.scaling = adapter_scaling(num_experts, in_features, out_features, rank, alpha, rslora)
        self.num_experts, self.rank, self.alpha = num_experts, rank, alpha
        bound = 1.0 / math.sqrt(in_features)
        a = jax.random.uniform(rngs.params(), (rank * num_experts, in_features), dtype, -bound, bound)
        self.lora_A = _Factor(a)
        self.lora_B = _Factor(jnp.zeros((out_features, rank * num_experts), dtype))

    def expert_lora(self) -> ExpertLoRA:
        """The adapter as :func:`moeyard.jax.experts` takes it."""
        return ExpertLoRA(
            lora_A=self.lora_A.weight[...],
            lora_B=self.lora_B.weight[...],
            scaling=self.scaling,
            num_experts=self.num_experts,
        )

    def delta_weight(self):
        """``[E, out, in]``: ``s * B_e @ A_e`` (for merging; the forward never forms it)."""
        E, r = self.num_experts, self.rank
        a = self.lora_A.weight[...].reshape(E, r, -1)
        b = jnp.transpose(self.lora_B.weight[...].reshape(-1, r, E), (2, 0, 1))
        return self.scaling * jnp.matmul(b, a, precision=precision(a.dtype))


class SharedExpert(nnx.Module):
    """A dense MLP applied to every token (DeepSeek's shared experts), optionally scaled by
    ``sigmoid(x @ gate^T)`` (Qwen2-MoE's ``shared_expert_gate``, Qwen3-Next, Qwen3.5).

    ``x [T, H] -> [T, H]``; weights ``gate_up_proj.weight [N1, H]``, ``down_proj.weight [H, I]``,
    ``gate.weight [1, H]``.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        activation: Activation,
        *,
        gate: bool = False,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
    ):
        n1 = 2 * intermediate_size if activation.gated else intermediate_size
        self.activation = activation
        self.gate_up_proj = Linear(hidden_size, n1, rngs=rngs, dtype=dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, rngs=rngs, dtype=dtype)
        self.gate = Linear(hidden_size, 1, rngs=rngs, dtype=dtype) if gate else None

    def __call__(self, x):
        y = self.down_proj(apply_activation(self.activation, self.gate_up_proj(x)))
        if self.gate is not None:
            y = jax.nn.sigmoid(self.gate(x)) * y
        return y

    def add_to(self, routed, x, *, inplace: bool = False):
        """``routed + self(x)`` for ``x, routed [T, H]`` (PyTorch's ``SharedExpert.add_to``; XLA fuses the sum;
        ``inplace`` has no effect on immutable arrays)."""
        return routed + self(x)


class Router(nnx.Module):
    """The router: ``weight [E, H]`` (``bias [E]`` if ``config.router_bias``) and DeepSeek-V3's
    ``e_score_correction_bias [E]`` float32 :class:`Buffer` if ``config.score_correction_bias``.

    ``deterministic`` False (the default, as a PyTorch module in training mode; ``layer.eval()`` sets it
    True) applies ``config.router_jitter`` with keys from the ``jitter`` stream of the ``rngs`` given at
    construction (or its default stream).
    """

    def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        E, H = config.num_experts, config.hidden_size
        self.config = config
        self.weight = nnx.Param(_normal(rngs, (E, H), dtype))
        self.bias = nnx.Param(jnp.zeros(E, dtype)) if config.router_bias else None
        self.e_score_correction_bias = Buffer(jnp.zeros(E, jnp.float32)) if config.score_correction_bias else None
        self.deterministic = False
        self.rngs = rngs["jitter"].fork() if config.router_jitter > 0 else None

    def __call__(self, x, num_sequences: int = 1) -> RoutingOutput:
        """``x [T, H]`` -> :class:`moeyard.jax.RoutingOutput`."""
        training = not self.deterministic
        rng = self.rngs() if training and self.rngs is not None else None
        return route(
            x,
            self.weight[...],
            self.config,
            bias=_value(self.bias),
            correction_bias=_value(self.e_score_correction_bias),
            num_sequences=num_sequences,
            training=training,
            rng=rng,
        )


class MoE(nnx.Module):
    """A Mixture-of-Experts layer (flax NNX), :class:`moeyard.MoE` on JAX.

    ``layer(x [..., H]) -> y [..., H]`` in ``x.dtype``; for ``x [B, S, H]`` the sequence-wise loss uses the
    B sequences. After a call, ``layer.aux_loss`` (an ``nnx.Intermediate``) holds the coefficient-weighted
    router loss (a scalar to add to the training loss; float32, float64 for a float64 layer) and
    ``layer.routing`` the :class:`moeyard.jax.RoutingOutput` (unless ``keep_routing`` is False).
    ``layer(x, return_aux_loss=True)`` returns ``(y, aux_loss)`` instead, for code that differentiates a
    pure function of its outputs. Runs under ``nnx.jit`` / ``jax.jit`` (static shapes, no host sync).

    Args:
        config: the :class:`moeyard.MoEConfig`.
        rngs: ``nnx.Rngs`` for the initial weights (all ``N(0, 0.02)``, biases 0, as the PyTorch layer)
            and the router jitter.
        dtype: the parameters' dtype (float32 default; bfloat16 or float64 work too).
        custom_vjp: the experts' backward (:func:`moeyard.jax.experts`): True (default) keeps only the
            up projection's output for it; False: plain autodiff.
        recipe: an FP8 training recipe for the experts' GEMMs, emulated (:func:`moeyard.jax.experts`), as
            :class:`moeyard.MoE`'s ``recipe``; None (default): the compute dtype's.

    LoRA adapters on the experts come with :meth:`add_lora` (``layer.lora``, ``nnx.LoRAParam`` factors) and go
    into the weights with :meth:`merge_lora`, as on the PyTorch side.

    Raises:
        TypeError: ``config`` is not a MoEConfig, or ``recipe`` neither a name, a Recipe nor None; at call
            time, ``x`` not floating or not in the weights' dtype.
        ValueError: ``custom_vjp`` not a bool, an unknown recipe name; at call time, ``x``'s last dimension
            is not ``hidden_size``.
    """

    def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, custom_vjp: bool = True, recipe=None):
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config: expected a moeyard.MoEConfig, got {type(config).__name__}")
        check_bool("custom_vjp", custom_vjp)
        self.config, self.custom_vjp = config, custom_vjp
        self.recipe = resolve_recipe(recipe)
        self.activation = Activation(
            name=config.activation, alpha=config.activation_alpha, limit=config.activation_limit
        )
        E, H, I = config.num_experts, config.hidden_size, config.intermediate_size
        n1 = 2 * I if self.activation.gated else I
        self.router = Router(config, rngs=rngs, dtype=dtype)
        self.gate_up_proj = nnx.Param(_normal(rngs, (E, n1, H), dtype))
        self.down_proj = nnx.Param(_normal(rngs, (E, H, I), dtype))
        self.gate_up_proj_bias = nnx.Param(jnp.zeros((E, n1), dtype)) if config.expert_bias else None
        self.down_proj_bias = nnx.Param(jnp.zeros((E, H), dtype)) if config.expert_bias else None
        shared_i = (config.shared_intermediate_size or I) * config.num_shared_experts
        self.shared_expert = (
            SharedExpert(H, shared_i, self.activation, gate=config.shared_expert_gate, rngs=rngs, dtype=dtype)
            if config.num_shared_experts
            else None
        )
        self.aux_loss = nnx.Intermediate(None)
        self.routing = nnx.Intermediate(None)
        self.keep_routing = True
        self.expert_parallel = None  # set by moeyard.jax.parallel.expert_parallel: called instead of experts
        self.lora = nnx.data(None)  # add_lora: an nnx.Dict {target: LoRAAdapter} (a data attribute)

    def add_lora(
        self,
        rank: int,
        *,
        rngs: nnx.Rngs,
        alpha: float | None = None,
        rslora: bool = False,
        targets: tuple[str, ...] = ("gate_up_proj", "down_proj"),
    ) -> MoE:
        """Add LoRA adapters (:class:`LoRAAdapter`, PEFT's layout and initialisation) to the expert projections
        named in ``targets``, in the experts' dtype; :meth:`moeyard.MoE.add_lora` on JAX. The base weights stay
        ``nnx.Param`` and the factors are ``nnx.LoRAParam``: train the adapters alone by differentiating or
        optimising with respect to ``nnx.LoRAParam`` (``nnx.grad(f, argnums=nnx.DiffState(0, nnx.LoRAParam))``,
        ``nnx.Optimizer(layer, tx, wrt=nnx.LoRAParam)``), PyTorch's ``freeze_base``. Returns ``self``.

        Raises:
            ValueError: unknown target, a bad rank/alpha, or adapters already present.
        """
        sizes = {"gate_up_proj": self.gate_up_proj.shape, "down_proj": self.down_proj.shape}
        check_new_adapters(self.lora is not None, targets, sizes)
        E, dtype = self.config.num_experts, self.down_proj.dtype
        self.lora = nnx.Dict(
            {
                t: LoRAAdapter(E, sizes[t][2], sizes[t][1], rank, alpha=alpha, rslora=rslora, rngs=rngs, dtype=dtype)
                for t in targets
            }
        )
        return self

    def merge_lora(self) -> MoE:
        """Fold the adapters into the expert weights (``W += s B A``) and remove them. Returns ``self``."""
        for name, adapter in (self.lora or {}).items():
            w = getattr(self, name)
            w.set_value(w[...] + adapter.delta_weight().astype(w.dtype))
        self.lora = None
        return self

    def __call__(self, x, return_aux_loss: bool = False):
        """``x [..., H] -> y [..., H]`` in ``x.dtype``; with ``return_aux_loss`` ``(y, aux_loss)``.

        Raises:
            TypeError: ``x`` not floating, or not in the weights' dtype.
            ValueError: ``x``'s last dimension is not ``hidden_size``.
        """
        check_float("x", x)
        H = self.config.hidden_size
        if x.ndim < 1 or x.shape[-1] != H:
            raise ValueError(f"x: expected shape [..., {H}], got {tuple(x.shape)}")
        if x.dtype != self.gate_up_proj.dtype:
            raise TypeError(f"x: expected dtype {self.gate_up_proj.dtype} (as the layer's weights), got {x.dtype}")
        x2 = x.reshape(-1, H)
        routing = self.router(x2, num_sequences=x.shape[0] if x.ndim == 3 and x2.shape[0] else 1)
        run = experts if self.expert_parallel is None else self.expert_parallel
        out = run(
            x2,
            routing.topk_ids,
            routing.topk_weights.astype(x.dtype),
            self.gate_up_proj[...],
            self.down_proj[...],
            activation=self.activation,
            gate_up_bias=_value(self.gate_up_proj_bias),
            down_bias=_value(self.down_proj_bias),
            custom_vjp=self.custom_vjp,
            recipe=self.recipe,
            **({} if self.lora is None else {"lora": self._adapters()}),
        )
        if self.shared_expert is not None:
            out = self.shared_expert.add_to(out, x2)
        self.aux_loss.set_value(routing.loss)
        self.routing.set_value(routing if self.keep_routing else None)
        return (out.reshape(x.shape), routing.loss) if return_aux_loss else out.reshape(x.shape)

    def _adapters(self) -> dict:
        """``lora=`` of the experts call: each adapter's factors; under expert parallelism (inside
        :func:`moeyard.jax.ep_apply`'s ``shard_map``) this device's block of them, covering its own experts."""
        local = self.expert_parallel is not None
        return {
            t: replace(a.expert_lora(), num_experts=None) if local else a.expert_lora() for t, a in self.lora.items()
        }


def _value(v):
    return None if v is None else v[...]


def _named_variables(module: nnx.Module) -> dict[str, nnx.Variable]:
    """``{"router.weight": variable, ...}``: the module's parameters and buffers by their PyTorch names."""
    out = {}
    for path, var in nnx.iter_graph(module):
        if isinstance(var, (nnx.Param, Buffer)):
            out[".".join(str(p) for p in path)] = var
    return out


def state_dict(module: nnx.Module) -> dict[str, np.ndarray]:
    """The parameters and buffers of ``module`` as NumPy arrays, keyed by the PyTorch layer's names
    (``torch.from_numpy`` each to load them into :class:`moeyard.MoE`)."""
    return {name: np.asarray(var[...]) for name, var in _named_variables(module).items()}


def load_state_dict(module: nnx.Module, state: dict) -> nnx.Module:
    """Set ``module``'s parameters and buffers from ``state`` (``{name: array}``, NumPy / JAX arrays or
    torch tensors, e.g. ``moeyard.MoE(...).state_dict()``), each cast to the variable's dtype. Returns
    ``module`` (changed in place; the arrays given are not, and are copied: changing them later, e.g. a torch
    tensor in place, leaves the module as loaded).

    Raises:
        ValueError: missing or unexpected keys, or a shape that differs (the message names them).
    """
    variables = _named_variables(module)
    missing, unexpected = sorted(set(variables) - set(state)), sorted(set(state) - set(variables))
    if missing or unexpected:
        raise ValueError(f"state: keys differ from the module's: missing {missing}, unexpected {unexpected}")
    for name, var in variables.items():
        value = state[name]
        if hasattr(value, "detach"):  # a torch tensor
            value = value.detach().cpu().numpy()
        value = np.asarray(value)
        if tuple(value.shape) != tuple(var.shape):
            raise ValueError(f"state[{name!r}]: expected shape {tuple(var.shape)}, got {tuple(value.shape)}")
        var.set_value(jnp.array(value, dtype=var.dtype, copy=True))  # no alias of the caller's (mutable) memory
    return module
