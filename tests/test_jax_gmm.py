"""moeyard.jax.gmm (the Pallas grouped GEMMs) against ``jax.lax.ragged_dot_general``, in Pallas's interpret
mode on the CPU: ``gmm``, ``gmm_t``, ``tgmm`` and the gradients through ``gmm``'s custom VJP in both weight
layouts, with empty experts, all rows to one expert, rows past the last group, sizes that are not
multiples of the tiles, one row and one expert; then the expert FFN with ``MOEYARD_JAX_GMM=pallas``
against the default path, and the choice's rules and errors.

Legend: R rows, E experts, ``in`` / ``out`` the weight's sizes.
"""

import pytest

pytest.importorskip("jax")

from jax_flags import set_xla_flags  # noqa: E402

set_xla_flags()  # before JAX starts its backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, PartitionSpec as P  # noqa: E402

import moeyard.jax as mj  # noqa: E402
from moeyard.jax import ffn  # noqa: E402
from moeyard.jax.gmm import TileConfig, gmm, gmm_t, tgmm, tile_table  # noqa: E402

HIGHEST = jax.lax.Precision.HIGHEST

# (R, in, out, group_sizes)
CASES = [
    pytest.param(37, 200, 72, [5, 0, 20, 7], id="ragged-empty-tail-unaligned"),
    pytest.param(24, 16, 40, [0, 0, 24, 0], id="all-to-one-expert"),
    pytest.param(1, 8, 24, [0, 1, 0], id="one-row"),
    pytest.param(19, 33, 17, [19], id="E1"),
    pytest.param(6, 16, 16, [0, 0], id="all-rows-past-the-groups"),
]
LAYOUTS = [pytest.param(False, id="standard"), pytest.param(True, id="transposed")]


def _ref_mm(rows, w, gs, transposed, t_in=False):
    """``ragged_dot_general`` in float32 (``t_in``: contract w's output dimension, as gmm_t)."""
    contract = (1 if transposed else 2) if not t_in else (2 if transposed else 1)
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [contract]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
    )
    return jax.lax.ragged_dot_general(rows, w, gs, dims, precision=HIGHEST)


def _case(R, n_in, n_out, E, transposed, dtype, seed=0):
    g = np.random.default_rng(seed)
    w_shape = (E, n_in, n_out) if transposed else (E, n_out, n_in)
    arrays = (
        g.standard_normal((R, n_in)),
        g.standard_normal(w_shape) / np.sqrt(n_in),
        g.standard_normal((R, n_out)),
        g.standard_normal((R, n_out)),
    )
    return [jnp.asarray(a, dtype) for a in arrays]


def _all_products(fwd, fwd_t, wgrad, transposed):
    """One jitted function: the forward, the input gradient product, the weight gradient product and the
    autodiff gradients of ``sum(fwd(x, w) * probe)``."""

    @jax.jit
    def run(x, w, gs, g, probe):
        grads = jax.grad(lambda x, w: jnp.sum(fwd(x, w, gs, transposed).astype(jnp.float32) * probe), (0, 1))(x, w)
        return fwd(x, w, gs, transposed), fwd_t(g, w, gs, transposed), wgrad(x, g, gs, transposed), *grads

    return run


def _ref_wgrad(x, ct, gs, transposed):
    E = gs.shape[0]
    w_shape = (E, x.shape[1], ct.shape[1]) if transposed else (E, ct.shape[1], x.shape[1])
    w0 = jnp.zeros(w_shape, x.dtype)
    return jax.vjp(lambda v: _ref_mm(x, v, gs, transposed), w0)[1](ct)[0]


def _check_against_ragged_dot(R, n_in, n_out, sizes, transposed, dtype, tol):
    gs = jnp.asarray(sizes, jnp.int32)
    x, w, g, probe = _case(R, n_in, n_out, len(sizes), transposed, dtype)
    got = _all_products(gmm, gmm_t, tgmm, transposed)(x, w, gs, g, probe.astype(jnp.float32))
    f32 = [a.astype(jnp.float32) for a in (x, w, g, probe)]
    want = _all_products(_ref_mm, lambda g, w, gs, t: _ref_mm(g, w, gs, t, t_in=True), _ref_wgrad, transposed)(
        f32[0], f32[1], gs, f32[2], f32[3]
    )
    names = ("gmm", "gmm_t", "tgmm", "grad rows", "grad w")
    for name, a, b in zip(names, got, want, strict=True):
        assert a.shape == b.shape and a.dtype == dtype, (name, a.shape, b.shape, a.dtype)
        a, b = np.asarray(a, np.float32), np.asarray(b)
        scale = max(np.abs(b).max(), 1.0)
        np.testing.assert_allclose(a, b, rtol=0, atol=tol * scale, err_msg=name)
    total = min(sum(sizes), R)
    assert np.all(np.asarray(got[0])[total:] == 0) and np.all(np.asarray(got[1])[total:] == 0)
    assert np.all(np.asarray(got[3])[total:] == 0)
    empty = np.asarray(sizes) == 0
    assert np.all(np.asarray(got[2])[empty] == 0) and np.all(np.asarray(got[4])[empty] == 0)


@pytest.mark.parametrize("transposed", LAYOUTS)
@pytest.mark.parametrize("R,n_in,n_out,sizes", CASES)
def test_gmm_float32(R, n_in, n_out, sizes, transposed):
    """float32 operands (float32 products in interpret mode): equal to ragged_dot up to summation order."""
    _check_against_ragged_dot(R, n_in, n_out, sizes, transposed, jnp.float32, 1e-5)


@pytest.mark.parametrize("transposed", LAYOUTS)
def test_gmm_bfloat16(transposed):
    """bfloat16 operands, float32 sums, bfloat16 results: against ragged_dot in float32 on the same
    (bfloat16) values, to bfloat16's rounding of the results."""
    _check_against_ragged_dot(37, 200, 72, [5, 0, 20, 7], transposed, jnp.bfloat16, 1e-2)


def test_tile_table_covers_every_row_once():
    """Random group sizes (zeros among them, sums up to R): each row in exactly one used entry, of its group
    (E for the tail), tiles at most BM rows; unused entries empty."""
    g = np.random.default_rng(0)
    E, R = 6, 48
    table = jax.jit(tile_table, static_argnums=(1, 2))
    for trial in range(30):
        bm = (1, 4, 16)[trial % 3]
        sizes = g.integers(0, 9, E) * (g.random(E) < 0.7)
        if trial % 5 == 0:
            sizes[-1] += R - sizes.sum()  # no tail
        expert, start, end = (np.asarray(a) for a in table(jnp.asarray(sizes, jnp.int32), R, bm))
        assert expert.shape == (-(-R // bm) + E,)
        owner = np.full(R, -1)
        bounds = np.concatenate([[0], np.cumsum(sizes), [R]])
        for e, s, t in zip(expert, start, end, strict=True):
            if e == E + 1:
                assert s == t == 0, trial
                continue
            assert 0 < t - s <= bm and bounds[e] <= s and t <= bounds[e + 1], (trial, e, s, t)
            assert np.all(owner[s:t] == -1), trial
            owner[s:t] = e
        np.testing.assert_array_equal(owner, np.searchsorted(bounds[1:-1], np.arange(R), side="right"))


def test_larger_tiles_than_the_problem():
    """A config whose tiles exceed every size, and one of tiles of one element per step."""
    gs = jnp.asarray([3, 0, 2], jnp.int32)
    x, w, _, _ = _case(7, 5, 6, 3, False, jnp.float32)
    want = np.asarray(_ref_mm(x, w, gs, False))
    for cfg in (TileConfig(block_m=64, block_n=64, block_k=64), TileConfig(block_m=1, block_n=2, block_k=1)):
        np.testing.assert_allclose(np.asarray(gmm(x, w, gs, config=cfg)), want, rtol=0, atol=1e-5)


def test_gmm_errors():
    x, w = jnp.ones((4, 8), jnp.bfloat16), jnp.ones((2, 6, 8), jnp.bfloat16)
    gs = jnp.asarray([2, 2], jnp.int32)
    with pytest.raises(ValueError, match="^rows"):
        gmm(jnp.ones((4, 7), jnp.bfloat16), w, gs)
    with pytest.raises(TypeError, match="^rows"):
        gmm(jnp.ones((4, 8), jnp.int32), w, gs)
    with pytest.raises(ValueError, match="^group_sizes"):
        gmm(x, w, jnp.asarray([4], jnp.int32))
    with pytest.raises(ValueError, match="^g"):
        gmm_t(x, w, gs)
    with pytest.raises(ValueError, match="^ct"):
        tgmm(x, jnp.ones((3, 6), jnp.bfloat16), gs)
    with pytest.raises(ValueError, match="^block_m"):
        TileConfig(block_m=48)
    with pytest.raises(TypeError, match="^config"):
        gmm(x, w, gs, config=dict(block_m=16))


# ---- the expert FFN: MOEYARD_JAX_GMM ------------------------------------------------------------------


def _experts_grads(case, ids, probe, **kw):
    names = list(case)

    def loss(*leaves):
        d = dict(zip(names, leaves, strict=True))
        out = mj.experts(
            d["x"], ids, d["w"], d["up"], d["down"], gate_up_bias=d.get("b_up"), down_bias=d.get("b_down"), **kw
        )
        return jnp.sum(out.astype(jnp.float32) * probe), out

    grads, out = jax.grad(loss, argnums=tuple(range(len(names))), has_aux=True)(*case.values())
    return {"out": out, **{f"grad.{n}": g for n, g in zip(names, grads, strict=True)}}


def _experts_case(transposed, T=11, K=2, E=4, H=24, I=20, seed=0):
    g = np.random.default_rng(seed)
    up = g.standard_normal((E, 2 * I, H)) / np.sqrt(H)
    down = g.standard_normal((E, H, I)) / np.sqrt(I)
    if transposed:
        up, down = up.transpose(0, 2, 1), down.transpose(0, 2, 1)
    case = dict(x=g.standard_normal((T, H)), w=g.random((T, K)) + 0.1, up=up, down=down)
    if transposed:
        case.update(b_up=g.standard_normal((E, 2 * I)) * 0.3, b_down=g.standard_normal((E, H)) * 0.3)
    ids = np.stack([g.permutation(E - 1)[:K] for _ in range(T)])  # expert E - 1 gets nothing
    probe = jnp.asarray(g.standard_normal((T, H)), jnp.float32)
    return {k: jnp.asarray(v, jnp.bfloat16) for k, v in case.items()}, jnp.asarray(ids, jnp.int32), probe


@pytest.mark.parametrize(
    "transposed,custom_vjp,activation,recipe",
    [
        (False, True, "swiglu", None),
        (False, False, "swiglu", None),
        (True, True, "clamped_swiglu", None),
        (False, True, "swiglu", "fp8_rowwise"),
        (True, True, "clamped_swiglu", "mxfp8"),
    ],
    ids=[
        "standard-custom_vjp",
        "standard-autodiff",
        "transposed-interleaved-biases",
        "fp8_rowwise",
        "transposed-mxfp8",
    ],
)
def test_experts_pallas_equals_default(monkeypatch, transposed, custom_vjp, activation, recipe):
    """bfloat16: output and every gradient with the Pallas GEMMs equal the default (ragged_dot on the CPU)
    path's to bfloat16 rounding, also under an FP8 recipe (its fake-quantised operands into the Pallas GEMMs,
    forward and backward); the Pallas path did run (pallas_call in the jaxpr)."""
    case, ids, probe = _experts_case(transposed)
    kw = dict(custom_vjp=custom_vjp, activation=activation, transposed=transposed, interleaved=transposed)
    kw.update({} if recipe is None else dict(recipe=recipe))
    monkeypatch.delenv(ffn.GMM_ENV, raising=False)
    want = _experts_grads(case, ids, probe, **kw)
    monkeypatch.setenv(ffn.GMM_ENV, "pallas")
    got = _experts_grads(case, ids, probe, **kw)
    assert "pallas_call" in str(jax.make_jaxpr(lambda c: _experts_grads(c, ids, probe, **kw))(case))
    for name, b in want.items():
        a, b = np.asarray(got[name], np.float32), np.asarray(b, np.float32)
        assert got[name].dtype == want[name].dtype and np.isfinite(a).all(), name
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-2 * max(np.abs(b).max(), 1.0), err_msg=name)
    assert np.all(np.asarray(got["grad.down"])[-1] == 0)  # the expert without rows


def _uses_pallas(dtype):
    x, w = jnp.ones((5, 8), dtype), jnp.ones((5, 2), dtype)
    up, down = jnp.ones((4, 8, 8), dtype), jnp.ones((4, 8, 4), dtype)
    ids = jnp.zeros((5, 2), jnp.int32).at[:, 1].set(1)
    f = jax.grad(lambda x: mj.experts(x, ids, w, up, down).astype(jnp.float32).sum())
    return "pallas_call" in str(jax.make_jaxpr(f)(x))


def test_gmm_choice(monkeypatch):
    """``auto`` (unset) is ragged_dot on the CPU, ``pallas`` runs bfloat16 / float16 through Pallas and
    keeps ragged_dot for float32, ``ragged_dot`` forces it; values are read on each call."""
    monkeypatch.delenv(ffn.GMM_ENV, raising=False)
    assert ffn.gmm_choice() == "auto" and not _uses_pallas(jnp.bfloat16)
    monkeypatch.setenv(ffn.GMM_ENV, "pallas")
    assert _uses_pallas(jnp.bfloat16) and _uses_pallas(jnp.float16) and not _uses_pallas(jnp.float32)
    monkeypatch.setenv(ffn.GMM_ENV, "ragged_dot")
    assert not _uses_pallas(jnp.bfloat16)
    monkeypatch.setenv(ffn.GMM_ENV, "auto")
    assert not _uses_pallas(jnp.bfloat16)


@pytest.mark.parametrize("choice", ["auto", "pallas"])
@pytest.mark.parametrize("backend", ["gpu", "cpu"])
def test_gmm_choice_inside_shard_map(monkeypatch, choice, backend):
    """Operands varying over a mesh axis (the expert-parallel path) keep ragged_dot under ``auto`` on a GPU,
    and under ``pallas`` off GPUs; outside ``jax.shard_map`` ``auto`` takes Pallas on a GPU only."""
    monkeypatch.setattr(ffn.jax, "default_backend", lambda: backend)
    rows, w = jnp.ones((4, 8), jnp.bfloat16), jnp.ones((2, 8, 8), jnp.bfloat16)
    outside = ffn.use_pallas(rows, w, choice)
    monkeypatch.setattr(ffn, "varying_axes", lambda a: frozenset({"ep"}))
    inside = ffn.use_pallas(rows, w, choice)
    assert outside == (choice == "pallas" or backend == "gpu")
    assert inside == (choice == "pallas" and backend == "gpu")


def test_gmm_choice_invalid(monkeypatch):
    monkeypatch.setenv(ffn.GMM_ENV, "triton")
    with pytest.raises(ValueError, match=f"^{ffn.GMM_ENV}.*'triton'"):
        _uses_pallas(jnp.bfloat16)


def _one_device_mesh():
    return jax.make_mesh((1,), ("ep",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])


def test_shard_map_traces_for_gpus_and_falls_back_in_interpret_mode(monkeypatch):
    """Inside ``jax.shard_map``: the compiled (GPU) path traces, its output typed varying and a replicated
    weight's gradient summed over the axis; the interpreter cannot run there, so the expert FFN keeps
    ragged_dot under ``pallas`` on the CPU (and ``gmm`` itself says why)."""
    x, w = jnp.ones((32, 16), jnp.bfloat16), jnp.ones((2, 16, 16), jnp.bfloat16)
    gs = jnp.asarray([8, 16], jnp.int32)

    def grads(interpret):
        f = jax.grad(lambda x, w: gmm(x, w, gs, interpret=interpret).astype(jnp.float32).sum(), (0, 1))
        return jax.shard_map(f, mesh=_one_device_mesh(), in_specs=(P("ep"), P()), out_specs=(P("ep"), P()))

    jaxpr = str(jax.make_jaxpr(grads(False))(x, w))
    assert jaxpr.count("pallas_call") == 3 and "psum" in jaxpr
    with pytest.raises(NotImplementedError, match="interpret mode"):
        jax.make_jaxpr(grads(True))(x, w)

    monkeypatch.setenv(ffn.GMM_ENV, "pallas")
    ids, tw = jnp.zeros((4, 1), jnp.int32), jnp.ones((4, 1), jnp.bfloat16)
    up, down = jnp.ones((2, 8, 16), jnp.bfloat16), jnp.ones((2, 16, 4), jnp.bfloat16)

    def local(x, up, down):
        return mj.ep_experts(x, ids, tw, up, down, axis_name="ep")

    sharded = jax.shard_map(local, mesh=_one_device_mesh(), in_specs=(P("ep"),) * 3, out_specs=P("ep"))
    assert "pallas_call" not in str(jax.make_jaxpr(sharded)(jnp.ones((4, 16), jnp.bfloat16), up, down))
