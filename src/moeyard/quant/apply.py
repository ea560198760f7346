"""Quantise the expert weights of a model in place, and load quantised checkpoints.

An *experts module* is any module that owns (in its own ``_parameters``) a 3-D ``down_proj`` and a 3-D
``gate_up_proj`` or ``up_proj``: :class:`moeyard.MoE`, and transformers v5's fused experts modules
(Qwen3-MoE, OLMoE, Mixtral, DeepSeek-V3, gpt-oss's transposed ``[E, H, 2I]`` layout, ...). Under PEFT
``ParamWrapper``s (``target_parameters``) the parameters belong to the innermost module of the
``base_layer`` chain, which is the one found. Each such parameter is replaced by an
:class:`NF4Experts` submodule of the same attribute name.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

import torch
import torch.nn as nn

from ._bnb import bnb_functional
from .nf4 import NF4Experts, check_compute_dtype, check_layout

Tensor = torch.Tensor
FORMATS = ("nf4",)
UP_NAMES = ("gate_up_proj", "up_proj")


def expert_parameters(module: nn.Module) -> list[tuple[str, nn.Module, str, Tensor]]:
    """``(qualified name, owner, attribute, parameter)`` of every 3-D expert weight inside ``module``
    (``module`` included), in ``named_modules`` order, the up projection before ``down_proj``."""
    found = []
    for prefix, owner in module.named_modules():
        params = owner._parameters
        down = params.get("down_proj")
        up = next((n for n in UP_NAMES if params.get(n) is not None and params[n].dim() == 3), None)
        if down is None or down.dim() != 3 or up is None:
            continue
        for attr in (up, "down_proj"):
            found.append((f"{prefix}.{attr}" if prefix else attr, owner, attr, params[attr]))
    return found


def _check_format(format: str) -> None:
    if format not in FORMATS:
        raise ValueError(f"format: expected one of {FORMATS}, got {format!r}")


def _targets(module: nn.Module) -> list[tuple[str, nn.Module, str, Tensor]]:
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    found = expert_parameters(module)
    if not found:
        raise ValueError(f"module: no expert weights found in {type(module).__name__} (expected modules with 3-D "
                         "gate_up_proj or up_proj and down_proj parameters, e.g. moeyard.MoE or a transformers "
                         "MoE model; already quantised weights are not parameters any more)")
    return found


def quantize_experts(module: nn.Module, format: str = "nf4", *, blocksize: int = 64,
                     compress_statistics: bool = True) -> nn.Module:
    """Quantise the expert weights inside ``module`` in place and return ``module``.

    Every experts module's ``gate_up_proj`` (or ``up_proj``) ``[E, a, b]`` and ``down_proj`` parameter
    becomes an :class:`NF4Experts` of the same attribute name, holding bitsandbytes' NF4 storage
    (``bitsandbytes.functional.quantize_4bit(w, quant_type="nf4", blocksize=blocksize,
    compress_statistics=compress_statistics)``; QLoRA, arXiv 2305.14314) on the parameter's device,
    with the parameter's dtype as compute dtype. About 0.26x the bytes of bfloat16 at the defaults.
    Biases, routers and every other parameter stay as they are. All weights are checked before any is
    replaced. A quantised model runs (and trains LoRA adapters on top) through :func:`moeyard.experts`,
    which dequantises only the active experts, in forward and again in backward. PEFT's ``W + dW`` fold
    cannot run on 4-bit storage, so a PEFT-wrapped model is switched to
    :func:`moeyard.integrations.peft.fuse_lora` here (call that yourself after a later ``get_peft_model``).
    After :func:`moeyard.parallel.expert_parallel` each rank quantises its own block of experts (a DTensor
    block on a mesh: its local tensor); before it, ``expert_parallel`` keeps each rank's block of the
    storage (:meth:`NF4Experts.select`).

    Args:
        module: a :class:`moeyard.MoE`, a transformers model or any module containing experts modules
            (also wrapped by PEFT).
        format: ``"nf4"`` (the only format).
        blocksize: elements per absmax block, one of 32, 64, ..., 4096; must divide each expert's
            ``a*b``.
        compress_statistics: double-quantise the absmax (uint8 plus a float32 scale per 256 blocks).
    Returns:
        ``module``.
    Raises:
        ValueError: unknown ``format``; no experts in ``module``; a bad ``blocksize`` for a weight.
        TypeError: ``module`` is not an ``nn.Module``; an expert weight is not float16 / bfloat16 /
            float32 (bitsandbytes quantises no other dtype, float64 included).
        ImportError: bitsandbytes is missing.
    """
    _check_format(format)
    targets = _targets(module)
    for name, _, _, p in targets:
        check_compute_dtype(p.dtype, name)
        _check_layout_named(name, p.shape, blocksize)
    bnb_functional()
    for _, owner, attr, p in targets:
        local = p.to_local() if hasattr(p, "to_local") else p  # an expert-parallel rank's DTensor block
        _replace(owner, attr, NF4Experts.from_float(local, blocksize=blocksize,
                                                    compress_statistics=compress_statistics))
    _fuse_peft(module)
    return module


def _fuse_peft(module: nn.Module) -> None:
    """:func:`moeyard.integrations.peft.fuse_lora` when ``module`` holds PEFT ``ParamWrapper``s."""
    if not any(hasattr(m, "parameter_name") and hasattr(m, "base_layer") for m in module.modules()):
        return
    from ..integrations.peft import fuse_lora
    fuse_lora(module)


def load_quantized_state_dict(module: nn.Module, state_dict: Mapping[str, Tensor] | str | os.PathLike,
                              format: str = "nf4", *, blocksize: int = 64, compress_statistics: bool = True,
                              strict: bool = True, assign: bool = False) -> nn.Module:
    """Load a state dict saved from a model after :func:`quantize_experts` into an unquantised ``module``
    of the same architecture; returns ``module``.

    The expert parameters are first replaced by empty :class:`NF4Experts` structures (no quantising,
    no bitsandbytes needed), then ``module.load_state_dict(state_dict, strict=strict, assign=assign)``
    fills them. ``blocksize`` and ``compress_statistics`` must be those the checkpoint was saved with
    (otherwise ``load_state_dict`` reports mismatched shapes or missing keys). The recipe::

        moeyard.quantize_experts(model, "nf4")
        safetensors.torch.save_file(model.state_dict(), "model.safetensors")
        fresh = build_model()                                     # same architecture, any weights
        moeyard.quant.load_quantized_state_dict(fresh, "model.safetensors")

    Args:
        state_dict: a mapping of tensors, or the path of a ``.safetensors`` file (read on CPU, copied
            onto the module's devices).
        assign: passed to ``load_state_dict`` (True for a module built on the meta device).
    Raises:
        ValueError, TypeError: as :func:`quantize_experts` (bitsandbytes not needed here).
        RuntimeError: from ``load_state_dict`` (missing/unexpected keys when strict, shape mismatches).
        ImportError: a path was given and safetensors is missing.
    """
    _check_format(format)
    if isinstance(state_dict, (str, os.PathLike)):
        try:
            from safetensors.torch import load_file
        except ImportError as ex:
            raise ImportError("loading a .safetensors file needs safetensors (pip install safetensors)") from ex
        state_dict = load_file(os.fspath(state_dict))
    targets = _targets(module)
    for name, _, _, p in targets:
        check_compute_dtype(p.dtype, name)
        _check_layout_named(name, p.shape, blocksize)
    for _, owner, attr, p in targets:
        _replace(owner, attr, NF4Experts.empty(p.shape, dtype=p.dtype, blocksize=blocksize,
                                              compress_statistics=compress_statistics, device=p.device))
    module.load_state_dict(state_dict, strict=strict, assign=assign)
    return module


def _replace(owner: nn.Module, attr: str, storage: NF4Experts) -> None:
    """Swap the parameter ``owner.<attr>`` for the submodule ``storage`` (same attribute name)."""
    delattr(owner, attr)
    owner.add_module(attr, storage)


def _check_layout_named(name: str, shape, blocksize: int) -> None:
    try:
        check_layout(shape, blocksize)
    except ValueError as ex:
        raise ValueError(f"{name}: {ex}") from None
