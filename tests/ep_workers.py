"""Worker functions for the expert-parallel tests (tests/test_parallel.py), run in spawned gloo
processes. Each worker batches many checks: spawning processes is the slow part.

Every rank draws the same global inputs from one seed, computes the single-process oracle (the
unsharded layer on all ranks' tokens) itself, runs its own slice through the expert-parallel layer
and compares: outputs, input gradients, routing-weight gradients, local expert-weight gradients,
and replicated-parameter gradients summed over ranks.

The same checks run on CUDA with NCCL from ``benchmarks/ep_check.py`` (``device``, ``backends`` and
``tol`` arguments; the oracle always runs on the CPU in float64). There ``SOFT_FAILURES`` is a list:
a numerical mismatch is recorded instead of raised, so every rank keeps issuing the same collectives.

Legend: W ranks, E experts, E_l = E / W, K top-k, H hidden, I intermediate, T_r tokens of rank r.
"""

from __future__ import annotations

import copy
import datetime
import math
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.utils.checkpoint

import moeyard
from moeyard import MoE, MoEConfig
from moeyard.parallel import expert_parallel
from moeyard.parallel.comm import resolve_group
from moeyard.parallel.common import EPOptions
from moeyard.parallel.experts import DISPATCHERS, ExpertParallel
from moeyard.parallel.sync_free import resolve_exchange

DISPATCHER_NAMES = list(DISPATCHERS)
# float64: only the summation order differs from the oracle; float32 (grouped_mm): a few units of 2^-24
TOL = {torch.float64: 1e-12, torch.float32: 2e-5}
# None: a mismatch raises AssertionError (pytest); a list: mismatch messages are appended to it
SOFT_FAILURES: list[str] | None = None


# ---------------------------------------------------------------- process plumbing


def spawn(fn, world: int, *args, timeout: float = 240.0) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned processes; a failure in any re-raises
    here; past ``timeout`` seconds all are killed and TimeoutError is raised (never a hang).

    The ranks meet through a file in a fresh temporary folder (``file://`` rendezvous), not a TCP port:
    test processes running side by side (pytest-xdist workers) can never pick the same rendezvous, as
    they could a port found free and then bound later."""
    with tempfile.TemporaryDirectory(prefix="moeyard-ep-") as folder:
        init_method = "file://" + os.path.join(folder, "rendezvous")
        ctx = mp.start_processes(
            _entry, args=(fn, world, init_method, args), nprocs=world, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=max(0.5, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"{fn.__name__} on {world} ranks did not finish in {timeout:.0f} s")


def _entry(rank: int, fn, world: int, init_method: str, args) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    try:
        fn(rank, world, *args)
        dist.barrier()
    except BaseException:  # the first failure is the one to read; its peers then fail in a collective
        traceback.print_exc()
        print(f"^^^ rank {rank} of {world} failed in {fn.__name__}", file=sys.stderr, flush=True)
        dist.destroy_process_group()
        raise
    _exit_together(rank, world)


def _exit_together(rank: int, world: int) -> None:
    """Leave without the process group's C++ teardown, which now and then aborted rank 0 (the store's
    host) at interpreter exit ("terminate called without an active exception", SIGABRT) after every
    check had passed: each rank posts to the store that it is done and exits at once; rank 0 waits for
    all of them first, so no rank is left talking to a store that is gone."""
    store = dist.distributed_c10d._get_default_store()
    store.set(f"moeyard-exit/{rank}", "1")
    if rank == 0:
        store.wait([f"moeyard-exit/{r}" for r in range(world)], datetime.timedelta(seconds=60))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------- comparisons


def rel_err(a, ref) -> float:
    """max |a - ref| / max |ref| in float64 on ref's device (inf for NaN; 0 for empty tensors)."""
    if ref.numel() == 0:
        return 0.0
    assert a.shape == ref.shape, (a.shape, ref.shape)
    scale = ref.abs().max().item()
    diff = (a.to(ref.device, torch.float64) - ref.double()).abs().max().item()
    return math.inf if math.isnan(diff) else (diff / scale if scale > 0 else diff)


def check(ok: bool, message: str) -> None:
    """Fail with ``message``: raise AssertionError, or record it when ``SOFT_FAILURES`` is a list."""
    if ok:
        return
    if SOFT_FAILURES is None:
        raise AssertionError(message)
    SOFT_FAILURES.append(message)


def check_err(what: str, got, ref, tol: float) -> None:
    e = rel_err(got, ref)
    check(e <= tol, f"{what} err {e:.3g} > {tol:g}")


def close(what: str, got: dict, ref: dict, tol: float) -> None:
    assert set(got) == set(ref), (what, sorted(got), sorted(ref))
    for k in ref:
        check_err(f"{what}: {k}", got[k], ref[k], tol)


def summed(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t)
    return t


def slices(counts: list[int], rank: int) -> slice:
    start = sum(counts[:rank])
    return slice(start, start + counts[rank])


# ---------------------------------------------------------------- functional: ExpertParallel on given ids


def routing_cases(W: int, E: int, K: int, H: int, g: torch.Generator) -> dict[str, tuple[list[int], torch.Tensor]]:
    """name -> (tokens per rank, global ids [sum T_r, K]): the code paths each exercises."""
    El = E // W

    def ids(T, pool):
        if T == 0:
            return torch.empty(0, K, dtype=torch.int64)
        return torch.tensor(pool)[torch.rand(T, len(pool), generator=g).argsort(1)[:, :K]]

    uneven = [5 + 3 * r for r in range(W)]
    empty = [0 if r == 1 else 6 for r in range(W)]
    hot = max(El, K)  # E_l < K: a token's K distinct experts span the first (last) ranks
    return {
        "uneven": (uneven, ids(sum(uneven), list(range(E)))),  # any rank to any rank
        "empty_rank": (empty, ids(sum(empty), list(range(E)))),  # a rank with no tokens
        "hot_rank0": ([4] * W, ids(4 * W, list(range(hot)))),  # all pairs to rank 0's experts
        "hot_last": ([3] * W, ids(3 * W, list(range(E - hot, E)))),  # ... to the last rank's
        "one_expert": (
            [5] * W,
            torch.cat(
                [
                    torch.full((5 * W, 1), E - 1),  # every token hits expert E-1
                    ids(5 * W, list(range(E - 1)))[:, : K - 1],
                ],
                1,
            ),
        ),
    }


def run_functional(
    ep_call, T_counts, ids_all, inputs, rank, dtype, backend, drop_invalid=False, device="cpu", x_grad: bool = True
):
    """This rank's slice through ``ep_call`` with its local weights on ``device``; returns out and
    grads (in ``dtype``, on ``device``; without ``x_grad`` the input needs no gradient and has none)."""
    W = len(T_counts)
    sl = slices(T_counts, rank)
    El = inputs["gate_up_proj"].shape[0] // W

    def leaf(t):  # a fresh leaf even when t is already on device in dtype
        return t.to(device, dtype, copy=True).requires_grad_()

    x, w = leaf(inputs["x"][sl]).requires_grad_(x_grad), leaf(inputs["w"][sl])
    up = leaf(inputs["gate_up_proj"][rank * El : (rank + 1) * El])
    down = leaf(inputs["down_proj"][rank * El : (rank + 1) * El])
    out = ep_call(x, ids_all[sl].to(device), w, up, down, backend=backend, drop_invalid=drop_invalid)
    out.backward(inputs["dy"][sl].to(device, dtype))
    grads = {"x": x.grad} if x_grad else {}
    return {"out": out.detach(), **grads, "w": w.grad, "up": up.grad, "down": down.grad}


def oracle_functional(T_counts, ids_all, inputs, rank, drop_invalid=False, weights_all=None):
    """The unsharded float64 ``loop`` experts on all tokens; this rank's share of every result."""
    W = len(T_counts)
    sl = slices(T_counts, rank)
    El = inputs["gate_up_proj"].shape[0] // W
    leaves = {k: inputs[k].clone().requires_grad_() for k in ("x", "w", "gate_up_proj", "down_proj")}
    w = leaves["w"] if weights_all is None else leaves["w"] * weights_all
    out = moeyard.experts(
        leaves["x"], ids_all, w, leaves["gate_up_proj"], leaves["down_proj"], backend="loop", drop_invalid=drop_invalid
    )
    out.backward(inputs["dy"])
    blk = slice(rank * El, (rank + 1) * El)
    return {
        "out": out.detach()[sl],
        "x": leaves["x"].grad[sl],
        "w": leaves["w"].grad[sl],
        "up": leaves["gate_up_proj"].grad[blk],
        "down": leaves["down_proj"].grad[blk],
    }


def make_functional_inputs(T_all: int, K: int, E: int, H: int, I: int, g: torch.Generator) -> dict:
    return {
        "x": torch.randn(T_all, H, generator=g, dtype=torch.float64),
        "w": torch.rand(T_all, K, generator=g, dtype=torch.float64) + 0.1,
        "dy": torch.randn(T_all, H, generator=g, dtype=torch.float64),
        "gate_up_proj": torch.randn(E, 2 * I, H, generator=g, dtype=torch.float64) / math.sqrt(H),
        "down_proj": torch.randn(E, H, I, generator=g, dtype=torch.float64) / math.sqrt(I),
    }


def check_functional(
    rank: int,
    W: int,
    *,
    E: int,
    K: int,
    dispatchers=DISPATCHER_NAMES,
    backends=(("loop", torch.float64), ("bmm_padded", torch.float64), ("grouped_mm", torch.float32)),
    H: int = 8,
    I: int = 4,
    device="cpu",
    tol: dict = TOL,
    extras: bool = True,
    exchange: str = "auto",
    overlap_chunks: int = 1,
) -> None:
    """Every routing case x dispatcher x backend against the oracle; ``sync_free`` with
    ``max_tokens`` where counts differ, ``align`` 4 once, its rows moved by ``exchange``, each call's
    tokens in ``overlap_chunks`` chunks. With ``extras`` (float64 ``loop`` on the CPU): sentinel ids
    dropped, capacity drops (not with ``overlap_chunks`` > 1: refused there)."""
    g = torch.Generator().manual_seed(1234)
    ep = resolve_group(None)
    for case, (T_counts, ids_all) in routing_cases(W, E, K, H, g).items():
        inputs = make_functional_inputs(sum(T_counts), K, E, H, I, g)
        ref = oracle_functional(T_counts, ids_all, inputs, rank)
        for name in dispatchers:
            equal = len(set(T_counts)) == 1
            opts = dict(max_tokens=None if (name != "sync_free" or equal) else max(T_counts) + 1)
            if name == "sync_free" and case == "uneven":
                opts["align"] = 4
            if name == "sync_free":
                opts["exchange"] = exchange
            call = ExpertParallel(ep, EPOptions(num_experts=E, dispatcher=name, overlap_chunks=overlap_chunks, **opts))
            for backend, dtype in backends:
                got = run_functional(call, T_counts, ids_all, inputs, rank, dtype, backend, device=device)
                what = f"{case}/{name}/{backend}/{str(dtype)[6:]}/rank{rank}"
                close(f"{what}/overlap{overlap_chunks}", got, ref, tol[dtype])
                if call.dropped is not None:
                    check(call.dropped.item() == 0, f"{what}: dropped {call.dropped.item()} pairs")
    if not extras:
        return
    # sentinel ids (>= E, < 0) with drop_invalid: dropped on every path, nothing else changes
    T_counts = [4] * W
    ids_all = routing_cases(W, E, K, H, g)["uneven"][1][: 4 * W].clone()
    ids_all[::3, 0] = E
    ids_all[1::5, -1] = -1
    inputs = make_functional_inputs(4 * W, K, E, H, I, g)
    ref = oracle_functional(T_counts, ids_all, inputs, rank, drop_invalid=True)
    for name in dispatchers:
        more = {"exchange": exchange} if name == "sync_free" else {}
        call = ExpertParallel(ep, EPOptions(num_experts=E, dispatcher=name, overlap_chunks=overlap_chunks, **more))
        got = run_functional(call, T_counts, ids_all, inputs, rank, torch.float64, "loop", drop_invalid=True)
        close(f"sentinels/{name}/rank{rank}", got, ref, TOL[torch.float64])
    if "sync_free" in dispatchers and overlap_chunks == 1:
        check_capacity(rank, W, ep, E=E, K=K, H=H, I=I, g=g, exchange=exchange)


def check_capacity(rank, W, ep, *, E, K, H, I, g, exchange: str = "auto") -> None:
    """``sync_free`` with ``capacity_factor``: the pairs past each destination's block (in token
    order) are dropped, counted on the device, and the rest equals the oracle without them."""
    El, T = E // W, 6
    T_counts = [T] * W
    ids_all = torch.rand(T * W, El, generator=g).argsort(1)[:, :K]  # all to rank 0's experts: overflow
    inputs = make_functional_inputs(T * W, K, E, H, I, g)
    cf = 0.5
    C = math.ceil(cf * T * K / W)
    keep = torch.ones(T * W, K, dtype=torch.float64)
    dropped = [0] * W
    for r in range(W):  # the naive rule: per source rank and destination, the first C pairs in token order
        used = [0] * W
        for t in range(sum(T_counts[:r]), sum(T_counts[: r + 1])):
            for k in range(K):
                d = int(ids_all[t, k]) // El
                if used[d] < C:
                    used[d] += 1
                else:
                    keep[t, k], dropped[r] = 0.0, dropped[r] + 1
    assert sum(dropped) > 0
    ref = oracle_functional(T_counts, ids_all, inputs, rank, weights_all=keep)
    ref["w"] = ref["w"] * keep[slices(T_counts, rank)]  # dropped pairs get no weight gradient
    call = ExpertParallel(ep, EPOptions(num_experts=E, dispatcher="sync_free", capacity_factor=cf, exchange=exchange))
    got = run_functional(call, T_counts, ids_all, inputs, rank, torch.float64, "loop")
    close(f"capacity/rank{rank}", got, ref, TOL[torch.float64])
    assert call.dropped.dtype == torch.int64 and call.dropped.item() == dropped[rank]


def check_no_host_reads(rank: int, W: int, overlap_chunks: int = 1, exchange: str = "auto") -> None:
    """``sync_free`` and ``all_gather`` with ``max_tokens``, forward and backward with the
    ``grouped_mm`` backend, read nothing back: every host-read method of Tensor raises meanwhile
    (the CPU-only token-count check of ``sync_free`` is stubbed out: on an accelerator it is skipped)."""
    from unittest import mock

    from moeyard.parallel import sync_free

    E, K, H, I, T = 8, 3, 8, 4, 5
    g = torch.Generator().manual_seed(5)
    inputs = make_functional_inputs(T * W, K, E, H, I, g)
    ids_all = torch.rand(T * W, E, generator=g).argsort(1)[:, :K]
    ep = resolve_group(None)
    ref = oracle_functional([T] * W, ids_all, inputs, rank)

    def read(*args, **kwargs):
        raise AssertionError("a host read on the sync-free path")

    reads = {name: read for name in ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__")}
    for name in ("sync_free",) if overlap_chunks > 1 else ("sync_free", "all_gather"):
        more = {"exchange": exchange} if name == "sync_free" else {}
        call = ExpertParallel(
            ep, EPOptions(num_experts=E, dispatcher=name, max_tokens=T + 2, overlap_chunks=overlap_chunks, **more)
        )
        with (
            mock.patch.object(sync_free, "token_counts", lambda T, ep, device: [T]),
            mock.patch.multiple(torch.Tensor, **reads),
        ):
            got = run_functional(call, [T] * W, ids_all, inputs, rank, torch.float32, "grouped_mm", drop_invalid=True)
        close(f"no host reads/{name}/overlap{overlap_chunks}/rank{rank}", got, ref, TOL[torch.float32])


# ---------------------------------------------------------------- the MoE layer

LAYER_CONFIGS = {
    "qwen3": dict(num_experts=8, top_k=2),
    "deepseek_v3": dict(
        num_experts=8,
        top_k=4,
        score_func="sigmoid",
        n_group=4,
        topk_group=2,
        score_correction_bias=True,
        routed_scaling_factor=2.5,
        num_shared_experts=1,
    ),
    "gpt_oss": dict(
        num_experts=4, top_k=2, topk_before_score=True, router_bias=True, expert_bias=True, activation="clamped_swiglu"
    ),
}


def make_layer(kw: dict, seed: int = 7, *, hidden: int = 8, intermediate: int = 4, separated: bool = False) -> MoE:
    """A float64 ``loop`` MoE layer with random weights (biases halved) from ``seed``; with
    ``separated``, the router of :func:`separate_routing`."""
    cfg = MoEConfig(hidden_size=hidden, intermediate_size=intermediate, **kw)
    torch.manual_seed(seed)
    m = MoE(cfg, backend="loop", dtype=torch.float64)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]) * (0.5 if "bias" in name else 1.0))
        if separated:
            m.router.weight.zero_()
            m.router.weight[:, : cfg.num_experts] = torch.eye(cfg.num_experts)
            if m.router.bias is not None:
                m.router.bias.zero_()
    return m


def separate_routing(x: torch.Tensor, num_experts: int, g: torch.Generator) -> torch.Tensor:
    """``x [T, H]`` with ``x[:, :E]`` a per-token permutation of ``0, 0.5, ..., (E - 1) / 2``: with the
    ``separated`` router (weight ``[I_E | 0]``, bias 0) the logits are these values exactly in any
    float dtype and neighbours differ by 0.5, so a bfloat16 layer selects the same experts as the
    float64 oracle (random logits rounded to bfloat16 flip near-ties)."""
    x = x.clone()
    x[:, :num_experts] = torch.rand(x.shape[0], num_experts, generator=g).argsort(1).to(x.dtype) * 0.5
    return x


def layer_results(m: MoE, x: torch.Tensor, dy: torch.Tensor, checkpointed: bool = False) -> dict:
    """Output, input gradient and every parameter gradient (DTensors made local) of one step; with
    ``checkpointed`` under ``torch.utils.checkpoint`` (non-reentrant: the forward, exchanges included,
    runs again in backward)."""
    x = x.clone().requires_grad_()
    calls = []
    hook = m.register_forward_pre_hook(lambda mod, args: calls.append(1))
    y = torch.utils.checkpoint.checkpoint(m, x, use_reentrant=False) if checkpointed else m(x)
    y.backward(dy)
    hook.remove()
    check(len(calls) == (2 if checkpointed else 1), f"the layer ran {len(calls)} times")
    res = {"out": y.detach(), "x": x.grad}
    res.update({n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad) for n, p in m.named_parameters()})
    return res


def layer_oracle(kw: dict, size: dict, T_counts: list[int], x_all, dy_all, dtype) -> dict:
    """The unsharded float64 ``loop`` layer on every rank's tokens, its weights and inputs first
    rounded to ``dtype`` (so a bfloat16 router picks the same experts): output, input gradient
    ``[sum T_r, H]`` and every parameter's gradient.

    Each rank's tokens run as one batch (gradients accumulated): the router scores in float32, so
    other batch shapes change its matmul blocking (~2e-8 relative at deepseek_v3)."""

    def rounded(t):
        return t.to(dtype).double()

    ref_layer = make_layer(kw, **size)
    with torch.no_grad():
        for p in ref_layer.parameters():
            p.copy_(rounded(p))
    parts = [
        layer_results(ref_layer, rounded(x_all[slices(T_counts, r)]), rounded(dy_all[slices(T_counts, r)]))
        for r in range(len(T_counts))
    ]
    oracle = {k: torch.cat([p[k] for p in parts]) for k in ("out", "x")}
    oracle.update({n: p.grad for n, p in ref_layer.named_parameters()})
    return oracle


def check_layer(
    rank: int,
    W: int,
    *,
    mesh=None,
    dispatchers=DISPATCHER_NAMES,
    device="cpu",
    backends=(("loop", torch.float64),),
    hidden: int = 8,
    intermediate: int = 4,
    tol: dict = TOL,
    T_counts: list[int] | None = None,
    separated: bool = False,
    exchange: str = "auto",
    overlap_chunks: int = 1,
    checkpointed: bool = False,
) -> None:
    """The MoE layer (router, shared experts, biases) per dispatcher and (backend, dtype), uneven
    tokens (``T_counts``), a rank with none when W > 2: outputs and every gradient (replicated ones,
    the router's among them, summed over ranks) against the float64 ``loop`` layer on the CPU.
    ``separated``: the router and inputs of :func:`separate_routing` (for low-precision dtypes);
    ``checkpointed``: each step under activation checkpointing (:func:`layer_results`)."""
    g = torch.Generator().manual_seed(99)
    size = dict(hidden=hidden, intermediate=intermediate, separated=separated)
    for cname, kw in LAYER_CONFIGS.items():
        if kw["num_experts"] % W:
            continue
        if T_counts is None:
            T_counts = [3 + 2 * r for r in range(W)]
            if W > 2:
                T_counts[2] = 0
        x_all = torch.randn(sum(T_counts), hidden, generator=g, dtype=torch.float64)
        if separated:
            x_all = separate_routing(x_all, kw["num_experts"], g)
        dy_all = torch.randn(x_all.shape, generator=g, dtype=torch.float64)
        oracles = {dtype: layer_oracle(kw, size, T_counts, x_all, dy_all, dtype) for dtype in {d for _, d in backends}}
        El = kw["num_experts"] // W
        sl = slices(T_counts, rank)
        for name in dispatchers:
            for backend, dtype in backends:
                oracle = oracles[dtype]
                m = make_layer(kw, **size).to(device, dtype)
                m.backend = backend
                max_tokens = max(T_counts) if name == "sync_free" else None
                more = {"exchange": exchange} if name == "sync_free" else {}
                expert_parallel(m, mesh, dispatcher=name, max_tokens=max_tokens, overlap_chunks=overlap_chunks, **more)
                got = layer_results(m, x_all[sl].to(device, dtype), dy_all[sl].to(device, dtype), checkpointed)
                what = f"layer {cname}/{name}/{backend}/{str(dtype)[6:]}/overlap{overlap_chunks}/rank{rank}"
                what += "/checkpointed" if checkpointed else ""
                compare_layer(what, m, got, oracle, sl, slice(rank * El, (rank + 1) * El), tol[dtype])


def compare_layer(what: str, m: MoE, got: dict, oracle: dict, sl: slice, block: slice, tol: float) -> None:
    """An expert-parallel layer's :func:`layer_results` on this rank's tokens ``sl`` against the
    :func:`layer_oracle`: outputs and input gradients of those tokens, the local expert block
    ``block`` (``[r * E_l, (r + 1) * E_l)``) of the expert gradients, and the replicated parameters'
    gradients summed over ranks (a collective: every rank calls it)."""
    local = dict(m.named_parameters(recurse=False))
    for k in list(got):
        if k in ("out", "x"):
            ref = oracle[k][sl]
        elif k in local:
            ref = oracle[k][block]  # local expert block
        else:
            got[k] = summed(got[k])  # replicated: each rank's share, summed
            ref = oracle[k]
        check_err(f"{what}: {k}", got[k], ref, tol)


# ---------------------------------------------------------------- transformers


def check_transformers(rank: int, W: int, arch: str = "qwen3_moe") -> None:
    """A tiny random transformers model with experts_implementation="moeyard": each rank runs its own
    sequences; logits and gradients against the single-process model on all of them."""
    from moeyard import verify

    with verify.quiet_transformers():
        base = verify.build_model(arch, experts_implementation="moeyard")
    ids, probe = verify.make_inputs(base, batch=W, seq=6)
    with moeyard.use_backend("loop"):
        oracle = verify.forward_backward(base, ids, probe)
        for name in DISPATCHER_NAMES:
            model = copy.deepcopy(base)
            expert_parallel(model, dispatcher=name)
            experts_mods = verify.experts_modules(model)
            assert experts_mods and all(m.moeyard_expert_parallel is not None for m in experts_mods)
            got = verify.forward_backward(model, ids[rank : rank + 1], probe[rank : rank + 1])
            params = dict(model.named_parameters())
            for k, v in got.items():
                if k == "logits":
                    ref = oracle[k][rank : rank + 1]
                elif params[k[5:]].shape != base.get_parameter(k[5:]).shape:  # an expert block
                    El = params[k[5:]].shape[0]
                    ref = oracle[k][rank * El : (rank + 1) * El]
                else:
                    v, ref = summed(v), oracle[k]
                e = rel_err(v, ref)
                assert e <= 1e-4, f"transformers {arch}/{name}/rank{rank}: {k} err {e:.3g}"


# ---------------------------------------------------------------- DTensor checkpoints


def check_checkpoint_save(rank: int, W: int, ckpt_dir: str) -> None:
    """EP with a 1-D DeviceMesh: weights are DTensors Shard(0), the layer is still exact; save with
    torch.distributed.checkpoint (global [E, ...] tensors) and the unsharded weights beside it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (W,))
    check_layer(rank, W, mesh=mesh, dispatchers=["all_to_all"])
    m = expert_parallel(make_layer(LAYER_CONFIGS["gpt_oss"]), mesh, dispatcher="sync_free")
    assert isinstance(m.gate_up_proj, DTensor) and m.gate_up_proj.placements == (Shard(0),)
    assert m.gate_up_proj.shape[0] == 4 and m.gate_up_proj.to_local().shape[0] == 4 // W
    dcp.save(m.state_dict(), checkpoint_id=ckpt_dir)
    if rank == 0:
        torch.save(make_layer(LAYER_CONFIGS["gpt_oss"]).state_dict(), os.path.join(ckpt_dir, "full.pt"))


def check_checkpoint_load(rank: int, W: int, ckpt_dir: str) -> None:
    """Load a checkpoint saved at another EP size into this one; every local block matches."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (W,))
    m = expert_parallel(make_layer(LAYER_CONFIGS["gpt_oss"], seed=123), mesh)  # other values
    sd = m.state_dict()
    dcp.load(sd, checkpoint_id=ckpt_dir)
    full = torch.load(os.path.join(ckpt_dir, "full.pt"))
    El = 4 // W
    for k, v in m.state_dict().items():
        local = v.to_local() if hasattr(v, "to_local") else v
        ref = full[k][rank * El : (rank + 1) * El] if local.shape != full[k].shape else full[k]
        assert torch.equal(local, ref), k


# ---------------------------------------------------------------- errors


def check_errors(rank: int, W: int) -> None:
    """Bad input raises the same clear error on every rank (no hang)."""
    import pytest

    with pytest.raises(ValueError, match="group"):
        expert_parallel(make_layer(dict(num_experts=6 if W == 4 else 3, top_k=2)))
    with pytest.raises(ValueError, match="module: expert layers differ"):
        expert_parallel(make_layer(dict(num_experts=4 * (rank + 1), top_k=2)))
    m = expert_parallel(make_layer(LAYER_CONFIGS["qwen3"]), dispatcher="sync_free")
    with pytest.raises(ValueError, match="max_tokens"):
        m(torch.randn(2 + rank, 8, dtype=torch.float64))  # uneven counts without max_tokens
    with pytest.raises(ValueError, match="already expert parallel"):
        expert_parallel(m)
    y = m(torch.randn(3, 8, dtype=torch.float64))  # still works after the errors
    assert y.shape == (3, 8) and torch.isfinite(y).all()


# ---------------------------------------------------------------- the symmetric-memory exchange, emulated


def check_symm_mem(rank: int, W: int) -> None:
    """``sync_free`` with ``exchange="symm_mem"``, its NVSHMEM ops replaced by the gloo emulation of
    their contract (tests/symm_emulation.py): the 2-D path (E_l <= 16: every routing case, align 4,
    sentinels, capacity drops), the 1-D path (E_l = 18 > 16, and forced at E_l = 4), the barrier
    when two ops of one direction follow each other, the MoE layer; then the clear errors of the
    real ops on gloo."""
    from unittest import mock

    from moeyard.parallel import symm_mem
    from symm_emulation import EmulatedSymmOps

    ops = EmulatedSymmOps()
    f64 = (("loop", torch.float64),)
    with mock.patch.object(symm_mem, "OPS", ops):
        check_functional(
            rank,
            W,
            E=4 * W,
            K=3,
            dispatchers=["sync_free"],
            backends=f64 + (("grouped_mm", torch.float32),),
            exchange="symm_mem",
        )
        assert {c[0] for c in ops.calls} == {"all_to_all_vdev_2d", "all_to_all_vdev_2d_offset"}, ops.calls
        ops.calls.clear()
        check_functional(
            rank, W, E=18 * W, K=4, dispatchers=["sync_free"], backends=f64, exchange="symm_mem", extras=False
        )
        assert {c[0] for c in ops.calls} == {"all_to_all_vdev"} and ops.calls[0][2] == 1, ops.calls
        with mock.patch.object(symm_mem, "MAX_2D_EXPERTS", 0):
            check_functional(rank, W, E=4 * W, K=3, dispatchers=["sync_free"], backends=f64, exchange="symm_mem")
        check_symm_barrier(rank, W, ops)
        check_layer(rank, W, dispatchers=["sync_free"], exchange="symm_mem")
    symm_mem.release_buffers()
    check_symm_errors(rank, W)


def check_symm_barrier(rank: int, W: int, ops) -> None:
    """Input without gradient: combine's backward (send -> recv) is the last op; the next dispatch
    goes the same way and must wait for a barrier first; buffers are reused, not reallocated."""
    from moeyard.parallel import symm_mem

    E, K, T = 4 * W, 2, 5
    g = torch.Generator().manual_seed(77)
    inputs = make_functional_inputs(T * W, K, E, 8, 4, g)
    ids_all = torch.rand(T * W, E, generator=g).argsort(1)[:, :K]
    ref = oracle_functional([T] * W, ids_all, inputs, rank)
    call = ExpertParallel(resolve_group(None), EPOptions(num_experts=E, dispatcher="sync_free", exchange="symm_mem"))
    sl, El = slices([T] * W, rank), E // W
    up = inputs["gate_up_proj"][rank * El : (rank + 1) * El].clone().requires_grad_()
    down = inputs["down_proj"][rank * El : (rank + 1) * El].clone().requires_grad_()
    for step in range(2):
        before, keys = ops.barriers, len(symm_mem._BUFFERS)
        up.grad = down.grad = None
        out = call(inputs["x"][sl], ids_all[sl], inputs["w"][sl], up, down, backend="loop")
        out.backward(inputs["dy"][sl])
        assert ops.barriers == before + step, (step, ops.barriers, before)  # none at first: the cache is new
        assert step == 0 or len(symm_mem._BUFFERS) == keys
        close(
            f"symm barrier/step{step}/rank{rank}",
            {"out": out.detach(), "up": up.grad, "down": down.grad},
            {k: ref[k] for k in ("out", "up", "down")},
            TOL[torch.float64],
        )


def check_symm_errors(rank: int, W: int) -> None:
    """The real ops on a gloo group: a clear ValueError before any collective, the layer untouched."""
    import pytest

    m = make_layer(LAYER_CONFIGS["qwen3"])
    with pytest.raises(ValueError, match="exchange: 'symm_mem' needs an NCCL group"):
        expert_parallel(m, dispatcher="sync_free", exchange="symm_mem")
    assert m.expert_parallel is None and m.gate_up_proj.shape[0] == 8
    with pytest.raises(ValueError, match="exchange: 'symm_mem' needs an NCCL group, got backend 'gloo'"):
        ExpertParallel(resolve_group(None), EPOptions(num_experts=8, dispatcher="sync_free", exchange="symm_mem"))


# ---------------------------------------------------------------- the peer-to-peer exchange, emulated


def check_p2p(rank: int, W: int) -> None:
    """``sync_free`` with ``exchange="p2p"``, its symmetric memory emulated by shared files
    (tests/peer_emulation.py) and its fresh rows NaN-filled (so a backend reading a row the exchange
    did not write fails): every routing case, align 4, sentinels, capacity drops, E_l = 18, two
    barriers per op and buffers allocated once, no host reads, the MoE layer;
    then the clear errors of the real ops on gloo."""
    from unittest import mock

    from moeyard.parallel import p2p
    from peer_emulation import EmulatedPeerOps

    tag = [f"{os.getpid()}"]
    dist.broadcast_object_list(tag, src=0)
    ops = EmulatedPeerOps(tag[0])

    def nan_rows(rows, like):
        return torch.full((rows + 1, like.shape[1]), float("nan"), dtype=like.dtype, device=like.device)

    f64 = (("loop", torch.float64),)
    try:
        with mock.patch.object(p2p, "OPS", ops), mock.patch.object(p2p, "new_rows", nan_rows):
            check_functional(
                rank,
                W,
                E=4 * W,
                K=3,
                dispatchers=["sync_free"],
                backends=f64 + (("bmm_padded", torch.float64), ("grouped_mm", torch.float32)),
                exchange="p2p",
            )
            check_functional(
                rank, W, E=18 * W, K=4, dispatchers=["sync_free"], backends=f64, exchange="p2p", extras=False
            )
            check_p2p_ops(rank, W, ops)
            check_p2p_buffer_sizes(rank, W, ops)
            check_unwritten_rows(rank, W, exchange="p2p")
            check_no_host_reads(rank, W, exchange="p2p")
            check_layer(rank, W, dispatchers=["sync_free"], exchange="p2p")
            ep = resolve_group(None)
            check(
                resolve_exchange(EPOptions(num_experts=4 * W, dispatcher="sync_free"), ep) == "p2p",
                "auto: p2p where it can run",
            )
            check(
                resolve_exchange(EPOptions(num_experts=4 * W, dispatcher="sync_free", overlap_chunks=2), ep)
                == "all_to_all",
                "auto with overlap_chunks 2: all_to_all",
            )
        moeyard.parallel.release_buffers()
        check(not p2p._BUFFERS and not p2p._RETIRED, "release_buffers drops every p2p buffer")
    finally:
        ops.close()
    check(
        resolve_exchange(EPOptions(num_experts=4 * W, dispatcher="sync_free"), resolve_group(None)) == "all_to_all",
        "auto on gloo: all_to_all",
    )
    m = make_layer(LAYER_CONFIGS["qwen3"])
    import pytest

    with pytest.raises(ValueError, match="exchange: 'p2p' needs an NCCL group, got backend 'gloo'"):
        expert_parallel(m, dispatcher="sync_free", exchange="p2p")
    assert m.expert_parallel is None and m.gate_up_proj.shape[0] == 8


def check_p2p_ops(rank: int, W: int, ops) -> None:
    """Forward + backward is four ops, two barriers each, on buffers allocated once; steps without
    the input's gradient (three ops) between full ones are still exact."""
    E, K, T = 4 * W, 2, 5
    g = torch.Generator().manual_seed(78)
    inputs = make_functional_inputs(T * W, K, E, 8, 4, g)
    ids_all = torch.rand(T * W, E, generator=g).argsort(1)[:, :K]
    ref = oracle_functional([T] * W, ids_all, inputs, rank)
    call = ExpertParallel(resolve_group(None), EPOptions(num_experts=E, dispatcher="sync_free", exchange="p2p"))
    sl, El = slices([T] * W, rank), E // W
    up = inputs["gate_up_proj"][rank * El : (rank + 1) * El].clone().requires_grad_()
    down = inputs["down_proj"][rank * El : (rank + 1) * El].clone().requires_grad_()
    for step, x_grad in enumerate((True, False, False, True)):
        before, allocated = ops.barriers, ops.allocations
        up.grad = down.grad = None
        x = inputs["x"][sl].clone().requires_grad_(x_grad)
        out = call(x, ids_all[sl], inputs["w"][sl], up, down, backend="loop")
        out.backward(inputs["dy"][sl])
        assert ops.barriers == before + 2 * (4 if x_grad else 3), (step, ops.barriers, before)
        assert step == 0 or ops.allocations == allocated
        got = {"out": out.detach(), "up": up.grad, "down": down.grad}
        want = {k: ref[k] for k in ("out", "up", "down")}
        if x_grad:
            got["x"], want["x"] = x.grad, ref["x"]
        close(f"p2p ops/step{step}/rank{rank}", got, want, TOL[torch.float64])


def check_p2p_buffer_sizes(rank: int, W: int, ops) -> None:
    """One set of buffers serves every token count up to the largest seen (its zero row at its own
    capacity, so pairs not sent still read zeros after a larger call wrote that row); a larger count
    allocates once more (four symmetric tensors), a smaller one never."""
    from moeyard.parallel import p2p

    E, K = 4 * W, 2
    p2p.release_buffers()
    call = ExpertParallel(resolve_group(None), EPOptions(num_experts=E, dispatcher="sync_free", exchange="p2p"))
    g = torch.Generator().manual_seed(79)
    for step, (T, grows) in enumerate(((6, True), (3, False), (5, False), (9, True), (2, False))):
        ids_all = torch.rand(T * W, E, generator=g).argsort(1)[:, :K]
        ids_all[::2, -1] = E  # not sent: read from the zero row
        inputs = make_functional_inputs(T * W, K, E, 8, 4, g)
        ref = oracle_functional([T] * W, ids_all, inputs, rank, drop_invalid=True)
        before = ops.allocations
        got = run_functional(call, [T] * W, ids_all, inputs, rank, torch.float64, "loop", drop_invalid=True)
        check(ops.allocations == before + (4 if grows else 0), f"p2p buffers/step{step}: {ops.allocations - before}")
        close(f"p2p buffers/step{step}/T{T}/rank{rank}", got, ref, TOL[torch.float64])


def check_unwritten_rows(rank: int, W: int, exchange: str = "all_to_all") -> None:
    """``sync_free`` on the ``triton`` backend (the interpreter on CPU) with its fresh tensors NaN-filled:
    its experts leave the empty rows' outputs and input gradients unwritten (``drop_invalid="unwritten"``)
    and the combine never reads them, so outputs and gradients still equal the oracle."""
    from unittest import mock

    import moeyard.parallel.experts as ep_experts
    from moeyard.experts.triton import ops

    real, real_like, real_experts = ops.empty, ops.empty_like, ep_experts.experts
    unwritten = []

    def watched(rows, ids, *args, **kw):  # did the local experts leave any empty row unwritten?
        out = real_experts(rows, ids, *args, **kw)
        empty = (ids[:, 0] < 0) | (ids[:, 0] >= args[1].shape[0])
        unwritten.append(bool(out.detach()[empty].isnan().all(1).any()))
        return out

    with (
        mock.patch.object(ops, "empty", lambda shape, like, dtype=None: real(shape, like, dtype).fill_(float("nan"))),
        mock.patch.object(ops, "empty_like", lambda like: real_like(like).fill_(float("nan"))),
        mock.patch.object(ep_experts, "experts", watched),
    ):
        check_functional(
            rank,
            W,
            E=4 * W,
            K=2,
            dispatchers=["sync_free"],
            backends=(("triton", torch.float32),),
            extras=False,
            exchange=exchange,
        )
    check(any(unwritten), f"unwritten rows/{exchange}/rank{rank}: every empty row was written")


# ---------------------------------------------------------------- per world size


def worker_2(rank: int, W: int, ckpt_dir: str) -> None:
    check_functional(rank, W, E=8, K=3)
    check_functional(rank, W, E=4, K=3, extras=False)  # E_l = 2 < K: more of a token's ids than local experts
    check_unwritten_rows(rank, W)
    check_no_host_reads(rank, W)
    check_layer(rank, W)
    check_transformers(rank, W)
    check_checkpoint_save(rank, W, ckpt_dir)
    check_errors(rank, W)


def worker_4(rank: int, W: int, ckpt_dir: str) -> None:
    check_functional(rank, W, E=8, K=2, backends=(("loop", torch.float64),))
    check_layer(rank, W, dispatchers=["all_to_all", "sync_free"])
    check_checkpoint_load(rank, W, ckpt_dir)
    check_errors(rank, W)


def worker_symm(rank: int, W: int) -> None:
    check_symm_mem(rank, W)


def worker_p2p(rank: int, W: int) -> None:
    check_p2p(rank, W)


def worker_8(rank: int, W: int) -> None:
    check_functional(rank, W, E=16, K=2, dispatchers=["sync_free"], backends=(("loop", torch.float64),))


# ---------------------------------------------------------------- FSDP2 on a 2-D (dp, ep) mesh


class TinyLM(torch.nn.Module):
    """Embedding -> dense residual block (an attention stand-in) -> residual MoE -> head (float64)."""

    def __init__(self, kw: dict, vocab: int = 11, hidden: int = 8, seed: int = 3):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(vocab, hidden, dtype=torch.float64)
        self.dense = torch.nn.Linear(hidden, hidden, dtype=torch.float64)
        self.moe = make_layer(kw, seed=seed + 1, hidden=hidden)
        self.head = torch.nn.Linear(hidden, vocab, dtype=torch.float64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + torch.tanh(self.dense(h))
        return self.head(h + self.moe(h))


def lm_loss(model: TinyLM, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over this batch's tokens plus 0.01 * the MoE layer's aux loss."""
    logits = model(ids)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return loss if model.moe.aux_loss is None else loss + 0.01 * model.moe.aux_loss


def check_fsdp2(
    rank: int, W: int, dispatcher: str = "all_to_all", overlap_chunks: int = 1, *, dp: int = 2, device="cpu"
) -> None:
    """dp x ep = W / dp with :func:`moeyard.parallel.fsdp_expert_parallel`: two SGD steps. Each
    rank's loss, every parameter's gradient (gathered to full tensors) and the parameters after each
    step against one process running the unsharded model on every rank's batch on the CPU (mean of
    the ranks' losses, as FSDP reduces). Float64 ``loop`` experts: only the summation order differs.
    On CUDA the tolerance is float32's: the router computes its logits and weights in float32 by
    design, and CUDA's float32 GEMM sums in another order than the CPU's (measured on two H200s:
    loss 2.5e-10, gradients 2.5e-8 relative)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from moeyard.parallel import fsdp_expert_parallel

    kw = dict(LAYER_CONFIGS["deepseek_v3"])  # router with a bias buffer, shared expert, sigmoid scores
    B, S, vocab = 2, 3, 11
    g = torch.Generator().manual_seed(21)
    ids = torch.randint(0, vocab, (2, W * B, S), generator=g)  # two steps of the global batch
    targets = torch.randint(0, vocab, (2, W * B, S), generator=g)
    ref = TinyLM(kw)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    model = TinyLM(kw).to(device)
    mesh = init_device_mesh(torch.device(device).type, (dp, W // dp), mesh_dim_names=("dp", "ep"))
    fsdp_expert_parallel(
        model,
        mesh,
        dispatcher=dispatcher,
        overlap_chunks=overlap_chunks,
        max_tokens=B * S if dispatcher == "sync_free" else None,
    )
    assert isinstance(model.moe.gate_up_proj, DTensor) and model.moe.gate_up_proj.shape[0] == kw["num_experts"]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    mine = slice(rank * B, (rank + 1) * B)
    what = f"fsdp2/dp{dp}/{dispatcher}/overlap{overlap_chunks}"
    tol = 1e-12 if torch.device(device).type == "cpu" else 1e-6
    ref_params = dict(ref.named_parameters())
    for step in range(2):
        ref_opt.zero_grad()
        ref_losses = [
            lm_loss(ref, ids[step, r * B : (r + 1) * B], targets[step, r * B : (r + 1) * B]) for r in range(W)
        ]
        (sum(ref_losses) / W).backward()
        opt.zero_grad()
        loss = lm_loss(model, ids[step, mine].to(device), targets[step, mine].to(device))
        loss.backward()
        check_err(f"{what}/step{step}/rank{rank}: loss", loss.detach(), ref_losses[rank].detach(), tol)
        for name, p in model.named_parameters():
            check_err(f"{what}/step{step}/rank{rank}: grad {name}", p.grad.full_tensor(), ref_params[name].grad, tol)
        ref_opt.step()
        opt.step()
        for name, p in model.named_parameters():
            check_err(
                f"{what}/step{step}/rank{rank}: {name} after the step",
                p.detach().full_tensor(),
                ref_params[name].detach(),
                tol,
            )


def worker_fsdp(rank: int, W: int) -> None:
    check_fsdp2(rank, W, "all_to_all")
    check_fsdp2(rank, W, "sync_free", overlap_chunks=2)


def worker_fsdp_dp1(rank: int, W: int) -> None:
    check_fsdp2(rank, W, "sync_free", overlap_chunks=2, dp=1)


# ---------------------------------------------------------------- overlap_chunks


def worker_checkpoint(rank: int, W: int) -> None:
    """Activation checkpointing over the expert-parallel layer: every dispatcher, its exchanges issued again
    by the recomputed forward inside backward (all ranks in the same order), with and without overlap."""
    check_layer(rank, W, checkpointed=True)
    check_layer(rank, W, dispatchers=["all_to_all", "sync_free"], overlap_chunks=2, checkpointed=True)


def worker_overlap(rank: int, W: int) -> None:
    """``overlap_chunks`` 2 and 3 (more chunks than some ranks have tokens) on every routing case,
    the layer, and with no host reads (``sync_free``)."""
    overlapping = ["all_to_all", "sync_free"]
    for n in (2, 3):
        check_functional(
            rank,
            W,
            E=8,
            K=3 if W == 2 else 2,
            dispatchers=overlapping,
            backends=(("loop", torch.float64),),
            overlap_chunks=n,
        )
    check_layer(rank, W, dispatchers=overlapping, overlap_chunks=2)
    check_frozen_input(rank, W, overlapping)
    if W == 2:
        check_no_host_reads(rank, W, overlap_chunks=2)
        check_overlap_schedule(rank, W)


def check_frozen_input(rank: int, W: int, dispatchers) -> None:
    """Chunks whose input needs no gradient (a frozen embedding before the layer): the received rows
    are not differentiable and their backward sends nothing back; the weights' and routing weights'
    gradients still equal the oracle's, and nothing hangs."""
    g = torch.Generator().manual_seed(99)
    E, K, H, I = 8, 2, 8, 4
    T_counts, ids_all = routing_cases(W, E, K, H, g)["uneven"]
    inputs = make_functional_inputs(sum(T_counts), K, E, H, I, g)
    ref = oracle_functional(T_counts, ids_all, inputs, rank)
    del ref["x"]
    for name in dispatchers:
        more = dict(max_tokens=max(T_counts) + 1) if name == "sync_free" else {}
        call = ExpertParallel(resolve_group(None), EPOptions(num_experts=E, dispatcher=name, overlap_chunks=2, **more))
        got = run_functional(call, T_counts, ids_all, inputs, rank, torch.float64, "loop", x_grad=False)
        close(f"frozen input/{name}/overlap2/rank{rank}", got, ref, TOL[torch.float64])


def check_overlap_schedule(rank: int, W: int) -> None:
    """The order of exchanges and expert compute with ``overlap_chunks=2``, forward and backward
    (S: an exchange issued, W: waited, E: experts; backward E< / E>: the experts' backward begins /
    ends): chunk 1's dispatch and chunk 0's combine are in flight during chunk 1's experts, chunk 0's
    reverse combine during chunk 1's expert backward, chunk 1's reverse dispatch during chunk 0's."""
    from unittest import mock

    from moeyard.parallel import experts as ep_experts, overlap

    events = []
    real_start, real_wait, real_experts = overlap.start, overlap.Pending.wait, ep_experts.experts

    def start(*args, **kwargs):
        events.append("S")
        return real_start(*args, **kwargs)

    def wait(self):
        events.append("W")
        return real_wait(self)

    def experts(rows, *args, **kwargs):
        events.append("E")
        y = real_experts(rows, *args, **kwargs)
        y.register_hook(lambda g: events.append("E<"))
        rows.register_hook(lambda g: events.append("E>"))
        return y

    E, K, T = 8, 2, 5
    g = torch.Generator().manual_seed(8)
    inputs = make_functional_inputs(T * W, K, E, 8, 4, g)
    ids_all = torch.rand(T * W, E, generator=g).argsort(1)[:, :K]
    ep = resolve_group(None)
    for name in ("all_to_all", "sync_free"):
        call = ExpertParallel(ep, EPOptions(num_experts=E, dispatcher=name, overlap_chunks=2))
        events.clear()
        with (
            mock.patch.object(overlap, "start", start),
            mock.patch.object(overlap.Pending, "wait", wait),
            mock.patch.object(ep_experts, "experts", experts),
        ):
            run_functional(call, [T] * W, ids_all, inputs, rank, torch.float64, "loop")
        assert events == [
            "S",
            "S",
            "W",
            "E",
            "S",
            "W",
            "E",
            "S",
            "W",
            "W",  # forward
            "S",
            "S",
            "W",
            "E<",
            "E>",
            "S",
            "W",
            "E<",
            "E>",
            "S",
            "W",
            "W",
        ], (name, events)
