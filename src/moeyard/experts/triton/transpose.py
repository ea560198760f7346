"""A tiled 2-D transpose with a cast, ``y = x.t()`` in ``y``'s dtype: the LoRA factor ``B``'s
expert-major relayout and its gradient's way back (:mod:`moeyard.experts.relayout`). torch's copy of
that strided view runs at 0.6 TB/s on an H200 (16 MiB in 0.053 ms); this kernel takes 0.007 ms
(``benchmarks/NOTES.md``, round 16).
"""

import torch
import triton
import triton.language as tl

from ...launch import cached, cdiv

BLOCK = 64


@cached
@triton.jit
def transpose_kernel(x_ptr, y_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr):
    """``y[n, m] = x[m, n]`` for one ``[BM, BN]`` tile of ``x [M, N]`` (``y [N, M]``; both contiguous):
    read along ``x``'s rows, written along ``y``'s (Triton moves the tile between the two layouts)."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    x = tl.load(x_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], mask=(rm[:, None] < M) & (rn[None, :] < N))
    tl.store(
        y_ptr + rn[:, None].to(tl.int64) * M + rm[None, :],
        tl.trans(x).to(y_ptr.dtype.element_ty),
        mask=(rn[:, None] < N) & (rm[None, :] < M),
    )


def launch(x: torch.Tensor, y: torch.Tensor) -> None:
    """``y = x.t()`` cast to ``y``'s dtype: ``x [M, N]`` and ``y [N, M]``, both contiguous, one device."""
    M, N = x.shape
    if M and N:
        transpose_kernel[(cdiv(M, BLOCK), cdiv(N, BLOCK))](x, y, M, N, BM=BLOCK, BN=BLOCK)
