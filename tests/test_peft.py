"""PEFT LoRA on transformers experts through moeyard (CPU, float32): logits and every LoRA gradient
against PEFT on transformers' eager experts, on the real architectures, automatically and through
``fuse_lora``; PEFT's own workflows (save / load, merge, disable, switch, several adapters) unchanged.
"""

import warnings

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from moeyard import verify  # noqa: E402
from moeyard.integrations import (
    peft as integration,  # noqa: E402
    transformers as tf_integration,  # noqa: E402
)

BACKENDS = ["loop", "bmm_padded", "grouped_mm"]
TOL = verify.TOLERANCE[torch.float32]


@pytest.fixture(autouse=True)
def _registered():
    tf_integration.register()
    with verify.quiet_transformers(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


@pytest.mark.parametrize("fuse", [False, True], ids=["auto", "fuse_lora"])
@pytest.mark.parametrize("arch", verify.REQUIRED)
def test_parity_with_peft_on_eager(arch, fuse):
    results = verify.check_arch(
        verify.ARCHS[arch], BACKENDS, device="cpu", dtype=torch.float32, lora_rank=4, fuse_lora=fuse
    )
    bad = [r for r in results if r.status != "pass"]
    assert not bad, bad


def _model(rank=4, seed=0, arch="qwen3_moe"):
    return verify.build_model(arch, seed=seed, lora_rank=rank)


def _logits(model, impl, ids):
    model.set_experts_implementation(impl)
    with torch.no_grad():
        return model(input_ids=ids).logits


def _factor_proxies(monkeypatch) -> list[str]:
    """Count every evaluation of PEFT's W + dW parametrizations."""
    from peft.tuners.lora import layer

    calls = []
    for cls in (layer._LoraFactorsProxy, layer._LoraParameterProxy):
        real = cls.forward
        monkeypatch.setattr(cls, "forward", lambda self, W, real=real, n=cls.__name__: calls.append(n) or real(self, W))
    return calls


def _add_other_adapter(model):
    """A second adapter "other" (r=2) on the same expert parameters, with random factors."""
    model.add_adapter(
        "other",
        peft.LoraConfig(
            r=2, lora_alpha=4, target_modules=[], target_parameters=model.peft_config["default"].target_parameters
        ),
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".other." in name:
                p.normal_(0, 0.3)


def test_fused_path_never_evaluates_the_fold(monkeypatch):
    model = _model()
    ids, probe = verify.make_inputs(model)
    ref = verify.forward_backward(model, ids, probe)  # PEFT on eager experts: the fold runs
    calls = _factor_proxies(monkeypatch)
    verify.forward_backward(model, ids, probe)
    assert calls, "the eager reference should go through PEFT's fold"
    integration.fuse_lora(model)
    calls.clear()
    got = verify.run_moeyard(model, "grouped_mm", ids, probe)
    assert calls == []
    err, where = verify.max_rel_error(got, ref)
    assert err <= TOL, (err, where)
    assert any("lora_A" in k for k in got) and any("lora_B" in k for k in got)


def test_save_load_round_trip(tmp_path):
    model = _model()
    integration.fuse_lora(model)
    ids, _ = verify.make_inputs(model)
    want = _logits(model, "moeyard", ids)
    model.save_pretrained(tmp_path)
    base = verify.build_model("qwen3_moe", seed=0)
    loaded = peft.PeftModel.from_pretrained(base, tmp_path)
    integration.fuse_lora(loaded)
    torch.testing.assert_close(_logits(loaded, "moeyard", ids), want, rtol=0, atol=0)
    plain = _logits(verify.build_model("qwen3_moe", seed=0), "eager", ids)
    assert (plain - want).abs().max() > 1e-3  # the saved adapters were loaded, not dropped


@pytest.mark.parametrize("fuse", [False, True], ids=["auto", "fuse_lora"])
def test_merge_disable_and_switch(fuse):
    model = _model()
    ids, _ = verify.make_inputs(model)
    plain = verify.build_model("qwen3_moe", seed=0)
    base_logits = _logits(plain, "eager", ids)
    if fuse:
        integration.fuse_lora(model)
    adapted = _logits(model, "moeyard", ids)
    assert (adapted - base_logits).abs().max() > 1e-3  # the adapters matter
    with model.disable_adapter():
        torch.testing.assert_close(_logits(model, "moeyard", ids), base_logits, rtol=1e-5, atol=1e-5)
    _add_other_adapter(model)  # a second adapter, switched to and back
    model.set_adapter("other")
    torch.testing.assert_close(_logits(model, "moeyard", ids), _logits(model, "eager", ids), rtol=1e-5, atol=1e-5)
    model.set_adapter("default")
    torch.testing.assert_close(_logits(model, "moeyard", ids), adapted, rtol=1e-5, atol=1e-5)
    merged = model.merge_and_unload()
    torch.testing.assert_close(_logits(merged, "moeyard", ids), adapted, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fuse", [False, True], ids=["auto", "fuse_lora"])
def test_several_active_adapters_fall_back_with_a_warning(fuse):
    model = _model()
    _add_other_adapter(model)
    model.base_model.set_adapter(["default", "other"])
    if fuse:
        integration.fuse_lora(model)
    ids, _ = verify.make_inputs(model)
    want = _logits(model, "eager", ids)
    integration._warned.clear()
    with pytest.warns(UserWarning, match="PEFT's"):
        got = _logits(model, "moeyard", ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fuse_lora_needs_wrapped_experts():
    with pytest.raises(ValueError, match="no PEFT ParamWrapper"):
        integration.fuse_lora(verify.build_model("qwen3_moe", seed=0))


def test_unfused_path_warns_once_naming_fuse_lora():
    """Trained as wrapped (no fuse_lora), PEFT's fold runs once per forward: one warning, the first time,
    naming fuse_lora; none on later forwards, none once fused (and the fold then never runs)."""
    model = _model()
    ids, _ = verify.make_inputs(model)
    integration._warned.clear()
    with pytest.warns(UserWarning, match=r"fuse_lora\(model\)") as record:
        _logits(model, "moeyard", ids)
    assert sum("fuse_lora" in str(w.message) for w in record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        _logits(model, "moeyard", ids)  # once per process
        integration._warned.clear()
        integration.fuse_lora(model)
        _logits(model, "moeyard", ids)  # fused: no fold, no warning
