"""The routed expert FFN on grouped GEMMs: permute -> grouped up-proj (+ bias) -> activation -> grouped
down-proj (+ bias) -> weighted combine, and its one custom VJP.

Legend: T tokens, H hidden, I intermediate, N1 = 2I (gated) or I, E experts, K top-k, R rows.

Weights stay as stored (no transposed copy per call): ``[E, out, in]`` (transformers v5's layout)
contracts its last dimension, gpt-oss's transposed ``[E, in, out]`` its middle one, through
``jax.lax.ragged_dot_general``'s dimension numbers. float32 and float64 matmuls run at
``Precision.HIGHEST`` (PyTorch's defaults compute full float32 products).

The grouped GEMMs (:func:`mm`, :func:`mm_t`, :func:`_weight_grad`) run on ``jax.lax.ragged_dot_general``
or on moeyard's Pallas kernels (:mod:`.gmm`), as the environment variable ``MOEYARD_JAX_GMM`` says:

- ``auto`` (default): Pallas for bfloat16 / float16 rows on a GPU backend outside ``jax.shard_map``,
  ``ragged_dot`` otherwise;
- ``pallas``: Pallas for bfloat16 / float16 rows on any backend (off GPUs in Pallas's interpret mode:
  slow, for tests; not inside ``jax.shard_map``, where the interpreter cannot run on varying operands);
  float32 / float64 keep ``ragged_dot`` (PyTorch computes full float32 products);
- ``ragged_dot``: always ``ragged_dot``.

Any other value raises ValueError naming the variable. :func:`routed_ffn` reads it on each call and keys
its ``jax.jit`` cache on it; under an enclosing ``jax.jit`` it is read once, when that function is traced,
and the compiled function keeps that choice until it is traced again.

The custom VJP (:func:`routed_ffn` with ``custom_vjp=True``) keeps for the backward only what the
inputs do not already hold: the up projection's output ``h [R, N1]`` and the plan (int32). Plain
autodiff keeps, besides ``h``, the permuted rows ``[R, H]``, the activation ``[R, I]`` and the down
projection's output ``[R, H]`` (the combine's weight gradient reads it). The backward instead gathers
the rows again from ``x``, recomputes the activation from ``h``, and takes the routing weights'
gradient as ``<dout[t], y_pair> = <dout[t] W_down_e, a_pair> + <dout[t], b_e>`` from the product
``dout W_down_e`` it needs anyway (SonicMoE's way of not caching ``y``, arXiv 2512.14080). The
gradients are the same up to float rounding (tested in float64 to 1e-10 against plain autodiff and
the PyTorch side).

Under an FP8 recipe (``FFNSpec.recipe``) both projections are :func:`scaled_mm`, each with its own VJP
(the recipe's fake-quantised operands in every GEMM), and the rest is differentiated by JAX: the FFN's custom
VJP is not used, so the routing weights' gradient comes from the down projection's output as on the PyTorch
side's composed form. With LoRA adapters (:mod:`.lora`) each adapted projection gains ``s (rows A_e^T) B_e^T``,
two thin ``ragged_dot`` GEMMs in the compute dtype (also under a recipe), and JAX differentiates the FFN
(no custom VJP) as well.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import jax
import jax.numpy as jnp

from ..activations import Activation
from ..checks import env_choice
from ..quant.recipe import Recipe
from .activations import apply_activation
from .checks import accumulation_dtype, match_varying, precision, varying_axes
from .dispatch import permute_unchecked, plan_unchecked, unpermute_unchecked
from .fp8 import fake_quantize
from .gmm import gmm, gmm_t, tgmm

_RAGGED = dict(lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
GMM_ENV = "MOEYARD_JAX_GMM"
GMM_CHOICES = ("auto", "pallas", "ragged_dot")
PALLAS_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def gmm_choice() -> str:
    """The grouped GEMM chosen by ``MOEYARD_JAX_GMM`` (module docstring): ``auto`` when unset.

    Raises:
        ValueError: another value.
    """
    return env_choice(GMM_ENV, GMM_CHOICES)


def check_choice(choice: str) -> str:
    """``choice`` if it is one of :data:`GMM_CHOICES`.

    Raises:
        ValueError: it is not (the message names ``MOEYARD_JAX_GMM``).
    """
    if choice not in GMM_CHOICES:
        raise ValueError(f"{GMM_ENV}: expected one of {', '.join(GMM_CHOICES)}, got {choice!r}")
    return choice


def use_pallas(rows, w, choice: str | None = None) -> bool:
    """Whether ``rows`` (and weight ``w``) go through the Pallas GEMMs under ``choice`` (None:
    :func:`gmm_choice`): bfloat16 / float16 rows, ``pallas``, or ``auto`` on a GPU backend. Operands varying
    over a mesh axis inside ``jax.shard_map`` (the expert-parallel path, :mod:`.parallel`) keep
    ``ragged_dot`` under ``auto`` (expert-parallel on two GPUs the Pallas GEMMs ran and agreed with one
    device to bf16 rounding, 1.1e-2, but no float32 reference has been run there yet: ``benchmarks/NOTES.md``,
    round 41) and off GPUs
    under ``pallas`` too (the interpreter cannot run there, :mod:`.gmm`).

    Raises:
        ValueError: an invalid choice.
    """
    choice = gmm_choice() if choice is None else check_choice(choice)
    if jnp.dtype(rows.dtype) not in PALLAS_DTYPES or choice == "ragged_dot":
        return False
    on_gpu = jax.default_backend() == "gpu"
    varying = bool(varying_axes(rows) or varying_axes(w))
    if choice == "pallas":
        return on_gpu or not varying
    return on_gpu and not varying


@dataclass(frozen=True)
class FFNSpec:
    """The static part of one expert FFN call (hashable: a ``jax.jit`` static argument).

    Attributes:
        activation: the :class:`moeyard.Activation`.
        interleaved: gate/up columns interleaved (gpt-oss).
        transposed: weights stored ``[E, in, out]`` (gpt-oss).
        drop_invalid: pairs with ids outside ``[0, E)`` contribute nothing (else their weight is NaN).
        num_experts: E.
        gmm: the grouped GEMM choice (``MOEYARD_JAX_GMM``'s values); None: read the variable when
            :func:`routed_ffn` is called.
        recipe: an FP8 training recipe (:class:`moeyard.quant.Recipe`), emulated (:func:`scaled_mm`); None:
            the compute dtype's GEMMs.
        lora_scales: ``(s_up, s_down)``, each a LoRA adapter's scale or None where the projection has none
            (the factors are :func:`routed_ffn`'s ``lora`` argument).
    """

    activation: Activation
    interleaved: bool
    transposed: bool
    drop_invalid: bool
    num_experts: int
    gmm: str | None = None
    recipe: Recipe | None = None
    lora_scales: tuple = (None, None)

    @property
    def has_lora(self) -> bool:
        return any(s is not None for s in self.lora_scales)


def mm(rows, w, group_sizes, transposed: bool, choice: str | None = None):
    """``rows [R, in]`` -> ``[R, out]``: the rows of group e times expert e's weight (``w [E, out, in]``,
    or ``[E, in, out]`` when ``transposed``); rows past the last group give zeros. ``choice``: the grouped
    GEMM (module docstring; None: ``MOEYARD_JAX_GMM``)."""
    if use_pallas(rows, w, choice):
        return gmm(rows, w, group_sizes, transposed)
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [1 if transposed else 2]), ([], [])), **_RAGGED
    )
    return jax.lax.ragged_dot_general(rows, w.astype(rows.dtype), group_sizes, dims, precision=precision(rows.dtype))


def mm_t(g, w, group_sizes, transposed: bool, choice: str | None = None):
    """``g [R, out]`` -> ``[R, in]``: the rows of group e times expert e's weight transposed (the
    input gradient of :func:`mm`); ``choice`` as :func:`mm`'s."""
    if use_pallas(g, w, choice):
        return gmm_t(g, w, group_sizes, transposed)
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2 if transposed else 1]), ([], [])), **_RAGGED
    )
    return jax.lax.ragged_dot_general(g, w.astype(g.dtype), group_sizes, dims, precision=precision(g.dtype))


def add_bias(y, bias, row_experts):
    """``y [R, out] + bias[expert of each row]`` (rows past the last expert: none), added in float32
    (float64) and rounded once, so the bias gradient is summed in float32 as on the PyTorch side."""
    if bias is None:
        return y
    acc = accumulation_dtype(y.dtype)
    padded = jnp.concatenate([bias.astype(acc), jnp.zeros((1, bias.shape[1]), acc)])  # row E: no bias
    return (y.astype(acc) + padded[row_experts]).astype(y.dtype)


def grouped_ffn(rows, group_sizes, row_experts, up, b_up, down, b_down, spec: FFNSpec, lora=(None, None)):
    """``rows [R, H]`` (expert-major, ``group_sizes [E]``) -> ``(y [R, H], h [R, N1])``: each expert's
    ``down(act(up(rows)))`` with biases; rows past the last group give zeros (and no gradient). Under
    ``spec.recipe`` both projections are :func:`scaled_mm` (the biases stay in the compute dtype). ``lora``:
    each projection's factors ``(A [E, r, in], B [E, out, r])`` or None, scaled by ``spec.lora_scales``
    (:func:`low_rank_term`)."""
    if spec.recipe is None:
        base = partial(mm, transposed=spec.transposed, choice=spec.gmm)
    else:
        base = lambda r, w, gs: scaled_mm(r, w, gs, spec.transposed, spec.gmm, spec.recipe)  # noqa: E731

    def proj(r, w, factors, scale):
        y = base(r, w, group_sizes)
        return y if factors is None else y + low_rank_term(r, factors, scale, group_sizes)

    h = add_bias(proj(rows, up, lora[0], spec.lora_scales[0]), b_up, row_experts)
    a = apply_activation(spec.activation, h, interleaved=spec.interleaved)
    y = add_bias(proj(a, down, lora[1], spec.lora_scales[1]), b_down, row_experts)
    return y, h


def low_rank_term(rows, factors, scale: float, group_sizes):
    """``s (rows A_e^T) B_e^T`` ``[R, out]`` for ``factors = (A [E, r, in], B [E, out, r])``: two thin grouped
    GEMMs (``ragged_dot``, in the rows' dtype), rows past the last group zero."""
    a, b = factors
    z = mm(rows, a, group_sizes, False, "ragged_dot")  # [R, r]
    return (scale * mm(z, b, group_sizes, False, "ragged_dot")).astype(rows.dtype)


def _forward(spec: FFNSpec, x, topk_ids, topk_weights, up, b_up, down, b_down, lora=(None, None)):
    plan = plan_unchecked(topk_ids, spec.num_experts)
    rows = permute_unchecked(x, plan)
    y, h = grouped_ffn(rows, plan.group_sizes, plan.row_experts(), up, b_up, down, b_down, spec, lora)
    return unpermute_unchecked(y, plan, topk_weights, spec.drop_invalid), (plan, h)


def routed_ffn(spec: FFNSpec, custom_vjp: bool, x, topk_ids, topk_weights, up, b_up, down, b_down, lora=(None, None)):
    """``out [T, H] = sum_k w[t, k] * FFN_{ids[t, k]}(x[t])`` (arguments checked by the caller);
    ``custom_vjp`` chooses the backward, ``spec.gmm`` (None: ``MOEYARD_JAX_GMM``, read now) the grouped
    GEMM (module docstring); ``lora``: the projections' LoRA factors (:func:`grouped_ffn`).

    Raises:
        ValueError: ``MOEYARD_JAX_GMM`` (or ``spec.gmm``) is none of ``auto``, ``pallas``, ``ragged_dot``.
    """
    spec = replace(spec, gmm=gmm_choice() if spec.gmm is None else check_choice(spec.gmm))
    return _routed_ffn(spec, custom_vjp, x, topk_ids, topk_weights, up, b_up, down, b_down, lora)


@partial(jax.jit, static_argnums=(0, 1))
def _routed_ffn(spec: FFNSpec, custom_vjp: bool, x, topk_ids, topk_weights, up, b_up, down, b_down, lora):
    # a recipe's GEMMs carry their own VJPs (scaled_mm); LoRA terms are differentiated by JAX
    if custom_vjp and spec.recipe is None and not spec.has_lora:
        return _routed_ffn_vjp(spec, x, topk_ids, topk_weights, up, b_up, down, b_down)
    return _forward(spec, x, topk_ids, topk_weights, up, b_up, down, b_down, lora)[0]


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _routed_ffn_vjp(spec, x, topk_ids, topk_weights, up, b_up, down, b_down):
    return _forward(spec, x, topk_ids, topk_weights, up, b_up, down, b_down)[0]


def _vjp_fwd(spec, x, topk_ids, topk_weights, up, b_up, down, b_down):
    out, (plan, h) = _forward(spec, x, topk_ids, topk_weights, up, b_up, down, b_down)
    vma = _Static(tuple(varying_axes(a) for a in (x, topk_weights, up, b_up, down, b_down)))
    return out, (x, topk_weights, up, b_up, down, b_down, plan, h, vma)


def _vjp_bwd(spec: FFNSpec, res, dout):
    x, w, up, b_up, down, b_down, plan, h, vma = res
    T, K = plan.num_tokens, plan.top_k
    acc = accumulation_dtype(x.dtype)
    gs, re = plan.group_sizes, plan.row_experts()
    rows = permute_unchecked(x, plan)
    a, act_vjp = jax.vjp(lambda v: apply_activation(spec.activation, v, interleaved=spec.interleaved), h)
    row_tokens = plan.row_tokens()  # T for pad rows and invalid pairs
    dout_rows = jnp.concatenate([dout, jnp.zeros((1, dout.shape[1]), dout.dtype)])[row_tokens]  # [R, H]
    pair_w = jnp.where(plan.valid, w.reshape(-1).astype(acc), 0)
    w_rows = jnp.zeros(plan.num_rows, acc).at[plan.pair_rows].set(pair_w)  # 0 for pad rows, invalid pairs
    g = mm_t(dout_rows, down, gs, spec.transposed, spec.gmm)  # [R, I]: dout[t] W_down_e
    dw_rows = jnp.sum(g.astype(acc) * a.astype(acc), axis=-1)
    if b_down is not None:
        b_rows = jnp.concatenate([b_down.astype(acc), jnp.zeros((1, b_down.shape[1]), acc)])[re]
        dw_rows = dw_rows + jnp.sum(dout_rows.astype(acc) * b_rows, axis=-1)
    dw = jnp.where(plan.valid, dw_rows[plan.pair_rows], 0).reshape(T, K).astype(w.dtype)
    dy = (dout_rows.astype(acc) * w_rows[:, None]).astype(x.dtype)
    da = (g.astype(acc) * w_rows[:, None]).astype(x.dtype)
    d_down = _weight_grad(a, dy, down, gs, spec.transposed, spec.gmm)
    dh = act_vjp(da)[0]
    d_rows = mm_t(dh, up, gs, spec.transposed, spec.gmm)
    d_up = _weight_grad(rows, dh, up, gs, spec.transposed, spec.gmm)
    dx = jnp.zeros((T + 1, x.shape[1]), acc).at[row_tokens].add(d_rows.astype(acc))[:T].astype(x.dtype)
    cts = (dx, dw, d_up, _bias_grad(dh, b_up, re), d_down, _bias_grad(dy, b_down, re))
    dx, dw, d_up, d_b_up, d_down, d_b_down = map(match_varying, cts, vma.value)
    return dx, None, dw, d_up, d_b_up, d_down, d_b_down


# ---------------------------------------------------------------------------------- an FP8 recipe, emulated


def _fq_weight(w, blocks, mode: str, transposed: bool, along_in: bool):
    """``w`` (``[E, out, in]``, or ``[E, in, out]`` when ``transposed``) fake-quantised (:func:`.fp8.fake_quantize`)
    along its input axis (``along_in``: the forward's contraction) or its output axis (the input gradient's),
    returned as stored."""
    swap = transposed == along_in  # the contraction axis is the middle one
    w = jnp.swapaxes(w, 1, 2) if swap else w
    w = fake_quantize(w, blocks, mode)
    return jnp.swapaxes(w, 1, 2) if swap else w


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def scaled_mm(rows, w, group_sizes, transposed: bool, choice: str, recipe: Recipe):
    """:func:`mm` under an FP8 recipe, emulated, as :class:`moeyard.experts.scaled.Emulated` does: every GEMM
    of forward and backward reads operands cast to e4m3 per the recipe's blocks and back (:mod:`.fp8`). The
    forward quantises along ``in`` (``rows``, and ``W_e`` along its input axis). The input gradient quantises
    along ``out`` (``dy`` rows, ``W_e^T``). The weight gradient quantises along each expert's tokens (``dy^T``
    and ``rows^T``, the blocks restarting at each expert), or runs in the compute dtype when the recipe's
    ``wgrad`` is None. The recipe's numerics, not its speed: the GEMMs run in the operands' dtype."""
    return _scaled_forward(rows, w, group_sizes, transposed, choice, recipe)


def _scaled_forward(rows, w, group_sizes, transposed, choice, recipe):
    a, b = recipe.forward
    wq = _fq_weight(w, b, recipe.scale, transposed, along_in=True)
    return mm(fake_quantize(rows, a, recipe.scale), wq, group_sizes, transposed, choice)


def _scaled_fwd(rows, w, group_sizes, transposed, choice, recipe):
    return _scaled_forward(rows, w, group_sizes, transposed, choice, recipe), (rows, w, group_sizes)


def _scaled_bwd(transposed, choice, recipe, res, g):
    rows, w, group_sizes = res
    a, b = recipe.dgrad
    wq = _fq_weight(w, b, recipe.scale, transposed, along_in=False)
    dx = mm_t(fake_quantize(g, a, recipe.scale), wq, group_sizes, transposed, choice)
    lhs, ct = rows, g
    if recipe.wgrad is not None:  # along each expert's tokens: blocks restart at the experts' bounds
        a, b = recipe.wgrad
        offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(group_sizes).astype(jnp.int32)])
        ct = fake_quantize(g.T, a, recipe.scale, offsets).T
        lhs = fake_quantize(rows.T, b, recipe.scale, offsets).T
    return dx.astype(rows.dtype), _weight_grad(lhs, ct, w, group_sizes, transposed, choice), None


scaled_mm.defvjp(_scaled_fwd, _scaled_bwd)


@jax.tree_util.register_static
@dataclass(frozen=True)
class _Static:
    """Static data among the residuals (no leaves)."""

    value: tuple


def _weight_grad(lhs, ct, w, group_sizes, transposed: bool, choice: str | None = None):
    """The gradient of :func:`mm`'s weight for cotangent ``ct``, in ``w``'s dtype: Pallas's :func:`.gmm.tgmm`,
    or JAX's own transpose of ``ragged_dot_general`` (the forward product it traces is dead code under
    ``jit``); ``choice`` as :func:`mm`'s."""
    if use_pallas(lhs, ct, choice):
        return tgmm(lhs, ct, group_sizes, transposed, out_dtype=w.dtype)
    return jax.vjp(lambda v: mm(lhs, v, group_sizes, transposed, "ragged_dot"), w)[1](ct)[0]


def _bias_grad(ct, bias, row_experts):
    """``[E, out]`` sum of ``ct``'s rows per expert in float32 (float64), in ``bias``'s dtype."""
    if bias is None:
        return None
    acc = accumulation_dtype(ct.dtype)
    E = bias.shape[0]
    summed = jnp.zeros((E + 1, ct.shape[1]), acc).at[row_experts].add(ct.astype(acc))
    return summed[:E].astype(bias.dtype)


_routed_ffn_vjp.defvjp(_vjp_fwd, _vjp_bwd)
