"""``grouped_mm``: torch's grouped GEMM (``torch._grouped_mm``) with device-side offsets.

No host sync. Fast on Hopper (CUTLASS) in bfloat16; elsewhere torch runs a fallback. Needs 16-byte
aligned strides (H and I multiples of 8 in bf16, of 4 in float32) and no float64. Under
``torch.compile`` (``fullgraph=True`` works) it needs bfloat16: torch's shape function for
``_grouped_mm`` takes nothing else (torch 2.11-2.13), and the registry says so. Memory: the
permuted ``[N, H]`` input, ``[N, 2I]`` and ``[N, I]`` activations and ``[N, H]`` output are kept for
backward (N = T*K).
"""

from __future__ import annotations

import torch

from ..activations import Activation
from ..dispatch import DispatchPlan
from . import scaled_hopper
from .pipeline import routed_ffn
from .registry import ExpertBackend, register_backend
from .scaled import Emulated, GroupedOps
from .weights import ExpertWeights

Tensor = torch.Tensor


def grouped_gemm(rows: Tensor, w: Tensor, plan: DispatchPlan) -> Tensor:
    """``rows [R, in] @ w[e].T`` for each expert's rows: ``w [E, out, in]`` (16-byte aligned strides,
    as ``_unsupported`` checks; LoRA factors come contiguous from ``expert_weights``) -> ``[R, out]``."""
    return torch._grouped_mm(rows, w.mT, offs=plan.padded_offsets[1:])


def grouped_mm_forward(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    weights: ExpertWeights,
    activation: Activation,
    *,
    drop_invalid: bool = False,
) -> Tensor:
    """The routed expert FFN on ``torch._grouped_mm`` (shapes, dtypes and semantics as
    :func:`moeyard.experts`): ``x [T, H]``, ``topk_ids`` / ``topk_weights`` ``[T, K]`` -> ``[T, H]``.
    Under an FP8 recipe the base GEMMs run on ``torch._scaled_grouped_mm`` where the Hopper fast path
    serves the recipe (:mod:`.scaled_hopper`: the whole FFN fused around them where it can, else each
    projection), else emulated on ``torch._grouped_mm``."""
    if weights.recipe is None:
        return routed_ffn(x, topk_ids, topk_weights, weights, activation, grouped_gemm, drop_invalid=drop_invalid)
    gemms, align = scaled_hopper.recipe_gemms(weights.recipe, x.device, x.dtype, weights, EMULATED)
    if gemms is scaled_hopper.HOPPER_ROWWISE and scaled_hopper.fused(weights, activation):
        return scaled_hopper.routed_ffn(x, topk_ids, topk_weights, weights, activation, drop_invalid=drop_invalid)
    if gemms is scaled_hopper.HOPPER_ROWWISE:
        scaled_hopper.warn_lora_composed(weights)
    return routed_ffn(
        x,
        topk_ids,
        topk_weights,
        weights,
        activation,
        grouped_gemm,
        drop_invalid=drop_invalid,
        align=align,
        recipe_gemms=gemms,
    )


# expert-major rows with offsets [E + 1] (int32): torch._grouped_mm's 2-D x 3-D and 2-D x 2-D forms
EMULATED = Emulated(
    GroupedOps(
        mm=lambda x, w, offsets: torch._grouped_mm(x, w.mT, offs=offsets[1:]),
        kmm=lambda dy, x, offsets: torch._grouped_mm(dy.mT, x, offs=offsets[1:]),
    )
)


_PROBED: dict[tuple, str | None] = {}


@torch.compiler.assume_constant_result  # torch.compile runs it while tracing and keeps its answer
def _probe(device_type: str, index: int | None, dtype: torch.dtype, traced: bool) -> str | None:
    """Whether ``torch._grouped_mm`` runs forward and backward on this device in ``dtype`` (and, for
    ``traced``, whether torch's compile-time shape function takes ``dtype``: torch 2.11-2.13 take
    bfloat16 only, where eager also runs float16 and float32): None, or the reason it does not.
    Cached per arguments."""
    key = (device_type, index, dtype, traced)
    if key not in _PROBED:
        _PROBED[key] = _run_probe(device_type, index, dtype) or (_run_probe("meta", None, dtype) if traced else None)
    return _PROBED[key]


def _run_probe(device_type: str, index: int | None, dtype: torch.dtype) -> str | None:
    """Run a tiny grouped GEMM forward and backward once (grad enabled, inference mode off, no random numbers, no
    host-to-device copy); the error text if it fails. On the ``meta`` device this runs torch's
    shape function, which is what ``torch.compile`` traces with. Identity saved-tensor hooks keep the
    probe's tensors away from enclosing hooks (a non-reentrant activation checkpoint would otherwise
    count them as the layer's and recompute the layer when the probe's backward reads them)."""
    if not hasattr(torch, "_grouped_mm"):
        return "this torch build has no torch._grouped_mm"
    try:
        dev = torch.device(device_type, index) if index is not None else torch.device(device_type)
        # may come under no_grad or inference_mode (generation): leave both for the probe's backward
        with torch.inference_mode(False), torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_same, _same):
            a = torch.ones(16, 16, device=dev, dtype=dtype, requires_grad=True)
            b = torch.ones(2, 16, 16, device=dev, dtype=dtype, requires_grad=True)
            offs = torch.arange(8, 17, 8, device=dev, dtype=torch.int32)  # [8, 16], made on the device
            y = torch._grouped_mm(a, b.mT, offs=offs)
            y.backward(torch.ones_like(y))
    except Exception as ex:  # the feature test: any failure means "not here"
        where = "under torch.compile" if device_type == "meta" else f"on {device_type}"
        return f"torch._grouped_mm fails {where} with {dtype}: {str(ex).splitlines()[0][:120]}"
    return None


def _same(t):
    return t


def _aligned(t: Tensor) -> bool:
    es = t.element_size()
    s0, s1 = t.stride(-2), t.stride(-1)
    ok_layout = (s1 == 1 and (s0 * es) % 16 == 0) or (s0 == 1 and (s1 * es) % 16 == 0)
    # no address while tracing: torch._grouped_mm itself rejects a misaligned start at run time
    return ok_layout and (torch.compiler.is_compiling() or t.data_ptr() % 16 == 0)


def _unsupported(
    device: torch.device, dtype: torch.dtype, weights: ExpertWeights | None, activation: Activation | None
) -> str | None:
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"needs bfloat16, float16 or float32, got {dtype}"
    reason = _probe(device.type, device.index, dtype, torch.compiler.is_compiling())
    if reason or weights is None:
        return reason
    es = weights.w_up.element_size()
    sizes = {"hidden_size": weights.hidden_size, "intermediate_size": weights.intermediate_size}
    for name, n in sizes.items():
        if (n * es) % 16:
            return f"{name}={n} is not a multiple of {16 // es} ({dtype} rows need 16-byte strides)"
    if not (_aligned(weights.w_up) and _aligned(weights.w_down)):
        return "expert weights need 16-byte aligned strides (a contiguous [E, out, in] or [E, in, out] tensor)"
    ranks = [lr.rank for lr in (weights.lora_up, weights.lora_down) if lr is not None]
    if any((r * es) % 16 for r in ranks):
        return f"LoRA ranks {ranks} must be multiples of {16 // es} ({dtype} rows need 16-byte strides)"
    return None


register_backend(
    ExpertBackend(
        name="grouped_mm",
        forward=grouped_mm_forward,
        unsupported=_unsupported,
        priority={"cuda": 20, "cpu": 20},
        reads_storage=True,
        description="torch._grouped_mm with device-side offsets; no host sync; fast on Hopper in bf16",
    )
)
