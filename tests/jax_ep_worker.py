"""Expert parallelism on simulated CPU devices, run by ``test_jax_parallel.py`` in a subprocess (the device
count must be set before JAX starts): ``python3 tests/jax_ep_worker.py`` prints one JSON object, each
check's largest error (``inf`` for a missing or non-finite result) or flag.

Every check compares the expert-parallel result with one device's (:func:`moeyard.jax.experts`, the
layer) in float64 under skewed routing: expert e chosen with probability ~ (e + 1)^-1.5.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from jax_flags import set_xla_flags  # noqa: E402

set_xla_flags("--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import (
    AxisType,  # noqa: E402
    PartitionSpec as P,  # noqa: E402
)

import jax_ep_emulation  # noqa: E402
import moeyard  # noqa: E402
import moeyard.jax as mj  # noqa: E402
from moeyard import MoEConfig  # noqa: E402
from moeyard.jax import parallel  # noqa: E402

jax.config.update("jax_enable_x64", True)
EMULATED = jax_ep_emulation.install(parallel)  # XLA:CPU has no ragged_all_to_all
E, K, T, H, I = 8, 2, 6, 8, 4  # T tokens per device


def mesh(W):
    return jax.make_mesh((W,), ("ep",), axis_types=(AxisType.Auto,), devices=jax.devices()[:W])


def skewed_ids(n, seed, experts=E, k=K):
    g = np.random.default_rng(seed)
    p = (np.arange(experts) + 1.0) ** -1.5
    return np.stack([g.choice(experts, k, replace=False, p=p / p.sum()) for _ in range(n)]).astype(np.int32)


def problem(W, seed=0):
    g = np.random.default_rng(seed)
    arrays = dict(
        x=g.standard_normal((W * T, H)),
        w=g.random((W * T, K)) + 0.1,
        up=g.standard_normal((E, 2 * I, H)) / 3,
        down=g.standard_normal((E, H, I)) / 2,
        b_up=g.standard_normal((E, 2 * I)) / 3,
        b_down=g.standard_normal((E, H)) / 3,
    )
    return {k: jnp.asarray(v) for k, v in arrays.items()}, jnp.asarray(skewed_ids(W * T, seed))


def max_err(got, want):
    got, want = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    errs = [
        float(np.abs(np.asarray(a) - np.asarray(b)).max()) if np.isfinite(np.asarray(a)).all() else float("inf")
        for a, b in zip(got, want, strict=True)
    ]
    return max(errs) if len(got) == len(want) else float("inf")


R = 2  # LoRA rank
LORA_SCALES = (0.5, 2.0)


def lora_factors(seed=4):
    """Both projections' LoRA factors in PEFT's global layout: ``A [R*E, in]``, ``B [out, R*E]``."""
    g = np.random.default_rng(seed)
    return {
        "la_up": jnp.asarray(g.standard_normal((R * E, H)) / 3),
        "lb_up": jnp.asarray(g.standard_normal((2 * I, R * E)) / 2),
        "la_down": jnp.asarray(g.standard_normal((R * E, I)) / 2),
        "lb_down": jnp.asarray(g.standard_normal((H, R * E)) / 2),
    }


def adapters(la_up, lb_up, la_down, lb_down):
    return {
        "gate_up_proj": moeyard.ExpertLoRA(lora_A=la_up, lora_B=lb_up, scaling=LORA_SCALES[0]),
        "down_proj": moeyard.ExpertLoRA(lora_A=la_down, lora_B=lb_down, scaling=LORA_SCALES[1]),
    }


def by_device(lb, W):
    """``B [out, R*E]`` (columns rank-major over all experts) with its columns grouped by device: each device's
    slice along the columns is then ``[out, R*E_l]``, rank-major over its own experts (the local layout)."""
    out = lb.shape[0]
    return lb.reshape(out, R, W, E // W).transpose(0, 2, 1, 3).reshape(out, R * E)


def experts_check(W, exchange, align=1, custom_vjp=True, drop=False, recipe=None, lora=False):
    """Output and every gradient of ep_experts against experts on one device (both under ``recipe``; with
    ``lora`` both projections adapted, each device holding its experts' factors in the local layout)."""
    a, ids = problem(W)
    if drop:  # sentinels of another layer's expert parallelism: contribute nothing
        ids = ids.at[0, 0].set(-1).at[5, 1].set(E)
    kw = dict(drop_invalid=drop, custom_vjp=custom_vjp, recipe=recipe)
    names = ("x", "w", "up", "b_up", "down", "b_down")
    if lora:
        a = {**a, **lora_factors()}
        names += ("la_up", "lb_up", "la_down", "lb_down")
    probe = jnp.asarray(np.random.default_rng(9).standard_normal((W * T, H)))

    def one(x, w, up, b_up, down, b_down, *f):
        more = dict(lora=adapters(*f)) if f else {}
        return mj.experts(x, ids, w, up, down, gate_up_bias=b_up, down_bias=b_down, **kw, **more)

    def local(x, ids, w, up, b_up, down, b_down, *f):
        return mj.ep_experts(
            x,
            ids,
            w,
            up,
            down,
            gate_up_bias=b_up,
            down_bias=b_down,
            axis_name="ep",
            exchange=exchange,
            align=align,
            **kw,
            **(dict(lora=adapters(*f)) if f else {}),
        )

    factor_specs = (P("ep"), P(None, "ep"), P("ep"), P(None, "ep")) if lora else ()
    sharded = jax.shard_map(local, mesh=mesh(W), in_specs=(P("ep"),) * 7 + factor_specs, out_specs=P("ep"))

    def many(x, w, up, b_up, down, b_down, *f):
        if f:  # B's columns grouped by device, so that each device's slice is its local layout
            f = (f[0], by_device(f[1], W), f[2], by_device(f[3], W))
        return sharded(x, ids, w, up, b_up, down, b_down, *f)

    def value_and_grads(f):
        return jax.jit(jax.value_and_grad(lambda *v: (f(*v) * probe).sum(), argnums=tuple(range(len(names)))))(
            *[a[n] for n in names]
        )

    return max_err(value_and_grads(many), value_and_grads(one))


def layer_check(W, exchange, lora=False):
    """The layer through ep_apply against the layer on one device: output and every parameter's
    gradient of sum(y * probe), and the aux loss as the mean of the shards' own; with ``lora``, both layers
    with the same adapters (B random), whose factors' gradients come back in PEFT's global layout."""
    cfg = MoEConfig(
        num_experts=E,
        hidden_size=H,
        intermediate_size=I,
        top_k=K,
        score_func="sigmoid",
        score_correction_bias=True,
        expert_bias=True,
        num_shared_experts=1,
        aux_loss_coef=0.1,
    )
    layer = mj.MoE(cfg, rngs=nnx.Rngs(0), dtype=jnp.float64)
    g = np.random.default_rng(1)
    # skew: a router that prefers the low experts
    layer.router.weight.set_value(jnp.asarray(g.standard_normal((E, H))))
    layer.router.e_score_correction_bias.set_value(jnp.asarray(-np.arange(E) * 0.3, jnp.float32))
    x = jnp.asarray(g.standard_normal((W * T, H)))
    probe = jnp.asarray(g.standard_normal((W * T, H)))
    ep_layer = mj.MoE(cfg, rngs=nnx.Rngs(0), dtype=jnp.float64)
    if lora:
        for m in (layer, ep_layer):
            m.add_lora(R, alpha=3.0, rngs=nnx.Rngs(2))
        for a in layer.lora.values():
            a.lora_B.weight.set_value(jnp.asarray(g.standard_normal(a.lora_B.weight.shape)) * 0.5)
    nnx.update(ep_layer, nnx.state(layer))
    mj.expert_parallel(ep_layer, axis_name="ep", exchange=exchange)
    m = mesh(W)

    def loss_one(layer, x):
        return (layer(x) * probe).sum()

    def loss_ep(layer, x):
        y, aux = mj.ep_apply(layer, x, mesh=m)
        return (y * probe).sum(), aux

    want = nnx.jit(nnx.value_and_grad(loss_one))(layer, x)
    (loss, aux), grads = nnx.jit(nnx.value_and_grad(loss_ep, has_aux=True))(ep_layer, x)
    shard_aux = nnx.jit(lambda layer, x: layer(x, return_aux_loss=True)[1])
    shards = np.mean([float(shard_aux(layer, x[i * T : (i + 1) * T])) for i in range(W)])
    return max(max_err((loss, grads), want), abs(float(aux) - shards))


def overflow_check(W=4):
    """Repeated ids (device 0's tokens send 3 pairs each to expert 0; 2 local experts): the 3T pairs exceed
    the block of C = 2T rows, so the last third of them are not sent and their tokens come back NaN;
    every other token is exact."""
    a, _ = problem(W)
    ids = jnp.asarray(np.where(np.arange(W * T)[:, None] < T, 0, skewed_ids(W * T, 3, k=3)), jnp.int32)
    w = jnp.ones((W * T, 3))
    want = mj.experts(a["x"], jnp.clip(ids, 0, E - 1), w, a["up"], a["down"], drop_invalid=True)
    f = jax.shard_map(
        lambda x, i, w, u, d: mj.ep_experts(x, i, w, u, d, axis_name="ep"),
        mesh=mesh(W),
        in_specs=(P("ep"),) * 5,
        out_specs=P("ep"),
    )
    got = np.asarray(jax.jit(f)(a["x"], ids, w, a["up"], a["down"]))
    nan = np.isnan(got).any(1)
    exact = np.abs(got[~nan] - np.asarray(want)[~nan]).max()
    return {"overflow_nan_rows": int(nan.sum()), "overflow_others": float(exact)}


def emulation_check():
    """The emulated collective on the example of jax.lax.ragged_all_to_all's docstring (2 devices)."""
    m = mesh(2)
    operand = jnp.array([1, 2, 2, 3, 4, 0], jnp.float64)
    args = [jnp.array(v, jnp.int32) for v in ([0, 1, 0, 1], [1, 2, 1, 1], [0, 0, 1, 2], [1, 1, 2, 1])]
    f = jax.shard_map(
        lambda o, *a: parallel.ragged_all_to_all(
            o, jax.lax.pcast(jnp.zeros(4, o.dtype), "ep", to="varying"), *a, axis_name="ep"
        ),
        mesh=m,
        in_specs=(P("ep"),) * 5,
        out_specs=P("ep"),
    )
    return max_err(jax.jit(f)(operand, *args), jnp.array([1, 3, 0, 0, 2, 2, 4, 0], jnp.float64))


def timed(out, name, f, *args, **kw):
    t0 = time.perf_counter()
    out[name] = f(*args, **kw)
    out.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 1)


def main():
    out = {"emulation": emulation_check(), "emulated_as": EMULATED}
    timed(out, "all_to_all_W8", experts_check, 8, "all_to_all")
    timed(out, "ragged_W8_align4", experts_check, 8, "ragged_all_to_all", align=4)
    timed(out, "all_to_all_W4_plain_autodiff_drop", experts_check, 4, "all_to_all", custom_vjp=False, drop=True)
    timed(out, "ragged_W4_drop", experts_check, 4, "ragged_all_to_all", drop=True)
    timed(out, "all_to_all_W4_mxfp8", experts_check, 4, "all_to_all", recipe="mxfp8")
    timed(out, "all_to_all_W4_lora", experts_check, 4, "all_to_all", lora=True)
    timed(out, "ragged_W8_lora_mxfp8", experts_check, 8, "ragged_all_to_all", lora=True, recipe="mxfp8")
    timed(out, "layer_all_to_all_W4", layer_check, 4, "all_to_all")
    timed(out, "layer_ragged_W8", layer_check, 8, "ragged_all_to_all")
    timed(out, "layer_all_to_all_W4_lora", layer_check, 4, "all_to_all", lora=True)
    timed(out, "overflow", overflow_check)
    out.update(out.pop("overflow"))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
