"""The block grid of :class:`moeyard.quant.FP8BlockExperts` (:mod:`.fp8_block`): 128 x 128 scale blocks,
blocked per row segment (a ``gate_up_proj``'s gate and up halves, as checkpoints store them). Shared by the
storage, its Triton dequantisation kernel (:mod:`.triton_fp8_block`) and the checkpoint loader
(:mod:`.fp8_checkpoint`).
"""

from __future__ import annotations

import torch

from .fp8 import Blocks

Tensor = torch.Tensor
BLOCK = 128
BLOCKS = Blocks(BLOCK, BLOCK)


def normalize_segments(row_segments, rows: int) -> tuple[int, ...]:
    """``row_segments`` as a tuple of positive ints summing to ``rows``; ``(rows,)`` when None or when
    every segment but the last is a multiple of 128 (the same grid as no segments).

    Raises:
        ValueError: not positive ints, or they do not sum to ``rows``.
    """
    if row_segments is None:
        return (rows,)
    segs = tuple(row_segments)
    if not segs or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in segs) or sum(segs) != rows:
        raise ValueError(
            f"row_segments: expected positive ints summing to the weight's {rows} rows, got {row_segments!r}"
        )
    if all(s % BLOCK == 0 for s in segs[:-1]):
        return (rows,)
    return segs


def scale_rows(row_segments: tuple[int, ...]) -> int:
    return sum(-(-s // BLOCK) for s in row_segments)


def grid_shape(shape, row_segments: tuple[int, ...]) -> tuple[int, int, int]:
    """The shape of ``weight_scale_inv`` for ``weight`` of ``shape``."""
    return (shape[0], scale_rows(row_segments), -(-shape[2] // BLOCK))


def row_block_ids(row_segments: tuple[int, ...], device) -> Tensor:
    """``[sum(row_segments)]`` int64 block-row index of every row (blocks restart at each segment)."""
    ids, base = [], 0
    for s in row_segments:
        ids.append(torch.arange(s, device=device) // BLOCK + base)
        base += -(-s // BLOCK)
    return torch.cat(ids)


def gate_up_segments(rows: int, gated: bool) -> tuple[int, ...] | None:
    """The row segments of a weight of ``rows`` rows: its gate and up halves (blocked separately, as
    checkpoints store ``gate_proj`` and ``up_proj``) when ``gated``, else None (the plain grid)."""
    return (rows // 2, rows // 2) if gated and rows % 2 == 0 else None


def infer_row_segments(shape, scale_shape, *, gated: bool) -> tuple[int, ...]:
    """The row segments under which ``scale_shape`` is the block grid of a weight of ``shape``: for
    ``gated`` (a gate_up_proj in the standard layout) the gate and up halves blocked separately (the
    checkpoint convention, :func:`gate_up_segments`) if that grid has this shape, else the plain grid.

    Raises:
        ValueError: neither grid has that shape.
    """
    a = shape[1]
    halves = gate_up_segments(a, gated)
    for segs in ([halves] if halves else []) + [(a,)]:
        if grid_shape(shape, segs) == tuple(scale_shape):
            return normalize_segments(segs, a)
    want = grid_shape(shape, (a,))
    raise ValueError(
        f"weight_scale_inv: expected shape {want} (one scale per 128 x 128 block of the weight "
        f"{tuple(shape)}){' or the gate and up halves blocked separately' if gated else ''}, "
        f"got {tuple(scale_shape)}"
    )
