"""Selective dequantisation of :class:`NF4Experts`: only the active experts, no host sync (and the
argument checks every quantised storage shares: :func:`check_active`, :func:`check_out`, :func:`use_triton`).

Two implementations behind :func:`dequantize`: a Triton kernel on CUDA (:mod:`.triton_nf4`) and a
vectorised torch path elsewhere (:func:`dequantize_torch`); both reproduce bitsandbytes'
``dequantize_4bit`` bit for bit. :func:`dequantize_reference` is the float64 oracle beside them.

Legend: E experts, ``(a, b)`` one expert's matrix, ``P = a*b`` elements per expert, ``bs`` blocksize.
"""

from __future__ import annotations

import functools
import warnings

import torch

from ..kernel_op import have_triton
from ._bnb import NESTED_BLOCKSIZE

Tensor = torch.Tensor
# Elements the torch path decodes per step (bounds its float32 temporaries to ~6 bytes per element).
TORCH_CHUNK = 1 << 22


def dequantize(storage, active: Tensor | None = None, *, out: Tensor | None = None) -> Tensor:
    """Dequantise the active experts of ``storage`` into ``[E, a, b]`` in its compute dtype.

    Values equal bitsandbytes' ``dequantize_4bit(storage.data, storage.quant_state())`` exactly (the
    float32 product ``code[q] * absmax``, rounded to the compute dtype). No autograd, no host sync
    (no ``.item()``, no data-dependent shapes): safe inside CUDA graphs.

    Args:
        storage: an :class:`NF4Experts`.
        active: ``[E]`` bool, or integer (e.g. ``tokens_per_expert``; ``> 0`` means active), on the
            storage's device; None dequantises every expert.
        out: optional caller-owned workspace ``[E, a, b]``, contiguous, in the compute dtype, on the
            storage's device, reused across calls. Rows of inactive experts are left untouched.
    Returns:
        ``out`` when given, else a new tensor whose inactive experts' rows are zero.
    Raises:
        TypeError: ``active`` is not a bool/integer tensor, or ``out`` has another dtype.
        ValueError: ``active`` / ``out`` have the wrong shape or device, or ``out`` is not contiguous.
    """
    out, fresh = output(storage, active, out)
    with torch.no_grad():
        if use_triton(storage.device):
            from .triton_nf4 import dequantize_triton

            dequantize_triton(storage, active, out, zero_inactive=fresh)
        else:
            dequantize_torch(storage, active, out, zero_inactive=fresh)
    return out


def output(storage, active: Tensor | None, out: Tensor | None) -> tuple[Tensor, bool]:
    """``(out, fresh)`` for a dequantisation: the caller's workspace (checked with ``active``) and False, or
    a new ``[E, a, b]`` from ``torch.empty`` and True; a fresh output's inactive experts are zeroed by the
    kernel that decodes the active ones (one write of the output, not a memset and then a write).

    Raises:
        as :func:`check_active` and :func:`check_out`.
    """
    check_active(storage, active)
    if out is not None:
        check_out(storage, out)
        return out, False
    return torch.empty(storage.shape, dtype=storage.dtype, device=storage.device), True


def use_triton(device: torch.device) -> bool:
    """Whether quantised experts on ``device`` are dequantised by a Triton kernel: on CUDA where Triton
    is installed (without it, one warning, and the torch path)."""
    if device.type != "cuda":
        return False
    if have_triton():
        return True
    _warn_no_triton()
    return False


def decoded_absmax(storage) -> Tensor:
    """``[nb]`` float32 block scales: the stored absmax, or the decoded double-quantised one
    (``fl(fl(code2[q] * absmax2[j // 256]) + offset)``, as bitsandbytes' ``dequantize_blockwise`` then
    ``+= offset``)."""
    if not storage.compress_statistics:
        return storage.absmax
    q = storage.absmax.long()
    group = torch.arange(q.numel(), device=q.device) // NESTED_BLOCKSIZE
    return storage.code2[q] * storage.absmax2[group] + storage.offset  # two float32 roundings, no FMA on CPU/CUDA


def _nibbles(packed: Tensor) -> Tensor:
    """``[m]`` uint8 bytes -> ``[2m]`` int64 codes in element order (high nibble first)."""
    return torch.stack((packed >> 4, packed & 0xF), dim=-1).view(-1).long()


def dequantize_torch(storage, active: Tensor | None, out: Tensor, zero_inactive: bool = False) -> None:
    """The torch implementation of :func:`dequantize` (any device): decodes every expert in chunks
    of about :data:`TORCH_CHUNK` elements and writes the active ones (a ``torch.where`` keeps the
    inactive rows of ``out``, or zeroes them with ``zero_inactive``), so its work does not shrink with
    fewer active experts; static shapes, no host sync."""
    E, a, b = storage.shape
    per, bs = a * b, storage.blocksize
    absmax = decoded_absmax(storage)
    data = storage.data.view(-1)
    step = max(1, TORCH_CHUNK // per)
    for e0 in range(0, E, step):
        e1 = min(E, e0 + step)
        vals = storage.code[_nibbles(data[e0 * per // 2 : e1 * per // 2])].view(-1, bs)
        vals = (vals * absmax[e0 * per // bs : e1 * per // bs, None]).view(e1 - e0, a, b).to(out.dtype)
        write_active(out[e0:e1], vals, None if active is None else active[e0:e1], zero_inactive)


def write_active(dst: Tensor, vals: Tensor, active: Tensor | None, zero: bool) -> None:
    """``dst [e, a, b] <- vals`` for the experts ``active [e]`` marks (all when None); the others' rows are
    zeroed with ``zero``, else kept (the torch paths of :func:`dequantize` and of FP8 block storage)."""
    if active is None:
        dst.copy_(vals)
    else:
        dst.copy_(torch.where(active[:, None, None] > 0, vals, 0 if zero else dst))


def dequantize_reference(storage, active: Tensor | None = None) -> Tensor:
    """Float64 oracle: ``[E, a, b]`` float64, ``code[q] * absmax`` evaluated exactly (a product of two
    float32 values fits a float64), with the block scales decoded in float32 as the format defines;
    inactive experts' rows are zero. Rounding it to float32 gives bitsandbytes' float32 output; its
    bfloat16 / float16 output is that float32 value rounded again (``ref.float().to(dtype)``).
    Plain torch, slow, for tests."""
    check_active(storage, active)
    E, a, b = storage.shape
    vals = storage.code.double()[_nibbles(storage.data.view(-1))].view(-1, storage.blocksize)
    vals = (vals * decoded_absmax(storage).double()[:, None]).view(E, a, b)
    if active is not None:
        vals = vals * (active > 0)[:, None, None]
    return vals


def check_active(storage, active: Tensor | None) -> None:
    """Shape, dtype and device of ``active`` (never its values: no host sync).

    Raises:
        TypeError: ``active`` is not a bool or integer tensor.
        ValueError: its shape is not ``[E]`` or its device is not the storage's.
    """
    if active is None:
        return
    if not isinstance(active, Tensor) or active.dtype.is_floating_point or active.is_complex():
        kind = f"a {active.dtype} tensor" if isinstance(active, Tensor) else f"a {type(active).__name__}"
        raise TypeError(f"active: expected a bool or integer tensor [E], got {kind}")
    if tuple(active.shape) != (storage.shape[0],):
        raise ValueError(
            f"active: expected shape ({storage.shape[0]},) (one entry per expert), got {tuple(active.shape)}"
        )
    if active.device != storage.device:
        raise ValueError(f"active: expected device {storage.device} (the storage's), got {active.device}")


def check_out(storage, out: Tensor) -> None:
    """Shape, dtype, device and contiguity of the workspace ``out``.

    Raises:
        TypeError: ``out`` is not a tensor or not of the storage's compute dtype.
        ValueError: its shape or device differs from the storage's, or it is not contiguous.
    """
    if not isinstance(out, Tensor):
        raise TypeError(f"out: expected a tensor, got {type(out).__name__}")
    if out.dtype != storage.dtype:
        raise TypeError(f"out: expected dtype {storage.dtype} (the compute dtype), got {out.dtype}")
    if out.shape != storage.shape:
        raise ValueError(f"out: expected shape {tuple(storage.shape)}, got {tuple(out.shape)}")
    if out.device != storage.device:
        raise ValueError(f"out: expected device {storage.device} (the storage's), got {out.device}")
    if not out.is_contiguous():
        raise ValueError("out: expected a contiguous tensor")


@functools.cache
def _warn_no_triton() -> None:
    warnings.warn(
        "moeyard: triton is not installed, so quantised experts are dequantised on CUDA by the torch "
        "path, which decodes every expert whatever `active` says (pip install triton)",
        stacklevel=4,
    )
