"""Per-kernel profile of the ``triton`` expert backend: which launch limits speed, and how far each
is from its roofline, in one GPU call.

At each shape (bf16, fresh random inputs, softmax-top-k routing of random logits) the routing and
every intermediate are built once; then each launch of the forward and backward is timed alone
through the backend's own launch functions (``triton.testing.do_bench``: warm-up, L2 flushed before
each run, median), next to its FLOP count and its fewest bytes (each input read once, each output
written once). Ceilings of the same run: a dense bf16 8192^3 matmul and a large device-to-device
copy (bytes read + written). The whole layer (forward; forward + backward) is timed too: its time
minus the kernels' sum is launch gaps and torch glue.

Usage (repository root, GPU machine):
  PYTHONPATH=src python3 benchmarks/triton_profile.py                       # both shapes, default options
  PYTHONPATH=src python3 benchmarks/triton_profile.py --variants            # + each option, A/B
Legend: T tokens, H hidden, I intermediate, E experts, K top-k, N = T*K pairs, N1 = 2I (swiglu).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field

CONFIGS = ("qwen3-30b-a3b", "sonic-7b")  # default shapes: names in moeyard.bench.models (any registered name works)
# --variants: name -> backend options (moeyard.experts.triton.options)
VARIANTS = {
    "default": {},
    "atomic": dict(atomic_combine=True),
    "chunk": dict(wgrad_chunk_rows=4096),
    "all": dict(atomic_combine=True, wgrad_chunk_rows=4096),
    "pointer": dict(tma=False, tma_wgrad=False, tma_up=False),  # no TMA loads (the kernels of GPUs before Hopper)
    "prefetch": dict(prefetch_h=True),  # dh prefetches its h rows into L2 before its main loop
    "pointer_up": dict(tma_up=False),  # the up projection's weight tiles by pointer loads
    "triton_up": dict(gluon_up=False),  # the up projection in the Triton kernel, not the Gluon one (sm_90)
    "triton_dh": dict(gluon_dh=False),  # the activation gradient in the Triton kernel, not the Gluon one (sm_90)
    "triton_wgrad": dict(
        gluon_wgrad=False
    ),  # the base weight gradients in the Triton kernel, not the Gluon one (sm_90)
}
DH_PARTIAL_BN = 64  # column tiles of the routing-weight gradient partial (ops.DH_CONFIGS: BN >= 64)


@dataclass(frozen=True, kw_only=True)
class Shape:
    T: int
    H: int
    I: int  # noqa: E741
    E: int
    K: int

    @property
    def N(self) -> int:
        return self.T * self.K

    @classmethod
    def of(cls, name: str) -> Shape:
        """The routed experts of a registered model shape (``moeyard.bench.models``) at its benchmark T."""
        from moeyard.bench.models import get_model

        m = get_model(name)
        c = m.moe_config()
        return cls(T=m.tokens, H=c.hidden_size, I=c.intermediate_size, E=c.num_experts, K=c.top_k)


@dataclass(kw_only=True)
class Cost:
    """One launch: its phase (fwd / bwd), FLOPs and fewest bytes."""

    name: str
    phase: str
    flops: float
    bytes: float
    run: object = field(default=None, repr=False)  # () -> None on the GPU


def chunk_usage(counts: list[int], chunk: int) -> tuple[int, int]:
    """``(slots, split_experts)`` of a chunked weight gradient: partial slots written (the chunks of
    experts longer than ``chunk`` rows) and the number of such experts. ``chunk == 0``: ``(0, 0)``."""
    if chunk <= 0:
        return 0, 0
    split = [c for c in counts if c > chunk]
    return sum(-(-c // chunk) for c in split), len(split)


def kernel_costs(
    s: Shape,
    *,
    itemsize: int = 2,
    atomic: bool = False,
    chunk_slots=(0, 0),
    split_experts=(0, 0),
    chunked=(False, False),
) -> list[Cost]:
    """Every launch of forward + backward at shape ``s`` (gated activation, no biases), in order.
    ``chunk_slots`` / ``split_experts``: per weight gradient (down, up), from :func:`chunk_usage`;
    ``chunked``: whether that weight gradient runs chunked (then its second stage is launched)."""
    T, H, I, E, N = s.T, s.H, s.I, s.E, s.N
    N1, b = 2 * I, itemsize
    idx = 8 * N  # sort_order (int64) read once
    out = [
        Cost(
            name="up (x@W_up, act)",
            phase="fwd",
            flops=2 * N * H * N1,
            bytes=b * (T * H + E * N1 * H + N * N1 + N * I) + idx,
        )
    ]
    out += _down_combine_costs("fwd", s, KA=I, NY=H, b=b, atomic=atomic, weighted=True)
    tiles = -(-I // DH_PARTIAL_BN)
    out += [
        Cost(name="dtw partial zero", phase="bwd", flops=0, bytes=4 * tiles * N),
        Cost(
            name="dh (dout@W_down, act')",
            phase="bwd",
            flops=2 * N * H * I,
            bytes=b * (T * H + E * H * I + N * N1 + N * N1 + N * I + N) + 4 * tiles * N + idx,
        ),
        Cost(name="dtw partial sum", phase="bwd", flops=tiles * N, bytes=4 * tiles * N + 4 * N),
    ]
    out += _wgrad_costs(
        "wgrad down",
        s,
        NL=H,
        NR=I,
        b=b,
        operands=T * H + N * I,
        slots=chunk_slots[0],
        split=split_experts[0],
        chunked=chunked[0],
    )
    out += _down_combine_costs("bwd", s, KA=N1, NY=H, b=b, atomic=atomic, weighted=False)
    out += _wgrad_costs(
        "wgrad up",
        s,
        NL=N1,
        NR=H,
        b=b,
        operands=N * N1 + T * H,
        slots=chunk_slots[1],
        split=split_experts[1],
        chunked=chunked[1],
    )
    return out


def _down_combine_costs(phase, s: Shape, *, KA, NY, b, atomic, weighted) -> list[Cost]:
    """The down projection and combine (``y = rows @ W^T`` by pair, then per token), or with
    ``atomic`` the zero-fill, the down projection adding into float32 ``[T, NY]``, and the cast."""
    T, E, N = s.T, s.E, s.N
    tag = "down" if phase == "fwd" else "dx"
    gemm_flops = 2 * N * KA * NY
    read = b * (N * KA + E * NY * KA) + 8 * N + (b * N if weighted else 0)
    if atomic:
        return [
            Cost(name=f"{tag} acc zero", phase=phase, flops=0, bytes=4 * T * NY),
            Cost(name=f"{tag} (atomic combine)", phase=phase, flops=gemm_flops + N * NY, bytes=read + 4 * T * NY),
            Cost(name=f"{tag} cast", phase=phase, flops=0, bytes=4 * T * NY + b * T * NY),
        ]
    return [
        Cost(name=tag, phase=phase, flops=gemm_flops, bytes=read + b * N * NY),
        Cost(name=f"{tag} combine", phase=phase, flops=N * NY, bytes=b * (N * NY + T * NY) + 8 * N),
    ]


def _wgrad_costs(tag, s: Shape, *, NL, NR, b, operands, slots, split, chunked=False) -> list[Cost]:
    """A weight gradient ``[E, NL, NR]``: its GEMM over every pair (the gather index: int32 tokens), and
    (``chunked``) the partials' float32 writes plus the second-stage sum (launched even when no expert
    is split)."""
    N, E = s.N, s.E
    main = Cost(
        name=tag,
        phase="bwd",
        flops=2 * N * NL * NR,
        bytes=b * operands + 4 * N + b * (E - split) * NL * NR + 4 * slots * NL * NR,
    )
    if not chunked:
        return [main]
    return [
        main,
        Cost(name=f"{tag} reduce", phase="bwd", flops=slots * NL * NR, bytes=4 * slots * NL * NR + b * split * NL * NR),
    ]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma list of moeyard.bench.models names")
    ap.add_argument(
        "--variants",
        nargs="?",
        const=",".join(VARIANTS),
        default="",
        help=f"also profile these option sets (default all of {sorted(VARIANTS)})",
    )
    ap.add_argument("--chunk", type=int, default=4096, help="rows per chunk of the 'chunk'/'all' variants")
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    ap.add_argument("--rep", type=int, default=200, help="do_bench repetition time, ms")
    ap.add_argument(
        "--skew",
        type=float,
        default=0.0,
        help="routing skew: expert e's logit gets -skew * log(1 + e) (0: balanced-ish random)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/triton_profile"))
    args = ap.parse_args(argv)
    args.configs = [c for c in args.configs.split(",") if c]
    from moeyard.bench.models import model_names

    unknown = [c for c in args.configs if c not in model_names()]
    if unknown:
        ap.error(f"unknown configs {unknown}; known: {model_names()}")
    args.variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variants {bad}; known: {sorted(VARIANTS)}")
    return args


def variant_options(name: str, chunk: int) -> dict:
    opts = dict(VARIANTS[name])
    if "wgrad_chunk_rows" in opts:
        opts["wgrad_chunk_rows"] = chunk
    return opts


# ---------------------------------------------------------------- GPU side


def bench(fn, args) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")


def ceilings(args) -> tuple[float, float]:
    """``(dense bf16 TFLOP/s, copy GB/s)`` measured now: 8192^3 matmul; 2 GiB device-to-device copy."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    tflops = 2 * 8192**3 / bench(lambda: a @ b, args) / 1e9
    src = torch.randn(2**29, device="cuda")  # 2 GiB float32
    dst = torch.empty_like(src)
    gbps = 2 * src.numel() * 4 / bench(lambda: dst.copy_(src), args) / 1e6
    return tflops, gbps


def make_inputs(s: Shape, seed: int, skew: float = 0.0, device: str = "cuda", dtype=None):
    """``(x, w_up, w_down, topk_weights, topk_ids, dout)`` in ``dtype`` (default bfloat16)."""
    import torch

    g = torch.Generator(device).manual_seed(seed)
    dt, dev = dtype or torch.bfloat16, device
    x = torch.randn(s.T, s.H, device=dev, generator=g).to(dt)
    w_up = (torch.randn(s.E, 2 * s.I, s.H, device=dev, generator=g) / s.H**0.5).to(dt)
    w_down = (torch.randn(s.E, s.H, s.I, device=dev, generator=g) / s.I**0.5).to(dt)
    logits = torch.randn(s.T, s.E, device=dev, generator=g)
    logits -= skew * torch.arange(1, s.E + 1, device=dev).log()
    tw, ids = logits.softmax(-1).topk(s.K, dim=-1)
    tw = (tw / tw.sum(-1, keepdim=True)).to(dt)
    dout = torch.randn(s.T, s.H, device=dev, generator=g).to(dt)
    return x, w_up, w_down, tw, ids, dout


NO_LORA = (None, None, 0, 0.0)  # the custom ops' LoRA arguments (la, lb, mode, scale) when there is none


def launches(s: Shape, inputs, opts: dict) -> list[Cost]:
    """:func:`kernel_costs` with each entry's ``run`` bound to the backend's launch on prebuilt buffers."""
    import torch

    from moeyard.experts.triton import ops
    from moeyard.experts.triton.options import Options
    from moeyard.experts.triton.schedule import max_partial_slots

    x, w_up, w_down, tw, ids, dout = inputs
    o = Options(**opts)
    r = ops.routing(ids, s.E)
    tw = tw.reshape(-1)
    spec = ops.ActSpec(name="swiglu")
    h, a, _ = ops.up_proj(x, w_up, None, r, spec, store_h=True)
    dh, aw, _, _ = ops.act_grad(dout, w_down, None, h, tw, r, spec)
    counts = r.expert_offsets.diff().tolist()  # host sync: fine outside the timed region
    chunks = [o.chunk_rows(s.N, nl, nr) for nl, nr in ((s.H, s.I), (2 * s.I, s.H))]
    chunks = [c if 0 < c < s.N else 0 for c in chunks]
    usage = [chunk_usage(counts, c) for c in chunks]
    costs = kernel_costs(
        s,
        atomic=o.atomic_combine,
        chunk_slots=tuple(u[0] for u in usage),
        split_experts=tuple(u[1] for u in usage),
        chunked=tuple(c > 0 for c in chunks),
    )
    N, T, H, I, dev = s.N, s.T, s.H, s.I, x.device
    y = torch.empty(N, H, device=dev, dtype=x.dtype)
    out = torch.empty(T, H, device=dev, dtype=x.dtype)
    acc = torch.zeros(T, H, device=dev, dtype=torch.float32)
    dw_part = torch.zeros(-(-I // ops._dh_min_bn()), N, device=dev, dtype=torch.float32)
    dh2, aw2 = torch.empty_like(dh), torch.empty_like(aw)
    so, off, K = r.sort_order, r.expert_offsets, s.K

    def wgrad_runs(lhs, rhs, l_tok, r_tok, like, chunk):
        dw = torch.empty_like(like)
        part = torch.empty((max_partial_slots(N, chunk), *like.shape[1:]), device=dev) if chunk else None
        main = lambda: ops.launch_wgrad(
            lhs,
            rhs,
            l_tok,
            r_tok,
            None,
            r.sorted_token,
            off,
            chunk,  # noqa: E731
            dw,
            None,
            part,
            None,
        )
        return [main, lambda: ops.launch_wgrad_reduce(part, None, off, chunk, dw, None)] if chunk else [main]

    def down_runs(rows, w, weights):
        if o.atomic_combine:
            return [
                acc.zero_,
                lambda: ops.launch_down(rows, w, None, weights, so, off, K, *NO_LORA, acc, None, None, True),
                lambda: out.copy_(acc),
            ]
        table = ops._down_table(rows, r, 0)  # made once per routing, as in a step
        return [
            lambda: ops.launch_down(rows, w, None, weights, so, off, K, *NO_LORA, y, None, table, False),
            lambda: ops.combine_(y, r.topk_ids, None, s.E, out),
        ]

    up_table = ops._gather_table(x, r, spec, "gluon_up")  # the Gluon kernels' tile table on sm_90, else None
    dh_table = ops._gather_table(dout, r, spec, "gluon_dh")
    runs = [
        lambda: ops.up_proj_(
            x, w_up, None, so, off, K, "swiglu", 1.702, 7.0, False, True, *NO_LORA, up_table, h, a, None
        )
    ]
    runs += down_runs(a, w_down, tw)
    runs += [
        dw_part.zero_,
        lambda: ops.act_grad_(
            dout,
            w_down,
            None,
            h,
            tw,
            so,
            off,
            K,
            "swiglu",
            1.702,
            7.0,
            False,
            *NO_LORA,
            dh_table,
            dh2,
            aw2,
            dw_part,
            None,
        ),
        lambda: dw_part.sum(0),
    ]
    runs += wgrad_runs(dout, aw, True, False, w_down, chunks[0])
    runs += down_runs(dh, w_up.mT, None)
    runs += wgrad_runs(dh, x, False, True, w_up, chunks[1])
    assert len(runs) == len(costs), (len(runs), [c.name for c in costs])
    for c, fn in zip(costs, runs, strict=True):
        c.run = fn
    costs[0].name += f" [wgrad chunk rows down/up: {chunks[0]}/{chunks[1]}, split experts {usage[0][1]}/{usage[1][1]}]"
    return costs


def whole_layer(s: Shape, inputs, args) -> tuple[float, float, list]:
    """``(fwd ms, fwd+bwd ms, [out, grads...])`` of the whole layer through ``moeyard.experts``."""
    import torch

    import moeyard

    x, w_up, w_down, tw, ids, dout = inputs
    leaves = [t.detach().requires_grad_() for t in (x, w_up, w_down, tw)]

    def fwd():
        return moeyard.experts(leaves[0], ids, leaves[3], leaves[1], leaves[2], backend="triton")

    def fwd_bwd():
        out = fwd()
        return [out.detach(), *torch.autograd.grad(out, leaves, dout)]

    result = fwd_bwd()
    return bench(fwd, args), bench(fwd_bwd, args), result


def reference(inputs, dtype=None) -> list:
    """``[out, dx, dw_up, dw_down, dtw]`` through the ``grouped_mm`` backend (float32 inputs unless
    ``dtype``): the yardstick for the triton results' error."""
    import torch

    import moeyard

    x, w_up, w_down, tw, ids, dout = inputs
    dt = dtype or torch.float32
    leaves = [t.detach().to(dt).requires_grad_() for t in (x, w_up, w_down, tw)]
    out = moeyard.experts(leaves[0], ids, leaves[3], leaves[1], leaves[2], backend="grouped_mm")
    return [out.detach(), *torch.autograd.grad(out, leaves, dout.to(dt))]


def best_configs() -> str:
    from moeyard.experts.triton import ops

    parts = []
    for name, k in ops._kernels().items():
        cfg = getattr(k, "best_config", None)
        if cfg is not None:
            parts.append(f"{name}: {cfg}")
    return "; ".join(parts) or "(fixed configs)"


def table(costs: list[Cost], times: list[float], dense: float, copy: float) -> str:
    total = sum(times)
    lines = [
        "| kernel | phase | ms | TFLOP/s | GB/s | % dense | % copy | floor ms | x floor | share |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c, ms in zip(costs, times, strict=True):
        tf, gb = c.flops / ms / 1e9, c.bytes / ms / 1e6
        floor = max(c.flops / dense / 1e9, c.bytes / copy / 1e6)
        lines.append(
            f"| {c.name} | {c.phase} | {ms:.3f} | {tf:.0f} | {gb:.0f} | {100 * tf / dense:.0f} | "
            f"{100 * gb / copy:.0f} | {floor:.3f} | {ms / max(floor, 1e-9):.2f} | {100 * ms / total:.1f}% |"
        )
    for phase in ("fwd", "bwd"):
        ms = sum(t for c, t in zip(costs, times, strict=True) if c.phase == phase)
        lines.append(f"| sum {phase} | | {ms:.3f} | | | | | | | {100 * ms / total:.1f}% |")
    return "\n".join(lines)


def profile_variant(s: Shape, inputs, name: str, args, dense: float, copy: float) -> tuple[str, list]:
    from moeyard.experts.triton.options import use_options

    opts = variant_options(name, args.chunk)
    with use_options(**opts):
        costs = launches(s, inputs, opts)
        times = []
        for c in costs:
            c.run()  # compile / autotune outside the timing
            times.append(bench(c.run, args))
        f_ms, fb_ms, result = whole_layer(s, inputs, args)
    head = (
        f"variant {name} {opts}: whole layer fwd {f_ms:.3f} ms, fwd+bwd {fb_ms:.3f} ms "
        f"(kernels: fwd {sum(t for c, t in zip(costs, times, strict=True) if c.phase == 'fwd'):.3f}, "
        f"bwd {sum(t for c, t in zip(costs, times, strict=True) if c.phase == 'bwd'):.3f}); configs: {best_configs()}"
    )
    return head + "\n" + table(costs, times, dense, copy), result


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main(argv=None):
    import torch

    from moeyard.experts import triton as _triton  # noqa: F401  (registers "triton")

    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    dense, copy = ceilings(args)
    report = [
        f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d %H:%M')}; "
        f"dense bf16 8192^3 {dense:.0f} TFLOP/s, copy {copy:.0f} GB/s (read + write)"
    ]
    print(report[0], flush=True)
    for cname in args.configs:
        s = Shape.of(cname)
        inputs = make_inputs(s, args.seed, args.skew)
        load = torch.bincount(inputs[4].flatten(), minlength=s.E).float()
        print(f"{cname}: expert load max/mean {(load.max() / load.mean()).item():.2f}", flush=True)
        base = None
        ref, ref_bf16 = reference(inputs), reference(inputs, torch.bfloat16)
        check = "rel error vs float32 grouped_mm (out, dx, dw_up, dw_down, dtw): bf16 grouped_mm " + ", ".join(
            f"{rel(a, b):.1e}" for a, b in zip(ref_bf16, ref, strict=True)
        )
        report.append(check)
        print(check, flush=True)
        for vname in ["default", *[v for v in args.variants if v != "default"]]:
            t0 = time.time()
            text, result = profile_variant(s, inputs, vname, args, dense, copy)
            text += "\nrel error vs float32 grouped_mm: " + ", ".join(
                f"{rel(a, b):.1e}" for a, b in zip(result, ref, strict=True)
            )
            if base is None:
                base = result
            else:
                diffs = ", ".join(f"{rel(a, b):.1e}" for a, b in zip(result, base, strict=True))
                text += f"\nrel diff vs default (out, dx, dw_up, dw_down, dtw): {diffs}"
            text = f"## {cname} {(s.T, s.H, s.I, s.E, s.K)} ({time.time() - t0:.0f}s)\n{text}"
            report.append(text)
            print(text, flush=True)
    with open(os.path.join(args.out, "triton_profile.md"), "w") as f:
        f.write("\n\n".join(report) + "\n")


if __name__ == "__main__":
    main()
