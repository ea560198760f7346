"""Quantised storage of expert weights: NF4 (4-bit NormalFloat, bitsandbytes' format; QLoRA,
arXiv 2305.14314) for 3-D expert stacks, with selective on-device dequantisation of the active
experts.

- :func:`quantize_experts`: replace the expert weights of a ``moeyard.MoE`` or a transformers
  model (PEFT-wrapped too) by :class:`NF4Experts` in place.
- :class:`NF4Experts`: the storage (buffers, so ``state_dict`` / safetensors carry it);
  ``dequantize(active, out=...)`` (Triton on CUDA, torch elsewhere, no host sync) and
  ``quant_state()`` (a bitsandbytes ``QuantState``).
- :func:`load_quantized_state_dict`: rebuild the quantised structure and load a saved checkpoint.

FP8 training recipes for the expert GEMMs (``fp8_rowwise``, ``fp8_blockwise``, ``mxfp8``):
:mod:`moeyard.quant.recipe` (:class:`Recipe`, :func:`set_recipe`, :func:`use_recipe`) and their casts,
:mod:`moeyard.quant.fp8` (the reference) and :mod:`moeyard.quant.fp8_triton` (CUDA kernels).

bitsandbytes is optional: imported only to quantise (``from_float``) or build a ``QuantState``.
Importing this package imports neither bitsandbytes nor Triton.
"""
from .apply import expert_parameters, load_quantized_state_dict, quantize_experts
from .dequant import dequantize, dequantize_reference
from .fp8_block import FP8BlockExperts
from .nf4 import NF4Experts
from .recipe import RECIPES, Recipe, get_recipe, recipe_names, resolve_recipe, set_recipe, use_recipe

__all__ = ["RECIPES", "Recipe", "get_recipe", "recipe_names", "resolve_recipe", "set_recipe", "use_recipe",
           "FP8BlockExperts", "NF4Experts", "dequantize", "dequantize_reference", "expert_parameters", "load_quantized_state_dict",
           "quantize_experts"]
