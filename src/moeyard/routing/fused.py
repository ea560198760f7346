"""The fused router: :func:`moeyard.routing.route` in two Triton kernels (forward, backward).

Forward: one kernel computes the logits GEMM, the scores, the top-k ids and weights and per-block
partial statistics (:mod:`.kernels`); a second, one program, reduces the partials in a fixed order and
computes the three losses and their weighted sum from them (the formulas of :mod:`.losses`, as the
torch path). Backward: one kernel yields ``d logits [T, E]`` (x's dtype); then ``dx = d logits @ W``,
``dW = d logits^T @ x`` and ``d bias = sum_t d logits`` are torch matmuls and a sum. Kept for
backward: x, the weight, the logits, the ids and the ``[B, 2E + 1]`` per-sequence statistics. No host
synchronisation; 2 launches and no other device op in the forward (besides allocations), so that the
host issues it quickly (``benchmarks/NOTES.md``, round 13). The three launches are ``torch.library`` custom ops
(:mod:`moeyard.kernel_op`): opaque under ``torch.compile``, called directly in eager mode.

Values equal the torch path's to float32 rounding; the ids are identical except where two keys tie
exactly (or, after rounding, within an ulp): among equal keys the lower expert id is picked.

Supported: float16 / bfloat16 / float32 inputs, ``E <= 512``, ``K <= 16``, ``n_group == 1``
(:func:`unsupported` names what is not; :func:`moeyard.routing.route` then uses the torch path).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from ..checks import check_float
from ..config import MoEConfig
from ..experts.triton.schedule import device_smem_limit, dot_precision, interpreting, tuned
from ..kernel_op import kernel_op, records_graph
from ..launch import cdiv, next_power_of_2
from . import kernels
from .output import finish

Tensor = torch.Tensor
MAX_EXPERTS = 512
MAX_TOP_K = 16
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Spec:
    """The static routing scheme a launch is compiled for."""

    sigmoid: bool
    topk_first: bool
    norm: bool
    scale: float
    top_k: int
    num_sequences: int

    @staticmethod
    def of(config: MoEConfig, num_sequences: int) -> Spec:
        return Spec(
            sigmoid=config.score_func == "sigmoid",
            topk_first=config.topk_before_score,
            norm=config.norm_topk_prob,
            scale=float(config.routed_scaling_factor),
            top_k=config.top_k,
            num_sequences=num_sequences,
        )


@dataclass(frozen=True)
class LossSpec:
    """The losses' scale factors (``aux = c_aux sum_e counts_e P_e``, ``seq = c_seq sum_be counts_be
    P_be``, ``z = c_z sum_t lse_t^2``: :mod:`.losses` factored; 0 without tokens) and coefficients."""

    c_aux: float
    c_seq: float
    c_z: float
    w_aux: float
    w_seq: float
    w_z: float

    @staticmethod
    def of(config: MoEConfig, num_tokens: int, num_sequences: int) -> LossSpec:
        T, B, E, K = num_tokens, num_sequences, config.num_experts, config.top_k
        S = T // B
        return LossSpec(
            c_aux=E / (T * T * K) if T else 0.0,
            c_seq=E / (K * S * S * B) if S else 0.0,
            c_z=1.0 / T if T else 0.0,
            w_aux=float(config.aux_loss_coef),
            w_seq=float(config.seq_aux_loss_coef),
            w_z=float(config.z_loss_coef),
        )

    def args(self) -> tuple:
        return self.c_aux, self.c_seq, self.c_z, self.w_aux, self.w_seq, self.w_z


def unsupported(x: Tensor, config: MoEConfig, *, training: bool = False) -> str | None:
    """Why the fused router cannot route ``x`` as ``config`` says, or None when it can."""
    if x.device.type != "cuda" and not interpreting():
        return f"x is on {x.device} (the fused router runs on CUDA, or under TRITON_INTERPRET=1)"
    if x.dtype not in DTYPES:
        return f"x is {x.dtype} (supported: {DTYPES})"
    if config.num_experts > MAX_EXPERTS:
        return f"num_experts={config.num_experts} > {MAX_EXPERTS}"
    if config.top_k > MAX_TOP_K:
        return f"top_k={config.top_k} > {MAX_TOP_K}"
    if config.n_group > 1:
        return "grouped top-k (n_group > 1)"
    if training and config.router_jitter > 0:
        return "router jitter in training"
    return None


def route_fused(
    x: Tensor,
    weight: Tensor,
    config: MoEConfig,
    *,
    bias: Tensor | None = None,
    correction_bias: Tensor | None = None,
    num_sequences: int = 1,
):
    """:func:`moeyard.routing.route` (``training=False`` semantics: no jitter) by the fused kernels.

    Args:
        x: ``[T, H]`` float16, bfloat16 or float32 (CUDA, or CPU under ``TRITON_INTERPRET=1``).
        weight: ``[E, H]`` floating point (used in x's dtype, as the torch path does).
        config: :class:`MoEConfig` with ``num_experts <= 512``, ``top_k <= 16``, ``n_group == 1``.
        bias, correction_bias: ``[E]`` floating point or None, on x's device.
        num_sequences: B, a positive divisor of T.
    Returns:
        :class:`moeyard.routing.RoutingOutput` (values as :func:`moeyard.routing.route`).
    Raises:
        TypeError: a non-floating or unsupported dtype (float64 x: use the torch path).
        ValueError: shapes, devices, ``num_sequences``, or an unsupported config (the message says which).
    """
    _check(x, weight, config, bias, correction_bias, num_sequences)
    spec, loss_spec = Spec.of(config, num_sequences), LossSpec.of(config, x.shape[0], num_sequences)
    if records_graph(x, weight, bias):
        logits, scores, ids, w, counts, losses = _FusedRouter.apply(x, weight, bias, correction_bias, spec, loss_spec)
    else:  # no graph to record: the kernels without the autograd function's host time
        logits, scores, ids, w, stats = _forward(x, weight, bias, correction_bias, spec)
        _, counts, losses = _losses(stats, spec.num_sequences, config.num_experts, loss_spec)
    aux, seq, z, loss = losses.unbind()
    return finish(config, ids, w, logits, scores, counts, aux, seq, z, loss)


def _check(x, weight, config, bias, correction_bias, num_sequences) -> None:
    check_float("x", x, dim=2)
    check_float("weight", weight, dim=2)
    if x.dtype not in DTYPES:
        raise TypeError(f"x: expected one of {DTYPES} for the fused router, got {x.dtype} (use the torch path)")
    E, H = config.num_experts, config.hidden_size
    if tuple(weight.shape) != (E, H) or x.shape[1] != H:
        raise ValueError(
            f"weight: expected shape {(E, H)} with x [T, {H}], got {tuple(weight.shape)} and {tuple(x.shape)}"
        )
    for name, t in (("bias", bias), ("correction_bias", correction_bias)):
        if t is None:
            continue
        check_float(name, t, dim=1)
        if t.shape[0] != E:
            raise ValueError(f"{name}: expected shape ({E},), got {tuple(t.shape)}")
    for name, t in (("weight", weight), ("bias", bias), ("correction_bias", correction_bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: expected device {x.device} (as x), got {t.device}")
    if config.top_k > E:
        raise ValueError(f"config.top_k: expected at most num_experts={E}, got {config.top_k}")
    T = x.shape[0]
    if not isinstance(num_sequences, int) or num_sequences < 1 or T % num_sequences:
        raise ValueError(f"num_sequences: expected a positive divisor of T={T}, got {num_sequences!r}")
    reason = unsupported(x, config)
    if reason is not None:
        raise ValueError(f"config: not supported by the fused router: {reason}")


class _FusedRouter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, corr, spec: Spec, loss_spec: LossSpec):
        logits, scores, ids, w, stats = _forward(x, weight, bias, corr, spec)
        seq_stats, counts, losses = _losses(stats, spec.num_sequences, weight.shape[0], loss_spec)
        ctx.mark_non_differentiable(ids, counts)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, weight, bias, logits, ids, seq_stats, counts)
        ctx.spec, ctx.loss_spec = spec, loss_spec
        return logits, scores, ids, w, counts, losses

    @staticmethod
    def backward(ctx, g_logits, g_scores, _g_ids, g_w, _g_counts, g_losses):
        x, weight, bias, logits, ids, seq_stats, counts = ctx.saved_tensors
        dl = _backward(
            logits, ids, g_w, g_logits, g_scores, (g_losses, counts, seq_stats), ctx.spec, ctx.loss_spec, x.dtype
        )
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dx = dl @ weight.to(x.dtype) if need_x else None
        dw = (dl.mT @ x).to(weight.dtype) if need_w else None
        db = dl.sum(0, dtype=torch.float32).to(bias.dtype) if need_b else None
        return dx, dw, db, None, None, None


def empty(shape: tuple, *, device, dtype) -> Tensor:
    """An uninitialised buffer the kernels fill entirely (tests poison it to prove that)."""
    return torch.empty(shape, device=device, dtype=dtype)


def _e_p2(num_experts: int) -> int:
    """The kernels' expert-axis width: ``E`` rounded up to a power of two, at least 16 (``tl.dot``'s least)."""
    return max(16, next_power_of_2(num_experts))


def block_m(e_p2: int, tokens: int) -> int:
    """Tokens per forward program: the logits GEMM's ``[BM, E_P2]`` float32 tile stays at 16K elements, and
    no larger than the sequence's ``tokens`` need (at least 16, ``tl.dot``'s least; 32 under the interpreter,
    to exercise several programs on small inputs)."""
    if interpreting():
        return 32
    return max(16, min(128, 16384 // e_p2, next_power_of_2(max(tokens, 1))))


def _forward(x, weight, bias, corr, spec: Spec):
    T, H = x.shape
    E, K, B = weight.shape[0], spec.top_k, spec.num_sequences
    bm = block_m(_e_p2(E), T // B)
    ns = cdiv(T // B, bm)
    f32 = dict(device=x.device, dtype=torch.float32)
    logits, scores = empty((T, E), **f32), empty((T, E), **f32)
    ids = empty((T, K), device=x.device, dtype=torch.int64)
    w = empty((T, K), **f32)
    # flat: under torch.compile with dynamic shapes, Inductor (torch 2.11) re-wrapped a mutated [B, NS, 2E + 1]
    # buffer, whose NS is a long symbolic expression, in a view of itself and failed on the self-copy it then
    # emitted (KeyError in Scheduler.compute_ancestors; pytorch/pytorch#189271). A 1-D buffer is never re-wrapped.
    stats = empty((B * ns * (2 * E + 1),), **f32)
    if T > 0:
        _forward_(
            x,
            weight,
            bias,
            corr,
            spec.sigmoid,
            spec.topk_first,
            spec.norm,
            spec.scale,
            bm,
            B,
            logits,
            scores,
            ids,
            w,
            stats,
        )
    return logits, scores, ids, w, stats


# The three launches are custom ops (moeyard.kernel_op), as the experts' kernels are: under torch.compile the
# compiler sees opaque ops, not the Triton kernels with launch arguments computed from (possibly symbolic) token
# counts; Dynamo then captures the router in one graph at any token count, also under the interpreter
# (tests/test_router_fused.py, test_compiles_for_varying_token_counts).
@kernel_op("moeyard::router_forward", mutates_args=("logits", "scores", "ids", "w", "stats"))
def _forward_(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    corr: Tensor | None,
    sigmoid: bool,
    topk_first: bool,
    norm: bool,
    scale: float,
    block_m: int,
    num_sequences: int,
    logits: Tensor,
    scores: Tensor,
    ids: Tensor,
    w: Tensor,
    stats: Tensor,
) -> None:
    """:func:`.kernels.router_fwd_kernel` over ``x [T, H]`` (T > 0) and ``weight [E, H]``: ``logits``, ``scores
    [T, E]``, ``ids [T, K]`` int64, ``w [T, K]`` and the partial statistics ``stats``, ``[B, NS, 2E + 1]``
    flattened (B = ``num_sequences`` sequences of ``T / B`` tokens, NS programs of ``block_m`` tokens each),
    written."""
    T, H = x.shape
    E, K = weight.shape[0], ids.shape[1]
    B = num_sequences
    S = T // B
    ns = cdiv(S, block_m)
    e_p2 = _e_p2(E)
    _fwd_launcher()[(ns, B)](
        x,
        weight,
        weight if bias is None else bias,
        weight if corr is None else corr,  # unread if None
        logits,
        scores,
        ids,
        w,
        stats,
        H,
        E,
        K,
        S,
        ns,
        x.stride(0),
        x.stride(1),
        weight.stride(0),
        weight.stride(1),
        scale,
        HAS_BIAS=bias is not None,
        HAS_CORR=corr is not None and not topk_first,
        PRECISION=dot_precision(x.dtype),
        E_P2=e_p2,
        K_P2=max(2, next_power_of_2(K)),
        BM=block_m,
        SIGMOID=sigmoid,
        TOPK_FIRST=topk_first,
        NORM=norm,
    )


@_forward_.register_fake
def _(x, weight, bias, corr, sigmoid, topk_first, norm, scale, block_m, num_sequences, logits, scores, ids, w, stats):
    return None


def _losses(stats: Tensor, num_sequences: int, num_experts: int, loss_spec: LossSpec) -> tuple[Tensor, Tensor, Tensor]:
    """``(seq_stats [B, 2E + 1], counts [E], losses [4])`` float32 from the partial statistics ``[B, NS, 2E +
    1]`` flattened (:func:`.kernels.router_losses_kernel`; with no tokens, zeros)."""
    B, E = num_sequences, num_experts
    width = 2 * E + 1
    f32 = dict(device=stats.device, dtype=torch.float32)
    if stats.shape[0] == 0:
        return torch.zeros((B, width), **f32), torch.zeros(E, **f32), torch.zeros(4, **f32)
    seq_stats, counts, losses = empty((B, width), **f32), empty((E,), **f32), empty((4,), **f32)
    _losses_(stats, *loss_spec.args(), seq_stats, counts, losses)
    return seq_stats, counts, losses


@kernel_op("moeyard::router_losses", mutates_args=("seq_stats", "counts", "losses"))
def _losses_(
    stats: Tensor,
    c_aux: float,
    c_seq: float,
    c_z: float,
    w_aux: float,
    w_seq: float,
    w_z: float,
    seq_stats: Tensor,
    counts: Tensor,
    losses: Tensor,
) -> None:
    """:func:`.kernels.router_losses_kernel` over ``stats``, ``[B, NS, 2E + 1]`` flattened (NS > 0; B and 2E + 1
    from ``seq_stats [B, 2E + 1]``): ``seq_stats``, ``counts`` and ``losses`` written (:class:`LossSpec`'s scales
    and weights)."""
    B, width = seq_stats.shape
    NS = stats.shape[0] // (B * width)
    E = (width - 1) // 2
    e_p2 = _e_p2(E)
    bj = 4 if interpreting() else max(1, min(32, 4096 // e_p2))  # three [BJ, E_P2] float32 tiles in registers
    kernels.router_losses_kernel[(1,)](
        stats, seq_stats, counts, losses, B, NS, E, c_aux, c_seq, c_z, w_aux, w_seq, w_z, E_P2=e_p2, BJ=bj, num_warps=4
    )


@_losses_.register_fake
def _(stats, c_aux, c_seq, c_z, w_aux, w_seq, w_z, seq_stats, counts, losses):
    return None


def _backward(logits, ids, g_w, g_logits, g_scores, loss_grad, spec: Spec, loss_spec: LossSpec, dtype):
    """``d logits [T, E]``; ``loss_grad = (d losses [4] or None, counts, seq_stats)``."""
    T, E = logits.shape
    dl = empty((T, E), device=logits.device, dtype=dtype)
    if T == 0:
        return dl
    g_losses, counts, seq_stats = loss_grad
    g_w, g_logits, g_scores, g_losses = (
        None if g is None else g.contiguous() for g in (g_w, g_logits, g_scores, g_losses)
    )
    _backward_(
        logits,
        ids,
        g_w,
        g_logits,
        g_scores,
        g_losses,
        counts,
        seq_stats,
        spec.sigmoid,
        spec.topk_first,
        spec.norm,
        spec.scale,
        spec.top_k,
        spec.num_sequences,
        *loss_spec.args(),
        dl,
    )
    return dl


@kernel_op("moeyard::router_backward", mutates_args=("dl",))
def _backward_(
    logits: Tensor,
    ids: Tensor,
    g_w: Tensor | None,
    g_logits: Tensor | None,
    g_scores: Tensor | None,
    g_losses: Tensor | None,
    counts: Tensor,
    seq_stats: Tensor,
    sigmoid: bool,
    topk_first: bool,
    norm: bool,
    scale: float,
    top_k: int,
    num_sequences: int,
    c_aux: float,
    c_seq: float,
    c_z: float,
    w_aux: float,
    w_seq: float,
    w_z: float,
    dl: Tensor,
) -> None:
    """:func:`.kernels.router_bwd_kernel`: ``dl = d logits [T, E]`` (T > 0) written from the gradients given (None:
    zero) of the weights, logits, scores and losses."""
    T, E = logits.shape
    e_p2 = _e_p2(E)
    bm = max(1, min(64, 4096 // e_p2))
    grads = [logits if g is None else g for g in (g_w, g_logits, g_scores, g_losses)]  # unread if None
    kernels.router_bwd_kernel[(cdiv(T, bm),)](
        logits,
        ids,
        *grads,
        counts,
        seq_stats,
        dl,
        T,
        E,
        top_k,
        T // num_sequences,
        scale,
        c_aux,
        c_seq,
        c_z,
        w_aux,
        w_seq,
        w_z,
        E_P2=e_p2,
        BM=bm,
        num_warps=4 if e_p2 <= 128 else 8,
        HAS_GW=g_w is not None,
        HAS_GL=g_logits is not None,
        HAS_GS=g_scores is not None,
        HAS_GLOSS=g_losses is not None,
        SIGMOID=sigmoid,
        TOPK_FIRST=topk_first,
        NORM=norm,
    )


@_backward_.register_fake
def _(
    logits,
    ids,
    g_w,
    g_logits,
    g_scores,
    g_losses,
    counts,
    seq_stats,
    sigmoid,
    topk_first,
    norm,
    scale,
    top_k,
    num_sequences,
    c_aux,
    c_seq,
    c_z,
    w_aux,
    w_seq,
    w_z,
    dl,
):
    return None


def _cfg(bk, warps, stages):
    return triton.Config(dict(BK=bk), num_warps=warps, num_stages=stages)


FWD_CONFIGS = [_cfg(bk, w, s) for bk in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)]
# the interpreter, and MOEYARD_TRITON_AUTOTUNE=0: at E = 128 on an H100 (H = 2048, K = 8; benchmarks/NOTES.md,
# round 30) 20-41 us from 8 to 4096 tokens and 142 at 32768, where BK 32 with 4 warps and 2 stages took 28-84
# and 171 (4 warps spilled a [128, 128] tile); with fewer stages where three do not fit (_fixed)
FIXED = dict(BK=32, num_warps=8, num_stages=3)


def _fixed(args, kwargs) -> dict:
    """``FIXED`` for a launch of :func:`.kernels.router_fwd_kernel`, with fewer stages where its ``x [BM, BK]``
    and ``W [BK, E_P2]`` tiles would not fit in the device's shared memory three times (float32 ``x`` with
    more than 256 experts on a GPU with less than sm_90's 227 KiB per block)."""
    if interpreting():
        return FIXED
    return _fixed_for(kwargs["BM"], kwargs["E_P2"], args[0].element_size(), device_smem_limit())


@functools.cache
def _fixed_for(bm: int, e_p2: int, size: int, limit: int) -> dict:
    stages = FIXED["num_stages"]
    while stages > 1 and stages * FIXED["BK"] * (bm + e_p2) * size > limit:
        stages -= 1
    return {**FIXED, "num_stages": stages}


def _prune(configs, named_args, **kwargs):
    """Keep configs whose pipelined ``x [BM, BK]`` and ``W [BK, E_P2]`` tiles fit in shared memory."""
    args = {**named_args, **kwargs}
    size = args["x_ptr"].element_size()
    ok = [
        c for c in configs if c.num_stages * c.kwargs["BK"] * (args["BM"] + args["E_P2"]) * size <= device_smem_limit()
    ]
    return ok or configs[:1]


_TUNED = []


def _fwd_launcher():
    """The forward kernel with its block config: autotuned over ``BK``, warps and stages on a GPU
    (keyed on H, E, K, the scheme and the tokens per program), ``FIXED`` under the interpreter or
    ``MOEYARD_TRITON_AUTOTUNE=0`` (:func:`moeyard.experts.triton.schedule.tuned`; built on first use)."""
    if not _TUNED:
        _TUNED.append(
            tuned(
                kernels.router_fwd_kernel,
                FWD_CONFIGS,
                ["H", "E", "K", "SIGMOID", "TOPK_FIRST", "BM"],
                prune=_prune,
                fixed=_fixed,
            )
        )
    return _TUNED[0]
