"""The fused Triton router (:mod:`moeyard.routing.fused`) under Triton's CPU interpreter (float32)
against the torch path of :func:`moeyard.routing.route`: every output, every loss, and the
gradients of x, the weight and the bias, for each routing scheme and the edge cases of a tiled
kernel (E not a power of two, T not a multiple of BM, K = 1, K = E, T = 0, several sequences).
Buffers the kernels fill are poisoned (NaN / -7) so an unwritten element shows.

Legend: T tokens, H hidden, E experts, K top-k, B sequences.
"""

import os

import pytest
import torch

pytest.importorskip("triton")

from moeyard import MoEConfig  # noqa: E402
from moeyard.routing import fused, route, use_router  # noqa: E402
from moeyard.routing.options import ENV, router_impl  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tests run under Triton's interpreter"
)
H = 64
COEFS = dict(aux_loss_coef=0.3, seq_aux_loss_coef=0.2, z_loss_coef=0.1)
FIELDS = ("topk_weights", "router_logits", "scores", "aux_loss", "seq_aux_loss", "z_loss", "loss")


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    real = fused.empty

    def poisoned(shape, *, device, dtype):
        return real(shape, device=device, dtype=dtype).fill_(-7 if not dtype.is_floating_point else float("nan"))

    monkeypatch.setattr(fused, "empty", poisoned)


def _problem(T, E, K, *, seed=0, **kw):
    cfg = MoEConfig(num_experts=E, hidden_size=H, intermediate_size=8, top_k=K, **COEFS, **kw)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w = torch.randn(E, H, generator=g) / H**0.5
    bias = torch.randn(E, generator=g) * 0.3 if cfg.router_bias else None
    corr = torch.randn(E, generator=g) * 0.05 if cfg.score_correction_bias else None
    return cfg, x, w, bias, corr


def _run(fn, cfg, x, w, bias, corr, B=1, dtype=torch.float32, use=FIELDS):
    """Outputs and the gradients of x, weight, bias for a fixed random weighting of the ``use`` outputs."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (x, w) + ((bias,) if bias is not None else ())]
    out = fn(
        leaves[0], leaves[1], cfg, bias=leaves[2] if bias is not None else None, correction_bias=corr, num_sequences=B
    )
    g = torch.Generator().manual_seed(1)
    total = sum((getattr(out, n) * torch.randn(getattr(out, n).shape, generator=g, dtype=dtype)).sum() for n in use)
    grads = torch.autograd.grad(total, leaves) if total.requires_grad else [torch.zeros_like(t) for t in leaves]
    return out, grads


def _compare(cfg, x, w, bias, corr, B=1, use=FIELDS):
    got, g_got = _run(fused.route_fused, cfg, x, w, bias, corr, B, use=use)
    want, g_want = _run(route, cfg, x, w, bias, corr, B, use=use)
    assert got.topk_ids.dtype == torch.int64 and torch.equal(got.topk_ids, want.topk_ids)
    assert torch.equal(got.tokens_per_expert, want.tokens_per_expert)
    assert not got.tokens_per_expert.requires_grad
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == torch.float32 and a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6, msg=name)
    for name, a, b in zip(("x", "weight", "bias")[: len(g_got)], g_got, g_want, strict=True):
        assert a.shape == b.shape and not a.isnan().any(), name
        err = ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
        assert err < 2e-5, f"d {name}: relative error {err:.2e}"


CASES = [
    pytest.param(dict(T=200, E=64, K=8), id="qwen3_softmax_renorm"),
    pytest.param(dict(T=200, E=60, K=4, norm_topk_prob=False), id="olmoe_E60_no_renorm"),
    pytest.param(
        dict(T=150, E=32, K=4, score_func="sigmoid", score_correction_bias=True, routed_scaling_factor=2.5),
        id="sigmoid_correction_scaled",
    ),
    pytest.param(dict(T=100, E=24, K=3, score_func="sigmoid", norm_topk_prob=False), id="sigmoid_raw"),
    pytest.param(dict(T=120, E=32, K=4, topk_before_score=True, router_bias=True), id="gpt_oss_topk_first"),
    pytest.param(
        dict(T=64, E=16, K=1, score_func="sigmoid", topk_before_score=True, norm_topk_prob=False),
        id="llama4_top1_sigmoid",
    ),
    pytest.param(dict(T=64, E=12, K=2, score_func="sigmoid", topk_before_score=True), id="sigmoid_topk_first_renorm"),
    pytest.param(dict(T=80, E=40, K=1), id="K1"),
    pytest.param(dict(T=40, E=8, K=8, routed_scaling_factor=1.5), id="K_eq_E"),
    pytest.param(dict(T=40, E=5, K=5, score_func="sigmoid", score_correction_bias=True), id="K_eq_E_sigmoid"),
    pytest.param(dict(T=8, E=1, K=1), id="E1"),
    pytest.param(dict(T=6, E=256, K=8), id="E256"),
]


@pytest.mark.parametrize("B", [1, 4], ids=["B1", "B4"])
@pytest.mark.parametrize("kw", CASES)
def test_matches_torch_path(kw, B):
    kw = dict(kw)
    T, E, K = kw.pop("T"), kw.pop("E"), kw.pop("K")
    if T % B:
        B = 2
    _compare(*_problem(T, E, K, **kw), B=B)


@pytest.mark.parametrize("use", [("topk_weights",), ("loss",), ("scores",), ("router_logits", "z_loss")])
def test_gradient_of_some_outputs(use):
    """Unused outputs reach the backward as None; each gradient term alone is right."""
    _compare(*_problem(70, 20, 3, score_func="sigmoid", score_correction_bias=True), B=2, use=use)


def test_strided_inputs_not_modified():
    cfg, x, w, bias, corr = _problem(50, 24, 4, topk_before_score=True, router_bias=True)
    x_wide = torch.randn(50, 2 * H)
    x_wide[:, ::2] = x
    w_t = w.T.contiguous().T  # [E, H] with strides (1, E)
    before = [t.clone() for t in (x_wide, w_t, bias)]
    out = fused.route_fused(x_wide[:, ::2], w_t, cfg, bias=bias)
    assert all(torch.equal(a, b) for a, b in zip(before, (x_wide, w_t, bias), strict=True))
    want = route(x, w, cfg, bias=bias)
    assert torch.equal(out.topk_ids, want.topk_ids)
    torch.testing.assert_close(out.topk_weights, want.topk_weights)


def test_no_tokens():
    cfg, x, w, bias, corr = _problem(0, 16, 2)
    out, (dx, dw) = _run(fused.route_fused, cfg, x, w, bias, corr)
    assert out.topk_ids.shape == (0, 2) and out.router_logits.shape == (0, 16)
    assert torch.equal(out.tokens_per_expert, torch.zeros(16))
    for name in ("aux_loss", "seq_aux_loss", "z_loss", "loss"):
        assert getattr(out, name).item() == 0.0, name
    assert dx.shape == (0, H) and torch.equal(dw, torch.zeros_like(dw))


def test_bit_reproducible():
    problem = _problem(200, 48, 6, score_func="sigmoid", score_correction_bias=True)
    (a, ga), (b, gb) = (_run(fused.route_fused, *problem, B=4) for _ in range(2))
    for name in ("topk_ids", "tokens_per_expert") + FIELDS:
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert all(torch.equal(u, v) for u, v in zip(ga, gb, strict=True))


def test_route_selects_fused(monkeypatch):
    cfg, x, w, bias, corr = _problem(20, 16, 2)
    calls = []
    real = fused.route_fused
    monkeypatch.setattr(fused, "route_fused", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert router_impl() == "auto"
    route(x, w, cfg)  # auto: CPU tensors take the torch path
    assert calls == []
    with use_router("fused"):
        out = route(x, w, cfg)
    assert calls == [1] and torch.equal(out.topk_ids, route(x, w, cfg).topk_ids)
    monkeypatch.setenv(ENV, "fused")
    route(x, w, cfg)
    assert calls == [1, 1]
    with use_router("torch"):
        route(x, w, cfg)
    assert calls == [1, 1]


@pytest.mark.parametrize("case", ["jitter", "grouped", "float64"])
def test_route_falls_back_to_torch(monkeypatch, case):
    kw = (
        dict(router_jitter=0.1)
        if case == "jitter"
        else dict(score_func="sigmoid", n_group=4, topk_group=2)
        if case == "grouped"
        else {}
    )
    cfg, x, w, bias, corr = _problem(20, 16, 2, **kw)
    dtype = torch.float64 if case == "float64" else torch.float32
    monkeypatch.setattr(fused, "route_fused", lambda *a, **k: pytest.fail("fused path taken"))
    with use_router("fused"):
        out = route(x.to(dtype), w.to(dtype), cfg, training=case == "jitter")
    assert out.topk_ids.shape == (20, 2)


def test_auto_picks_fused_for_cuda_tensors(monkeypatch):
    import types

    from moeyard import routing

    cuda_like, cpu_like = types.SimpleNamespace(is_cuda=True), types.SimpleNamespace(is_cuda=False)
    assert routing._pick_fused(cuda_like) is fused and routing._pick_fused(cpu_like) is None
    with use_router("torch"):
        assert routing._pick_fused(cuda_like) is None
    with use_router("fused"):
        assert routing._pick_fused(cpu_like) is fused

    def no_triton():
        raise ImportError("no triton")

    monkeypatch.setattr(routing, "_fused_module", no_triton)
    monkeypatch.setattr(routing, "_triton_missing", False)
    assert routing._pick_fused(cuda_like) is None  # auto without triton: the torch path
    with use_router("fused"), pytest.raises(ImportError):
        routing._pick_fused(cpu_like)


def test_options_reject_unknown(monkeypatch):
    monkeypatch.setenv(ENV, "fast")
    with pytest.raises(ValueError, match=ENV):
        router_impl()
    with pytest.raises(ValueError, match="impl"):
        with use_router("triton"):
            pass


def _bad_inputs():
    cfg, x, w, bias, corr = _problem(10, 16, 2, router_bias=True)
    big = MoEConfig(num_experts=513, hidden_size=H, intermediate_size=8, top_k=2)
    k_gt_e = MoEConfig(num_experts=16, hidden_size=H, intermediate_size=8, top_k=2)
    k_gt_e.top_k = 17  # a config mutated after validation
    grouped = MoEConfig(num_experts=16, hidden_size=H, intermediate_size=8, top_k=2, n_group=4, topk_group=2)
    return [
        (TypeError, "x", (x.long(), w, cfg), {}),
        (TypeError, "x", (x.double(), w.double(), cfg), {}),
        (TypeError, "weight", (x, w.int(), cfg), {}),
        (ValueError, "weight", (x, w[:, :32], cfg), {}),
        (ValueError, "x", (x[0], w, cfg), {}),
        (ValueError, "bias", (x, w, cfg), dict(bias=bias[:8])),
        (ValueError, "correction_bias", (x, w, cfg), dict(correction_bias=torch.zeros(16, 2))),
        (ValueError, "num_sequences", (x, w, cfg), dict(num_sequences=3)),
        (ValueError, "top_k", (x, w, k_gt_e), {}),
        (ValueError, "num_experts", (x, torch.randn(513, H), big), {}),
        (ValueError, "n_group", (x, w, grouped), {}),
    ]


@pytest.mark.parametrize("i", range(11))
def test_bad_input(i):
    err, name, args, kw = _bad_inputs()[i]
    with pytest.raises(err, match=name):
        fused.route_fused(*args, **kw)


def test_auto_stops_retrying_a_failed_import(monkeypatch):
    import types

    from moeyard import routing

    tries = []

    def no_triton():
        tries.append(1)
        raise ImportError("no triton")

    monkeypatch.setattr(routing, "_fused_module", no_triton)
    monkeypatch.setattr(routing, "_triton_missing", False)
    cuda_like = types.SimpleNamespace(is_cuda=True)
    assert routing._pick_fused(cuda_like) is None and routing._pick_fused(cuda_like) is None
    assert tries == [1]


def test_tokens_per_program(monkeypatch):
    """On a GPU a forward program takes the tokens its sequence has, rounded up to a power of two, from 16
    (``tl.dot``'s least) to 128 and a ``[BM, E_P2]`` tile of at most 16K elements; the autotuner keys on it,
    so a decoding step's few tokens get a config of their own."""
    monkeypatch.setattr(fused, "interpreting", lambda: False)
    for e_p2, cap in ((16, 128), (128, 128), (256, 64), (512, 32)):
        for tokens, want in ((0, 16), (1, 16), (8, 16), (17, 32), (50, 64), (64, 64), (65, 128), (10**6, 128)):
            assert fused.block_m(e_p2, tokens) == max(16, min(cap, want)), (e_p2, tokens)
    monkeypatch.setattr(fused, "_TUNED", [])
    monkeypatch.setattr(fused, "tuned", lambda kernel, configs, key, **kw: key)
    assert "BM" in fused._fwd_launcher()


def test_fixed_config_fits_shared_memory():
    """``MOEYARD_TRITON_AUTOTUNE=0``: three stages where ``x [BM, 32]`` and ``W [32, E_P2]`` fit three times in
    a block's shared memory, fewer where not (float32 x, 512 experts: two stages on an A100, one on sm_86)."""
    h100, a100, sm86 = 232448, 166912, 101376
    assert fused._fixed_for(128, 128, 2, h100) == dict(BK=32, num_warps=8, num_stages=3)
    assert fused._fixed_for(32, 512, 4, h100)["num_stages"] == 3  # 208,896 bytes
    assert fused._fixed_for(32, 512, 4, a100)["num_stages"] == 2
    assert fused._fixed_for(32, 512, 4, sm86)["num_stages"] == 1
    assert fused._fixed_for(32, 512, 2, a100)["num_stages"] == 3


def test_compiles_for_varying_token_counts():
    # route_fused under torch.compile(fullgraph=True), called at several token counts (after the first, a
    # recompile with dynamic shapes): its three launches are custom ops, opaque to the compiler (the Triton
    # kernels traced directly could not be captured here); outputs, ids and gradients equal eager's
    cfg, _, w, bias, corr = _problem(1, 16, 4)
    compiled = torch.compile(fused.route_fused, backend="aot_eager", fullgraph=True)
    g = torch.Generator().manual_seed(5)
    for T, B in ((40, 1), (21, 1), (64, 2), (1, 1)):
        x = torch.randn(T, H, generator=g)
        got, g_got = _run(compiled, cfg, x, w, bias, corr, B)
        want, g_want = _run(fused.route_fused, cfg, x, w, bias, corr, B)
        assert torch.equal(got.topk_ids, want.topk_ids), T
        for n in FIELDS:
            torch.testing.assert_close(getattr(got, n), getattr(want, n), msg=lambda m, T=T, n=n: f"T={T} {n}: {m}")
        for a, b in zip(g_got, g_want, strict=True):
            assert b.abs().sum() > 0
            torch.testing.assert_close(a, b, msg=lambda m, T=T: f"T={T}: {m}")
