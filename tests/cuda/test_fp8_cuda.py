"""FP8 recipes on a CUDA GPU: the Triton casts bit-equal to the reference on the device (they cast
themselves there), the Hopper fast path of ``fp8_rowwise`` (``torch._scaled_grouped_mm``) against the
float64 ``loop`` oracle under the same recipe for the output and every gradient (judged against torch's
own bfloat16 error under the recipe; the fused form's gradients, rounded in another order, by their error
against the exact layer: see ``tests/test_fp8.py::_check_fused``), on the ``grouped_mm`` and ``triton``
backends, with empty experts, one hot expert, dropped pairs, LoRA on a frozen FP8 base; no host sync; a
CUDA graph capture."""

import pytest
import torch

import moeyard
from helpers import add_lora, assert_matches_oracle, make_inputs, run_experts
from moeyard.quant import fp8
from moeyard.quant.fp8 import Blocks

pytestmark = pytest.mark.cuda
DEV = "cuda"
FROZEN = ("gate_up_proj", "down_proj")


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _check(backend, inputs, recipe="fp8_rowwise", fused=False, **kw):
    T, H = inputs["hidden_states"].shape
    g = torch.randn(T, H, dtype=torch.float64)
    oracle = run_experts(inputs, torch.float64, "loop", g, recipe=recipe, **kw)
    lowp = run_experts(inputs, torch.bfloat16, "loop", g, device=DEV, recipe=recipe, **kw)
    got = run_experts(inputs, torch.bfloat16, backend, g, device=DEV, recipe=recipe, **kw)
    if not fused:
        assert_matches_oracle(got, lowp, oracle, torch.bfloat16, what=f"{backend} {recipe}")
        return
    assert_matches_oracle({"out": got["out"]}, {"out": lowp["out"]}, {"out": oracle["out"]}, torch.bfloat16)
    exact = run_experts(inputs, torch.float64, "loop", g, **kw)
    for k in exact:
        e_got = ((got[k] - exact[k]).norm() / exact[k].norm()).item()
        e_recipe = ((oracle[k] - exact[k]).norm() / exact[k].norm()).item()
        assert e_got <= 1.25 * e_recipe + 4e-3, f"{backend} fused {k}: err {e_got:.3g} > 1.25 * {e_recipe:.3g}"


@pytest.fixture(params=["auto", "triton", "cutlass"])
def fast_path_calls(monkeypatch, request):
    """The Hopper fast path's calls, with each choice of forward / input-gradient GEMM (``MOEYARD_FP8_GEMM``):
    "gemm" per FP8 grouped GEMM (Gluon, Triton or CUTLASS; the weight gradients' too), "fused" per fused FFN."""
    import importlib

    hop = importlib.import_module("moeyard.experts.scaled_hopper")
    grouped = importlib.import_module("moeyard.quant.fp8_grouped")
    wgrad = importlib.import_module("moeyard.quant.fp8_gluon_wgrad")
    calls = []
    real_mm, real_ffn, real_triton, real_wgrad = hop.scaled_grouped_mm, hop.routed_ffn, grouped.grouped_mm, wgrad.launch
    monkeypatch.setenv(hop.ENV_GEMM, request.param)
    monkeypatch.setattr(hop, "scaled_grouped_mm", lambda *a: calls.append("gemm") or real_mm(*a))
    monkeypatch.setattr(grouped, "grouped_mm", lambda *a, **k: calls.append("gemm") or real_triton(*a, **k))
    monkeypatch.setattr(hop, "routed_ffn", lambda *a, **k: calls.append("fused") or real_ffn(*a, **k))
    monkeypatch.setattr(wgrad, "launch", lambda *a: calls.append("gemm") or real_wgrad(*a))
    return calls


@pytest.mark.parametrize("M, K", [(1, 16), (4097, 2048), (333, 768), (65, 4096), (40, 12288)])
def test_rowwise_cast_on_device(M, K):
    from moeyard.quant import fp8_triton

    t = (torch.randn(M, K, device=DEV) * torch.logspace(-4, 4, K, device=DEV)).bfloat16()
    q, s = fp8_triton.rowwise(t)
    q_ref, s_ref = fp8.quantize(t, Blocks(None), "pow2")
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref[:, 0])


@pytest.mark.parametrize("I", [768, 2048, 3000])
def test_row_casts_of_the_activation_on_device(monkeypatch, I):
    # act(h) cast per row, read once (a row held whole) or twice (amax, then cast): the same bits; the
    # activation's backward kernel casting d h (as rowwise(d h)) and writing rw * act(h) (as act_rows)
    from moeyard.activations import Activation
    from moeyard.quant import fp8_triton

    act, R = Activation(name="swiglu"), 1000
    h = (torch.randn(R, 2 * I, device=DEV) * 3).bfloat16()
    rw, da = torch.rand(R, device=DEV) + 0.5, torch.randn(R, I, device=DEV).bfloat16()
    once = fp8_triton.rowwise(h, act, row_weights=rw), fp8_triton.act_rows(h, act, row_weights=rw)
    monkeypatch.setattr(fp8_triton, "ONE_PASS_ELEMENTS", 0)
    twice = fp8_triton.rowwise(h, act, row_weights=rw), fp8_triton.act_rows(h, act, row_weights=rw)
    assert torch.equal(once[0][0].view(torch.uint8), twice[0][0].view(torch.uint8))
    assert torch.equal(once[0][1], twice[0][1]) and torch.equal(once[1], twice[1])
    plain = fp8_triton.act_backward(h, da, act, row_weights=rw)
    both = fp8_triton.act_backward(h, da, act, row_weights=rw, quantize=True, with_act_rows=True)
    assert torch.equal(both.dh, plain.dh)
    # the row sums in the same order; the compiler may contract their products differently in the two variants
    torch.testing.assert_close(both.d_row_weights, plain.d_row_weights, rtol=1e-6, atol=1e-6)
    q, s = fp8_triton.rowwise(plain.dh)
    assert torch.equal(both.dh_fp8[0].view(torch.uint8), q.view(torch.uint8)) and torch.equal(both.dh_fp8[1], s)
    torch.testing.assert_close(both.act_rows, once[1], rtol=2**-8, atol=1e-6)  # one bf16 rounding apart at most
    # the cast written over da's memory: the same bits, in da's storage, and nothing else of the results moved
    da_copy = da.clone()
    over = fp8_triton.act_backward(h, da_copy, act, row_weights=rw, quantize=True, overwrite_da=True)
    assert over.dh_fp8[0].data_ptr() == da_copy.data_ptr()
    assert torch.equal(over.dh_fp8[0].view(torch.uint8), q.view(torch.uint8)) and torch.equal(over.dh_fp8[1], s)
    assert torch.equal(over.dh, plain.dh)
    torch.testing.assert_close(over.d_row_weights, both.d_row_weights, rtol=1e-6, atol=1e-6)


def test_colwise_casts_on_device():
    from moeyard.quant import fp8_colwise, fp8_triton

    R, N = 3000, 384
    t = (torch.randn(R, N, device=DEV) * torch.logspace(-3, 3, N, device=DEV)).bfloat16()
    off = torch.tensor([0, 0, 512, 2048, 2048, 2992], dtype=torch.int32, device=DEV)
    q, s = fp8_colwise.colwise_per_group(t, off)
    q_ref, s_ref = fp8.quantize(t.mT, Blocks(None), "pow2", off)
    assert torch.equal(q[:, :2992].view(torch.uint8), q_ref[:, :2992].view(torch.uint8))
    live = off.diff() > 0
    assert torch.equal(s[live], s_ref.mT[:-1][live])
    starts, width = fp8_colwise.padded_offsets(off, R, 128)  # the tile kernels: the same bytes and scales
    qp, sp = fp8_colwise.colwise_per_group(t, off, padded=(starts, width))
    assert torch.equal(sp, s)
    for g in range(5):
        a, b, p0, p1 = (int(v) for v in (off[g], off[g + 1], starts[g], starts[g + 1]))
        assert torch.equal(qp[:, p0 : p0 + b - a].view(torch.uint8), q[:, a:b].view(torch.uint8))
        assert (qp[:, p0 + b - a : p1].float() == 0).all()
    w = (torch.randn(5, 1000, 200, device=DEV) * torch.logspace(-3, 3, 200, device=DEV)).bfloat16()
    q_ref, s_ref = fp8.quantize(w.mT, Blocks(None), "pow2")
    for rows in (None, 16, 1024):  # the forward's cast with the columns' amax (atomic max over programs)
        qf, sf, amax = fp8_triton.rowwise_per_expert(w, rows=rows)
        qf_ref, sf_ref = fp8_triton.rowwise(w.view(-1, 200))
        assert torch.equal(qf.view(torch.uint8), qf_ref.view(5, 1000, 200).view(torch.uint8))
        assert torch.equal(sf, sf_ref.view(5, 1000)) and torch.equal(amax, w.float().abs().amax(1))
        for q, s in (fp8_triton.colwise_per_expert(w, amax), fp8_triton.colwise_per_expert(w)):
            assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref[..., 0])


@pytest.mark.parametrize("recipe", ["fp8_rowwise", "fp8_rowwise_gw_hp"])
@pytest.mark.parametrize("backend", ["grouped_mm", "triton"])
@pytest.mark.parametrize("case", ["base", "empty_experts", "one_hot_expert"])
def test_fast_path_matches_oracle(backend, case, recipe, fast_path_calls):
    T, H, I, E, K = 1024, 256, 128, 16, 4
    ids = None
    if case == "empty_experts":  # 12 of 16 experts receive nothing
        ids = torch.stack([torch.randperm(4)[:K] * 4 for _ in range(T)])
    elif case == "one_hot_expert":  # every token's first choice is expert 3
        ids = torch.stack([torch.cat([torch.tensor([3]), torch.randperm(E - 1)[: K - 1] + 4]) % E for _ in range(T)])
    inp = make_inputs(T, H, I, E, K, ids=ids)
    inp["hidden_states"][:, :3] *= 30  # outlier channels
    _check(backend, inp, recipe=recipe, fused=True)
    assert fast_path_calls.count("fused") == (1 if _hopper() else 0)
    fp8_gemms = 4 if recipe == "fp8_rowwise_gw_hp" else 6  # 2 forward, 2 dgrad (, 2 wgrad)
    assert fast_path_calls.count("gemm") == (fp8_gemms if _hopper() else 0)


@pytest.mark.parametrize(
    "recipe, frozen",
    [("fp8_rowwise", True), ("fp8_rowwise", False), ("fp8_rowwise_gw_hp", True), ("fp8_rowwise_gw_hp", False)],
)
@pytest.mark.parametrize("rank", [8, 16, 64])
def test_fast_path_lora(fast_path_calls, recipe, frozen, rank):
    # LoRA on an FP8 base: fused (the adapter terms inside the four FP8 GEMMs, on the Gluon kernel with auto)
    # except with cutlass (per projection); the output and every gradient against the exact layer
    import os

    inp = add_lora(make_inputs(1024, 256, 128, 8, 2), rank)
    inp["hidden_states"][:, :3] *= 30  # outlier channels
    fused = os.environ["MOEYARD_FP8_GEMM"] != "cutlass"  # a trained base's FP8 wgrads: padded casts, rows unpadded
    _check("triton", inp, recipe=recipe, fused=fused, frozen=FROZEN if frozen else ())
    if _hopper():
        assert fast_path_calls.count("fused") == fused
        fp8_gemms = 4 if frozen or recipe.endswith("gw_hp") else 6  # forward and dgrad (, FP8 wgrad)
        assert fast_path_calls.count("gemm") == fp8_gemms


@pytest.mark.parametrize("recipe", ["fp8_rowwise", "fp8_rowwise_gw_hp"])
def test_fast_path_up_dgrad_in_windows(fast_path_calls, monkeypatch, recipe):
    # the up projection's input gradient two column windows at a time (128 columns each, narrower than the
    # Gluon kernel's column tile): the same outputs and gradients as one window, bit for bit on moeyard's
    # GEMMs (a column's reduction does not depend on the others), and one GEMM more
    import importlib
    import os

    hop = importlib.import_module("moeyard.experts.scaled_hopper")
    inp = make_inputs(700, 256, 128, 8, 2)
    g = torch.randn(700, 256, dtype=torch.float64)
    monkeypatch.setattr(hop, "dgrad_windows", lambda *a: 1)
    whole = run_experts(inp, torch.bfloat16, "grouped_mm", g, device=DEV, recipe=recipe)
    before = fast_path_calls.count("gemm")
    monkeypatch.setattr(hop, "dgrad_windows", lambda *a: 2)
    monkeypatch.setattr(hop, "wgrad_windows", lambda *a: [(0, a[2])])  # the weight gradient's whole
    monkeypatch.setattr(hop, "WINDOW_COLS", 128)
    monkeypatch.setattr(hop, "MIN_WINDOW_ROWS", 128)
    windows = run_experts(inp, torch.bfloat16, "grouped_mm", g, device=DEV, recipe=recipe)
    if _hopper():
        assert fast_path_calls.count("gemm") == 2 * before + 1  # one GEMM more for the second window
    exact = os.environ[hop.ENV_GEMM] != "cutlass"
    for k in whole:
        if exact:
            assert torch.equal(windows[k], whole[k]), k
        else:
            err = ((windows[k] - whole[k]).norm() / whole[k].norm()).item()
            assert err < (4e-3 if k == "grad_hidden_states" else 1e-6), f"{k}: {err:.3g}"  # CUTLASS tiles by N


def test_fast_path_up_wgrad_in_windows(fast_path_calls, monkeypatch):
    # fp8_rowwise's up-projection weight gradient made two column windows of x at a time (256 columns each): the
    # same outputs and gradients as one window, bit for bit on the Gluon kernel (an output tile does not depend
    # on the others), and one GEMM more
    import importlib

    hop = importlib.import_module("moeyard.experts.scaled_hopper")
    inp = make_inputs(700, 512, 128, 8, 2)
    g = torch.randn(700, 512, dtype=torch.float64)
    monkeypatch.setattr(hop, "dgrad_windows", lambda *a: 1)
    monkeypatch.setattr(hop, "wgrad_windows", lambda *a: [(0, 512)])
    whole = run_experts(inp, torch.bfloat16, "grouped_mm", g, device=DEV, recipe="fp8_rowwise")
    before = fast_path_calls.count("gemm")
    monkeypatch.setattr(hop, "wgrad_windows", lambda *a: [(0, 256), (256, 512)])
    monkeypatch.setattr(hop, "MIN_WINDOW_ROWS", 128)
    windows = run_experts(inp, torch.bfloat16, "grouped_mm", g, device=DEV, recipe="fp8_rowwise")
    if _hopper():
        assert fast_path_calls.count("gemm") == 2 * before + 1  # one GEMM more for the second window
    for k in whole:
        assert torch.equal(windows[k], whole[k]), k


def test_fast_path_drop_invalid():
    inp = make_inputs(512, 128, 64, 8, 2)
    ids = inp["topk_ids"].clone()
    ids[::3, 1] = 8  # another rank's experts
    inp["topk_ids"] = ids
    _check("grouped_mm", inp, fused=True, drop_invalid=True)


@pytest.mark.parametrize("recipe", ["fp8_rowwise", "fp8_rowwise_gw_hp"])
def test_fast_path_invalid_ids_give_nan_rows(fast_path_calls, recipe):
    # an invalid id's pair carries a NaN weight (as moeyard.experts gives it): its token comes out NaN from
    # the combine's own sum (gathered_sum's row_terms), every other token exactly as with drop_invalid
    import importlib

    if not _hopper():
        pytest.skip("the fused FP8 path runs on Hopper")
    hop = importlib.import_module("moeyard.experts.scaled_hopper")
    from moeyard.activations import Activation
    from moeyard.experts.weights import expert_weights

    inp = make_inputs(512, 128, 64, 8, 2)
    x = inp["hidden_states"].to(DEV, torch.bfloat16)
    ids = inp["topk_ids"].clone().to(DEV)
    ids[::7, 1] = 8  # another rank's experts
    w = inp["topk_weights"].to(DEV, torch.bfloat16)
    up, down = (inp[k].to(DEV, torch.bfloat16) for k in FROZEN)
    weights = expert_weights(up, down, recipe=recipe)
    out = hop.routed_ffn(x, ids, w.masked_fill(ids >= 8, float("nan")), weights, Activation())
    kept = hop.routed_ffn(x, ids, w, weights, Activation(), drop_invalid=True)
    bad = (ids >= 8).any(1)
    assert "fused" in fast_path_calls
    assert out[bad].isnan().all() and not out[~bad].isnan().any()
    assert torch.equal(out[~bad], kept[~bad])


@pytest.mark.parametrize("recipe", ["fp8_blockwise", "mxfp8"])
def test_emulated_recipes_on_device(recipe):
    with pytest.warns(UserWarning, match="emulated"):
        _check("grouped_mm", make_inputs(256, 128, 64, 8, 2), recipe=recipe)


def test_no_host_sync_and_cuda_graph():
    if not _hopper():
        pytest.skip("the fast path needs SM 9.0")
    cfg = moeyard.MoEConfig(num_experts=16, hidden_size=256, intermediate_size=128, top_k=4)
    moe = moeyard.MoE(cfg, backend="triton", recipe="fp8_rowwise", device=DEV, dtype=torch.bfloat16)
    x = torch.randn(2048, 256, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    moe(x).backward(dy)  # warm-up (compiles)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe(x).backward(dy)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    moe.aux_loss = moe.routing = None
    for p in moe.parameters():
        p.grad = None
    x.grad = None
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        moe(x).backward(dy)
        moe.aux_loss = moe.routing = None
    torch.cuda.current_stream().wait_stream(s)
    ref_grad = moe.gate_up_proj.grad.clone()
    graph = torch.cuda.CUDAGraph()
    for p in moe.parameters():
        p.grad = None
    x.grad = None
    with torch.cuda.graph(graph):
        y = moe(x)
        y.backward(dy)
    moe.aux_loss = moe.routing = None
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(y).all()
    torch.testing.assert_close(moe.gate_up_proj.grad, ref_grad, rtol=0, atol=0)


@pytest.mark.parametrize("lora", [False, True])
def test_fast_path_reads_nf4_storage(fast_path_calls, monkeypatch, lora):
    # QLoRA on an FP8 base: the weight casts decode NF4 storage in their loads, no dense weight written; the
    # output and every gradient bit-equal to the layer on the dequantised weights (experts 5 and 6 get no
    # token: not cast), and no host sync
    import os

    pytest.importorskip("bitsandbytes")
    if not _hopper():
        pytest.skip("the fast path needs SM 9.0")
    if lora and os.environ["MOEYARD_FP8_GEMM"] == "cutlass":
        pytest.skip("LoRA layers run per projection with the cutlass GEMM")
    from helpers import lora_arg, random_ids
    from moeyard.quant import NF4Experts

    T, H, I, E, K = 2048, 512, 384, 8, 2
    inp = make_inputs(T, H, I, E, K, ids=random_ids(T, K, E, experts=[0, 1, 2, 3, 4, 7]))
    inp = add_lora(inp, 16) if lora else inp
    bf = torch.bfloat16
    stored = {k: NF4Experts.from_float(inp[k].to(DEV, bf)) for k in ("gate_up_proj", "down_proj")}
    dense = {k: v.dequantize() for k, v in stored.items()}
    monkeypatch.setenv("MOEYARD_FP8_NF4", "codes")
    calls, real = [], NF4Experts.dequantize
    monkeypatch.setattr(NF4Experts, "dequantize", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    g = torch.randn(T, H, device=DEV, dtype=bf)
    ids = inp["topk_ids"].to(DEV)

    def run(weights, sync_check=False):
        x = inp["hidden_states"].to(DEV, bf).requires_grad_()
        tw = inp["topk_weights"].to(DEV, bf).requires_grad_()
        factors = {k: v.to(DEV, bf).requires_grad_() for k, v in inp.items() if ".lora_" in k}
        up, down = weights["gate_up_proj"], weights["down_proj"]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if sync_check else 0)
        try:
            out = moeyard.experts(
                x, ids, tw, up, down, backend="triton", recipe="fp8_rowwise", lora=lora_arg(factors), check_ids=False
            )
            out.backward(g)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        return {"out": out, "x": x.grad, "topk_weights": tw.grad, **{k: v.grad for k, v in factors.items()}}

    want = run(dense)
    calls.clear()
    run(stored)  # warm-up: compiles the NF4 casts
    got = run(stored, sync_check=True)
    assert not calls and fast_path_calls.count("fused") == 3
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")


def test_lora_on_fp8_base_no_host_sync_and_cuda_graph():
    # the fused LoRA form (adapter terms in the FP8 GEMMs, the triton backend's thin GEMMs) syncs nothing
    # and captures: a replay gives the eager step's factor gradients bit for bit
    if not _hopper():
        pytest.skip("the fast path needs SM 9.0")
    cfg = moeyard.MoEConfig(num_experts=16, hidden_size=256, intermediate_size=128, top_k=4)
    moe = moeyard.MoE(cfg, backend="triton", recipe="fp8_rowwise_gw_hp", device=DEV, dtype=torch.bfloat16)
    moe.add_lora(16)
    with torch.no_grad():
        for adapter in moe.lora.values():
            adapter.lora_B.weight.normal_()
    x = torch.randn(2048, 256, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    trained = [p for p in moe.parameters() if p.requires_grad]

    def step():
        for p in trained:
            p.grad = None
        x.grad = None
        moe(x).backward(dy)
        moe.aux_loss = moe.routing = None

    step()  # warm-up (compiles, autotunes)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    ref = [p.grad.clone() for p in trained]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    for p in trained:
        p.grad = None
    x.grad = None
    with torch.cuda.graph(graph):
        moe(x).backward(dy)
    moe.aux_loss = moe.routing = None
    graph.replay()
    torch.cuda.synchronize()
    for p, want in zip(trained, ref, strict=True):
        torch.testing.assert_close(p.grad, want, rtol=0, atol=0)


@pytest.mark.parametrize("recipe", ["fp8_rowwise", "fp8_rowwise_gw_hp"])
def test_cache_fp8_weights_on_device(monkeypatch, recipe):
    # moeyard.cache_fp8_weights(): three steps cast each weight once per kind, bit-equal to casting every call
    if not _hopper():
        pytest.skip("the fast path needs SM 9.0")
    from moeyard.quant import fp8_triton

    cfg = moeyard.MoEConfig(num_experts=16, hidden_size=256, intermediate_size=128, top_k=4)
    moe = moeyard.MoE(cfg, backend="triton", recipe=recipe, device=DEV, dtype=torch.bfloat16)
    x = torch.randn(2048, 256, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        for t in (x, *moe.parameters()):
            t.grad = None
        y = moe(x)
        y.backward(dy)
        return [y.detach(), x.grad.clone(), moe.gate_up_proj.grad.clone(), moe.down_proj.grad.clone()]

    plain = step()
    calls = []
    real = fp8_triton.colwise_per_expert
    monkeypatch.setattr(fp8_triton, "colwise_per_expert", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    with moeyard.cache_fp8_weights():
        cached = [step() for _ in range(3)]
    assert len(calls) == 2  # the two weights' transposed casts, once for the three steps
    for got in cached:
        assert all(torch.equal(a, b) for a, b in zip(got, plain, strict=True))


@pytest.mark.parametrize("case", ["gpt_oss", "gelu", "lora_down"])
def test_fast_path_activations(case):
    # the down projection with the activation fused (gpt-oss: clamped SwiGLU, interleaved, biases; a plain
    # activation), and unfused where the down projection has a LoRA term
    if case == "gpt_oss":  # the down bias takes the per-projection form
        inp = make_inputs(512, 128, 64, 8, 2, bias=True, transposed=True)
        _check("grouped_mm", inp, transposed=True, interleaved=True, activation="clamped_swiglu")
    elif case == "gelu":
        _check("triton", make_inputs(512, 128, 64, 8, 2, gated=False), fused=True, activation="gelu")
    else:
        _check("triton", add_lora(make_inputs(512, 128, 64, 8, 2), 8, projections=("down_proj",)), frozen=FROZEN)


@pytest.mark.parametrize("N, H", [(1, 16), (4099, 2048), (777, 7168)])
def test_fp8_dispatch_packed_rows_on_device(N, H):
    # FP8 dispatch's packed rows: the Triton pack and unpack against the torch reference, bit for bit
    from moeyard.parallel import fp8_rows

    x = (torch.randn(N, H, device=DEV) * torch.logspace(-3, 3, H, device=DEV)).bfloat16()
    x[: N // 3] = 0
    want = fp8_rows.pack_reference(x)
    got = fp8_rows.pack(x)
    assert torch.equal(got, want)
    assert torch.equal(fp8_rows.unpack(got, H, torch.bfloat16), fp8_rows.unpack_reference(want, H, torch.bfloat16))


@pytest.mark.parametrize("dw_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("counts, NL, NR", [([0, 37, 1, 600, 128, 0, 2000, 129], 1536, 2048), ([5, 300], 200, 72)])
def test_gluon_fp8_wgrad_matches_float64(counts, NL, NR, dw_dtype):
    """moeyard.quant.fp8_gluon_wgrad on the padded column casts against float64 on the dequantised operands
    (within fast accumulation's error, and the output's rounding): empty experts, counts that are not multiples
    of 16 or 128, partial tiles of NL and NR."""
    if not _hopper():
        pytest.skip("the Gluon kernel needs sm_90")
    from moeyard.quant import fp8_colwise, fp8_gluon_wgrad

    torch.manual_seed(0)
    offsets = torch.tensor([0] + counts, device=DEV).cumsum(0).to(torch.int32)
    R = int(offsets[-1])
    dy, x = torch.randn(R, NL, device=DEV), torch.randn(R, NR, device=DEV)
    dy[:, :3] *= 50  # outlier columns
    starts = fp8_colwise.padded_offsets(offsets, R, fp8_gluon_wgrad.BK)
    (lq, ls), (rq, rs) = (fp8_colwise.colwise_per_group(t, offsets, padded=starts) for t in (dy, x))
    dw = torch.full((len(counts), NL, NR), float("nan"), device=DEV, dtype=dw_dtype)
    assert fp8_gluon_wgrad.ready(lq, rq, dw.dtype, dw.shape[0])
    assert not fp8_gluon_wgrad.ready(lq, rq, dw.dtype, 0) and not fp8_gluon_wgrad.ready(lq, rq, torch.int32, 1)
    fp8_gluon_wgrad.launch(lq, ls, rq, rs, starts[0], dw)
    ref = torch.zeros(len(counts), NL, NR, dtype=torch.float64, device=DEV)
    for e in range(len(counts)):
        a, b, p = int(offsets[e]), int(offsets[e + 1]), int(starts[0][e])
        lo = lq[:, p : p + b - a].double() * ls[e].double()[:, None]
        ro = rq[:, p : p + b - a].double() * rs[e].double()[:, None]
        ref[e] = lo @ ro.mT
    assert torch.isfinite(dw).all()
    for e, n in enumerate(counts):
        if n == 0:
            assert (dw[e] == 0).all()
    bound = 4e-3 if dw_dtype == torch.bfloat16 else 2e-3
    for e, n in enumerate(counts):  # each expert's tile on its own: a tile of another expert's rows fails here
        if n:
            err = ((dw[e].double() - ref[e]).norm() / ref[e].norm()).item()
            assert err <= bound, (e, err)


def test_layer_fp8_rowwise_with_the_gluon_wgrad(monkeypatch):
    """fp8_rowwise's fused form with MOEYARD_FP8_WGRAD=gluon (unpadded rows) against cutlass (rows padded per
    expert): output and input gradients alike, the weight gradients within the fast accumulation's error."""
    if not _hopper():
        pytest.skip("the Gluon kernel needs sm_90")
    torch.manual_seed(3)
    inputs = make_inputs(512, 256, 128, 8, 2)

    def grads():
        g = torch.randn(512, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        return run_experts(inputs, torch.bfloat16, "triton", g, device=DEV, recipe="fp8_rowwise")

    monkeypatch.setenv("MOEYARD_FP8_WGRAD", "cutlass")
    want = grads()
    monkeypatch.setenv("MOEYARD_FP8_WGRAD", "gluon")
    got = grads()
    for k in want:
        if k in ("grad_gate_up_proj", "grad_down_proj"):
            assert ((got[k].double() - want[k].double()).norm() / want[k].double().norm()).item() < 1e-2, k
        else:
            torch.testing.assert_close(got[k], want[k], msg=k)  # the GEMMs' tiles cover other rows: bf16's tolerance
