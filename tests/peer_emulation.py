"""Symmetric memory on the CPU for the ``p2p`` exchange's tests: every rank's tensor is a shared
file under ``/dev/shm`` (or the temp dir), mapped by every process of the group, so a rank's reads
and writes of a peer's view really land in the peer's memory, as over NVLink; the barrier is the
group's ``dist.barrier`` (CPU ops are synchronous, so it orders every earlier write).

:class:`EmulatedPeerOps` has the contract of ``moeyard.parallel.p2p.TorchPeerOps`` (for
``moeyard.parallel.p2p.OPS``).
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

Tensor = torch.Tensor


class EmulatedPeerOps:
    """Counts its allocations and barriers (``allocations``, ``barriers``)."""

    def __init__(self, tag: str):
        self.tag, self.allocations, self.barriers = tag, 0, 0
        self.root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        self.paths: list[str] = []

    def unavailable(self, ep) -> str | None:
        return None

    def symmetric(self, shape, dtype, device, group) -> tuple[list[Tensor], object]:
        rank, W = dist.get_rank(group), dist.get_world_size(group)
        n = 1
        for d in shape:
            n *= d
        key = f"moeyard-{self.tag}-{self.allocations}"
        self.allocations += 1
        path = os.path.join(self.root, f"{key}-{rank}")
        self.paths.append(path)
        local = torch.from_file(path, shared=True, size=n, dtype=dtype).view(shape)
        local.fill_(-7)  # what a fresh allocation may hold
        dist.barrier(group)
        views = [
            local
            if s == rank
            else torch.from_file(os.path.join(self.root, f"{key}-{s}"), shared=True, size=n, dtype=dtype).view(shape)
            for s in range(W)
        ]
        dist.barrier(group)
        return views, group

    def barrier(self, handle) -> None:
        self.barriers += 1
        dist.barrier(handle)

    def close(self) -> None:
        """Remove this rank's files (the mappings stay valid until dropped)."""
        for path in self.paths:
            if os.path.exists(path):
                os.unlink(path)
        self.paths.clear()
