"""moeyard.jax against moeyard (PyTorch, the ``loop`` oracle): the same layer with the same weights and
inputs gives the same outputs, routing, losses and every gradient, in float32 and in float64 (to 1e-10);
the stages one by one; the custom VJP against plain autodiff; the same errors for bad input.

Legend: B sequences, S tokens each, T = B * S, H hidden size, I intermediate size, E experts, K top-k.
"""

import subprocess
import sys

import pytest

pytest.importorskip("jax")
pytest.importorskip("flax")

from jax_parity import assert_parity, jax_layer, run_jax, run_torch, tolerance, torch_layer  # noqa: E402  (sets XLA_FLAGS)

# isort: split
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from flax import nnx  # noqa: E402

import moeyard  # noqa: E402
import moeyard.jax as mj  # noqa: E402
from moeyard import MoEConfig  # noqa: E402

H, I = 16, 8
LOSS = dict(aux_loss_coef=0.1, seq_aux_loss_coef=0.05, z_loss_coef=0.01)
DTYPES = [pytest.param(torch.float64, id="float64"), pytest.param(torch.float32, id="float32")]

# every routing variant of moeyard.route and every activation, each in at least one model family's block
LAYERS = [
    pytest.param(dict(num_experts=8, top_k=2, **LOSS), id="qwen3-swiglu"),
    pytest.param(
        dict(num_experts=8, top_k=2, topk_before_score=True, activation="geglu", **LOSS), id="topk_first-geglu"
    ),
    pytest.param(dict(num_experts=8, top_k=2, norm_topk_prob=False, activation="reglu", **LOSS), id="olmoe-reglu"),
    pytest.param(
        dict(
            num_experts=8,
            top_k=4,
            score_func="sigmoid",
            n_group=4,
            topk_group=2,
            score_correction_bias=True,
            routed_scaling_factor=2.5,
            num_shared_experts=1,
            **LOSS,
        ),
        id="deepseek_v3-shared",
    ),
    pytest.param(
        dict(num_experts=8, top_k=3, score_func="sigmoid", score_correction_bias=True, activation="silu", **LOSS),
        id="sigmoid_bias-silu",
    ),
    pytest.param(
        dict(
            num_experts=12,
            top_k=4,
            score_func="sigmoid",
            n_group=6,
            topk_group=3,
            norm_topk_prob=False,
            activation="gelu",
            **LOSS,
        ),
        id="grouped_nonorm-gelu",
    ),
    pytest.param(
        dict(num_experts=6, top_k=2, score_func="sigmoid", n_group=6, topk_group=3, activation="relu"),
        id="groups_of_one-relu",
    ),
    pytest.param(
        dict(
            num_experts=4,
            top_k=2,
            topk_before_score=True,
            router_bias=True,
            expert_bias=True,
            activation="clamped_swiglu",
            activation_alpha=1.5,
            activation_limit=1.0,
            **LOSS,
        ),
        id="gpt_oss-clamped",
    ),
    pytest.param(
        dict(
            num_experts=4,
            top_k=1,
            score_func="sigmoid",
            topk_before_score=True,
            norm_topk_prob=False,
            num_shared_experts=1,
            **LOSS,
        ),
        id="llama4",
    ),
    pytest.param(
        dict(
            num_experts=8,
            top_k=2,
            score_func="sigmoid",
            topk_before_score=True,
            num_shared_experts=2,
            shared_intermediate_size=8,
            shared_expert_gate=True,
        ),
        id="sigmoid_topk_norm-gated_shared",
    ),
    pytest.param(dict(num_experts=5, top_k=5, activation="relu2", expert_bias=True, **LOSS), id="k_eq_E-relu2"),
    pytest.param(dict(num_experts=1, top_k=1), id="E1"),
]


def _check_layer(kw, dtype, shape, *, custom_vjp=True, edit=None):
    cfg = MoEConfig(hidden_size=H, intermediate_size=I, **kw)
    with jax.enable_x64(dtype == torch.float64):
        t = torch_layer(cfg, dtype)
        if edit is not None:
            edit(t)
        j = jax_layer(cfg, t, dtype, custom_vjp=custom_vjp)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(shape, generator=g, dtype=dtype)
        probe = torch.randn(shape, generator=g, dtype=dtype)
        ref = run_torch(t, x, probe)
        got = run_jax(j, x, probe)
        assert_parity(got, ref, tolerance(dtype))
    return ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kw", LAYERS)
def test_layer_parity(kw, dtype):
    """B = 2 sequences of 6 tokens: output, routing fields, the three losses and the gradients of x and
    every parameter (router included, through the weights and the losses); float64 to 1e-10, float32
    to 2e-5."""
    _check_layer(kw, dtype, (2, 6, H))


@pytest.mark.parametrize("kw", [LAYERS[0], LAYERS[7]])
def test_layer_parity_plain_autodiff(kw):
    """The same with the custom VJP off."""
    _check_layer(kw, torch.float64, (2, 6, H), custom_vjp=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_experts(dtype):
    """3 tokens, top-1 of 8 experts: at least 5 experts receive nothing (their gradients are zero)."""
    ref = _check_layer(dict(num_experts=8, top_k=1, expert_bias=True, **LOSS), dtype, (3, H))
    assert (ref["tokens_per_expert"] == 0).sum() >= 5
    empty = ref["tokens_per_expert"] == 0
    assert np.all(ref["grad.down_proj"][empty] == 0) and np.any(ref["grad.down_proj"][~empty] != 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_tokens_to_one_expert(dtype):
    """A router bias of +20 on expert 3: every token's top-1 is expert 3."""

    def edit(t):
        with torch.no_grad():
            t.router.bias.zero_()
            t.router.bias[3] = 20.0

    ref = _check_layer(
        dict(num_experts=4, top_k=1, router_bias=True, norm_topk_prob=False, **LOSS), dtype, (2, 5, H), edit=edit
    )
    assert np.all(ref["topk_ids"] == 3)


@pytest.mark.parametrize("shape", [(1, H), (0, H)], ids=["T1", "T0"])
def test_one_and_no_tokens(shape):
    _check_layer(dict(num_experts=4, top_k=2, **LOSS), torch.float64, shape)


# ---- the stages one by one ---------------------------------------------------------------------------


def _ids(T, K, E, seed=0, invalid=False):
    g = np.random.default_rng(seed)
    ids = np.stack([g.permutation(E)[:K] for _ in range(T)]).astype(np.int64)
    if invalid:
        ids[0, 0], ids[-1, -1] = -1, E  # the sentinels of expert parallelism
    return ids


@pytest.mark.parametrize("align", [1, 4])
def test_plan_permute_unpermute(align):
    """Every plan field, the permuted rows (pad rows zero) and the combine equal the PyTorch side's,
    with invalid ids among the valid ones."""
    T, K, E, Hs = 7, 3, 5, 4
    ids = _ids(T, K, E, invalid=True)
    x = np.random.default_rng(1).standard_normal((T, Hs)).astype(np.float32)
    w = np.random.default_rng(2).standard_normal((T, K)).astype(np.float32)
    tp = moeyard.make_plan(torch.from_numpy(ids), E, align=align)
    jp = mj.make_plan(jnp.asarray(ids, jnp.int32), E, align=align)
    assert jp.num_rows == tp.num_rows and jp.align == align
    for f in ("tokens_per_expert", "expert_offsets", "padded_offsets", "sort_order", "pair_rows", "valid"):
        np.testing.assert_array_equal(np.asarray(getattr(jp, f)), getattr(tp, f).numpy(), err_msg=f)
    np.testing.assert_array_equal(np.asarray(jp.row_experts()), tp.row_experts().numpy())
    rows = np.asarray(mj.permute(jnp.asarray(x), jp))
    np.testing.assert_array_equal(rows, moeyard.permute(torch.from_numpy(x), tp).numpy())
    y = np.random.default_rng(3).standard_normal(rows.shape).astype(np.float32)
    got = np.asarray(mj.unpermute(jnp.asarray(y), jp, jnp.asarray(w), drop_invalid=True))
    want = moeyard.unpermute(torch.from_numpy(y), tp, torch.from_numpy(w), drop_invalid=True).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    pairs = np.asarray(mj.unpermute(jnp.asarray(y), jp))
    np.testing.assert_array_equal(pairs, moeyard.unpermute(torch.from_numpy(y), tp).numpy())


def _experts_case(layout, activation, T=9, K=2, E=4, Hs=8, Is=6, dtype=np.float64, seed=0):
    """Inputs of one experts call, as NumPy arrays, in ``layout`` (standard, or gpt-oss's transposed)."""
    g = np.random.default_rng(seed)
    gated = activation in moeyard.activations.GATED
    n1 = 2 * Is if gated else Is
    up = g.standard_normal((E, n1, Hs)) / np.sqrt(Hs)
    down = g.standard_normal((E, Hs, Is)) / np.sqrt(Is)
    if layout == "transposed":
        up, down = up.transpose(0, 2, 1), down.transpose(0, 2, 1)
    case = dict(
        hidden_states=g.standard_normal((T, Hs)),
        topk_weights=g.random((T, K)) + 0.1,
        gate_up_proj=up,
        down_proj=down,
        gate_up_bias=g.standard_normal((E, n1)) * 0.3,
        down_bias=g.standard_normal((E, Hs)) * 0.3,
    )
    return {k: v.astype(dtype) for k, v in case.items()}, _ids(T, K, E, seed)


LORA_SCALING = {"gate_up_proj": 0.5, "down_proj": 2.0}  # the adapters' scales in the LoRA cases


def _lora(leaves):
    """``lora=`` of an experts call from the ``<proj>.lora_A`` / ``<proj>.lora_B`` leaves (None without)."""
    names = [k for k in LORA_SCALING if f"{k}.lora_A" in leaves]
    return {
        k: moeyard.ExpertLoRA(lora_A=leaves[f"{k}.lora_A"], lora_B=leaves[f"{k}.lora_B"], scaling=LORA_SCALING[k])
        for k in names
    } or None


def _torch_experts(case, ids, probe, **kw):
    leaves = {k: torch.from_numpy(v).requires_grad_() for k, v in case.items()}
    out = moeyard.experts(
        leaves["hidden_states"],
        torch.from_numpy(ids),
        leaves["topk_weights"],
        leaves["gate_up_proj"],
        leaves["down_proj"],
        gate_up_bias=leaves["gate_up_bias"],
        down_bias=leaves["down_bias"],
        backend="loop",
        lora=_lora(leaves),
        **kw,
    )
    (out * torch.from_numpy(probe)).sum().backward()
    return {"out": out.detach().numpy(), **{f"grad.{k}": v.grad.numpy() for k, v in leaves.items()}}


def _jax_experts(case, ids, probe, **kw):
    names = list(case)

    def loss(*leaves):
        d = dict(zip(names, leaves, strict=True))
        out = mj.experts(
            d["hidden_states"],
            jnp.asarray(ids, jnp.int32),
            d["topk_weights"],
            d["gate_up_proj"],
            d["down_proj"],
            gate_up_bias=d["gate_up_bias"],
            down_bias=d["down_bias"],
            lora=_lora(d),
            **kw,
        )
        return (out * probe).sum(), out

    grads, out = jax.jit(jax.grad(loss, argnums=tuple(range(len(names))), has_aux=True))(
        *[jnp.asarray(case[n]) for n in names]
    )
    return {"out": np.asarray(out), **{f"grad.{n}": np.asarray(g) for n, g in zip(names, grads, strict=True)}}


def _layout_case(layout, activation, interleaved):
    """``(case, ids, probe, kw)``: one experts call's inputs in ``layout`` and its keyword arguments."""
    case, ids = _experts_case(layout, activation)
    probe = np.random.default_rng(5).standard_normal(case["hidden_states"].shape)
    kw = dict(
        activation=moeyard.Activation(name=activation, limit=1.0),
        transposed=layout == "transposed",
        interleaved=interleaved,
    )
    return case, ids, probe, kw


@pytest.mark.parametrize(
    "layout,activation,interleaved",
    [
        ("standard", "swiglu", False),
        ("transposed", "clamped_swiglu", True),
        ("transposed", "geglu", False),
        ("standard", "relu2", False),
    ],
)
def test_experts_layouts(layout, activation, interleaved):
    """gpt-oss's transposed and interleaved layouts, with biases, in float64: output and every gradient."""
    with jax.enable_x64(True):
        case, ids, probe, kw = _layout_case(layout, activation, interleaved)
        ref = _torch_experts(case, ids, probe, **kw)
        for custom_vjp in (True, False):
            got = _jax_experts(case, ids, probe, custom_vjp=custom_vjp, **kw)
            assert_parity(got, ref, 1e-10)


@pytest.mark.parametrize("mode", ["float", "pow2", "e8m0", "e8m0_floor"])
def test_fake_quantize_matches_torch(mode):
    """moeyard.jax.fp8.fake_quantize against moeyard.quant.fp8's: rows, tiles, 128 x 128 and odd blocks (rows
    and columns no multiple of a block), zero blocks, a NaN, blocks restarting at segment bounds. Bit-equal
    with power-of-two scales; with float scales (XLA's float32 division) within two float32 ulps, but for the
    rare value the inexact quotient rounds to the next e4m3 step."""
    from moeyard.jax import fp8 as jfp8
    from moeyard.quant import fp8 as tfp8
    from moeyard.quant.fp8 import Blocks

    g = np.random.default_rng(3)
    t = (g.standard_normal((3, 70, 300)) * np.logspace(-3, 3, 300)).astype(np.float32)
    t[0, :5] = 0
    t[1, 7, 9] = np.nan
    cases = [(Blocks(b, m), None) for b, m in ((None, 1), (128, 1), (32, 1), (128, 128), (16, 4))]
    cases += [(Blocks(b), np.array([0, 40, 40, 170, 290], np.int32)) for b in (None, 32)]
    for blocks, offsets in cases:
        got = np.asarray(jfp8.fake_quantize(jnp.asarray(t), blocks, mode, None if offsets is None else offsets))
        want = tfp8.fake_quantize(
            torch.from_numpy(t), blocks, mode, None if offsets is None else torch.from_numpy(offsets)
        ).numpy()
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        ok = ~np.isnan(want)
        if mode == "float":  # the scale within two ulps; rarely a value one e4m3 step off
            rel = np.abs(got[ok] - want[ok]) / np.maximum(np.abs(want[ok]), 1e-30)
            assert (rel <= 3e-7).mean() > 0.999 and rel.max() <= 0.125, (blocks, (rel > 3e-7).sum(), rel.max())
        else:
            np.testing.assert_array_equal(got[ok], want[ok], err_msg=str(blocks))
    with pytest.raises(ValueError, match="scale mode"):
        jfp8.fake_quantize(jnp.asarray(t), Blocks(None), "int8")


@pytest.mark.parametrize("recipe", ["fp8_rowwise", "fp8_rowwise_gw_hp", "mxfp8", "fp8_blockwise"])
@pytest.mark.parametrize("layout", ["standard", "transposed"])
def test_experts_recipes_match_torch(recipe, layout):
    """An FP8 recipe, emulated: output and every gradient as moeyard.experts' emulated recipe on the loop
    oracle, float64, both backwards (1e-12; fp8_blockwise's float scales 2e-6), and visibly not the
    unquantised result."""
    activation = "swiglu" if layout == "standard" else "clamped_swiglu"
    with jax.enable_x64(True):
        case, ids, probe, kw = _layout_case(layout, activation, interleaved=layout == "transposed")
        ref = _torch_experts(case, ids, probe, recipe=recipe, **kw)
        plain = _jax_experts(case, ids, probe, **kw)
        for custom_vjp in (True, False):
            got = _jax_experts(case, ids, probe, custom_vjp=custom_vjp, recipe=recipe, **kw)
            assert_parity(got, ref, 2e-6 if recipe == "fp8_blockwise" else 1e-12)
        assert np.abs(plain["out"] - ref["out"]).max() > 1e-3
        assert np.abs(plain["grad.hidden_states"] - ref["grad.hidden_states"]).max() > 1e-3


def _with_lora(case, projections=("gate_up_proj", "down_proj"), rank=3, seed=7):
    """``case`` plus random LoRA factors in PEFT's layout (``lora_A [r*E, in]``, ``lora_B [out, r*E]``)."""
    g = np.random.default_rng(seed)
    E = case["down_proj"].shape[0]
    n1 = case["gate_up_bias"].shape[1]
    H = case["hidden_states"].shape[1]
    I = case["down_proj"].size // (E * H)
    sizes = {"gate_up_proj": (H, n1), "down_proj": (I, H)}
    out = dict(case)
    for name in projections:
        inp, o = sizes[name]
        out[f"{name}.lora_A"] = g.standard_normal((rank * E, inp)) / np.sqrt(inp)
        out[f"{name}.lora_B"] = g.standard_normal((o, rank * E)) / np.sqrt(rank)
    return out


@pytest.mark.parametrize(
    "layout,projections,recipe",
    [
        ("standard", ("gate_up_proj", "down_proj"), None),
        ("transposed", ("gate_up_proj", "down_proj"), None),
        ("standard", ("down_proj",), None),
        ("standard", ("gate_up_proj", "down_proj"), "mxfp8"),
    ],
)
def test_experts_lora_matches_torch(layout, projections, recipe):
    """LoRA adapters in PEFT's layout: output and every gradient (the factors' too) as moeyard.experts' on the
    loop oracle, float64, both backwards, both weight layouts, one adapter or two, under an emulated recipe
    (the adapter terms in the compute dtype on both sides); the adapters change the output."""
    activation = "swiglu" if layout == "standard" else "clamped_swiglu"
    with jax.enable_x64(True):
        base, ids, probe, kw = _layout_case(layout, activation, interleaved=layout == "transposed")
        case = _with_lora(base, projections)
        ref = _torch_experts(case, ids, probe, recipe=recipe, **kw)
        for custom_vjp in (True, False):
            got = _jax_experts(case, ids, probe, custom_vjp=custom_vjp, recipe=recipe, **kw)
            assert_parity(got, ref, 1e-12 if recipe else 1e-10)
        plain = _jax_experts(base, ids, probe, recipe=recipe, **kw)
        assert np.abs(plain["out"] - ref["out"]).max() > 1e-2


def test_experts_lora_factor_dtype():
    """float32 factors on bfloat16 weights: cast to the weights' dtype for the GEMMs, gradients in float32 (as
    on the PyTorch side), finite, and the output close to the float64 result."""
    case, ids, probe, kw = _layout_case("standard", "swiglu", interleaved=False)
    case = _with_lora(case)
    lowp = {k: v.astype(np.float32 if ".lora_" in k else jnp.bfloat16) for k, v in case.items()}
    got = _jax_experts(lowp, ids, probe.astype(jnp.bfloat16), **kw)
    assert got["grad.gate_up_proj.lora_A"].dtype == np.float32 and got["out"].dtype == jnp.bfloat16
    assert all(np.isfinite(np.asarray(v, np.float64)).all() for v in got.values())
    with jax.enable_x64(True):
        ref = _jax_experts(case, ids, probe, **kw)
    err = np.abs(np.asarray(got["out"], np.float64) - ref["out"]).max() / np.abs(ref["out"]).max()
    assert err < 3e-2, err


def test_layer_recipe_parity():
    """moeyard.jax.MoE(recipe=) against moeyard.MoE(recipe=) on the loop oracle, float64: output, routing
    and every gradient; a bad recipe is refused as on the PyTorch side."""
    cfg = MoEConfig(hidden_size=H, intermediate_size=I, num_experts=4, top_k=2, **LOSS)
    with jax.enable_x64(True):
        t = torch_layer(cfg, torch.float64)
        t.recipe = "mxfp8"
        j = jax_layer(cfg, t, torch.float64, recipe="mxfp8")
        g = torch.Generator().manual_seed(1)
        x = torch.randn((2, 6, H), generator=g, dtype=torch.float64)
        probe = torch.randn((2, 6, H), generator=g, dtype=torch.float64)
        assert_parity(run_jax(j, x, probe), run_torch(t, x, probe), 1e-10)
    with pytest.raises(ValueError, match="recipe"):
        mj.MoE(cfg, rngs=nnx.Rngs(0), recipe="fp4")
    with pytest.raises(TypeError, match="recipe"):
        mj.experts(
            *(jnp.zeros(s) for s in ((3, 8), (3, 1))),
            jnp.ones((3, 1)),
            jnp.zeros((2, 12, 8)),
            jnp.zeros((2, 8, 6)),
            recipe=3,
        )


@pytest.mark.parametrize(
    "lora", [dict(rank=3, alpha=6.0), dict(rank=2, rslora=True, targets=("down_proj",))], ids=["both", "down_rslora"]
)
def test_layer_lora_parity(lora):
    """moeyard.jax.MoE.add_lora against moeyard.MoE.add_lora (random B), float64: the state-dict names, the
    output, routing and every gradient (the factors' and the base's); merge_lora on both sides gives the
    adapted output; bad calls are refused."""
    cfg = MoEConfig(hidden_size=H, intermediate_size=I, num_experts=4, top_k=2, **LOSS)
    with jax.enable_x64(True):
        t = torch_layer(cfg, torch.float64)
        t.add_lora(**lora, freeze_base=False)
        with torch.no_grad():
            for adapter in t.lora.values():
                adapter.lora_B.weight.normal_(generator=torch.Generator().manual_seed(3))
        j = jax_layer(cfg, t, torch.float64, lora=lora)
        assert sorted(mj.state_dict(j)) == sorted(t.state_dict())
        assert [a.scaling for a in j.lora.values()] == [a.scaling for a in t.lora.values()]
        g = torch.Generator().manual_seed(1)
        x = torch.randn((2, 6, H), generator=g, dtype=torch.float64)
        probe = torch.randn((2, 6, H), generator=g, dtype=torch.float64)
        ref = run_torch(t, x, probe)
        assert_parity(run_jax(j, x, probe), ref, 1e-10)
        t.merge_lora()  # in place on the torch weights: the JAX layer loaded copies of them
        j.merge_lora()
        assert j.lora is None and t.lora is None
        merged = np.asarray(j(jnp.asarray(x.numpy())))
        np.testing.assert_allclose(merged, ref["y"], rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(merged, t(x).detach().numpy(), rtol=1e-10, atol=1e-10)
    layer = mj.MoE(cfg, rngs=nnx.Rngs(0)).add_lora(2, rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match="already has LoRA"):
        layer.add_lora(2, rngs=nnx.Rngs(1))
    for bad, match in ((dict(targets=("q_proj",)), "targets"), (dict(alpha=-1.0), "alpha"), (dict(), "rank")):
        with pytest.raises(ValueError, match=match):
            mj.MoE(cfg, rngs=nnx.Rngs(0)).add_lora(0 if match == "rank" else 2, rngs=nnx.Rngs(1), **bad)


def test_experts_drop_invalid():
    """Sentinel ids (-1, E) contribute nothing with drop_invalid, in both backwards."""
    with jax.enable_x64(True):
        case, _ = _experts_case("standard", "swiglu")
        ids = _ids(9, 2, 4, invalid=True)
        probe = np.random.default_rng(5).standard_normal(case["hidden_states"].shape)
        ref = _torch_experts(case, ids, probe, drop_invalid=True)
        for custom_vjp in (True, False):
            assert_parity(_jax_experts(case, ids, probe, drop_invalid=True, custom_vjp=custom_vjp), ref, 1e-10)


def test_invalid_ids_under_jit_give_nan_rows():
    """Under jit the ids are not read: the tokens routed to an invalid id get NaN rows, the others are exact."""
    case, _ = _experts_case("standard", "swiglu", dtype=np.float32)
    ids = _ids(9, 2, 4, invalid=True)
    args = [jnp.asarray(case[k]) for k in ("hidden_states", "topk_weights", "gate_up_proj", "down_proj")]
    out = np.asarray(jax.jit(lambda x, w, u, d, i: mj.experts(x, i, w, u, d))(*args, jnp.asarray(ids, jnp.int32)))
    bad = (ids < 0).any(1) | (ids >= 4).any(1)
    assert np.isnan(out[bad]).all() and np.isfinite(out[~bad]).all()


def test_custom_vjp_saves_memory():
    """What the backward keeps (the residuals the VJP closes over): with the custom VJP, the inputs, the
    plan and ``h [T*K, 2I]`` only; plain autodiff keeps at least the permuted rows and the pairs' outputs
    (``[T*K, H]`` each) on top. The GPU measurement of the peak: ``benchmarks/jax_gpu.py``."""
    T, K, E, Hs, Is = 64, 4, 8, 16, 8
    g = np.random.default_rng(0)
    x = jnp.asarray(g.standard_normal((T, Hs)), jnp.float32)
    ids = jnp.asarray(_ids(T, K, E), jnp.int32)
    w = jnp.asarray(g.random((T, K)), jnp.float32)
    up = jnp.asarray(g.standard_normal((E, 2 * Is, Hs)), jnp.float32)
    down = jnp.asarray(g.standard_normal((E, Hs, Is)), jnp.float32)

    def float_residual_bytes(custom_vjp):
        f = lambda x, w, u, d: mj.experts(x, ids, w, u, d, custom_vjp=custom_vjp)  # noqa: E731
        _, pullback = jax.vjp(f, x, w, up, down)
        return sum(a.nbytes for a in jax.tree_util.tree_leaves(pullback) if jnp.issubdtype(a.dtype, jnp.floating))

    inputs = sum(a.nbytes for a in (x, w, up, down))
    h = T * K * 2 * Is * 4
    assert float_residual_bytes(True) == inputs + h
    assert float_residual_bytes(False) >= inputs + h + 2 * T * K * Hs * 4


# ---- routing functions -------------------------------------------------------------------------------


def test_update_correction_bias():
    bias = np.array([0.1, -0.2, 0.0, 0.3], np.float32)
    load = np.array([5, 1, 3, 3], np.float32)
    got = mj.update_correction_bias(jnp.asarray(bias), jnp.asarray(load), rate=0.01)
    want = moeyard.update_correction_bias(torch.from_numpy(bias), torch.from_numpy(load), rate=0.01)
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=0, atol=1e-7)


def test_router_jitter():
    """Jitter draws from the key given: the same key gives the same routing, training differs from
    eval, and training without a key is an error naming ``rng``."""
    cfg = MoEConfig(num_experts=8, hidden_size=H, intermediate_size=I, top_k=2, router_jitter=0.5)
    g = np.random.default_rng(0)
    x, w = jnp.asarray(g.standard_normal((16, H)), jnp.float32), jnp.asarray(g.standard_normal((8, H)), jnp.float32)
    key = jax.random.key(0)
    a = mj.route(x, w, cfg, training=True, rng=key)
    b = mj.route(x, w, cfg, training=True, rng=key)
    c = mj.route(x, w, cfg)
    np.testing.assert_array_equal(np.asarray(a.topk_weights), np.asarray(b.topk_weights))
    assert not np.allclose(np.asarray(a.router_logits), np.asarray(c.router_logits))
    with pytest.raises(ValueError, match="^rng"):
        mj.route(x, w, cfg, training=True)
    layer = mj.MoE(cfg, rngs=nnx.Rngs(0, jitter=1))
    y1, y2 = layer(x), layer(x)  # the stream advances: two draws
    layer.eval()
    assert not np.allclose(np.asarray(y1), np.asarray(y2))
    np.testing.assert_array_equal(np.asarray(layer(x)), np.asarray(layer(x)))


# ---- bad input: the same errors as the PyTorch side ----------------------------------------------------


def _adapter(lora_A, lora_B, scaling=1.0, num_experts=None):
    return moeyard.ExpertLoRA(lora_A=lora_A, lora_B=lora_B, scaling=scaling, num_experts=num_experts)


def _bad_calls(lib, arr):
    """``(label, call)`` pairs of bad calls of ``lib`` (``moeyard`` or ``moeyard.jax``) on arrays made by ``arr``."""
    cfg = MoEConfig(num_experts=4, hidden_size=8, intermediate_size=4, top_k=2)
    x, w = arr((5, 8)), arr((5, 2))
    up, down = arr((4, 8, 8)), arr((4, 8, 4))
    ids = arr((5, 2), "int")
    bad_ids = arr((5, 2), "int", fill=4)
    return [
        ("ids float", lambda: lib.experts(x, w, w, up, down)),
        ("weights int", lambda: lib.experts(x, ids, ids, up, down)),
        ("x int", lambda: lib.experts(ids, ids, w, up, down)),
        ("x 3-D", lambda: lib.experts(arr((1, 5, 8)), ids, w, up, down)),
        ("down shape", lambda: lib.experts(x, ids, w, up, arr((4, 8, 5)))),
        ("up odd", lambda: lib.experts(x, ids, w, arr((4, 7, 8)), down)),
        ("up 2-D", lambda: lib.experts(x, ids, w, arr((8, 8)), down)),
        ("hidden size", lambda: lib.experts(arr((5, 6)), ids, w, up, down)),
        ("weights shape", lambda: lib.experts(x, ids, arr((5, 3)), up, down)),
        ("ids rows", lambda: lib.experts(x, arr((4, 2), "int"), w, up, down)),
        ("k > E", lambda: lib.experts(x, arr((5, 5), "int"), arr((5, 5)), up, down)),
        ("ids out of range", lambda: lib.experts(x, bad_ids, w, up, down)),
        ("activation", lambda: lib.experts(x, ids, w, up, down, activation="tanh")),
        (
            "interleaved plain",
            lambda: lib.experts(x, ids, w, arr((4, 4, 8)), down, activation="relu", interleaved=True),
        ),
        ("bias shape", lambda: lib.experts(x, ids, w, up, down, down_bias=arr((4, 7)))),
        ("lora not a dict", lambda: lib.experts(x, ids, w, up, down, lora=[1])),
        ("lora key", lambda: lib.experts(x, ids, w, up, down, lora={"q_proj": None})),
        ("lora entry", lambda: lib.experts(x, ids, w, up, down, lora={"down_proj": (arr((8, 4)), arr((8, 8)))})),
        (
            "lora_A shape",
            lambda: lib.experts(x, ids, w, up, down, lora={"down_proj": _adapter(arr((6, 4)), arr((8, 6)))}),
        ),
        (
            "lora_B shape",
            lambda: lib.experts(x, ids, w, up, down, lora={"gate_up_proj": _adapter(arr((8, 8)), arr((8, 4)))}),
        ),
        (
            "lora_A int",
            lambda: lib.experts(x, ids, w, up, down, lora={"down_proj": _adapter(arr((8, 4), "int"), arr((8, 8)))}),
        ),
        (
            "lora scaling",
            lambda: lib.experts(x, ids, w, up, down, lora={"down_proj": _adapter(arr((8, 4)), arr((8, 8)), "2")}),
        ),
        (
            "lora experts",
            lambda: lib.experts(
                x, ids, w, up, down, lora={"down_proj": _adapter(arr((8, 4)), arr((8, 8)), num_experts=8)}
            ),
        ),
        ("plan float ids", lambda: lib.make_plan(w, 4)),
        ("plan 1-D", lambda: lib.make_plan(arr((5,), "int"), 4)),
        ("plan experts", lambda: lib.make_plan(ids, 0)),
        ("plan align", lambda: lib.make_plan(ids, 4, align=0)),
        ("route weight", lambda: lib.route(x, arr((4, 6)), cfg)),
        ("route x int", lambda: lib.route(ids, arr((4, 8)), cfg)),
        ("route sequences", lambda: lib.route(x, arr((4, 8)), cfg, num_sequences=2)),
    ]


def _error(call):
    try:
        call()
    except (TypeError, ValueError) as ex:
        return type(ex), str(ex).split(":")[0]
    return None


def test_bad_input_same_errors():
    """Each bad call raises the same exception type naming the same argument on both sides."""
    rng = np.random.default_rng(0)

    def np_arr(shape, kind="float", fill=None):
        if kind == "int":
            return np.full(shape, fill, np.int64) if fill is not None else rng.integers(0, 2, shape)
        return rng.standard_normal(shape).astype(np.float32)

    torch_calls = _bad_calls(moeyard, lambda *a, **k: torch.from_numpy(np_arr(*a, **k)))
    jax_calls = _bad_calls(mj, lambda *a, **k: jnp.asarray(np_arr(*a, **k)))
    for (label, t_call), (_, j_call) in zip(torch_calls, jax_calls, strict=True):
        want = _error(t_call)
        assert want is not None, f"{label}: the PyTorch side raised nothing"
        assert _error(j_call) == want, f"{label}: {_error(j_call)} != {want}"


def test_layer_bad_input():
    cfg = MoEConfig(num_experts=4, hidden_size=8, intermediate_size=4, top_k=2)
    layer = mj.MoE(cfg, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="^x"):
        layer(jnp.ones((3, 7)))
    with pytest.raises(TypeError, match="^x"):
        layer(jnp.ones((3, 8), jnp.bfloat16))
    with pytest.raises(TypeError, match="^config"):
        mj.MoE({"num_experts": 4}, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="missing"):
        mj.load_state_dict(layer, {})
    state = mj.state_dict(layer)
    state["down_proj"] = np.zeros((4, 8, 5), np.float32)
    with pytest.raises(ValueError, match="down_proj"):
        mj.load_state_dict(layer, state)


# ---- imports -----------------------------------------------------------------------------------------


def test_imports():
    """``import moeyard`` imports neither jax nor flax; ``import moeyard.jax`` needs jax, not flax (until the
    layer is used); without them the errors say what to install."""
    code = (
        "import sys, moeyard\n"
        "assert 'jax' not in sys.modules and 'flax' not in sys.modules, 'moeyard imported jax'\n"
        "sys.modules['flax'] = None\n"
        "import moeyard.jax as mj\n"
        "mj.experts, mj.route, mj.ep_experts\n"
        "try:\n    mj.MoE\nexcept ImportError as ex:\n    assert \"pip install 'moeyard[jax]'\" in str(ex), ex\n"
        "else:\n    raise SystemExit('no ImportError for MoE without flax')\n"
        "for m in [m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'moeyard.jax'))]:\n"
        "    del sys.modules[m]\n"
        "sys.modules['jax'] = None\n"
        "try:\n    import moeyard.jax\nexcept ImportError as ex:\n    assert \"pip install 'moeyard[jax]'\" in str(ex), ex\n"
        "else:\n    raise SystemExit('no ImportError')"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
