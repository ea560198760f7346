"""Expert parallelism (EP) over ``torch.distributed``.

:func:`expert_parallel` splits the routed experts of a :class:`moeyard.MoE` (or of every
transformers experts module running ``experts_implementation="moeyard"``) over a process group or a
1-D ``DeviceMesh``: rank r keeps experts ``[r * E / W, (r + 1) * E / W)``, and each forward sends the
routed rows to the ranks owning their experts and brings the results back. One module per stage:

- :mod:`.comm`: the group and the differentiable collectives;
- :mod:`.all_to_all`, :mod:`.sync_free`, :mod:`.all_gather`: the dispatchers (dispatch + combine, and
  ``EXPERTS_DROP_INVALID``: how the local experts treat the rows of pairs not theirs);
- :mod:`.symm_mem`: ``sync_free``'s NVSHMEM exchange (``exchange="symm_mem"``);
- :mod:`.p2p`: ``sync_free``'s peer-to-peer exchange (``exchange="p2p"``), its row copies in :mod:`.row_copy`,
  its receive layout in :mod:`.p2p_layout`;
- :mod:`.send_order`: what those two exchanges share (the pairs' send order, the autograd around them);
- :mod:`.experts`: dispatch -> local experts (:func:`moeyard.experts`, any backend) -> combine;
- :mod:`.overlap`: ``overlap_chunks=N``: the tokens in N chunks, exchanges in flight during experts;
- :mod:`.apply`: :func:`expert_parallel` (shards the weights, installs the layer's seam),
  :func:`release_buffers` (the symmetric-memory exchanges' buffers, before the group is destroyed);
- :mod:`.lora`: LoRA adapters of the split experts (each rank its experts' factors, PEFT's layout):
  :func:`shard_lora`, :func:`lora_state_dict` (the global factors, to save on rank 0);
- :mod:`.fsdp`: :func:`fsdp_expert_parallel`, composed with FSDP2 on a 2-D ``(dp, ep)`` mesh.

``moeyard bench --ep N`` times them under torchrun (:mod:`moeyard.bench.ep`).

Composing with FSDP2 on a 2-D ``(dp, ep)`` mesh (tested on CPU/gloo at dp = 2 x ep = 2 against one
process on the global batch: losses, every gradient, two optimizer steps)::

    mesh = init_device_mesh("cuda", (dp, ep), mesh_dim_names=("dp", "ep"))
    fsdp_expert_parallel(model, mesh, blocks=model.model.layers, dispatcher="sync_free", max_tokens=T)
    optimizer = torch.optim.AdamW(param_groups_by_mesh(model.parameters()))  # afterwards: one group per mesh
    loss = loss_fn(model(batch_of_this_rank))            # mean over this rank's tokens
    loss.backward(); optimizer.step()

Expert weights are DTensors on the 2-D mesh (``Shard(0)`` over ``ep``, FSDP's shard over ``dp``),
reduced over ``dp`` with a divide factor of ``dp * ep``; every other parameter is sharded and
averaged over the flattened mesh (see :mod:`.fsdp` for why). Without FSDP, gradients of replicated
parameters are each rank's own share; DDP/FSDP reduce them.
"""

from .apply import expert_parallel, find_experts, release_buffers
from .comm import EPGroup
from .common import Dispatched, EPOptions
from .experts import DISPATCHERS, ExpertParallel
from .fsdp import fsdp_expert_parallel, param_groups_by_mesh
from .lora import lora_state_dict, shard_lora

__all__ = [
    "DISPATCHERS",
    "Dispatched",
    "EPGroup",
    "EPOptions",
    "ExpertParallel",
    "expert_parallel",
    "find_experts",
    "fsdp_expert_parallel",
    "lora_state_dict",
    "param_groups_by_mesh",
    "release_buffers",
    "shard_lora",
]
