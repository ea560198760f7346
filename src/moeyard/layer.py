"""The MoE layer: router -> dispatch -> routed experts -> combine, plus optional shared experts.

Weights use transformers v5's layout, so checkpoints map one to one: ``gate_up_proj [E, 2I, H]``
(gate rows then up rows; ``[E, I, H]`` for a plain activation), ``down_proj [E, H, I]``, optional
``gate_up_proj_bias [E, 2I]`` and ``down_proj_bias [E, H]``.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from .activations import Activation
from .checks import check_float
from .config import MoEConfig
from .experts import experts
from .experts.lora import LoRAAdapter, check_new_adapters
from .experts.registry import check_backend_name
from .quant.recipe import Recipe, resolve_recipe
from .routing import Router, RoutingOutput
from .shared_triton import _add_shared, fused_ready

Tensor = torch.Tensor


class SharedExpert(nn.Module):
    """A dense MLP applied to every token (DeepSeek's shared experts), optionally scaled by
    ``sigmoid(x @ gate)`` (Qwen2-MoE's ``shared_expert_gate``, Qwen3-Next, Qwen3.5).

    ``x [T, H] -> [T, H]``; weights ``gate_up_proj [N1, H]``, ``down_proj [H, I]``.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        activation: Activation,
        *,
        gate: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        n1 = 2 * intermediate_size if activation.gated else intermediate_size
        self.activation = activation
        self.gate_up_proj = nn.Linear(hidden_size, n1, bias=False, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, **kw)
        self.gate = nn.Linear(hidden_size, 1, bias=False, **kw) if gate else None
        for p in self.parameters():
            nn.init.normal_(p, std=0.02)

    def forward(self, x: Tensor) -> Tensor:
        y = self.down_proj(self.activation(self.gate_up_proj(x)))
        if self.gate is not None:
            y = torch.sigmoid(self.gate(x)) * y
        return y

    def add_to(self, routed: Tensor, x: Tensor, *, inplace: bool = False) -> Tensor:
        """``routed + self(x)`` for ``x, routed [T, H]`` in the weights' dtype, returned ``[T, H]``: on CUDA in
        one autograd function with fewer passes (:func:`moeyard.shared_triton.add_shared`; with ``inplace``, for a
        caller that owns ``routed``, the sum may be written over it), else in torch ops (anything
        :func:`moeyard.shared_triton.fused_ready` declines: sharded or wrapped projections, float64, ...)."""
        if fused_ready(self, x, routed):
            return _add_shared(self, x, routed, inplace=inplace)
        return routed + self(x)


class MoE(nn.Module):
    """A Mixture-of-Experts layer.

    ``forward(x [..., H]) -> [..., H]`` in ``x.dtype``. For ``x [B, S, H]`` the sequence-wise loss uses
    the B sequences. After a forward, ``self.aux_loss`` holds the coefficient-weighted router loss
    (a float32 scalar, float64 for a float64 layer, to add to the training loss) and ``self.routing`` the :class:`RoutingOutput` (unless
    ``self.keep_routing`` is set False).

    LoRA: :meth:`add_lora` gives the expert projections PEFT-layout adapters (``self.lora``), trained
    through the fused kernels with the base expert weights frozen; :meth:`merge_lora` folds them in.

    Activation checkpointing: ``torch.utils.checkpoint.checkpoint(moe, x, use_reentrant=False)`` gives the
    output and every gradient bit-identical to no checkpointing (test ``test_activation_checkpointing``). The
    reentrant variant runs its first forward with gradients disabled, so the ``self.aux_loss`` made there
    carries none (the router would silently lose its load-balancing gradient, and a warning says so): there,
    checkpoint ``moe(x, True)`` (``return_aux_loss``) and add the loss it returns, which flows through the
    checkpoint's outputs. Compiling a checkpointed layer needs
    ``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True`` (storing ``aux_loss`` and
    ``routing`` is a side effect Dynamo otherwise refuses inside a checkpoint), and on torch 2.11
    ``layer.keep_routing = False``: its Dynamo fails with an internal error on the stored
    :class:`RoutingOutput` there (torch 2.13 does not); the routing statistics are then not kept.

    CUDA graphs: forward and backward run with no host sync and capture whole; before capturing,
    drop the warm-up step's tensors (``layer.aux_loss = layer.routing = None``): they keep the
    warm-up's autograd graph, and freeing it inside the capture makes the capture fail (seen with
    torch 2.11).

    Args:
        config: the :class:`MoEConfig`.
        backend: expert backend name, ``auto`` (default: the best that runs on the input's device and
            dtype) or None (the process default, :func:`moeyard.set_backend` / ``MOEYARD_BACKEND``).
        recipe: an FP8 training recipe for the routed experts' GEMMs (``"fp8_rowwise"``,
            ``"fp8_blockwise"``, ``"mxfp8"`` or a :class:`moeyard.quant.Recipe`: see
            :func:`moeyard.experts`), or None (default: the weights' dtype). The attribute
            ``self.recipe`` may be changed between steps. Router and shared experts stay in the compute dtype.
    Raises:
        ValueError: unknown backend or recipe (here), or a backend that cannot run on the input (at forward).
        TypeError / ValueError: a bad input at forward (wrong dtype or last dimension).
    """

    def __init__(
        self,
        config: MoEConfig,
        backend: str | None = "auto",
        *,
        recipe: str | Recipe | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config: expected a moeyard.MoEConfig, got {type(config).__name__}")
        if backend is not None:
            check_backend_name(backend)
        resolve_recipe(recipe)
        self.config, self.backend, self.recipe = config, backend, recipe
        self.activation = Activation(
            name=config.activation, alpha=config.activation_alpha, limit=config.activation_limit
        )
        E, H, I = config.num_experts, config.hidden_size, config.intermediate_size
        n1 = 2 * I if self.activation.gated else I
        kw = {"device": device, "dtype": dtype}
        self.router = Router(config, **kw)
        self.gate_up_proj = nn.Parameter(torch.empty(E, n1, H, **kw))
        self.down_proj = nn.Parameter(torch.empty(E, H, I, **kw))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(E, n1, **kw)) if config.expert_bias else None
        self.down_proj_bias = nn.Parameter(torch.zeros(E, H, **kw)) if config.expert_bias else None
        self.shared_expert = None
        if config.num_shared_experts:
            shared_i = (config.shared_intermediate_size or I) * config.num_shared_experts
            self.shared_expert = SharedExpert(H, shared_i, self.activation, gate=config.shared_expert_gate, **kw)
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)
        self.lora: nn.ModuleDict | None = None
        self.aux_loss: Tensor | None = None
        self.routing: RoutingOutput | None = None
        self.keep_routing = True  # False: self.routing is set to None at each forward (see the class docstring)
        self.expert_parallel = None  # set by moeyard.parallel.expert_parallel: called instead of experts

    def add_lora(
        self,
        rank: int,
        *,
        alpha: float | None = None,
        rslora: bool = False,
        targets: tuple[str, ...] = ("gate_up_proj", "down_proj"),
        freeze_base: bool = True,
    ) -> MoE:
        """Add LoRA adapters (:class:`moeyard.experts.lora.LoRAAdapter`, PEFT's layout and init) to the
        expert projections named in ``targets``, in the experts' device and dtype; with
        ``freeze_base`` the expert weights and biases stop requiring grad. Returns ``self``.

        State dict keys: ``lora.<target>.lora_A.weight [r*E, in]``, ``lora.<target>.lora_B.weight [out, r*E]``.
        Under expert parallelism (before or after :func:`moeyard.parallel.expert_parallel`) the factors of
        all E experts are drawn as here, then each rank keeps its block ``[r*E_l, in]``, ``[out, r*E_l]``
        (:mod:`moeyard.parallel.lora`), so the adapters equal those of the unsplit layer.

        Raises:
            ValueError: unknown target, a bad rank/alpha, or adapters already present.
        """
        sizes = {"gate_up_proj": self.gate_up_proj.shape, "down_proj": self.down_proj.shape}
        check_new_adapters(self.lora is not None, targets, sizes)
        kw = {"device": self.down_proj.device, "dtype": self.down_proj.dtype}
        E = self.config.num_experts  # all experts, also where this rank holds only its block of the weights
        self.lora = nn.ModuleDict(
            {t: LoRAAdapter(E, sizes[t][2], sizes[t][1], rank, alpha=alpha, rslora=rslora, **kw) for t in targets}
        )
        if self.expert_parallel is not None:  # keep this rank's block (moeyard.parallel.lora)
            self.expert_parallel.shard_lora(self)
        if freeze_base:
            for p in (self.gate_up_proj, self.down_proj, self.gate_up_proj_bias, self.down_proj_bias):
                if p is not None:
                    p.requires_grad_(False)
        return self

    @torch.no_grad()
    def merge_lora(self) -> MoE:
        """Fold the adapters into the expert weights (``W += s B A``) and remove them. Returns ``self``.
        Under expert parallelism each rank folds its block (its experts' factors into its weights).

        Raises:
            TypeError: the expert weights are quantised (dequantise, merge, quantise again instead).
        """
        for name, adapter in (self.lora or {}).items():
            w = getattr(self, name)
            if not isinstance(w, torch.Tensor):
                raise TypeError(
                    f"merge_lora: {name} is quantised ({type(w).__name__}); LoRA cannot be merged into "
                    "quantised storage"
                )
            w = w.to_local() if hasattr(w, "to_local") else w  # a DTensor block on a DeviceMesh
            w += adapter.delta_weight().to(w.dtype)
        self.lora = None
        return self

    def forward(self, x: Tensor, return_aux_loss: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """``x [..., H] -> y [..., H]`` in ``x.dtype``; with ``return_aux_loss`` ``(y, aux_loss)``, the float32
        scalar also kept in ``self.aux_loss`` (see the class docstring, Activation checkpointing).

        Raises:
            TypeError: ``x`` not floating, or not in the weights' dtype.
            ValueError: ``x``'s last dimension is not ``hidden_size``; the backend cannot run on ``x``.
        """
        check_float("x", x)
        H = self.config.hidden_size
        if x.dim() < 1 or x.shape[-1] != H:
            raise ValueError(f"x: expected shape [..., {H}], got {tuple(x.shape)}")
        if x.dtype != self.gate_up_proj.dtype:
            raise TypeError(f"x: expected dtype {self.gate_up_proj.dtype} (as the layer's weights), got {x.dtype}")
        if not (return_aux_loss or torch.is_grad_enabled()) and x.requires_grad and self.training:
            self._warn_loss_without_grad()
        x2 = x.reshape(-1, H)
        routing = self.router(x2, num_sequences=x.shape[0] if x.dim() == 3 and x2.shape[0] else 1)
        run = experts if self.expert_parallel is None else self.expert_parallel
        out = run(
            x2,
            routing.topk_ids,
            routing.topk_weights.to(x.dtype),
            self.gate_up_proj,
            self.down_proj,
            activation=self.activation,
            backend=self.backend,
            gate_up_bias=self.gate_up_proj_bias,
            down_bias=self.down_proj_bias,
            recipe=self.recipe,
            check_ids=False,  # the router's ids lie in [0, E)
            lora=None if self.lora is None else {n: a.expert_lora() for n, a in self.lora.items()},
        )
        if self.shared_expert is not None:
            out = self.shared_expert.add_to(out, x2, inplace=True)  # out: the routed experts' own buffer
        self.aux_loss, self.routing = routing.loss, routing if self.keep_routing else None
        return (out.view(x.shape), routing.loss) if return_aux_loss else out.view(x.shape)

    def _warn_loss_without_grad(self) -> None:
        c = self.config
        if c.aux_loss_coef or c.seq_aux_loss_coef or c.z_loss_coef:
            warnings.warn(
                "MoE: gradients are disabled while x requires them (the first forward of "
                "torch.utils.checkpoint(use_reentrant=True)), so self.aux_loss will carry no gradient "
                "to the router; use use_reentrant=False, or forward(x, return_aux_loss=True) inside the "
                "checkpoint and add the aux_loss it returns",
                stacklevel=3,
            )

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"num_experts={c.num_experts}, top_k={c.top_k}, hidden_size={c.hidden_size}, "
            f"intermediate_size={c.intermediate_size}, activation={c.activation}, backend={self.backend}"
            + ("" if self.recipe is None else f", recipe={getattr(self.recipe, 'name', self.recipe)}")
        )
