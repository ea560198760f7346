"""Expert parallelism on CPU with gloo: 2, 4 and 8 spawned processes against one process running all
ranks' tokens through the unsharded layer (the checks live in ep_workers.py, batched per world size
because spawning is the slow part), plus the errors raised before any process group exists.
"""

import pytest
import torch
import torch.distributed as dist

import ep_workers
from moeyard import MoE, MoEConfig
from moeyard.parallel import expert_parallel, fsdp_expert_parallel

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)


@pytest.fixture(scope="module")
def ep2_checkpoint(tmp_path_factory):
    """Run every 2-rank check once; the DTensor checkpoint it saves at EP = 2 is reused below."""
    path = tmp_path_factory.mktemp("ep2_ckpt")
    ep_workers.spawn(ep_workers.worker_2, 2, str(path))
    return path


@pytest.mark.xdist_group("ep2_checkpoint")  # one worker runs the module fixture once
def test_two_ranks(ep2_checkpoint):
    """Every dispatcher: functional cases (uneven, empty rank, all to one rank, sentinels, capacity),
    the MoE layer, a transformers Qwen3-MoE, a DTensor checkpoint save, bad input."""
    assert (ep2_checkpoint / "full.pt").exists()


@pytest.mark.xdist_group("ep2_checkpoint")  # one worker runs the module fixture once
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_checkpoint_from_ep2_loads_at_ep1(ep2_checkpoint):
    """The EP = 2 DTensor checkpoint loads into one unsharded layer (no process group)."""
    import torch.distributed.checkpoint as dcp

    m = ep_workers.make_layer(ep_workers.LAYER_CONFIGS["gpt_oss"], seed=123)
    sd = m.state_dict()
    dcp.load(sd, checkpoint_id=str(ep2_checkpoint), no_dist=True)
    full = torch.load(ep2_checkpoint / "full.pt")
    assert set(sd) == set(full)
    for k in full:
        assert torch.equal(sd[k], full[k]), k


@pytest.mark.xdist_group("ep2_checkpoint")  # one worker runs the module fixture once
def test_four_ranks(ep2_checkpoint):
    """Functional cases and the layer on 4 ranks (one with no tokens); the EP = 2 checkpoint loads at
    EP = 4; bad input."""
    ep_workers.spawn(ep_workers.worker_4, 4, str(ep2_checkpoint))


def test_symm_mem_exchange_emulated():
    """``sync_free`` with ``exchange="symm_mem"`` on 2 ranks, its NVSHMEM ops emulated on gloo: both
    paths (2-D at E_l <= 16, 1-D past it), padding, capacity, sentinels, autograd, the barrier between
    same-direction ops, the layer; the errors of the real ops on gloo."""
    ep_workers.spawn(ep_workers.worker_symm, 2)


def test_p2p_exchange_emulated():
    """``sync_free`` with ``exchange="p2p"`` on 2 ranks, symmetric memory emulated by shared files:
    every routing case, padding, capacity, sentinels, autograd, NaN in every row it does not write,
    its barriers, no host reads, the layer; the errors of the real ops on gloo."""
    ep_workers.spawn(ep_workers.worker_p2p, 2)


@pytest.mark.parametrize("direction", ["pull", "push", "pull_indexed", "pull_scaled"])
def test_copy_rows_kernel_matches_reference(direction):
    """The Triton row copy under the interpreter (three peers' buffers in one launch, through the
    address table) against the torch reference, and the reference against the definition row by
    row: counts 0, partial blocks and the full bound, a row stride wider than H, a pull through each
    peer's index (rows read twice or not at all), and scaled by each peer's factors; nothing past a
    peer's count written."""
    pytest.importorskip("triton")
    import os
    from unittest import mock

    from moeyard.parallel.row_copy import copy_rows, copy_rows_reference

    g = torch.Generator().manual_seed(3)
    W, C, H = 3, 21, 40
    rows = torch.randperm(64, generator=g)[: W * C].view(W, C)  # disjoint across peers, as a layout
    base, count = torch.tensor([40, 3, 17]), torch.tensor([C, 0, 13])
    local = torch.randn(65, H + 8, generator=g)[:, :H]
    peers = [torch.randn(66, H + 8, generator=g)[:, :H] for _ in range(W)]
    index = [torch.randint(0, 64, (64,), generator=g) for _ in range(W)] if direction.startswith("pull_") else None
    scale = [torch.randn(64, generator=g) for _ in range(W)] if direction == "pull_scaled" else None
    pull = direction != "push"
    mode = "pull" if pull else "push"
    if pull:
        ref, got = torch.zeros(65, H), torch.zeros(65, H)
        copy_rows_reference(ref, peers, rows, base, count, direction=mode, index=index, scale=scale)
        local_got, peers_got = got, peers
    else:
        ref = [torch.zeros(66, H) for _ in range(W)]
        got = [torch.zeros(66, H + 8)[:, :H] for _ in range(W)]
        copy_rows_reference(local, ref, rows, base, count, direction=mode)
        local_got, peers_got = local, got
    for s in range(W):  # the definition, row by row
        for j in range(int(count[s])):
            w = int(base[s]) + j
            if pull:
                src = peers[s][int(index[s][w]) if index else w] * (float(scale[s][w]) if scale else 1.0)
                assert torch.equal(ref[int(rows[s, j])], src), (s, j)
            else:
                assert torch.equal(ref[s][w], local[int(rows[s, j])]), (s, j)
    table = torch.tensor([p.data_ptr() for p in peers_got], dtype=torch.int64)
    addresses = lambda views: None if views is None else torch.tensor([v.data_ptr() for v in views])  # noqa: E731
    with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}):
        from moeyard.parallel.row_copy_triton import copy_rows_triton

        copy_rows_triton(
            local_got,
            peers_got[0],
            table,
            rows,
            base,
            count,
            pull=pull,
            index_table=addresses(index),
            scale_table=addresses(scale),
        )
    if pull:
        assert torch.equal(got[:-1], ref[:-1])
        assert torch.count_nonzero(got.abs().sum(1)) == count.sum()
    else:
        for s in range(W):
            assert torch.equal(got[s][:-1], ref[s][:-1]), s
            assert torch.count_nonzero(got[s].abs().sum(1)) == count[s]
    with pytest.raises(ValueError, match="direction: expected one of"):
        copy_rows(local, peers, table, rows, base, count, direction="both")
    with pytest.raises(ValueError, match="index, scale: only a pull"):
        copy_rows(local, peers, table, rows, base, count, direction="push", index=(peers, table))


def test_p2p_layout_kernel_matches_reference():
    """The ``p2p`` dispatch's layout kernel under the interpreter against its torch reference, every
    output: 1-4 ranks, each rank's view, E_l 1 to 18, align 1 to 16, counts from none to a full block."""
    pytest.importorskip("triton")
    import os
    from unittest import mock

    from moeyard.parallel.p2p_layout import layout_reference, num_rows

    g = torch.Generator().manual_seed(5)
    with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}):
        from moeyard.parallel.p2p_layout_triton import layout_triton

        for W, El, align, C in ((1, 1, 1, 7), (2, 4, 1, 50), (3, 18, 4, 40), (2, 5, 16, 300), (4, 3, 2, 9)):
            counts = torch.randint(0, 3 * C // El + 1, (W, W, El), generator=g)
            counts[0, :, 0] = 0  # an empty expert and window part
            counts = torch.minimum(counts, (C // El) * torch.ones_like(counts))  # a sender's total <= C
            counts[-1, -1] = 0
            counts[-1, -1, -1] = C  # a full block
            R = num_rows(W, C, El, align)
            for me in range(W):
                want = layout_reference(counts, me, align, C, R)
                got = layout_triton(counts, me, align, C, R)
                for name, a, b in zip(
                    ("dst_rows", "window", "received", "pad_rows", "row_experts"), want, got, strict=True
                ):
                    assert (a is None and b is None) or torch.equal(a, b), (name, W, El, align, C, me)
        # rows past int32 (the kernel's arithmetic): the reference answers, the kernel is not launched
        import moeyard.parallel.p2p_layout_triton as lt

        with mock.patch.object(lt, "MAX_TILE", 2**31), mock.patch.object(lt, "layout_kernel", None):
            got = layout_triton(counts, 0, align, C, R)
        assert all(
            torch.equal(a, b)
            for a, b in zip(layout_reference(counts, 0, align, C, R), got, strict=True)
            if a is not None
        )


@pytest.mark.slow  # ~60 s on 2 cores: 8 processes importing torch
def test_eight_ranks():
    """One dispatcher (sync_free) on 8 ranks, every routing case."""
    ep_workers.spawn(ep_workers.worker_8, 8)


def test_errors_before_any_collective():
    layer = MoE(MoEConfig(num_experts=4, hidden_size=8, intermediate_size=4, top_k=2))
    with pytest.raises(ValueError, match="dispatcher"):
        expert_parallel(layer, dispatcher="ring")
    with pytest.raises(ValueError, match="capacity_factor"):
        expert_parallel(layer, dispatcher="all_to_all", capacity_factor=1.25)
    with pytest.raises(ValueError, match="capacity_factor"):
        expert_parallel(layer, dispatcher="sync_free", capacity_factor=0)
    with pytest.raises(ValueError, match="max_tokens"):
        expert_parallel(layer, dispatcher="all_to_all", max_tokens=16)
    with pytest.raises(ValueError, match="align"):
        expert_parallel(layer, dispatcher="all_gather", align=16)
    with pytest.raises(ValueError, match="exchange: expected one of"):
        expert_parallel(layer, dispatcher="sync_free", exchange="nvshmem")
    with pytest.raises(ValueError, match="exchange: only the sync_free dispatcher"):
        expert_parallel(layer, dispatcher="all_to_all", exchange="symm_mem")
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="overlap_chunks: expected a positive int"):
            expert_parallel(layer, overlap_chunks=bad)
    with pytest.raises(ValueError, match="overlap_chunks: only the all_to_all and sync_free"):
        expert_parallel(layer, dispatcher="all_gather", overlap_chunks=2)
    with pytest.raises(ValueError, match="overlap_chunks: not with capacity_factor"):
        expert_parallel(layer, dispatcher="sync_free", capacity_factor=2.0, overlap_chunks=2)
    with pytest.raises(ValueError, match="overlap_chunks: not with exchange='symm_mem'"):
        expert_parallel(layer, dispatcher="sync_free", exchange="symm_mem", overlap_chunks=2)
    with pytest.raises(ValueError, match="overlap_chunks: not with exchange='p2p'"):
        expert_parallel(layer, dispatcher="sync_free", exchange="p2p", overlap_chunks=2)
    with pytest.raises(TypeError, match="mesh: expected a 2-D DeviceMesh"):
        fsdp_expert_parallel(layer, None)
    with pytest.raises(TypeError, match="module"):
        expert_parallel("not a module")
    with pytest.raises(ValueError, match="module: no moeyard.MoE"):
        expert_parallel(torch.nn.Linear(4, 4))
    if not dist.is_initialized():
        with pytest.raises(ValueError, match="group: torch.distributed is not initialised"):
            expert_parallel(layer)
    assert layer.expert_parallel is None and layer.gate_up_proj.shape[0] == 4  # untouched


def test_bench_ep_under_torchrun(tmp_path):
    """``moeyard bench --ep 2 --overlap 1,2`` runs under torchrun with gloo and reports every dispatcher
    and routing, and the whole call per overlap_chunks."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "ep.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "moeyard",
        "bench",
        "--ep",
        "2",
        "--shape",
        "32,16,8,4,2",
        "--warmup",
        "0",
        "--iters",
        "1",
        "--overlap",
        "1,2",
        "--json",
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["routing"], r["dispatcher"]) for r in rows} == {
        (a, b) for a in ("balanced", "zipf") for b in ("all_to_all", "sync_free", "all_gather")
    }
    assert len(rows) == 12 and all(r["dispatch_ms"] > 0 and r["experts_ms"] > 0 for r in rows)
    assert {r["rank"] for r in rows} == {0, 1}
    # sync_free is timed with the named all_to_all exchange (p2p, auto's choice on CUDA, needs NCCL)
    assert all(r["exchange"] == ("all_to_all" if r["dispatcher"] == "sync_free" else "auto") for r in rows)
    for r in rows:  # the whole call per overlap_chunks (all_gather: 1 only)
        assert set(r["overlap"]) == ({"1"} if r["dispatcher"] == "all_gather" else {"1", "2"}), r["overlap"]
        assert all(v["fwd_ms"] > 0 and v["fwd_bwd_ms"] > 0 for v in r["overlap"].values())
    # balanced routing: every rank computes exactly its share of the 2 * 32 * 2 pairs
    assert all(r["pairs_computed"] == 32 * 2 for r in rows if r["routing"] == "balanced")


def test_bench_ep_lora_weak_scaling_under_torchrun(tmp_path):
    """``moeyard bench --ep 2 --lora 4``: the LoRA step, and per row the one-GPU step on the same tokens
    and the weak-scaling ratio; ``--quant`` is refused with ``--ep``."""
    import json
    import os
    import subprocess
    import sys

    from moeyard.bench.args import check_bench_arguments
    from moeyard.cli import build_parser

    out = tmp_path / "ep_lora.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "moeyard",
        "bench",
        "--ep",
        "2",
        "--shape",
        "16,16,8,4,2",
        "--warmup",
        "0",
        "--iters",
        "1",
        "--lora",
        "4",
        "--routing",
        "zipf",
        "--json",
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LoRA r=4 step" in proc.stdout and "per GPU vs 1 GPU" in proc.stdout
    result = json.loads(out.read_text())
    assert result["lora_rank"] == 4 and all(r["lora_rank"] == 4 for r in result["rows"])
    assert all(r["one_gpu"]["fwd_bwd_ms"] > 0 for r in result["rows"])
    scaling = result["weak_scaling"]
    assert {s["dispatcher"] for s in scaling} == {"all_to_all", "sync_free", "all_gather"}
    assert all(
        s["routing"] == "zipf" and s["per_gpu"] == s["one_gpu_fwd_bwd_ms"] / s["ep_fwd_bwd_ms"] > 0 for s in scaling
    )
    args = build_parser().parse_args(["bench", "--ep", "2", "--lora", "16", "--quant", "nf4"])
    with pytest.raises(ValueError, match="--ep: .*--quant"):
        check_bench_arguments(args)


def test_lora_of_all_experts_is_refused():
    """An installed ExpertParallel takes only this rank's block of the LoRA factors: an adapter of all E
    experts (one that says so: ``ExpertLoRA.num_experts``) raises before any collective, naming shard_lora."""
    from moeyard.parallel import EPOptions, ExpertParallel
    from moeyard.parallel.comm import EPGroup

    layer = MoE(MoEConfig(num_experts=4, hidden_size=8, intermediate_size=4, top_k=2)).add_lora(2)
    call = ExpertParallel(EPGroup(group=None, world_size=2, rank=0), EPOptions(num_experts=4))
    lora = {n: a.expert_lora() for n, a in layer.lora.items()}
    with pytest.raises(ValueError, match=r"lora\['gate_up_proj'\]: the adapter covers 4 experts.*shard_lora"):
        call(
            torch.randn(3, 8),
            torch.zeros(3, 2, dtype=torch.int64),
            torch.ones(3, 2),
            layer.gate_up_proj[:2],
            layer.down_proj[:2],
            lora=lora,
        )
    from moeyard import ExpertLoRA

    bad = {"down_proj": ExpertLoRA(lora_A=torch.randn(5, 4), lora_B=torch.randn(8, 5))}  # 5 rows: not r * 2
    with pytest.raises(ValueError, match=r"lora\['down_proj'\]: expected lora_A \[r\*2, in\]"):
        call(
            torch.randn(3, 8),
            torch.zeros(3, 2, dtype=torch.int64),
            torch.ones(3, 2),
            layer.gate_up_proj[:2],
            layer.down_proj[:2],
            lora=bad,
        )


def test_nccl_device_check():
    """On an NCCL group, tensors off CUDA (or off the current CUDA device) raise a clear ValueError
    before the collective; other backends take any device."""
    from moeyard.parallel.comm import check_device

    with pytest.raises(ValueError, match="NCCL, which needs CUDA tensors"):
        check_device(torch.device("cpu"), "nccl")
    check_device(torch.device("cpu"), "gloo")
    check_device(torch.device("cpu"), "cpu:gloo,cuda:nccl")


def test_route_pairs_without_slots():
    """``route_pairs(slots=False)``: the same ids and drops as with slots, by the short path where no
    destination can overflow (C >= T * K) and by the sort where one can."""
    from moeyard.parallel.sync_free import route_pairs

    g = torch.Generator().manual_seed(8)
    E, W, T, K = 8, 2, 6, 3
    ids = torch.rand(T, E, generator=g).argsort(1)[:, :K]
    ids[0, 1], ids[3, 2] = E, -1  # dropped sentinels
    for block in (T * K, 4):  # the short path; capacity drops
        full, short = route_pairs(ids, E, W, T, block), route_pairs(ids, E, W, T, block, slots=False)
        assert torch.equal(full.ids, short.ids) and torch.equal(full.dropped, short.dropped)
        assert (short.pair_slot is None) == (block >= T * K)
    assert int(route_pairs(ids, E, W, T, 4).dropped) > 0


def test_p2p_limits():
    """The peer-to-peer exchange's checks that need no process group: NCCL, CUDA, no overlap_chunks > 1."""
    from moeyard.parallel import EPOptions, ExpertParallel
    from moeyard.parallel.comm import EPGroup
    from moeyard.parallel.p2p import check_available, num_rows

    with pytest.raises(ValueError, match="exchange: 'p2p' needs an NCCL group, got backend 'gloo'"):
        check_available(EPGroup(group=None, world_size=2, rank=0, backend="gloo"))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="exchange: 'p2p' needs CUDA"):
            check_available(EPGroup(group=None, world_size=2, rank=0, backend="nccl"))
    with pytest.raises(ValueError, match="overlap_chunks: not with exchange='p2p'"):
        ExpertParallel(
            EPGroup(group=None, world_size=2, rank=0, backend="nccl"),
            EPOptions(num_experts=4, dispatcher="sync_free", exchange="p2p", overlap_chunks=2),
        )
    assert num_rows(2, 10, 4, 1) == 20 and num_rows(2, 10, 4, 4) == 32 and num_rows(2, 9, 3, 8) == 40


def test_symm_mem_limits():
    """The symmetric-memory exchange's checks that need no process group: at most 32 ranks, CUDA,
    which path a shape takes (2-D up to 16 local experts and 16 ranks), no overlap_chunks > 1."""
    from moeyard.parallel import EPOptions, ExpertParallel
    from moeyard.parallel.comm import EPGroup
    from moeyard.parallel.symm_mem import check_available, use_2d

    with pytest.raises(ValueError, match="at most 32 ranks"):
        check_available(EPGroup(group=None, world_size=64, rank=0, backend="nccl"))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="exchange: 'symm_mem' needs CUDA"):
            check_available(EPGroup(group=None, world_size=2, rank=0, backend="nccl"))
    assert use_2d(2, 16) and use_2d(16, 1) and not use_2d(2, 17) and not use_2d(17, 4)
    with pytest.raises(ValueError, match="overlap_chunks: not with exchange='symm_mem'"):  # before the CUDA check
        ExpertParallel(
            EPGroup(group=None, world_size=2, rank=0, backend="nccl"),
            EPOptions(num_experts=4, dispatcher="sync_free", exchange="symm_mem", overlap_chunks=2),
        )


def test_expert_parallel_checks_its_overlap_options():
    """Built directly (not through expert_parallel), ExpertParallel refuses the same overlap options."""
    from moeyard.parallel import EPOptions, ExpertParallel
    from moeyard.parallel.comm import EPGroup

    ep = EPGroup(group=None, world_size=2, rank=0, backend="gloo")
    with pytest.raises(ValueError, match="only the all_to_all and sync_free"):
        ExpertParallel(ep, EPOptions(num_experts=4, dispatcher="all_gather", overlap_chunks=2))
    with pytest.raises(ValueError, match="not with capacity_factor"):
        ExpertParallel(ep, EPOptions(num_experts=4, dispatcher="sync_free", capacity_factor=1.0, overlap_chunks=2))
    with pytest.raises(ValueError, match="positive int"):
        ExpertParallel(ep, EPOptions(num_experts=4, overlap_chunks=0))


@pytest.mark.filterwarnings("ignore")
def test_fsdp2_on_a_dp2_ep2_mesh():
    """FSDP2 x expert parallelism on a (dp=2, ep=2) gloo mesh: losses, full gradients and the
    parameters after two SGD steps equal one process on the global batch."""
    ep_workers.spawn(ep_workers.worker_fsdp, 4)


@pytest.mark.filterwarnings("ignore")
def test_fsdp2_on_a_dp1_ep2_mesh():
    """dp = 1: FSDP's single-rank reduce (no collective) still divides the expert gradients by dp * ep
    exactly once, in float64 too."""
    ep_workers.spawn(ep_workers.worker_fsdp_dp1, 2)


def test_overlap_two_ranks():
    """overlap_chunks 2 and 3: every routing case (uneven, a rank with no tokens, all to one rank),
    sentinels, the layer, no host reads (sync_free), and the order of exchanges and expert compute
    forward and backward."""
    ep_workers.spawn(ep_workers.worker_overlap, 2)


def test_overlap_four_ranks():
    """overlap_chunks 2 and 3 on 4 ranks (one with no tokens in the layer cases)."""
    ep_workers.spawn(ep_workers.worker_overlap, 4)


def test_activation_checkpointing_two_ranks():
    """torch.utils.checkpoint (non-reentrant) over the expert-parallel layer, every dispatcher, with and
    without overlap_chunks: the recomputed forward issues its exchanges again in backward; outputs and every
    gradient against the oracle, nothing hangs."""
    ep_workers.spawn(ep_workers.worker_checkpoint, 2)


def test_bench_ep_fp8_dispatch_under_torchrun(tmp_path):
    """``moeyard bench --ep 2 --fp8-dispatch --recipe fp8_rowwise``: the all_to_all and all_gather rows
    again with e4m3 rows on the wire (their bytes: H + 16 per row), the experts under the recipe."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "ep_fp8.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m"]
    cmd += ["moeyard", "bench", "--ep", "2", "--shape", "32,16,8,4,2", "--warmup", "0", "--iters", "1"]
    cmd += ["--routing", "balanced", "--fp8-dispatch", "--recipe", "fp8_rowwise", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "recipe fp8_rowwise" in proc.stdout and "all_to_all fp8" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    fp8 = {r["dispatcher"] for r in rows if r["fp8_dispatch"]}
    assert fp8 == {"all_to_all", "all_gather"} and len(rows) == 2 * 5
    for r in rows:
        assert r["dispatch_ms"] > 0 and r["overlap"]["1"]["fwd_bwd_ms"] > 0
        if r["fp8_dispatch"]:  # e4m3 rows and their scale: H + 16 bytes a row
            assert r["dispatch_GBps"] == pytest.approx(r["rows_sent"] * (r["H"] + 16) / r["dispatch_ms"] / 1e6)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--fp8-dispatch"], "--fp8-dispatch: .*--ep"),
        (["--ep", "2", "--recipe", "fp8_rowwise,mxfp8"], "--ep --recipe: one recipe"),
        (["--ep", "2", "--lora", "4", "--recipe", "fp8_rowwise"], "--recipe: .*not with --lora"),
    ],
)
def test_bench_ep_fp8_arguments_refused(argv, match):
    from moeyard.bench.args import check_bench_arguments
    from moeyard.cli import build_parser

    with pytest.raises(ValueError, match=match):
        check_bench_arguments(build_parser().parse_args(["bench", *argv]))
