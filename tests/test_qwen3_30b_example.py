"""examples/qwen3_30b_qlora.py at ``--tiny`` on CPU: the run finishes with finite losses and a summary; the
experts hold NF4 storage; only LoRA factors train and all of them get gradients; gradient checkpointing is on
and recomputes the experts (gradients equal those without checkpointing); the chunked cross-entropy equals
the plain one.
"""

import importlib.util
import json
import pathlib

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")
pytest.importorskip("transformers")

import moeyard  # noqa: E402,F401  (registers the "moeyard" experts implementation)
from moeyard.quant import NF4Experts  # noqa: E402

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "examples" / "qwen3_30b_qlora.py"
pytestmark = pytest.mark.xdist_group("qwen3_30b_example")  # one pytest-xdist worker runs the example once


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("qwen3_30b_qlora", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def run(example, tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    summary = example.main(["--tiny", "--steps", "2", "--out", str(out)])
    return summary, out


def _loss(example, model, seed=5, batch=2, seq=16):
    lm = model.base_model.model
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, lm.config.vocab_size, (batch, seq + 1), generator=g)
    hidden = lm.model(input_ids=ids[:, :-1], use_cache=False).last_hidden_state
    return example.chunked_lm_loss(hidden, lm.lm_head, ids[:, 1:], chunk=7)


def test_run_and_summary(run):
    summary, out = run
    assert summary["losses_finite"] and len(summary["steps"]) == 2
    assert summary["gradient_checkpointing"] is True
    saved = json.loads((out / "qwen3_30b_qlora.json").read_text())
    assert saved["tokens_per_step"] == 4 * 64 and saved["memory"]["nf4_expert_bytes"] > 0
    assert saved["memory"]["lora_params"] > 0 and saved["fused_experts_modules"] == 2
    assert saved["table_line"].startswith("| qwen3-30b-a3b-tiny QLoRA")


def test_experts_are_nf4_and_only_lora_trains(example, run):
    model = run[0]["_model"]
    experts = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeExperts"]
    assert len(experts) == 2
    for m in experts:
        assert isinstance(m.gate_up_proj, NF4Experts) and isinstance(m.down_proj, NF4Experts)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_A" in n or "lora_B" in n for n in trainable)
    names = " ".join(trainable)
    for target in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert target in names, target
    wrapped = sorted(m.parameter_name for m in model.modules() if hasattr(m, "parameter_name") and hasattr(m, "lora_A"))
    assert wrapped == ["down_proj", "down_proj", "gate_up_proj", "gate_up_proj"]  # 2 layers
    assert sum(".mlp.experts." in n for n in trainable) == 2 * 2 * 2  # layers x weights x (A, B)
    model.zero_grad(set_to_none=True)
    _loss(example, model).backward()
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and torch.isfinite(p.grad).all(), n
            assert p.grad.abs().sum() > 0, n  # after the run's AdamW steps B != 0, so A gets a gradient too
        else:
            assert p.grad is None, n
    model.zero_grad(set_to_none=True)


def test_checkpointing_recomputes_experts(example, run, monkeypatch):
    model = run[0]["_model"]
    lm = model.base_model.model
    assert example.is_checkpointing(lm)
    calls = []
    real = NF4Experts.dequantize
    monkeypatch.setattr(NF4Experts, "dequantize", lambda self, *a, **k: (calls.append(1), real(self, *a, **k))[1])

    def grads():
        model.zero_grad(set_to_none=True)
        calls.clear()
        loss = _loss(example, model)
        loss.backward()
        g = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        model.zero_grad(set_to_none=True)
        return loss.detach(), g, len(calls)

    loss_ckpt, g_ckpt, n_ckpt = grads()
    model.gradient_checkpointing_disable()
    try:
        assert not example.is_checkpointing(lm)
        loss_ref, g_ref, n_ref = grads()
    finally:
        model.gradient_checkpointing_enable()
    # 2 layers x 2 weights: forward + backward without; + the recomputed forward with checkpointing
    assert n_ref == 2 * 2 * 2 and n_ckpt == 2 * 2 * 3
    torch.testing.assert_close(loss_ckpt, loss_ref, rtol=0, atol=0)
    for n in g_ref:
        torch.testing.assert_close(g_ckpt[n], g_ref[n], rtol=1e-5, atol=1e-7, msg=n)


def test_chunked_cross_entropy_equals_plain(example):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 13, 24, generator=g, dtype=torch.float64).requires_grad_()
    head = torch.nn.Linear(24, 50, bias=False).double().requires_grad_(False)
    labels = torch.randint(0, 50, (2, 13), generator=g)
    labels[0, :3] = -100
    got = example.chunked_lm_loss(hidden, head, labels, chunk=5)
    (g_got,) = torch.autograd.grad(got * 3, hidden)
    want = F.cross_entropy(head(hidden).reshape(-1, 50), labels.reshape(-1), ignore_index=-100)
    (g_want,) = torch.autograd.grad(want * 3, hidden)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(g_got, g_want)
