"""``triton``: fused Triton kernels for the routed expert FFN, forward and backward.

Gathers token rows inside the GEMM loads (no permuted copy of the input), fuses the activation
and biases into GEMM epilogues and the routing weight into the down projection, and combines pair
rows per token in a fixed order (deterministic, no float atomics). No host sync: the tile map is
built on the device from ``expert_offsets``. Triton is imported on first use, so ``import moeyard``
works without it.

Speed options (default off; :mod:`.options` has the details): ``MOEYARD_TRITON_ATOMIC_COMBINE=1``
fuses the combine into the down projection with float32 atomics (forward and input gradient; NOT
deterministic); ``MOEYARD_TRITON_WGRAD_CHUNK=<rows>`` splits experts longer than ``rows`` into chunks
for the weight gradients, with float32 partials summed per expert in a fixed order (deterministic;
partial buffer at most ``MOEYARD_TRITON_WGRAD_PARTIAL_MIB``, default 512). In code:
``with options.use_options(...)``.
``MOEYARD_TRITON_AUTOTUNE=0`` uses one fixed tile config everywhere.

Runs on CUDA in bfloat16, float16 and float32, and on CPU under Triton's interpreter
(``TRITON_INTERPRET=1``, float32 only: the interpreter's ``tl.dot`` needs float32 operands).
"""

from __future__ import annotations

import torch

from ...activations import Activation
from ...kernel_op import (
    have_triton as _have_triton,  # (tests replace it)
    interpreting,
)
from ..registry import ExpertBackend, register_backend
from ..weights import ExpertWeights

Tensor = torch.Tensor
MAX_LORA_RANK = 128


def triton_forward(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    weights: ExpertWeights,
    activation: Activation,
    *,
    drop_invalid: bool = False,
) -> Tensor:
    """``out[t] = sum_k topk_weights[t, k] * FFN_e(x[t])``: ``x [T, H]``, ``topk_ids`` / ``topk_weights``
    ``[T, K]`` -> ``[T, H]`` in ``x.dtype``. Differentiable w.r.t. ``x``, the weights, biases and
    ``topk_weights``. Pairs with an id outside ``[0, E)`` add nothing with ``drop_invalid``; otherwise
    they add ``w * 0`` (the caller puts NaN in their weights, so those tokens come out NaN).

    Under an FP8 recipe (``weights.recipe``) the layer runs the composed pipeline of the ``grouped_mm``
    backend, whose base GEMMs are ``torch._scaled_grouped_mm`` on Hopper with the rowwise recipe (FP8
    casts by Triton kernels, :mod:`moeyard.quant.fp8_triton`), emulated otherwise
    (:mod:`moeyard.experts.scaled_hopper`).
    """
    if weights.recipe is not None:
        from ..grouped_mm import grouped_mm_forward

        return grouped_mm_forward(x, topk_ids, topk_weights, weights, activation, drop_invalid=drop_invalid)
    from .function import triton_experts

    return triton_experts(x, topk_ids, topk_weights, weights, activation, drop_invalid=drop_invalid)


def _unsupported(
    device: torch.device, dtype: torch.dtype, weights: ExpertWeights | None, activation: Activation | None
) -> str | None:
    if not _have_triton():
        return "triton is not installed (pip install triton)"
    if weights is not None and weights.max_rank > MAX_LORA_RANK:
        return f"LoRA rank {weights.max_rank} exceeds {MAX_LORA_RANK} (the low-rank rows are held in registers)"
    if device.type == "cuda":
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return f"needs bfloat16, float16 or float32 on CUDA, got {dtype}"
        return None
    if device.type == "cpu":
        if not interpreting():
            return "runs on CPU only under Triton's interpreter (TRITON_INTERPRET=1)"
        if dtype != torch.float32:
            return f"needs float32 under Triton's interpreter, got {dtype}"
        return None
    return f"needs a CUDA GPU (or the CPU interpreter), got {device.type}"


# Ranked above grouped_mm (20) for ``auto`` on CUDA: measured faster on an H200 at every benchmark shape
# (README's benchmark table), also for large experts with weight gradients: at sonic-120b (32768 tokens,
# H 4096, I 2048, E 64, k 4; 2026-11-23) triton 44.3 ms fwd+bwd, the torch grouped_mm pipeline 46.1 ms,
# moeyard's grouped_mm 57.5 ms.
register_backend(
    ExpertBackend(
        name="triton",
        forward=triton_forward,
        unsupported=_unsupported,
        priority={"cuda": 30},
        reads_storage=True,
        description="fused Triton grouped GEMMs: gather in the loads, activation/bias/weight in epilogues; "
        "deterministic combine; no host sync",
    )
)
