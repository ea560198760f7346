"""``expert_parallel``: turn a moeyard ``MoE`` or a transformers model's experts modules into their
expert-parallel form, in place."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ..experts.quantized import is_quantized
from .comm import EPGroup, resolve_group
from .common import MOE_SEAM, TRANSFORMERS_SEAM, EPOptions
from .experts import DISPATCHERS, ExpertParallel, check_fp8_dispatch, check_overlap_options
from .sync_free import EXCHANGES, check_exchange


def expert_parallel(
    module: nn.Module,
    group=None,
    *,
    dispatcher: str = "all_to_all",
    capacity_factor: float | None = None,
    max_tokens: int | None = None,
    align: int = 1,
    exchange: str = "auto",
    overlap_chunks: int = 1,
    fp8_dispatch: bool = False,
) -> nn.Module:
    """Split the routed experts of ``module`` over the ranks of ``group``; returns ``module``.

    Every :class:`moeyard.MoE` in ``module`` (itself included) and every transformers experts module
    (``gate_up_proj`` or ``up_proj`` and ``down_proj`` of shape ``[E, ...]``, running
    ``experts_implementation="moeyard"``) is changed in place: rank r keeps experts
    ``[r * E / W, (r + 1) * E / W)`` (each ``[E, ...]`` parameter is replaced by a new
    ``nn.Parameter`` of the local block: build the optimizer afterwards) and its forward exchanges
    tokens with the other ranks. The router, shared experts and everything else stay replicated.

    LoRA adapters (``MoE.add_lora`` before or after, PEFT ``target_parameters`` adapters on the
    transformers experts' weights) are split with the experts: each rank keeps its experts' factors in
    PEFT's layout, ``lora_A [r*E_l, in]``, ``lora_B [out, r*E_l]``, under the same names
    (:mod:`moeyard.parallel.lora`: :func:`~moeyard.parallel.lora.shard_lora`; PEFT's wrappers are switched
    to :func:`moeyard.integrations.peft.fuse_lora`); save them gathered with
    :func:`~moeyard.parallel.lora.lora_state_dict`. Quantised expert weights
    (:func:`moeyard.quantize_experts`, before or after) keep only this rank's block of their storage
    (``NF4Experts.select``; plain modules also on a mesh).

    Each rank passes its own tokens (any count, 0 included; every rank must call the layer) and gets
    its own outputs; gradients flow back through both exchanges. Local expert weights get the
    gradients of all ranks' tokens routed to them; replicated parameters (the router) get only this
    rank's share: the data-parallel wrapper (DDP, FSDP) reduces them as it reduces any replicated
    parameter. The layer's ``aux_loss`` is computed from this rank's tokens.

    Args:
        module: an ``nn.Module`` holding moeyard ``MoE`` layers or transformers experts modules.
        group: None (the default process group), a ``ProcessGroup`` or a 1-D ``DeviceMesh``. With a
            mesh the expert weights become DTensors ``Shard(0)`` on it, so ``torch.distributed.checkpoint``
            saves the global ``[E, ...]`` tensors and loads them at any EP size.
        dispatcher: ``all_to_all`` (exact sizes; one host sync per layer), ``sync_free`` (static
            worst-case buffers, no host sync) or ``all_gather`` (gather all tokens, reduce-scatter).
            All three give the same results (``sync_free`` with ``capacity_factor`` may drop pairs).
        capacity_factor: ``sync_free`` only; see :mod:`moeyard.parallel.sync_free`.
        max_tokens: ``sync_free`` / ``all_gather``: static bound on any rank's token count.
        align: ``sync_free`` only: pad each local expert's received rows to a multiple of this.
        exchange: ``sync_free`` only: ``all_to_all`` (worst-case blocks in equal splits; portable),
            ``symm_mem`` (only the routed rows, through NVSHMEM symmetric memory: CUDA, NCCL, at
            most 32 ranks; see :mod:`moeyard.parallel.symm_mem`), ``p2p`` (only the routed rows,
            copied by kernels straight from and into the peers' symmetric buffers and laid out
            expert-major on the way: CUDA, NCCL; see :mod:`moeyard.parallel.p2p`) or ``auto``
            (``p2p`` where it can run and ``overlap_chunks == 1``, else ``all_to_all``;
            ``benchmarks/NOTES.md`` rounds 33, 34).
        overlap_chunks: ``all_to_all`` / ``sync_free``: split each call's tokens into this many chunks
            and keep one chunk's exchanges in flight (``async_op=True``) while another chunk's experts
            run, forward and backward (:mod:`moeyard.parallel.overlap`); 1 (default): one blocking
            exchange each way. Same results up to float rounding; ``sync_free`` sizes each chunk's
            blocks at ``ceil(T_max / overlap_chunks)`` tokens (no host sync added). Not with
            ``capacity_factor`` (capacity would then apply per chunk), nor with ``exchange="symm_mem"``
            or ``"p2p"`` (their exchanges are kernels on the current stream, not async collectives).
        fp8_dispatch: ``all_to_all`` and ``all_gather`` dispatchers, ``overlap_chunks == 1``: the dispatch
            carries each token row as e4m3 with one power-of-two scale (:mod:`moeyard.parallel.fp8_rows`:
            ``H + 16`` bytes a row against bf16's ``2H``); the combine and every backward exchange stay in
            the compute dtype. Under the ``fp8_rowwise`` recipe the forward is unchanged (the experts' own
            cast gives the same bytes); without a recipe the experts see e4m3-rounded rows.

    On NCCL call ``torch.cuda.set_device(local_rank)`` first (the shape check's ``all_gather_object``
    and every exchange use the current device) and keep the layers' tensors on that device.

    Raises:
        ValueError: unknown ``dispatcher``; bad ``capacity_factor``, ``max_tokens``, ``align`` or
            ``exchange`` (``symm_mem`` where it cannot run: not CUDA, not NCCL, no NVSHMEM, W > 32;
            ``p2p``: not CUDA, not NCCL); ``fp8_dispatch`` with another dispatcher or with
            ``overlap_chunks > 1``; ``overlap_chunks`` (not a positive int, or > 1 with
            ``all_gather``, ``capacity_factor`` or ``exchange`` ``symm_mem`` / ``p2p``);
            ``group`` not initialised, a mesh not 1-D, or a world size not dividing E; ``module`` with
            no experts, already expert parallel, a transformers experts module not running
            ``"moeyard"``, or expert shapes that differ across ranks (checked with one all-gather);
            expert weights on another device type than the mesh's (the meta device is accepted: a
            model built there is split before its weights exist); quantised expert storage without
            ``select`` (quantise after ``expert_parallel`` instead); a LoRA adapter covering neither E
            nor E / W experts.
        TypeError: ``module`` is not an ``nn.Module``, ``group`` of the wrong kind, ``fp8_dispatch`` not a bool.
    """
    _check_options(dispatcher, capacity_factor, max_tokens, align, exchange)
    check_overlap_options(overlap_chunks, dispatcher, capacity_factor, exchange)
    check_fp8_dispatch(fp8_dispatch, dispatcher, overlap_chunks)
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected an nn.Module, got {type(module).__name__}")
    targets = find_experts(module)
    if not targets:
        raise ValueError(
            "module: no moeyard.MoE or transformers experts module (gate_up_proj/up_proj and "
            "down_proj of shape [E, ...]) found"
        )
    ep = resolve_group(group)
    _check_same_on_every_rank(targets, ep)  # first: the checks below then fail alike on every rank
    check_exchange(ep, EPOptions(num_experts=ep.world_size, dispatcher=dispatcher, exchange=exchange))
    for name, (m, seam) in targets.items():
        if getattr(m, seam, None) is not None:
            raise ValueError(f"module: {name or type(m).__name__} is already expert parallel")
        E = _num_experts(m)
        if E % ep.world_size:
            raise ValueError(
                f"group: its size {ep.world_size} does not divide num_experts={E} of {name or type(m).__name__}"
            )
        for attr, q in _quantized_experts(m):
            if not callable(getattr(q, "select", None)):
                raise ValueError(
                    f"module: {name or type(m).__name__}.{attr} is {type(q).__name__} storage, which "
                    "cannot keep one rank's experts; quantise after expert_parallel"
                )
        if ep.mesh is not None and m.down_proj.device.type not in (ep.mesh.device_type, "meta"):
            raise ValueError(
                f"group: a {ep.mesh.device_type} DeviceMesh, but the expert weights of "
                f"{name or type(m).__name__} are on {m.down_proj.device}; move the module first"
            )
    for m, seam in targets.values():
        E = _num_experts(m)
        _shard(m, E, ep)
        options = EPOptions(
            num_experts=E,
            dispatcher=dispatcher,
            capacity_factor=capacity_factor,
            max_tokens=max_tokens,
            align=align,
            exchange=exchange,
            overlap_chunks=overlap_chunks,
            fp8_dispatch=fp8_dispatch,
        )
        setattr(m, seam, ExpertParallel(ep, options))
    from .lora import shard_lora

    shard_lora(module)
    return module


def find_experts(module: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """``{qualified name: (module, seam attribute)}`` of the MoE layers and transformers experts
    modules in ``module``.

    Raises:
        ValueError: a transformers experts module whose implementation is not ``"moeyard"``.
    """
    from ..layer import MoE

    found = {}
    for name, m in module.named_modules():
        if isinstance(m, MoE):
            found[name] = (m, MOE_SEAM)
        elif (
            hasattr(m, "has_gate")
            and _is_3d(getattr(m, "down_proj", None))
            and _is_3d(getattr(m, "gate_up_proj" if m.has_gate else "up_proj", None))
        ):
            impl = getattr(getattr(m, "config", None), "_experts_implementation", None)
            if impl != "moeyard":
                raise ValueError(
                    f"module: {name} runs experts_implementation={impl!r}; expert parallelism "
                    "needs 'moeyard' (model.set_experts_implementation('moeyard'))"
                )
            found[name] = (m, TRANSFORMERS_SEAM)
    return found


def _is_3d(p) -> bool:
    """A 3-D tensor, or 3-D quantised expert storage (:class:`moeyard.quant.NF4Experts`)."""
    return (isinstance(p, torch.Tensor) and p.dim() == 3) or (is_quantized(p) and len(p.shape) == 3)


def _num_experts(m: nn.Module) -> int:
    return m.down_proj.shape[0]


def _expert_params(m: nn.Module, E: int) -> list[tuple[str, nn.Parameter]]:
    """The module's own ``[E, ...]`` parameters (expert weights and biases; not the router's)."""
    return [(n, p) for n, p in m.named_parameters(recurse=False) if p.dim() >= 2 and p.shape[0] == E]


def _quantized_experts(m: nn.Module) -> list[tuple[str, nn.Module]]:
    """The module's quantised expert weights (submodules such as :class:`moeyard.quant.NF4Experts`)."""
    return [(n, q) for n, q in m.named_children() if is_quantized(q)]


def _shard(m: nn.Module, E: int, ep: EPGroup) -> None:
    """Keep this rank's block of every ``[E, ...]`` parameter (a DTensor ``Shard(0)`` on a mesh) and of
    every quantised expert weight (its own storage, ``select``: a plain module on a mesh too)."""
    El = E // ep.world_size
    for name, q in _quantized_experts(m):
        setattr(m, name, q.select(ep.rank * El, (ep.rank + 1) * El))
    for name, p in _expert_params(m, E):
        local = p.detach()[ep.rank * El : (ep.rank + 1) * El].clone()
        if ep.mesh is not None:
            from torch.distributed.tensor import DTensor, Shard

            local = DTensor.from_local(local, ep.mesh, [Shard(0)], run_check=False)
        setattr(m, name, nn.Parameter(local, requires_grad=p.requires_grad))


def _check_same_on_every_rank(targets: dict, ep: EPGroup) -> None:
    """One all-gather of the layers' names and expert-parameter shapes: a mismatch raises on every
    rank (instead of a hang in the first exchange)."""
    mine = [
        (
            name,
            type(m).__name__,
            getattr(m, seam, None) is not None,
            [(n, tuple(p.shape), str(p.dtype)) for n, p in _expert_params(m, _num_experts(m))]
            + [(n, tuple(q.shape), str(q.dtype), type(q).__name__) for n, q in _quantized_experts(m)],
        )
        for name, (m, seam) in targets.items()
    ]
    everyone = [None] * ep.world_size
    dist.all_gather_object(everyone, mine, group=ep.group)
    for r, theirs in enumerate(everyone):
        if theirs != mine:
            raise ValueError(
                f"module: expert layers differ between rank {ep.rank} and rank {r} of group: "
                f"{_first_difference(mine, theirs)}"
            )


def _first_difference(a: list, b: list) -> str:
    for x, y in zip(a, b, strict=False):  # the lengths may differ: said below
        if x != y:
            return f"{x} vs {y}"
    return f"{len(a)} vs {len(b)} expert layers"


def _check_options(dispatcher, capacity_factor, max_tokens, align, exchange) -> None:
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"dispatcher: expected one of {list(DISPATCHERS)}, got {dispatcher!r}")
    if capacity_factor is not None:
        if dispatcher != "sync_free":
            raise ValueError(
                f"capacity_factor: only the sync_free dispatcher drops pairs, got dispatcher={dispatcher!r}"
            )
        if (
            isinstance(capacity_factor, bool)
            or not isinstance(capacity_factor, (int, float))
            or not capacity_factor > 0
        ):
            raise ValueError(f"capacity_factor: expected a positive number or None, got {capacity_factor!r}")
    if max_tokens is not None:
        if dispatcher == "all_to_all":
            raise ValueError(
                "max_tokens: the all_to_all dispatcher sizes its exchanges exactly; "
                "use sync_free or all_gather for a static bound"
            )
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens: expected a positive int or None, got {max_tokens!r}")
    if isinstance(align, bool) or not isinstance(align, int) or align < 1:
        raise ValueError(f"align: expected a positive int, got {align!r}")
    if align != 1 and dispatcher != "sync_free":
        raise ValueError(
            f"align: only the sync_free dispatcher places received rows itself, got dispatcher={dispatcher!r}"
        )
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange: expected one of {list(EXCHANGES)}, got {exchange!r}")
    if exchange != "auto" and dispatcher != "sync_free":
        raise ValueError(
            f"exchange: only the sync_free dispatcher has a choice of exchange, got dispatcher={dispatcher!r}"
        )


def release_buffers(group=None) -> None:
    """Free the symmetric buffers that the ``p2p`` and ``symm_mem`` exchanges of ``sync_free`` keep for
    the process (a collective over ``group``, default the world: call on every rank). Waits for the
    current CUDA device's queued work, then a barrier of ``group``, so no peer still reads or writes
    them. Call it before ``torch.distributed.destroy_process_group()`` (symmetric memory freed at
    interpreter exit, after the group is gone, can crash the process) or to give their memory back;
    a CUDA graph captured over them must not be replayed afterwards. No-op for the other exchanges.

    Raises:
        ValueError: ``group`` not initialised (as :func:`expert_parallel`)."""
    from . import p2p, symm_mem

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    dist.barrier(group=resolve_group(group).group)
    p2p.release_buffers()
    symm_mem.release_buffers()
