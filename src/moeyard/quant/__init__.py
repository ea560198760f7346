"""Quantised storage of expert weights, with selective on-device dequantisation of the active experts:
NF4 (4-bit NormalFloat, bitsandbytes' format; QLoRA, arXiv 2305.14314) and FP8 (e4m3 with 128 x 128
block scales, the checkpoint format of DeepSeek-V3 and the Qwen3 FP8 models) for 3-D expert stacks.

- :func:`quantize_experts`: replace the expert weights of a ``moeyard.MoE`` or a transformers
  model (PEFT-wrapped too) by :class:`NF4Experts` (``"nf4"``) or :class:`FP8BlockExperts`
  (``"fp8_block"``) in place.
- :class:`NF4Experts`: the storage (buffers, so ``state_dict`` / safetensors carry it);
  ``dequantize(active, out=...)`` (Triton on CUDA, torch elsewhere, no host sync) and
  ``quant_state()`` (a bitsandbytes ``QuantState``).
- :class:`FP8BlockExperts`: ``weight`` float8_e4m3fn and ``weight_scale_inv`` float32 buffers,
  the same ``dequantize(active, out=...)`` (:mod:`moeyard.quant.fp8_block`).
- :func:`load_quantized_state_dict`: rebuild the quantised structure and load a saved checkpoint.
- :func:`load_fp8_checkpoint`: load a DeepSeek-V3 / Qwen3-FP8 checkpoint onto a transformers model
  with the experts kept in FP8 (:mod:`moeyard.quant.fp8_checkpoint`).

FP8 training recipes for the expert GEMMs (``fp8_rowwise``, ``fp8_blockwise``, ``mxfp8``):
:mod:`moeyard.quant.recipe` (:class:`Recipe`, :func:`set_recipe`, :func:`use_recipe`) and their casts,
:mod:`moeyard.quant.fp8` (the reference) and :mod:`moeyard.quant.fp8_triton` (CUDA kernels).

bitsandbytes is optional: imported only to quantise NF4 (``from_float``) or build a ``QuantState``.
Importing this package imports neither bitsandbytes nor Triton.
"""

from .apply import expert_parameters, load_quantized_state_dict, quantize_experts
from .dequant import dequantize, dequantize_reference
from .fp8_block import FP8BlockExperts
from .fp8_checkpoint import load_fp8_checkpoint
from .nf4 import NF4Experts
from .recipe import RECIPES, Recipe, get_recipe, recipe_names, resolve_recipe, set_recipe, use_recipe

__all__ = [
    "RECIPES",
    "Recipe",
    "get_recipe",
    "recipe_names",
    "resolve_recipe",
    "set_recipe",
    "use_recipe",
    "FP8BlockExperts",
    "NF4Experts",
    "dequantize",
    "dequantize_reference",
    "expert_parameters",
    "load_fp8_checkpoint",
    "load_quantized_state_dict",
    "quantize_experts",
]
