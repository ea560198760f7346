"""QLoRA on a CUDA GPU: NF4 expert weights through the ``triton`` and ``grouped_mm`` backends in
bfloat16 give exactly what the same call on bitsandbytes' dequantised weights gives (same math, same
kernels), and the step makes no host sync (the dequantisation kernel included)."""

import pytest
import torch

import moeyard
from helpers import LORA_SCALING, add_lora, make_inputs

pytestmark = pytest.mark.cuda
pytest.importorskip("bitsandbytes")
from moeyard.quant import NF4Experts  # noqa: E402

NAMES = ("gate_up_proj", "down_proj")


def _case():
    inp = add_lora(make_inputs(600, 256, 128, 16, 4), 16)
    t = {k: (v.to("cuda", torch.bfloat16) if v.is_floating_point() else v.cuda()) for k, v in inp.items()}
    leaves = [t["hidden_states"].requires_grad_(), t["topk_weights"].requires_grad_()]
    lora = {}
    for n in NAMES:
        A, B = t[f"{n}.lora_A"].requires_grad_(), t[f"{n}.lora_B"].requires_grad_()
        lora[n] = moeyard.ExpertLoRA(lora_A=A, lora_B=B, scaling=LORA_SCALING[n])
        leaves += [A, B]
    return t, leaves, lora, [NF4Experts.from_float(t[n]) for n in NAMES]


def _step(t, leaves, lora, up, down, backend):
    out = moeyard.experts(t["hidden_states"], t["topk_ids"], t["topk_weights"], up, down, lora=lora, backend=backend)
    return [out.detach(), *torch.autograd.grad(out, leaves, torch.ones_like(out))]


@pytest.mark.parametrize("backend", ["triton", "grouped_mm"])
def test_equals_dequantised_weights(backend):
    t, leaves, lora, q = _case()
    got = _step(t, leaves, lora, *q, backend)
    dense = [s.dequantize() for s in q]
    want = _step(t, leaves, lora, *dense, backend)
    again = _step(t, leaves, lora, *dense, backend)
    # bit-exact where the backend itself is reproducible run to run (torch._grouped_mm was not: 2.3% of
    # the outputs one bf16 ulp apart between two QLoRA/dense calls on an H200, 2026-11-23)
    exact = all(torch.equal(a, w) for a, w in zip(again, want, strict=True))
    for g, w in zip(got, want, strict=True):
        scale = w.abs().max().item()
        torch.testing.assert_close(g, w, rtol=0, atol=0 if exact else 2**-7 * scale)
    if backend == "triton":
        assert exact


def test_no_host_sync():
    t, leaves, lora, q = _case()
    _step(t, leaves, lora, *q, "triton")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(t, leaves, lora, *q, "triton")
    finally:
        torch.cuda.set_sync_debug_mode("default")
