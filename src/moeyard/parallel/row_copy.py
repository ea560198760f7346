"""Copy rows between this rank's memory and every peer's, each peer's window of rows up to a count
held on the device.

The ``p2p`` exchange (:mod:`.p2p`) moves all peers' rows with one call: dispatch pulls the window
of rows each peer sent this rank out of the peers' buffers into expert-major rows, combine pushes
expert-major rows back into the peers' buffers. For peer ``s`` and ``j`` in ``[0, count[s])``:

- ``direction="pull"``: ``local[rows[s, j]] = peers[s][base[s] + j]``, or with ``index``
  ``local[rows[s, j]] = peers[s][index[s][base[s] + j]]`` (each peer's window names its rows: a peer
  puts its tokens in its buffer once and lists, per routed pair, the token's row), and with ``scale``
  each row times ``scale[s][base[s] + j]`` (product in float32, float64 for float64 rows, rounded
  once);
- ``direction="push"``: ``peers[s][base[s] + j] = local[rows[s, j]]``.

``base`` and ``count`` are ``[W]`` int64 device tensors, never read on the host: the launch is
sized for the static bound ``C = rows.shape[1]`` and programs past a peer's count return at once,
so only the ``count`` rows travel. On CUDA one Triton kernel covers every peer (:mod:`.row_copy_triton`;
the copies from or to this rank's own buffer run beside the ones over NVLink); elsewhere
:func:`copy_rows_reference`.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor
DIRECTIONS = ("pull", "push")


def copy_rows(
    local: Tensor,
    peers: list[Tensor],
    table: Tensor,
    rows: Tensor,
    base: Tensor,
    count: Tensor,
    *,
    direction: str,
    index: tuple[list[Tensor], Tensor] | None = None,
    scale: tuple[list[Tensor], Tensor] | None = None,
) -> None:
    """See the module docstring. ``local [*, H]``; ``peers``: W tensors ``[*, H]`` of one shape,
    dtype and row stride (a symmetric tensor's views by rank); ``table [W]`` int64, their
    ``data_ptr()`` on ``local``'s device (read by the CUDA kernel); ``rows [W, C]`` int64;
    ``base``, ``count`` ``[W]`` int64 with ``count <= C`` and every row addressed in range (the
    caller's layout guarantees it; not checked: a check would read the device). ``index`` and
    ``scale`` (pull only): ``(views, table)``, W contiguous tensors ``[*]`` (a symmetric tensor's
    views by rank; int64 row numbers, factors in the rows' dtype) and their addresses, as ``peers`` and
    ``table``. The last row of ``local`` (pull) or of each peer (push) is scratch for
    :func:`copy_rows_reference`. No host sync.

    Raises:
        ValueError: ``direction`` is not ``pull`` or ``push``; ``index`` or ``scale`` with ``push``."""
    _check(direction, index, scale)
    if local.is_cuda:
        from .row_copy_triton import copy_rows_triton

        copy_rows_triton(
            local,
            peers[0],
            table,
            rows,
            base,
            count,
            pull=direction == "pull",
            index_table=None if index is None else index[1],
            scale_table=None if scale is None else scale[1],
        )
    else:
        copy_rows_reference(
            local,
            peers,
            rows,
            base,
            count,
            direction=direction,
            index=None if index is None else index[0],
            scale=None if scale is None else scale[0],
        )


def _check(direction: str, index, scale) -> None:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction: expected one of {DIRECTIONS}, got {direction!r}")
    if (index is not None or scale is not None) and direction != "pull":
        raise ValueError(
            f"index, scale: only a pull reads its rows through an index or scales them, got direction={direction!r}"
        )


def _at(t: Tensor, i: Tensor) -> Tensor:
    """``t[i]`` with ``i`` clamped into range (rows past a count read something, then go to scratch)."""
    return t.index_select(0, i.clamp(max=t.shape[0] - 1))


def copy_rows_reference(
    local: Tensor,
    peers: list[Tensor],
    rows: Tensor,
    base: Tensor,
    count: Tensor,
    *,
    direction: str,
    index: list[Tensor] | None = None,
    scale: list[Tensor] | None = None,
) -> None:
    """The same in torch ops, one peer after the other (``index``, ``scale``: the W tensors): the whole
    bound ``C`` is read (rows past the count from the window or the indexed rows clamped into range)
    and written, those past the count into the destination's last row (scratch)."""
    _check(direction, index, scale)
    j = torch.arange(rows.shape[1], device=rows.device)
    for s, peer in enumerate(peers):
        keep = j < count[s]
        window = base[s] + j
        if direction == "pull":
            src = window if index is None else torch.where(keep, _at(index[s], window), 0)
            got = peer.index_select(0, src.clamp(max=peer.shape[0] - 1))
            if scale is not None:
                wide = torch.promote_types(got.dtype, torch.float32)
                got = (got.to(wide) * _at(scale[s], window).to(wide).unsqueeze(1)).to(got.dtype)
            local.index_copy_(0, torch.where(keep, rows[s], local.shape[0] - 1), got)
        else:
            got = local.index_select(0, torch.where(keep, rows[s], 0).clamp(max=local.shape[0] - 1))
            peer.index_copy_(0, torch.where(keep, window, peer.shape[0] - 1), got)
