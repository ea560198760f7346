"""FP8 block storage (``moeyard.quant.FP8BlockExperts``) on a CUDA GPU: the Triton dequantisation kernel
gives the torch path's bits for the active experts only; the ``triton`` and ``grouped_mm`` backends on the
storage give exactly what they give on the dequantised weights (output and every gradient, LoRA on top);
no host sync in the dequantisation or a training step; a checkpoint loaded onto the GPU gives the logits
of the same checkpoint loaded on the CPU and moved."""

import pytest
import torch

import moeyard
from helpers import LORA_SCALING, add_lora, make_inputs
from moeyard.quant import FP8BlockExperts, fp8_block

pytestmark = pytest.mark.cuda
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
NAMES = ("gate_up_proj", "down_proj")


def _weights(shape, dtype):
    return (torch.randn(shape, device="cuda") * 0.05).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape,segments", [((7, 200, 300), None), ((16, 1536, 2048), (768, 768)), ((3, 144, 40), (72, 72))]
)
def test_kernel_equals_torch_path(dtype, shape, segments):
    s = FP8BlockExperts.from_float(_weights(shape, dtype), row_segments=segments)
    want = torch.full(s.shape, float("nan"), dtype=dtype, device="cuda")
    fp8_block.dequantize_torch(s, None, want)
    assert torch.equal(s.dequantize(), want)
    active = torch.arange(shape[0], device="cuda") % 3 == 1
    out = torch.full(s.shape, float("nan"), dtype=dtype, device="cuda")
    s.dequantize(active, out=out)
    assert torch.equal(out[active], want[active]) and out[~active].isnan().all()
    assert torch.equal(want.cpu(), fp8_block.dequantize_reference(s).float().to(dtype).cpu())


def _case(dtype=torch.bfloat16):
    inp = add_lora(make_inputs(600, 256, 192, 16, 4), 16)
    t = {k: (v.to("cuda", dtype) if v.is_floating_point() else v.cuda()) for k, v in inp.items()}
    leaves = [t["hidden_states"].requires_grad_(), t["topk_weights"].requires_grad_()]
    lora = {}
    for n in NAMES:
        A, B = t[f"{n}.lora_A"].requires_grad_(), t[f"{n}.lora_B"].requires_grad_()
        lora[n] = moeyard.ExpertLoRA(lora_A=A, lora_B=B, scaling=LORA_SCALING[n])
        leaves += [A, B]
    q = [
        FP8BlockExperts.from_float(t["gate_up_proj"], row_segments=(192, 192)),
        FP8BlockExperts.from_float(t["down_proj"]),
    ]
    return t, leaves, lora, q


def _step(t, leaves, lora, up, down, backend):
    out = moeyard.experts(t["hidden_states"], t["topk_ids"], t["topk_weights"], up, down, lora=lora, backend=backend)
    return [out.detach(), *torch.autograd.grad(out, leaves, torch.ones_like(out))]


@pytest.mark.parametrize("backend", ["triton", "grouped_mm"])
def test_backends_equal_dequantised_weights(backend):
    t, leaves, lora, q = _case()
    got = _step(t, leaves, lora, *q, backend)
    want = _step(t, leaves, lora, *(s.dequantize() for s in q), backend)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize("backend", ["triton", "grouped_mm"])
def test_no_host_sync(backend):
    t, leaves, lora, q = _case()
    _step(t, leaves, lora, *q, backend)  # warm-up (compiles, autotunes)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        q[0].dequantize(torch.arange(16, device="cuda") % 2)
        _step(t, leaves, lora, *q, backend)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_checkpoint_on_gpu(tmp_path):
    pytest.importorskip("transformers")
    from moeyard.quant import load_fp8_checkpoint
    from test_fp8_checkpoint import cast_parameters, tiny_qwen3_moe, write_fp8_checkpoint

    model = cast_parameters(tiny_qwen3_moe(hidden_size=160, moe_intermediate_size=72), torch.bfloat16)
    path = write_fp8_checkpoint(model, tmp_path).fp8
    on_gpu = load_fp8_checkpoint(path, device="cuda")
    moved = load_fp8_checkpoint(path).to("cuda")
    assert on_gpu.model.layers[0].mlp.experts.gate_up_proj.device.type == "cuda"
    assert on_gpu.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    ids = torch.randint(0, 64, (2, 9), device="cuda")
    with torch.no_grad(), moeyard.use_backend("triton"):
        assert torch.equal(on_gpu(input_ids=ids).logits, moved(input_ids=ids).logits)
        tokens = on_gpu.generate(ids, max_new_tokens=4, do_sample=False)
    assert tokens.shape == (2, 13)
