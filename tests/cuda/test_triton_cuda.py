"""The ``triton`` expert backend on a CUDA GPU: bfloat16 parity with the float64 ``loop`` oracle
(judged against torch's own bfloat16 error), float32, no host sync (sync-debug mode and a CUDA
graph capture of forward + backward), and 64-bit indexing when ``T * K * H > 2**31``."""

import pytest
import torch

import moeyard
from helpers import check_fill_invalid
from moeyard.activations import Activation
from moeyard.experts import triton as triton_backend  # noqa: F401  (registers "triton")

pytestmark = pytest.mark.cuda
DEV = "cuda"


def _problem(T, H, I, E, K, *, bias=False, transposed=False, gated=True, scale=1.0):
    n1 = 2 * I if gated else I
    up_shape, down_shape = ((E, H, n1), (E, I, H)) if transposed else ((E, n1, H), (E, H, I))
    p = dict(
        x=torch.randn(T, H, device=DEV) * scale,
        gate_up_proj=torch.randn(up_shape, device=DEV) / H**0.5,
        down_proj=torch.randn(down_shape, device=DEV) / I**0.5,
        topk_weights=torch.rand(T, K, device=DEV) + 0.1,
    )
    if bias:
        p["gate_up_bias"] = torch.randn(E, n1, device=DEV) * 0.5
        p["down_bias"] = torch.randn(E, H, device=DEV) * 0.5
    ids = torch.rand(T, E, device=DEV).topk(K, dim=1).indices
    return p, ids


def _run(p, ids, backend, dtype, dout=None, **kw):
    leaves = {k: v.detach().to(dtype).requires_grad_() for k, v in p.items()}
    out = moeyard.experts(
        leaves["x"],
        ids,
        leaves["topk_weights"],
        leaves["gate_up_proj"],
        leaves["down_proj"],
        gate_up_bias=leaves.get("gate_up_bias"),
        down_bias=leaves.get("down_bias"),
        backend=backend,
        **kw,
    )
    if dout is None:
        dout = torch.randn(out.shape, device=DEV, generator=torch.Generator(DEV).manual_seed(1))
    grads = torch.autograd.grad(out, list(leaves.values()), dout.to(dtype))
    return {"out": out.detach(), **{f"d_{n}": g for n, g in zip(leaves, grads, strict=True)}}


def _rel(got, ref):
    return ((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _check(p, ids, dtype, **kw):
    got = _run(p, ids, "triton", dtype, **kw)
    ref = _run(p, ids, "loop", torch.float64, **kw)
    base = _run(p, ids, "loop", dtype, **kw)
    for name, r in ref.items():
        assert not got[name].isnan().any(), name
        err, err_torch = _rel(got[name], r), _rel(base[name], r)
        assert err <= 2 * err_torch + 1e-6, f"{name}: rel err {err:.2e} vs torch {dtype} {err_torch:.2e}"


@pytest.mark.parametrize("act", ["swiglu", "geglu", "relu2"])
def test_bf16_parity(act):
    p, ids = _problem(1000, 512, 192, 16, 4, gated=Activation(name=act).gated)
    _check(p, ids, torch.bfloat16, activation=act)


def test_bf16_gpt_oss_layout():
    p, ids = _problem(600, 384, 160, 8, 2, bias=True, transposed=True, scale=2.0)
    act = Activation(name="clamped_swiglu", limit=2.0)
    _check(p, ids, torch.bfloat16, activation=act, transposed=True, interleaved=True)


def test_fp32_parity():
    p, ids = _problem(300, 256, 96, 8, 2, bias=True)
    _check(p, ids, torch.float32)


def _graph_inputs(T=512, H=256, I=128, E=8, K=2):
    p, ids = _problem(T, H, I, E, K)
    leaves = {k: v.to(torch.bfloat16).requires_grad_() for k, v in p.items()}
    return leaves, ids, torch.randn(T, H, device=DEV, dtype=torch.bfloat16)


def _fwd_bwd(leaves, ids, dout):
    out = moeyard.experts(
        leaves["x"], ids, leaves["topk_weights"], leaves["gate_up_proj"], leaves["down_proj"], backend="triton"
    )
    return [out.detach()] + list(torch.autograd.grad(out, list(leaves.values()), dout))


@pytest.mark.parametrize(
    "opts",
    [{}, {"atomic_combine": True, "wgrad_chunk_rows": 64}, {"tma": False, "tma_wgrad": False}, {"prefetch_h": True}],
    ids=["default", "options", "pointer", "prefetch"],
)
def test_no_host_sync(opts):
    from moeyard.experts.triton.options import use_options

    leaves, ids, dout = _graph_inputs()
    with use_options(**opts):
        _fwd_bwd(leaves, ids, dout)  # compile and autotune first
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            _fwd_bwd(leaves, ids, dout)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("opts", [{"gluon_dh": False}, {"atomic_combine": True}], ids=["dh", "atomic"])
def test_first_tuned_call_matches_the_next(opts, monkeypatch):
    """With autotuning on, the first call of a new shape tunes each kernel on the caller's own buffers. A kernel
    that writes one routing-weight partial row per column tile (the Triton activation gradient: the tile width
    varies between configs) or adds into its output (the atomic combine) must still return, on that first call,
    what the next call returns; they once returned the sum of the tuning runs' writes."""
    from moeyard.experts.triton import ops
    from moeyard.experts.triton.options import use_options

    monkeypatch.setenv("MOEYARD_TRITON_AUTOTUNE", "1")
    monkeypatch.setattr(ops, "_LAUNCHERS", {})  # launchers built anew, autotuned
    leaves, ids, dout = _graph_inputs(T=700, H=256, I=384, E=8, K=2)  # I 384: 6, 3 or 2 column tiles per config
    with use_options(**opts):
        first = _fwd_bwd(leaves, ids, dout)
        second = _fwd_bwd(leaves, ids, dout)
    for name, a, b in zip(["out", *leaves], first, second, strict=True):
        assert _rel(a, b) < 1e-3, f"{name}: the first (tuning) call differs from the second by {_rel(a, b):.2e}"


@pytest.mark.parametrize("tma", [False, True])
def test_cuda_graph_forward_backward(tma):
    from moeyard.experts.triton.options import use_options

    with use_options(tma=tma, tma_wgrad=tma):
        _graph_round_trip()


def test_bf16_gpt_oss_layout_pointer():
    from moeyard.experts.triton.options import use_options

    with use_options(tma=False, tma_wgrad=False):
        test_bf16_gpt_oss_layout()


@pytest.mark.parametrize("layout", ["relu2", "geglu", "gpt-oss"])
def test_bf16_prefetch_h(layout):
    """The dh kernel's L2 prefetch over every h layout: plain, gated, interleaved (gpt-oss)."""
    from moeyard.experts.triton.options import use_options

    with use_options(prefetch_h=True):
        if layout == "gpt-oss":
            test_bf16_gpt_oss_layout()
        else:
            p, ids = _problem(1000, 512, 192, 16, 4, gated=Activation(name=layout).gated)
            _check(p, ids, torch.bfloat16, activation=layout)


def _graph_round_trip():
    leaves, ids, dout = _graph_inputs()
    eager = _fwd_bwd(leaves, ids, dout)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _fwd_bwd(leaves, ids, dout)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = _fwd_bwd(leaves, ids, dout)
    # new inputs and new routing, copied into the captured buffers
    fresh, fresh_ids, fresh_dout = _graph_inputs()
    with torch.no_grad():
        for k in leaves:
            leaves[k].copy_(fresh[k])
    ids.copy_(fresh_ids)
    dout.copy_(fresh_dout)
    graph.replay()
    want = _fwd_bwd(leaves, ids, dout)
    for s, w in zip(static, want, strict=True):
        assert torch.equal(s, w)
    assert not torch.equal(static[0], eager[0])


@pytest.mark.parametrize("weights", [False, True])
def test_fill_invalid_large(weights):
    """The in-place combine at K = 1 on bf16 rows of sonic-7b's width, thousands of row blocks with no
    invalid row between the first and the last (:func:`helpers.check_fill_invalid`)."""
    check_fill_invalid(65541, 1536, weights, DEV, torch.bfloat16)


def test_int64_indexing():
    # T * K * H > 2**31: pair rows of the last tokens lie past 2**31 elements
    T, H, I, E, K = 140_000, 2048, 32, 8, 8
    assert T * K * H > 2**31
    p, ids = _problem(T, H, I, E, K)
    leaves = {k: v.to(torch.bfloat16).requires_grad_() for k, v in p.items()}
    out = moeyard.experts(
        leaves["x"], ids, leaves["topk_weights"], leaves["gate_up_proj"], leaves["down_proj"], backend="triton"
    )
    dout = torch.randn_like(out)
    (dx,) = torch.autograd.grad(out, [leaves["x"]], dout)
    tail = slice(T - 64, T)  # tokens are independent: check the last ones against a small reference
    sub = {k: v.detach().double() for k, v in leaves.items()}
    for k in ("x", "topk_weights"):
        sub[k] = sub[k][tail].requires_grad_()
    ref = moeyard.experts(
        sub["x"], ids[tail], sub["topk_weights"], sub["gate_up_proj"], sub["down_proj"], backend="loop"
    )
    (ref_dx,) = torch.autograd.grad(ref, [sub["x"]], dout[tail].double())
    low = {k: v.detach().to(torch.bfloat16).requires_grad_() for k, v in sub.items()}
    base = moeyard.experts(
        low["x"], ids[tail], low["topk_weights"], low["gate_up_proj"], low["down_proj"], backend="loop"
    )
    (base_dx,) = torch.autograd.grad(base, [low["x"]], dout[tail])
    assert _rel(out[tail], ref) <= 2 * _rel(base, ref) + 1e-6
    assert _rel(dx[tail], ref_dx) <= 2 * _rel(base_dx, ref_dx) + 1e-6


# the speed options (moeyard.experts.triton.options), each against the float64 oracle in bf16
@pytest.mark.parametrize(
    "opts",
    [
        dict(atomic_combine=True),  # fused combine with float32 atomics (fwd and dx)
        dict(wgrad_chunk_rows=64),  # every expert (~250 rows) split into chunks
        dict(wgrad_chunk_rows=300, atomic_combine=True),  # some experts split, with the atomic combine
        dict(tma=False, tma_wgrad=False),  # pointer loads everywhere (GPUs before Hopper)
        dict(tma_wgrad=True, wgrad_chunk_rows=64),  # TMA weight gradients, descriptors sized to each chunk
        dict(prefetch_h=True),  # dh prefetches its h rows into L2
    ],
    ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()),
)
def test_bf16_options(opts):
    from moeyard.experts.triton.options import use_options

    p, ids = _problem(1000, 512, 192, 16, 4, bias=True)
    with use_options(**opts):
        _check(p, ids, torch.bfloat16)


def _bf16_layer(backend: str = "triton"):
    """A small bf16 layer with a router loss, its input and output gradient (seeded)."""
    torch.manual_seed(0)
    cfg = moeyard.MoEConfig(hidden_size=256, intermediate_size=128, num_experts=8, top_k=2, aux_loss_coef=0.01)
    layer = moeyard.MoE(cfg, backend=backend).cuda().bfloat16()
    x = torch.randn(4, 64, 256, device="cuda", dtype=torch.bfloat16)
    return layer, x, torch.randn_like(x)


def _step(layer, fn, x, dout):
    """``fn(x) -> (out, aux_loss)``, then backward (``.backward``: the reentrant checkpoint takes no
    ``autograd.grad``); the output, x's and every trained parameter's gradient."""
    xi = x.clone().requires_grad_()
    out, aux = fn(xi)
    layer.zero_grad(set_to_none=True)
    torch.autograd.backward([out, aux], [dout, torch.ones_like(aux)])
    grads = [xi.grad] + [p.grad for p in layer.parameters() if p.requires_grad]
    assert all(g is not None for g in grads)
    return [out.detach()] + grads


@pytest.mark.parametrize("backend", ["triton", "grouped_mm"])
def test_layer_compiles_fullgraph_inductor(backend):
    # the whole layer in bf16 under torch.compile's default backend (Inductor), one graph, compiled before any
    # eager call: outputs and gradients as eager's (triton: the kernels are the same custom ops; Inductor fuses
    # the rest; grouped_mm: torch's grouped GEMM, its feature probe run while tracing)
    layer, x, dout = _bf16_layer(backend)
    got = _step(layer, torch.compile(lambda x: layer(x, True), fullgraph=True), x, dout)
    want = _step(layer, lambda x: layer(x, True), x, dout)
    assert len(got) == len(want) == 5
    for a, b in zip(got, want, strict=True):
        assert b.float().abs().sum() > 0
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dynamic", [False, None])
@pytest.mark.parametrize("backend,lora", [("triton", False), ("grouped_mm", False), ("triton", True)])
def test_layer_compiles_for_varying_token_counts(backend, lora, dynamic):
    # one compiled layer called at several token counts (a model fed batches of varying size), outputs and
    # gradients as eager's at each. dynamic=False: a graph per shape. Default (None): the second shape recompiles
    # with dynamic shapes; torch 2.11's Inductor failed on that graph (KeyError in Scheduler.compute_ancestors,
    # pytorch/pytorch#189271) while the fused router's statistics buffer was 3-D (benchmarks/NOTES.md, round 32)
    torch._dynamo.reset()  # the layer's forward is one code object: earlier cases' graphs count to its recompile limit
    layer, _, _ = _bf16_layer(backend)
    if lora:  # LoRA r = 8 on both projections, base frozen, B factors nonzero
        layer.add_lora(8)
        with torch.no_grad():
            for adapter in layer.lora.values():
                adapter.lora_B.weight.normal_(0, 0.05)
    compiled = torch.compile(lambda x: layer(x, True), fullgraph=True, dynamic=dynamic)
    g = torch.Generator(device="cuda").manual_seed(1)
    for shape in ((4, 64, 256), (2, 5, 256), (3, 100, 256), (1, 1, 256)):
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
        dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
        got = _step(layer, compiled, x, dout)
        want = _step(layer, lambda x: layer(x, True), x, dout)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2, msg=lambda m, shape=shape: f"shape {shape}: {m}")


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_bf16(reentrant):
    # the layer under torch.utils.checkpoint on the GPU kernels (Gluon on sm_90): the recomputed forward saves
    # the same tensors, so output and every gradient are bit-identical to no checkpointing
    from torch.utils.checkpoint import checkpoint

    layer, x, dout = _bf16_layer()
    want = _step(layer, lambda x: layer(x, True), x, dout)
    got = _step(layer, lambda x: checkpoint(layer, x, True, use_reentrant=reentrant), x, dout)
    for a, b in zip(got, want, strict=True):
        assert b.float().abs().sum() > 0
        assert torch.equal(a, b)


def test_checkpointed_layer_compiles_inductor(monkeypatch):
    # a compiled, activation-checkpointed layer (torchtitan's arrangement of a block) with Inductor in bf16:
    # one graph, outputs and gradients as eager's (see the CPU test for the Dynamo switch)
    cfg = torch._dynamo.config
    if not hasattr(cfg, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        pytest.skip("this torch has no skip_fwd_side_effects_in_bwd_under_checkpoint")
    monkeypatch.setattr(cfg, "skip_fwd_side_effects_in_bwd_under_checkpoint", True)
    from torch.utils.checkpoint import checkpoint

    layer, x, dout = _bf16_layer()
    layer.keep_routing = False  # torch 2.11's Dynamo fails on the stored RoutingOutput inside the checkpoint

    def block(x):
        return checkpoint(layer, x, True, use_reentrant=False)

    got = _step(layer, torch.compile(block, fullgraph=True), x, dout)
    want = _step(layer, block, x, dout)
    assert layer.routing is None
    for a, b in zip(got, want, strict=True):
        assert b.float().abs().sum() > 0
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "T,K,E",
    [(1, 8, 128), (7, 8, 128), (64, 8, 128), (256, 8, 128), (2048, 1, 1022), (3, 4, 255), (33, 2, 256), (100, 6, 7)],
)
def test_one_launch_sort_on_cuda(T, K, E):
    """The one-launch sort of few pairs (``moeyard.dispatch_triton``, compiled) gives ``torch.sort``'s keys,
    stable order and offsets, invalid ids (negative, ``E`` and above) at the tail."""
    from moeyard import dispatch
    from moeyard.dispatch_triton import sort_by_expert_small

    ids = torch.randint(-2, E + 3, (T, K), device=DEV, generator=torch.Generator(DEV).manual_seed(T + E))
    want = dispatch._sort(dispatch._sort_keys(ids, E), E)
    got = sort_by_expert_small(ids, E, dispatch._key_dtype(E))
    for name, a, b in zip(("keys", "order", "offsets"), want, got, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.parametrize("T,K,E,align", [(1, 8, 128, 1), (256, 8, 128, 16), (4096, 8, 128, 1), (3000, 8, 256, 16)])
def test_plan_kernels_on_cuda(T, K, E, align):
    """``make_plan`` and ``plan_rows`` on their Triton kernels (compiled) against the torch path on the CPU:
    every field, invalid ids included, one-launch sort (few pairs) and ``torch.sort`` (many), with padding."""
    from moeyard.dispatch import make_plan, plan_rows

    g = torch.Generator().manual_seed(T + E)
    ids = torch.randint(-2, E + 3, (T, K), generator=g)
    w = torch.rand(T, K, generator=g, dtype=torch.bfloat16)
    want = make_plan(ids, E, align=align)  # CPU: the torch path (no interpreter in the CUDA tests)
    got = make_plan(ids.to(DEV), E, align=align)
    for name in ("tokens_per_expert", "expert_offsets", "padded_offsets", "sort_order", "pair_rows", "valid"):
        a, b = getattr(want, name), getattr(got, name)
        assert a.dtype == b.dtype and torch.equal(a, b.cpu()), name
    for name, a, b in zip(("row_tokens", "live_rows", "row_weights", "nan_terms"),
                          plan_rows(want, w, nan_terms=True), plan_rows(got, w.to(DEV), nan_terms=True),
                          strict=True):  # fmt: skip
        torch.testing.assert_close(b.cpu(), a, rtol=0, atol=0, equal_nan=True, msg=name)
