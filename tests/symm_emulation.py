"""What the NVSHMEM all-to-alls of ``torch.ops.symm_mem`` do, in plain torch: the reference
(``ref_*``: every rank's inputs in, one rank's output out; host ints) and an emulation of their
contract over any process group (:class:`EmulatedSymmOps`, for ``moeyard.parallel.symm_mem.OPS``).

Used by the CPU tests (gloo) to run the symmetric-memory exchange without NVSHMEM, and by
``benchmarks/ep_symm_check.py`` on GPUs to check the real ops against the same reference. Read
from pytorch's ``nvshmem_extension.cu`` and ``test_nvshmem.py`` (torch 2.8 - 2.13):

- ``all_to_all_vdev_2d``: ``in_splits [W * ne]`` rank-major (chunk ``d * ne + e``: rows for rank
  d's expert e), input chunks back to back from row 0; on rank r, ``out`` is expert-major: expert
  e's block holds its chunks from ranks 0, 1, ... back to back, then padding up to a multiple of
  ``major_align``, and an empty block still takes ``major_align`` rows; ``out_splits_offsets[0]``
  the received splits, ``[1]`` their offsets in ``out``, both indexed ``e * W + s``.
- ``all_to_all_vdev_2d_offset``: ``in_splits_offsets [2, ne * W]`` (index ``e * W + d``: splits
  and input offsets, gaps allowed); on rank r, ``out`` holds rank s's chunk for (e, r) at chunk
  ``s * ne + e``, back to back from row 0, no padding; ``out_splits_offsets [2, W * ne]`` likewise.
- ``all_to_all_vdev``: ``in_splits [W]``, input back to back; ``out`` back to back by source;
  ``out_splits_offsets [2, W]``.

Only the rows named by the splits are written; the rest of ``out`` keeps what it held.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

Tensor = torch.Tensor


def _exclusive(xs: list[int]) -> list[int]:
    out, acc = [], 0
    for x in xs:
        out.append(acc)
        acc += x
    return out


def ref_vdev_2d(inputs: list[Tensor], in_splits: list[Tensor], rank: int, major_align: int):
    """Rank ``rank``'s result of ``all_to_all_vdev_2d``: ``(meta [2, ne * W] int64, writes, rows
    used)``, ``writes`` a list of ``(out row, rows)``."""
    W = len(inputs)
    ne = in_splits[0].numel() // W
    splits = [s.tolist() for s in in_splits]  # [source][d * ne + e]
    offsets = [_exclusive(s) for s in splits]
    meta = torch.zeros(2, ne * W, dtype=torch.int64)
    writes, start = [], 0
    for e in range(ne):
        at = start
        for s in range(W):
            n, src = splits[s][rank * ne + e], offsets[s][rank * ne + e]
            meta[0, e * W + s], meta[1, e * W + s] = n, at
            writes.append((at, inputs[s][src : src + n]))
            at += n
        size = at - start
        start += max(major_align, math.ceil(size / major_align) * major_align)
    return meta, writes, start


def ref_vdev_2d_offset(inputs: list[Tensor], in_splits_offsets: list[Tensor], rank: int):
    """Rank ``rank``'s result of ``all_to_all_vdev_2d_offset``: ``(meta [2, W * ne], writes, rows used)``."""
    W = len(inputs)
    ne = in_splits_offsets[0].shape[1] // W
    meta = torch.zeros(2, W * ne, dtype=torch.int64)
    writes, at = [], 0
    for s in range(W):
        so = in_splits_offsets[s].tolist()
        for e in range(ne):
            n, src = so[0][e * W + rank], so[1][e * W + rank]
            meta[0, s * ne + e], meta[1, s * ne + e] = n, at
            writes.append((at, inputs[s][src : src + n]))
            at += n
    return meta, writes, at


def ref_vdev(inputs: list[Tensor], in_splits: list[Tensor], rank: int):
    """Rank ``rank``'s result of ``all_to_all_vdev``: ``(meta [2, W], writes, rows used)``."""
    W = len(inputs)
    meta = torch.zeros(2, W, dtype=torch.int64)
    writes, at = [], 0
    for s in range(W):
        splits = in_splits[s].tolist()
        n, src = splits[rank], _exclusive(splits)[rank]
        meta[0, s], meta[1, s] = n, at
        writes.append((at, inputs[s][src : src + n]))
        at += n
    return meta, writes, at


class EmulatedSymmOps:
    """The contract of ``moeyard.parallel.symm_mem.TorchSymmOps`` over any process group (gloo):
    each op all-gathers the inputs and splits and applies the reference for this rank. Stricter
    than needed where a real op would misbehave: every tensor must come from :meth:`empty` (whole,
    not a view), the ops' size limits are asserted, and new buffers are filled with NaN (float) or
    -1 (int), so reading rows nobody wrote shows up.

    Attributes:
        barriers: how many times :meth:`barrier` ran. calls: ``(op name, W, ne)`` of each call.
    """

    def __init__(self):
        self.allocated: dict[int, Tensor] = {}
        self.barriers = 0
        self.calls: list[tuple[str, int, int]] = []

    def unavailable(self, ep) -> str | None:
        return None

    def prepare(self, group, device) -> str:
        return group.group_name

    def empty(self, shape, dtype, device, group_name) -> Tensor:
        fill = float("nan") if dtype.is_floating_point else -1
        t = torch.full(shape, fill, dtype=dtype, device=device)
        self.allocated[t.data_ptr()] = t
        return t

    def barrier(self, group, device) -> None:
        self.barriers += 1
        dist.barrier(group=group)

    def all_to_all_vdev_2d(self, input, out, in_splits, out_splits_offsets, group_name, major_align) -> None:
        W = dist.get_world_size()
        ne = in_splits.numel() // W
        assert W <= 32 and ne <= 16, f"all_to_all_vdev_2d: W={W} (<= 32), ne={ne} (<= 16)"
        assert major_align is not None and major_align >= 1
        self._check(input, out, in_splits, out_splits_offsets, (W * ne,), (2, W * ne))
        inputs, splits = self._gather(input), self._gather(in_splits)
        assert int(in_splits.sum()) <= input.shape[0], "sum of splits is larger than input dim"
        self._write(out, out_splits_offsets, ref_vdev_2d(inputs, splits, dist.get_rank(), major_align))
        self.calls.append(("all_to_all_vdev_2d", W, ne))

    def all_to_all_vdev_2d_offset(self, input, out, in_splits_offsets, out_splits_offsets, group_name) -> None:
        W = dist.get_world_size()
        ne = in_splits_offsets.shape[1] // W
        assert W <= 16 and ne <= 32, f"all_to_all_vdev_2d_offset: W={W} (<= 16), ne={ne} (<= 32)"
        self._check(input, out, in_splits_offsets, out_splits_offsets, (2, W * ne), (2, W * ne))
        so = in_splits_offsets
        assert bool(((so[1] + so[0]) <= input.shape[0]).all()), "input chunk past the input"
        inputs, metas = self._gather(input), self._gather(in_splits_offsets)
        self._write(out, out_splits_offsets, ref_vdev_2d_offset(inputs, metas, dist.get_rank()))
        self.calls.append(("all_to_all_vdev_2d_offset", W, ne))

    def all_to_all_vdev(self, input, out, in_splits, out_splits_offsets, group_name) -> None:
        W = dist.get_world_size()
        self._check(input, out, in_splits, out_splits_offsets, (W,), (2, W))
        assert int(in_splits.sum()) <= input.shape[0], "sum of splits is larger than input dim"
        inputs, splits = self._gather(input), self._gather(in_splits)
        self._write(out, out_splits_offsets, ref_vdev(inputs, splits, dist.get_rank()))
        self.calls.append(("all_to_all_vdev", W, 1))

    def _check(self, input, out, splits_in, meta_out, splits_shape, meta_shape) -> None:
        for name, t in (("input", input), ("out", out), ("in splits", splits_in), ("out_splits_offsets", meta_out)):
            assert self.allocated.get(t.data_ptr()) is t, f"{name}: not a whole symmetric tensor"
            assert t.is_contiguous(), f"{name}: not contiguous"
        assert input.dtype == out.dtype and input.stride(0) == out.stride(0), "input/out: dtype or row stride differ"
        assert splits_in.dtype == meta_out.dtype == torch.int64, "splits must be int64"
        assert tuple(splits_in.shape) == splits_shape, (tuple(splits_in.shape), splits_shape)
        assert tuple(meta_out.shape) == meta_shape, (tuple(meta_out.shape), meta_shape)
        assert bool((splits_in.view(-1)[: splits_shape[-1]] >= 0).all()), "negative split"

    @staticmethod
    def _gather(t: Tensor) -> list[Tensor]:
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t.contiguous())
        return parts

    @staticmethod
    def _write(out: Tensor, meta_out: Tensor, result) -> None:
        meta, writes, used = result
        assert used <= out.shape[0], f"out: {used} rows needed, {out.shape[0]} allocated"
        for at, rows in writes:
            out[at : at + rows.shape[0]] = rows
        meta_out.copy_(meta)
