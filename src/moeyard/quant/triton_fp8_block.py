"""Triton kernel for selective dequantisation of :class:`moeyard.quant.FP8BlockExperts` (CUDA; CPU
only under ``TRITON_INTERPRET=1``).

Three thin layers, as :mod:`.triton_nf4`: :func:`fp8_block_dequant_kernel`; the custom op
``moeyard::fp8_block_dequantize_`` writing into a preallocated output (fake registration: traceable
by ``torch.compile``); :func:`dequantize_triton`, the wrapper that launches. The oracle is
:func:`moeyard.quant.fp8_block.dequantize_reference`.

Grid ``(ceil(a / BR), ceil(b / BC), E)``: a program writes a ``BR x BC`` tile of one expert; programs
of inactive experts read one flag and exit, or, into a fresh output (``ZERO_INACTIVE``), store zeros.
The e4m3 bytes are decoded through a 256-entry float32 table (``torch.float8_e4m3fn`` viewed as float32:
exact, NaN included; Triton's interpreter decodes ``0x7f`` as 480, not NaN), so CPU tests and GPU runs
give the same values (a NaN is a NaN on both, its payload aside). Output rounding to bfloat16 is
:func:`moeyard.quant.triton_nf4._store_out`'s (round to nearest even).

Legend: E experts, ``(a, b)`` one expert's matrix, ``Ra x Rb`` its block grid.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..kernel_op import interpreting, kernel_op
from ..launch import cached, cdiv
from .fp8 import E4M3
from .fp8_block_grid import BLOCK, row_block_ids
from .triton_nf4 import MAX_GRID_Y, _store_out

Tensor = torch.Tensor
BLOCK_ROWS = 32
BLOCK_COLS = 128  # one scale block wide: a tile reads one scale per row


@cached
@triton.jit
def fp8_block_dequant_kernel(
    w_ptr,  # [E, a, b] uint8: the e4m3 bytes, contiguous
    scale_ptr,  # [E, Ra, Rb] float32, contiguous
    row_block_ptr,  # [a] int32: block row of each weight row
    lut_ptr,  # [256] float32: the value of each e4m3 byte
    active_ptr,  # [E] uint8 (a bool viewed as bytes) or int32/int64: expert e is decoded iff > 0; read if HAS_ACTIVE
    out_ptr,  # [E, a, b] float16 / bfloat16 / float32 / float64, contiguous
    a,
    b,
    Ra,
    Rb,
    BR: tl.constexpr,
    BC: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_ACTIVE: tl.constexpr,
    ZERO_INACTIVE: tl.constexpr,  # an inactive expert's tiles are stored as zeros (else left untouched)
    HW_ROUND: tl.constexpr,  # round with the hardware conversion (GPU); else on the bits (interpreter)
):
    """``out[e, i, j] = fl(lut[w[e, i, j]] * scale[e, row_block[i], j // BLOCK])`` over one tile."""
    e = tl.program_id(2)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    m_row = rows < a
    mask = m_row[:, None] & (cols < b)[None, :]
    offs = e.to(tl.int64) * a * b + rows[:, None].to(tl.int64) * b + cols[None, :]
    if HAS_ACTIVE:
        if tl.load(active_ptr + e) <= 0:
            if ZERO_INACTIVE:
                tl.store(out_ptr + offs, tl.zeros([BR, BC], dtype=out_ptr.dtype.element_ty), mask=mask)
            return
    byte = tl.load(w_ptr + offs, mask=mask, other=0).to(tl.int32)
    r_blk = tl.load(row_block_ptr + rows, mask=m_row, other=0)
    s_offs = e.to(tl.int64) * Ra * Rb + r_blk[:, None] * Rb + (cols // BLOCK)[None, :]
    scale = tl.load(scale_ptr + s_offs, mask=mask, other=0.0)
    _store_out(out_ptr + offs, tl.load(lut_ptr + byte) * scale, mask, HW_ROUND)


@kernel_op("moeyard::fp8_block_dequantize_", mutates_args=("out",))
def fp8_block_dequantize_(
    weight: Tensor,
    weight_scale_inv: Tensor,
    row_blocks: Tensor,
    lut: Tensor,
    active: Tensor | None,
    block: int,
    zero_inactive: bool,
    out: Tensor,
) -> None:
    """Write the active experts of ``out [E, a, b]`` from FP8 block storage (tensors as the kernel documents);
    with ``zero_inactive`` the others' rows are zeroed, else left untouched."""
    E, a, b = out.shape
    if out.numel() == 0:
        return
    if active is not None and active.dtype == torch.bool:
        active = active.view(torch.uint8)
    grid = (cdiv(a, BLOCK_ROWS), cdiv(b, BLOCK_COLS), E)
    fp8_block_dequant_kernel[grid](
        weight.view(torch.uint8),
        weight_scale_inv,
        row_blocks,
        lut,
        active if active is not None else lut,
        out,
        a,
        b,
        weight_scale_inv.shape[1],
        weight_scale_inv.shape[2],
        BR=BLOCK_ROWS,
        BC=BLOCK_COLS,
        BLOCK=block,
        HAS_ACTIVE=active is not None,
        ZERO_INACTIVE=zero_inactive,
        HW_ROUND=not interpreting(),
    )


@fp8_block_dequantize_.register_fake
def _(weight, weight_scale_inv, row_blocks, lut, active, block, zero_inactive, out):
    return None


@functools.lru_cache(maxsize=16)
def e4m3_table(device: torch.device) -> Tensor:
    """``[256]`` float32: the value of every e4m3 byte (``torch.float8_e4m3fn`` decoded by torch)."""
    return torch.arange(256, dtype=torch.uint8, device=device).view(E4M3).float()


@functools.lru_cache(maxsize=64)
def _row_blocks(row_segments: tuple[int, ...], device: torch.device) -> Tensor:
    return row_block_ids(row_segments, device).to(torch.int32)


def dequantize_triton(storage, active: Tensor | None, out: Tensor, zero_inactive: bool = False) -> None:
    """Launch the kernel for ``storage`` (an :class:`FP8BlockExperts`) into ``out`` (checked by the
    caller: ``[E, a, b]``, contiguous, compute dtype, same device); ``zero_inactive``: zero the inactive
    experts' rows (``out`` fresh from ``torch.empty``), else leave them untouched.

    Raises:
        ValueError: more experts than one grid dimension holds (65535).
    """
    if storage.shape[0] > MAX_GRID_Y:
        raise ValueError(f"FP8 dequantisation: at most {MAX_GRID_Y} experts per tensor, got {storage.shape[0]}")
    fp8_block_dequantize_(
        storage.weight.contiguous(),
        storage.weight_scale_inv.contiguous(),
        _row_blocks(storage.row_segments, storage.device),
        e4m3_table(storage.device),
        active,
        BLOCK,
        zero_inactive,
        out,
    )
