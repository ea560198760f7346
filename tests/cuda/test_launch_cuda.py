"""moeyard.launch on a CUDA GPU: a layer's steps through the compiled kernels' launchers give the same bits
as through Triton's own launch path, bf16 and (on sm_90) ``fp8_rowwise_gw_hp``, and the direct path is taken."""

import pytest
import torch

import moeyard
from moeyard import launch

pytestmark = pytest.mark.cuda


def _sm90() -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


def _step(layer, x, dout):
    xi = x.clone().requires_grad_()
    out = layer(xi)
    layer.zero_grad(set_to_none=True)
    out.backward(dout)
    return [out.detach(), xi.grad] + [p.grad for p in layer.parameters() if p.requires_grad]


@pytest.mark.parametrize("recipe", [None, "fp8_rowwise_gw_hp"])
@pytest.mark.parametrize("tokens", [7, 300])
def test_direct_launches_give_the_same_bits(recipe, tokens):
    if recipe and not _sm90():
        pytest.skip("the FP8 fast path needs sm_90")
    torch.manual_seed(0)
    cfg = moeyard.MoEConfig(hidden_size=256, intermediate_size=128, num_experts=8, top_k=2)
    layer = moeyard.MoE(cfg, backend="triton", recipe=recipe).cuda().bfloat16()
    x = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn_like(x)
    previous = launch.set_enabled(False)
    try:
        want = _step(layer, x, dout)
        launch.set_enabled(True)
        _step(layer, x, dout)  # the first launch of each signature takes Triton's path
        before = launch.counts()
        got = _step(layer, x, dout)
        after = launch.counts()
    finally:
        launch.set_enabled(previous)
    assert after["direct"] - before["direct"] >= 5 and after["triton"] == before["triton"]
    assert len(got) == len(want) > 3
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
