"""Quantised expert weights (e.g. :class:`moeyard.quant.NF4Experts`) in the routed FFN.

Every backend computes on dense weights; a quantised weight reaches it through :func:`dequantized`:

- only the experts that receive at least one token are dequantised (into a fresh ``[E, a, b]``
  buffer of the compute dtype; the other experts' rows are zero and never read), found on the
  device from ``topk_ids`` (no host sync);
- while the backend runs, a saved-tensor hook replaces every tensor that shares that buffer's storage
  (the weight itself or any view a backend saves for backward) by a recipe, and backward dequantises
  again (once per weight and backward). So autograd never keeps the dense weights alive between
  forward and backward: a stack of layers holds one layer's dense weights at a time, as QLoRA's
  ``MatMul4Bit`` does (Dettmers et al., arXiv 2305.14314).
- saved-tensor hooks already active around the call (non-reentrant activation checkpointing, i.e.
  ``torch.utils.checkpoint(use_reentrant=False)`` and transformers' ``gradient_checkpointing_enable()``;
  CPU offloading) still receive every other saved tensor: the hook passes them to the enclosing
  hooks, so a checkpointed layer keeps none of the experts' activations and recomputes them. (Without
  this, the innermost hooks would hide those tensors from the checkpoint, which then keeps them and
  stops its recomputation before the experts.)

The base weights are frozen: a quantised weight gets no gradient; LoRA adapters train on top.
"""

from __future__ import annotations

import contextlib

import torch

Tensor = torch.Tensor


def is_quantized(w) -> bool:
    """True for quantised expert storage: not a tensor, has ``dequantize(active, out=...)`` and ``shape``."""
    return not isinstance(w, Tensor) and callable(getattr(w, "dequantize", None)) and hasattr(w, "shape")


def active_experts(topk_ids: Tensor, num_experts: int) -> Tensor:
    """``[E]`` bool on ``topk_ids``' device: expert ``e`` receives at least one (valid) pair. No host sync."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    slot = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    hit = torch.zeros(num_experts + 1, dtype=torch.bool, device=topk_ids.device)
    return hit.index_fill_(0, slot, True)[:num_experts]


@contextlib.contextmanager
def dequantized(weights: tuple, topk_ids: Tensor):
    """``with dequantized((gate_up_proj, down_proj), topk_ids) as (up, down):`` dense tensors for the
    quantised entries (active experts only; others pass through), and the saved-tensor hook of the
    module docstring around the block. A no-op when nothing is quantised.

    Raises:
        TypeError: a quantised weight whose ``dequantize`` does not return a tensor.
    """
    if not any(is_quantized(w) for w in weights):
        yield weights
        return
    E = next(w.shape[0] for w in weights if is_quantized(w))
    active = active_experts(topk_ids, E)
    dense, recipes = [], {}
    for w in weights:
        if not is_quantized(w):
            dense.append(w)
            continue
        d = w.dequantize(active)
        if not isinstance(d, Tensor):
            raise TypeError(f"{type(w).__name__}.dequantize: expected a tensor, got {type(d).__name__}")
        recipes[d.untyped_storage().data_ptr()] = w
        dense.append(d)
    again: dict[int, Tensor] = {}  # backward's dequantised weights, once per storage
    outer = _enclosing_hooks()

    def pack(t: Tensor):
        storage = recipes.get(t.untyped_storage().data_ptr())
        if storage is None:
            return t if outer is None else _Outer(outer[1], outer[0](t))
        return _Recipe(storage, tuple(t.shape), t.stride(), t.storage_offset())

    def unpack(p):
        if isinstance(p, _Outer):
            return p.unpack(p.packed)
        if not isinstance(p, _Recipe):
            return p
        if id(p.storage) not in again:
            again[id(p.storage)] = p.storage.dequantize(active)
        return again[id(p.storage)].as_strided(p.shape, p.stride, p.offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield tuple(dense)


def _enclosing_hooks():
    """The ``(pack, unpack)`` saved-tensor hooks active now (e.g. a non-reentrant checkpoint's), or None."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)  # torch's own accessor
    return top(False) if top is not None else None


class _Outer:
    """A tensor packed by the enclosing hooks, and their unpack."""

    __slots__ = ("unpack", "packed")

    def __init__(self, unpack, packed):
        self.unpack, self.packed = unpack, packed


class _Recipe:
    """How to rebuild a saved view of a dequantised weight: its storage and the view's geometry."""

    __slots__ = ("storage", "shape", "stride", "offset")

    def __init__(self, storage, shape, stride, offset):
        self.storage, self.shape, self.stride, self.offset = storage, shape, stride, offset
