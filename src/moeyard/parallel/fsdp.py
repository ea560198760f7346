"""Expert parallelism composed with FSDP2 on a 2-D ``(dp, ep)`` mesh.

The layout (torchtitan's ``apply_fsdp`` with ``ep_degree > 1``): the routed experts are split over
``mesh["ep"]`` by :func:`moeyard.parallel.expert_parallel` (DTensors ``Shard(0)``), and each rank's
block is replicated over ``mesh["dp"]`` only, so FSDP shards and reduces the expert weights over
``mesh["dp"]``. Every other parameter (router, shared experts, attention, embeddings) is replicated
over all ``dp * ep`` ranks, each of which sees its own tokens, so FSDP shards and reduces it over the
flattened mesh.

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

from .apply import MOE_SEAM, expert_parallel, find_experts


def fsdp_expert_parallel(model: nn.Module, mesh, *, dp_dim: str = "dp", ep_dim: str = "ep",
                         blocks: tuple | list = (), fsdp_kwargs: dict | None = None, **ep_kwargs) -> nn.Module:
    """Expert parallelism over ``mesh[ep_dim]`` and FSDP2 (``fully_shard``) over the rest; in place,
    returns ``model``.

    Steps: :func:`expert_parallel` ``(model, mesh[ep_dim], **ep_kwargs)``; then for every expert layer
    (a ``moeyard.MoE`` or a transformers experts module): ``fully_shard`` each child module holding
    parameters (a ``MoE``'s router and shared expert) over the flattened ``(dp, ep)`` mesh, then the
    layer itself (its own expert weights) over ``mesh[dp_dim]``, its gradients divided by ``dp * ep``
    in all (see the module docstring); then each module of ``blocks`` (e.g. the decoder layers,
    each its own all-gather) and ``model`` over the flattened mesh.

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
            anything :func:`expert_parallel` raises.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh: expected a 2-D DeviceMesh, got {type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim != 2 or dp_dim not in names or ep_dim not in names:
        raise ValueError(f"mesh: expected a 2-D DeviceMesh with dimensions {dp_dim!r} and {ep_dim!r}, got "
                         f"{mesh.ndim} dimension(s) named {names}")
    kw = dict(fsdp_kwargs or {})
    if "mesh" in kw:
        raise ValueError("fsdp_kwargs: the meshes come from mesh (dp for the experts, the flattened mesh for the rest)")
    dp_mesh = mesh[dp_dim]
    flat = mesh[(dp_dim, ep_dim)]._flatten(f"{dp_dim}_{ep_dim}")
    expert_parallel(model, mesh[ep_dim], **ep_kwargs)
    for layer, seam in find_experts(model).values():
        if seam == MOE_SEAM:
            for child in layer.children():
                if any(True for _ in child.parameters()):
                    fully_shard(child, mesh=flat, **kw)
        fully_shard(layer, mesh=dp_mesh, **kw)
        if mesh[ep_dim].size() > 1:
            layer.set_all_reduce_hook(_divide_by(mesh[ep_dim].size()))
    for block in blocks:
        fully_shard(block, mesh=flat, **kw)
    fully_shard(model, mesh=flat, **kw)
    return model


def _divide_by(n: int):
    """An FSDP all-reduce hook dividing the reduced gradient by ``n`` in place."""
    def hook(grad):
        grad.div_(n)
    return hook
