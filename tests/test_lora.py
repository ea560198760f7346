"""LoRA adapters on the expert projections (``moeyard.experts(..., lora=...)``), every CPU backend
against the float64 ``loop`` oracle: the output and the gradients of x, the routing weights, both
factors of both projections (and of the base weights when they train), across ranks, activations,
weight layouts and the routing edge cases of tiled kernels. The oracle's own LoRA is checked against
the merged weight ``W + s B A`` built the way PEFT folds it.
"""

import math

import pytest
import torch

import moeyard
from helpers import LORA_SCALING, add_lora, check_backend, cpu_backends, make_inputs, random_ids, run_experts

FP32_BACKENDS = cpu_backends(torch.float32)
FROZEN = ("gate_up_proj", "down_proj")


def _merged(w: torch.Tensor, A: torch.Tensor, B: torch.Tensor, s: float, transposed: bool) -> torch.Tensor:
    """PEFT's fold: ``einsum("o r e, e r i -> e o i", B.view(out, r, E), A.view(E, r, in)) * s``."""
    E = w.shape[0]
    r = A.shape[0] // E
    delta = torch.einsum("ore,eri->eoi", B.view(B.shape[0], r, E), A.view(E, r, A.shape[1])) * s
    return w + (delta.mT if transposed else delta)


@pytest.mark.parametrize("transposed", [False, True])  # transformers' [E, out, in] and gpt-oss's [E, in, out]
def test_loop_lora_equals_merged_weights(transposed):
    inp = add_lora(make_inputs(23, 16, 12, 5, 2, transposed=transposed, bias=True), 3)
    kw = dict(transposed=transposed, interleaved=transposed, activation="clamped_swiglu" if transposed else "swiglu")
    got = moeyard.experts(
        inp["hidden_states"],
        inp["topk_ids"],
        inp["topk_weights"],
        inp["gate_up_proj"],
        inp["down_proj"],
        gate_up_bias=inp["gate_up_bias"],
        down_bias=inp["down_bias"],
        lora={
            n: moeyard.ExpertLoRA(lora_A=inp[f"{n}.lora_A"], lora_B=inp[f"{n}.lora_B"], scaling=LORA_SCALING[n])
            for n in FROZEN
        },
        backend="loop",
        **kw,
    )
    merged = {n: _merged(inp[n], inp[f"{n}.lora_A"], inp[f"{n}.lora_B"], LORA_SCALING[n], transposed) for n in FROZEN}
    want = moeyard.experts(
        inp["hidden_states"],
        inp["topk_ids"],
        inp["topk_weights"],
        merged["gate_up_proj"],
        merged["down_proj"],
        gate_up_bias=inp["gate_up_bias"],
        down_bias=inp["down_bias"],
        backend="loop",
        **kw,
    )
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", FP32_BACKENDS)
@pytest.mark.parametrize("rank", [1, 3, 4, 16])  # 1 and 3: r*E a multiple of no tile; 4, 16: grouped_mm's aligned ranks
def test_ranks_frozen_base(backend, rank):
    inp = add_lora(make_inputs(29, 24, 16, 5, 2), rank)
    if backend == "grouped_mm" and rank % 4:
        with pytest.raises(ValueError, match="LoRA ranks"):
            run_experts(inp, torch.float32, backend, torch.randn(29, 24, dtype=torch.float64), frozen=FROZEN)
        return
    check_backend(backend, inp, torch.float32, frozen=FROZEN)


@pytest.mark.parametrize("backend", FP32_BACKENDS)
def test_rank_64_and_trainable_base(backend):
    # base weights train too: their gradients include nothing of the adapters' and vice versa
    check_backend(backend, add_lora(make_inputs(21, 32, 16, 3, 2, bias=True), 64), torch.float32)


@pytest.mark.parametrize("backend", FP32_BACKENDS)
@pytest.mark.parametrize("act", ["gelu", "geglu", "custom"])  # plain activation, another gated one, a callable
def test_activations(backend, act):
    gated = act != "gelu"
    activation = (
        moeyard.Activation(name="custom", fn=lambda h: torch.tanh(h), fn_gated=False) if act == "custom" else act
    )
    inp = add_lora(make_inputs(17, 16, 16, 4, 2, gated=gated and act != "custom"), 4, gated=gated and act != "custom")
    check_backend(backend, inp, torch.float32, activation=activation, frozen=FROZEN)


@pytest.mark.parametrize("backend", FP32_BACKENDS)
def test_gpt_oss_layout(backend):
    # transposed [E, in, out] weights, interleaved gate/up columns, biases, clamped SwiGLU
    inp = add_lora(make_inputs(19, 16, 16, 4, 2, bias=True, transposed=True), 4)
    check_backend(
        backend, inp, torch.float32, activation="clamped_swiglu", transposed=True, interleaved=True, frozen=FROZEN
    )


@pytest.mark.parametrize("backend", FP32_BACKENDS)
@pytest.mark.parametrize("which", ["gate_up_proj", "down_proj"])
def test_one_projection_adapted(backend, which):
    check_backend(
        backend, add_lora(make_inputs(15, 16, 16, 4, 2), 4, projections=(which,)), torch.float32, frozen=FROZEN
    )


EDGE_CASES = [
    # (T, E, K, ids): the routing cases that break tiled kernels
    (40, 6, 2, "one_expert"),  # every token to experts 0 and 1: others empty, one long expert
    (1, 7, 3, None),  # T = 1: a single row tile per expert
    (0, 4, 2, None),  # no tokens at all: gradients are zeros, nothing hangs
    (12, 4, 4, None),  # k = E
]


@pytest.mark.parametrize("backend", FP32_BACKENDS)
@pytest.mark.parametrize("T,E,K,ids", EDGE_CASES)
def test_routing_edge_cases(backend, T, E, K, ids):
    routed = torch.stack([torch.arange(K)] * T) if ids == "one_expert" else random_ids(T, K, E)
    inp = add_lora(make_inputs(T, 16, 16, E, K, ids=routed), 4)
    check_backend(backend, inp, torch.float32, frozen=FROZEN)


@pytest.mark.parametrize("backend", ["bmm_padded", "grouped_mm"])
def test_bfloat16(backend):
    check_backend(backend, add_lora(make_inputs(33, 32, 16, 4, 2), 8), torch.bfloat16, frozen=FROZEN)


def test_float32_factors_with_bfloat16_weights():
    # PEFT keeps adapters in float32 over a bf16 base: factors are cast per call, gradients come back in float32
    inp = add_lora(make_inputs(9, 16, 16, 3, 2), 8)
    x = inp["hidden_states"].bfloat16()
    A, B = (inp[f"gate_up_proj.lora_{n}"].float().requires_grad_() for n in "AB")
    out = moeyard.experts(
        x,
        inp["topk_ids"],
        inp["topk_weights"].bfloat16(),
        inp["gate_up_proj"].bfloat16(),
        inp["down_proj"].bfloat16(),
        backend="bmm_padded",
        lora={"gate_up_proj": moeyard.ExpertLoRA(lora_A=A, lora_B=B, scaling=0.5)},
    )
    out.float().sum().backward()
    assert A.grad.dtype == torch.float32 and B.grad.dtype == torch.float32
    assert A.grad.abs().sum() > 0 and B.grad.abs().sum() > 0


def test_triton_split_and_fused_agree(monkeypatch):
    if "triton" not in FP32_BACKENDS:
        pytest.skip("triton runs only under its interpreter on CPU")
    from moeyard.experts.triton.options import use_options

    inp = add_lora(make_inputs(26, 24, 16, 5, 2, bias=True), 5)
    results = {}
    for mode in ("split", "fused"):
        torch.manual_seed(1)  # the same output gradient for both
        with use_options(lora_mode=mode):
            results[mode] = check_backend("triton", inp, torch.float32, frozen=FROZEN)
    for k in results["split"]:
        torch.testing.assert_close(results["split"][k], results["fused"][k], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("one_pass", [True, False])  # False: the row partials over budget, two passes over d_y
def test_triton_frozen_base_runs_no_base_weight_gradient(monkeypatch, one_pass):
    if "triton" not in FP32_BACKENDS:
        pytest.skip("triton runs only under its interpreter on CPU")
    from moeyard.experts.triton import ops

    if not one_pass:
        monkeypatch.setattr(ops, "wgrad_rows_fits", lambda *a: False)
    shapes, fused_rows, thin_passes, low_rank = [], [], [], []
    real, real_rows, real_thin = ops.wgrad, ops.wgrad_rows, ops.low_rank_rows
    monkeypatch.setattr(
        ops,
        "wgrad",
        lambda *a, **k: shapes.append(tuple(k["like_w"].shape)) or low_rank.append(k.get("low_rank")) or real(*a, **k),
    )
    monkeypatch.setattr(ops, "wgrad_rows", lambda *a, **k: fused_rows.append(tuple(a[2].shape)) or real_rows(*a, **k))
    monkeypatch.setattr(ops, "low_rank_rows", lambda *a, **k: thin_passes.append(a[1].shape) or real_thin(*a, **k))
    E, r = 3, 4
    inp = add_lora(make_inputs(10, 16, 12, E, 2), r)
    check_backend("triton", inp, torch.float32, frozen=FROZEN)
    shapes.clear(), fused_rows.clear(), thin_passes.clear()
    run_experts(inp, torch.float32, "triton", torch.randn(10, 16, dtype=torch.float64), frozen=FROZEN)
    # only the factor gradients: dA by wgrad ([E, r, in]); dB_up with the rows d_h B_e by wgrad_rows (one pass
    # over d_h, sorted rows); dB_down by wgrad and the rows d out B_e by a thin pass (d out is read by token);
    # each a low-rank one (tile-major where it reads by token)
    assert low_rank and all(low_rank)
    if one_pass:
        assert sorted(shapes) == [(E, r, 12), (E, r, 16), (E, 16, r)], shapes
        assert fused_rows == [(E, 24, r)], fused_rows
        assert len(thin_passes) == 3  # the forward's x A_up^T and a A_down^T, backward's d out B_down
    else:
        assert sorted(shapes) == [(E, r, 12), (E, r, 16), (E, 16, r), (E, 24, r)], shapes
        assert not fused_rows and len(thin_passes) == 4


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])  # the same dtype, and a cast
def test_lora_b_expert_major_relayout(dtype):
    # PEFT's lora_B [out, r*E] (column k*E + e: expert e, rank k) -> [E, out, r] contiguous; the gradient
    # back in lora_B's layout and dtype
    from moeyard.experts.relayout import expert_major

    out, r, E = 7, 3, 5
    B = torch.randn(out, r * E, dtype=torch.float64, requires_grad=True)
    b = expert_major(B, r, E, dtype)
    assert b.shape == (E, out, r) and b.is_contiguous() and b.dtype == dtype
    assert torch.equal(b, B.detach().view(out, r, E).permute(2, 0, 1).to(dtype))
    g = torch.randn(E, out, r, dtype=dtype)
    (grad,) = torch.autograd.grad(b, B, g)
    assert grad.dtype == torch.float64 and grad.is_contiguous()
    assert torch.equal(grad, g.double().permute(1, 2, 0).reshape(out, r * E))


@pytest.mark.parametrize(
    "bad,match,err",
    [
        (dict(lora_A=torch.randn(7, 16)), r"lora_A: expected shape \[r\*3, 16\]", ValueError),  # 7 rows: not r*E
        (dict(lora_B=torch.randn(32, 9)), r"lora_B: expected shape \[32, 6\]", ValueError),  # rank of B != A's
        (dict(lora_A=torch.randn(6, 16, dtype=torch.float64).long()), "floating-point", TypeError),
        (dict(scaling="2"), "scaling: expected a finite float", TypeError),
        (dict(scaling=math.nan), "scaling: expected a finite float", TypeError),
    ],
)
def test_bad_adapters(bad, match, err):
    x, ids, tw = torch.randn(5, 16), random_ids(5, 2, 3), torch.rand(5, 2)
    up, down = torch.randn(3, 32, 16), torch.randn(3, 16, 16)
    kw = dict(lora_A=torch.randn(6, 16), lora_B=torch.randn(32, 6), scaling=1.0) | bad
    lora = {"gate_up_proj": moeyard.ExpertLoRA(**kw)}
    before = {k: v.clone() for k, v in kw.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(err, match=match):
        moeyard.experts(x, ids, tw, up, down, backend="loop", lora=lora)
    assert all(torch.equal(before[k], kw[k]) for k in before)


def test_bad_lora_argument():
    x, ids, tw = torch.randn(5, 16), random_ids(5, 2, 3), torch.rand(5, 2)
    up, down = torch.randn(3, 32, 16), torch.randn(3, 16, 16)
    with pytest.raises(TypeError, match="lora: expected a dict"):
        moeyard.experts(x, ids, tw, up, down, lora={"up_proj": moeyard.ExpertLoRA(lora_A=up[0], lora_B=up[0])})
    with pytest.raises(TypeError, match="moeyard.ExpertLoRA"):
        moeyard.experts(x, ids, tw, up, down, lora={"down_proj": (torch.randn(6, 16), torch.randn(16, 6))})


def test_triton_refuses_ranks_above_its_register_tile():
    from moeyard.experts import triton as triton_backend
    from moeyard.experts.weights import expert_weights

    E, r = 2, triton_backend.MAX_LORA_RANK + 1
    w = expert_weights(
        torch.randn(E, 32, 16),
        torch.randn(E, 16, 16),
        lora={"down_proj": moeyard.ExpertLoRA(lora_A=torch.randn(r * E, 16), lora_B=torch.randn(16, r * E))},
    )
    reason = triton_backend._unsupported(torch.device("cuda"), torch.bfloat16, w, None)
    assert reason is not None and "LoRA rank" in reason
