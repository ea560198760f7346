"""Triton kernel for selective NF4 dequantisation (CUDA; CPU only under ``TRITON_INTERPRET=1``).

Four thin layers: :func:`nf4_dequant_kernel`; the custom op ``moeyard::nf4_dequantize_`` writing into
a preallocated output (fake registration: traceable by ``torch.compile``); :func:`dequantize_triton`,
the wrapper that checks and launches. The oracle is :func:`moeyard.quant.dequant.dequantize_reference`.

Grid ``(ceil(P / (NB * BS)), E)``: a program decodes ``NB`` absmax blocks of ``BS`` elements of one
expert; programs of inactive experts read one flag and exit, or, into a fresh output
(``ZERO_INACTIVE``), store zeros (one pass over the output, not a memset then a pass). Output rounding
to bfloat16 is round-to-nearest-even: the hardware conversion on a GPU, integer arithmetic on the bits
under the interpreter (which truncates), so CPU tests and GPU runs give the same bits (a NaN's
payload aside: 0x7FFF from the hardware, 0x7FC0 on the bits).

Legend: E experts, P = a*b elements per expert, BS blocksize, BS2 = 256 (nested absmax blocksize).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernel_op import interpreting, kernel_op
from ..launch import cached, cdiv
from ._bnb import NESTED_BLOCKSIZE

Tensor = torch.Tensor
ELEMENTS_PER_PROGRAM = 4096
NUM_WARPS = 4
MAX_GRID_Y = 65535


@triton.jit
def _round_bf16(x):
    """float32 -> bfloat16 by round-to-nearest-even on the bits (NaN kept as a quiet NaN)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _store_out(p_out, vals, mask, HW_ROUND: tl.constexpr):
    """``vals`` (float32) rounded to ``p_out``'s dtype and stored: to bfloat16 by the hardware conversion
    (``HW_ROUND``, round to nearest even) or :func:`_round_bf16` (the interpreter truncates)."""
    if p_out.dtype.element_ty == tl.bfloat16 and not HW_ROUND:
        tl.store(p_out, _round_bf16(vals), mask=mask)
    else:
        tl.store(p_out, vals.to(p_out.dtype.element_ty), mask=mask)


@triton.jit
def block_scales(absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, blk, mask, NESTED: tl.constexpr, BS2: tl.constexpr):
    """float32 block scales at the block indices ``blk``: the stored ``absmax``, or with ``NESTED`` (double
    quantisation) ``fl(fl(code2[absmax[blk]] * absmax2[blk // BS2]) + offset)``, rounded twice when the kernel
    is launched without FMA fusion (as :func:`moeyard.quant.dequant.decoded_absmax`)."""
    if NESTED:
        q = tl.load(absmax_ptr + blk, mask=mask, other=0).to(tl.int32)
        scale = tl.load(code2_ptr + q, mask=mask, other=0.0) * tl.load(absmax2_ptr + blk // BS2, mask=mask, other=0.0)
        scale = scale + tl.load(offset_ptr)
    else:
        scale = tl.load(absmax_ptr + blk, mask=mask, other=0.0)
    return scale


@cached
@triton.jit
def nf4_dequant_kernel(
    data_ptr,  # [E * P / 2] uint8: element 2i in the high nibble of byte i, 2i+1 in the low nibble
    absmax_ptr,  # [E * P / BS] uint8 (NESTED: indexes code2) or float32: one scale per block
    absmax2_ptr,  # [ceil(E * P / BS / BS2)] float32: second-level scales; read if NESTED
    code2_ptr,  # [256] float32: the absmax code (bitsandbytes' dynamic map); read if NESTED
    offset_ptr,  # [] float32: added to every decoded absmax; read if NESTED
    code_ptr,  # [16] float32: the NF4 table
    active_ptr,  # [E] uint8 (a bool viewed as bytes) or int32/int64: expert e is decoded iff > 0; read if HAS_ACTIVE
    out_ptr,  # [E, P] float32 / bfloat16 / float16, contiguous
    blocks_per_expert,  # P // BS
    BS: tl.constexpr,
    BS2: tl.constexpr,
    NB: tl.constexpr,
    NESTED: tl.constexpr,
    HAS_ACTIVE: tl.constexpr,
    ZERO_INACTIVE: tl.constexpr,  # an inactive expert's blocks are stored as zeros (else left untouched)
    HW_ROUND: tl.constexpr,  # round with the hardware conversion (GPU); else on the bits (interpreter)
):
    """``out[e, k] = fl(code[q] * absmax[block])`` for the ``NB`` blocks of one program."""
    e = tl.program_id(1)
    r_blk = tl.program_id(0) * NB + tl.arange(0, NB)
    m_blk = r_blk < blocks_per_expert
    blk = e.to(tl.int64) * blocks_per_expert + r_blk  # [NB] global block index
    p_out = out_ptr + blk[:, None] * BS + tl.arange(0, BS)[None, :]
    if HAS_ACTIVE:
        if tl.load(active_ptr + e) <= 0:
            if ZERO_INACTIVE:
                tl.store(p_out, tl.zeros([NB, BS], dtype=out_ptr.dtype.element_ty), mask=m_blk[:, None])
            return
    b_scale = block_scales(absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, blk, m_blk, NESTED, BS2)
    HALF: tl.constexpr = BS // 2
    p_bytes = data_ptr + blk[:, None] * HALF + tl.arange(0, HALF)[None, :]
    b_bytes = tl.load(p_bytes, mask=m_blk[:, None], other=0).to(tl.int32)  # [NB, BS/2]
    b_vals = tl.interleave(tl.load(code_ptr + (b_bytes >> 4)), tl.load(code_ptr + (b_bytes & 0xF)))  # [NB, BS]
    _store_out(p_out, b_vals * b_scale[:, None], m_blk[:, None], HW_ROUND)


@kernel_op("moeyard::nf4_dequantize_", mutates_args=("out",))
def nf4_dequantize_(
    data: Tensor,
    absmax: Tensor,
    absmax2: Tensor | None,
    code2: Tensor | None,
    offset: Tensor | None,
    code: Tensor,
    active: Tensor | None,
    blocksize: int,
    zero_inactive: bool,
    out: Tensor,
) -> None:
    """Write the active experts of ``out [E, a, b]`` from NF4 storage (tensors as the kernel documents);
    with ``zero_inactive`` the others' rows are zeroed, else left untouched."""
    E = out.shape[0]
    per = out.numel() // max(E, 1)
    if out.numel() == 0:
        return
    nb = max(1, ELEMENTS_PER_PROGRAM // blocksize)
    blocks_per_expert = per // blocksize
    nested = absmax2 is not None
    if active is not None and active.dtype == torch.bool:
        active = active.view(torch.uint8)
    grid = (cdiv(blocks_per_expert, nb), E)
    nf4_dequant_kernel[grid](
        data,
        absmax,
        absmax2 if nested else absmax,
        code2 if nested else code,
        offset if nested else code,
        code,
        active if active is not None else code,
        out,
        blocks_per_expert,
        BS=blocksize,
        BS2=NESTED_BLOCKSIZE,
        NB=nb,
        NESTED=nested,
        HAS_ACTIVE=active is not None,
        ZERO_INACTIVE=zero_inactive,
        HW_ROUND=not interpreting(),
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,
    )


@nf4_dequantize_.register_fake
def _(data, absmax, absmax2, code2, offset, code, active, blocksize, zero_inactive, out):
    return None


def dequantize_triton(storage, active: Tensor | None, out: Tensor, zero_inactive: bool = False) -> None:
    """Launch the kernel for ``storage`` (an :class:`NF4Experts`) into ``out`` (checked by the caller:
    ``[E, a, b]``, contiguous, compute dtype, same device); ``zero_inactive``: zero the inactive experts'
    rows (``out`` fresh from ``torch.empty``), else leave them untouched.

    Raises:
        ValueError: more experts than one grid dimension holds (65535).
    """
    if storage.shape[0] > MAX_GRID_Y:
        raise ValueError(f"NF4 dequantisation: at most {MAX_GRID_Y} experts per tensor, got {storage.shape[0]}")
    nf4_dequantize_(
        storage.data,
        storage.absmax,
        storage.absmax2,
        storage.code2,
        storage.offset,
        storage.code,
        active,
        storage.blocksize,
        zero_inactive,
        out,
    )
