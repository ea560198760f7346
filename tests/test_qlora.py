"""QLoRA: NF4 expert weights (``moeyard.quant.NF4Experts``) in the routed FFN, every CPU backend: the
output and the gradients (x, routing weights, LoRA factors) equal those of the same call on the weights
bitsandbytes dequantises from the same storage (same math, so exactly); only the active experts are
dequantised, autograd keeps no dense weight between forward and backward; the MoE layer and PEFT
(through ``fuse_lora``) train adapters on a quantised base.
"""

import gc
import weakref

import pytest
import torch

import moeyard
from helpers import LORA_SCALING, add_lora, bnb_dequantize, cpu_backends, make_inputs, random_ids

pytest.importorskip("bitsandbytes")
from moeyard.quant import NF4Experts  # noqa: E402

BACKENDS = cpu_backends(torch.float32)
NAMES = ("gate_up_proj", "down_proj")


def _run(x, ids, tw, up, down, lora, backend, **kw):
    leaves = [x, tw] + [t for a in lora.values() for t in (a.lora_A, a.lora_B)]
    out = moeyard.experts(x, ids, tw, up, down, backend=backend, lora=lora, **kw)
    grads = torch.autograd.grad(
        out, leaves, torch.ones_like(out) * 0.01 + torch.linspace(-1, 1, out.numel()).view_as(out)
    )
    return [out, *grads]


def _case(T, H, I, E, K, rank=4, ids=None, transposed=False):
    inp = add_lora(make_inputs(T, H, I, E, K, ids=ids, transposed=transposed), rank)
    f = {k: v.float() for k, v in inp.items()}
    x = f["hidden_states"].requires_grad_()
    tw = f["topk_weights"].requires_grad_()
    lora = {
        n: moeyard.ExpertLoRA(
            lora_A=f[f"{n}.lora_A"].requires_grad_(), lora_B=f[f"{n}.lora_B"].requires_grad_(), scaling=LORA_SCALING[n]
        )
        for n in NAMES
    }
    q = [NF4Experts.from_float(f[n]) for n in NAMES]
    return x, inp["topk_ids"], tw, q, lora


CASES = [
    # (T, H, I, E, K, ids): code paths
    (40, 64, 32, 6, 2, None),  # balanced-ish random routing
    (30, 64, 32, 5, 2, "one_expert"),  # every token to experts 0 and 1: the others stay quantised, empty
    (17, 48, 40, 7, 3, None),  # prime E, H and I not multiples of 64 (each expert 48*80 = 60 blocks)
    (0, 64, 32, 4, 2, None),  # no tokens: nothing is dequantised, nothing hangs
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T,H,I,E,K,ids", CASES)
def test_equals_dequantised_weights(backend, T, H, I, E, K, ids):
    routed = torch.stack([torch.arange(K)] * T) if ids == "one_expert" else random_ids(T, K, E)
    x, ids, tw, q, lora = _case(T, H, I, E, K, ids=routed)
    got = _run(x, ids, tw, *q, lora, backend)
    want = _run(x, ids, tw, *(bnb_dequantize(s) for s in q), lora, backend)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gpt_oss_layout(backend):
    x, ids, tw, q, lora = _case(20, 64, 32, 4, 2, transposed=True)
    kw = dict(transposed=True, interleaved=True, activation="clamped_swiglu")
    got = _run(x, ids, tw, *q, lora, backend, **kw)
    want = _run(x, ids, tw, *(bnb_dequantize(s) for s in q), lora, backend, **kw)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_only_active_experts_and_no_dense_weight_kept(monkeypatch):
    x, _, tw, q, lora = _case(24, 64, 32, 6, 2)
    ids = torch.stack([torch.tensor([1, 4])] * 24)  # experts 1 and 4 only
    calls, alive = [], []
    real = NF4Experts.dequantize

    def spy(self, active=None, *, out=None):
        calls.append(active.clone())
        d = real(self, active, out=out)
        alive.append(weakref.ref(d))
        return d

    monkeypatch.setattr(NF4Experts, "dequantize", spy)
    out = moeyard.experts(x, ids, tw, *q, backend="grouped_mm", lora=lora)
    gc.collect()
    assert len(calls) == 2 and all(a.tolist() == [False, True, False, False, True, False] for a in calls)
    assert all(r() is None for r in alive), "autograd keeps a dequantised weight alive until backward"
    out.sum().backward()
    assert len(calls) == 4  # backward dequantised each weight once more
    assert lora["gate_up_proj"].lora_A.grad is not None and x.grad is not None


def test_moe_layer_qlora():
    cfg = moeyard.MoEConfig(num_experts=4, hidden_size=64, intermediate_size=32, top_k=2)
    torch.manual_seed(0)
    layer = moeyard.MoE(cfg, backend="bmm_padded")
    dense = moeyard.MoE(cfg, backend="bmm_padded")
    dense.load_state_dict(layer.state_dict())
    moeyard.quantize_experts(layer, "nf4")
    with torch.no_grad():
        dense.gate_up_proj.copy_(bnb_dequantize(layer.gate_up_proj))
        dense.down_proj.copy_(bnb_dequantize(layer.down_proj))
    for m in (layer, dense):
        torch.manual_seed(1)
        m.add_lora(4)
        torch.nn.init.normal_(m.lora.gate_up_proj.lora_B.weight)
    x = torch.randn(2, 5, 64)
    y, y_ref = layer(x), dense(x)
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    y.sum().backward()
    y_ref.sum().backward()
    torch.testing.assert_close(layer.lora.gate_up_proj.lora_A.weight.grad, dense.lora.gate_up_proj.lora_A.weight.grad)
    with pytest.raises(TypeError, match="quantised"):
        layer.merge_lora()


def test_peft_qlora_matches_dequantised_model():
    pytest.importorskip("peft")
    from moeyard import verify
    from moeyard.integrations.transformers import register

    register()
    with verify.quiet_transformers():
        model = verify.build_model("qwen3_moe", seed=0, lora_rank=4)
        ref = verify.build_model("qwen3_moe", seed=0, lora_rank=4)
        moeyard.quantize_experts(model, "nf4")  # switches the PEFT wrappers to fuse_lora
        for m, r in zip(verify.experts_modules(model), verify.experts_modules(ref), strict=True):
            with torch.no_grad():
                r.gate_up_proj.copy_(bnb_dequantize(m.gate_up_proj))
                r.down_proj.copy_(bnb_dequantize(m.down_proj))
        ids, probe = verify.make_inputs(model)
        want = verify.forward_backward(ref, ids, probe)  # PEFT on eager experts, dense dequantised weights
        got = verify.run_moeyard(model, "grouped_mm", ids, probe)
    err, where = verify.max_rel_error(got, want)
    assert err <= verify.TOLERANCE[torch.float32], (err, where)
    assert sum("lora_" in k for k in got) == 8  # 2 layers x 2 projections x (A, B)


def test_quantised_weight_gets_no_gradient_and_dtype_errors():
    x, ids, tw, q, lora = _case(8, 64, 32, 4, 2)
    with pytest.raises(TypeError, match="hidden_states: expected dtype"):
        moeyard.experts(x.double(), ids, tw.double(), *q, backend="loop")
