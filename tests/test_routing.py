"""Routing against hand-written float64 references of each model's formula, the losses against the
papers' formulas (values and gradients w.r.t. the router weight), and the correction-bias update.

Legend: T tokens, H hidden size, E experts, K top-k, B sequences of S tokens.
"""

import dataclasses
import math

import pytest
import torch

import moeyard
from moeyard import MoEConfig, Router, route, update_correction_bias

H = 16


def ref_route(x, W, cfg, bias=None, corr=None):
    """Dense ``[T, E]`` float64 routing weights (0 where not selected), written token by token from
    the model descriptions (see the cases below)."""
    logits = x.double() @ W.double().T
    if bias is not None:
        logits = logits + bias.double()
    T, E = logits.shape
    K = cfg.top_k
    dense = torch.zeros(T, E, dtype=torch.float64)
    for t in range(T):
        l = logits[t].tolist()
        if cfg.topk_before_score:
            # gpt-oss: softmax over the top-k logits; Llama 4: sigmoid of the top-k (top-1) logits
            top = sorted(range(E), key=lambda e: -l[e])[:K]
            if cfg.score_func == "softmax":
                m = max(l[e] for e in top)
                w = [math.exp(l[e] - m) for e in top]
                w = [v / sum(w) for v in w]
            else:
                w = [1 / (1 + math.exp(-l[e])) for e in top]
                if cfg.norm_topk_prob:
                    w = [v / sum(w) for v in w]
        else:
            if cfg.score_func == "softmax":
                m = max(l)
                z = sum(math.exp(v - m) for v in l)
                s = [math.exp(v - m) / z for v in l]
            else:
                s = [1 / (1 + math.exp(-v)) for v in l]
            # DeepSeek-V3 (arXiv 2412.19437, sec. 2.1.2): the bias only steers the selection
            sel = [s[e] + (0.0 if corr is None else float(corr[e])) for e in range(E)]
            candidates = list(range(E))
            if cfg.n_group > 1:
                per = E // cfg.n_group
                group_score = [sum(sorted(sel[g * per : (g + 1) * per], reverse=True)[:2]) for g in range(cfg.n_group)]
                groups = sorted(range(cfg.n_group), key=lambda g: -group_score[g])[: cfg.topk_group]
                candidates = [e for g in groups for e in range(g * per, (g + 1) * per)]
            top = sorted(candidates, key=lambda e: -sel[e])[:K]
            w = [s[e] for e in top]  # weights from the unbiased scores
            if cfg.norm_topk_prob:
                w = [v / sum(w) for v in w]
        for e, v in zip(top, w, strict=True):
            dense[t, e] = v * cfg.routed_scaling_factor
    return dense


def to_dense(out, E):
    T = out.topk_ids.shape[0]
    return torch.zeros(T, E, dtype=torch.float64).scatter_(1, out.topk_ids, out.topk_weights.double())


# each row: a model family's router as transformers implements it
CONFIGS = [
    pytest.param(dict(num_experts=8, top_k=2), id="qwen3_mixtral"),  # softmax, top-k, renormalise
    pytest.param(
        dict(num_experts=8, top_k=2, topk_before_score=True), id="mixtral_topk_first"
    ),  # top-k logits, softmax
    pytest.param(dict(num_experts=8, top_k=2, norm_topk_prob=False), id="olmoe_qwen2"),  # softmax, top-k, raw probs
    pytest.param(
        dict(
            num_experts=16,
            top_k=4,
            score_func="sigmoid",
            n_group=4,
            topk_group=2,
            score_correction_bias=True,
            routed_scaling_factor=2.5,
        ),
        id="deepseek_v3",
    ),  # grouped, biased
    pytest.param(
        dict(num_experts=8, top_k=3, score_func="sigmoid", score_correction_bias=True), id="sigmoid_bias"
    ),  # bias, no groups
    pytest.param(
        dict(num_experts=12, top_k=4, score_func="sigmoid", n_group=6, topk_group=3, norm_topk_prob=False),
        id="grouped_nonorm",
    ),  # 6 groups of 2, raw weights
    pytest.param(
        dict(num_experts=6, top_k=2, score_func="sigmoid", n_group=6, topk_group=3), id="groups_of_one"
    ),  # a group of 1: its score is s
    pytest.param(dict(num_experts=8, top_k=2, topk_before_score=True, router_bias=True), id="gpt_oss"),
    pytest.param(
        dict(num_experts=8, top_k=1, score_func="sigmoid", topk_before_score=True, norm_topk_prob=False), id="llama4"
    ),  # sigmoid of the top-1 logit
    pytest.param(dict(num_experts=8, top_k=2, score_func="sigmoid", topk_before_score=True), id="sigmoid_topk_norm"),
    pytest.param(dict(num_experts=5, top_k=5), id="k_eq_E"),  # every expert selected
    pytest.param(dict(num_experts=1, top_k=1), id="E1"),  # weight 1 for everyone
]


def _setup(kw, T=24):
    cfg = MoEConfig(hidden_size=H, intermediate_size=8, **kw)
    x = torch.randn(T, H)
    W = torch.randn(cfg.num_experts, H) / math.sqrt(H)
    bias = torch.randn(cfg.num_experts) * 0.3 if cfg.router_bias else None
    corr = torch.randn(cfg.num_experts) * 0.1 if cfg.score_correction_bias else None
    return cfg, x, W, bias, corr


@pytest.mark.parametrize("kw", CONFIGS)
def test_router_formula(kw):
    cfg, x, W, bias, corr = _setup(kw)
    before = [t.clone() for t in (x, W) + tuple(t for t in (bias, corr) if t is not None)]
    out = route(x, W, cfg, bias=bias, correction_bias=corr)
    after = [x, W] + [t for t in (bias, corr) if t is not None]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    want = ref_route(x, W, cfg, bias, corr)
    assert out.topk_ids.dtype == torch.int64 and out.topk_weights.dtype == torch.float32
    assert torch.equal(to_dense(out, cfg.num_experts) != 0, want != 0), "selected experts differ"
    torch.testing.assert_close(to_dense(out, cfg.num_experts), want, rtol=1e-5, atol=1e-6)
    logits = x.double() @ W.double().T + (0 if bias is None else bias.double())
    torch.testing.assert_close(out.router_logits.double(), logits, rtol=1e-5, atol=1e-5)
    scores = logits.softmax(-1) if cfg.score_func == "softmax" else logits.sigmoid()
    torch.testing.assert_close(out.scores.double(), scores, rtol=1e-5, atol=1e-6)
    counts = torch.bincount(out.topk_ids.reshape(-1), minlength=cfg.num_experts)
    assert torch.equal(out.tokens_per_expert, counts.float())
    assert (out.topk_ids.sort(1).values.diff(1) > 0).all(), "an expert chosen twice for one token"


def test_routing_output_is_a_pytree():
    """FSDP2 (before torch 2.13), torch.compile and export find the router's tensors by flattening its
    output: every field, in order, and back."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    cfg = MoEConfig(hidden_size=8, intermediate_size=4, num_experts=4, top_k=2)
    out = route(torch.randn(5, 8), torch.randn(4, 8, requires_grad=True), cfg)
    leaves, spec = tree_flatten(out)
    assert len(leaves) == len(dataclasses.fields(out))
    assert all(a is getattr(out, f.name) for a, f in zip(leaves, dataclasses.fields(out), strict=True))
    back = tree_unflatten(leaves, spec)
    assert type(back) is type(out) and all(
        getattr(back, f.name) is getattr(out, f.name) for f in dataclasses.fields(out)
    )


def test_deepseek_bias_changes_selection_not_weights():
    """The correction bias steers which experts are picked; the weights stay the unbiased scores."""
    cfg, x, W, _, _ = _setup(
        dict(num_experts=8, top_k=2, score_func="sigmoid", score_correction_bias=True, norm_topk_prob=False)
    )
    corr = torch.zeros(8)
    corr[5] = 10.0  # expert 5 is now always chosen
    out = route(x, W, cfg, correction_bias=corr)
    assert (out.topk_ids == 5).any(1).all()
    torch.testing.assert_close(out.topk_weights, out.scores.gather(1, out.topk_ids))


def test_grouped_topk_excludes_groups():
    """Only experts of the topk_group best groups are chosen."""
    cfg, x, W, _, _ = _setup(dict(num_experts=16, top_k=4, score_func="sigmoid", n_group=8, topk_group=2))
    out = route(x, W, cfg)
    groups = out.topk_ids // 2
    assert all(len(set(g.tolist())) <= 2 for g in groups)


def test_router_module_and_jitter():
    cfg = MoEConfig(num_experts=4, hidden_size=1, intermediate_size=4, top_k=2, router_jitter=0.1)
    router = Router(cfg)
    x = torch.randn(64, 1)
    x_before = x.clone()
    router.eval()
    base = router(x)
    again = router(x)
    assert torch.equal(base.router_logits, again.router_logits), "jitter applied outside training"
    torch.testing.assert_close(base.router_logits, x @ router.weight.detach().T)
    router.train()
    jittered = router(x).router_logits
    assert not torch.equal(jittered, base.router_logits), "no jitter in training"
    # H = 1: each logit is w_e * x * u with one u ~ U(0.9, 1.1) per token
    ratio = jittered / base.router_logits
    assert ((ratio >= 0.9 - 1e-6) & (ratio <= 1.1 + 1e-6)).all()
    torch.testing.assert_close(ratio, ratio[:, :1].expand_as(ratio))
    assert ratio.std() > 0.01
    assert torch.equal(x, x_before)
    # without jitter, training mode changes nothing
    cfg0 = MoEConfig(num_experts=4, hidden_size=1, intermediate_size=4, top_k=2)
    assert torch.equal(
        route(x, router.weight, cfg0, training=True).router_logits, route(x, router.weight, cfg0).router_logits
    )


def test_router_bias_and_buffer():
    cfg = MoEConfig(
        num_experts=4,
        hidden_size=H,
        intermediate_size=4,
        top_k=2,
        router_bias=True,
        score_correction_bias=True,
        score_func="sigmoid",
    )
    r = Router(cfg)
    assert r.bias.shape == (4,) and r.e_score_correction_bias.shape == (4,)
    assert "e_score_correction_bias" in dict(r.named_buffers())
    with torch.no_grad():
        r.bias.copy_(torch.randn(4))
        r.e_score_correction_bias.copy_(torch.randn(4) * 0.1)
    x = torch.randn(10, H)
    out = r(x)
    want = ref_route(x, r.weight.detach(), cfg, r.bias.detach(), r.e_score_correction_bias)
    torch.testing.assert_close(to_dense(out, 4), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kw", [CONFIGS[0], CONFIGS[3], CONFIGS[7]])
def test_router_float64(kw):
    """float64 input routes in float64: the weights and every loss match the float64 formulas to
    1e-12 (a float32 router would miss by ~1e-7)."""
    cfg, x, W, bias, corr = _setup(kw)
    cfg = dataclasses.replace(cfg, aux_loss_coef=0.1, seq_aux_loss_coef=0.01, z_loss_coef=0.001)
    x, W = x.double(), W.double()
    out = route(x, W, cfg, bias=None if bias is None else bias.double(), correction_bias=corr, num_sequences=2)
    for f in ("topk_weights", "router_logits", "scores", "aux_loss", "seq_aux_loss", "z_loss", "loss"):
        assert getattr(out, f).dtype == torch.float64, f
    torch.testing.assert_close(to_dense(out, cfg.num_experts), ref_route(x, W, cfg, bias, corr), rtol=1e-12, atol=1e-12)
    if bias is None:
        aux, seq, z = ref_losses(x, W, cfg, out.topk_ids, 2)
        for got, want in ((out.aux_loss, aux), (out.seq_aux_loss, seq), (out.z_loss, z)):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


# ---- losses ---------------------------------------------------------------------------------------


def ref_losses(x, W, cfg, ids, B):
    """Float64 losses from the papers, differentiable in ``W`` (float64 leaf); ``ids`` are the routed
    experts (the indicator / count terms carry no gradient)."""
    l = x.double() @ W.T
    T, E = l.shape
    K = cfg.top_k
    if cfg.score_func == "softmax":
        p = torch.exp(l - l.max(1, keepdim=True).values)
        p = p / p.sum(1, keepdim=True)
    else:
        s = 1 / (1 + torch.exp(-l))
        p = s / s.sum(1, keepdim=True)
    onehot = torch.zeros(T, E, dtype=torch.float64).scatter_(1, ids, 1.0)
    # Switch Transformer eq. 4, top-k form: E * sum_e (count_e / (T K)) * mean_t p_te
    aux = E * sum((onehot[:, e].sum() / (T * K)) * p[:, e].mean() for e in range(E))
    # DeepSeek-V3 eq. 17-20 per sequence, averaged: f_e = E / (K S) * count_e, P_e = mean_t s'_te
    S = T // B
    seq = (
        sum(
            sum(
                (E / (K * S)) * onehot[b * S : (b + 1) * S, e].sum() * p[b * S : (b + 1) * S, e].mean()
                for e in range(E)
            )
            for b in range(B)
        )
        / B
    )
    # ST-MoE eq. 5: mean_t (log sum_e exp l_te)^2
    z = sum(torch.log(torch.exp(l[t]).sum()) ** 2 for t in range(T)) / T
    return aux, seq, z


LOSS_CONFIGS = [
    pytest.param(dict(num_experts=8, top_k=2), 1, id="softmax_top2"),
    pytest.param(dict(num_experts=8, top_k=1, norm_topk_prob=False), 4, id="switch_top1_B4"),
    pytest.param(dict(num_experts=6, top_k=3, score_func="sigmoid"), 2, id="sigmoid_B2"),
    pytest.param(
        dict(num_experts=16, top_k=4, score_func="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5),
        3,
        id="deepseek_B3",
    ),
]


@pytest.mark.parametrize("kw,B", LOSS_CONFIGS)
def test_losses_and_gradients(kw, B):
    coefs = dict(aux_loss_coef=0.01, seq_aux_loss_coef=0.003, z_loss_coef=0.001)
    cfg = MoEConfig(hidden_size=H, intermediate_size=8, **kw, **coefs)
    T = 24
    x = torch.randn(T, H)
    W = (torch.randn(cfg.num_experts, H) / math.sqrt(H)).requires_grad_()
    out = route(x, W, cfg, num_sequences=B)
    W64 = W.detach().double().requires_grad_()
    want = ref_losses(x, W64, cfg, out.topk_ids, B)
    names = ("aux_loss", "seq_aux_loss", "z_loss")
    for name, ref in zip(names, want, strict=True):
        got = getattr(out, name)
        assert got.dim() == 0 and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), ref.detach(), rtol=1e-5, atol=1e-7, msg=name)
        (g,) = torch.autograd.grad(got, W, retain_graph=True)
        (g_ref,) = torch.autograd.grad(ref, W64, retain_graph=True)
        assert g_ref.abs().max() > 0
        torch.testing.assert_close(g.double(), g_ref, rtol=1e-4, atol=1e-6 * g_ref.abs().max().item(), msg=name)
    total = sum(coefs[c] * w for c, w in zip(("aux_loss_coef", "seq_aux_loss_coef", "z_loss_coef"), want, strict=True))
    torch.testing.assert_close(out.loss.double(), total.detach(), rtol=1e-5, atol=1e-8)


def test_aux_loss_matches_transformers():
    """transformers' ``load_balancing_loss_func`` (Mixtral, Qwen) is K times moeyard's aux_loss."""
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    cfg = MoEConfig(num_experts=8, hidden_size=H, intermediate_size=8, top_k=2)
    x, W = torch.randn(32, H), torch.randn(8, H)
    out = route(x, W, cfg)
    hf = mixtral.load_balancing_loss_func((out.router_logits,), num_experts=8, top_k=2)
    torch.testing.assert_close(2 * out.aux_loss, hf, rtol=1e-5, atol=1e-6)


def test_uniform_routing_aux_loss_is_one():
    """Equal logits and every expert chosen equally often: aux_loss = 1, seq_aux_loss = 1."""
    cfg = MoEConfig(num_experts=4, hidden_size=H, intermediate_size=8, top_k=4)
    out = route(torch.randn(8, H), torch.zeros(4, H), cfg, num_sequences=2)
    torch.testing.assert_close(out.aux_loss, torch.tensor(1.0))
    torch.testing.assert_close(out.seq_aux_loss, torch.tensor(1.0))
    torch.testing.assert_close(out.z_loss, torch.tensor(math.log(4) ** 2))


def test_no_tokens():
    cfg = MoEConfig(
        num_experts=4,
        hidden_size=H,
        intermediate_size=8,
        top_k=2,
        aux_loss_coef=1.0,
        seq_aux_loss_coef=1.0,
        z_loss_coef=1.0,
    )
    W = torch.randn(4, H, requires_grad=True)
    out = route(torch.randn(0, H), W, cfg)
    assert out.topk_ids.shape == (0, 2) and out.topk_weights.shape == (0, 2)
    for name in ("aux_loss", "seq_aux_loss", "z_loss", "loss"):
        assert getattr(out, name).item() == 0.0, name
    out.loss.backward()
    assert torch.equal(W.grad, torch.zeros_like(W))
    assert torch.equal(out.tokens_per_expert, torch.zeros(4))


def test_update_correction_bias():
    bias = torch.tensor([0.0, 0.5, -0.2, 0.1, 0.0])
    load = torch.tensor([10.0, 2.0, 4.0, 4.0, 5.0])  # mean 5: expert 0 overloaded, 1-3 under, 4 even
    bias_before, load_before = bias.clone(), load.clone()
    new = update_correction_bias(bias, load, rate=0.01)
    assert torch.equal(bias, bias_before) and torch.equal(load, load_before)
    torch.testing.assert_close(new, bias + 0.01 * torch.tensor([-1.0, 1.0, 1.0, 1.0, 0.0]))
    # the default rate is DeepSeek-V3's gamma = 0.001
    torch.testing.assert_close(update_correction_bias(bias, load), bias + 0.001 * torch.sign(5 - load))
    # with the router's counts: the most loaded expert's bias goes down, the least loaded goes up
    cfg = MoEConfig(
        num_experts=8, hidden_size=H, intermediate_size=8, top_k=2, score_func="sigmoid", score_correction_bias=True
    )
    r = Router(cfg)
    out = r(torch.randn(64, H))
    b = update_correction_bias(r.e_score_correction_bias, out.tokens_per_expert)
    assert b[out.tokens_per_expert.argmax()] < 0 < b[out.tokens_per_expert.argmin()]
    assert torch.equal(r.e_score_correction_bias, torch.zeros(8))


def test_router_gradient_flows_through_weights():
    """d topk_weights / d W against float64 autograd of the reference formula."""
    cfg, x, W, _, corr = _setup(
        dict(
            num_experts=16,
            top_k=4,
            score_func="sigmoid",
            n_group=4,
            topk_group=2,
            score_correction_bias=True,
            routed_scaling_factor=2.5,
        )
    )
    W = W.requires_grad_()
    out = route(x, W, cfg, correction_bias=corr)
    g_out = torch.randn_like(out.topk_weights)
    (g,) = torch.autograd.grad(out.topk_weights, W, g_out)
    W64 = W.detach().double().requires_grad_()
    s = torch.sigmoid(x.double() @ W64.T).gather(1, out.topk_ids)
    w = s / s.sum(1, keepdim=True) * 2.5
    (g_ref,) = torch.autograd.grad(w, W64, g_out.double())
    torch.testing.assert_close(g.double(), g_ref, rtol=1e-4, atol=1e-6)


def test_moeyard_exports():
    assert moeyard.route is route and moeyard.update_correction_bias is update_correction_bias
