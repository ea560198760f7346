"""The expert-parallel group and differentiable collectives over it.

:class:`EPGroup` names the process group (and the 1-D ``DeviceMesh`` when one was given) that the
experts are split over. The collectives are autograd Functions: the backward of an all-to-all is the
all-to-all with the splits swapped, the backward of an all-gather is a reduce-scatter and the other
way round. They run on gloo (CPU) and NCCL alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

Tensor = torch.Tensor


@dataclass(frozen=True, kw_only=True)
class EPGroup:
    """Where the experts live.

    Attributes:
        group: the process group (a ``ProcessGroup``; ``WORLD`` by default).
        world_size: W, ranks in the group (EP size).
        rank: this process's rank in the group.
        mesh: the 1-D ``DeviceMesh`` given, or None (expert weights then stay plain tensors).
        backend: the group's ``torch.distributed`` backend name (``"nccl"``, ``"gloo"``,
            ``"cpu:gloo,cuda:nccl"``, ...); ``""`` when unknown.
    """

    group: object
    world_size: int
    rank: int
    mesh: object | None = None
    backend: str = ""


def check_device(device: torch.device, backend: str) -> None:
    """Raise ValueError when tensors on ``device`` cannot go through a group of ``backend``: NCCL
    alone takes only CUDA tensors of this process's current device (``torch.cuda.set_device(local_rank)``
    before the first collective), and a wrong device otherwise fails inside NCCL or hangs.

    Host metadata only (no sync)."""
    if backend != "nccl":
        return
    if device.type != "cuda":
        raise ValueError(
            f"hidden_states: the expert-parallel group runs NCCL, which needs CUDA tensors; got "
            f"device {device} (move the model to cuda:{{local_rank}})"
        )
    current = torch.cuda.current_device()
    if device.index is not None and device.index != current:
        raise ValueError(
            f"hidden_states: on {device}, but this process's current CUDA device is cuda:{current}; "
            "call torch.cuda.set_device(local_rank) before init_process_group and keep the model there"
        )


def symmetric_memory_unavailable(ep: EPGroup, minimum: str) -> str | None:
    """Why ``torch.distributed._symmetric_memory`` cannot serve ``ep`` (a phrase for the exchanges'
    errors), or None: it needs an NCCL group, CUDA, and a torch that has it (``minimum``, e.g.
    ``"2.8"``, is named in the phrase). Host metadata only."""
    if "nccl" not in ep.backend:
        return f"needs an NCCL group, got backend {ep.backend or 'unknown'!r}"
    if not torch.cuda.is_available():
        return "needs CUDA"
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError:
        return f"needs torch.distributed._symmetric_memory (torch >= {minimum}), torch {torch.__version__} has none"
    return None


def enable_symmetric_memory(group_name: str) -> None:
    """Register the group for symmetric memory once (before its first rendezvous)."""
    import warnings

    import torch.distributed._symmetric_memory as symm

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # no longer needed in newer torch
        if not symm.is_symm_mem_enabled_for_group(group_name):
            symm.enable_symm_mem_for_group(group_name)


def resolve_group(group) -> EPGroup:
    """An :class:`EPGroup` from None (``WORLD``), a ``ProcessGroup`` or a 1-D ``DeviceMesh``.

    Raises:
        ValueError: torch.distributed is not initialised, or the mesh is not 1-D.
        TypeError: ``group`` is something else.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialised (call init_process_group first)")
    mesh = None
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"group: expected a 1-D DeviceMesh (slice the expert dimension, e.g. mesh['ep']), "
                f"got {group.ndim} dimensions"
            )
        mesh, group = group, group.get_group()
    elif group is None:
        group = dist.group.WORLD
    elif not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group: expected None, a ProcessGroup or a 1-D DeviceMesh, got {type(group).__name__}")
    return EPGroup(
        group=group,
        world_size=dist.get_world_size(group),
        rank=dist.get_rank(group),
        mesh=mesh,
        backend=str(dist.get_backend(group)),
    )


def all_to_all(
    x: Tensor,
    out_splits: list[int] | None,
    in_splits: list[int] | None,
    group,
    *,
    out_rows: int | None = None,
    pad_rows: int = 0,
) -> Tensor:
    """Differentiable ``all_to_all_single`` of ``x [N_in, ...]`` -> ``[N_out + pad_rows, ...]``.

    ``in_splits[d]`` rows go to rank ``d``; ``out_splits[s]`` rows come from rank ``s`` (host ints).
    With both None the splits are equal (``N_in / W`` each) and ``out_rows`` (default ``N_in``) sets
    the output size: no host information is needed. ``pad_rows`` zero rows follow the received ones
    in the same buffer (a gather that maps missing rows there needs no copy with a zero row appended).
    """
    return _AllToAll.apply(x, out_splits, in_splits, group, out_rows, pad_rows)


def exchange(out, group) -> tuple[Tensor, Tensor | None]:
    """A blocking exchange of a dispatcher stage's :class:`~moeyard.parallel.common.Outgoing`:
    ``(rows, ids)`` received (``rows`` followed by ``out.pad_rows`` zero rows; ``ids`` None when none
    were sent; sent first)."""
    ids = None if out.ids is None else _a2a(out.ids, None, None, group, None)
    return all_to_all(out.rows, out.out_splits, out.in_splits, group, pad_rows=out.pad_rows), ids


def receive_buffer(x: Tensor, out_splits, out_rows, pad_rows) -> tuple[Tensor, Tensor]:
    """``(buffer, received)`` for an ``all_to_all_single`` of ``x``: ``received`` (the collective's
    output, ``sum(out_splits)`` rows, else ``out_rows``, else ``x``'s) is the leading part of
    ``buffer``, whose ``pad_rows`` trailing rows are zero."""
    rows = sum(out_splits) if out_splits is not None else (x.shape[0] if out_rows is None else out_rows)
    buffer = x.new_empty((rows + pad_rows, *x.shape[1:]))
    if pad_rows:
        buffer[rows:].zero_()
    return buffer, buffer[:rows]


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, out_rows, pad_rows):
        ctx.group, ctx.out_splits, ctx.in_splits, ctx.in_rows = group, out_splits, in_splits, x.shape[0]
        buffer, received = receive_buffer(x, out_splits, out_rows, pad_rows)
        dist.all_to_all_single(received, x.contiguous(), out_splits, in_splits, group=group)
        ctx.received = received.shape[0]
        return buffer

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


def _a2a(x: Tensor, out_splits, in_splits, group, out_rows) -> Tensor:
    out = receive_buffer(x, out_splits, out_rows, 0)[0]
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def all_gather(x: Tensor, group) -> Tensor:
    """Differentiable all-gather along dim 0: ``x [N, ...]`` on every rank -> ``[W * N, ...]``
    (rank-major). Backward: the reduce-scatter (sum) of the gradient."""
    return _AllGather.apply(x, group)


def reduce_scatter(x: Tensor, group) -> Tensor:
    """Differentiable reduce-scatter (sum) along dim 0: ``x [W * N, ...]`` -> ``[N, ...]``, block
    ``rank`` of the sum over ranks. Backward: the all-gather of the gradient."""
    return _ReduceScatter.apply(x, group)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx, dy):
        return _scatter(dy, ctx.group), None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _scatter(x, group)

    @staticmethod
    def backward(ctx, dy):
        return _gather(dy, ctx.group), None


def _gather(x: Tensor, group) -> Tensor:
    """Plain (not differentiable) all-gather along dim 0; integer tensors too."""
    W = dist.get_world_size(group)
    out = x.new_empty((W * x.shape[0], *x.shape[1:]))
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, x.contiguous(), group=group)
    return out


def _scatter(x: Tensor, group) -> Tensor:
    W = dist.get_world_size(group)
    out = x.new_empty((x.shape[0] // W, *x.shape[1:]))
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, x.contiguous(), group=group)
    return out


def gather_ints(x: Tensor, group) -> Tensor:
    """All-gather of a small integer tensor along dim 0 (no autograd)."""
    return _gather(x, group)
