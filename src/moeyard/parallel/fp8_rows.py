"""FP8 dispatch: token rows cross the expert-parallel exchange as e4m3 with one scale each, half the
bytes of bf16 (DeepEP's and torchao's FP8 expert-parallel dispatch).

A row ``x [H]`` is cast with one power-of-two scale over the row (the ``fp8_rowwise`` recipe's cast of
the up projection's input, :func:`moeyard.quant.fp8.quantize` with ``Blocks(None)``, mode ``pow2``) and
packed as ``H`` e4m3 bytes, the float32 scale's 4 bytes and 12 zero bytes (rows of ``H + 16`` bytes,
16-byte aligned), exchanged as ``uint8``, then unpacked and dequantised into the compute dtype on
arrival. Under ``fp8_rowwise`` the receiving experts cast those rows again to the same bytes (a power-of-two
scale of an e4m3-rounded row gives it back), so the forward is the one the recipe computes without FP8
dispatch; the backward's exchanges carry the gradients in the compute dtype. Without a recipe the experts
see each row rounded to e4m3 (about 29 dB SQNR: ``benchmarks/fp8_numerics.py``).

No host sync beyond the dispatcher's own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..quant.fp8 import E4M3, Blocks, quantize
from .comm import _a2a, _gather, _scatter, receive_buffer

Tensor = torch.Tensor
PAD = 16  # bytes after the row's H e4m3 bytes: its float32 scale, then zeros (16-byte rows)


def pack(x: Tensor) -> Tensor:
    """``x [N, H]`` float -> ``[N, H + 16]`` uint8: each row's e4m3 bytes, its float32 scale's bytes, zeros.
    On CUDA one Triton pass writes the packed rows (:func:`pack_kernel`; ``H`` a multiple of 4), elsewhere
    :func:`pack_reference`."""
    return pack_kernel(x) if x.is_cuda and x.shape[1] % 4 == 0 else pack_reference(x)


def unpack(packed: Tensor, H: int, dtype: torch.dtype, out: Tensor | None = None) -> Tensor:
    """``[N, H + 16]`` uint8 from :func:`pack` -> ``[N, H]`` in ``dtype`` (written into ``out`` when given: a
    ``[N, H]`` view with a unit column stride). On CUDA one Triton pass (:func:`unpack_kernel`)."""
    if packed.is_cuda and H % 4 == 0:
        return unpack_kernel(packed, H, dtype, out)
    rows = unpack_reference(packed, H, dtype)
    return rows if out is None else out.copy_(rows)


def pack_reference(x: Tensor) -> Tensor:
    """:func:`pack` in torch (the reference: :func:`moeyard.quant.fp8.quantize`)."""
    N, H = x.shape
    q, s = quantize(x, Blocks(None), "pow2")
    tail = torch.zeros(N, PAD - 4, dtype=torch.uint8, device=x.device)
    return torch.cat([q.view(torch.uint8), s.contiguous().view(torch.uint8), tail], dim=1)


def unpack_reference(packed: Tensor, H: int, dtype: torch.dtype) -> Tensor:
    """:func:`unpack` in torch."""
    q = packed[:, :H].contiguous().view(E4M3)
    s = packed[:, H : H + 4].contiguous().view(torch.float32)
    return (q.float() * s).to(dtype)


def _views(packed: Tensor, H: int) -> tuple[Tensor, Tensor]:
    """The e4m3 ``[N, H]`` and float32 ``[N]`` views of packed rows (``H`` a multiple of 4)."""
    return packed.view(E4M3)[:, :H], packed.view(torch.float32)[:, H // 4]


def pack_kernel(x: Tensor) -> Tensor:
    """:func:`pack` by :func:`moeyard.quant.fp8_triton.rowwise` writing the packed rows' bytes directly (no
    e4m3 copy, no concatenation); ``H`` a multiple of 4 (the fast paths need 16)."""
    from ..quant import fp8_triton

    N, H = x.shape
    packed = torch.empty(N, H + PAD, dtype=torch.uint8, device=x.device)
    fp8_triton.rowwise(x, out=_views(packed, H))
    packed[:, H + 4 :].zero_()
    return packed


def unpack_kernel(packed: Tensor, H: int, dtype: torch.dtype, out: Tensor | None = None) -> Tensor:
    """:func:`unpack` by :func:`moeyard.quant.fp8_triton.dequantize_rows` reading the packed rows in place."""
    from ..quant import fp8_triton

    q, s = _views(packed, H)
    out = torch.empty(packed.shape[0], H, dtype=dtype, device=packed.device) if out is None else out
    return fp8_triton.dequantize_rows(q, s, out)


def all_to_all(
    x: Tensor,
    out_splits: list[int] | None,
    in_splits: list[int] | None,
    group,
    *,
    out_rows: int | None = None,
    pad_rows: int = 0,
) -> Tensor:
    """:func:`moeyard.parallel.comm.all_to_all` with the rows crossing as packed e4m3 (module docstring):
    ``x [N_in, H]`` -> ``[N_out + pad_rows, H]`` in ``x.dtype``; backward: the compute dtype's reverse
    ``all_to_all_single``."""
    return _FP8AllToAll.apply(x, out_splits, in_splits, group, out_rows, pad_rows)


def all_gather(x: Tensor, group) -> Tensor:
    """:func:`moeyard.parallel.comm.all_gather` with the rows crossing as packed e4m3: ``x [N, H]`` ->
    ``[W * N, H]``; backward: the reduce-scatter (sum) of the gradient in the compute dtype."""
    return _FP8AllGather.apply(x, group)


class _FP8AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, out_rows, pad_rows):
        ctx.group, ctx.out_splits, ctx.in_splits, ctx.in_rows = group, out_splits, in_splits, x.shape[0]
        packed = pack(x)
        _, received = receive_buffer(packed, out_splits, out_rows, 0)
        dist.all_to_all_single(received, packed, out_splits, in_splits, group=group)
        ctx.received = received.shape[0]
        rows = x.new_empty(received.shape[0] + pad_rows, x.shape[1])
        rows[received.shape[0] :].zero_()
        unpack(received, x.shape[1], x.dtype, out=rows[: received.shape[0]])
        return rows

    @staticmethod
    def backward(ctx, dy):
        return (
            _a2a(dy[: ctx.received], ctx.in_splits, ctx.out_splits, ctx.group, ctx.in_rows),
            None,
            None,
            None,
            None,
            None,
        )


class _FP8AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return unpack(_gather(pack(x), group), x.shape[1], x.dtype)

    @staticmethod
    def backward(ctx, dy):
        return _scatter(dy, ctx.group), None
