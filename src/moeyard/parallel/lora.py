"""LoRA adapters of expert-parallel experts: each rank keeps its own experts' factors, in PEFT's layout.

One process (PEFT >= 0.17 ``target_parameters``, :class:`moeyard.experts.lora.LoRAAdapter`): an
``[E, out, in]`` projection's adapter is ``lora_A [r*E, in]`` (row ``e*r + j``: expert-major) and
``lora_B [out, r*E]`` (column ``j*E + e``: rank-major). Under expert parallelism rank p of W owns
experts ``[p*E_l, (p+1)*E_l)``, ``E_l = E / W``, and keeps

- ``lora_A[p*r*E_l:(p+1)*r*E_l]``: its rows, ``[r*E_l, in]`` (contiguous in the global factor);
- ``lora_B.view(out, r, E)[:, :, p*E_l:(p+1)*E_l]`` as ``[out, r*E_l]`` (column ``j*E_l + e``),

which is exactly the adapter PEFT creates for an ``[E_l, out, in]`` parameter, under the same attribute
and state-dict names, so the local experts train it through the fused kernels unchanged. The factors
are plain tensors, also on a ``DeviceMesh``: a rank's ``lora_B`` columns are ``r`` separate column
ranges of the global factor, which no ``DTensor`` placement that ``torch.distributed.checkpoint``
writes can describe (a ``_StridedShard`` is rejected there as overlapping chunks).

- :func:`shard_lora`: keep this rank's block of every adapter on expert-parallel experts that still
  covers all E experts (called by :func:`moeyard.parallel.expert_parallel` and ``MoE.add_lora``; call it
  after ``peft.get_peft_model`` on an already expert-parallel model), and let ``load_state_dict`` take
  the global factors (this rank's block is copied).
- :func:`lora_state_dict`: every LoRA factor of a model in the global layout (expert adapters gathered
  over their group, FSDP's shards gathered), for ``PeftModel.save_pretrained(dir, state_dict=...)`` or
  ``torch.save`` on rank 0; it loads into a model at any EP size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from .common import MOE_SEAM, TRANSFORMERS_SEAM

Tensor = torch.Tensor


def shard_factors(
    lora_A: Tensor, lora_B: Tensor, rank: int, num_experts: int, ep_rank: int, world_size: int
) -> tuple[Tensor, Tensor]:
    """``(lora_A [r*E_l, in], lora_B [out, r*E_l])``: rank ``ep_rank``'s block (copies) of the global
    ``lora_A [r*E, in]``, ``lora_B [out, r*E]`` (module docstring)."""
    El = num_experts // world_size
    A = lora_A[ep_rank * rank * El : (ep_rank + 1) * rank * El].clone()
    B = lora_B.view(lora_B.shape[0], rank, num_experts)[:, :, ep_rank * El : (ep_rank + 1) * El]
    return A, B.reshape(lora_B.shape[0], rank * El).clone()


def gather_factor(t: Tensor, which: str, rank: int, group, world_size: int) -> Tensor:
    """The global factor from every rank's block ``t``: ``which="A"``: ``[r*E_l, in]`` blocks ->
    ``[r*E, in]``; ``"B"``: ``[out, r*E_l]`` blocks -> ``[out, r*E]`` (module docstring). A collective
    over ``group`` (one all-gather; on NCCL ``t`` must be on this process's CUDA device)."""
    if world_size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    if which == "A":
        return torch.cat(parts)
    out = t.shape[0]
    return torch.cat([b.view(out, rank, -1) for b in parts], dim=2).reshape(out, -1)  # [out, r, E] rank-major


@dataclass(frozen=True)
class ExpertAdapter:
    """One LoRA adapter of an expert-parallel projection.

    Attributes:
        owner: the module holding it: a :class:`moeyard.experts.lora.LoRAAdapter`, or a PEFT ``ParamWrapper``.
        name: the PEFT adapter name, or None for a ``LoRAAdapter``.
        rank: r. call: the layer's :class:`moeyard.parallel.ExpertParallel`.
    """

    owner: nn.Module
    name: str | None
    rank: int
    call: object

    @property
    def lora_A(self) -> nn.Linear:
        return self.owner.lora_A if self.name is None else self.owner.lora_A[self.name]

    @property
    def lora_B(self) -> nn.Linear:
        return self.owner.lora_B if self.name is None else self.owner.lora_B[self.name]

    @property
    def layout(self) -> tuple[int, int, int, int]:
        """``(E, E_l, ep rank, W)``."""
        ep, E = self.call.ep, self.call.num_experts
        return E, E // ep.world_size, ep.rank, ep.world_size


def expert_adapters(module: nn.Module) -> list[ExpertAdapter]:
    """The LoRA adapters of every expert-parallel layer in ``module``: a ``MoE``'s ``lora`` and the PEFT
    ``ParamWrapper`` adapters on a transformers experts module's weights."""
    from ..layer import MoE

    found, layers = [], {}
    for m in module.modules():
        call = getattr(m, MOE_SEAM if isinstance(m, MoE) else TRANSFORMERS_SEAM, None)
        if call is None:
            continue
        layers[id(m)] = call
        if isinstance(m, MoE):
            found += [ExpertAdapter(a, None, a.rank, call) for a in (m.lora or {}).values()]
    if not layers or not _peft_installed():
        return found
    from ..integrations.peft import lora_key, wrapper_chains

    for base, chain in wrapper_chains(module):
        call = layers.get(id(base))
        if call is not None:
            found += [
                ExpertAdapter(w, name, w.r[name], call)
                for w in chain
                if lora_key(w.parameter_name)
                for name in w.lora_A
            ]
    return found


def _peft_installed() -> bool:
    try:
        import peft.tuners.lora.layer  # noqa: F401
    except ImportError:
        return False
    return True


def shard_lora(module: nn.Module) -> int:
    """Keep this rank's block (module docstring) of every LoRA adapter on the expert-parallel layers of
    ``module`` that still covers all E experts, in place: each factor becomes a new ``nn.Parameter``
    (build the optimizer afterwards), the adapter's ``num_experts`` becomes ``E / W``. Every adapter's
    factors then also load from a state dict holding the global ones (``load_state_dict`` copies this
    rank's block), and PEFT's wrappers around those experts are switched to
    :func:`moeyard.integrations.peft.fuse_lora`. Idempotent; no collective.

    Call it after ``peft.get_peft_model`` on a model that is already expert parallel (PEFT sizes its
    adapters from the weights: E_l experts on a process group, where this only adds the loading hooks,
    all E on a ``DeviceMesh``, whose weights are DTensors of the global shape).

    Returns:
        The number of adapters sharded here.
    Raises:
        ValueError: an adapter covering neither E nor E / W experts.
    """
    adapters = expert_adapters(module)
    count = 0
    for owner in {id(a.owner): a.owner for a in adapters}.values():
        mine = [a for a in adapters if a.owner is owner]
        E, El, p, W = mine[0].layout
        if owner.num_experts not in (E, El):
            raise ValueError(
                f"module: a LoRA adapter of {owner.num_experts} experts on an expert-parallel layer of "
                f"{E} experts over {W} ranks (expected {E} or {El})"
            )
        for a in mine:
            if owner.num_experts != El:
                _replace_factors(a, *shard_factors(a.lora_A.weight.detach(), a.lora_B.weight.detach(), a.rank, E, p, W))
                count += 1
            _add_load_hooks(a)
        owner.num_experts = El
    if any(a.name is not None for a in adapters):
        from ..integrations.peft import fuse_lora

        fuse_lora(module)
    return count


def _replace_factors(a: ExpertAdapter, A: Tensor, B: Tensor) -> None:
    for linear, t in ((a.lora_A, A), (a.lora_B, B)):
        linear.weight = nn.Parameter(t, requires_grad=linear.weight.requires_grad)
    a.lora_A.out_features = a.lora_B.in_features = A.shape[0]


def _add_load_hooks(a: ExpertAdapter) -> None:
    """A ``load_state_dict`` pre-hook on each factor's ``nn.Linear``: a global factor in the incoming state
    dict is replaced by this rank's block (a local one loads as is)."""
    E, El, p, W = a.layout
    if W == 1:
        return
    r = a.rank
    for linear, which in ((a.lora_A, "A"), (a.lora_B, "B")):
        if getattr(linear, "_moeyard_ep_lora_hook", None) is not None:
            continue

        def hook(mod, state_dict, prefix, *args, which=which):
            key = prefix + "weight"
            t = state_dict.get(key)
            if not isinstance(t, Tensor) or hasattr(t, "to_local"):
                return
            glob = (r * E, mod.in_features) if which == "A" else (mod.out_features, r * E)
            if tuple(t.shape) == glob:  # (load_state_dict hands its hooks a copy of the user's dict)
                if which == "A":
                    state_dict[key] = t[p * r * El : (p + 1) * r * El]
                else:
                    state_dict[key] = t.reshape(glob[0], r, E)[:, :, p * El : (p + 1) * El].reshape(glob[0], r * El)

        linear._moeyard_ep_lora_hook = linear.register_load_state_dict_pre_hook(hook)


def lora_state_dict(
    module: nn.Module, *, rank0_only: bool = True, device: torch.device | str = "cpu"
) -> dict[str, Tensor]:
    """Every LoRA factor of ``module`` (parameters with a ``lora_``-prefixed name component: moeyard's
    ``lora.<target>.lora_A.weight``, PEFT's ``...lora_A.<adapter>.weight``) in the global layout, under
    its ``state_dict`` key: the expert-parallel adapters gathered over their group into ``[r*E, in]`` /
    ``[out, r*E]``, FSDP's sharded parameters gathered whole (``DTensor.full_tensor``), the others as
    they are; copied to ``device``.

    Collective: every rank of the default group calls it (one or two collectives per factor, in the
    same order everywhere); the factors travel one at a time on their own device. Save on rank 0::

        sd = lora_state_dict(model)                           # every rank
        if dist.get_rank() == 0:
            model.save_pretrained(path, state_dict=sd)        # PEFT; or torch.save(sd, path)

    The result loads at any EP size: ``PeftModel.from_pretrained`` then ``expert_parallel``, or
    ``load_state_dict`` into an expert-parallel model (:func:`shard_lora`'s hooks keep each rank's block).

    Args:
        rank0_only: True (default): ranks other than global rank 0 return ``{}``.
        device: where the returned tensors live.
    """
    local = {}
    for a in expert_adapters(module):
        local[id(a.lora_A.weight)] = (a, "A")
        local[id(a.lora_B.weight)] = (a, "B")
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    out = {}
    for name, p in module.named_parameters():
        if not any(part.startswith("lora_") for part in name.split(".")):
            continue
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        if id(p) in local:
            a, which = local[id(p)]
            t = gather_factor(t, which, a.rank, a.call.ep.group, a.call.ep.world_size)
        if keep:
            out[name] = t.to(device, copy=True)  # never the parameter itself
    return out
