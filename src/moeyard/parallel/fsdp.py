"""Expert parallelism composed with FSDP2 on a 2-D ``(dp, ep)`` mesh.

The layout (torchtitan's ``apply_fsdp`` with ``ep_degree > 1``): the routed experts are split over
``mesh["ep"]`` by :func:`moeyard.parallel.expert_parallel` (DTensors ``Shard(0)``), and each rank's
block is replicated over ``mesh["dp"]`` only, so FSDP shards and reduces the expert weights over
``mesh["dp"]``. Every other parameter (router, shared experts, attention, embeddings) is replicated
over all ``dp * ep`` ranks, each of which sees its own tokens, so FSDP shards and reduces it over the
flattened mesh. LoRA adapters of the experts (``MoE.add_lora``, PEFT's wrappers around a transformers
experts module) hold only their rank's experts' factors (:mod:`moeyard.parallel.lora`), so they go
with the expert weights: sharded and reduced over ``mesh["dp"]``, with their optimizer state. NF4 expert
storage (:func:`moeyard.quantize_experts`) is buffers: each rank keeps its block, FSDP leaves it alone.

Gradient scale: each rank's loss is the mean over its own tokens, FSDP averages the replicated
parameters' gradients over the ``dp * ep`` ranks of the flattened mesh, i.e. the gradient of the
mean of the ranks' losses. A rank's expert block already holds the gradient of the losses of its
whole EP group (the combine's backward brings them back), so the sum over ``dp`` holds all
``dp * ep`` ranks' losses: FSDP averages it over ``dp`` as usual, and the layer's all-reduce hook
(``set_all_reduce_hook``, run on the reduce-scatter's output) divides it by ``ep``. (A gradient
divide factor of ``dp * ep`` would say the same, but torch divides twice by it when ``dp`` is 1 and
the reduce dtype is float64 or float16: its single-rank copy divides after the pre-division.)
"""

from __future__ import annotations

import torch.nn as nn

from .apply import expert_parallel, find_experts
from .common import MOE_SEAM


def fsdp_expert_parallel(
    model: nn.Module,
    mesh,
    *,
    dp_dim: str = "dp",
    ep_dim: str = "ep",
    blocks: tuple | list = (),
    fsdp_kwargs: dict | None = None,
    **ep_kwargs,
) -> nn.Module:
    """Expert parallelism over ``mesh[ep_dim]`` and FSDP2 (``fully_shard``) over the rest; in place,
    returns ``model``.

    Steps: :func:`expert_parallel` ``(model, mesh[ep_dim], **ep_kwargs)`` (skipped when every expert
    layer is already expert parallel over the ranks of ``mesh[ep_dim]``: e.g. split on the meta device
    before its weights were built); then for every expert layer (a ``moeyard.MoE`` or a transformers
    experts module): ``fully_shard`` each child module holding parameters (a ``MoE``'s router and
    shared expert; not its ``lora`` adapters) over the flattened ``(dp, ep)`` mesh, then the layer
    itself (its own expert weights and LoRA adapters) and the PEFT ``ParamWrapper`` chain around a
    transformers experts module (its adapters) over ``mesh[dp_dim]``, their gradients divided by
    ``dp * ep`` in all (see the module docstring); then each module of ``blocks`` (e.g. the decoder
    layers, each its own all-gather) and ``model`` over the flattened mesh.

    Each rank passes its own batch; its loss must be the mean over its own tokens (as with plain
    FSDP), and every rank must run the same number of forward calls. Build the optimizer afterwards.

    Args:
        model: an ``nn.Module`` holding moeyard ``MoE`` layers or transformers experts modules (see
            :func:`expert_parallel`); not yet sharded by FSDP.
        mesh: a 2-D ``DeviceMesh`` with dimensions named ``dp_dim`` and ``ep_dim``, e.g.
            ``init_device_mesh("cuda", (dp, ep), mesh_dim_names=("dp", "ep"))``.
        blocks: submodules of ``model`` (not inside an expert layer) to shard as their own FSDP
            units, children before parents.
        fsdp_kwargs: passed to every ``fully_shard`` call (``mp_policy``, ``reshard_after_forward``,
            ``offload_policy``); not ``mesh``.
        ep_kwargs: passed to :func:`expert_parallel` (``dispatcher``, ``max_tokens``, ``overlap_chunks``, ...).

    Raises:
        TypeError: ``mesh`` is not a ``DeviceMesh``.
        ValueError: ``mesh`` not 2-D or without the named dimensions; ``fsdp_kwargs`` naming ``mesh``;
            ``ep_kwargs`` given for a model already expert parallel, or one split over other ranks
            than ``mesh[ep_dim]``'s; anything :func:`expert_parallel` raises.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh: expected a 2-D DeviceMesh, got {type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim != 2 or dp_dim not in names or ep_dim not in names:
        raise ValueError(
            f"mesh: expected a 2-D DeviceMesh with dimensions {dp_dim!r} and {ep_dim!r}, got "
            f"{mesh.ndim} dimension(s) named {names}"
        )
    kw = dict(fsdp_kwargs or {})
    if "mesh" in kw:
        raise ValueError("fsdp_kwargs: the meshes come from mesh (dp for the experts, the flattened mesh for the rest)")
    dp_mesh = mesh[dp_dim]
    flat = mesh[(dp_dim, ep_dim)]._flatten(f"{dp_dim}_{ep_dim}")
    if not _already_split(model, mesh[ep_dim], ep_kwargs):
        expert_parallel(model, mesh[ep_dim], **ep_kwargs)
    wrappers = _peft_wrappers(model)
    for layer, seam in find_experts(model).values():
        if seam == MOE_SEAM:
            for name, child in layer.named_children():
                if name != "lora" and any(True for _ in child.parameters()):
                    fully_shard(child, mesh=flat, **kw)
        for unit in [layer] + wrappers.get(id(layer), []):
            if not any(True for _ in unit.parameters()):
                continue  # NF4 storage (buffers) under PEFT's wrappers: nothing for FSDP to shard
            fully_shard(unit, mesh=dp_mesh, **kw)
            if mesh[ep_dim].size() > 1:
                unit.set_all_reduce_hook(_divide_by(mesh[ep_dim].size()))
    for block in blocks:
        fully_shard(block, mesh=flat, **kw)
    fully_shard(model, mesh=flat, **kw)
    return model


def param_groups_by_mesh(params) -> list[dict]:
    """Optimizer parameter groups, one per ``DeviceMesh`` of the trainable ``params`` (DTensors after
    :func:`fsdp_expert_parallel`: the experts' weights and adapters on ``mesh["dp"]`` or ``(dp, ep)``,
    the rest on the flattened mesh), plain tensors in one more. An optimizer's foreach (or fused)
    step runs each group's tensors together, and DTensor refuses an op over several meshes ("does not
    support cross-mesh operation"), which is what ``torch.optim.AdamW(model.parameters())`` runs into
    on CUDA, where foreach is the default::

        optimizer = torch.optim.AdamW(param_groups_by_mesh(model.parameters()), lr=1e-4)

    Returns:
        ``[{"params": [...]}, ...]`` in first-seen order (parameters that do not require grad left out).
    """
    groups: dict = {}
    for p in params:
        if p.requires_grad:
            groups.setdefault(getattr(p, "device_mesh", None), []).append(p)
    return [{"params": ps} for ps in groups.values()]


def _already_split(model: nn.Module, ep_mesh, ep_kwargs: dict) -> bool:
    """True when every expert layer of ``model`` is expert parallel over the ranks of ``ep_mesh``; False
    when none is.

    Raises:
        ValueError: some are and some are not, they are split over other ranks, or ``ep_kwargs`` were
            given for layers already split."""
    import torch.distributed as dist

    calls = [getattr(m, seam, None) for m, seam in find_experts(model).values()]
    if not any(calls):
        return False
    ranks = dist.get_process_group_ranks(ep_mesh.get_group())
    if not all(calls) or any(dist.get_process_group_ranks(c.ep.group) != ranks for c in calls):
        raise ValueError(
            f"model: its expert layers must all be expert parallel over mesh's ep ranks {ranks}, "
            "or none (fsdp_expert_parallel then splits them)"
        )
    if ep_kwargs:
        raise ValueError(f"ep_kwargs: the model is already expert parallel; {sorted(ep_kwargs)} cannot change it")
    return True


def _peft_wrappers(model: nn.Module) -> dict[int, list[nn.Module]]:
    """``{id(experts module): [its outermost PEFT ParamWrapper]}`` (the unit holding the chain's adapters)."""
    if not any(hasattr(m, "parameter_name") and hasattr(m, "base_layer") for m in model.modules()):
        return {}
    from ..integrations.peft import wrapper_chains

    return {id(base): chain[:1] for base, chain in wrapper_chains(model)}


def _divide_by(n: int):
    """An FSDP all-reduce hook dividing the reduced gradient by ``n`` in place."""

    def hook(grad):
        grad.div_(n)

    return hook
