"""Keeping the FP8 casts of expert weights across calls, for gradient accumulation.

Under an FP8 recipe's Hopper fast path (:mod:`moeyard.experts.scaled_hopper`) every call casts each expert
weight twice: per output channel for the forward, transposed per input channel for the input gradient. That
cost is fixed per call, while the saving grows with the tokens: at qwen3-30b-a3b's expert sizes on an H100 the
two weights' casts take about 2 ms per layer call and the rest of the FP8 path saves about 0.07 ms per
thousand tokens (``benchmarks/NOTES.md``, round 39), so calls of fewer than about 27,000 tokens lose time to
FP8. Between two optimizer steps the weights do not change, so with :func:`cache_fp8_weights` around the
micro-batches each weight is cast once per step instead of twice per micro-batch (TransformerEngine's
``is_first_microbatch`` serves the same purpose).

The cache is keyed by the weight tensor itself (weakly: a weight that dies leaves it) and checked against its
version counter, so an in-place update made inside the block (``optimizer.step()``, ``w.add_(...)``) is
seen and the weight cast again; an update that bypasses the version counter (writing through ``w.data``)
is not, which is why the cache exists only inside the block. Not used while a CUDA graph is being captured
or under ``torch.compile`` tracing (the casts are then part of the graph).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

Tensor = torch.Tensor
_caches: list[WeakIdKeyDictionary] = []  # one per open block, innermost last


@contextlib.contextmanager
def cache_fp8_weights():
    """``with moeyard.cache_fp8_weights():`` keep each expert weight's FP8 casts for the block's calls.

    For gradient accumulation under an FP8 recipe: put the micro-batches' forward and backward passes in the
    block and the optimizer step after it, so each weight is cast once per optimizer step (module docstring).
    With a frozen base (LoRA adapters on top) the block may span the whole training loop: the base is cast
    once.
    The casts are made on first use and freed when the block ends: two e4m3 copies per weight, as many bytes
    as the weight in bf16. A weight changed in place inside the block is cast again (version counter); one
    changed through ``.data`` is not: do not do that inside the block. Blocks nest (the innermost serves).

    Example::

        with moeyard.cache_fp8_weights():
            for batch in micro_batches:
                model(batch).loss.backward()
        optimizer.step()
    """
    cache = WeakIdKeyDictionary()
    _caches.append(cache)
    try:
        yield
    finally:
        _caches.remove(cache)
        cache.clear()


def keeping(w) -> bool:
    """Whether :func:`cached` keeps ``w``'s casts now: inside a :func:`cache_fp8_weights` block, not while
    capturing a CUDA graph or under ``torch.compile``."""
    return (
        bool(_caches)
        and not torch.compiler.is_compiling()
        and not (w.device.type == "cuda" and torch.cuda.is_current_stream_capturing())
    )


def cached(w, kind: str, make: Callable[[], tuple[Tensor, ...]]) -> tuple[Tensor, ...]:
    """``make()`` (the ``kind`` cast of weight ``w``: a tensor, or frozen quantised storage, which has no version
    counter), kept in the innermost open :func:`cache_fp8_weights` block while ``w``'s version is unchanged; outside a block (or while capturing a CUDA graph, or under
    ``torch.compile``) just ``make()``."""
    if not keeping(w):
        return make()
    entry = _caches[-1].setdefault(w, {})
    version = getattr(w, "_version", 0)  # quantised storage (frozen): no version counter
    hit = entry.get(kind)
    if hit is not None and hit[0] == version:
        return hit[1]
    value = make()
    entry[kind] = (version, value)
    return value
