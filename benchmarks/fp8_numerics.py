"""FP8 recipes' numerics: signal-to-quantisation-noise ratio (dB) of the routed experts' output and of
every gradient against float32, per recipe, at a real model shape, under four conditions.

SQNR(y, ref) = 10 log10(|ref|^2 / |y - ref|^2) over all elements (torchao's ``compute_error``). The
layer: a softmax top-k router (float32 logits ``x R^T``, renormalised), then ``moeyard.experts``; the
loss is ``<y, dy>`` with a fixed random ``dy``, so the gradients are those of x, ``gate_up_proj``,
``down_proj`` and the router weight R. Reference: the same computation in float32 without a recipe.
The top-k choice is made once, on the float32 inputs, and shared by every run (the routing weights
stay differentiable): near-ties chosen differently after x is rounded to bf16 would otherwise send a
few tokens to other experts, an error of the routing, not of the GEMMs.
Rows: the compute dtype alone (bfloat16, no recipe: the floor every recipe stands on) and each recipe
in that dtype. Conditions:

- ``normal``: x ~ N(0, 1), near-uniform routing;
- ``outliers``: 4 of H channels of x scaled by 100 (activation outliers, as in LLM.int8());
- ``skewed``: Zipf routing (``alpha = 1.2``: the hottest expert gets ~25x the mean load);
- ``empty``: only a quarter of the experts receive tokens.

``dense`` repeats ``normal`` with one expert and top-1 (a dense FFN of the same H and I, the same
quantisation): the recipe's error on the MoE layer should stay within 1 dB of it.

torchao's bars for its MoE FP8 tests (``test/prototype/moe_training/test_training.py``): output >= 23 dB,
input gradient >= 29 dB, weight gradients >= 21 dB, measured against the same block in bf16 (not
float32), with a bf16 shared expert beside the routed experts (its share of the input gradient is not
quantised), weights drawn with std 0.02 and the loss ``mse(out, 1)``, whose gradient is nearly constant
(the output is small), so quantising it loses little. ``--protocol torchao`` measures that way: a
``moeyard.MoE`` with one shared expert (intermediate size I), against itself in bf16 without the recipe.
The default protocol (``random``) is harder: a random output gradient through two FP8 GEMMs on each path
(e4m3 keeps 3 mantissa bits: one cast is about 29 dB, a GEMM of two casts about 26 dB, two GEMMs about
23 dB).

Usage: ``PYTHONPATH=src python benchmarks/fp8_numerics.py [--model qwen3-30b-a3b] [--tokens 4096]
[--device cuda] [--json PATH]``; on CPU use ``--small`` (H 256, I 128, E 16, k 4, 512 tokens).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

import moeyard
from moeyard.bench.models import get_model

QUANTITIES = ("out", "dx", "dw_up", "dw_down", "d_router")
BARS = {"out": 23.0, "dx": 29.0, "dw_up": 21.0, "dw_down": 21.0}  # torchao's test bars (dB)


def sqnr(y: torch.Tensor, ref: torch.Tensor) -> float:
    ref, y = ref.double(), y.double()
    noise = (y - ref).square().sum().item()
    return math.inf if noise == 0 else 10 * math.log10(ref.square().sum().item() / noise)


def make_case(H: int, I: int, E: int, K: int, T: int, condition: str, device, seed: int = 0) -> dict:
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    if condition == "outliers":
        x[:, torch.randperm(H, generator=g)[:4]] *= 100
    bias = torch.zeros(E)
    if condition == "skewed":
        bias = -1.2 * torch.log(torch.arange(1, E + 1, dtype=torch.float32)) * 4
    elif condition == "empty":
        bias[E // 4 :] = -math.inf
    router = torch.randn(E, H, generator=g) * H**-0.5
    ids = (x @ router.T + bias).topk(K, dim=-1).indices  # chosen once, in float32
    return {
        "x": x.to(device),
        "router": router.to(device),
        "bias": bias.to(device),
        "ids": ids.to(device),
        "up": (torch.randn(E, 2 * I, H, generator=g) * H**-0.5).to(device),
        "down": (torch.randn(E, H, I, generator=g) * I**-0.5).to(device),
        "dy": torch.randn(T, H, generator=g).to(device),
        "K": K,
    }


def run(case: dict, dtype: torch.dtype, recipe, backend: str) -> dict:
    leaves = {k: case[k].detach().to(dtype).requires_grad_() for k in ("x", "router", "up", "down")}
    logits = leaves["x"].float() @ leaves["router"].float().T + case["bias"]
    ids = case["ids"]
    w = logits.softmax(-1).gather(1, ids)
    w = w / w.sum(-1, keepdim=True)
    y = moeyard.experts(leaves["x"], ids, w.to(dtype), leaves["up"], leaves["down"], backend=backend, recipe=recipe)
    y.backward(case["dy"].to(dtype))
    return {
        "out": y.detach(),
        "dx": leaves["x"].grad,
        "dw_up": leaves["up"].grad,
        "dw_down": leaves["down"].grad,
        "d_router": leaves["router"].grad,
    }


def torchao_protocol(args, H, I, E, K, T) -> list[dict]:
    """SQNR under torchao's test protocol (module docstring): ``moeyard.MoE`` with a shared expert, init std
    0.02, loss ``mse(out, 1)``, against the same layer in the compute dtype without a recipe."""
    dtype = getattr(torch, args.dtype)
    cfg = moeyard.MoEConfig(
        num_experts=E, hidden_size=H, intermediate_size=I, top_k=K, num_shared_experts=1, norm_topk_prob=True
    )
    torch.manual_seed(42)
    base = moeyard.MoE(cfg, backend=args.backend, device=args.device, dtype=dtype)
    for p in base.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x0 = torch.randn(T, H, device=args.device, dtype=dtype)

    def step(recipe):
        base.recipe = recipe
        base.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        out = base(x)
        torch.nn.functional.mse_loss(out, torch.ones_like(out)).backward()
        return {
            "out": out.detach(),
            "dx": x.grad,
            "dw_up": base.gate_up_proj.grad,
            "dw_down": base.down_proj.grad,
            "d_router": base.router.weight.grad,
        }

    ref = step(None)
    rows = []
    for recipe in args.recipes:
        got = step(recipe)
        rows.append({"condition": "torchao", "recipe": recipe, **{q: sqnr(got[q], ref[q]) for q in QUANTITIES}})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def table(args) -> dict:
    shape = get_model(args.model)
    cfg = shape.moe_config()
    H, I, E, K, T = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.top_k, args.tokens
    if args.small:
        H, I, E, K, T = 256, 128, 16, 4, 512
    dtype = getattr(torch, args.dtype)
    if args.protocol == "torchao":
        return {
            "shape": {"H": H, "I": I, "E": E, "K": K, "T": T},
            "dtype": args.dtype,
            "backend": args.backend,
            "protocol": "torchao",
            "device": _device_name(args.device),
            "rows": torchao_protocol(args, H, I, E, K, T),
        }
    rows = []
    for condition in ("normal", "outliers", "skewed", "empty", "dense"):
        e, k = (1, 1) if condition == "dense" else (E, K)
        case = make_case(H, I, e, k, T, "normal" if condition == "dense" else condition, args.device)
        ref = run(case, torch.float32, None, args.backend)
        for recipe in [None] + args.recipes:
            got = run(case, dtype, recipe, args.backend)
            db = {q: sqnr(got[q], ref[q]) for q in QUANTITIES if not (condition == "dense" and q == "d_router")}
            rows.append({"condition": condition, "recipe": recipe or args.dtype, **db})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return {
        "shape": {"H": H, "I": I, "E": E, "K": K, "T": T},
        "dtype": args.dtype,
        "backend": args.backend,
        "protocol": "random",
        "device": _device_name(args.device),
        "rows": rows,
    }


def _device_name(device) -> str:
    return torch.cuda.get_device_name() if str(device).startswith("cuda") else "cpu"


def print_table(result: dict) -> None:
    s = result["shape"]
    against = "float32" if result["protocol"] == "random" else f"{result['dtype']} (torchao's protocol)"
    print(
        f"SQNR (dB) against {against} · H {s['H']} I {s['I']} E {s['E']} k {s['K']} T {s['T']} · "
        f"{result['dtype']} · backend {result['backend']} · {result['device']}"
    )
    print(f"{'condition':10} {'recipe':14} " + " ".join(f"{q:>9}" for q in QUANTITIES))
    for r in result["rows"]:
        print(f"{r['condition']:10} {r['recipe']:14} " + " ".join(f"{r.get(q, float('nan')):9.2f}" for q in QUANTITIES))
    dense = {r["recipe"]: r for r in result["rows"] if r["condition"] == "dense"}
    fails = []
    for r in result["rows"]:
        if r["condition"] == "dense" or r["recipe"] == result["dtype"]:
            continue
        fails += [f"{r['condition']}/{r['recipe']}/{q} {r[q]:.1f} < {bar}" for q, bar in BARS.items() if r[q] < bar]
        d = dense.get(r["recipe"])
        if d and r["condition"] == "normal":
            fails += [
                f"normal/{r['recipe']}/{q} {r[q]:.1f} more than 1 dB below dense {d[q]:.1f}"
                for q in BARS
                if r[q] < d[q] - 1
            ]
    print("bars: " + ("all met" if not fails else "; ".join(fails)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--small", action="store_true", help="H 256, I 128, E 16, k 4, 512 tokens (CPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--backend", default="grouped_mm")
    p.add_argument("--recipes", default=",".join(moeyard.recipe_names()))
    p.add_argument("--protocol", default="random", choices=["random", "torchao"])
    p.add_argument("--json")
    args = p.parse_args(argv)
    args.recipes = [r for r in args.recipes.split(",") if r]
    result = table(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
