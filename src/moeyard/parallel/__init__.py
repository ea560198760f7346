"""Expert parallelism (EP) over ``torch.distributed``.

:func:`expert_parallel` splits the routed experts of a :class:`moeyard.MoE` (or of every
transformers experts module running ``experts_implementation="moeyard"``) over a process group or a
1-D ``DeviceMesh``: rank r keeps experts ``[r * E / W, (r + 1) * E / W)``, and each forward sends the
routed rows to the ranks owning their experts and brings the results back. One module per stage:

- :mod:`.comm`: the group and the differentiable collectives;
- :mod:`.all_to_all`, :mod:`.sync_free`, :mod:`.all_gather`: the dispatchers (dispatch + combine);
- :mod:`.experts`: dispatch -> local experts (:func:`moeyard.experts`, any backend) -> combine;
- :mod:`.apply`: :func:`expert_parallel` (shards the weights, installs the layer's seam);
- :mod:`.bench`: ``moeyard bench --ep N`` under torchrun.

Composing with FSDP2 on a 2-D ``(data, expert)`` mesh (not tested here: no multi-GPU machine)::

    mesh = init_device_mesh("cuda", (dp, ep), mesh_dim_names=("dp", "ep"))
    expert_parallel(model, mesh["ep"])                 # expert weights: DTensor Shard(0) on "ep"
    # expert weights are replicated over "dp" only: shard/reduce them over mesh["dp"]
    # (fully_shard(layer_experts, mesh=mesh["dp"], shard_placement_fn=lambda p: Shard(1)) where they
    # are their own module); every other parameter is replicated over all dp * ep ranks (each EP rank
    # sees different tokens): shard/reduce it over the flattened mesh, mesh["dp", "ep"]._flatten().

Gradients of replicated parameters are each rank's own share; DDP/FSDP reduce them.
"""
from .apply import expert_parallel, find_experts
from .fsdp import fsdp_expert_parallel
from .comm import EPGroup
from .common import Dispatched, EPOptions
from .experts import DISPATCHERS, ExpertParallel

__all__ = ["DISPATCHERS", "Dispatched", "EPGroup", "EPOptions", "ExpertParallel", "expert_parallel", "fsdp_expert_parallel",
           "find_experts"]
