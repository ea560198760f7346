"""The Hopper fast path of the ``fp8_rowwise`` recipes: grouped GEMMs on e4m3 operands with float32 rowwise
scales, cast by :mod:`moeyard.quant.fp8_triton`. The forward and input-gradient GEMMs run on
:func:`moeyard.quant.fp8_grouped.grouped_mm` (the row gather by token inside its loads; ``MOEYARD_FP8_GEMM``
``auto``, the default: its Gluon kernel where it applies, else its Triton kernel; ``triton``: its Triton
kernel) or, with ``MOEYARD_FP8_GEMM=cutlass``, on ``torch._scaled_grouped_mm`` (CUTLASS, SM 9.0) after a
gather of the e4m3 rows; the FP8 weight gradients on :mod:`moeyard.quant.fp8_gluon_wgrad` (its Gluon kernel on
sm_90; ``MOEYARD_FP8_WGRAD=cutlass``: on ``torch._scaled_grouped_mm``; :func:`wgrad_gemm`).

Which scale each GEMM's operands carry (expert-major rows ``x [R, K]``, ``w [E, N, K]``, offsets ``[E + 1]``):

- forward ``y = x w_e^T``: ``x`` one scale per row (over K), ``w_e`` one per output channel (over K);
- dgrad ``dx = dy w_e``: ``dy`` one per row (over N), ``w_e^T`` one per input channel (over N);
- wgrad ``dw_e = dy_e^T x_e``: ``dy^T`` and ``x^T`` one per channel and expert, over the expert's tokens
  (for the Gluon kernel an operand gathered by token, ``x`` or ``d out``, one per channel over all tokens:
  :func:`_token_amax`). The Gluon kernel takes column casts that start each expert at a multiple of 128 rows
  (zeros after its rows), so the rows themselves need no padding; ``torch._scaled_grouped_mm`` takes groups
  of a multiple of 16 rows (``Recipe.align``). Under ``fp8_rowwise_gw_hp`` (``Recipe.wgrad`` None) in the
  compute dtype.

Forward and dgrad accumulate with ``use_fast_accum`` (contraction over H or I, at most a few thousand). wgrad
contracts over an expert's tokens (thousands to hundreds of thousands): exactly on ``torch._scaled_grouped_mm``,
with fast accumulation on the Gluon kernel (relative error against float64 1.86e-3 where the exact one gives
1.66e-3, ``benchmarks/fp8_wgrad_probe.py``, H200).

Two forms:

- :class:`HopperRowwise`, the three GEMMs of one projection (:func:`moeyard.experts.scaled.scaled_linear`):
  any layer the composed pipeline builds (biases, LoRA terms, custom activations).
- :func:`routed_ffn`, the whole routed FFN fused around the same GEMMs, for a named activation and no
  down-projection bias (LoRA terms included where the rows need no per-expert padding: :func:`fused`): the
  up projection casts each token's row once and gathers the
  e4m3 rows (the bf16 permuted copy of x is never made; its wgrad cast reads ``x`` through the rows'
  token index); the down projection casts ``act(h)`` straight from ``h`` with the routing weight folded into
  its rowwise scale (``act(h)`` is never written in bf16, nor kept: only ``h`` is); the combine is then an
  unweighted sum of each token's rows, whose backward's ``d out`` is cast once per token and gathered in
  e4m3 like ``x`` (no ``[R, H]`` copy of it in bf16), and the routing weights' gradient ``<d out[t], y_r> = <d act_r,
  act(h_r)>`` comes out of the activation's backward kernel (the ``[T, K, H]`` pair copy a weighted combine
  keeps for it is never made). Same results as the composed form, up to where bf16 rounding happens.
  LoRA terms (``y = x W_e^T + s (x A_e^T) B_e^T``, Hu et al., arXiv 2106.09685) ride in the same FP8
  GEMMs: each adds ``s z B_e^T`` (forward, ``z = x A_e^T``) or ``s (dy B_e) A_e`` (input gradient) after its
  scales, in the compute dtype (:class:`moeyard.quant.fp8_grouped.LowRankTerm`); the thin GEMMs that make
  ``z`` and the factors' gradients are the ``triton`` backend's (:mod:`moeyard.experts.triton.function`).
  The down projection's ``z`` is taken from ``rw * act(h)``, written in the compute dtype by the same read
  of ``h`` that casts ``act(h)``.

On a CPU (Triton's interpreter) ``torch._scaled_grouped_mm`` is replaced by its definition
(:func:`scaled_grouped_mm`), so the tests run both forms everywhere. Elsewhere (another GPU, dtype or
recipe, or sizes that are not multiples of 16) a recipe runs emulated (:class:`moeyard.experts.scaled.Emulated`)
and, on a GPU, says so once.
"""

from __future__ import annotations

import warnings

import torch

from ..activations import Activation
from ..checks import env_choice
from ..dispatch import DispatchPlan, make_plan, plan_rows, rows_by_token
from ..kernel_op import have_triton
from ..quant import weight_cache
from ..quant.recipe import Recipe
from ..weighted_sum import gathered_sum
from .scaled import Emulated, RecipeGEMMs
from .triton.options import read_once
from .weights import ExpertWeights

Tensor = torch.Tensor
_warned: set[tuple] = set()
ENV_GEMM = "MOEYARD_FP8_GEMM"


def scaled_grouped_mm(
    a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, offsets: Tensor, out_dtype: torch.dtype, fast_accum: bool
) -> Tensor:
    """``torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offsets[1:])`` on CUDA; on a CPU its definition
    in float32 (dequantise, ``torch._grouped_mm``): ``a [M, K]`` e4m3 row-major with ``scale_a [M]``, ``b
    [G, K, N]`` column-major with ``scale_b [G, N]`` -> ``[M, N]``; or, for wgrad, ``a [N, M]`` and ``b [M, K]``
    grouped along M with ``scale_a [G * N]``, ``scale_b [G * K]`` (group-major) -> ``[G, N, K]``."""
    if a.is_cuda:
        return torch._scaled_grouped_mm(
            a, b, scale_a, scale_b, offs=offsets[1:], out_dtype=out_dtype, use_fast_accum=fast_accum
        )
    if b.dim() == 3:
        a_deq = a.float() * scale_a[:, None]
        b_deq = b.float() * scale_b[:, None, :]
        return torch._grouped_mm(a_deq, b_deq, offs=offsets[1:]).to(out_dtype)
    G = offsets.numel() - 1
    group = torch.searchsorted(offsets[1:].to(torch.int64), torch.arange(a.shape[1]), right=True).clamp(max=G - 1)
    a_deq = a.float() * scale_a.view(G, -1).mT[:, group]
    b_deq = b.float() * scale_b.view(G, -1)[group]
    return torch._grouped_mm(a_deq, b_deq, offs=offsets[1:]).to(out_dtype)


def _cast():
    from ..quant import fp8_triton

    return fp8_triton


def _colwise():
    from ..quant import fp8_colwise

    return fp8_colwise


class HopperRowwise(RecipeGEMMs):
    """``fp8_rowwise`` on ``torch._scaled_grouped_mm`` (shapes: :mod:`moeyard.experts.scaled`, offsets form)."""

    def forward(self, x, w, offsets, recipe):
        return _forward(_cast().rowwise(x), w, offsets, x.dtype, gemm_backend())[0]

    def dgrad(self, dy, w, offsets, recipe):
        return _dgrad(_cast().rowwise(dy), w, offsets, dy.dtype, gemm_backend())

    def wgrad(self, dy, x, offsets, recipe):
        if recipe.wgrad is None:
            return _wgrad_hp(dy, x, offsets)
        cols = _colwise()
        return _wgrad(
            lambda p: cols.colwise_per_group(dy, offsets, padded=p),
            lambda p: cols.colwise_per_group(x, offsets, padded=p),
            offsets,
            dy.shape[0],
            dy.dtype,
            wgrad_gemm(),
        )


HOPPER_ROWWISE = HopperRowwise()


def _forward(
    xq_xs: tuple[Tensor, Tensor],
    w: Tensor,
    offsets: Tensor,
    dtype: torch.dtype,
    gemm: str,
    index: Tensor | None = None,
    tiles=None,
    lora=None,
) -> tuple[Tensor, Tensor | None]:
    """``(x w_e^T, amax)`` from the cast rows ``(xq, xs)`` (``[R, K]``, or ``[T, K]`` read through ``index
    [R]``, :func:`_gathered_gemm`): casts ``w [E, N, K]`` per output channel (once per
    :func:`moeyard.cache_fp8_weights` block; NF4 storage as a :class:`moeyard.quant.fp8_triton.NF4Source`, read in the cast's loads), which
    also gives ``amax [E, K]`` (or None), the columns' ``max
    |w|`` that :func:`_dgrad`'s transposed cast takes (:func:`moeyard.quant.fp8_triton.rowwise_per_expert`);
    ``tiles``: the step's :class:`moeyard.quant.fp8_grouped.TileTable` (or None); ``lora``: a
    :class:`moeyard.quant.fp8_grouped.LowRankTerm` the GEMM adds (or None)."""
    key = _key(w)
    make = lambda: _cast().rowwise_per_expert(_source(w, weight_cache.keeping(key)))  # noqa: E731
    wq, ws, amax = weight_cache.cached(key, "rowwise", make)
    return _gathered_gemm(xq_xs, wq, ws, offsets, dtype, gemm, index, tiles, lora), amax


def _gathered_gemm(
    a_sa, bq: Tensor, bs: Tensor, offsets: Tensor, dtype, gemm: str, index: Tensor | None, tiles=None, lora=None
):
    """``out[r] = a[index[r]] b_e^T`` (rowwise scales; ``index`` None: ``a``'s own rows) for ``bq [E, N, K]``
    e4m3 with ``bs [E, N]``, plus the low-rank term ``lora`` when given: with ``gemm`` ``auto`` or ``triton``
    (:func:`gemm_backend`) :func:`moeyard.quant.fp8_grouped.grouped_mm` (the gather in its loads), with
    ``cutlass`` (no low-rank term: :func:`fused` keeps LoRA layers off it) the rows gathered first and
    ``torch._scaled_grouped_mm`` (fast accumulation: forward and dgrad contract over H or I only)."""
    aq, sa = a_sa
    if gemm != "cutlass":
        from ..quant import fp8_grouped

        return fp8_grouped.grouped_mm(
            aq, sa, bq, bs, offsets, dtype, index=index, gluon=gemm == "auto", tiles=tiles, lora=lora
        )
    assert lora is None, "the cutlass GEMM takes no low-rank term"
    if index is not None:
        aq, sa = rows_by_token(aq, index), rows_by_token(sa[:, None], index)[:, 0]  # zero rows: scale 0
    return scaled_grouped_mm(aq, bq.contiguous().mT, sa, bs.contiguous(), offsets, dtype, True)


GEMMS = ("auto", "triton", "cutlass")


def gemm_backend() -> str:
    """``MOEYARD_FP8_GEMM``, the forward and input-gradient GEMMs: ``auto`` (default; unset or empty too)
    moeyard's grouped GEMM on its Gluon kernel where that applies (Hopper) and on its Triton kernel
    elsewhere, ``triton`` always on its Triton kernel, ``cutlass`` on ``torch._scaled_grouped_mm``.

    Raises:
        ValueError: another value.
    """
    return env_choice(ENV_GEMM, GEMMS)


def _wgrad(dy_cast, x_cast, offsets: Tensor, rows: int, dtype, gemm: str, cols: int | None = None) -> Tensor:
    """``dw_e = dy_e^T x_e`` ``[E, N, K]`` over ``rows`` rows, from the per-expert column casts
    ``dy_cast(padded) -> (dy^T [N, R], [E, N])`` and ``x_cast(padded) -> (x^T [K, R], [E, K])``
    (:func:`moeyard.quant.fp8_colwise.colwise_per_group` with ``padded``): with ``gemm`` (:func:`wgrad_gemm`)
    ``gluon`` on :mod:`moeyard.quant.fp8_gluon_wgrad` from padded casts (where it cannot run,
    ``torch._scaled_grouped_mm`` takes them: their zero columns add nothing), with ``cutlass`` on
    ``torch._scaled_grouped_mm`` from unpadded ones (each group a multiple of 16 rows). No host sync.

    ``cols`` (``K``; the up projection's, whose ``x`` cast is the larger): on the ``gluon`` path ``dw`` is then
    made :func:`wgrad_windows` column windows at a time, ``x_cast(padded, c0, c1)`` casting columns ``c0 ..
    c1 - 1`` only, so one window's cast of ``x`` is alive at once (``dy``'s is read once per window); the
    results equal one window's bit for bit (an output column does not depend on the others)."""
    if gemm != "gluon":
        (dyq, dys), (xq, xs) = dy_cast(None), x_cast(None)
        return scaled_grouped_mm(dyq, xq.mT, dys.reshape(-1), xs.reshape(-1), offsets, dtype, False)
    from ..quant import fp8_gluon_wgrad as gluon_wgrad

    starts = _colwise().padded_offsets(offsets, rows, gluon_wgrad.BK)
    dyq, dys = dy_cast(starts)
    windowed = cols is not None and rows >= MIN_WINDOW_ROWS
    windows = wgrad_windows(rows, starts[1], cols, dyq.shape[0], dtype.itemsize) if windowed else []
    if len(windows) <= 1:  # x's columns cast whole
        return _wgrad_window(dyq, dys, *x_cast(starts), starts[0], dtype, None)
    dw = torch.empty(dys.shape[0], dyq.shape[0], cols, device=dyq.device, dtype=dtype)
    for c0, c1 in windows:
        xq, xs = x_cast(starts, c0, c1)
        _wgrad_window(dyq, dys, xq, xs, starts[0], dtype, dw[:, :, c0:c1])
        del xq, xs  # one window's cast alive at a time
    return dw


def _wgrad_window(
    dyq: Tensor, dys: Tensor, xq: Tensor, xs: Tensor, starts: Tensor, dtype, out: Tensor | None
) -> Tensor:
    """:func:`_wgrad`'s GEMM from the padded casts (``starts [E + 1]`` their experts' first columns), into ``out``
    (a window of ``dw``'s columns; None: a new tensor): the Gluon kernel where it runs, else
    ``torch._scaled_grouped_mm`` (its result copied into ``out``), which allocates only its own result."""
    from ..quant import fp8_gluon_wgrad as gluon_wgrad

    shape = (dys.shape[0], dyq.shape[0], xq.shape[0])
    if gluon_wgrad.ready(dyq, xq, dtype, shape[0]):
        dw = torch.empty(shape, device=dyq.device, dtype=dtype) if out is None else out
        gluon_wgrad.launch(dyq, dys, xq, xs, starts, dw)
        return dw
    result = scaled_grouped_mm(dyq, xq.mT, dys.reshape(-1), xs.reshape(-1), starts, dtype, False)
    return result if out is None else out.copy_(result)


ENV_WGRAD = "MOEYARD_FP8_WGRAD"
WGRAD_GEMMS = ("gluon", "cutlass")


def wgrad_gemm() -> str:
    """``MOEYARD_FP8_WGRAD``, the FP8 weight gradients' GEMM (``fp8_rowwise``): ``gluon`` (default; unset or empty
    too) moeyard's e4m3 grouped GEMM over each expert's rows (:mod:`moeyard.quant.fp8_gluon_wgrad`, sm_90; fast
    accumulation; elsewhere ``torch._scaled_grouped_mm`` on the same padded casts), which needs no padded rows;
    ``cutlass`` ``torch._scaled_grouped_mm`` on unpadded casts, accumulating exactly, with rows padded per
    expert (``Recipe.align``). H200, 2026-11-29, ``benchmarks/fp8_wgrad_probe.py``: the Gluon GEMM at 84-90% of
    the dense e4m3 rate at qwen3-30b-a3b, sonic-30b-a and sonic-120b (73-77% at qwen3.5-35b-a3b),
    ``torch._scaled_grouped_mm`` at 46-55%.

    Raises:
        ValueError: another value.
    """
    return env_choice(ENV_WGRAD, WGRAD_GEMMS)


def _wgrad_hp(dy: Tensor, x: Tensor, offsets: Tensor) -> Tensor:
    """``dw_e = dy_e^T x_e`` ``[E, N, K]`` in the compute dtype (``torch._grouped_mm``) from the rows
    ``dy [R, N]``, ``x [R, K]``: a recipe's wgrad with ``wgrad=None``."""
    return torch._grouped_mm(dy.mT, x, offs=offsets[1:])


# ---------------------------------------------------------------------------------- the fused form


def fused(weights: ExpertWeights, activation: Activation) -> bool:
    """Whether :func:`routed_ffn` computes this layer: a named activation and no down bias; with LoRA terms
    also rows that need no per-expert padding (:func:`unpadded`), which the ``triton`` backend's thin LoRA
    GEMMs take."""
    if activation.fn is not None or weights.b_down is not None:
        return False
    return (weights.lora_up is None and weights.lora_down is None) or unpadded(weights, gemm_backend(), wgrad_gemm())


def unpadded(weights: ExpertWeights, gemm: str, wgrad: str) -> bool:
    """Whether the fused form's rows can go without per-expert padding (``Recipe.align``): no GEMM of the step
    needs aligned groups when moeyard's FP8 GEMM (``gemm`` not ``cutlass``) runs forward and input gradients
    and the weight gradients run on padded column casts (``wgrad``, :func:`wgrad_gemm`, ``gluon``), in the
    compute dtype (``Recipe.wgrad`` None) or are not taken (a frozen base, or no autograd)."""
    if gemm == "cutlass":
        return False
    trains = torch.is_grad_enabled() and (weights.w_up.requires_grad or weights.w_down.requires_grad)  # NF4: False
    return weights.recipe.wgrad is None or not trains or wgrad == "gluon"


def warn_lora_composed(weights: ExpertWeights) -> None:
    """Warn once per recipe that LoRA terms on an FP8 base run the composed form here (each projection on its
    own, the adapter terms as separate GEMMs in the compute dtype: the rows are padded per expert for a trained
    base's FP8 weight gradients on ``MOEYARD_FP8_WGRAD=cutlass``, or the GEMM is ``cutlass``): correct, but
    slower than the fused form's LoRA terms inside the FP8 GEMMs (``fp8_rowwise_gw_hp``, or a frozen base) and
    holding more memory (H200, 2026-11-28, ``moeyard bench --lora 16 --recipe fp8_rowwise_gw_hp``, this form:
    a LoRA step 1.4-2.2x bf16's; ``docs/fp8.md``)."""
    if (weights.lora_up is None and weights.lora_down is None) or ("lora", weights.recipe.name) in _warned:
        return
    _warned.add(("lora", weights.recipe.name))
    warnings.warn(
        f"moeyard: recipe {weights.recipe.name!r} with LoRA adapters runs each projection on its own here (a "
        f"base trained with FP8 weight gradients on {ENV_WGRAD}=cutlass, or {ENV_GEMM}=cutlass): measured "
        "1.4-2.2x slower than bf16's fused LoRA step, with more memory; freeze the base, leave those settings "
        "at their defaults or use fp8_rowwise_gw_hp (see docs/fp8.md)",
        stacklevel=4,
    )


# the triton backend's options read once for the forward's launches, and once in each backward (its kernels
# serve the weight gradients in the compute dtype, the LoRA terms and the tile tables)
@read_once
def routed_ffn(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    weights: ExpertWeights,
    activation: Activation,
    *,
    drop_invalid: bool = False,
) -> Tensor:
    """The routed expert FFN under ``weights.recipe`` (``fp8_rowwise``) in the fused form (module docstring):
    ``x [T, H]``, ``topk_ids`` / ``topk_weights`` ``[T, K]`` -> ``[T, H]``; differentiable w.r.t. ``x``,
    ``topk_weights``, both weights, the up bias and the LoRA factors. Pairs with an invalid id add nothing;
    without ``drop_invalid`` their NaN routing weight (:func:`moeyard.experts` sets it) makes their token's
    row NaN."""
    recipe = weights.recipe
    gemm, wgrad = gemm_backend(), wgrad_gemm()  # read once: forward and backward must agree with the plan's alignment
    flat = unpadded(weights, gemm, wgrad)
    plan = make_plan(topk_ids, weights.num_experts, align=1 if flat else recipe.align)
    offsets = plan.padded_offsets
    # each pair's row, -1 for an invalid pair (the combines skip it: its row is past offsets[E], unwritten); the
    # NaN weight of an invalid id reaches its token's row (0 * NaN) in the combine's own float32 sum (no
    # gradient: a constant term)
    row_tokens, pair_rows, row_weights, nan_terms = plan_rows(plan, topk_weights, nan_terms=not drop_invalid)
    lora = weights.lora_up is not None or weights.lora_down is not None
    # the triton backend's view of the rows, for the kernels that read one operand by token (unpadded rows)
    routing = _routing(plan, topk_ids) if flat and (lora or recipe.wgrad is None) else None
    hp = None if recipe.wgrad is not None else _HighPrecisionWgrad(plan, row_tokens, routing)
    dh_cast = _DhCast()
    tiles = _tile_table() if gemm != "cutlass" else None  # the four FP8 GEMMs' tile table, made once per step
    up, down = _Adapter.of(weights.lora_up, routing), _Adapter.of(weights.lora_down, routing)
    w_up, w_down = weights.w_up, weights.w_down
    if not (isinstance(w_up, Tensor) and isinstance(w_down, Tensor)):  # NF4 storage: cast the active experts
        active = plan.expert_offsets[1:] > plan.expert_offsets[:-1]
        w_up, w_down = (w if isinstance(w, Tensor) else _cast().nf4_source(w, active) for w in (w_up, w_down))
    h = _GatheredUp.apply(x, w_up, *up.factors, row_tokens, pair_rows, offsets, (gemm, wgrad), hp, dh_cast, tiles, up)
    if weights.b_up is not None:
        from .pipeline import add_row_bias

        h = add_row_bias(h, weights.b_up, plan)
    rw = _RowWeights.apply(topk_weights, row_weights, pair_rows)
    out = _ActDownCombine.apply(
        h,
        w_down,
        *down.factors,
        offsets,
        rw,
        row_tokens,
        pair_rows,
        activation,
        weights.interleaved,
        (gemm, wgrad),
        hp,
        dh_cast,
        tiles,
        nan_terms,
        down,
    )
    return out


def _routing(plan: DispatchPlan, topk_ids: Tensor):
    """The plan's unpadded rows as the ``triton`` backend's kernels take them (:class:`.triton.ops.Routing`)."""
    from .triton import ops

    return ops.Routing(
        topk_ids=topk_ids.contiguous(),
        sort_order=plan.sort_order,
        expert_offsets=plan.expert_offsets,
        num_experts=plan.num_experts,
    )


class _Adapter:
    """A projection's LoRA adapter as the fused form runs it: ``factors`` ``(A [E, r, in], B [E, out, r])``
    (passed to the autograd functions as inputs, for their gradients; ``(None, None)`` without an adapter),
    the scale ``s`` and the rows' :class:`.triton.ops.Routing` for the thin GEMMs."""

    NONE: _Adapter

    def __init__(self, a: Tensor | None, b: Tensor | None, scale: float, routing):
        self.factors, self.scale, self.routing = (a, b), scale, routing

    @staticmethod
    def of(lora, routing) -> _Adapter:
        return _Adapter.NONE if lora is None else _Adapter(lora.a, lora.b, lora.scaling, routing)

    def rows(self, t: Tensor, factor: Tensor, *, by_token: bool) -> Tensor:
        """``[R, r]``: each row of ``t`` (``[T, .]`` read at the row's token with ``by_token``, else ``[R, .]``)
        times its expert's ``factor [E, ., r]`` (a thin grouped GEMM of the ``triton`` backend)."""
        from .triton import ops

        return ops.low_rank_rows(t, factor, self.routing, gather=by_token)

    def term(self, z: Tensor, lb: Tensor):
        """The FP8 GEMM's low-rank term ``s z lb_e^T``."""
        from ..quant.fp8_grouped import LowRankTerm

        return LowRankTerm(z, lb, self.scale)

    def factor_grad(self, lhs: Tensor, rhs: Tensor, lhs_by_token: bool, rhs_by_token: bool, like: Tensor) -> Tensor:
        """``s lhs_e^T rhs_e`` shaped like the factor ``like`` (:func:`.triton.function._thin_wgrad`)."""
        from .triton.function import _thin_wgrad

        return _thin_wgrad(lhs, rhs, lhs_by_token, rhs_by_token, self.routing, like, self.scale)


_Adapter.NONE = _Adapter(None, None, 0.0, None)


def _tile_table():
    from ..quant.fp8_grouped import TileTable

    return TileTable()


class _RowWeights(torch.autograd.Function):
    """``row_weights [R]`` float32 (:func:`moeyard.dispatch.plan_rows`: each valid pair's routing weight at its
    row, zero elsewhere) as a function of ``topk_weights [T, K]``: the gradient reads back each pair's row
    (``pair_rows``, -1 for an invalid pair: no gradient)."""

    @staticmethod
    def forward(ctx, topk_weights: Tensor, row_weights: Tensor, pair_rows: Tensor) -> Tensor:
        ctx.save_for_backward(pair_rows)
        ctx.dtype = topk_weights.dtype
        return row_weights

    @staticmethod
    def backward(ctx, d_rows: Tensor):
        (pair_rows,) = ctx.saved_tensors
        # index -1 reads the appended zero
        return torch.cat([d_rows, d_rows.new_zeros(1)])[pair_rows].to(ctx.dtype), None, None


def _dgrad(
    dyq_dys: tuple[Tensor, Tensor],
    w: Tensor,
    offsets: Tensor,
    dtype,
    gemm: str,
    index: Tensor | None = None,
    amax: Tensor | None = None,
    tiles=None,
    lora=None,
) -> Tensor:
    """``dx = dy w_e`` (plus the low-rank term ``lora``, or None) from the rowwise cast of ``dy`` (``[R, N]``,
    or ``[T, N]`` read through ``index``): casts ``w [E, N, K]`` per input channel (:func:`_weight_t`)."""
    return _gathered_gemm(dyq_dys, *_weight_t(w, amax), offsets, dtype, gemm, index, tiles, lora)


def _weight_t(w: Tensor, amax: Tensor | None) -> tuple[Tensor, Tensor]:
    """``w [E, N, K]`` cast per input channel, transposed: ``([E, K, N] e4m3, [E, K] float32)``, once per
    :func:`moeyard.cache_fp8_weights` block; with the forward's column ``amax [E, K]`` when given
    (:func:`_forward`)."""
    key = _key(w)
    return weight_cache.cached(
        key, "colwise", lambda: _cast().colwise_per_expert(_source(w, weight_cache.keeping(key)), amax)
    )


def _weight_t_cols(w: Tensor, amax: Tensor | None, c0: int, c1: int) -> tuple[Tensor, Tensor]:
    """Columns ``c0 .. c1 - 1`` of ``w``'s transposed cast (:func:`_weight_t`): rows ``c0 .. c1 - 1`` of
    ``([E, K, N], [E, K])``, cast alone (``[E, c1 - c0, N]``) unless a :func:`moeyard.cache_fp8_weights` block
    keeps the whole cast (then a slice of it, no copy)."""
    if weight_cache.keeping(_key(w)) or (c0, c1) == (0, w.shape[2]):
        wq, ws = _weight_t(w, amax)
        return wq[:, c0:c1], ws[:, c0:c1]
    return _cast().colwise_per_expert(_source(w, False), amax, cols=(c0, c1))


def _key(w):
    """What :mod:`moeyard.quant.weight_cache` keeps ``w``'s casts under: the weight tensor, or for NF4 storage
    (an :class:`moeyard.quant.fp8_triton.NF4Source`, which the fused form makes per call) the storage itself."""
    return w if isinstance(w, Tensor) else w.storage


def _source(w, kept: bool):
    """The casts' operand for ``w``: as it is, except NF4 storage whose cast is ``kept`` across calls
    (:func:`moeyard.cache_fp8_weights`), which casts every expert, not only the call's active ones."""
    return w._replace(active=None) if kept and not isinstance(w, Tensor) else w


ENV_NF4 = "MOEYARD_FP8_NF4"
NF4_MODES = ("codes", "dequantize")


def nf4_mode() -> str:
    """``MOEYARD_FP8_NF4``, how the fused form takes NF4 base weights: ``codes`` (default; unset or empty too)
    the FP8 weight casts decode the 4-bit codes and block scales in their loads, so no dense weight is written;
    ``dequantize``: the active experts into a dense buffer first, then cast it (:mod:`moeyard.experts.quantized`).
    Both give the same bits. ``codes`` holds one layer's dense expert weights less at the peak (1.1 and 1.5 GiB in
    4-layer qwen3-30b-a3b and qwen3.5-35b-a3b QLoRA stacks) at the same or a shorter step: 37.73 against 38.49
    and 34.66 against 34.75 ms (H200, 2026-11-28, ``moeyard bench --quant nf4 --lora 16 --backends qlora
    --recipe fp8_rowwise_gw_hp``; ``benchmarks/NOTES.md``, round 50).

    Raises:
        ValueError: another value.
    """
    return env_choice(ENV_NF4, NF4_MODES)


def takes_storage(w) -> bool:
    """Whether the fused form reads this quantised base weight in its FP8 casts (as an NF4Source): NF4 storage
    (:class:`moeyard.quant.NF4Experts`) with :func:`nf4_mode` ``codes``."""
    from ..quant import NF4Experts

    return isinstance(w, NF4Experts) and nf4_mode() == "codes"


# at most this many column windows, of the up projection's input gradient (sonic-120b's sizes need four) and of
# its weight gradient
MAX_WINDOWS = 4
WINDOW_COLS = 256  # a window's columns: a multiple of the FP8 GEMM's column tile (moeyard.quant.fp8_gluon.BN)
MIN_WINDOW_ROWS = 4096  # fewer rows hold too little memory to be worth a GEMM launch more


def dgrad_windows(rows: int, hidden: int, inner: int, experts: int, itemsize: int) -> int:
    """How many column windows :func:`_dgrad_summed` makes the up projection's input gradient in, for ``rows``
    rows of ``inner`` (2I) columns, ``hidden`` (H) output columns, ``experts`` experts and an output of
    ``itemsize`` bytes an element: the fewest ``n`` (at most :data:`MAX_WINDOWS`) for which what the
    fast path holds while a window runs, ``d h``'s e4m3 cast (``R 2I`` bytes) and ``1/n`` of both ``W_up``'s
    transposed cast (``E H 2I``) and the ``[R, H]`` output rows (``R H itemsize``), is less than the compute
    dtype's path holds there, the output rows whole: ``n > (out + w) / (out - dh)`` (strictly, so that the
    step's small tensors do not tip the peak over bf16's where the two would be equal)."""
    out, dh, w = rows * hidden * itemsize, rows * inner, experts * hidden * inner
    if out == 0 or dh + w == 0:
        return 1
    if dh >= out:
        return MAX_WINDOWS
    return min(MAX_WINDOWS, (out + w) // (out - dh) + 1)


def column_windows(hidden: int, n: int) -> list[tuple[int, int]]:
    """``n`` windows ``(c0, c1)`` over ``hidden`` columns, each but the last a multiple of
    :data:`WINDOW_COLS` wide (so fewer than ``n`` when ``hidden`` is narrow)."""
    step = -(-hidden // max(n, 1))
    step = max(-(-step // WINDOW_COLS) * WINDOW_COLS, WINDOW_COLS)
    return [(c0, min(hidden, c0 + step)) for c0 in range(0, hidden, step)] or [(0, hidden)]


def wgrad_windows(rows: int, width: int, hidden: int, inner: int, itemsize: int) -> list[tuple[int, int]]:
    """The column windows (:func:`column_windows`) of ``x``'s ``hidden`` (H) columns in which :func:`_wgrad` makes
    the up projection's FP8 weight gradient, for ``rows`` rows of ``d h`` with ``inner`` (2I) columns in the
    compute dtype (``itemsize`` bytes an element) and casts ``width`` columns wide (padded): the fewest (at most
    :data:`MAX_WINDOWS`) whose widest ``c`` columns make the casts held there, ``d h``'s (``width 2I``
    bytes) and that window's of ``x`` (``width c``), less than the compute dtype's path holds there instead,
    ``d h``'s rows (``R 2I itemsize``; the weight gradients, ``dx`` and the rest alike on both): ``width c < R 2I
    itemsize - width 2I``. At the anchor shapes' sizes: two windows at qwen3-30b-a3b's and sonic-120b's, three at
    qwen3.5-35b-a3b's and sonic-7b's, four at sonic-30b-a's (``test_wgrad_windows``). Each window reads ``d h``'s
    cast again: at qwen3.5-35b-a3b's sizes three windows cost 0.01 ms a step, four 0.25 (H200,
    ``benchmarks/NOTES.md`` round 57)."""
    held = rows * inner * itemsize - width * inner
    for n in range(1, MAX_WINDOWS + 1):
        windows = column_windows(hidden, n)
        if width * max(c1 - c0 for c0, c1 in windows) < held:
            break
    return windows


def _dgrad_summed(
    dh_cast: _DhCast,
    dh: Tensor,
    w: Tensor,
    offsets: Tensor,
    pair_rows: Tensor,
    gemm: str,
    amax: Tensor | None,
    tiles=None,
    low_rank: tuple | None = None,
) -> Tensor:
    """``dx [T, H]``, each token's sum over its live rows ``r`` (``pair_rows [T, K]``, -1: none) of ``d h_r
    w_e`` (plus, with ``low_rank = (adapter, g, A)``, the LoRA term ``s g_r A_e``: :class:`_Adapter`, ``g =
    d h B_e [R, r]``, ``A [E, r, H]``, each window taking its columns of ``A``), from the rowwise cast of ``d h [R, 2I]`` (``dh_cast``'s, :class:`_DhCast`) and ``w [E, 2I, H]``.
    Made :func:`dgrad_windows` column windows at a time (:func:`column_windows`; one below
    :data:`MIN_WINDOW_ROWS` rows): for each, ``W_up``'s transposed cast of those columns
    (:func:`_weight_t_cols`), the GEMM's ``[R, c1 - c0]`` rows and their sum into ``dx``'s columns
    (:func:`moeyard.weighted_sum.gathered_sum` with ``out``), so only one window's output rows and weight
    cast are alive at once; the results equal one window's bit for bit (a column's sum does not depend on
    the others). ``d h``'s cast is read once per window (its bytes are the windows' cost). No host sync."""
    dhq, dhs = dh_cast.take(dh)
    R, inner = dhq.shape
    E, _, H = w.shape
    n = dgrad_windows(pair_rows.numel(), H, inner, E, dh.dtype.itemsize) if R >= MIN_WINDOW_ROWS else 1
    windows = column_windows(H, n)
    dx = dh.new_empty(pair_rows.shape[0], H) if len(windows) > 1 else None
    for i, (c0, c1) in enumerate(windows):
        wq, ws = _weight_t_cols(w, amax, c0, c1)
        term = None if low_rank is None else low_rank[0].term(low_rank[1], low_rank[2][:, :, c0:c1].mT)
        d_rows = _gathered_gemm((dhq, dhs), wq, ws, offsets, dh.dtype, gemm, None, tiles, term)
        del wq, ws
        if i == len(windows) - 1:  # not held through the last sum
            del dhq, dhs
        if dx is None:
            return gathered_sum(d_rows, pair_rows)[0]
        gathered_sum(d_rows, pair_rows, out=dx[:, c0:c1])
        del d_rows  # one window's rows alive at a time
    return dx


class _HighPrecisionWgrad:
    """The weight gradients of a recipe with ``wgrad=None``, in the compute dtype: ``dw_e = lhs_e^T rhs_e``
    with one operand read by token (``x`` or ``d out``, ``[T, .]``) and the other in the plan's rows. With
    ``routing`` (unpadded rows, :func:`_routing`) on the ``triton`` backend's weight-gradient kernels, which
    read the first by token (no ``[R, .]`` copy of it); else (None) that operand's rows gathered for
    ``torch._grouped_mm``."""

    def __init__(self, plan: DispatchPlan, row_tokens: Tensor, routing):
        self.row_tokens, self.offsets, self.routing = row_tokens, plan.padded_offsets, routing

    def __call__(self, by_token: Tensor, rows: Tensor, token_first: bool, like_w: Tensor) -> Tensor:
        """``dw`` shaped like ``like_w``: ``lhs, rhs = (by_token, rows)`` if ``token_first`` else ``(rows, by_token)``."""
        if self.routing is not None:
            lhs, rhs = (by_token, rows) if token_first else (rows, by_token)
            return _wgrad_by_token(lhs, rhs, self.routing, token_first, like_w)
        gathered = rows_by_token(by_token, self.row_tokens)
        return _wgrad_hp(gathered, rows, self.offsets) if token_first else _wgrad_hp(rows, gathered, self.offsets)


def _wgrad_by_token(lhs: Tensor, rhs: Tensor, routing, lhs_by_token: bool, like_w: Tensor) -> Tensor:
    """``dw_e = lhs_e^T rhs_e`` in the compute dtype on the ``triton`` backend's weight-gradient kernels, one
    operand read by token (``[T, .]``: ``x`` or ``d out``, no ``[R, .]`` copy), the other in sorted rows."""
    from .triton import ops

    dw, _ = ops.wgrad(
        lhs,
        rhs,
        lhs_by_token=lhs_by_token,
        rhs_by_token=not lhs_by_token,
        scale=None,
        r=routing,
        like_w=like_w,
        like_b=None,
    )
    return dw


class _DhCast:
    """The rowwise e4m3 cast of the up projection's output gradient ``d h``, made by the activation's
    backward kernel (:func:`moeyard.quant.fp8_triton.act_backward`, from the rows it has just written) and
    handed to the up projection's backward, which takes it only for the same memory at the same version
    (else, e.g. after a hook changed ``d h``, it casts ``d h`` itself)."""

    def __init__(self):
        self.wanted, self.key, self.fp8 = False, None, None

    @staticmethod
    def _key(t: Tensor) -> tuple:
        return t.data_ptr(), t.shape, t.stride(), t.dtype, t._version

    def put(self, dh: Tensor, fp8: tuple[Tensor, Tensor]) -> None:
        self.key, self.fp8 = self._key(dh), fp8

    def made(self, dh: Tensor) -> bool:
        """Whether ``dh`` is the tensor whose cast was put and not yet taken: the down projection's backward
        made it, and nothing else holds it (``h`` is internal to the fused form)."""
        return self.fp8 is not None and self.key == self._key(dh)

    def take(self, dh: Tensor) -> tuple[Tensor, Tensor]:
        fp8 = self.fp8 if self.made(dh) else None
        self.key = self.fp8 = None
        return fp8 if fp8 is not None else _cast().rowwise(dh)


class _GatheredUp(torch.autograd.Function):
    """``h = x[row_tokens] w_e^T`` (``+ s (x A_e^T) B_e^T`` with an adapter: :class:`_Adapter`) with the e4m3
    rows read by token from one cast per token; backward: ``dx`` summed over each token's live rows, ``dw``
    from ``x`` read through ``row_tokens`` (in FP8, or with ``hp`` in the compute dtype:
    :class:`_HighPrecisionWgrad`), the factors' gradients from the thin GEMMs. The pairs' rows and the
    weight's column ``amax``, which only the input gradient reads, are let go before the weight gradient
    (where this backward holds most), unless the backward keeps its graph; so is ``d h`` once its column cast
    is made (FP8 weight gradient, no adapter), where the down projection's backward made it
    (:meth:`_DhCast.made`)."""

    @staticmethod
    def forward(ctx, x, w, a_lo, b_lo, row_tokens, pair_rows, offsets, gemms, hp, dh_cast, tiles, adapter):
        gemm, ctx.wgrad_gemm = gemms  # forward / input gradients, FP8 weight gradients
        z = term = None
        if a_lo is not None:  # z = x[row] A_e^T, kept for B's gradient
            z = adapter.rows(x, a_lo.mT, by_token=True)
            term = adapter.term(z, b_lo)
        ctx.save_for_backward(x, _tensor(w), row_tokens, offsets, a_lo, b_lo, z)
        ctx.stored = None if isinstance(w, Tensor) else w
        ctx.gemm, ctx.hp, ctx.dh_cast, ctx.tiles, ctx.adapter = gemm, hp, dh_cast, tiles, adapter
        ctx.pair_rows = pair_rows  # internal (made by routed_ffn), never modified: held as is
        dh_cast.wanted = ctx.needs_input_grad[0]  # whether backward's dgrad will take d h's e4m3 cast
        h, ctx.w_amax = _forward(_cast().rowwise(x), w, offsets, x.dtype, gemm, row_tokens, tiles, term)
        return h

    @staticmethod
    @read_once
    def backward(ctx, dh):
        x, w, row_tokens, offsets, a_lo, b_lo, z = ctx.saved_tensors
        w = ctx.stored or w
        need_x, need_w, need_a, need_b = (ctx.needs_input_grad[i] for i in range(4))
        adapter = ctx.adapter
        dh = dh.contiguous()
        # d h's memory can go back once the FP8 weight gradient's column cast of it is made (asked here, before the
        # input gradient takes its row cast): this backward's alone, read by nothing after without an adapter
        release = ctx.dh_cast.made(dh) and a_lo is None and not _graph_kept()
        dx = dw = da = db = g = None
        if a_lo is not None and need_b and (need_x or need_a) and _one_pass(b_lo, adapter.routing):
            from .triton import ops  # dB_e = s d h^T z and the rows g = d h B_e from one pass over d h

            db, g = ops.wgrad_rows(dh, z, b_lo, lhs_by_token=False, r=adapter.routing, alpha=adapter.scale)
        elif a_lo is not None and (need_x or need_a):
            g = adapter.rows(dh, b_lo, by_token=False)
        if need_x:
            low_rank = None if a_lo is None else (adapter, g, a_lo)
            dx = _dgrad_summed(ctx.dh_cast, dh, w, offsets, ctx.pair_rows, ctx.gemm, ctx.w_amax, ctx.tiles, low_rank)
        if not _graph_kept():  # read by the input gradient only
            ctx.pair_rows = ctx.w_amax = None
        if need_w and ctx.hp is not None:
            dw = ctx.hp(x, dh, False, w)
        elif need_w:
            cols = _colwise()
            dw = _wgrad(
                lambda p: _released_after(cols.colwise_per_group(dh, offsets, padded=p), dh if release else None),
                _TokenColumns(x, offsets, row_tokens),
                offsets,
                dh.shape[0],
                dh.dtype,
                ctx.wgrad_gemm,
                cols=x.shape[1],
            )
        if need_a:  # dA_e = s (d h B_e)^T x
            da = adapter.factor_grad(g, x, False, True, a_lo)
        if need_b and db is None:  # dB_e = s d h^T (x A_e^T)
            db = adapter.factor_grad(dh, z, False, False, b_lo)
        return dx, dw, da, db, None, None, None, None, None, None, None, None


def _released_after(result, t: Tensor | None):
    """``result``, after giving ``t``'s memory back (``t`` None: nothing), so that the next allocation (the
    other operand's column cast) can take it: the up projection's FP8 weight gradient then holds ``d h``'s
    cast instead of ``d h`` and its cast (at sonic-120b one ``[R, 2I]`` bf16 buffer, 1 GiB, less at the step's
    peak). Only for a tensor nothing else reads afterwards."""
    if t is not None:
        t.untyped_storage().resize_(0)
    return result


def _token_amax(t: Tensor, padded) -> Tensor | None:
    """For the padded column cast of rows gathered by token from ``t [T, N]`` (``x``, ``d out``): the columns'
    amax over all ``T`` tokens, float32 ``[N]``, one bound for every expert's rows (None without ``padded``: the
    unpadded cast takes each expert's own). Its power-of-two scales round every value as each expert's own
    would wherever that expert's column stays within e4m3's normal range of the tokens' maximum (2^15 below
    it); the same SQNR of ``dW`` in simulation (outlier channels, token scales, skewed routing). One reduction over
    ``T`` rows, where each expert's own would read the ``k T`` gathered ones."""
    return None if padded is None else torch.linalg.vector_norm(t, float("inf"), dim=0).float()


class _TokenColumns:
    """:func:`_wgrad`'s ``x_cast`` for rows gathered by token from ``x [T, K]`` (``row_tokens``): the column cast
    of columns ``c0 .. c1 - 1`` (all: ``c1`` None), padded with the columns' amax over all tokens
    (:func:`_token_amax`, made once for every window), or unpadded."""

    def __init__(self, x: Tensor, offsets: Tensor, row_tokens: Tensor):
        self.x, self.offsets, self.row_tokens, self.amax, self.made = x, offsets, row_tokens, None, False

    def __call__(self, padded, c0: int = 0, c1: int | None = None) -> tuple[Tensor, Tensor]:
        if not self.made:  # once for every window (None unpadded)
            self.amax, self.made = _token_amax(self.x, padded), True
        amax = None if self.amax is None else self.amax[c0:c1]
        cols = self.x[:, c0:c1]
        return _colwise().colwise_per_group(cols, self.offsets, index=self.row_tokens, padded=padded, amax=amax)


def _tensor(w) -> Tensor | None:
    """``w`` for ``save_for_backward``: the weight tensor, or None for NF4 storage (kept on ``ctx``)."""
    return w if isinstance(w, Tensor) else None


def _one_pass(b: Tensor, routing) -> bool:
    """:func:`.triton.function._one_pass`: whether ``dB`` and the rows ``d h B_e`` come from one pass."""
    from .triton.function import _one_pass as one_pass

    return one_pass(b, routing)


class _ActDownCombine(torch.autograd.Function):
    """``out[t] = sum over t's live rows r of rw_r * act(h_r) w_e^T`` (``+ s (rw_r act(h_r) A_e^T) B_e^T``
    with an adapter, :class:`_Adapter`; ``rw`` folded into the rowwise scale of ``act(h)``; the combine an
    unweighted gathered sum); backward from ``d out [T, H]``: the rows' ``dy = d out[token]`` cast once per
    token and gathered in e4m3 (no ``[R, H]`` copy in the compute dtype), ``d h`` and ``d rw`` from one kernel
    over ``h`` and ``d act``, ``dw`` from ``act(h)`` cast again from ``h`` and ``d out`` read through the
    rows' tokens (with ``hp`` in the compute dtype, :class:`_HighPrecisionWgrad`, from ``rw * act(h)``
    written once, by the same kernel as ``d h``, which the factor ``A``'s gradient reads too); ``d h``'s e4m3
    cast for the up projection's dgrad comes from that kernel too (``dh_cast``, :class:`_DhCast`), and ``d
    h`` itself goes into ``h``'s memory unless the backward keeps its graph (``retain_graph``,
    ``create_graph``)."""

    @staticmethod
    def forward(
        ctx,
        h,
        w,
        a_lo,
        b_lo,
        offsets,
        rw,
        row_tokens,
        pair_rows,
        act,
        interleaved,
        gemms,
        hp,
        dh_cast,
        tiles,
        terms,
        ad,
    ):
        gemm, ctx.wgrad_gemm = gemms  # forward / input gradients, FP8 weight gradients
        cast = _cast()
        # with an adapter the same read of h also writes rw * act(h) in the compute dtype, z's operand
        a_rows = None if a_lo is None else h.new_empty(h.shape[0], a_lo.shape[2])
        aq, a_s = cast.rowwise(h, act, interleaved=interleaved, weighted_rows=None if a_rows is None else (a_rows, rw))
        z = term = None
        if a_lo is not None:  # z = (rw act(h)) A_e^T, kept for B's gradient
            z = ad.rows(a_rows, a_lo.mT, by_token=False)
            del a_rows
            term = ad.term(z, b_lo)
        y, ctx.w_amax = _forward((aq, a_s * rw), w, offsets, h.dtype, gemm, tiles=tiles, lora=term)
        del aq, a_s
        ctx.save_for_backward(h, _tensor(w), offsets, rw, row_tokens, a_lo, b_lo, z)
        ctx.stored = None if isinstance(w, Tensor) else w
        ctx.act, ctx.interleaved, ctx.gemm, ctx.hp, ctx.dh_cast, ctx.tiles = act, interleaved, gemm, hp, dh_cast, tiles
        ctx.adapter = ad
        return gathered_sum(y, pair_rows, row_terms=terms)[0]

    @staticmethod
    @read_once
    def backward(ctx, d_out):
        h, w, offsets, rw, row_tokens, a_lo, b_lo, z = ctx.saved_tensors
        w = ctx.stored or w
        need_h, need_w, need_a, need_b, need_rw = (ctx.needs_input_grad[i] for i in (0, 1, 2, 3, 5))
        ad = ctx.adapter
        cast = _cast()
        d_out = d_out.contiguous()
        dh = drw = dw = da = db = a_rows = g = None
        hp_wgrad = need_w and ctx.hp is not None
        if need_w and not hp_wgrad:  # the FP8 weight gradient reads h: before d h takes it
            cols = _colwise()
            dw = _wgrad(
                lambda p: cols.colwise_per_group(
                    d_out, offsets, index=row_tokens, padded=p, amax=_token_amax(d_out, p)
                ),
                lambda p: cols.colwise_per_group(
                    h, offsets, ctx.act, interleaved=ctx.interleaved, row_weights=rw, padded=p
                ),
                offsets,
                h.shape[0],
                d_out.dtype,
                ctx.wgrad_gemm,
            )
        if a_lo is not None and (need_h or need_rw or need_a):  # g = d out[token] B_e
            g = ad.rows(d_out, b_lo, by_token=True)
        if need_h or need_rw:
            # d / d (rw * act(h)), with the adapter's s g A_e
            term = None if a_lo is None else ad.term(g, a_lo.mT)
            da_ = _dgrad(
                cast.rowwise(d_out), w, offsets, d_out.dtype, ctx.gemm, row_tokens, ctx.w_amax, ctx.tiles, term
            )
            quantize = need_h and ctx.dh_cast.wanted
            grads = cast.act_backward(
                h,
                da_,
                ctx.act,
                interleaved=ctx.interleaved,
                row_weights=rw,
                quantize=quantize,
                with_act_rows=hp_wgrad or need_a,
                overwrite_da=True,  # da_ is dropped below: d h's e4m3 cast takes its memory
                # h is read no more (rw * act(h) comes from the same kernel): d h takes its memory, unless this
                # backward keeps the graph for another (retain_graph, create_graph), which reads h again
                overwrite_h=not _graph_kept(),
            )
            del da_
            dh, drw, a_rows = grads.dh, grads.d_row_weights, grads.act_rows
            if quantize:
                ctx.dh_cast.put(dh, grads.dh_fp8)
        if (hp_wgrad or need_a) and a_rows is None:
            a_rows = cast.act_rows(h, ctx.act, interleaved=ctx.interleaved, row_weights=rw)
        if hp_wgrad:
            dw = ctx.hp(d_out, a_rows, True, w)
        if need_a:  # dA_e = s (d out B_e)^T (rw act(h))
            da = ad.factor_grad(g, a_rows, False, False, a_lo)
        if need_b:  # dB_e = s d out^T z, z = (rw act(h)) A_e^T
            db = ad.factor_grad(d_out, z, True, False, b_lo)
        return dh, dw, da, db, None, drw, None, None, None, None, None, None, None, None, None, None


def _graph_kept() -> bool:
    """Whether the running backward keeps its graph (``retain_graph`` or ``create_graph``), so that a saved
    tensor is read again by a later backward; True where torch does not say (outside a backward)."""
    keep = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if keep is None else bool(keep())


# ---------------------------------------------------------------------------------- the choice


def fast_path_reason(
    recipe: Recipe, device: torch.device, dtype: torch.dtype, weights: ExpertWeights | None
) -> str | None:
    """None when the Hopper fast path serves ``recipe`` here, else why not."""
    if not recipe.rowwise:
        return f"{recipe.name} has no Hopper fast path (torch._scaled_grouped_mm takes rowwise scales on SM 9.0)"
    if device.type != "cuda":
        return f"no FP8 GEMM on {device.type}"
    if not hasattr(torch, "_scaled_grouped_mm") or not have_triton():
        return "needs torch._scaled_grouped_mm and Triton"
    cap = torch.cuda.get_device_capability(device)
    if cap != (9, 0):
        return f"the rowwise FP8 grouped GEMM runs on SM 9.0 (Hopper), this GPU is SM {cap[0]}.{cap[1]}"
    if dtype != torch.bfloat16:
        return f"the fast path computes in bfloat16, got {dtype}"
    if weights is not None:
        for name, n in (("hidden_size", weights.hidden_size), ("intermediate_size", weights.intermediate_size)):
            if n % 16:
                return f"{name}={n} is not a multiple of 16 (FP8 rows need 16-byte strides)"
    return None


def recipe_gemms(
    recipe: Recipe, device: torch.device, dtype: torch.dtype, weights: ExpertWeights, emulated: Emulated
) -> tuple[RecipeGEMMs, int]:
    """``(gemms, align)`` for a grouped backend: the Hopper fast path and ``recipe.align`` where it runs,
    else ``emulated`` and 1 (with one warning per reason on a GPU: emulation is slower than the compute
    dtype's own GEMMs)."""
    reason = fast_path_reason(recipe, device, dtype, weights)
    if reason is None:
        return HOPPER_ROWWISE, recipe.align
    if device.type == "cuda" and (recipe.name, reason) not in _warned:
        _warned.add((recipe.name, reason))
        warnings.warn(
            f"moeyard: recipe {recipe.name!r} runs emulated (quantise, dequantise, bf16 GEMMs: its "
            f"numerics, slower than bf16): {reason}",
            stacklevel=4,
        )
    return emulated, 1
