"""Copy rows between a contiguous window and indexed rows, up to a count held on the device.

The ``p2p`` exchange (:mod:`.p2p`) moves each peer's rows with it: dispatch pulls the window of rows
a peer sent this rank out of the peer's buffer into expert-major rows, combine pushes expert-major
rows back into the peer's buffer. Either side may be a peer's memory (a symmetric-memory view).

``copy_rows(dst, src, rows, base, count, indexed="dst")``, ``j`` in ``[0, count)``:

- ``indexed="dst"`` (pull): ``dst[rows[j]] = src[base + j]``;
- ``indexed="src"`` (push): ``dst[base + j] = src[rows[j]]``.

``base`` and ``count`` are ``[]`` int64 device tensors, never read on the host: the launch is
sized for ``rows.numel()`` (a static bound) and programs past ``count`` return at once, so only the
``count`` rows travel. On CUDA a Triton kernel (:mod:`.row_copy_triton`); elsewhere
:func:`copy_rows_reference`, which reads the whole bound and writes the rows past ``count`` into
``dst``'s last row (the caller keeps a spare row there).
"""
from __future__ import annotations

import torch

Tensor = torch.Tensor


def copy_rows(dst: Tensor, src: Tensor, rows: Tensor, base: Tensor, count: Tensor, *, indexed: str) -> None:
    """See the module docstring. ``dst [*, H]``, ``src [*, H]`` one dtype, rows contiguous (row
    stride may differ); ``rows [C]`` int64; ``base``, ``count`` ``[]`` int64; ``count <= C`` and every
    row addressed in range (the caller's layout guarantees it; not checked: a check would read the
    device). ``dst``'s last row is scratch for :func:`copy_rows_reference`. No host sync."""
    if dst.is_cuda:
        from .row_copy_triton import copy_rows_triton
        copy_rows_triton(dst, src, rows, base, count, indexed=indexed)
    else:
        copy_rows_reference(dst, src, rows, base, count, indexed=indexed)


def copy_rows_reference(dst: Tensor, src: Tensor, rows: Tensor, base: Tensor, count: Tensor, *, indexed: str) -> None:
    """The same in torch ops: the whole bound ``C`` is read (rows past ``count`` from the window
    clamped into ``src``, or from ``src[rows[j]]`` clamped) and written, those past ``count`` into
    ``dst``'s last row (scratch)."""
    j = torch.arange(rows.numel(), device=rows.device)
    keep = j < count
    window = base + j
    spare = dst.shape[0] - 1
    if indexed == "dst":
        got = src.index_select(0, window.clamp(max=src.shape[0] - 1))
        dst.index_copy_(0, torch.where(keep, rows, spare), got)
    elif indexed == "src":
        got = src.index_select(0, torch.where(keep, rows, 0).clamp(max=src.shape[0] - 1))
        dst.index_copy_(0, torch.where(keep, window, spare), got)
    else:
        raise ValueError(f"indexed: expected 'dst' or 'src', got {indexed!r}")
