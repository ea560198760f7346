"""moeyard: Mixture-of-Experts layers for PyTorch — routing, sync-free dispatch, expert backends
(``loop`` reference, ``bmm_padded``, ``grouped_mm``, ``triton``), and a transformers experts
implementation named ``"moeyard"``.

Importing moeyard registers that experts implementation with transformers (when transformers is
installed); it has no other import-time effect.
"""

from .activations import Activation
from .checks import is_debug, set_debug
from .config import MoEConfig
from .dispatch import DispatchPlan, make_plan, permute, unpermute
from .experts import ExpertLoRA, available_backends, backend_names, experts, get_backend, set_backend, use_backend
from .layer import MoE, SharedExpert
from .quant import quantize_experts
from .quant.recipe import Recipe, get_recipe, recipe_names, set_recipe, use_recipe
from .quant.weight_cache import cache_fp8_weights
from .routing import Router, RoutingOutput, route, update_correction_bias

__version__ = "0.3.20"  # the package version (pyproject.toml reads it from here); CHANGELOG.md says what it added

import importlib.util as _importlib_util

if _importlib_util.find_spec("transformers") is not None:
    from .integrations.transformers import register as _register_transformers

    _register_transformers()

__all__ = [
    "Activation",
    "DispatchPlan",
    "ExpertLoRA",
    "MoE",
    "MoEConfig",
    "Router",
    "RoutingOutput",
    "SharedExpert",
    "available_backends",
    "backend_names",
    "cache_fp8_weights",
    "experts",
    "get_backend",
    "is_debug",
    "make_plan",
    "permute",
    "quantize_experts",
    "Recipe",
    "get_recipe",
    "recipe_names",
    "route",
    "set_backend",
    "set_debug",
    "set_recipe",
    "unpermute",
    "update_correction_bias",
    "use_backend",
    "use_recipe",
    "__version__",
]
