"""The symmetric-memory exchanges of the ``sync_free`` dispatcher on CUDA: raw ops, the layer, timings.

    torchrun --standalone --nproc-per-node 2 benchmarks/ep_symm_check.py [--exchange symm_mem|p2p]
        [--json PATH] [--only TEXT] [--no-timing]

``--exchange symm_mem`` (default; NVSHMEM) runs (a) to (c) below. ``--exchange p2p`` (torch's CUDA
symmetric-memory backend; one backend per process, so a separate run) runs ``copy_rows/*`` (the
row-copy kernel on CUDA over every rank's symmetric buffer at once, both directions), (b) with
``exchange="p2p"`` plus CUDA-graph capture and replay of the layer, (c)'s kernel profiles of
``sync_free`` + ``p2p`` and of ``all_to_all``, and its timing table with ``sync_free`` + ``p2p`` in place
of the NVSHMEM rows (no raw ops).

Each rank uses ``cuda:LOCAL_RANK``; NVLink multicast stays off (the caller's NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 are kept); ``NVSHMEM_SYMMETRIC_SIZE``
defaults to 8G here (the timing's buffers take 3 GiB). Checks (PASS/FAIL table, exit code 1 on any
failure or mismatch):

(a) ``ops/*``: ``torch.ops.symm_mem.all_to_all_vdev_2d`` (E_l = 4 and 16, ``major_align`` 1 and 8,
    a rank sending nothing), ``all_to_all_vdev_2d_offset`` (the 2-D result sent back) and
    ``all_to_all_vdev`` on small tensors and one bf16 H = 2048 case, through moeyard's own wrappers
    (``symm_mem.OPS``), against the CPU reference of their contract (``tests/symm_emulation.py``,
    the one the CPU tests' emulation runs): received rows, splits, offsets, and rows past the
    written ones left alone (the exchange relies on it for its zero row).
(b) ``functional/*``, ``layer``, ``sync_debug/*``: ``sync_free`` with ``exchange="symm_mem"``
    against the single-process float64 oracle (``tests/ep_workers.py``: uneven tokens, a rank with
    0 tokens, all pairs to one rank, one expert hit by every token; outputs, input, routing-weight
    and expert-weight gradients) at E_l = 4 (2-D path), E_l = 4 forced onto the 1-D path, and
    E_l = 64 (1-D path), triton and grouped_mm in bf16 and fp32; forward + backward under
    ``torch.cuda.set_sync_debug_mode("error")`` at E_l = 4 and 64.
(c) the bare exchanges of 262144 x 2048 bf16 per rank with equal splits (``all_to_all_vdev``, NCCL's
    ``all_to_all_single``, a local copy: ms and GB/s); the device kernels of three dispatch + combine
    calls (``torch.profiler``, rank 0) of ``sync_free`` + ``symm_mem`` and of ``all_to_all``; then timing at qwen3-30b-a3b per rank (T = 32768, E = 128, K = 8, H = 2048, bf16; balanced and Zipf
    routing): dispatch and combine ms (slowest rank) of ``all_to_all``, ``sync_free`` + equal
    splits and ``sync_free`` + ``symm_mem`` (``moeyard.bench.ep.measure``), one table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from unittest import mock

os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", "8G")  # before NVSHMEM starts (first symmetric allocation)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)
import ep_check  # noqa: E402
import ep_workers as w  # noqa: E402
import symm_emulation as ref  # noqa: E402
from moeyard.parallel import release_buffers, symm_mem  # noqa: E402

FP32, BF16 = torch.float32, torch.bfloat16
K = 3


# ---------------------------------------------------------------- (a) the raw ops


def _splits(W: int, n: int, high: int, seed: int) -> list[torch.Tensor]:
    """Every rank's random in-splits ``[n]`` (all ranks draw all, from one seed); rank 1 sends nothing."""
    g = torch.Generator().manual_seed(seed)
    out = [torch.randint(0, high, (n,), generator=g) for _ in range(W)]
    if W > 1:
        out[1].zero_()
    return out


def _inputs(W: int, rows: int, hidden: int, dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, hidden, generator=g).to(dtype) for _ in range(W)]


def _symm(shape, dtype, device, name, fill=None):
    t = symm_mem.OPS.empty(shape, dtype, device, name)
    if fill is not None:
        t.fill_(fill)
    return t


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _compare(what: str, out, meta_out, expected, rank: int) -> None:
    """``out`` / ``meta_out`` (device) against a reference ``(meta, writes, used)``."""
    meta, writes, used = expected
    w.check(torch.equal(meta_out.cpu(), meta), f"{what}: splits/offsets {meta_out.cpu().tolist()} != {meta.tolist()}")
    got = out.float().cpu()
    for at, rows in writes:
        w.check(torch.equal(got[at : at + rows.shape[0]], rows.float()), f"{what}/rank{rank}: rows at {at} differ")
    w.check(bool(torch.isnan(got[used:]).all()), f"{what}/rank{rank}: rows past the {used} written ones changed")


def ops_2d(ne: int, align: int, hidden: int = 16, dtype=FP32, high: int = 6):
    """``all_to_all_vdev_2d`` then ``all_to_all_vdev_2d_offset`` of its result, against the reference."""

    def run(rank, W, device):
        name = symm_mem.OPS.prepare(dist.group.WORLD, device)
        splits = _splits(W, W * ne, high, seed=10 + ne + align)
        rows_in = W * ne * high
        inputs = _inputs(W, rows_in, hidden, dtype, seed=20 + ne)
        rows_out = W * rows_in + ne * align
        inp = _symm((rows_in, hidden), dtype, device, name)
        inp.copy_(inputs[rank])
        out = _symm((rows_out + 1, hidden), dtype, device, name, float("nan"))
        s_in = _symm((W * ne,), torch.int64, device, name)
        s_in.copy_(splits[rank])
        meta = _symm((2, W * ne), torch.int64, device, name, -1)
        symm_mem.OPS.all_to_all_vdev_2d(inp, out, s_in, meta, name, align)
        _sync(device)
        expected = ref.ref_vdev_2d(inputs, splits, rank, align)
        _compare(f"vdev_2d ne={ne} align={align}", out, meta, expected, rank)
        # back: each rank's expert-major result with its splits/offsets (gaps: the padding)
        metas = [ref.ref_vdev_2d(inputs, splits, r, align)[0] for r in range(W)]
        outs = [_expected_out(inputs, splits, r, align, rows_out + 1, hidden, dtype) for r in range(W)]
        in_so = _symm((2, W * ne), torch.int64, device, name)
        in_so.copy_(meta)
        back = _symm((rows_in, hidden), dtype, device, name, float("nan"))
        meta_back = _symm((2, W * ne), torch.int64, device, name, -1)
        symm_mem.OPS.all_to_all_vdev_2d_offset(out, back, in_so, meta_back, name)
        _sync(device)
        expected = ref.ref_vdev_2d_offset(outs, metas, rank)
        _compare(f"vdev_2d_offset ne={ne} align={align}", back, meta_back, expected, rank)
        w.check(
            torch.equal(back[: expected[2]].cpu().float(), inputs[rank][: expected[2]].float()),
            f"vdev_2d_offset ne={ne}: the round trip does not give the input back",
        )

    return run


def _expected_out(inputs, splits, rank, align, rows, hidden, dtype):
    out = torch.full((rows, hidden), float("nan")).to(dtype)
    for at, chunk in ref.ref_vdev_2d(inputs, splits, rank, align)[1]:
        out[at : at + chunk.shape[0]] = chunk
    return out


def ops_1d(hidden: int, dtype, high: int):
    def run(rank, W, device):
        name = symm_mem.OPS.prepare(dist.group.WORLD, device)
        splits = _splits(W, W, high, seed=30 + hidden)
        inputs = _inputs(W, W * high, hidden, dtype, seed=40)
        inp = _symm((W * high, hidden), dtype, device, name)
        inp.copy_(inputs[rank])
        out = _symm((W * W * high + 1, hidden), dtype, device, name, float("nan"))
        s_in = _symm((W,), torch.int64, device, name)
        s_in.copy_(splits[rank])
        meta = _symm((2, W), torch.int64, device, name, -1)
        symm_mem.OPS.all_to_all_vdev(inp, out, s_in, meta, name)
        _sync(device)
        _compare(f"vdev H={hidden} {str(dtype)[6:]}", out, meta, ref.ref_vdev(inputs, splits, rank), rank)

    return run


# ---------------------------------------------------------------- (b) the layer


def functional(num_local: int, force_1d: bool = False, exchange: str = "symm_mem"):
    def run(rank, W, device):
        with mock.patch.object(symm_mem, "MAX_2D_EXPERTS", 0 if force_1d else symm_mem.MAX_2D_EXPERTS):
            w.check_functional(
                rank,
                W,
                E=num_local * W,
                K=K,
                dispatchers=["sync_free"],
                backends=ep_check.BACKENDS,
                H=ep_check.H,
                I=ep_check.I,
                device=device,
                tol=ep_check.TOL,
                extras=False,
                exchange=exchange,
            )

    return run


def layer(exchange: str):
    def run(rank, W, device):
        w.check_layer(
            rank,
            W,
            dispatchers=["sync_free"],
            device=device,
            backends=ep_check.BACKENDS,
            hidden=ep_check.H,
            intermediate=ep_check.I,
            tol=ep_check.TOL,
            T_counts=ep_check._layer_counts(W),
            separated=True,
            exchange=exchange,
        )

    return run


def _copy_case(rank: int, W: int, H: int, device):
    """Rank ``rank``'s inputs of the row-copy check (any rank can make any rank's): local rows
    ``[300 W, H]``, indices ``[W, 257]`` into them (disjoint across peers, as a layout's), and
    per-peer counts (0, 1, 200, 257, ...)."""
    g = torch.Generator().manual_seed(40 + rank)
    local = torch.randn(300 * W, H, generator=g).to(device, BF16)
    rows = torch.randperm(280 * W, generator=g)[: 257 * W].view(W, 257).to(device)
    count = torch.tensor([(0, 1, 200, 257)[(rank + s) % 4] for s in range(W)], device=device)
    return local, rows, count


def copy_rows_check(direction: str):
    """The row-copy kernel on CUDA over real symmetric memory (every peer's buffer at once, bf16,
    H = 2048 and 40) against its torch reference (pull), or against the rows each writer sent,
    rebuilt from its seed (push: rank r writes rows ``[300 r, 300 r + count)`` of every peer)."""

    def run(rank, W, device):
        from moeyard.parallel import p2p
        from moeyard.parallel.row_copy import copy_rows_reference
        from moeyard.parallel.row_copy_triton import copy_rows_triton

        for H in (2048, 40):
            views, handle = p2p.OPS.symmetric((300 * W + 2, H), BF16, device, dist.group.WORLD)
            table = torch.tensor([v.data_ptr() for v in views], dtype=torch.int64, device=device)
            local, rows, count = _copy_case(rank, W, H, device)
            what = f"copy_rows/{direction}/H{H}/rank{rank}"
            if direction == "pull":
                views[rank].copy_(torch.randn(300 * W + 2, H, generator=torch.Generator().manual_seed(rank)).to(BF16))
                p2p.OPS.barrier(handle)
                base = torch.tensor([(5 * s + 3 * rank) % 40 for s in range(W)], device=device)
                ref = torch.full((300 * W + 1, H), float("nan"), device=device, dtype=BF16)
                got = ref.clone()
                copy_rows_reference(ref, views, rows, base, count, direction="pull")
                copy_rows_triton(got, views[0], table, rows, base, count, pull=True)
                w.check(torch.equal(got[:-1].nan_to_num(7.0), ref[:-1].nan_to_num(7.0)), f"{what}: differs")
            else:
                views[rank].fill_(float("nan"))
                p2p.OPS.barrier(handle)
                base = torch.full((W,), 300 * rank, device=device)
                copy_rows_triton(local, views[0], table, rows, base, count, pull=False)
                p2p.OPS.barrier(handle)
                torch.cuda.synchronize(device)
                mine = views[rank].clone()
                for writer in range(W):
                    src, rws, cnt = _copy_case(writer, W, H, device)
                    n = int(cnt[rank])
                    region = mine[300 * writer : 300 * (writer + 1)]
                    w.check(
                        torch.equal(region[:n], src[rws[rank, :n]]) and bool(region[n:].isnan().all()),
                        f"{what}: rows from rank {writer} wrong",
                    )
            p2p.OPS.barrier(handle)
            torch.cuda.synchronize(device)
            dist.barrier()

    return run


def checks(exchange: str = "symm_mem") -> list[tuple[str, object]]:
    if exchange == "p2p":
        out = [(f"copy_rows/{d}", copy_rows_check(d)) for d in ("pull", "push")]
        out += [
            ("functional/El4", functional(4, exchange="p2p")),
            ("functional/El64", functional(64, exchange="p2p")),
            ("layer", layer("p2p")),
        ]
        out += [
            (f"sync_debug/El{n}/{b}", ep_check.sync_debug_experts("sync_free", b, num_experts=n * 2, exchange="p2p"))
            for n in (4, 64)
            for b in ("triton", "grouped_mm")
        ]
        out += [(f"cuda_graph/{b}", ep_check.cuda_graph(b, exchange="p2p")) for b in ("triton", "grouped_mm")]
        return out
    out = [(f"ops/vdev_2d/ne{ne}/align{a}", ops_2d(ne, a)) for ne in (4, 16) for a in (1, 8)]
    out.append(("ops/vdev_2d/bf16_h2048", ops_2d(8, 16, hidden=2048, dtype=BF16, high=64)))
    out += [("ops/vdev/h16", ops_1d(16, FP32, 6)), ("ops/vdev/bf16_h2048", ops_1d(2048, BF16, 512))]
    out += [
        ("functional/2d/El4", functional(4)),
        ("functional/1d/El4", functional(4, force_1d=True)),
        ("functional/1d/El64", functional(64)),
        ("layer", layer("symm_mem")),
    ]
    out += [
        (f"sync_debug/El{n}/{b}", ep_check.sync_debug_experts("sync_free", b, num_experts=n * 2, exchange="symm_mem"))
        for n in (4, 64)
        for b in ("triton", "grouped_mm")
    ]
    return out


# ---------------------------------------------------------------- (c) timing

PROFILED = {
    "symm_mem": (("sync_free", "symm_mem"), ("all_to_all", "auto")),
    "p2p": (("sync_free", "p2p"), ("all_to_all", "auto")),
}
VARIANTS = {
    "symm_mem": (("all_to_all", "auto"), ("sync_free", "all_to_all"), ("sync_free", "symm_mem")),
    "p2p": (("all_to_all", "auto"), ("sync_free", "all_to_all"), ("sync_free", "p2p")),
}


def _qwen3(device):
    """``(options, shape)`` of ``moeyard bench`` at qwen3-30b-a3b, bf16, 3 warm-up and 10 timed runs."""
    from moeyard import bench as layer_bench

    opts = layer_bench.resolve_options(
        layer_bench.BenchOptions(models=["qwen3-30b-a3b"], device=str(device), dtype="bfloat16", warmup=3, iters=10)
    )
    return opts, layer_bench.cases(opts)[0]


def timing(ep, device, variants) -> list[dict]:
    """Every rank's ``moeyard.bench.ep.measure`` rows at qwen3-30b-a3b, per routing and variant."""
    from moeyard.bench import ep as ep_bench

    opts, shape = _qwen3(device)
    rows = []
    for routing in ("balanced", "zipf"):
        for dispatcher, exchange in variants:
            rows.append(
                ep_bench.measure(
                    shape, shape.moe_config(), routing, dispatcher, "auto", ep, opts, device, exchange=exchange
                )
            )
            torch.cuda.empty_cache()
    return rows


def raw_timing(ep, device, rows: int = 262144, hidden: int = 2048) -> dict:
    """The bare exchanges of ``rows x hidden`` bf16 per rank (qwen3-30b-a3b's pairs at EP = 2), equal
    splits: ``all_to_all_vdev`` on symmetric buffers, NCCL ``all_to_all_single`` on plain ones, and
    a local copy of the same rows; ms (median, ``moeyard.bench.ep``'s timer) and GB/s of the bytes
    each rank sends."""
    from moeyard.bench import ep as ep_bench

    opts, _ = _qwen3(device)
    W, name = ep.world_size, symm_mem.OPS.prepare(dist.group.WORLD, device)
    x = torch.randn(rows, hidden, device=device).to(BF16)
    inp = _symm((rows, hidden), BF16, device, name)
    inp.copy_(x)
    out = _symm((rows + 1, hidden), BF16, device, name)
    s_in = _symm((W,), torch.int64, device, name)
    s_in.fill_(rows // W)
    meta = _symm((2, W), torch.int64, device, name)
    plain_out = torch.empty_like(x)
    gb = rows * hidden * 2 / 1e9
    res = {"rows": rows, "hidden": hidden, "GB": gb}

    def ms(fn) -> float:
        return ep_bench._time_ms(fn, ep, opts, device)

    res["vdev_ms"] = ms(lambda: symm_mem.OPS.all_to_all_vdev(inp, out, s_in, meta, name))
    res["nccl_ms"] = ms(lambda: dist.all_to_all_single(plain_out, x))
    res["copy_ms"] = ms(lambda: plain_out.copy_(x))
    for k in ("vdev", "nccl", "copy"):
        res[f"{k}_GBps"] = gb / res[f"{k}_ms"] * 1e3
    return res


def profile_exchange(ep, device, dispatcher: str, exchange: str, steps: int = 3) -> str:
    """The device kernels of ``steps`` dispatch + combine calls (no experts in between: the
    dispatched rows go straight back) at qwen3-30b-a3b per rank, balanced routing, as
    ``torch.profiler``'s table (top 16 by device time), for rank 0 to print."""
    from moeyard import bench as layer_bench
    from moeyard.parallel.common import EPOptions
    from moeyard.parallel.experts import DISPATCHERS
    from moeyard.routing import route

    opts, shape = _qwen3(device)
    config = shape.moe_config()
    torch.manual_seed(1000 + ep.rank)
    inputs = layer_bench.make_inputs(shape, opts)
    more = {"exchange": exchange} if dispatcher == "sync_free" else {}
    options = EPOptions(
        num_experts=config.num_experts,
        dispatcher=dispatcher,
        max_tokens=None if dispatcher == "all_to_all" else shape.tokens,
        **more,
    )
    mod = DISPATCHERS[dispatcher]
    with torch.no_grad():
        r = route(inputs.xs[0], inputs.router_weight, config)
        x, ids, wt = inputs.xs[0], r.topk_ids, r.topk_weights.to(BF16)
        d = mod.dispatch(x, ids, wt, ep, options)  # warm-up (the symmetric buffers' allocation)
        mod.combine(d.rows, d)
        torch.cuda.synchronize(device)
        act = torch.profiler.ProfilerActivity
        with torch.profiler.profile(activities=[act.CUDA if device.type == "cuda" else act.CPU]) as prof:
            for _ in range(steps):
                d = mod.dispatch(x, ids, wt, ep, options)
                mod.combine(d.rows, d)
            torch.cuda.synchronize(device)
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=16, max_name_column_width=50)


def raw_report(ep, device) -> list[dict]:
    """:func:`raw_timing` on every rank, printed by rank 0 (slowest rank); every rank's results."""
    raw = raw_timing(ep, device)
    torch.cuda.empty_cache()
    raws = [None] * ep.world_size
    dist.all_gather_object(raws, raw)
    if ep.rank == 0:
        print(
            "\n==== raw exchange, equal splits, per rank: "
            f"{raw['rows']} x {raw['hidden']} bf16 ({raw['GB']:.2f} GB), slowest rank ===="
        )
        for k, label in (
            ("vdev", "all_to_all_vdev (NVSHMEM)"),
            ("nccl", "all_to_all_single (NCCL)"),
            ("copy", "local copy"),
        ):
            ms = max(r[f"{k}_ms"] for r in raws)
            print(f"raw {label:<28} {ms:8.3f} ms {raw['GB'] / ms * 1e3:8.1f} GB/s", flush=True)
    return raws


def timing_table(everyone: list[list[dict]]) -> str:
    lines = ["routing   variant                    rows sent (r0)  rows recv (max)  dispatch ms  combine ms"]
    for i, r0 in enumerate(everyone[0]):
        per = [rank_rows[i] for rank_rows in everyone]
        label = r0["dispatcher"] + ("" if r0["dispatcher"] != "sync_free" else f" + {r0['exchange']}")
        lines.append(
            f"{r0['routing']:<9} {label:<26} {r0['rows_sent']:>14} {max(p['rows_received'] for p in per):>16}"
            f" {max(p['dispatch_ms'] for p in per):>12.3f} {max(p['combine_ms'] for p in per):>11.3f}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- driver


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH", help="write every rank's results here")
    p.add_argument("--only", metavar="TEXT", help="run the checks whose name contains TEXT")
    p.add_argument("--no-timing", action="store_true", help="skip (c)")
    p.add_argument("--exchange", choices=("symm_mem", "p2p"), default="symm_mem", help="which exchange to check")
    args = p.parse_args()
    device = ep_check.start_nccl("ep_symm_check", 180)
    if device is None:
        return 2
    try:
        from moeyard.parallel.comm import resolve_group

        ep = resolve_group(None)
        from moeyard.parallel import p2p

        p2p_run = args.exchange == "p2p"
        reason = (p2p if p2p_run else symm_mem).OPS.unavailable(ep)
        if reason:
            print(f"ep_symm_check: the {args.exchange} exchange cannot run here: {reason}", flush=True)
            return 1
        results = ep_check.run_all(ep.rank, ep.world_size, device, args.only, checks(args.exchange))
        everyone = [None] * ep.world_size
        dist.all_gather_object(everyone, results)
        ok = ep.rank != 0 or ep_check.report(everyone, f"ep_symm_check: the {args.exchange} exchange of sync_free")
        timings = raws = None
        if not args.no_timing and not args.only:
            raws = None if p2p_run else raw_report(ep, device)
            for dispatcher, exchange in PROFILED[args.exchange]:
                table = profile_exchange(ep, device, dispatcher, exchange)
                torch.cuda.empty_cache()
                if ep.rank == 0:
                    print(
                        f"\n==== profile: 3 x (dispatch + combine), {dispatcher} ({exchange}), qwen3-30b-a3b, "
                        f"balanced, rank 0 ====\n{table}\n==== end profile ====",
                        flush=True,
                    )
            rows = timing(ep, device, VARIANTS[args.exchange])
            timings = [None] * ep.world_size
            dist.all_gather_object(timings, rows)
            if ep.rank == 0:
                print("\n==== timing: qwen3-30b-a3b per rank, bf16, slowest rank's ms ====")
                print(timing_table(timings), flush=True)
        if ep.rank == 0 and args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {
                        "world_size": ep.world_size,
                        "torch": torch.__version__,
                        "results": everyone,
                        "raw": raws,
                        "timing": timings,
                    },
                    f,
                    indent=1,
                )
        release_buffers()
        return ep_check.exit_code(ok, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
