"""Quantise the expert weights of a model in place, and load quantised checkpoints.

An *experts module* is any module that owns (in its own ``_parameters``) a 3-D ``down_proj`` and a 3-D
``gate_up_proj`` or ``up_proj``: :class:`moeyard.MoE`, and transformers v5's fused experts modules
(Qwen3-MoE, OLMoE, Mixtral, DeepSeek-V3, gpt-oss's transposed ``[E, H, 2I]`` layout, ...). Under PEFT
``ParamWrapper``s (``target_parameters``) the parameters belong to the innermost module of the
``base_layer`` chain, which is the one found. Each such parameter is replaced by a storage submodule
of the same attribute name: :class:`NF4Experts` (format ``"nf4"``) or :class:`FP8BlockExperts`
(format ``"fp8_block"``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
import torch.nn as nn

from . import fp8_block, fp8_block_grid
from ._bnb import bnb_functional
from .fp8_block import FP8BlockExperts
from .nf4 import NF4Experts, check_compute_dtype, check_layout

Tensor = torch.Tensor
FORMATS = ("nf4", "fp8_block")
NF4_DEFAULTS = {"blocksize": 64, "compress_statistics": True}
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


def _options(format: str, blocksize, compress_statistics) -> dict:
    """The storage options of ``format`` (NF4's defaults filled in). Raises ValueError for an unknown
    format, or an NF4 option given with ``"fp8_block"`` (whose blocks are fixed at 128 x 128)."""
    if format not in FORMATS:
        raise ValueError(f"format: expected one of {FORMATS}, got {format!r}")
    given = {k: v for k, v in (("blocksize", blocksize), ("compress_statistics", compress_statistics)) if v is not None}
    if format == "nf4":
        return {**NF4_DEFAULTS, **given}
    if given:
        raise ValueError(f"{next(iter(given))}: an NF4 option; format 'fp8_block' stores fixed 128 x 128 block scales")
    return {}


def _check_weight(format: str, name: str, p: Tensor, opts: dict) -> None:
    """Raise before anything is replaced: a dtype or layout the format cannot store (errors name ``name``)."""
    if format == "nf4":
        check_compute_dtype(p.dtype, name)
        _check_layout_named(name, p.shape, opts["blocksize"])
    else:
        fp8_block.check_compute_dtype(p.dtype, name)


def _targets(module: nn.Module) -> list[tuple[str, nn.Module, str, Tensor]]:
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    found = expert_parameters(module)
    if not found:
        raise ValueError(
            f"module: no expert weights found in {type(module).__name__} (expected modules with 3-D "
            "gate_up_proj or up_proj and down_proj parameters, e.g. moeyard.MoE or a transformers "
            "MoE model; already quantised weights are not parameters any more)"
        )
    return found


def quantize_experts(
    module: nn.Module, format: str = "nf4", *, blocksize: int | None = None, compress_statistics: bool | None = None
) -> nn.Module:
    """Quantise the expert weights inside ``module`` in place and return ``module``.

    Every experts module's ``gate_up_proj`` (or ``up_proj``) ``[E, a, b]`` and ``down_proj`` parameter
    becomes a frozen storage submodule of the same attribute name, on the parameter's device, with the
    parameter's dtype as compute dtype:

    - ``"nf4"``: :class:`NF4Experts`, bitsandbytes' NF4 (``bitsandbytes.functional.quantize_4bit(w,
      quant_type="nf4", blocksize=blocksize, compress_statistics=compress_statistics)``; QLoRA, arXiv
      2305.14314). About 0.26x the bytes of bfloat16 at the defaults.
    - ``"fp8_block"``: :class:`FP8BlockExperts`, e4m3 values with one float32 ``weight_scale_inv``
      per 128 x 128 block (``amax / 448``), the checkpoint format of DeepSeek-V3 and the Qwen3 FP8
      models (:mod:`moeyard.quant.fp8_block`). About 0.5x the bytes of bfloat16. Needs no extra package.

    Biases, routers and every other parameter stay as they are. All weights are checked before any is
    replaced. A quantised model runs (and trains LoRA adapters on top) through :func:`moeyard.experts`,
    which dequantises only the active experts, in forward and again in backward. PEFT's ``W + dW`` fold
    cannot run on quantised storage, so a PEFT-wrapped model is switched to
    :func:`moeyard.integrations.peft.fuse_lora` here (call that yourself after a later ``get_peft_model``).
    After :func:`moeyard.parallel.expert_parallel` each rank quantises its own block of experts (a DTensor
    block on a mesh: its local tensor); before it, ``expert_parallel`` keeps each rank's block of the
    storage (:meth:`NF4Experts.select`).

    Args:
        module: a :class:`moeyard.MoE`, a transformers model or any module containing experts modules
            (also wrapped by PEFT).
        format: ``"nf4"`` or ``"fp8_block"``.
        blocksize: NF4 only: elements per absmax block, one of 32, 64 (default), ..., 4096; must divide
            each expert's ``a*b``.
        compress_statistics: NF4 only: double-quantise the absmax (uint8 plus a float32 scale per 256
            blocks; default True).
    Returns:
        ``module``.
    Raises:
        ValueError: unknown ``format``; no experts in ``module``; a bad ``blocksize`` for a weight; an NF4
            option with ``"fp8_block"``.
        TypeError: ``module`` is not an ``nn.Module``; an expert weight of a dtype the format does not
            store (NF4: float16 / bfloat16 / float32, as bitsandbytes; FP8: those and float64).
        ImportError: ``"nf4"`` and bitsandbytes is missing.
    """
    opts = _options(format, blocksize, compress_statistics)
    targets = _targets(module)
    for name, _, _, p in targets:
        _check_weight(format, name, p, opts)
    if format == "nf4":
        bnb_functional()
    for _, owner, attr, p in targets:
        p = p.to_local() if hasattr(p, "to_local") else p  # an expert-parallel rank's DTensor block
        if format == "nf4":
            storage = NF4Experts.from_float(p, **opts)
        else:
            segments = fp8_block_grid.gate_up_segments(p.shape[1], gated_rows(owner, attr))
            storage = FP8BlockExperts.from_float(p, row_segments=segments)
        _replace(owner, attr, storage)
    _fuse_peft(module)
    return module


def _fuse_peft(module: nn.Module) -> None:
    """:func:`moeyard.integrations.peft.fuse_lora` when ``module`` holds PEFT ``ParamWrapper``s."""
    if not any(hasattr(m, "parameter_name") and hasattr(m, "base_layer") for m in module.modules()):
        return
    from ..integrations.peft import fuse_lora

    fuse_lora(module)


def load_quantized_state_dict(
    module: nn.Module,
    state_dict: Mapping[str, Tensor] | str | os.PathLike,
    format: str = "nf4",
    *,
    blocksize: int | None = None,
    compress_statistics: bool | None = None,
    strict: bool = True,
    assign: bool = False,
) -> nn.Module:
    """Load a state dict saved from a model after :func:`quantize_experts` into an unquantised ``module``
    of the same architecture; returns ``module``.

    The expert parameters are first replaced by empty storage structures (no quantising, no
    bitsandbytes needed), then ``module.load_state_dict(state_dict, strict=strict, assign=assign)``
    fills them. NF4: ``blocksize`` and ``compress_statistics`` must be those the checkpoint was saved
    with (otherwise ``load_state_dict`` reports mismatched shapes or missing keys). FP8: the block grid
    is read from each ``<name>.weight_scale_inv`` in ``state_dict`` (a ``gate_up_proj`` whose gate and
    up halves were blocked separately, as loaded from a DeepSeek-V3 / Qwen3 FP8 checkpoint, included).
    The recipe::

        moeyard.quantize_experts(model, "fp8_block")
        safetensors.torch.save_file(model.state_dict(), "model.safetensors")
        fresh = build_model()                                     # same architecture, any weights
        moeyard.quant.load_quantized_state_dict(fresh, "model.safetensors", "fp8_block")

    Args:
        state_dict: a mapping of tensors, or the path of a ``.safetensors`` file (read on CPU, copied
            onto the module's devices).
        assign: passed to ``load_state_dict`` (True for a module built on the meta device).
    Raises:
        ValueError, TypeError: as :func:`quantize_experts` (bitsandbytes not needed here); FP8: a
            ``weight_scale_inv`` whose shape is no block grid of its weight.
        RuntimeError: from ``load_state_dict`` (missing/unexpected keys when strict, shape mismatches).
        ImportError: a path was given and safetensors is missing.
    """
    opts = _options(format, blocksize, compress_statistics)
    if isinstance(state_dict, (str, os.PathLike)):
        try:
            from safetensors.torch import load_file
        except ImportError as ex:
            raise ImportError("loading a .safetensors file needs safetensors (pip install safetensors)") from ex
        state_dict = load_file(os.fspath(state_dict))
    targets = _targets(module)
    for name, _, _, p in targets:
        _check_weight(format, name, p, opts)
    structures = [_empty(format, name, owner, attr, p, state_dict, opts) for name, owner, attr, p in targets]
    for (_, owner, attr, _), storage in zip(targets, structures, strict=True):
        _replace(owner, attr, storage)
    module.load_state_dict(state_dict, strict=strict, assign=assign)
    return module


def _empty(
    format: str, name: str, owner: nn.Module, attr: str, p: Tensor, state_dict: Mapping[str, Tensor], opts: dict
) -> nn.Module:
    """An empty storage structure for the parameter ``name`` (FP8: the grid of ``state_dict``'s scales)."""
    if format == "nf4":
        return NF4Experts.empty(p.shape, dtype=p.dtype, device=p.device, **opts)
    segments = None
    scale = state_dict.get(f"{name}.weight_scale_inv")
    if scale is not None:
        try:
            segments = fp8_block_grid.infer_row_segments(p.shape, scale.shape, gated=gated_rows(owner, attr))
        except ValueError as ex:
            raise ValueError(f"{name}.{ex}") from None
    return FP8BlockExperts.empty(p.shape, dtype=p.dtype, row_segments=segments, device=p.device)


def gated_rows(owner: nn.Module, attr: str) -> bool:
    """Whether ``owner.<attr>`` is a gated ``gate_up_proj`` whose rows are the gate half then the up half:
    the standard layout (not transposed, not interleaved) of a gated experts module (moeyard.MoE's
    activation, transformers' ``has_gate``)."""
    if attr != "gate_up_proj" or getattr(owner, "is_transposed", False) or not getattr(owner, "is_concatenated", True):
        return False
    activation = getattr(owner, "activation", None)
    return bool(getattr(activation, "gated", getattr(owner, "has_gate", True)))


def _replace(owner: nn.Module, attr: str, storage: nn.Module) -> None:
    """Swap the parameter ``owner.<attr>`` for the submodule ``storage`` (same attribute name)."""
    delattr(owner, attr)
    owner.add_module(attr, storage)


def _check_layout_named(name: str, shape, blocksize: int) -> None:
    try:
        check_layout(shape, blocksize)
    except ValueError as ex:
        raise ValueError(f"{name}: {ex}") from None
