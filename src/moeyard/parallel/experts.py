"""The expert-parallel experts call: dispatch -> local experts -> combine.

:class:`ExpertParallel` is what :func:`moeyard.parallel.expert_parallel` installs on a layer: a
callable with the signature of :func:`moeyard.experts`, called with the layer's local expert weights
(plain tensors or DTensors sharded on dim 0) instead of :func:`moeyard.experts` itself.
"""

from __future__ import annotations

import torch

from ..checks import check_float, check_ids_on_host, check_topk, invalid_ids
from ..experts import experts
from . import all_gather, all_to_all, sync_free
from .comm import EPGroup, check_device
from .common import EPOptions, local_experts
from .overlap import pipelined

Tensor = torch.Tensor
DISPATCHERS = {"all_to_all": all_to_all, "sync_free": sync_free, "all_gather": all_gather}
REPR_DEFAULTS = {"capacity_factor": None, "max_tokens": None, "align": 1, "exchange": "auto", "overlap_chunks": 1}


def to_local(t):
    """A DTensor's local shard; anything else as is."""
    return t.to_local() if hasattr(t, "to_local") else t


class ExpertParallel:
    """The routed experts over an expert-parallel group.

    Attributes:
        ep: the :class:`EPGroup`. options: the :class:`EPOptions`.
        dropped: after a call, ``[]`` int64 device tensor: this rank's pairs not computed (over the
            ``sync_free`` capacity); None for the lossless dispatchers. Never read back here.
    """

    def __init__(self, ep: EPGroup, options: EPOptions):
        """Raises ValueError when ``options.exchange`` cannot run on ``ep`` (``symm_mem`` off
        CUDA/NCCL/NVSHMEM) or ``overlap_chunks`` cannot run with the options
        (:func:`check_overlap_options`)."""
        self.ep, self.options = ep, options
        self.dispatcher = DISPATCHERS[options.dispatcher]
        check_overlap_options(options.overlap_chunks, options.dispatcher, options.capacity_factor, options.exchange)
        check_fp8_dispatch(options.fp8_dispatch, options.dispatcher, options.overlap_chunks)
        if options.dispatcher == "sync_free":
            sync_free.check_exchange(ep, options)
        self.dropped: Tensor | None = None

    @property
    def num_experts(self) -> int:
        """E, experts over all ranks."""
        return self.options.num_experts

    def __call__(
        self,
        hidden_states: Tensor,
        topk_ids: Tensor,
        topk_weights: Tensor,
        gate_up_proj: Tensor,
        down_proj: Tensor,
        *,
        drop_invalid: bool = False,
        check_ids: bool = True,
        **kwargs,
    ) -> Tensor:
        """As :func:`moeyard.experts`, with ``topk_ids [T, K]`` global ids in ``[0, E)`` and the local
        weights ``gate_up_proj [E_l, 2I, H]``, ``down_proj [E_l, H, I]`` (or their DTensors); the
        other keyword arguments go to the local :func:`moeyard.experts` call (DTensors made local).

        LoRA adapters (``lora=``) are this rank's block in PEFT's layout, ``lora_A [r*E_l, in]``,
        ``lora_B [out, r*E_l]`` (:mod:`moeyard.parallel.lora`); their gradients are those of every
        rank's tokens routed to the local experts.

        Collective: every rank of the group must call it (with any T, 0 included).

        Returns:
            ``[T, H]`` in ``hidden_states.dtype``, differentiable w.r.t. ``hidden_states``,
            ``topk_weights``, the local weights and the LoRA factors.
        Raises:
            ValueError, TypeError: as :func:`moeyard.experts`; weights that are not this rank's
            block of ``E / W`` experts; LoRA adapters covering other than E_l experts (their
            ``ExpertLoRA.num_experts``: e.g. all E, added after :func:`expert_parallel` and not
            sharded); on an NCCL group, ``hidden_states`` off this process's current CUDA device.
            Raised before any collective.
        """
        check_device(hidden_states.device, self.ep.backend)
        E, El = self.options.num_experts, local_experts(self.options, self.ep)
        check_local_lora(kwargs.get("lora"), E, El)
        w_up, w_down = to_local(gate_up_proj), to_local(down_proj)
        kwargs = {k: to_local(v) for k, v in kwargs.items()}
        if w_up.shape[0] != El or w_down.shape[0] != El:
            raise ValueError(
                f"gate_up_proj: expected this rank's block of {El} experts (E={E} over "
                f"{self.ep.world_size} ranks), got {w_up.shape[0]}"
            )
        check_float("hidden_states", hidden_states, dim=2)
        check_topk(topk_ids, topk_weights, hidden_states.shape[0], E, hidden_states.device)
        bad = None
        if check_ids and not drop_invalid and not check_ids_on_host(topk_ids, E):
            bad = invalid_ids(topk_ids, E).any(1, keepdim=True)  # accelerator: NaN rows, as moeyard.experts

        def compute(d):
            return experts(
                d.rows,
                d.topk_ids,
                d.topk_weights,
                w_up,
                w_down,
                drop_invalid=self.dispatcher.EXPERTS_DROP_INVALID,
                **kwargs,
            )

        weights = topk_weights.to(hidden_states.dtype)
        if self.options.overlap_chunks > 1:
            out, self.dropped = pipelined(
                self.dispatcher, hidden_states, topk_ids, weights, self.ep, self.options, compute
            )
        else:
            d = self.dispatcher.dispatch(hidden_states, topk_ids, weights, self.ep, self.options)
            out = self.dispatcher.combine(compute(d), d)
            self.dropped = d.dropped
        return out if bad is None else out.masked_fill(bad, float("nan"))

    def shard_lora(self, module) -> None:
        """Keep this rank's block of the LoRA adapters of ``module`` (a layer this call is installed on)
        that still cover all E experts: what ``MoE.add_lora`` calls for adapters added after
        :func:`moeyard.parallel.expert_parallel` (:func:`moeyard.parallel.lora.shard_lora`)."""
        from .lora import shard_lora

        shard_lora(module)

    def __repr__(self) -> str:
        o = self.options
        extra = "".join(f", {k}={getattr(o, k)}" for k, default in REPR_DEFAULTS.items() if getattr(o, k) != default)
        return (
            f"ExpertParallel(dispatcher={o.dispatcher}, num_experts={o.num_experts}, "
            f"world_size={self.ep.world_size}, rank={self.ep.rank}{extra})"
        )


def check_local_lora(lora, E: int, El: int) -> None:
    """Raise ValueError, before any collective, when an adapter of ``lora`` says it covers other than this
    rank's ``El`` experts (``ExpertLoRA.num_experts``; None is taken as local) or its factors' rows and
    columns are not ``r * El`` (the other checks are the experts call's). Host metadata only."""
    for name, a in (lora or {}).items() if isinstance(lora, dict) else ():
        n = getattr(a, "num_experts", None)
        if n is not None and n != El:
            hint = (
                " (all of them: adapters added after expert_parallel; moeyard.parallel.shard_lora(model) keeps "
                "this rank's block, before the optimizer is built)"
                if n == E
                else ""
            )
            raise ValueError(
                f"lora['{name}']: the adapter covers {n} experts, this rank computes its block of "
                f"E / W = {El} of {E}{hint}"
            )
        A, B = getattr(a, "lora_A", None), getattr(a, "lora_B", None)
        if (
            isinstance(A, Tensor)
            and isinstance(B, Tensor)
            and A.dim() == B.dim() == 2
            and (A.shape[0] == 0 or A.shape[0] % El or B.shape[1] != A.shape[0])
        ):
            raise ValueError(
                f"lora['{name}']: expected lora_A [r*{El}, in] and lora_B [out, r*{El}] (this rank's "
                f"E_l = {El} experts), got {tuple(A.shape)} and {tuple(B.shape)}"
            )


def check_fp8_dispatch(fp8_dispatch, dispatcher, overlap_chunks) -> None:
    """Raise ValueError (TypeError for a non-bool) unless ``fp8_dispatch`` can run with these options: the
    ``all_to_all`` and ``all_gather`` dispatchers, one exchange each way (``overlap_chunks == 1``). Host
    metadata only."""
    if not isinstance(fp8_dispatch, bool):
        raise TypeError(f"fp8_dispatch: expected a bool, got {type(fp8_dispatch).__name__}")
    if fp8_dispatch and dispatcher not in ("all_to_all", "all_gather"):
        raise ValueError(
            f"fp8_dispatch: the all_to_all and all_gather dispatchers carry e4m3 rows, got dispatcher={dispatcher!r}"
        )
    if fp8_dispatch and overlap_chunks != 1:
        raise ValueError("fp8_dispatch: not with overlap_chunks > 1 (the chunked exchanges carry the compute dtype)")


def check_overlap_options(overlap_chunks, dispatcher, capacity_factor, exchange) -> None:
    """Raise ValueError unless ``overlap_chunks`` (a positive int) can run with these options: more than
    one chunk needs the ``all_to_all`` or ``sync_free`` dispatcher, no ``capacity_factor`` and not the
    ``symm_mem`` exchange. Host metadata only."""
    if isinstance(overlap_chunks, bool) or not isinstance(overlap_chunks, int) or overlap_chunks < 1:
        raise ValueError(f"overlap_chunks: expected a positive int, got {overlap_chunks!r}")
    if overlap_chunks > 1 and dispatcher == "all_gather":
        raise ValueError(
            "overlap_chunks: only the all_to_all and sync_free dispatchers overlap their exchanges, "
            "got dispatcher='all_gather'"
        )
    if overlap_chunks > 1 and capacity_factor is not None:
        raise ValueError(
            "overlap_chunks: not with capacity_factor (its capacity would apply per chunk and drop "
            "other pairs than one exchange does)"
        )
    sync_free.check_overlap(exchange, overlap_chunks)
