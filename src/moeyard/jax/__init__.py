"""moeyard for JAX: the MoE block of :mod:`moeyard` on JAX arrays, stage by stage.

    route -> make_plan -> permute -> grouped up-proj -> activation -> grouped down-proj -> unpermute

Same :class:`moeyard.MoEConfig`, routing variants and losses, weight layouts (``gate_up_proj [E, 2I, H]``,
``down_proj [E, H, I]``, gpt-oss's transposed and interleaved ones), activations, biases and errors as
the PyTorch side, checked against it in the test-suite (float32, and float64 to 1e-10). The grouped GEMMs
are ``jax.lax.ragged_dot``; everything has static shapes, traces under ``jax.jit`` and differentiates.

- :func:`route`, :class:`RoutingOutput`, :func:`select_experts`, :func:`update_correction_bias`;
- :func:`make_plan`, :class:`DispatchPlan`, :func:`permute`, :func:`unpermute`;
- :func:`experts` (one custom VJP over the expert stage, :mod:`.ffn`);
- :class:`MoE`, :class:`Router`, :class:`SharedExpert` (flax NNX), :func:`load_state_dict`, :func:`state_dict`;
- :mod:`.parallel`: expert parallelism under ``jax.shard_map``.

Needs ``jax`` and ``flax`` (``pip install 'moeyard[jax]'``); ``import moeyard`` never imports them.
"""

try:
    import jax as _jax  # noqa: F401
except ImportError as _ex:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError("moeyard.jax needs jax and flax: pip install 'moeyard[jax]'") from _ex

from ..activations import Activation
from ..config import MoEConfig
from .dispatch import DispatchPlan, make_plan, permute, unpermute
from .experts import experts
from .routing import RoutingOutput, route, select_experts, update_correction_bias

_LAYER = ("MoE", "Router", "SharedExpert", "load_state_dict", "state_dict")
_PARALLEL = ("expert_parallel", "ep_experts", "ep_apply")

__all__ = [
    "Activation",
    "DispatchPlan",
    "MoE",
    "MoEConfig",
    "Router",
    "RoutingOutput",
    "SharedExpert",
    "ep_apply",
    "ep_experts",
    "expert_parallel",
    "experts",
    "load_state_dict",
    "make_plan",
    "permute",
    "route",
    "select_experts",
    "state_dict",
    "unpermute",
    "update_correction_bias",
]


def __getattr__(name):
    """The flax NNX layer and expert parallelism, imported on first use (flax only then)."""
    if name in _LAYER:
        try:
            from . import layer
        except ImportError as ex:
            if "flax" not in str(ex):
                raise
            raise ImportError(f"moeyard.jax.{name} needs flax (NNX): pip install 'moeyard[jax]'") from ex
        return getattr(layer, name)
    if name in _PARALLEL:
        from . import parallel

        return getattr(parallel, name)
    raise AttributeError(f"module 'moeyard.jax' has no attribute {name!r}")
