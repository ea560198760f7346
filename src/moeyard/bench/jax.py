"""``moeyard bench --framework jax``: the JAX layer timed next to the PyTorch side, in one run.

For each case the usual rows come first (:func:`moeyard.bench.run`: moeyard's PyTorch backends and the
peers), then, on the same inputs and router weight (``--routing`` included):

- ``jax``: :class:`moeyard.jax.MoE` (custom VJP over the experts);
- ``jax autodiff``: the same layer with plain autodiff (``custom_vjp=False``);
- ``jax pallas``: the layer with JAX's Pallas/Triton lowering of ``ragged_dot`` (GPU, where the flag
  ``jax_ragged_dot_use_gpu_pallas_triton_lowering`` exists);
- ``ragged_dot pipeline``: the plain JAX pipeline MaxText's MoE runs (``sparse_matmul``): linear router,
  softmax, top-k, renormalised weights, ``argsort`` of the ids, gather, ``ragged_dot`` with ``wi_0`` and
  ``wi_1 [E, H, I]``, SwiGLU, ``ragged_dot`` with ``wo [E, I, H]``, unsort, weighted sum (plus the dense
  shared expert of the case); its output is checked against ``jax`` on the first input set. Softmax
  top-k SwiGLU layers only (the five ANCHORS.md shapes are).

Each JAX row is ``jax.jit``-compiled before its warm-up (not timed). ``fwd``: the forward; ``fwd+bwd``: the
forward and ``jax.vjp``'s pullback of the output gradient (gradients of x and every parameter), as
``y.backward(dy)``; median of ``--iters`` calls after ``--warmup``, each call waited for with
``block_until_ready`` (host dispatch included). ``peak GiB``: XLA's buffer assignment of the compiled
fwd+bwd (temporaries + outputs, the saved activations and the gradients), not a measured peak. The note
of the ``jax`` row gives its speed against the ``ragged_dot`` pipeline and the fastest PyTorch row
(``other ms / jax ms``, fwd+bwd (fwd): > 1 means the JAX layer is faster).

``ragged_dot``'s GPU lowering decides these rows: XLA's default is a dense zero-padded GEMM (out of memory
at the larger shapes); ``XLA_FLAGS=--xla_gpu_experimental_use_ragged_dot_fusion=true`` (cuDNN) or
``JAX_RAGGED_DOT_USE_GPU_PALLAS_TRITON_LOWERING=true`` choose another for the whole run, and the caption
says which was in force (``benchmarks/jax_gpu.py --lowering`` sets them).

JAX's GPU memory preallocation is turned off for the run (``XLA_PYTHON_CLIENT_PREALLOCATE=false``, set
before JAX's first computation): PyTorch and JAX share the GPU.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
import traceback
from collections.abc import Callable

import numpy as np
import torch

from ..config import MoEConfig
from . import layer as layer_bench
from .models import ModelShape, routed_only

GIB = 2**30
PALLAS_FLAG = "jax_ragged_dot_use_gpu_pallas_triton_lowering"


def run(opts: layer_bench.BenchOptions, progress: Callable[[str, int, int], None] | None = None) -> dict:
    """:func:`moeyard.bench.run`'s result with the JAX rows of every case added after its PyTorch rows
    (module docstring). Failing JAX implementations are rows with an ``error``.

    Raises:
        ValueError: a bad option (named), as :func:`moeyard.bench.run`.
    """
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    report = progress or (lambda desc, done, total: None)
    opts = layer_bench.resolve_options(opts)
    shapes = layer_bench.cases(opts)
    names = _implementations(opts.device)
    extra = len(shapes) * len(names)
    result = layer_bench.run(opts, progress=lambda desc, done, total: report(desc, done, total + extra))
    torch_rows = result["rows"]
    rows, done = [], len(torch_rows)
    for shape in shapes:
        case_rows = [r for r in torch_rows if r.get("case") == shape.name and r.get("T", shape.tokens) == shape.tokens]
        jax_rows = []
        for name in names:
            report(f"{shape.name} · {name}", done, done + extra)
            jax_rows.append(run_one(name, shape, opts))
            done += 1
        _ratios(jax_rows, case_rows)
        balance = {k: r[k] for r in case_rows[:1] for k in ("load_max_over_mean",) if k in r}
        rows += case_rows + [{**r, **balance} for r in jax_rows]
    result["rows"] = rows + [r for r in torch_rows if r not in rows]
    result["env"].update(environment(opts))
    return result


def environment(opts: layer_bench.BenchOptions) -> dict:
    """The JAX side of the run: versions and device, as a caption line (``framework_note``)."""
    import jax

    try:
        import flax

        flax_version = flax.__version__
    except ImportError:
        flax_version = "not installed"
    dev = _device(opts.device)
    note = (
        f"JAX rows: jax {jax.__version__} · flax {flax_version} · {dev.device_kind} ({dev.platform}) · "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"
        + (" · Pallas ragged_dot lowering on" if getattr(jax.config, PALLAS_FLAG, False) else "")
    )
    return {"jax": jax.__version__, "flax": flax_version, "framework_note": note}


def _implementations(device: str) -> list[str]:
    import jax

    names = ["jax", "jax autodiff", "ragged_dot pipeline"]
    if str(device).startswith("cuda") and hasattr(jax.config, PALLAS_FLAG):
        names.insert(2, "jax pallas")
    return names


def _device(device: str):
    import jax

    return jax.devices("gpu" if str(device).startswith("cuda") else "cpu")[0]


def run_one(name: str, shape: ModelShape, opts: layer_bench.BenchOptions) -> dict:
    """One JAX row: times, TFLOP/s, memory, or the error (never raises for a failing implementation)."""
    config = shape.moe_config()
    if opts.routed_only:
        config = routed_only(config)
    flops = layer_bench.layer_flops(config, shape.tokens)
    row = {
        "case": shape.name,
        "T": shape.tokens,
        "H": config.hidden_size,
        "I": config.intermediate_size,
        "E": config.num_experts,
        "k": config.top_k,
        "impl": name,
        "kind": "jax",
        "flops_fwd": flops,
        "note": "",
    }
    try:
        row.update(measure(name, config, _inputs(shape, opts), opts))
        row["fwd_tflops"] = flops / row["fwd_ms"] / 1e9
        row["fwdbwd_tflops"] = 3 * flops / row["fwdbwd_ms"] / 1e9
    except Exception as ex:  # a failing implementation is a row, not a crash
        row["error"] = f"{type(ex).__name__}: {(str(ex).strip().splitlines() or [''])[0][:300]}"
        row["detail"] = traceback.format_exc()[-1500:]
    finally:
        gc.collect()
    return row


def _inputs(shape: ModelShape, opts: layer_bench.BenchOptions) -> dict:
    """The case's inputs as the PyTorch rows had them (:func:`moeyard.bench.make_inputs` after the same
    seed), moved to JAX's device; the PyTorch copies are freed before the JAX rows run."""
    torch.manual_seed(0)  # moeyard.bench.run_case seeds the same before making its inputs
    inputs = layer_bench.make_inputs(shape, opts)
    dev, dtype = _device(opts.device), _jax_dtype(opts.dtype)
    out = {
        "xs": [_to_jax(t, dtype, dev) for t in inputs.xs],
        "dys": [_to_jax(t, dtype, dev) for t in inputs.dys],
        "router_weight": _to_jax(inputs.router_weight, dtype, dev),
    }
    del inputs
    layer_bench.free_memory(opts.device)
    return out


def measure(name: str, config: MoEConfig, inputs: dict, opts: layer_bench.BenchOptions) -> dict:
    """fwd / fwd+bwd milliseconds and XLA's fwd+bwd memory of implementation ``name``."""
    import jax

    xs, dys = inputs["xs"], inputs["dys"]
    layer_fwd, layer_params = _layer(
        config, inputs["router_weight"], _device(opts.device), custom_vjp=name != "jax autodiff"
    )
    note = ""
    if name == "ragged_dot pipeline":
        fwd, params = plain_pipeline(config, layer_params)
        got, want = jax.jit(fwd)(params, xs[0]), jax.jit(layer_fwd)(layer_params, xs[0])
        err = float(jax.numpy.abs(got.astype("float32") - want.astype("float32")).max())
        note = f"max |y - y(jax)| = {err:.2e}"
    else:
        fwd, params = layer_fwd, layer_params
    pallas = name == "jax pallas"
    previous = getattr(jax.config, PALLAS_FLAG, False)
    try:
        if pallas:
            jax.config.update(PALLAS_FLAG, True)  # part of jit's cache key: this row compiles its own
        return {**_time(fwd, params, xs, dys, opts), "note": note}
    finally:
        if pallas:
            jax.config.update(PALLAS_FLAG, previous)


def _time(fwd, params, xs, dys, opts) -> dict:
    import jax

    def fwd_bwd(params, x, dy):
        _, pullback = jax.vjp(fwd, params, x)
        return pullback(dy)

    f = jax.jit(fwd)
    fb = jax.jit(fwd_bwd)
    compiled = fb.lower(params, xs[0], dys[0]).compile()
    mem = compiled.memory_analysis()
    peak = None if mem is None else (mem.temp_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes) / GIB
    n = len(xs)
    fwd_ms = time_ms(lambda i: f(params, xs[i % n]), opts.warmup, opts.iters)
    fwdbwd_ms = time_ms(lambda i: compiled(params, xs[i % n], dys[i % n]), opts.warmup, opts.iters)
    return {"fwd_ms": fwd_ms, "fwdbwd_ms": fwdbwd_ms, "peak_gib": peak}


def time_ms(step: Callable[[int], object], warmup: int, iters: int) -> float:
    """Median milliseconds of ``step(i)``, each call waited for, after ``max(warmup, 1)`` untimed calls
    (the first compiles)."""
    import jax

    for i in range(max(warmup, 1)):
        jax.block_until_ready(step(i))
    times = []
    for i in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(step(i))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _layer(config: MoEConfig, router_weight, dev, *, custom_vjp: bool):
    """``(fwd(params, x), params)`` of a :class:`moeyard.jax.MoE` on ``dev`` in ``router_weight``'s dtype,
    with that router weight (the layer's other state is closed over)."""
    import jax
    from flax import nnx

    from ..jax import MoE

    with jax.default_device(dev):
        layer = MoE(config, rngs=nnx.Rngs(0), dtype=router_weight.dtype, custom_vjp=custom_vjp)
    layer.router.weight.set_value(router_weight)
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def fwd(params, x):
        return nnx.merge(graphdef, params, rest, copy=True)(x)

    return fwd, params


def plain_pipeline(config: MoEConfig, layer_params):
    """``(fwd(params, x), params)``: MaxText's plain ``ragged_dot`` MoE (module docstring) with the
    layer's weights relaid out as MaxText stores them (``wi_0``, ``wi_1 [E, H, I]``, ``wo [E, I, H]``).

    Raises:
        ValueError: a layer it does not compute (other routers or activations, expert biases).
    """
    import jax
    import jax.numpy as jnp

    c = config
    if (
        c.score_func != "softmax"
        or c.topk_before_score
        or c.n_group > 1
        or c.score_correction_bias
        or c.router_bias
        or c.expert_bias
        or c.activation != "swiglu"
        or c.routed_scaling_factor != 1
    ):
        raise ValueError("ragged_dot pipeline: softmax top-k routing with SwiGLU experts and no biases only")
    E, K, I = c.num_experts, c.top_k, c.intermediate_size
    p = layer_params
    up = p["gate_up_proj"][...]  # [E, 2I, H]
    params = {
        "router": p["router"]["weight"][...],
        "wi_0": jnp.swapaxes(up[:, :I], 1, 2),
        "wi_1": jnp.swapaxes(up[:, I:], 1, 2),
        "wo": jnp.swapaxes(p["down_proj"][...], 1, 2),
    }
    if "shared_expert" in p:
        s = p["shared_expert"]
        params["shared"] = {k: s[k]["weight"][...] for k in s}

    def fwd(params, x):
        T = x.shape[0]
        logits = jnp.dot(x, params["router"].T).astype(jnp.float32)
        w, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), K)
        if c.norm_topk_prob:
            w = w / w.sum(-1, keepdims=True)
        flat = ids.reshape(-1)
        order = jnp.argsort(flat)
        group_sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
        rows = x[order // K]
        h = jax.nn.silu(jax.lax.ragged_dot(rows, params["wi_0"], group_sizes)) * jax.lax.ragged_dot(
            rows, params["wi_1"], group_sizes
        )
        y = jax.lax.ragged_dot(h, params["wo"], group_sizes)
        y = y[jnp.argsort(order)].reshape(T, K, -1)
        out = jnp.einsum("tkh,tk->th", y, w.astype(y.dtype), preferred_element_type=jnp.float32).astype(x.dtype)
        if "shared" in params:
            s = params["shared"]
            g, u = jnp.split(jnp.dot(x, s["gate_up_proj"].T), 2, axis=-1)
            shared = jnp.dot(jax.nn.silu(g) * u, s["down_proj"].T)
            if "gate" in s:
                shared = jax.nn.sigmoid(jnp.dot(x, s["gate"].T)) * shared
            out = out + shared
        return out

    return fwd, params


def _ratios(jax_rows: list[dict], torch_rows: list[dict]) -> None:
    """The ``jax`` row's note: its speed against the ``ragged_dot`` pipeline and the fastest PyTorch
    moeyard row, ``other ms / jax ms`` for fwd+bwd (fwd)."""
    ok = {r["impl"]: r for r in jax_rows if "error" not in r}
    ours = ok.get("jax")
    if ours is None:
        return
    others = []
    if "ragged_dot pipeline" in ok:
        others.append(("ragged_dot pipeline", ok["ragged_dot pipeline"]))
    torch_ok = [r for r in torch_rows if r.get("kind") == "moeyard" and "error" not in r and r.get("fwdbwd_ms")]
    if torch_ok:
        best = min(torch_ok, key=lambda r: r["fwdbwd_ms"])
        others.append((f"torch {best['impl']}", best))
    parts = [
        f"{label} {r['fwdbwd_ms'] / ours['fwdbwd_ms']:.2f}x ({r['fwd_ms'] / ours['fwd_ms']:.2f}x)"
        for label, r in others
    ]
    if parts:
        ours["note"] = "vs " + ", ".join(parts) + " (fwd+bwd (fwd), > 1: jax faster)"


def _jax_dtype(name: str):
    import jax.numpy as jnp

    return {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}[name]


def _to_jax(t: torch.Tensor, dtype, dev):
    import jax
    import jax.numpy as jnp

    host = t.detach().float().cpu().numpy().astype(np.float32)
    return jax.device_put(jnp.asarray(host, dtype), dev)
