"""The router alone: :func:`moeyard.routing.route` on the torch path vs the fused Triton router
(:mod:`moeyard.routing.fused`), forward and forward + backward, at model router shapes.

    python benchmarks/router_bench.py [--models ...] [--tokens T] [--dtype bfloat16] [--iters 20] [--json PATH]

First a correctness pre-check per shape (float32 at min(T, 4096) tokens: identical ids and matching
values and gradients; then the bench dtype at T: agreement of ids, a tie-aware count), then timings:
CUDA events, median of ``--iters`` runs, inputs rotating over three fresh ``randn`` sets. The table
gives ms, the GB/s of reading x once (``T * H`` elements), and the floor: x's bytes at the device's
measured copy bandwidth. Shapes the fused router does not cover (grouped top-k) show ``fallback``:
``route`` runs the torch path there. ``--kernels N``: after the timings of each shape, the N costliest
GPU kernels of one forward + backward per implementation (``torch.profiler``), to see where each one's
time goes. Exit status 1 when a pre-check fails.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from moeyard import bench
from moeyard.bench.models import get_model
from moeyard.routing import fused, route, use_router

MODELS = ("qwen3-30b-a3b", "qwen3.5-35b-a3b", "olmoe-1b-7b", "deepseek-v3", "gpt-oss-20b", "gpt-oss-120b")
N_SETS = 3


def make_inputs(cfg, T: int, dtype, device, n_sets: int = N_SETS, seed: int = 0) -> list[dict]:
    """``n_sets`` fresh input sets: x, weight (and bias / correction bias when the config has them)."""
    g = torch.Generator(device).manual_seed(seed)
    E, H = cfg.num_experts, cfg.hidden_size
    sets = []
    for _ in range(n_sets):
        s = dict(
            x=torch.randn(T, H, device=device, dtype=dtype, generator=g),
            weight=(torch.randn(E, H, device=device, generator=g) / H**0.5).to(dtype),
        )
        if cfg.router_bias:
            s["bias"] = (torch.randn(E, device=device, generator=g) * 0.1).to(dtype)
        if cfg.score_correction_bias:
            s["correction_bias"] = torch.randn(E, device=device, generator=g) * 0.01
        sets.append(s)
    return sets


def run_route(cfg, inp: dict, impl: str, backward: bool):
    """One call of ``route`` (and its backward through the weights and the loss when ``backward``)."""
    x, w = inp["x"], inp["weight"]
    if backward:
        x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    with use_router(impl), torch.set_grad_enabled(backward):
        out = route(x, w, cfg, bias=inp.get("bias"), correction_bias=inp.get("correction_bias"))
    if not backward:
        return out, ()
    # a non-constant weight gradient (ones would vanish through the renormalisation), and the losses
    torch.autograd.backward([out.topk_weights, out.loss, out.z_loss], [out.topk_weights.detach(), None, None])
    return out, (x.grad, w.grad)


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def check(cfg, T: int, dtype, device) -> dict:
    """Fused vs torch path: float32 at min(T, 4096) tokens (ids identical, values and gradients
    close) and ``dtype`` at T (fraction of tokens whose id set differs; bf16 logits tie often)."""
    inp = make_inputs(cfg, min(T, 4096), torch.float32, device, 1, seed=7)[0]
    (a, ga), (b, gb) = (run_route(cfg, inp, impl, True) for impl in ("fused", "torch"))
    # ids equal, or equal up to (near-)ties: where the ids differ, the scores they select agree to float32
    # rounding (which of two equal scores top-k returns first is not specified; the fused kernel takes
    # the lower id, and the two paths' scores may differ in the last bit)
    picked = (a.scores.gather(1, a.topk_ids), b.scores.gather(1, b.topk_ids))
    res = dict(
        ids_equal_fp32=bool(torch.equal(a.topk_ids, b.topk_ids) or torch.allclose(*picked, rtol=1e-5, atol=0)),
        max_rel_fp32=max(
            _rel(getattr(a, n), getattr(b, n))
            for n in ("topk_weights", "router_logits", "scores", "aux_loss", "z_loss", "loss")
        ),
        grad_rel_fp32=max(_rel(u, v) for u, v in zip(ga, gb, strict=True)),
    )
    inp = make_inputs(cfg, T, dtype, device, 1, seed=8)[0]
    (a, _), (b, _) = (run_route(cfg, inp, impl, False) for impl in ("fused", "torch"))
    same = (a.topk_ids.sort(1).values == b.topk_ids.sort(1).values).all(1)
    res["id_set_mismatch"] = 1.0 - same.float().mean().item()
    res["logits_rel"] = _rel(a.router_logits, b.router_logits)
    res["ok"] = (
        res["ids_equal_fp32"]
        and res["max_rel_fp32"] < 1e-4
        and res["grad_rel_fp32"] < 1e-4
        and res["logits_rel"] < 1e-2
    )
    return res


def copy_bandwidth(device, warmup: int, iters: int) -> float:
    """Device copy bandwidth in GB/s (read + write of a 1 GiB buffer)."""
    src = torch.empty(2**28, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    ms = bench.time_ms(lambda i: dst.copy_(src), 1, warmup, iters, device)
    return 2 * src.numel() * 4 / ms / 1e6


def time_case(cfg, T: int, dtype, device, warmup: int, iters: int) -> dict:
    sets = make_inputs(cfg, T, dtype, device)
    out = {}
    for impl in ("torch", "fused"):
        for phase, bwd in (("fwd", False), ("fwd_bwd", True)):
            out[f"{impl}_{phase}_ms"] = bench.time_ms(
                lambda i, impl=impl, bwd=bwd: run_route(cfg, sets[i], impl, bwd), N_SETS, warmup, iters, device
            )
    return out


def kernel_table(cfg, T: int, dtype, device, top: int) -> str:
    """The ``top`` costliest GPU kernels of one forward + backward per implementation (after one
    untimed call), as ``torch.profiler``'s table sorted by device time."""
    inp = make_inputs(cfg, T, dtype, device, 1, seed=9)[0]
    cuda = device.type == "cuda"
    acts = [torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU]
    out = []
    for impl in ("torch", "fused"):
        for _ in range(2):  # the first call untimed (compiles), the second profiled
            with torch.profiler.profile(activities=acts) as prof:
                run_route(cfg, inp, impl, True)
                if cuda:
                    torch.cuda.synchronize(device)
        out.append(
            f"-- {impl}\n"
            + prof.key_averages().table(
                sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=top, max_name_column_width=60
            )
        )
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument(
        "--kernels",
        type=int,
        default=0,
        metavar="N",
        help="print the N costliest GPU kernels of one fwd+bwd per implementation",
    )
    p.add_argument("--json")
    a = p.parse_args()
    device = torch.device("cuda")
    dtype = getattr(torch, a.dtype)
    bw = copy_bandwidth(device, a.warmup, a.iters)
    print(f"{torch.cuda.get_device_name(device)}; copy bandwidth {bw:.0f} GB/s; T={a.tokens}, {a.dtype}", flush=True)
    print(
        f"{'model':16} {'E':>4} {'K':>3} {'path':9} {'check':28} {'torch fwd':>9} {'fused fwd':>9} "
        f"{'GB/s':>6} {'floor':>6} {'torch f+b':>9} {'fused f+b':>9}",
        flush=True,
    )
    rows, ok = [], True
    for name in a.models:
        cfg = get_model(name).moe_config()
        probe = torch.empty(0, cfg.hidden_size, device=device, dtype=dtype)
        path = "fused" if fused.unsupported(probe, cfg) is None else "fallback"
        chk = check(cfg, a.tokens, dtype, device)
        ok &= chk["ok"]
        t = time_case(cfg, a.tokens, dtype, device, a.warmup, a.iters)
        x_gb = a.tokens * cfg.hidden_size * dtype.itemsize / 1e9
        row = dict(
            model=name,
            T=a.tokens,
            H=cfg.hidden_size,
            E=cfg.num_experts,
            K=cfg.top_k,
            path=path,
            dtype=a.dtype,
            x_GB=x_gb,
            floor_ms=x_gb / bw * 1e3,
            copy_GBps=bw,
            **chk,
            **t,
        )
        rows.append(row)
        note = f"{'ok' if chk['ok'] else 'FAIL'} ids {chk['id_set_mismatch']:.1e} g {chk['grad_rel_fp32']:.0e}"
        print(
            f"{name:16} {row['E']:>4} {row['K']:>3} {path:9} {note:28} {t['torch_fwd_ms']:9.3f} "
            f"{t['fused_fwd_ms']:9.3f} {x_gb / t['fused_fwd_ms'] * 1e3:6.0f} {row['floor_ms']:6.3f} "
            f"{t['torch_fwd_bwd_ms']:9.3f} {t['fused_fwd_bwd_ms']:9.3f}",
            flush=True,
        )
        if a.kernels > 0:
            print(kernel_table(cfg, a.tokens, dtype, device, a.kernels), flush=True)
        bench.free_memory("cuda")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
