"""The shared experts' fused form (:mod:`moeyard.shared_triton`) on a CUDA GPU: bfloat16 at qwen3.5-35b-a3b's
shared-expert sizes against the torch form in float64 (judged against the torch form's own bfloat16 error), the
layer's output and gradients with and without it, and a CUDA graph capture of forward + backward (no host sync)."""

import pytest
import torch

from helpers import EPS, rel_err, shared_expert_grads
from moeyard import MoE, MoEConfig
from moeyard.activations import Activation
from moeyard.layer import SharedExpert
from moeyard.shared_triton import add_shared, fused_ready

pytestmark = pytest.mark.cuda
DEV = "cuda"


@pytest.mark.parametrize("gate", [True, False])
@pytest.mark.parametrize("T", [4097, 128])
def test_bf16_matches_float64(gate, T):
    torch.manual_seed(0)
    H, I = 2048, 512
    shared = SharedExpert(H, I, Activation(), gate=gate, device=DEV, dtype=torch.bfloat16)
    ref = SharedExpert(H, I, Activation(), gate=gate, device=DEV, dtype=torch.float64)
    ref.load_state_dict({k: v.double() for k, v in shared.state_dict().items()})
    x, routed, dy = (torch.randn(T, H, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    assert fused_ready(shared, x, routed)
    fused = shared_expert_grads(shared, x, routed, dy, True)
    plain = shared_expert_grads(shared, x, routed, dy, False)
    exact = shared_expert_grads(ref, x.double(), routed.double(), dy.double(), False)
    for i, (f, p, e) in enumerate(zip(fused, plain, exact, strict=True)):
        assert rel_err(f, e) <= 2 * rel_err(p, e) + EPS[torch.bfloat16], (i, rel_err(f, e), rel_err(p, e))


def test_layer_with_and_without(monkeypatch):
    import moeyard.layer as layer

    cfg = MoEConfig(
        hidden_size=1024,
        intermediate_size=256,
        num_experts=16,
        top_k=4,
        num_shared_experts=1,
        shared_intermediate_size=512,
        shared_expert_gate=True,
    )
    torch.manual_seed(1)
    moe = MoE(cfg, backend="triton", device=DEV, dtype=torch.bfloat16)
    x = torch.randn(2, 300, 1024, device=DEV, dtype=torch.bfloat16)
    dy = torch.randn_like(x)

    def run():
        xx = x.clone().requires_grad_()
        for p in moe.parameters():
            p.grad = None
        y = moe(xx)
        y.backward(dy)
        return [y.detach(), xx.grad] + [p.grad for p in moe.parameters()]

    fused = run()
    monkeypatch.setattr(layer, "fused_ready", lambda *a: False)
    plain = run()
    for f, p in zip(fused, plain, strict=True):
        assert rel_err(f, p.double()) < 2e-2


def test_cuda_graph():
    """Forward + backward captured in a CUDA graph (the form makes no host sync) replays the eager result."""
    torch.manual_seed(2)
    H, I, T = 512, 256, 1000
    shared = SharedExpert(H, I, Activation(), gate=True, device=DEV, dtype=torch.bfloat16)
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    routed = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
    dy = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)

    def step():
        x.grad = None
        for p in shared.parameters():
            p.grad = None
        add_shared(shared, x, routed.clone()).backward(dy)
        return x.grad, shared.gate.weight.grad

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            eager = [t.clone() for t in step()]
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    x.data.copy_(x.detach())
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(outs, eager, strict=True):
        torch.testing.assert_close(a, b)
