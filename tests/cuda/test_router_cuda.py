"""The fused router on a CUDA GPU at real router shapes: float32 parity with the torch path (ids
identical, values and gradients close), bfloat16 (logits within rounding of the torch path; a valid
top-k of its own keys, ties broken towards the lower id; weights and statistics from those ids;
selection-independent gradients close), bit-reproducibility, and no host sync."""

import pytest
import torch

from moeyard import MoEConfig
from moeyard.routing import fused, route, use_router
from moeyard.routing.losses import balance_loss_from_stats

pytestmark = pytest.mark.cuda
DEV = "cuda"
COEFS = dict(aux_loss_coef=0.01, seq_aux_loss_coef=0.003, z_loss_coef=0.001)
SCHEMES = [
    pytest.param(dict(E=128, K=8), id="qwen3"),
    pytest.param(dict(E=256, K=8), id="qwen3.5"),
    pytest.param(dict(E=64, K=8, norm_topk_prob=False), id="olmoe"),
    pytest.param(
        dict(E=256, K=8, score_func="sigmoid", score_correction_bias=True, routed_scaling_factor=2.5), id="sigmoid_bias"
    ),
    pytest.param(dict(E=32, K=4, topk_before_score=True, router_bias=True), id="gpt_oss"),
    pytest.param(dict(E=512, K=10), id="E512"),
    pytest.param(dict(E=60, K=16), id="E60_K16"),
]


def _problem(kw, T=2000, H=512, dtype=torch.float32):
    kw = dict(kw)
    E, K = kw.pop("E"), kw.pop("K")
    cfg = MoEConfig(num_experts=E, hidden_size=H, intermediate_size=8, top_k=K, **COEFS, **kw)
    g = torch.Generator(DEV).manual_seed(0)
    x = torch.randn(T, H, device=DEV, generator=g).to(dtype)
    w = (torch.randn(E, H, device=DEV, generator=g) / H**0.5).to(dtype)
    bias = (torch.randn(E, device=DEV, generator=g) * 0.3).to(dtype) if cfg.router_bias else None
    corr = torch.randn(E, device=DEV, generator=g) * 0.05 if cfg.score_correction_bias else None
    return cfg, x, w, bias, corr


def _run(fn, cfg, x, w, bias, corr, B=4, use=("topk_weights", "loss", "router_logits", "scores")):
    leaves = [t.detach().requires_grad_() for t in (x, w) + ((bias,) if bias is not None else ())]
    out = fn(
        leaves[0], leaves[1], cfg, bias=leaves[2] if bias is not None else None, correction_bias=corr, num_sequences=B
    )
    g = torch.Generator(DEV).manual_seed(1)
    total = sum(
        (getattr(out, n).float() * torch.randn(getattr(out, n).shape, device=DEV, generator=g)).sum() for n in use
    )
    return out, torch.autograd.grad(total, leaves)


def torch_route(*args, **kwargs):
    """The torch path (the reference; the default router on CUDA is the fused one)."""
    with use_router("torch"):
        return route(*args, **kwargs)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("tokens, sequences", [(2000, 4), (8, 1), (200, 4)], ids=["T2000", "T8", "T200_B4"])
@pytest.mark.parametrize("kw", SCHEMES)
def test_float32_parity(kw, tokens, sequences):
    """At 8 and 50 tokens per sequence the forward runs programs of 16 and 64 tokens (``fused.block_m``)."""
    problem = _problem(kw, T=tokens)
    (a, ga), (b, gb) = _run(fused.route_fused, *problem, B=sequences), _run(torch_route, *problem, B=sequences)
    assert torch.equal(a.topk_ids, b.topk_ids) and torch.equal(a.tokens_per_expert, b.tokens_per_expert)
    for n in ("topk_weights", "router_logits", "scores", "aux_loss", "seq_aux_loss", "z_loss", "loss"):
        assert _rel(getattr(a, n), getattr(b, n)) < 1e-5, n
    for u, v in zip(ga, gb, strict=True):
        assert _rel(u, v) < 1e-4


@pytest.mark.parametrize("kw", SCHEMES)
def test_bfloat16_selection_and_values(kw):
    cfg, x, w, bias, corr = _problem(kw, T=4096, H=2048, dtype=torch.bfloat16)
    out = fused.route_fused(x, w, cfg, bias=bias, correction_bias=corr)
    want = torch_route(x, w, cfg, bias=bias, correction_bias=corr)
    torch.testing.assert_close(out.router_logits, want.router_logits, rtol=2**-7, atol=1e-3)
    l, s = out.router_logits, out.scores
    torch.testing.assert_close(s, l.softmax(-1) if cfg.score_func == "softmax" else l.sigmoid(), rtol=1e-5, atol=1e-6)
    key = l if cfg.topk_before_score else s + (0 if corr is None else corr)  # the kernel's own keys
    picked = key.gather(1, out.topk_ids)
    rest = key.scatter(1, out.topk_ids, float("-inf"))
    assert (picked[:, :-1] >= picked[:, 1:]).all(), "ids not in decreasing key order"
    assert (picked[:, -1] >= rest.max(1).values).all(), "not a top-k of the keys"
    counts = torch.zeros(cfg.num_experts, device=DEV).index_add_(
        0, out.topk_ids.reshape(-1), torch.ones(out.topk_ids.numel(), device=DEV)
    )
    assert torch.equal(out.tokens_per_expert, counts)
    probs = s if cfg.score_func == "softmax" else s / (s.sum(-1, keepdim=True) + 1e-20)
    aux = balance_loss_from_stats(counts, probs.sum(0), x.shape[0], cfg.top_k)
    torch.testing.assert_close(out.aux_loss, aux, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.z_loss, torch.logsumexp(l, -1).square().mean(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kw", SCHEMES[:1] + SCHEMES[3:5])
def test_bfloat16_gradients(kw):
    """Outputs that do not depend on the selection (ties differ between the paths in bfloat16)."""
    problem = _problem(kw, T=4096, H=2048, dtype=torch.bfloat16)
    use = ("router_logits", "scores", "z_loss")
    (_, ga), (_, gb) = _run(fused.route_fused, *problem, use=use), _run(torch_route, *problem, use=use)
    for u, v in zip(ga, gb, strict=True):
        assert u.dtype == v.dtype and _rel(u, v) < 2e-2


def test_reproducible_and_no_host_sync():
    problem = _problem(SCHEMES[3].values[0], T=8192, H=1024, dtype=torch.bfloat16)
    first = _run(fused.route_fused, *problem)  # compiles and autotunes outside sync-debug mode
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        second = _run(fused.route_fused, *problem)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for n in ("topk_ids", "topk_weights", "tokens_per_expert", "aux_loss", "seq_aux_loss", "z_loss", "loss"):
        assert torch.equal(getattr(first[0], n), getattr(second[0], n)), n
    assert all(torch.equal(u, v) for u, v in zip(first[1], second[1], strict=True))


def test_default_router_on_cuda_is_fused(monkeypatch):
    cfg, x, w, bias, corr = _problem(SCHEMES[0].values[0], T=64)
    calls = []
    real = fused.route_fused
    monkeypatch.setattr(fused, "route_fused", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.delenv("MOEYARD_ROUTER", raising=False)
    route(x, w, cfg)
    assert calls == [1]
    route(x.double(), w.double(), cfg)  # float64: the fused router does not apply, the torch path runs
    assert calls == [1]


def test_autotuned_per_program_size(monkeypatch):
    """With autotuning on (the default), the forward is tuned per program size (``fused.block_m``: 16, 64 and
    128 tokens here), each on its first call: that call returns what the next returns, with the torch path's
    ids."""
    monkeypatch.setenv("MOEYARD_TRITON_AUTOTUNE", "1")
    monkeypatch.setattr(fused, "_TUNED", [])  # the launcher built anew, autotuned
    for tokens in (8, 50, 2000):
        problem = _problem(dict(E=128, K=8), T=tokens)
        (a, ga), (b, gb) = (_run(fused.route_fused, *problem, B=1) for _ in range(2))
        ref, _ = _run(torch_route, *problem, B=1)
        assert torch.equal(a.topk_ids, b.topk_ids) and torch.equal(a.topk_ids, ref.topk_ids), tokens
        for n in ("topk_weights", "router_logits", "scores", "loss"):
            assert torch.equal(getattr(a, n), getattr(b, n)), (tokens, n)
        assert all(torch.equal(u, v) for u, v in zip(ga, gb, strict=True)), tokens
    assert {key[0][-1] for key in fused._TUNED[0].picks} == {16, 64, 128}
