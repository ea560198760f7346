"""The layer benchmark's CUDA-graph timing (``moeyard bench --cuda-graph``) on a GPU: a captured forward +
backward replays the layer's computation (new inputs copied into the captured ones give the eager layer's
output and gradients), and the benchmark reports graphed rows, bf16 and under an FP8 recipe on Hopper."""

import pytest
import torch

import moeyard
from moeyard import bench
from moeyard.bench.layer import graphed

pytestmark = pytest.mark.cuda


def test_graphed_step_replays_the_layer():
    torch.manual_seed(0)
    cfg = moeyard.MoEConfig(num_experts=8, hidden_size=256, intermediate_size=128, top_k=2)
    layer = moeyard.MoE(cfg, backend="triton", device="cuda", dtype=torch.bfloat16)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    out = {}

    def step():
        for t in [x, *layer.parameters()]:
            t.grad = None
        y = layer(x)
        y.backward(dy)
        out["y"] = y

    def drop():  # what the layer keeps of its last step, made outside the capture: not freed inside it
        layer.aux_loss = layer.routing = None

    replay = graphed(step, torch.device("cuda"), after=drop)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))  # new data in the captured input
    replay(0)
    torch.cuda.synchronize()
    got_y, got_dx, got_dw = out["y"].clone(), x.grad.clone(), layer.gate_up_proj.grad.clone()
    x2 = x.detach().clone().requires_grad_()
    for p in layer.parameters():
        p.grad = None
    want_y = layer(x2)
    want_y.backward(dy)
    assert torch.equal(got_y, want_y) and torch.equal(got_dx, x2.grad)
    assert torch.equal(got_dw, layer.gate_up_proj.grad)


def test_bench_rows_under_cuda_graphs():
    hopper = torch.cuda.get_device_capability() == (9, 0)
    result = bench.run(
        bench.BenchOptions(
            shapes=["2048,256,128,8,2"],
            backends=["triton"],
            recipes=["none", "fp8_rowwise_gw_hp"] if hopper else None,
            peers=False,
            cuda_graph=True,
            warmup=2,
            iters=5,
        )
    )
    assert result["env"]["cuda_graph"] is True
    for row in result["rows"]:
        assert "error" not in row, row.get("detail")
        assert row["fwd_ms"] > 0 and row["fwdbwd_ms"] > row["fwd_ms"] * 0.5
