"""Every backend that runs on CUDA against the float64 ``loop`` oracle (output and every gradient, in
float32 and bfloat16), the MoE layer forward and backward, no host sync in dispatch and the
``grouped_mm`` / ``triton`` backends, and invalid expert ids on the GPU (NaN rows; ValueError in
debug mode).

Legend: T tokens, H hidden size, I intermediate size, E experts, K top-k.
"""

import math

import pytest
import torch

import moeyard
from helpers import assert_matches_oracle, check_backend, make_inputs, random_ids
from moeyard import MoE, MoEConfig, make_plan, permute, unpermute

pytestmark = pytest.mark.cuda
DEV = "cuda"
DTYPES = [torch.float32, torch.bfloat16]


def cuda_backends(dtype):
    if not torch.cuda.is_available():
        return []
    return [b for b in moeyard.available_backends(DEV, dtype) if b != "loop"]


BACKEND_DTYPE = [pytest.param(b, d, id=f"{b}-{str(d)[6:]}") for d in DTYPES for b in cuda_backends(d) + ["auto"]]

# (T, H, I, E, K, experts the ids are drawn from (None: all))
SHAPES = [
    pytest.param(256, 128, 64, 16, 4, None, id="base"),  # several tiles per expert
    pytest.param(64, 64, 32, 8, 2, [1, 6], id="empty_experts"),  # six experts get no rows
    pytest.param(48, 64, 32, 8, 1, [5], id="one_expert"),  # every row in one group
    pytest.param(1, 64, 32, 8, 2, None, id="T1"),  # one token
    pytest.param(0, 64, 32, 8, 2, None, id="T0"),  # no tokens
    pytest.param(37, 64, 32, 7, 7, None, id="prime_E_k_eq_E"),  # prime E, K = E
    pytest.param(33, 24, 40, 5, 2, None, id="H24_I40"),  # H, I not multiples of 16
    pytest.param(10, 64, 32, 1, 1, None, id="E1"),  # a single expert
]


@pytest.mark.parametrize("backend,dtype", BACKEND_DTYPE)
@pytest.mark.parametrize("T,H,I,E,K,pool", SHAPES)
def test_backend_vs_oracle(backend, dtype, T, H, I, E, K, pool):
    ids = None
    if pool is not None:
        ids = torch.tensor(pool)[torch.rand(T, len(pool)).argsort(1)[:, :K]]
    check_backend(backend, make_inputs(T, H, I, E, K, ids=ids, bias=True), dtype, device=DEV)


@pytest.mark.parametrize("backend,dtype", BACKEND_DTYPE)
@pytest.mark.parametrize("activation", ["swiglu", "geglu", "reglu", "clamped_swiglu", "gelu", "relu", "relu2", "silu"])
def test_activations(backend, dtype, activation):
    gated = activation in ("swiglu", "geglu", "reglu", "clamped_swiglu")
    inputs = make_inputs(96, 64, 32, 8, 2, gated=gated, bias=True)
    inputs["hidden_states"] *= 6  # reach the clamps of clamped_swiglu
    check_backend(backend, inputs, dtype, device=DEV, activation=activation)


@pytest.mark.parametrize("backend,dtype", BACKEND_DTYPE)
def test_gpt_oss_layout_and_drop_invalid(backend, dtype):
    T, E, K = 64, 8, 2
    ids = random_ids(T, K, E)
    ids[0, 0], ids[5, 1] = -1, E
    inputs = make_inputs(T, 64, 32, E, K, bias=True, transposed=True, ids=ids)
    inputs["hidden_states"] *= 6
    check_backend(
        backend,
        inputs,
        dtype,
        device=DEV,
        activation="clamped_swiglu",
        transposed=True,
        interleaved=True,
        drop_invalid=True,
    )


def _layer_run(cfg, state, x64, g64, dtype, backend, device):
    m = MoE(cfg, backend=backend, dtype=dtype, device=device)
    m.load_state_dict({k: v.to(v.dtype if k.endswith("correction_bias") else dtype) for k, v in state.items()})
    x = x64.detach().to(device=device, dtype=dtype, copy=True).requires_grad_()
    y = m(x)
    ((y.float() * g64.to(device).float()).sum() + m.aux_loss).backward()
    res = {"out": y.detach().double().cpu(), "grad_x": x.grad.double().cpu()}
    res.update({f"grad_{n}": p.grad.double().cpu() for n, p in m.named_parameters()})
    return res, m.routing.topk_ids.cpu()


@pytest.mark.parametrize("backend,dtype", BACKEND_DTYPE)
def test_layer_forward_backward(backend, dtype):
    cfg = MoEConfig(
        num_experts=8,
        hidden_size=64,
        intermediate_size=32,
        top_k=4,
        score_func="sigmoid",
        n_group=4,
        topk_group=2,
        score_correction_bias=True,
        routed_scaling_factor=2.5,
        num_shared_experts=1,
        aux_loss_coef=0.1,
        seq_aux_loss_coef=0.05,
        z_loss_coef=0.01,
    )
    ref = MoE(cfg, backend="loop", dtype=torch.float64)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
    state = ref.state_dict()
    # routing is discrete: redraw the input until the low-precision router picks the experts float64
    # picks (a near-tie flips in bfloat16 otherwise), so the comparison measures arithmetic only
    for _ in range(50):
        x = torch.randn(2, 8, 64, dtype=torch.float64)
        g = torch.randn_like(x)
        oracle, ids64 = _layer_run(cfg, state, x, g, torch.float64, "loop", "cpu")
        lowp, ids_lowp = _layer_run(cfg, state, x, g, dtype, "loop", DEV)
        if torch.equal(ids64, ids_lowp):
            break
    got, ids = _layer_run(cfg, state, x, g, dtype, backend, DEV)
    assert torch.equal(ids64, ids_lowp) and torch.equal(ids64, ids), "precondition: same experts selected"
    assert_matches_oracle(got, lowp, oracle, dtype, what=f"MoE[{backend}]")


@pytest.fixture
def sync_error():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    yield
    torch.cuda.set_sync_debug_mode("default")


def _problem(T=128, H=64, I=32, E=8, K=2, dtype=torch.bfloat16):
    d = make_inputs(T, H, I, E, K, bias=True)
    return {
        k: (v.to(device=DEV, dtype=dtype).requires_grad_() if v.is_floating_point() else v.to(DEV))
        for k, v in d.items()
    }


@pytest.mark.parametrize("align", [1, 16])
def test_dispatch_does_not_sync(align, sync_error):
    ids = torch.randint(0, 8, (128, 2), device=DEV)
    x = torch.randn(128, 64, device=DEV, requires_grad=True)
    w = torch.rand(128, 2, device=DEV, requires_grad=True)
    plan = make_plan(ids, 8, align=align)
    rows = permute(x, plan)
    out = unpermute(rows * 2, plan, w, drop_invalid=True)
    out.sum().backward()
    plan.row_experts()
    torch.cuda.set_sync_debug_mode("default")
    assert torch.allclose(out, 2 * w.sum(1, keepdim=True) * x)


@pytest.mark.parametrize("backend", [b for b in ("grouped_mm", "triton") if b in cuda_backends(torch.bfloat16)])
@pytest.mark.parametrize("drop_invalid", [False, True])
def test_backend_does_not_sync(backend, drop_invalid):
    d = _problem()
    args = (d["hidden_states"], d["topk_ids"], d["topk_weights"], d["gate_up_proj"], d["down_proj"])
    kw = dict(backend=backend, gate_up_bias=d["gate_up_bias"], down_bias=d["down_bias"], drop_invalid=drop_invalid)
    moeyard.experts(*args, **kw).sum().backward()  # warm-up: feature probes, autotuning, compilation
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = moeyard.experts(*args, **kw)
        out.float().square().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("backend", [b for b in ("grouped_mm", "triton") if b in cuda_backends(torch.bfloat16)])
def test_invalid_ids_nan_rows_then_debug_error(backend):
    d = _problem()
    ids = d["topk_ids"].clone()
    ids[3, 0], ids[7, 1] = -1, 8
    args = (d["hidden_states"], ids, d["topk_weights"], d["gate_up_proj"], d["down_proj"])
    moeyard.set_debug(False)
    try:
        out = moeyard.experts(*args, backend=backend).detach()
        bad = torch.zeros(out.shape[0], dtype=torch.bool, device=DEV)
        bad[[3, 7]] = True
        assert out[bad].isnan().all(), "a token with an invalid id must come out NaN"
        assert torch.isfinite(out[~bad]).all()
        ok = moeyard.experts(d["hidden_states"], d["topk_ids"], *args[2:], backend=backend).detach()
        torch.testing.assert_close(out[~bad], ok[~bad])
        moeyard.set_debug(True)
        with pytest.raises(ValueError, match=r"^topk_ids: "):
            moeyard.experts(*args, backend=backend)
    finally:
        moeyard.set_debug(None)


@pytest.mark.parametrize("backend", cuda_backends(torch.bfloat16))
def test_bias_gradient_accumulation_bf16(backend):
    """Many rows per expert: the bias gradients are sums over thousands of rows and must not be
    accumulated in bfloat16."""
    check_backend(backend, make_inputs(4096, 64, 32, 4, 2, bias=True), torch.bfloat16, device=DEV)


@pytest.mark.parametrize("backend", [b for b in ("grouped_mm", "triton") if b in cuda_backends(torch.bfloat16)])
def test_cuda_graph_captures_whole_layer(backend):
    """Router + dispatch + experts + combine + aux loss, forward and backward, captured once and
    replayed on new inputs and weights: replay equals an eager step on those (no host sync anywhere)."""
    cfg = MoEConfig(
        num_experts=8,
        hidden_size=128,
        intermediate_size=64,
        top_k=2,
        aux_loss_coef=0.01,
        z_loss_coef=0.001,
        num_shared_experts=1,
        shared_expert_gate=True,
    )
    layer = MoE(cfg, backend=backend).to(DEV, torch.bfloat16)
    params = list(layer.parameters())
    x = torch.randn(256, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        out = layer(x)
        loss = (out.float() * dy.float()).sum() + layer.aux_loss
        return [out.detach()] + list(torch.autograd.grad(loss, [x] + params))

    eager = step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    # the warm-up's aux_loss and routing keep its autograd graph: free them before, not inside, the capture
    layer.aux_loss = layer.routing = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    with torch.no_grad():  # new inputs and weights: new routing, read by the captured kernels
        x.copy_(torch.randn_like(x))
        dy.copy_(torch.randn_like(dy))
        for p in params:
            p.add_(torch.randn_like(p) * 0.02)
    graph.replay()
    want = step()
    for got, ref in zip(static, want, strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert not torch.equal(static[0], eager[0])
