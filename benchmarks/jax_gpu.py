"""moeyard.jax on CUDA: what the CPU tests cannot show. Four parts, each in its own try/except (a
failing part prints its error and the next one runs), then a short table of everything measured:

- ``parity``: the JAX layer on the GPU (XLA's GPU lowering of ``ragged_dot``, not the CPU fallback) against
  the PyTorch layer (``loop`` backend) with the same weights, float32: output, routing and every gradient,
  for a softmax block and gpt-oss's block; ``moeyard.jax.experts`` in gpt-oss's transposed + interleaved
  layout; bf16 against float64.
- ``ep``: expert parallelism over all GPUs present: ``ragged_all_to_all`` (XLA:CPU lacks it) against the
  dense ``all_to_all`` exchange and one device's result, skewed routing, outputs and every gradient
  (float32, and bf16 at qwen3-30b-a3b's sizes), then forward + backward milliseconds of both exchanges.
- ``memory``: peak GPU memory of forward + backward with and without the experts' custom VJP, for 1 and 4
  chained layers at sonic-7b and qwen3-30b-a3b (bf16, routed experts only); each measured in a fresh
  process (``peak_bytes_in_use`` minus the parameters and inputs, preallocation off; allocations of XLA's
  autotuning at compile time count too), next to XLA's own buffer assignment (temporaries only).
- ``bench``: ``moeyard bench --framework jax`` at the five ANCHORS.md shapes (or ``--models``): the
  PyTorch rows, the JAX layer, its plain-autodiff and Pallas-lowering variants and MaxText's plain
  ``ragged_dot`` pipeline, in one run; the JSON goes to ``--out``.

``ragged_dot``'s GPU lowering matters more than anything here: XLA's default rewrites it into a dense,
zero-padded GEMM (``[rows, E * in]``: out of memory at the ANCHORS shapes, e.g. 128 GiB for qwen3-30b-a3b's
up projection), ``--lowering cudnn`` turns on XLA's cuDNN ragged-dot fusion
(``--xla_gpu_experimental_use_ragged_dot_fusion``, forward and input gradient; the weight gradient stays
dense), ``--lowering pallas`` JAX's Pallas/Triton lowering (``jax_ragged_dot_use_gpu_pallas_triton_lowering``).
A lowering this jax lacks is reported, not crashed on. Every part runs under the one chosen.

Run from the repository root (one GPU; ``ep`` wants two or more):

    PYTHONPATH=src python3 benchmarks/jax_gpu.py                         # all parts
    PYTHONPATH=src python3 benchmarks/jax_gpu.py --parts parity,memory   # about 3 min
    PYTHONPATH=src python3 benchmarks/jax_gpu.py --parts parity,memory --lowering pallas
    PYTHONPATH=src python3 benchmarks/jax_gpu.py --parts ep              # on 2+ GPUs, about 2 min
    PYTHONPATH=src python3 benchmarks/jax_gpu.py --parts bench --models sonic-7b,qwen3-30b-a3b \
        --backends triton,grouped_mm,torch_gmm                           # one 10-minute call per 2-3 shapes

Without a GPU it runs on the CPU at toy sizes (``--quick`` is then implied): a smoke test of the script.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import subprocess
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # PyTorch shares the GPU; peaks measured
LOWERINGS = {  # --lowering: the environment that selects it (read when JAX starts, also by the child processes)
    "default": {},
    "cudnn": {"XLA_FLAGS": "--xla_gpu_experimental_use_ragged_dot_fusion=true"},
    "pallas": {"JAX_RAGGED_DOT_USE_GPU_PALLAS_TRITON_LOWERING": "true"},
}
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SUMMARY: list[tuple[str, str, str]] = []  # (part, what, result)
ANCHORS = ("sonic-7b", "qwen3-30b-a3b", "sonic-30b-a", "sonic-120b", "qwen3.5-35b-a3b")


def note(part: str, what: str, result: str) -> None:
    SUMMARY.append((part, what, result))
    print(f"  {what}: {result}", flush=True)


def on_gpu() -> bool:
    import jax

    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def rel(a, b) -> float:
    """max |a - b| / max |b| over the leaves of two pytrees (inf if a leaf is not finite)."""
    import jax
    import numpy as np

    worst = 0.0
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        if not np.isfinite(x).all():
            return float("inf")
        worst = max(worst, float(np.abs(x - y).max(initial=0.0) / max(np.abs(y).max(initial=0.0), 1e-30)))
    return worst


# ---------------------------------------------------------------- parity


def part_parity(args) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from flax import nnx

    import moeyard
    import moeyard.jax as mj

    dev = jax.devices()[0]
    # an explicit index: JAX may leave another GPU current on a multi-GPU host (round 41: weight on cuda:1, x on cuda:0)
    tdev = "cuda:0" if torch.cuda.is_available() else "cpu"
    blocks = {
        "softmax top-8 + gated shared": dict(
            num_experts=16,
            top_k=8,
            num_shared_experts=1,
            shared_expert_gate=True,
            aux_loss_coef=0.01,
            z_loss_coef=0.001,
        ),
        "gpt-oss": dict(
            num_experts=8,
            top_k=4,
            topk_before_score=True,
            router_bias=True,
            expert_bias=True,
            activation="clamped_swiglu",
        ),
    }
    for label, kw in blocks.items():
        cfg = moeyard.MoEConfig(hidden_size=256, intermediate_size=128, **kw)
        torch.manual_seed(0)
        t = moeyard.MoE(cfg, backend="loop", device=tdev)
        with torch.no_grad():
            for p in t.parameters():
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
        with jax.default_device(dev):
            j = mj.load_state_dict(mj.MoE(cfg, rngs=nnx.Rngs(0)), t.state_dict())
        x = torch.randn(2, 512, 256, device=tdev)
        probe = torch.randn_like(x)
        xt = x.clone().requires_grad_()
        y = t(xt)
        ((y * probe).sum() + t.aux_loss).backward()
        want = {"y": y, "x": xt.grad, **{n: p.grad for n, p in t.named_parameters()}, "weights": t.routing.topk_weights}
        graphdef, params, rest = nnx.split(j, nnx.Param, ...)

        def loss(params, x, probe, rest):
            m = nnx.merge(graphdef, params, rest, copy=True)  # noqa: B023  (traced and run in this iteration)
            out = m(x)
            routing = m.routing.get_value()
            return (out * probe).sum() + routing.loss, (out, routing.topk_weights, routing.topk_ids)

        xj, pj = (jax.device_put(jnp.asarray(a.cpu().numpy()), dev) for a in (x, probe))
        (gp, gx), (yj, wj, ids) = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(params, xj, pj, rest)
        got = {
            "y": yj,
            "x": gx,
            "weights": wj,
            **{".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(gp)},
        }
        ids_equal = bool(np.array_equal(np.asarray(ids), t.routing.topk_ids.cpu().numpy()))
        errs = {k: rel(got[k], want[k].detach().cpu().numpy()) for k in want}
        worst = max(errs, key=errs.get)
        note("parity", f"layer {label}, float32", f"max rel err {errs[worst]:.1e} ({worst}); same experts: {ids_equal}")
    _parity_layouts(dev)


def _parity_layouts(dev) -> None:
    """gpt-oss's transposed + interleaved experts with biases, float32 and bf16 on the GPU vs float64 on the CPU."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import moeyard.jax as mj

    g = np.random.default_rng(0)
    T, K, E, H, I = 1024, 4, 16, 256, 128
    ids = np.stack([g.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
    arrays = [
        g.standard_normal((T, H)),
        g.random((T, K)),
        g.standard_normal((E, H, 2 * I)) / 16,
        g.standard_normal((E, I, H)) / 11,
        g.standard_normal((E, 2 * I)) / 4,
        g.standard_normal((E, H)) / 4,
    ]
    probe = g.standard_normal((T, H))

    def f(x, w, up, down, bu, bd, probe):
        out = mj.experts(
            x,
            jnp.asarray(ids),
            w,
            up,
            down,
            gate_up_bias=bu,
            down_bias=bd,
            transposed=True,
            interleaved=True,
            activation="clamped_swiglu",
        )
        return (out.astype(jnp.float32) * probe).sum(), out

    grad = jax.grad(f, argnums=tuple(range(6)), has_aux=True)
    with jax.enable_x64(True):
        cpu = jax.devices("cpu")[0]
        ref = jax.jit(grad)(*[jax.device_put(jnp.asarray(a), cpu) for a in arrays], jax.device_put(probe, cpu))
        ref = jax.tree_util.tree_map(np.asarray, ref)
    for dtype in (jnp.float32, jnp.bfloat16):
        got = jax.jit(grad)(
            *[jax.device_put(jnp.asarray(a, dtype), dev) for a in arrays],
            jax.device_put(jnp.asarray(probe, jnp.float32), dev),
        )
        note(
            "parity",
            f"experts transposed+interleaved+biases, {jnp.dtype(dtype).name} vs float64",
            f"max rel err out {rel(got[1], ref[1]):.1e}, grads {rel(got[0], ref[0]):.1e}",
        )


# ---------------------------------------------------------------- expert parallelism


def part_ep(args) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, PartitionSpec as P

    import moeyard.jax as mj

    devices = jax.devices()
    W = len(devices)
    if W < 2:
        note("ep", "devices", f"{W} device: the exchanges need 2 or more (skipped)")
        return
    mesh = jax.make_mesh((W,), ("ep",), axis_types=(AxisType.Auto,), devices=devices)
    sizes = [("small, float32", 64, 16, 4, 64, 32, jnp.float32)]
    if not args.quick:
        sizes.append(("qwen3-30b-a3b sizes, bf16", 2048, 128, 8, 2048, 768, jnp.bfloat16))
    for label, T, E, K, H, I, dtype in sizes:
        g = np.random.default_rng(0)
        p = (np.arange(E) + 1.0) ** -1.2
        ids = np.stack([g.choice(E, K, replace=False, p=p / p.sum()) for _ in range(W * T)]).astype(np.int32)
        x, w = g.standard_normal((W * T, H)), g.random((W * T, K))
        up, down = g.standard_normal((E, 2 * I, H)) / math.sqrt(H), g.standard_normal((E, H, I)) / math.sqrt(I)
        probe = g.standard_normal((W * T, H))
        args_ = [jnp.asarray(a, dtype) for a in (x, w, up, down)]
        ids_j, probe_j = jnp.asarray(ids), jnp.asarray(probe, dtype)

        def loss_one(x, w, up, down):
            return (mj.experts(x, ids_j, w, up, down).astype(jnp.float32) * probe_j).sum()  # noqa: B023  (traced and run in this iteration)

        ref = jax.jit(jax.value_and_grad(loss_one, argnums=(0, 1, 2, 3)))(*args_)
        results = {}
        for exchange, align in (("all_to_all", 1), ("ragged_all_to_all", 1), ("ragged_all_to_all", 16)):
            name = exchange + (f" align {align}" if align > 1 else "")
            try:
                local = jax.shard_map(
                    functools.partial(mj.ep_experts, axis_name="ep", exchange=exchange, align=align),
                    mesh=mesh,
                    in_specs=(P("ep"),) * 5,
                    out_specs=P("ep"),
                )

                def loss_ep(x, w, up, down):
                    return (local(x, ids_j, w, up, down).astype(jnp.float32) * probe_j).sum()  # noqa: B023  (traced and run in this iteration)

                step = jax.jit(jax.value_and_grad(loss_ep, argnums=(0, 1, 2, 3)))
                got = step(*args_)
                results[name] = got
                ms = _time(functools.partial(step, *args_), 3 if args.quick else 10)
                note(
                    "ep",
                    f"{label}, W={W}, {name}",
                    f"max rel err vs one device {rel(got, ref):.1e}; fwd+bwd {ms:.2f} ms",
                )
            except Exception as ex:  # noqa: BLE001  (each exchange reported on its own)
                note("ep", f"{label}, W={W}, {name}", f"ERROR {type(ex).__name__}: {str(ex).splitlines()[0][:200]}")
        if "all_to_all" in results and "ragged_all_to_all" in results:
            note(
                "ep",
                f"{label}, ragged_all_to_all vs all_to_all",
                f"max rel err {rel(results['ragged_all_to_all'], results['all_to_all']):.1e}",
            )


def _time(step, iters: int) -> float:
    import jax

    jax.block_until_ready(step())
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(step())
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


# ---------------------------------------------------------------- memory


def part_memory(args) -> None:
    models = ["sonic-7b", "qwen3-30b-a3b"]
    for model in models:
        for layers in (1, 4):
            row = {}
            for custom in (True, False):
                cmd = [
                    sys.executable,
                    os.path.abspath(__file__),
                    "--memory-child",
                    model,
                    str(layers),
                    str(int(custom)),
                    "--mem-tokens",
                    str(args.mem_tokens),
                ]
                if args.quick:
                    cmd.append("--quick")
                run = subprocess.run(
                    cmd,
                    capture_output=True,
                    text=True,
                    timeout=900,
                    env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src"), "JAX_TRACEBACK_FILTERING": "off"},
                )
                if run.returncode != 0:
                    error = [line for line in run.stderr.strip().splitlines() if "Error" in line][-3:]
                    raise RuntimeError(f"memory child {model} x{layers}: {error or run.stderr.strip()[-600:]}")
                row[custom] = json.loads(run.stdout.strip().splitlines()[-1])
            a, b = row[True], row[False]
            peak = (
                "n/a (no allocator statistics here)"
                if a["peak_gib"] is None
                else f"custom VJP {a['peak_gib']:.2f} vs autodiff {b['peak_gib']:.2f} (x{b['peak_gib'] / a['peak_gib']:.2f})"
            )
            size = "quick" if args.quick else f"T={args.mem_tokens}"
            note(
                "memory",
                f"{model} ({size}), {layers} layer(s), fwd+bwd peak GiB",
                f"{peak}; XLA temp {a['xla_temp_gib']:.2f} vs {b['xla_temp_gib']:.2f}; "
                f"fwd+bwd ms {a['ms']:.2f} vs {b['ms']:.2f}",
            )


def memory_child(model: str, layers: int, custom: bool, quick: bool, tokens: int) -> None:
    """One process, one measurement: L chained layers (routed experts only, bf16), forward + backward of
    ``sum(y * dy)`` w.r.t. x and every parameter; prints JSON."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import moeyard.jax as mj
    from moeyard.bench.models import get_model, routed_only

    shape = get_model(model)
    cfg = routed_only(shape.moe_config())
    T = 512 if quick else tokens
    if quick:
        import dataclasses

        cfg = dataclasses.replace(cfg, hidden_size=128, intermediate_size=64, num_experts=16)
    dtype = jnp.bfloat16 if on_gpu() else jnp.float32
    stack = [mj.MoE(cfg, rngs=nnx.Rngs(i), dtype=dtype, custom_vjp=custom) for i in range(layers)]
    graphdef, params, rest = nnx.split(stack, nnx.Param, ...)
    key = jax.random.key(0)
    x = jax.random.normal(key, (T, cfg.hidden_size), dtype)
    dy = jax.random.normal(jax.random.key(1), (T, cfg.hidden_size), dtype)

    def fwd(params, x):
        for layer in nnx.merge(graphdef, params, rest, copy=True):
            x = layer(x)
        return x

    def step(params, x, dy):
        _, pullback = jax.vjp(fwd, params, x)
        return pullback(dy)

    compiled = jax.jit(step).lower(params, x, dy).compile()
    mem = compiled.memory_analysis()
    dev = jax.devices()[0]
    jax.block_until_ready(compiled(params, x, dy))
    base = sum(a.nbytes for a in jax.tree_util.tree_leaves((params, rest, x, dy)))
    stats = dev.memory_stats() or {}
    peak = None if "peak_bytes_in_use" not in stats else (stats["peak_bytes_in_use"] - base) / 2**30
    ms = _time(lambda: compiled(params, x, dy), 5)
    print(json.dumps({"peak_gib": peak, "xla_temp_gib": mem.temp_size_in_bytes / 2**30, "ms": ms}))


# ---------------------------------------------------------------- bench


def part_bench(args) -> None:
    out = os.path.join(args.out, "jax_bench.json")
    models = args.models.split(",") if args.models else list(ANCHORS)
    cmd = [sys.executable, "-m", "moeyard", "bench", "--framework", "jax", "--json", out]
    for m in models:
        cmd += ["--model", m]
    if args.backends:
        cmd += ["--backends", args.backends]
    if args.quick:
        cmd = [
            sys.executable,
            "-m",
            "moeyard",
            "bench",
            "--framework",
            "jax",
            "--json",
            out,
            "--shape",
            "256,64,32,8,2",
            "--backends",
            "grouped_mm",
            "--no-peers",
            "--iters",
            "2",
            "--warmup",
            "1",
        ]
    print("  $", " ".join(cmd[1:]), flush=True)
    run = subprocess.run(cmd, text=True, timeout=3600, env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")})
    if run.returncode != 0 and not os.path.exists(out):
        raise RuntimeError(f"moeyard bench exited with {run.returncode}")
    result = json.load(open(out))
    for case in dict.fromkeys(r["case"] for r in result["rows"]):
        rows = {r["impl"]: r for r in result["rows"] if r["case"] == case}
        ok = {k: r for k, r in rows.items() if "error" not in r}
        torch_best = min(
            (r for r in ok.values() if r.get("kind") == "moeyard"), key=lambda r: r["fwdbwd_ms"], default=None
        )
        parts = [
            f"{k} {r['fwd_tflops']:.0f}/{r['fwdbwd_tflops']:.0f}"
            for k, r in ok.items()
            if r.get("kind") == "jax" or r is torch_best
        ]
        errors = [f"{k}: {r['error'][:80]}" for k, r in rows.items() if "error" in r]
        note("bench", f"{case} TFLOP/s fwd/fwd+bwd", "; ".join(parts) + (f"; errors: {errors}" if errors else ""))
        if "jax" in ok:
            note("bench", f"{case} jax row", ok["jax"].get("note", ""))
    print(f"  JSON: {out}")


def use_lowering(name: str) -> bool:
    """Put lowering ``name``'s settings into the environment (this process and its children), after
    checking in a throw-away process that this jax accepts them (an unknown XLA flag aborts XLA)."""
    env = dict(LOWERINGS[name])
    if "XLA_FLAGS" in env:
        env["XLA_FLAGS"] = " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), env["XLA_FLAGS"]) if f)
    if not env:
        return True
    probe = subprocess.run(
        [sys.executable, "-c", "import jax, jax.numpy as jnp; jnp.ones(2).block_until_ready()"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    if probe.returncode != 0:
        print(f"--lowering {name}: this jax does not accept {env}: {probe.stderr.strip().splitlines()[-1:]}")
        return False
    os.environ.update(env)
    return True


PARTS = {"parity": part_parity, "ep": part_ep, "memory": part_memory, "bench": part_bench}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {list(PARTS)} (default: all)")
    p.add_argument("--models", help="bench: comma-separated model names (default: the five ANCHORS.md shapes)")
    p.add_argument(
        "--backends",
        help="bench: the PyTorch rows, as moeyard bench --backends (default: every backend that runs, and the peers)",
    )
    p.add_argument("--out", default="/tmp/moeyard_jax_gpu", help="where the bench JSON goes")
    p.add_argument("--quick", action="store_true", help="toy sizes (implied without a GPU)")
    p.add_argument(
        "--lowering",
        choices=list(LOWERINGS),
        default="default",
        help="ragged_dot's GPU lowering for every part (module docstring)",
    )
    p.add_argument("--mem-tokens", type=int, default=8192, help="memory: tokens per layer call (default 8192)")
    p.add_argument("--memory-child", nargs=3, metavar=("MODEL", "LAYERS", "CUSTOM"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.memory_child:
        model, layers, custom = args.memory_child
        memory_child(model, int(layers), custom == "1", args.quick, args.mem_tokens)
        return 0
    if not use_lowering(args.lowering):
        return 1
    import jax

    args.quick = args.quick or not on_gpu()
    os.makedirs(args.out, exist_ok=True)
    print(
        f"jax {jax.__version__} on {[d.device_kind for d in jax.devices()]}; ragged_dot lowering {args.lowering}; "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}",
        flush=True,
    )
    failed = []
    for name in args.parts.split(","):
        if name not in PARTS:
            print(f"unknown part {name!r}; parts: {list(PARTS)}")
            failed.append(name)
            continue
        print(f"\n== {name}", flush=True)
        t0 = time.perf_counter()
        try:
            PARTS[name](args)
        except Exception as ex:  # noqa: BLE001  (report and go on with the next part)
            traceback.print_exc()
            note(name, "ERROR", f"{type(ex).__name__}: {str(ex).splitlines()[0][:300] if str(ex) else ''}")
            failed.append(name)
        print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    print("\n== summary")
    width = max((len(w) for _, w, _ in SUMMARY), default=10)
    for part, what, result in SUMMARY:
        print(f"{part:7s} {what:{width}s}  {result}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
