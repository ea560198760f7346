"""Worker of tests/test_parallel_fp8.py (spawned gloo processes): FP8 dispatch against one process.

With ``fp8_dispatch`` the experts receive each token row rounded to e4m3 with one power-of-two scale and
every backward exchange carries the compute dtype, so the oracle is the unsharded ``loop`` experts on
the rows cast that way (``moeyard.quant.fp8.fake_quantize``, ``Blocks(None)``, ``pow2``), its input
gradient taken with respect to those rows."""

from __future__ import annotations

import functools

import torch

import moeyard
from ep_workers import check, check_err, make_functional_inputs, run_functional, slices
from moeyard.parallel import expert_parallel
from moeyard.parallel.comm import resolve_group
from moeyard.parallel.common import EPOptions
from moeyard.parallel.experts import ExpertParallel
from moeyard.quant.fp8 import Blocks, fake_quantize


def oracle_fp8(T_counts, ids_all, inputs, rank, recipe=None) -> dict:
    W = len(T_counts)
    sl = slices(T_counts, rank)
    El = inputs["gate_up_proj"].shape[0] // W
    xq = fake_quantize(inputs["x"], Blocks(None), "pow2").requires_grad_()
    leaves = {k: inputs[k].clone().requires_grad_() for k in ("w", "gate_up_proj", "down_proj")}
    out = moeyard.experts(
        xq, ids_all, leaves["w"], leaves["gate_up_proj"], leaves["down_proj"], backend="loop", recipe=recipe
    )
    out.backward(inputs["dy"])
    blk = slice(rank * El, (rank + 1) * El)
    return {
        "out": out.detach()[sl],
        "x": xq.grad[sl],
        "w": leaves["w"].grad[sl],
        "up": leaves["gate_up_proj"].grad[blk],
        "down": leaves["down_proj"].grad[blk],
    }


def check_fp8_dispatch(rank: int, W: int) -> None:
    E, K, H, I = 4 * W, 2, 24, 8
    g = torch.Generator().manual_seed(5)
    T_counts = [5 + 3 * r for r in range(W)]
    if W > 2:
        T_counts[1] = 0  # a rank with no tokens
    inputs = make_functional_inputs(sum(T_counts), K, E, H, I, g)
    inputs["x"][:, :2] *= 40  # outlier channels: rows whose small values round coarsely
    ids_all = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(sum(T_counts))])
    ep = resolve_group(None)
    for recipe in (None, "fp8_rowwise"):
        oracle = oracle_fp8(T_counts, ids_all, inputs, rank, recipe)
        for name in ("all_to_all", "all_gather"):
            call = ExpertParallel(ep, EPOptions(num_experts=E, dispatcher=name, fp8_dispatch=True))
            ep_call = functools.partial(call, recipe=recipe)
            got = run_functional(ep_call, T_counts, ids_all, inputs, rank, torch.float64, "loop")
            for k in oracle:
                check_err(f"fp8 dispatch {name} recipe {recipe} rank {rank}: {k}", got[k], oracle[k], 1e-12)
    # under fp8_rowwise the experts' own cast of the received rows gives the same bytes: the forward
    # equals the one without FP8 dispatch
    plain = ExpertParallel(ep, EPOptions(num_experts=E, dispatcher="all_to_all"))
    fp8 = ExpertParallel(ep, EPOptions(num_experts=E, dispatcher="all_to_all", fp8_dispatch=True))
    outs = [
        run_functional(
            lambda *a, c=c, **kw: c(*a, recipe="fp8_rowwise", **kw),
            T_counts,
            ids_all,
            inputs,
            rank,
            torch.float64,
            "loop",
        )["out"]
        for c in (plain, fp8)
    ]
    check(torch.equal(outs[0], outs[1]), f"rank {rank}: fp8_rowwise forward changed by FP8 dispatch")
    # the bytes that cross: H + 16 per row against 2H (bf16) / 8H (float64)
    from moeyard.parallel import fp8_rows

    check(fp8_rows.pack(inputs["x"][:3]).shape == (3, H + 16), "packed rows are H + 16 bytes")


def check_fp8_dispatch_errors(rank: int, W: int) -> None:
    m = moeyard.MoE(moeyard.MoEConfig(num_experts=2 * W, hidden_size=8, intermediate_size=4, top_k=1))
    for kw, err, text in (
        (dict(dispatcher="sync_free", fp8_dispatch=True), ValueError, "all_to_all and all_gather"),
        (dict(overlap_chunks=2, fp8_dispatch=True), ValueError, "overlap_chunks"),
        (dict(fp8_dispatch=1), TypeError, "fp8_dispatch: expected a bool"),
    ):
        try:
            expert_parallel(m, **kw)
        except err as ex:
            check(text in str(ex), f"{kw}: {ex}")
        else:
            check(False, f"{kw}: no {err.__name__}")


def worker(rank: int, W: int) -> None:
    check_fp8_dispatch(rank, W)
    check_fp8_dispatch_errors(rank, W)
