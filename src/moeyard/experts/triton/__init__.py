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

import functools
import importlib.util
import os

import torch

from ...activations import Activation
from ..registry import ExpertBackend, Workload, register_backend
from ..weights import ExpertWeights

Tensor = torch.Tensor
MAX_LORA_RANK = 128
# ``auto`` defers to ``grouped_mm`` on Hopper when the base weights need gradients and each expert's
# GEMM work, mean rows per expert x H x I, reaches this: measured on an H200 (2026-11-23, bf16, whole
# layer fwd+bwd, README's table) triton leads the torch pipeline by 1.3-1.5x at 4.3e9 (sonic-30b-a:
# 2048 x 4096 x 512) and below, and trails it by 4% at 1.7e10 (sonic-120b: 2048 x 4096 x 2048), where
# its weight-gradient kernels hold the gap (forward alone: triton 1.2x ahead); the threshold sits between.
# It defers to moeyard's ``grouped_mm`` backend (torch's grouped GEMM, as in that pipeline), which is not
# itself measured at those shapes yet (benchmarks/gpu_round.sh router: bench_auto).
LARGE_EXPERT_WORK = 8e9


def triton_forward(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, weights: ExpertWeights,
                   activation: Activation, *, drop_invalid: bool = False) -> Tensor:
    """``out[t] = sum_k topk_weights[t, k] * FFN_e(x[t])``: ``x [T, H]``, ``topk_ids`` / ``topk_weights``
    ``[T, K]`` -> ``[T, H]`` in ``x.dtype``. Differentiable w.r.t. ``x``, the weights, biases and
    ``topk_weights``. Pairs with an id outside ``[0, E)`` add nothing with ``drop_invalid``; otherwise
    they add ``w * 0`` (the caller puts NaN in their weights, so those tokens come out NaN).
    """
    from .function import triton_experts
    return triton_experts(x, topk_ids, topk_weights, weights, activation, drop_invalid=drop_invalid)


@functools.cache
def _have_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def _unsupported(device: torch.device, dtype: torch.dtype, weights: ExpertWeights | None,
                 activation: Activation | None) -> str | None:
    if not _have_triton():
        return "triton is not installed (pip install triton)"
    if weights is not None and weights.max_rank > MAX_LORA_RANK:
        return f"LoRA rank {weights.max_rank} exceeds {MAX_LORA_RANK} (the low-rank rows are held in registers)"
    if device.type == "cuda":
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return f"needs bfloat16, float16 or float32 on CUDA, got {dtype}"
        return None
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            return "runs on CPU only under Triton's interpreter (TRITON_INTERPRET=1)"
        if dtype != torch.float32:
            return f"needs float32 under Triton's interpreter, got {dtype}"
        return None
    return f"needs a CUDA GPU (or the CPU interpreter), got {device.type}"


def _defer(device: torch.device, dtype: torch.dtype, weights: ExpertWeights, work: Workload) -> str | None:
    """``grouped_mm`` for large experts with base weight gradients on Hopper or newer in 16-bit
    (``LARGE_EXPERT_WORK``)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16) or not work.weight_grad:
        return None
    if torch.cuda.get_device_capability(device)[0] < 9:
        return None
    rows = work.pairs / weights.num_experts
    return "grouped_mm" if rows * weights.hidden_size * weights.intermediate_size >= LARGE_EXPERT_WORK else None


# Ranked above grouped_mm (20) for ``auto`` on CUDA: measured faster on an H200 (README's benchmark table),
# except for large experts with weight gradients (``_defer``).
register_backend(ExpertBackend(
    name="triton", forward=triton_forward, unsupported=_unsupported, priority={"cuda": 30}, defer=_defer,
    description="fused Triton grouped GEMMs: gather in the loads, activation/bias/weight in epilogues; "
                "deterministic combine; no host sync",
))
