"""moeyard's Pallas grouped GEMMs (``moeyard.jax.gmm``) against ``jax.lax.ragged_dot`` on a GPU, bf16.

For each shape (qwen3-30b-a3b: H 2048, I 768; sonic-7b: H 1536, I 256; both E 128, top-8, T 16384 tokens,
so R = T * 8 rows, random balanced routing), each grouped GEMM of the expert FFN:

- ``up``: ``rows [R, H] x w_up [E, 2I, H]`` -> ``[R, 2I]`` (gmm); ``down``: ``[R, I] x w_down [E, H, I]``
  (gmm); ``up_t``: the rows' gradient of ``up``, ``[R, 2I]`` -> ``[R, H]`` (gmm_t); ``up_w``: its weight
  gradient ``[E, 2I, H]`` (tgmm); ``down_t``, ``down_w`` the same for ``down``;

through ``ragged_dot`` (XLA's GPU lowering) and the Pallas kernels under a few tile configs: the median of
20 timed runs after 3 warm-up runs (``block_until_ready``), TFLOP/s, and the largest error against a
float32 reference (a HIGHEST-precision dense product over four of the experts' rows: the first, two in the
middle, the last), relative to that reference's largest value. A row that fails (out of memory, a
lowering error) prints its error and the next one runs. Then ``moeyard.jax.experts`` forward + backward
(custom VJP) with ``MOEYARD_JAX_GMM=pallas`` and ``ragged_dot``. A short table closes the output.

Run from the repository root on a GPU machine:

    PYTHONPATH=src python3 benchmarks/jax_gmm_probe.py [--models qwen3-30b-a3b,sonic-7b] [--tokens 16384]

``--tiny`` runs the same code at toy sizes in Pallas's interpret mode (the CPU; correctness only, the
timings mean nothing).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import moeyard.jax as mj  # noqa: E402
from moeyard.jax import ffn  # noqa: E402
from moeyard.jax.gmm import GPU_CONFIG, INTERPRET_CONFIG, TileConfig, gmm, gmm_t, tgmm  # noqa: E402

MODELS = {  # name: (H, I, E, K)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "sonic-7b": (1536, 256, 128, 8),
}
TINY = {"tiny": (64, 48, 8, 2)}
CONFIGS = {
    "m128n128k64w8s3": TileConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3),
    "m128n256k64w8s3 (default)": GPU_CONFIG,
    "m64n128k64w4s4": TileConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4),
    "m128n256k64w8s4": TileConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4),
    "m256n128k64w8s3": TileConfig(block_m=256, block_n=128, block_k=64, num_warps=8, num_stages=3),
}
TINY_CONFIGS = {"i16": INTERPRET_CONFIG, "i32": TileConfig(block_m=32, block_n=32, block_k=16)}
HIGHEST = jax.lax.Precision.HIGHEST
ROWS: list[dict] = []  # every measured row, for the table
SKIP_RAGGED = False  # --skip-ragged: XLA's dense rewrite takes minutes (or runs out of memory) at these sizes


def short_error(ex: BaseException) -> str:
    first = str(ex).strip().splitlines()[0] if str(ex).strip() else ""
    return f"{type(ex).__name__}: {first[:160]}"


def timed_ms(f, *args, warmup: int, reps: int) -> float:
    """Median milliseconds of ``f(*args)`` over ``reps`` runs after ``warmup`` (each waited for)."""
    for _ in range(warmup):
        jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def balanced_group_sizes(T: int, K: int, E: int, seed: int = 0) -> np.ndarray:
    """Rows per expert of random routing: each token's K distinct experts drawn uniformly."""
    g = np.random.default_rng(seed)
    ids = np.argsort(g.random((T, E)), axis=1)[:, :K]
    return np.bincount(ids.reshape(-1), minlength=E).astype(np.int32)


def ragged(lhs, w, gs, contract: int):
    """``ragged_dot_general`` of ``lhs [R, k]`` with ``w [E, ., .]`` contracting w's dimension ``contract``."""
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [contract]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
    )
    return jax.lax.ragged_dot_general(lhs, w, gs, dims)


def ragged_wgrad(lhs, ct, gs, w_shape):
    """The weight gradient of ``ragged(lhs, w, gs, 2)`` for ``w [E, out, in]`` (JAX's transpose)."""
    w0 = jnp.zeros(w_shape, lhs.dtype)
    return jax.vjp(lambda v: ragged(lhs, v, gs, 2), w0)[1](ct)[0]


def gemms(H: int, I: int, E: int, R: int, gs, interpret: bool, configs: dict):
    """``name -> (flops, make_args, {impl: fn}, reference)`` for the six GEMMs; ``make_args(key)`` builds the
    bf16 operands, ``reference(args, e, lo, hi)`` expert e's part of the result in float32."""
    up_shape, down_shape = (E, 2 * I, H), (E, H, I)

    def pallas(kind, w_shape=None):
        out = {}
        for cname, cfg in configs.items():
            if kind == "gmm":
                f = lambda x, w, cfg=cfg: gmm(x, w, gs, config=cfg, interpret=interpret)  # noqa: E731
            elif kind == "gmm_t":
                f = lambda x, w, cfg=cfg: gmm_t(x, w, gs, config=cfg, interpret=interpret)  # noqa: E731
            else:
                f = lambda x, c, cfg=cfg: tgmm(x, c, gs, config=cfg, interpret=interpret)  # noqa: E731
            out[f"pallas {cname}"] = jax.jit(f)
        return out

    f32 = jnp.float32

    def ref_fwd(args, e, lo, hi):  # rows_e @ w_e^T
        x, w = args
        return jnp.dot(x[lo:hi].astype(f32), w[e].astype(f32).T, precision=HIGHEST)

    def ref_t(args, e, lo, hi):  # g_e @ w_e
        g, w = args
        return jnp.dot(g[lo:hi].astype(f32), w[e].astype(f32), precision=HIGHEST)

    def ref_w(args, e, lo, hi):  # ct_e^T x_e
        x, c = args
        return jnp.dot(c[lo:hi].astype(f32).T, x[lo:hi].astype(f32), precision=HIGHEST)

    def operands(*shapes):
        def make(key):
            keys = jax.random.split(key, len(shapes))
            return [
                (jax.random.normal(k, s, jnp.float32) / np.sqrt(s[-1])).astype(jnp.bfloat16)
                for k, s in zip(keys, shapes, strict=True)
            ]

        return make

    table = {}
    for name, (k_in, k_out, w_shape) in {"up": (H, 2 * I, up_shape), "down": (I, H, down_shape)}.items():
        flops = 2 * R * k_in * k_out
        table[name] = (
            flops,
            operands((R, k_in), w_shape),
            {"ragged_dot": jax.jit(lambda x, w: ragged(x, w, gs, 2)), **pallas("gmm")},
            ref_fwd,
        )
        table[f"{name}_t"] = (
            flops,
            operands((R, k_out), w_shape),
            {"ragged_dot": jax.jit(lambda g, w: ragged(g, w, gs, 1)), **pallas("gmm_t")},
            ref_t,
        )
        table[f"{name}_w"] = (
            flops,
            operands((R, k_in), (R, k_out)),
            {
                "ragged_dot": jax.jit(lambda x, c, s=w_shape: ragged_wgrad(x, c, gs, s)),
                **pallas("tgmm"),
            },
            ref_w,
        )
    return table


def sample_experts(gs: np.ndarray) -> list[int]:
    nonempty = [e for e in range(len(gs)) if gs[e] > 0]
    picks = [nonempty[0], nonempty[len(nonempty) // 3], nonempty[2 * len(nonempty) // 3], nonempty[-1]]
    return sorted(set(picks))


def max_rel_error(out, args, reference, gs: np.ndarray, weight_grad: bool) -> float:
    """Largest |out - ref| over the sampled experts, relative to the reference's largest |value|."""
    offsets = np.concatenate([[0], np.cumsum(gs)])
    err, scale = 0.0, 0.0
    for e in sample_experts(gs):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        want = reference(args, e, lo, hi)
        got = out[e] if weight_grad else out[lo:hi]
        err = max(err, float(jnp.max(jnp.abs(got.astype(jnp.float32) - want))))
        scale = max(scale, float(jnp.max(jnp.abs(want))))
    return err / max(scale, 1e-30)


def probe_gemms(model: str, shape, T: int, configs: dict, interpret: bool, warmup: int, reps: int) -> None:
    H, I, E, K = shape
    R = T * K
    gs_np = balanced_group_sizes(T, K, E)
    gs = jnp.asarray(gs_np)
    print(f"\n== {model}: T {T}, H {H}, I {I}, E {E}, top-{K}, R {R} rows (per expert {gs_np.min()}..{gs_np.max()})")
    for gi, (name, (flops, make, impls, reference)) in enumerate(gemms(H, I, E, R, gs, interpret, configs).items()):
        args = make(jax.random.key(gi))
        for impl, f in impls.items():
            if impl == "ragged_dot" and SKIP_RAGGED:
                continue
            row = dict(model=model, gemm=name, impl=impl)
            try:
                out = f(*args)
                row["err"] = max_rel_error(out, args, reference, gs_np, name.endswith("_w"))
                del out
                row["ms"] = timed_ms(f, *args, warmup=warmup, reps=reps)
                row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
                print(
                    f"  {name:7s} {impl:24s} {row['ms']:9.3f} ms {row['tflops']:7.1f} TFLOP/s  rel err {row['err']:.2e}"
                )
            except Exception as ex:  # out of memory, a lowering this jax lacks: report and go on
                row["error"] = short_error(ex)
                print(f"  {name:7s} {impl:24s} FAILED {row['error']}")
            ROWS.append(row)
        del args


def probe_layer(model: str, shape, T: int, warmup: int, reps: int) -> None:
    """``moeyard.jax.experts`` forward + backward (custom VJP), bf16, under each ``MOEYARD_JAX_GMM``."""
    H, I, E, K = shape
    g = np.random.default_rng(1)
    ids = jnp.asarray(np.argsort(g.random((T, E)), axis=1)[:, :K].astype(np.int32))
    keys = jax.random.split(jax.random.key(7), 4)
    x = jax.random.normal(keys[0], (T, H), jnp.bfloat16)
    w = jax.nn.softmax(jax.random.normal(keys[1], (T, K))).astype(jnp.bfloat16)
    up = (jax.random.normal(keys[2], (E, 2 * I, H)) / np.sqrt(H)).astype(jnp.bfloat16)
    down = (jax.random.normal(keys[3], (E, H, I)) / np.sqrt(I)).astype(jnp.bfloat16)
    flops = 3 * 2 * T * K * (H * 2 * I + I * H)  # forward + two backward products, both projections
    results = {}
    for choice in ("ragged_dot", "pallas"):
        os.environ[ffn.GMM_ENV] = choice  # read when the jitted function below is traced
        row = dict(model=model, gemm="experts fwd+bwd", impl=choice)

        def loss(x, w, up, down):
            return jnp.sum(mj.experts(x, ids, w, up, down).astype(jnp.float32) ** 2)

        f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
        try:
            results[choice] = jax.device_get(f(x, w, up, down))
            row["ms"] = timed_ms(f, x, w, up, down, warmup=warmup, reps=reps)
            row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
            print(f"  experts fwd+bwd {choice:12s} {row['ms']:9.3f} ms {row['tflops']:7.1f} TFLOP/s")
        except Exception as ex:
            row["error"] = short_error(ex)
            print(f"  experts fwd+bwd {choice:12s} FAILED {row['error']}")
        ROWS.append(row)
    os.environ.pop(ffn.GMM_ENV, None)
    if len(results) == 2:
        a, b = (jax.tree_util.tree_leaves(results[c]) for c in ("pallas", "ragged_dot"))
        errs = [
            float(np.max(np.abs(np.asarray(p, np.float32) - np.asarray(r, np.float32))))
            / max(float(np.max(np.abs(np.asarray(r, np.float32)))), 1e-30)
            for p, r in zip(a, b, strict=True)
        ]
        ROWS[-1]["err"] = max(errs)
        print(f"  experts pallas vs ragged_dot: loss and gradients, max rel diff {max(errs):.2e}")


def print_table() -> None:
    """Per model and GEMM: ragged_dot, the best Pallas config, and the speed-up."""
    print("\n| model | GEMM | ragged_dot ms | best Pallas | ms | TFLOP/s | rel err | speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    keys = list(dict.fromkeys((r["model"], r["gemm"]) for r in ROWS))
    for model, name in keys:
        rows = [r for r in ROWS if r["model"] == model and r["gemm"] == name]
        base = next((r for r in rows if r["impl"] == "ragged_dot"), {})
        others = [r for r in rows if r["impl"] != "ragged_dot" and "ms" in r]
        best = min(others, key=lambda r: r["ms"]) if others else {}
        base_ms = f"{base['ms']:.3f}" if "ms" in base else base.get("error", "-")[:40]
        if best:
            speed = f"{base['ms'] / best['ms']:.1f}x" if "ms" in base else "-"
            err = f"{best['err']:.1e}" if "err" in best else "-"
            cells = (best["impl"], f"{best['ms']:.3f}", f"{best['tflops']:.1f}", err, speed)
        else:
            failed = next((r.get("error", "") for r in rows if r["impl"] != "ragged_dot"), "-")
            cells = ("failed", failed[:40], "-", "-", "-")
        print(f"| {model} | {name} | {base_ms} | " + " | ".join(cells) + " |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="toy sizes in interpret mode (CPU): correctness only")
    p.add_argument("--skip-layer", action="store_true", help="only the GEMMs")
    p.add_argument("--skip-ragged", action="store_true", help="no ragged_dot rows (XLA's dense rewrite: slow or OOM)")
    args = p.parse_args()
    global SKIP_RAGGED
    SKIP_RAGGED = args.skip_ragged
    print("jax", jax.__version__, jax.devices())
    if args.tiny:
        models, T, configs, interpret, warmup, reps = TINY, 64, TINY_CONFIGS, True, 1, 1
    else:
        models = {m: MODELS[m] for m in args.models.split(",")}
        T, configs, interpret, warmup, reps = args.tokens, CONFIGS, None, args.warmup, args.reps
        if jax.default_backend() != "gpu":
            print("no GPU: the Pallas kernels would run interpreted; use --tiny on a CPU", file=sys.stderr)
            return 2
    for model, shape in models.items():
        try:
            probe_gemms(model, shape, T, configs, interpret, warmup, reps)
        except Exception:
            traceback.print_exc()
        if not args.skip_layer:
            try:
                probe_layer(model, shape, T, warmup, reps)
            except Exception:
                traceback.print_exc()
    print_table()
    bad = [r for r in ROWS if r["impl"] != "ragged_dot" and r.get("err", 0.0) > (2e-2 if args.tiny else 3e-2)]
    for r in bad:
        print(f"ERROR TOO LARGE: {r['model']} {r['gemm']} {r['impl']} {r['err']:.2e}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
