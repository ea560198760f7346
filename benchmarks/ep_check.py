"""Expert parallelism on CUDA with NCCL: correctness, no host syncs, CUDA graphs.

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node 2 benchmarks/ep_check.py [--json PATH]

Each rank uses ``cuda:LOCAL_RANK`` (set before the NCCL group is created). The comparisons are the
CPU tests' own (``tests/ep_workers.py``): every rank draws the same global inputs from one seed and
runs the unsharded float64 ``loop`` layer on all ranks' tokens on the CPU (the single-process
oracle; computed on every rank instead of gathered to one, the same numbers without the traffic),
then its own tokens through the expert-parallel layer on its GPU. Checks, for every dispatcher and
the ``triton`` and ``grouped_mm`` backends in bfloat16 and float32:

- ``functional/<dispatcher>``: :class:`moeyard.parallel.ExpertParallel` on given ids: uneven tokens,
  a rank with 0 tokens, every pair to rank 0's / the last rank's experts, one expert hit by every
  token; outputs, input and routing-weight gradients, local expert-weight gradients;
- ``layer/<dispatcher>``: the ``MoE`` layer (router, shared experts, biases; three configs), uneven
  tokens; router and shared-expert gradients summed over ranks;
- ``mesh``: the layer over a 1-D CUDA ``DeviceMesh`` (DTensor expert weights);
- ``sync_debug/<what>``: ``sync_free`` (and ``all_gather`` with ``max_tokens``) forward + backward
  under ``torch.cuda.set_sync_debug_mode("error")``: any device-to-host sync raises;
- ``cuda_graph/<backend>``: the ``sync_free`` layer's forward + backward captured once in a CUDA
  graph, replayed on fresh inputs (static shapes), against eager runs of the same inputs;
- ``functional|layer/<dispatcher>/overlap<N>``: the same with ``overlap_chunks`` 2 and 3 (async
  exchanges on NCCL's stream); ``sync_debug/sync_free/<backend>/overlap2`` adds no host sync;
- ``fsdp2/dp1_epW``: :func:`moeyard.parallel.fsdp_expert_parallel` on a CUDA ``(dp, ep) = (1, W)`` mesh.

Numerical mismatches are recorded (every rank keeps issuing the same collectives); an exception in
one check fails that check. Rank 0 prints a PASS/FAIL table last; the exit code is 1 on any failure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import ep_workers as w  # noqa: E402
from moeyard.parallel import expert_parallel, release_buffers  # noqa: E402
from moeyard.parallel.comm import EPGroup  # noqa: E402
from moeyard.parallel.common import EPOptions  # noqa: E402
from moeyard.parallel.experts import DISPATCHERS, ExpertParallel  # noqa: E402

BF16, FP32 = torch.bfloat16, torch.float32
BACKENDS = (("triton", BF16), ("triton", FP32), ("grouped_mm", BF16), ("grouped_mm", FP32))
# relative to max |oracle|: bfloat16 keeps 8 bits (a few roundings per path); float32 paths are
# ieee (triton) or cuBLAS without TF32 (grouped_mm). A wrong row or expert gives errors near 1.
TOL = {BF16: 5e-2, FP32: 1e-3}
H, I = 64, 32  # multiples of 16: every backend's tiles
E, K = 8, 3  # functional cases: E_l = 4 at W = 2
LAYER_TOKENS = (29, 64)  # per rank (ranks past the second: 29 each), uneven


def _group(rank: int, W: int) -> EPGroup:
    return EPGroup(group=dist.group.WORLD, world_size=W, rank=rank, backend=str(dist.get_backend()))


# ---------------------------------------------------------------- checks (rank, W, device)


def functional(dispatcher: str, overlap_chunks: int = 1):
    def run(rank, W, device):
        w.check_functional(
            rank,
            W,
            E=E,
            K=K,
            dispatchers=[dispatcher],
            backends=BACKENDS,
            H=H,
            I=I,
            device=device,
            tol=TOL,
            extras=False,
            overlap_chunks=overlap_chunks,
        )

    return run


def layer(dispatcher: str, overlap_chunks: int = 1):
    def run(rank, W, device):
        w.check_layer(
            rank,
            W,
            dispatchers=[dispatcher],
            device=device,
            backends=BACKENDS,
            hidden=H,
            intermediate=I,
            tol=TOL,
            T_counts=_layer_counts(W),
            separated=True,
            overlap_chunks=overlap_chunks,
        )

    return run


def mesh(rank, W, device):
    from torch.distributed.device_mesh import init_device_mesh

    m = init_device_mesh("cuda", (W,))
    w.check_layer(
        rank,
        W,
        mesh=m,
        dispatchers=["all_to_all", "sync_free"],
        device=device,
        backends=(("grouped_mm", BF16),),
        hidden=H,
        intermediate=I,
        tol=TOL,
        T_counts=_layer_counts(W),
        separated=True,
    )


def fsdp2(rank, W, device):
    """fsdp_expert_parallel on a CUDA (dp, ep) mesh with dp = 1 x ep = W (float64 loop layer and the
    tests' tiny LM; the 4-process CPU test covers dp = 2): losses, full gradients, two SGD steps."""
    w.check_fsdp2(rank, W, "sync_free", overlap_chunks=2, dp=1, device=device)


def _layer_counts(W: int) -> list[int]:
    return [LAYER_TOKENS[r % 2] for r in range(W)]


def sync_debug_experts(
    dispatcher: str, backend: str, overlap_chunks: int = 1, *, num_experts: int = E, exchange: str = "auto"
):
    """ExpertParallel alone (given ids, static ``max_tokens``) under sync debug mode; ``sync_free``
    rows moved by ``exchange``."""

    def run(rank, W, device):
        T, E = 48, num_experts
        g = torch.Generator().manual_seed(5)
        inputs = w.make_functional_inputs(T * W, K, E, H, I, g)
        ids_all = torch.rand(T * W, E, generator=g).argsort(1)[:, :K]
        ref = w.oracle_functional([T] * W, ids_all, inputs, rank)
        # on the device before the strict run: a host-to-device copy is a sync too
        on_device = {k: v.to(device, BF16) for k, v in inputs.items()}
        ids_device = ids_all.to(device)
        more = {"exchange": exchange} if dispatcher == "sync_free" else {}
        call = ExpertParallel(
            _group(rank, W),
            EPOptions(num_experts=E, dispatcher=dispatcher, max_tokens=T + 8, overlap_chunks=overlap_chunks, **more),
        )
        w.run_functional(call, [T] * W, ids_device, on_device, rank, BF16, backend, drop_invalid=True, device=device)
        torch.cuda.synchronize(device)  # compiled kernels and warm allocator before the strict run
        with sync_debug():
            got = w.run_functional(
                call, [T] * W, ids_device, on_device, rank, BF16, backend, drop_invalid=True, device=device
            )
        w.close(f"sync_debug/{dispatcher}/{backend}/overlap{overlap_chunks}/rank{rank}", got, ref, TOL[BF16])

    return run


def sync_debug_layer(backend: str):
    """The ``sync_free`` MoE layer (qwen3 config) forward + backward under sync debug mode."""

    def run(rank, W, device):
        T = 40
        kw, size = w.LAYER_CONFIGS["qwen3"], dict(hidden=H, intermediate=I, separated=True)
        x_all, dy_all = _layer_inputs(T * W, seed=11)
        oracle = w.layer_oracle(kw, size, [T] * W, x_all, dy_all, BF16)
        m = _ep_layer(kw, size, backend, BF16, device, max_tokens=T)
        x, dy = _mine(x_all, rank, T, device), _mine(dy_all, rank, T, device)
        w.layer_results(m, x, dy)  # warm-up (compiles), then grads reset
        m.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        with sync_debug():
            got = w.layer_results(m, x, dy)
        El = E // W
        w.compare_layer(
            f"sync_debug/layer/{backend}/rank{rank}",
            m,
            got,
            oracle,
            slice(rank * T, (rank + 1) * T),
            slice(rank * El, (rank + 1) * El),
            TOL[BF16],
        )

    return run


class sync_debug:
    """``with sync_debug():`` any CUDA device-to-host synchronisation raises RuntimeError."""

    def __enter__(self):
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")


def cuda_graph(backend: str, dtype=BF16, exchange: str = "auto"):
    """Capture forward + backward of the ``sync_free`` layer (rows moved by ``exchange``) once; replay
    on two fresh inputs and compare output, input gradient and every local gradient with an eager
    twin on the same inputs."""

    def run(rank, W, device):
        T, kw, size = 64, w.LAYER_CONFIGS["qwen3"], dict(hidden=H, intermediate=I)
        graphed = _ep_layer(kw, size, backend, dtype, device, max_tokens=T, exchange=exchange)
        eager = _ep_layer(kw, size, backend, dtype, device, max_tokens=T, exchange=exchange)
        static_x = torch.randn(T, H, device=device, dtype=dtype, requires_grad=True)
        static_dy = torch.randn(T, H, device=device, dtype=dtype)

        def step():
            graphed.zero_grad(set_to_none=True)
            static_x.grad = None
            out = graphed(static_x)
            out.backward(static_dy)
            return out

        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        graphed.zero_grad(set_to_none=True)
        static_x.grad = None
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            static_out = graphed(static_x)
            static_out.backward(static_dy)
        for i in range(2):
            x_all, dy_all = _layer_inputs(T * W, seed=100 + i)
            x, dy = _mine(x_all, rank, T, device, dtype), _mine(dy_all, rank, T, device, dtype)
            with torch.no_grad():
                static_x.copy_(x)
                static_dy.copy_(dy)
            graph.replay()
            got = {"out": static_out.detach().clone(), "x": static_x.grad.clone()}
            got.update({n: p.grad.clone() for n, p in graphed.named_parameters()})
            eager.zero_grad(set_to_none=True)
            ref = w.layer_results(eager, x, dy)
            w.close(f"cuda_graph/{backend}/replay{i}/rank{rank}", got, ref, TOL[dtype])

    return run


def _ep_layer(kw, size, backend, dtype, device, *, max_tokens, exchange: str = "auto"):
    m = w.make_layer(kw, **size).to(device, dtype)
    m.backend = backend
    return expert_parallel(m, dispatcher="sync_free", max_tokens=max_tokens, exchange=exchange)


def _layer_inputs(n: int, seed: int):
    """``x [n, H]`` with separated routing (``ep_workers.separate_routing``, E = 8) and ``dy [n, H]``."""
    g = torch.Generator().manual_seed(seed)
    x = w.separate_routing(torch.randn(n, H, generator=g, dtype=torch.float64), 8, g)
    return x, torch.randn(n, H, generator=g, dtype=torch.float64)


def _mine(t, rank: int, T: int, device, dtype=BF16):
    return t[rank * T : (rank + 1) * T].to(device, dtype)


def checks() -> list[tuple[str, object]]:
    out = [(f"functional/{d}", functional(d)) for d in DISPATCHERS]
    out += [(f"layer/{d}", layer(d)) for d in DISPATCHERS]
    out.append(("mesh", mesh))
    out += [
        (f"sync_debug/{d}/{b}", sync_debug_experts(d, b))
        for d in ("sync_free", "all_gather")
        for b in ("triton", "grouped_mm")
    ]
    out += [(f"sync_debug/layer/{b}", sync_debug_layer(b)) for b in ("triton", "grouped_mm")]
    out += [(f"cuda_graph/{b}", cuda_graph(b)) for b in ("triton", "grouped_mm")]
    out += [
        (f"{kind}/{d}/overlap{n}", fn(d, n))
        for kind, fn in (("functional", functional), ("layer", layer))
        for d in ("all_to_all", "sync_free")
        for n in (2, 3)
    ]
    out += [
        (f"sync_debug/sync_free/{b}/overlap2", sync_debug_experts("sync_free", b, 2)) for b in ("triton", "grouped_mm")
    ]
    out.append(("fsdp2/dp1_epW", fsdp2))
    return out


# ---------------------------------------------------------------- driver


def run_all(rank: int, W: int, device: torch.device, only: str | None, todo=None) -> list[dict]:
    """Every check of ``todo`` (default :func:`checks`) on this rank; each result agreed over ranks
    (one all-reduce per check)."""
    results = []
    w.SOFT_FAILURES = []
    for name, fn in checks() if todo is None else todo:
        if only and only not in name:
            continue
        before, t0 = len(w.SOFT_FAILURES), time.perf_counter()
        error = None
        try:
            fn(rank, W, device)
            torch.cuda.synchronize(device)
        except Exception as ex:  # noqa: BLE001 - reported in the table
            traceback.print_exc()
            error = f"{type(ex).__name__}: {str(ex).splitlines()[0][:300] if str(ex) else ''}"
        torch.cuda.set_sync_debug_mode("default")
        fails = w.SOFT_FAILURES[before:] + ([error] if error else [])
        flag = torch.tensor([len(fails)], device=device)
        dist.all_reduce(flag)
        results.append(
            {"check": name, "rank": rank, "ok": int(flag.item()) == 0, "failures": fails, "s": time.perf_counter() - t0}
        )
        if rank == 0:
            print(
                f"[ep_check] {name}: {'PASS' if results[-1]['ok'] else 'FAIL'} ({results[-1]['s']:.1f} s)", flush=True
            )
    return results


def report(everyone: list[list[dict]], title: str = "ep_check: expert parallelism on CUDA/NCCL") -> bool:
    """Print the table (rank 0); True when every check passed on every rank."""
    print(f"\n==== {title} ====")
    ok_all = True
    for i, r0 in enumerate(everyone[0]):
        per = [rank_rows[i] for rank_rows in everyone]
        ok = all(p["ok"] for p in per)
        ok_all &= ok
        fails = [f for p in per for f in p["failures"]]
        print(
            f"{'PASS' if ok else 'FAIL'}  {r0['check']:<32} {max(p['s'] for p in per):6.1f} s"
            + (f"  {len(fails)} failure(s); first: {fails[0][:240]}" if fails else "")
        )
    print(f"==== {'ALL PASS' if ok_all else 'FAILURES'} ====")
    return ok_all


def start_nccl(script: str, timeout_s: int) -> torch.device | None:
    """This torchrun process's CUDA device with the NCCL default group initialised, or None (after
    saying how to run ``script``) outside torchrun or without CUDA."""
    if not torch.cuda.is_available() or "LOCAL_RANK" not in os.environ:
        print(f"{script}: run under torchrun on CUDA: torchrun --nproc-per-node 2 benchmarks/{script}.py")
        return None
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=timeout_s), device_id=device)
    return device


def exit_code(ok: bool, device: torch.device) -> int:
    """Rank 0's verdict on every rank: 0 when ``ok``, else 1 (a collective)."""
    flag = torch.tensor([0 if ok else 1], device=device)
    dist.broadcast(flag, 0)
    return int(flag.item())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH", help="write every rank's results (all failure messages) here")
    p.add_argument("--only", metavar="TEXT", help="run the checks whose name contains TEXT")
    args = p.parse_args()
    device = start_nccl("ep_check", 120)
    if device is None:
        return 2
    try:
        rank, W = dist.get_rank(), dist.get_world_size()
        results = run_all(rank, W, device, args.only)
        everyone = [None] * W
        dist.all_gather_object(everyone, results)
        ok = True
        if rank == 0:
            ok = report(everyone)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"world_size": W, "torch": torch.__version__, "results": everyone}, f, indent=1)
        release_buffers()
        return exit_code(ok, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
