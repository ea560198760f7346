"""LoRA on the expert projections on a CUDA GPU: bfloat16 parity of the ``triton`` (split and fused)
and ``grouped_mm`` backends with the float64 ``loop`` oracle for the output and every gradient
(x, routing weights, both factors of both projections; base frozen), judged against torch's own
bfloat16 error; ranks 1..64 with ``r*E`` a multiple of no tile, empty experts and one hot expert; no
host sync and a CUDA graph capture of the LoRA forward + backward; PEFT parity on the GPU."""

import pytest
import torch

import moeyard
from helpers import add_lora, check_backend, make_inputs, nan_fill_empty, run_experts

pytestmark = pytest.mark.cuda
DEV = "cuda"
FROZEN = ("gate_up_proj", "down_proj")


@pytest.mark.parametrize("mode", ["split", "fused"])
@pytest.mark.parametrize("rank", [1, 5, 16, 64])  # 1, 5: r*E a multiple of no tile; 64: the largest register tile
def test_triton_bf16(mode, rank):
    from moeyard.experts.triton.options import use_options

    inp = add_lora(make_inputs(700, 256, 192, 12, 4), rank)
    with use_options(lora_mode=mode):
        check_backend("triton", inp, torch.bfloat16, device=DEV, frozen=FROZEN)


@pytest.mark.parametrize("rank", [8, 16])
def test_grouped_mm_bf16(rank):
    check_backend(
        "grouped_mm", add_lora(make_inputs(700, 256, 192, 12, 4), rank), torch.bfloat16, device=DEV, frozen=FROZEN
    )


@pytest.mark.parametrize("case", ["one_hot_expert", "gpt_oss", "trainable_base"])
def test_triton_edge_cases(case):
    E, K = 9, 2
    if case == "one_hot_expert":  # every token to experts 0 and 1: seven empty experts, two long ones
        inp = add_lora(make_inputs(900, 128, 64, E, K, ids=torch.stack([torch.arange(K)] * 900)), 16)
        check_backend("triton", inp, torch.bfloat16, device=DEV, frozen=FROZEN)
    elif case == "gpt_oss":
        inp = add_lora(make_inputs(300, 128, 64, E, K, bias=True, transposed=True), 16)
        check_backend(
            "triton",
            inp,
            torch.bfloat16,
            device=DEV,
            frozen=FROZEN,
            activation="clamped_swiglu",
            transposed=True,
            interleaved=True,
        )
    else:
        check_backend("triton", add_lora(make_inputs(300, 128, 64, E, K, bias=True), 16), torch.bfloat16, device=DEV)


@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize(
    "case", ["ragged", "one_hot_expert", "bias", "rank24", "frozen", "frozen_base_trained", "one_k_step"]
)
def test_gluon_down_projection(case, block_m, monkeypatch):
    """The warp-specialised Gluon down projection (sm_90), with one consumer warp group (row tiles of 64)
    and two (128): it runs for the forward and the input gradient, and every output and gradient
    matches the oracle. Cases: outputs and K not multiples of the tile (H 320, I 200: a 64-wide last
    column tile, a 8-wide last K step), rank 8 (half the padded box), empty experts and three long ones,
    biases, rank 24 (padded to 32), no LoRA term (base frozen, and base trained: its weight gradients
    too), reductions of one and two K steps (I 40: 40 and 80)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel is for sm_90")
    from moeyard.experts.triton import kernels_gluon, ops

    calls = []
    real = kernels_gluon.launch
    monkeypatch.setattr(kernels_gluon, "launch", lambda *a, **k: (calls.append(a[-2]), real(*a, **k)))
    monkeypatch.setattr(ops, "tma_block_m", lambda: block_m)  # the tile table's rows and the kernel's BM
    E, K = 10, 3
    if case == "ragged":
        inp = add_lora(make_inputs(777, 320, 200, E, K), 8)
    elif case == "one_hot_expert":
        inp = add_lora(make_inputs(600, 256, 192, E, K, ids=torch.stack([torch.arange(K)] * 600)), 16)
    elif case == "bias":
        inp = add_lora(make_inputs(500, 256, 192, E, K, bias=True), 16)
    elif case == "rank24":
        inp = add_lora(make_inputs(500, 256, 256, E, K), 24)
    elif case == "one_k_step":
        inp = add_lora(make_inputs(300, 256, 40, E, K), 16)
    else:
        inp = make_inputs(777, 320, 200, E, K, bias=True)
    check_backend("triton", inp, torch.bfloat16, device=DEV, frozen=() if case == "frozen_base_trained" else FROZEN)
    assert calls == [block_m, block_m], "the forward and the input gradient each launch the Gluon kernel once"


@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize(
    "case",
    [
        "ragged",
        "one_hot_expert",
        "bias",
        "rank24",
        "frozen",
        "frozen_base_trained",
        "one_k_step",
        "reglu",
        "gelu",
        "float16",
        "geglu",
        "three_programs",
    ],
)
def test_gluon_gathered_gemms(case, block_m, monkeypatch):
    """The warp-specialised Gluon kernels that gather rows by token (sm_90: loader warps copying the rows with
    ``cp.async``, the weight through TMA), the up projection and the activation gradient, with one consumer
    warp group (row tiles of 64) and two (128): each runs once per step, and every output and gradient
    matches the oracle (backward reads the ``h`` the up projection stored), every buffer poisoned with NaN
    first. Cases: outputs and K not multiples of the tile (H 336, I 200: a 72-wide last column tile, a
    16-wide last K step), rank 8, empty experts and three long ones, rank 24 (padded to 32), no LoRA term
    (base frozen, and base trained), a reduction of one K step (H 48), ReGLU, a plain (not gated) GELU,
    float16; three programs for 60-odd tiles (each runs many tiles through the same rings); biases (the activation gradient stays with the Triton kernel:
    the down bias's gradient term is not in the Gluon one) and GeGLU (both stay)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels are for sm_90")
    from moeyard.experts.triton import kernels_gluon_gather as gather, ops

    nan_fill_empty(monkeypatch)
    calls = {"up": [], "dh": []}
    for kind in calls:
        real = getattr(gather, f"launch_{kind}")
        monkeypatch.setattr(
            gather,
            f"launch_{kind}",
            lambda *a, _real=real, _kind=kind, **k: (calls[_kind].append(a[-2]), _real(*a, **k)),
        )
    monkeypatch.setattr(ops, "tma_block_m", lambda: block_m)  # the tile table's rows and the kernel's BM
    if case == "three_programs":
        monkeypatch.setattr(ops, "num_sms", lambda device: 3)
    E, K = 10, 3
    kw, dtype, frozen = {}, torch.bfloat16, FROZEN
    if case in ("ragged", "three_programs"):
        inp = add_lora(make_inputs(777, 336, 200, E, K), 8)
    elif case == "one_hot_expert":
        inp = add_lora(make_inputs(600, 256, 192, E, K, ids=torch.stack([torch.arange(K)] * 600)), 16)
    elif case == "bias":
        inp = add_lora(make_inputs(500, 256, 192, E, K, bias=True), 16)
    elif case == "rank24":
        inp = add_lora(make_inputs(500, 256, 256, E, K), 24)
    elif case == "one_k_step":
        inp = add_lora(make_inputs(300, 48, 128, E, K), 16)
    elif case in ("reglu", "geglu", "float16"):
        inp = add_lora(make_inputs(500, 256, 192, E, K), 16)
        kw = {"activation": case} if case != "float16" else {}
        dtype = torch.float16 if case == "float16" else dtype
    elif case == "gelu":
        inp = add_lora(make_inputs(500, 256, 192, E, K, gated=False), 16, gated=False)
        kw = {"activation": "gelu"}
    else:
        inp = make_inputs(777, 336, 200, E, K)
        frozen = () if case == "frozen_base_trained" else FROZEN
    check_backend("triton", inp, dtype, device=DEV, frozen=frozen, **kw)
    assert calls["up"] == ([] if case == "geglu" else [block_m]), "the forward launches the Gluon up projection once"
    assert calls["dh"] == ([] if case in ("geglu", "bias") else [block_m]), "backward launches the Gluon dh once"


@pytest.mark.parametrize("rank", [8, 16, 32])
def test_gluon_gathered_against_triton(rank, monkeypatch):
    """The Gluon up projection and activation gradient against the Triton kernels on the same operands (``h``,
    ``a``; ``d_h``, ``w act(h)``, the routing weights' gradient): LoRA's ``Lb`` with its unit stride along
    the rank and along the outputs, the down weight in transformers' ``[E, H, I]`` layout and transposed
    (both layouts the kernels take), ranks 8 to 32 (one to two 16-wide boxes, and the up projection's
    three-stage ring), 2000 tokens over 40 experts, K = 6; the second layout on 7 programs (40-odd tiles
    each)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels are for sm_90")
    from moeyard.experts.triton import kernels_gluon_gather as gather, ops
    from moeyard.experts.triton.options import use_options

    calls = []
    for kind in ("up", "dh"):
        real = getattr(gather, f"launch_{kind}")
        monkeypatch.setattr(
            gather, f"launch_{kind}", lambda *a, _real=real, _kind=kind, **k: (calls.append(_kind), _real(*a, **k))
        )
    g = torch.Generator(device=DEV).manual_seed(rank)
    T, H, I, E, K = 2000, 512, 384, 40, 6
    rand = lambda *shape, scale=1.0: (torch.randn(*shape, device=DEV, generator=g) * scale).bfloat16()  # noqa: E731
    x, dout = rand(T, H), rand(T, H)
    w_up, w_down = rand(E, 2 * I, H, scale=H**-0.5), rand(E, H, I, scale=I**-0.5)
    up = ops.LoRATerm(la=rand(E, H, rank, scale=H**-0.5), lb=rand(E, 2 * I, rank), scale=0.5)
    down = ops.LoRATerm(la=rand(E, H, rank, scale=H**-0.5), lb=rand(E, I, rank), scale=0.5)
    tw = torch.rand(T * K, device=DEV, generator=g).bfloat16()
    r = ops.routing(torch.randint(0, E, (T, K), device=DEV, generator=g), E)
    spec = ops.ActSpec(name="swiglu")

    def both(lb_layout, w_layout):
        h, a, _ = ops.up_proj(
            x, w_up, None, r, spec, store_h=True, lora=ops.LoRATerm(la=up.la, lb=lb_layout(up.lb), scale=0.5)
        )
        dh, aw, dtw, _ = ops.act_grad(
            dout,
            w_layout(w_down),
            None,
            h,
            tw,
            r,
            spec,
            lora=ops.LoRATerm(la=down.la, lb=lb_layout(down.lb), scale=0.5),
        )
        return h, a, dh, aw, dtw

    same = lambda t: t  # noqa: E731
    with use_options(gluon_up=False, gluon_dh=False):
        want = both(same, same)
    assert not calls
    rank_major = lambda t: t.mT.contiguous().mT  # noqa: E731
    sms = ops.num_sms
    for lb_layout, w_layout, programs in ((same, same, None), (rank_major, rank_major, 7)):
        monkeypatch.setattr(ops, "num_sms", lambda device, programs=programs: programs or sms(device))
        with use_options(gluon_up=True, gluon_dh=True):
            got = both(lb_layout, w_layout)
        for g_, ref in zip(got, want, strict=True):  # a wrong layout or row is off by the values' own size
            assert (g_.float() - ref.float()).abs().max() <= 0.02 * ref.float().abs().max()
    assert calls == ["up", "dh", "up", "dh"]


@pytest.mark.parametrize("by_token", [True, False])
@pytest.mark.parametrize("chunk", [0, 96])
def test_wgrad_rows_bf16(by_token, chunk):
    """``dB`` and the rows ``d_y B_e`` from one pass over ``d_y`` (the split mode's backward), autotuned:
    NL 640 (three 256-wide partials, the last 128 wide), rank 16, one long expert cut into chunks and
    empty ones; against float64, within bfloat16 rounding of the inputs' products."""
    from moeyard.experts.triton import ops
    from moeyard.experts.triton.options import use_options

    T, K, E, NL, R = 600, 2, 9, 640, 16
    topk = torch.stack([torch.tensor([0, 1 + i % 4]) for i in range(T)]).to(DEV)  # experts 5..8 empty
    r = ops.routing(topk, E)
    N = T * K
    lhs = torch.randn(T if by_token else N, NL, device=DEV).bfloat16()
    zw, factor = torch.randn(N, R, device=DEV).bfloat16(), torch.randn(E, NL, R, device=DEV).bfloat16()
    with use_options(wgrad_chunk_rows=chunk):
        dw, rows = ops.wgrad_rows(lhs, zw, factor, lhs_by_token=by_token, r=r)
    ell = lhs.double()[r.sort_order // K] if by_token else lhs.double()
    expert = topk.reshape(-1)[r.sort_order]
    want_rows = torch.einsum("nl,nlr->nr", ell, factor.double()[expert])
    want_dw = torch.stack([ell[expert == e].T @ zw.double()[expert == e] for e in range(E)])
    for got, want in ((rows, want_rows), (dw, want_dw)):
        err = (got.double() - want).norm() / want.norm()
        assert got.dtype == torch.bfloat16 and err < 1e-2, err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lora_b_relayout_kernel(dtype):
    """lora_B's expert-major relayout through the Triton transpose (forward and gradient), exact."""
    from moeyard.experts.relayout import expert_major

    out, r, E = 1000, 16, 37
    B = torch.randn(out, r * E, device=DEV, requires_grad=True)
    b = expert_major(B, r, E, dtype)
    assert torch.equal(b, B.detach().view(out, r, E).permute(2, 0, 1).to(dtype)) and b.is_contiguous()
    g = torch.randn(E, out, r, device=DEV, dtype=dtype)
    (grad,) = torch.autograd.grad(b, B, g)
    assert grad.dtype == torch.float32 and torch.equal(grad, g.float().permute(1, 2, 0).reshape(out, r * E))


def _leaves(seed=0):
    g = torch.Generator().manual_seed(seed)
    inp = add_lora(make_inputs(512, 256, 128, 16, 4), 16)
    leaves = {k: (v.to(DEV, torch.bfloat16) if v.is_floating_point() else v.to(DEV)) for k, v in inp.items()}
    for k in leaves:
        if ".lora_" in k or k == "hidden_states":
            leaves[k] = leaves[k].detach().requires_grad_()
    dout = torch.randn(512, 256, generator=g).to(DEV, torch.bfloat16)
    return leaves, dout


def _step(leaves, dout):
    lora = {
        n: moeyard.ExpertLoRA(lora_A=leaves[f"{n}.lora_A"], lora_B=leaves[f"{n}.lora_B"], scaling=0.5) for n in FROZEN
    }
    out = moeyard.experts(
        leaves["hidden_states"],
        leaves["topk_ids"],
        leaves["topk_weights"],
        leaves["gate_up_proj"],
        leaves["down_proj"],
        backend="triton",
        lora=lora,
    )
    train = [v for k, v in leaves.items() if v.requires_grad]
    return [out.detach()] + list(torch.autograd.grad(out, train, dout))


@pytest.mark.parametrize("mode", ["split", "fused"])
def test_no_host_sync(mode):
    from moeyard.experts.triton.options import use_options

    leaves, dout = _leaves()
    with use_options(lora_mode=mode):
        _step(leaves, dout)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            _step(leaves, dout)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_cuda_graph():
    leaves, dout = _leaves()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _step(leaves, dout)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = _step(leaves, dout)
    fresh, fresh_dout = _leaves(seed=1)
    with torch.no_grad():
        for k in leaves:
            leaves[k].copy_(fresh[k])
    dout.copy_(fresh_dout)
    graph.replay()
    want = _step(leaves, dout)
    for s, w in zip(static, want, strict=True):
        torch.testing.assert_close(s, w, rtol=0, atol=0)


@pytest.mark.parametrize("fuse", [False, True], ids=["auto", "fuse_lora"])
def test_peft_parity(fuse):
    pytest.importorskip("peft")
    from moeyard import verify
    from moeyard.integrations.transformers import register

    register()
    with verify.quiet_transformers():
        results = verify.check_arch(
            verify.ARCHS["qwen3_moe"],
            ["triton", "grouped_mm"],
            device=DEV,
            dtype=torch.float32,
            lora_rank=8,
            fuse_lora=fuse,
        )
    assert all(r.status == "pass" for r in results), results


def test_frozen_base_grad_is_none():
    inp = add_lora(make_inputs(64, 64, 32, 4, 2), 4)
    run_experts(inp, torch.bfloat16, "triton", torch.randn(64, 64, dtype=torch.float64), device=DEV, frozen=FROZEN)
