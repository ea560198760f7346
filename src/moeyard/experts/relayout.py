"""The LoRA factor ``B`` relaid out expert-major, once per call: PEFT's ``lora_B [out, r*E]`` (rank-major
columns: column ``k*E + e`` is expert ``e``'s rank ``k``) -> ``[E, out, r]`` contiguous, so every expert's
``[out, r]`` block is one dense block for the kernels' loads (TMA boxes included); its gradient goes back
the same way, to ``lora_B``'s layout and dtype. Both directions are the 2-D transpose of ``[out*r, E]``
(``[E, out*r]``): on a CUDA device with Triton a tiled kernel (:mod:`.triton.transpose`, 8x torch's
strided copy), elsewhere and while ``torch.compile`` traces, torch's copy. No host sync.
"""

from __future__ import annotations

import functools

import torch

Tensor = torch.Tensor


def expert_major(b: Tensor, rank: int, num_experts: int, dtype: torch.dtype) -> Tensor:
    """``b [out, r*E]`` -> ``[E, out, r]`` contiguous in ``dtype`` (one copy, the cast included);
    differentiable, the gradient returned in ``b``'s dtype as ``[out, r*E]`` contiguous. Raises nothing
    of its own: :func:`moeyard.experts.weights.low_rank` has checked the shapes (``b.shape[1] == r * E``)."""
    return _ExpertMajor.apply(b, rank, num_experts, dtype)


class _ExpertMajor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, b, r, E, dtype):
        out = b.shape[0]
        ctx.meta = (b.dtype, out, r, E)
        return transpose(b.reshape(out * r, E), dtype).view(E, out, r)

    @staticmethod
    def backward(ctx, grad):
        dtype, out, r, E = ctx.meta
        return transpose(grad.reshape(E, out * r), dtype).view(out, r * E), None, None, None


def transpose(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x.t()`` of ``x [M, N]`` as a new contiguous ``[N, M]`` tensor in ``dtype``."""
    y = torch.empty((x.shape[1], x.shape[0]), dtype=dtype, device=x.device)
    kernel = _kernel() if x.is_cuda and not torch.compiler.is_compiling() else None
    if kernel is None:
        y.copy_(x.t())
    else:
        kernel(x.contiguous(), y)
    return y


@functools.cache
def _kernel():
    """:func:`.triton.transpose.launch`, or None without Triton (imported once, on first use)."""
    try:
        from .triton.transpose import launch
    except ImportError:
        return None
    return launch
