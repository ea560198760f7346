"""Peer MoE layers the benchmark times next to moeyard's backends.

- ``torch_gmm``: the torch grouped_mm pipeline most training stacks run (torchtitan-style): softmax
  router, top-k renormalised; argsort by expert, ``histc`` counts, gather, ``torch._grouped_mm`` x2
  with SwiGLU between, routing-weight multiply, ``index_add``. Runs wherever ``torch._grouped_mm`` does
  (CUDA in bf16; CPU in float32).
- ``sonicmoe``: SonicMoE (``sonic-moe``, CuTe-DSL kernels for Hopper), when ``import sonicmoe`` works
  and the device is CUDA; skipped with a reason otherwise.
- ``torchao_fp8``: the same pipeline with torchao's FP8 rowwise grouped GEMM
  (``torchao.prototype.moe_training._to_fp8_rowwise_then_scaled_grouped_mm``: dynamic e4m3 casts, all three
  GEMMs on ``torch._scaled_grouped_mm``), each expert's rows padded to a multiple of 16 as it requires
  (torchtitan's FP8 MoE path). Needs torchao and a CUDA GPU of compute capability 9.0, in bfloat16.

Both implement the routed experts of a softmax top-k, SwiGLU layer without biases or shared experts;
:func:`peer_note` says how a :class:`MoEConfig` differs from that. Each peer is an ``nn.Module``
``forward(x [T, H]) -> [T, H]`` with its router weight ``[E, H]`` at ``.router.weight``.

Legend: T tokens, H hidden, I expert intermediate, E experts, K top-k, N = T*K routed pairs.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import MoEConfig

Tensor = torch.Tensor


class TorchGroupedMM(nn.Module):
    """The torch grouped_mm pipeline (module docstring); weights ``w13 [E, H, 2I]``, ``w2 [E, I, H]``."""

    def __init__(self, config: MoEConfig, *, device=None, dtype=None):
        super().__init__()
        E, H, I = config.num_experts, config.hidden_size, config.intermediate_size
        kw = {"device": device, "dtype": dtype}
        self.top_k = config.top_k
        self.router = nn.Linear(H, E, bias=False, **kw)
        self.w13_EH2I = nn.Parameter(torch.empty(E, H, 2 * I, **kw))
        self.w2_EIH = nn.Parameter(torch.empty(E, I, H, **kw))
        for p in self.parameters():
            nn.init.normal_(p, std=0.02)

    def forward(self, x_TH: Tensor) -> Tensor:
        E, K = self.router.out_features, self.top_k
        probs_TE = F.linear(x_TH, self.router.weight).float().softmax(-1)
        w_TK, ids_TK = probs_TE.topk(K, dim=-1)
        w_TK = (w_TK / w_TK.sum(-1, keepdim=True)).to(x_TH.dtype)
        flat_N = ids_TK.reshape(-1)
        order_N = flat_N.argsort(stable=True)
        counts_E = torch.histc(flat_N.float(), bins=E, min=0, max=E - 1)
        offsets_E = counts_E.cumsum(0).to(torch.int32)
        token_N = order_N // K
        h_N2I = torch._grouped_mm(x_TH[token_N], self.w13_EH2I, offs=offsets_E)
        gate, up = h_N2I.chunk(2, dim=-1)
        y_NH = torch._grouped_mm(F.silu(gate) * up, self.w2_EIH, offs=offsets_E)
        y_NH = y_NH * w_TK.reshape(-1)[order_N].unsqueeze(-1)
        return torch.zeros_like(x_TH).index_add(0, token_N, y_NH)


class TorchaoFP8(nn.Module):
    """The torch pipeline on torchao's FP8 rowwise grouped GEMM (module docstring); weights ``w13 [E, 2I, H]``,
    ``w2 [E, H, I]`` (torchao reads ``B_t = w.mT`` column-major)."""

    ALIGN = 16

    def __init__(self, config: MoEConfig, *, device=None, dtype=None):
        super().__init__()
        E, H, I = config.num_experts, config.hidden_size, config.intermediate_size
        kw = {"device": device, "dtype": dtype}
        self.top_k = config.top_k
        self.router = nn.Linear(H, E, bias=False, **kw)
        self.w13_E2IH = nn.Parameter(torch.empty(E, 2 * I, H, **kw))
        self.w2_EHI = nn.Parameter(torch.empty(E, H, I, **kw))
        for p in self.parameters():
            nn.init.normal_(p, std=0.02)

    def forward(self, x_TH: Tensor) -> Tensor:
        from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm as fp8_gmm

        E, K, A = self.router.out_features, self.top_k, self.ALIGN
        T, H = x_TH.shape
        probs_TE = F.linear(x_TH, self.router.weight).float().softmax(-1)
        w_TK, ids_TK = probs_TE.topk(K, dim=-1)
        w_TK = (w_TK / w_TK.sum(-1, keepdim=True)).to(x_TH.dtype)
        flat_N = ids_TK.reshape(-1)
        order_N = flat_N.argsort(stable=True)
        counts_E = torch.bincount(flat_N, minlength=E)
        padded_E = (counts_E + A - 1) // A * A
        starts_E = padded_E.cumsum(0) - padded_E
        expert_N = flat_N[order_N]
        rank_N = torch.arange(T * K, device=x_TH.device) - (counts_E.cumsum(0) - counts_E)[expert_N]
        row_N = starts_E[expert_N] + rank_N  # each sorted pair's row in the padded buffer
        token_N = order_N // K
        rows = x_TH.new_zeros(T * K + E * A, H).index_copy(0, row_N, x_TH[token_N])
        offs_E = padded_E.cumsum(0).to(torch.int32)
        h = fp8_gmm(rows, self.w13_E2IH.mT, offs_E, out_dtype=x_TH.dtype, pad_token_groups_for_grouped_mm=False)
        gate, up = h.chunk(2, dim=-1)
        y = fp8_gmm(
            (F.silu(gate) * up).contiguous(),
            self.w2_EHI.mT,
            offs_E,
            out_dtype=x_TH.dtype,
            pad_token_groups_for_grouped_mm=False,
        )
        y_NH = y[row_N] * w_TK.reshape(-1)[order_N].unsqueeze(-1)
        return torch.zeros_like(x_TH).index_add(0, token_N, y_NH)


class SonicMoE(nn.Module):
    """SonicMoE's ``MoE`` layer (SwiGLU, no bias) behind ``forward(x [T, H]) -> [T, H]``."""

    def __init__(self, config: MoEConfig, *, device=None, dtype=None):
        super().__init__()
        from sonicmoe import MoE as _SonicMoE
        from sonicmoe.enums import ActivationType

        self.moe = _SonicMoE(
            num_experts=config.num_experts,
            num_experts_per_tok=config.top_k,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            activation_function=ActivationType.SWIGLU,
            add_bias=False,
            std=0.02,
        ).to(device, dtype)
        for p in self.moe.parameters():
            nn.init.normal_(p, std=0.02)

    @property
    def router(self) -> nn.Linear:
        return self.moe.router

    def forward(self, x_TH: Tensor) -> Tensor:
        from sonicmoe import KernelBackendMoE

        return self.moe(x_TH, kernel_backend_moe=KernelBackendMoE.sonicmoe)[0]


def _torch_gmm_unsupported(device: torch.device, dtype: torch.dtype) -> str | None:
    if not hasattr(torch, "_grouped_mm"):
        return "this torch build has no torch._grouped_mm"
    if device.type == "cpu" and dtype != torch.float32:
        return f"torch._grouped_mm on CPU is only timed in float32, got {dtype}"
    return None


def _sonicmoe_unsupported(device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type != "cuda":
        return f"needs a CUDA GPU, got {device.type}"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"needs bfloat16 or float16, got {dtype}"
    if importlib.util.find_spec("sonicmoe") is None:
        return "sonicmoe is not installed (pip install sonic-moe)"
    try:
        import sonicmoe  # noqa: F401
    except Exception as ex:  # an installed but broken package: say why, once
        return f"import sonicmoe failed: {type(ex).__name__}: {str(ex).splitlines()[0][:160] if str(ex) else ''}"
    return None


def _torchao_fp8_unsupported(device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return "needs a CUDA GPU of compute capability 9.0 (torch._scaled_grouped_mm's rowwise FP8)"
    if dtype != torch.bfloat16:
        return f"needs bfloat16, got {dtype}"
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (pip install torchao)"
    try:
        from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm  # noqa: F401
    except Exception as ex:  # an installed but incompatible torchao: say why
        return f"torchao's FP8 grouped GEMM does not import: {type(ex).__name__}: {str(ex).splitlines()[0][:160]}"
    return None


@dataclass(frozen=True)
class Peer:
    """A peer: ``build(config, device=, dtype=) -> nn.Module``; ``unsupported(device, dtype)`` -> reason or None."""

    name: str
    build: Callable[..., nn.Module]
    unsupported: Callable[[torch.device, torch.dtype], str | None]


PEERS: dict[str, Peer] = {
    "torch_gmm": Peer("torch_gmm", TorchGroupedMM, _torch_gmm_unsupported),
    "sonicmoe": Peer("sonicmoe", SonicMoE, _sonicmoe_unsupported),
    "torchao_fp8": Peer("torchao_fp8", TorchaoFP8, _torchao_fp8_unsupported),
}


def peer_names() -> list[str]:
    """Every peer name."""
    return list(PEERS)


def peer_status(device: torch.device | str, dtype: torch.dtype) -> dict[str, str | None]:
    """``{peer name: None if it runs on device/dtype, else the reason}``."""
    device = torch.device(device)
    return {name: p.unsupported(device, dtype) for name, p in PEERS.items()}


def peer_config(config: MoEConfig) -> MoEConfig:
    """The layer a peer computes for ``config``: same T-independent shape (E, H, I, K), softmax top-k
    renormalised, SwiGLU, no biases, no shared experts."""
    return MoEConfig(
        num_experts=config.num_experts,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        top_k=config.top_k,
    )


def peer_note(config: MoEConfig) -> str:
    """How the peers' layer differs from ``config`` ("" when it matches)."""
    diffs = []
    if config.score_func != "softmax" or config.n_group > 1 or config.score_correction_bias:
        diffs.append(
            f"softmax router instead of {config.score_func}"
            f"{' grouped' if config.n_group > 1 else ''}{' + bias' if config.score_correction_bias else ''}"
        )
    if not config.norm_topk_prob and not config.topk_before_score:
        diffs.append("renormalised top-k")
    if config.activation != "swiglu":
        diffs.append(f"swiglu instead of {config.activation}")
    if config.expert_bias or config.router_bias:
        diffs.append("no biases")
    if config.num_shared_experts:
        diffs.append("no shared expert")
    return "; ".join(diffs)
