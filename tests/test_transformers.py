"""The transformers experts implementation "moeyard" against transformers' eager experts (CPU, float32).

Tolerances (relative error max|got - ref| / max|ref|), and why:
- whole models: verify.TOLERANCE[float32] = 1e-4 (same routing; only summation order differs,
  amplified through 2 layers and the backward; ~1e-6 seen).
- one experts module: 1e-5 (a single layer, no amplification; ~1e-7 seen).
"""

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")

import moeyard  # noqa: E402
from moeyard import verify  # noqa: E402
from moeyard.experts import registry  # noqa: E402
from moeyard.integrations import transformers as integration  # noqa: E402

MODULE_TOL = 1e-5
CPU_BACKENDS = ["loop", "bmm_padded", "grouped_mm"]


@pytest.fixture(autouse=True)
def _registered():
    integration.register()
    with verify.quiet_transformers():
        yield


@pytest.fixture(autouse=True)
def _default_backend(monkeypatch):
    monkeypatch.delenv(registry.ENV_BACKEND, raising=False)
    previous = registry._default[0]
    yield
    registry._default[0] = previous


def _spy(monkeypatch, name: str) -> list[int]:
    """Wrap backend ``name``'s forward in the registry; returns the list of call sizes."""
    calls = []
    backend = registry._BACKENDS[name]

    def forward(x, *args, **kwargs):
        calls.append(x.shape[0])
        return backend.forward(x, *args, **kwargs)

    monkeypatch.setitem(registry._BACKENDS, name, dataclasses.replace(backend, forward=forward))
    return calls


# ------------------------------------------------------------------ whole models


@pytest.mark.parametrize("arch", verify.REQUIRED)
def test_model_parity_every_cpu_backend(arch):
    assert set(CPU_BACKENDS) <= set(moeyard.available_backends("cpu", torch.float32))
    results = verify.check_arch(verify.ARCHS[arch], CPU_BACKENDS, device="cpu", dtype=torch.float32)
    bad = [r for r in results if r.status != "pass"]
    assert not bad, bad
    assert all(r.limit == verify.TOLERANCE[torch.float32] for r in results)


def test_check_arch_detects_a_wrong_backend(monkeypatch):
    """The harness can fail: a backend 0.1% off is reported as a failure."""
    loop = registry._BACKENDS["loop"]
    off = dataclasses.replace(loop, forward=lambda *a, **k: loop.forward(*a, **k) * 1.001)
    monkeypatch.setitem(registry._BACKENDS, "loop", off)
    (result,) = verify.check_arch(verify.ARCHS["qwen3_moe"], ["loop"], device="cpu", dtype=torch.float32)
    assert result.status == "fail" and result.error > verify.TOLERANCE[torch.float32]


def test_registered_name_is_accepted():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    integration.register()  # idempotent
    assert ALL_EXPERTS_FUNCTIONS["moeyard"] is integration.moeyard_experts_forward
    model = verify.build_model("mixtral")
    assert model.get_correct_experts_implementation("moeyard") == "moeyard"


def test_set_experts_implementation_switches(monkeypatch):
    calls = _spy(monkeypatch, "loop")
    moeyard.set_backend("loop")
    model = verify.build_model("qwen3_moe")
    ids, probe = verify.make_inputs(model)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        assert calls == []
        model.set_experts_implementation("moeyard")
        assert {m.config._experts_implementation for m in verify.experts_modules(model)} == {"moeyard"}
        got = model(input_ids=ids).logits
        assert len(calls) == model.config.num_hidden_layers
        model.set_experts_implementation("eager")
        again = model(input_ids=ids).logits
    assert len(calls) == model.config.num_hidden_layers
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(again, ref, rtol=0, atol=0)


def test_from_pretrained_with_moeyard(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    calls = _spy(monkeypatch, "grouped_mm")
    moeyard.set_backend("grouped_mm")
    model = verify.build_model("olmoe")
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(
        tmp_path, experts_implementation="moeyard", attn_implementation="eager"
    )
    assert loaded.config._experts_implementation == "moeyard"
    ids, _ = verify.make_inputs(model)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
    assert len(calls) == model.config.num_hidden_layers
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", verify.REQUIRED)
def test_generate_matches_eager(monkeypatch, arch):
    # greedy decoding with transformers' KV cache: a prefill call over the prompt, then one call per new token
    # with one token per sequence; moeyard's experts (grouped_mm, spied on) give eager's tokens and, at every
    # step, its logits
    calls = _spy(monkeypatch, "grouped_mm")
    moeyard.set_backend("grouped_mm")
    ref = verify.build_model(arch).eval()
    got = verify.build_model(arch, experts_implementation="moeyard").eval()
    ids = torch.randint(0, ref.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    kw = dict(
        attention_mask=torch.ones_like(ids),
        max_new_tokens=5,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
    )
    want, out = ref.generate(ids, **kw), got.generate(ids, **kw)
    assert torch.equal(out.sequences, want.sequences)
    for a, b in zip(out.logits, want.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    layers = len(calls) // 5  # the experts' calls per forward: a layer may be dense
    assert layers > 0 and len(calls) == 5 * layers
    assert calls[:layers] == [14] * layers and calls[layers:] == [2] * (4 * layers)  # prefill, then 2 per step


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_compiled_generate_matches_eager(arch):
    # generate with a static KV cache and a compile config compiles the decoding step (fullgraph; transformers
    # compiles on CUDA only unless told, as here): moeyard's triton experts (Triton's interpreter on CPU) decode
    # the tokens of the uncompiled run, logits close at every step
    pytest.importorskip("triton")
    from transformers import CompileConfig

    moeyard.set_backend("triton")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = verify.build_model(arch, experts_implementation="moeyard").eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    kw = dict(
        attention_mask=torch.ones_like(ids),
        max_new_tokens=5,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
        cache_implementation="static",
    )
    want = model.generate(ids, disable_compile=True, **kw)
    config = CompileConfig(fullgraph=True, mode="default")
    config._compile_all_devices = True
    got = model.generate(ids, compile_config=config, **kw)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # the decoding step was compiled
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("how", ["set_backend", "env"])
@pytest.mark.parametrize("backend", ["loop", "bmm_padded"])
def test_default_backend_is_used(monkeypatch, how, backend):
    spies = {name: _spy(monkeypatch, name) for name in CPU_BACKENDS}
    if how == "set_backend":
        moeyard.set_backend(backend)
    else:
        moeyard.set_backend(None)
        monkeypatch.setenv(registry.ENV_BACKEND, backend)
    model = verify.build_model("mixtral", experts_implementation="moeyard")
    ids, _ = verify.make_inputs(model)
    with torch.no_grad():
        model(input_ids=ids)
    assert {name: len(c) for name, c in spies.items()} == {
        name: (model.config.num_hidden_layers if name == backend else 0) for name in CPU_BACKENDS
    }


# ------------------------------------------------------------------ one experts module


def _experts_module(arch: str) -> torch.nn.Module:
    return verify.experts_modules(verify.build_model(arch))[0]


def _routing(T: int, K: int, E: int, *, sentinels: bool = False):
    scores = torch.randn(T, E)
    weights, ids = scores.softmax(-1).topk(K, dim=-1)
    if sentinels:  # expert parallel: pairs owned by other ranks carry id E and weight 0
        drop = torch.rand(T, K) < 0.4
        drop[0] = True  # a token with no local expert at all
        ids, weights = ids.masked_fill(drop, E), weights.masked_fill(drop, 0.0)
    return ids, weights


def _module_run(mod, impl: str, x, ids, weights) -> dict[str, torch.Tensor]:
    """Forward + backward of the experts module under ``impl``; output and all gradients."""
    mod.config._experts_implementation = impl
    mod.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    weights = weights.detach().clone().requires_grad_()
    out = mod(x, ids, weights)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=out.dtype))
    res = {"out": out.detach(), "grad.x": x.grad, "grad.weights": weights.grad}
    res.update({"grad." + n: p.grad for n, p in mod.named_parameters()})
    return {k: v.double() for k, v in res.items()}


def _assert_module_parity(
    mod, x, ids, weights, *, backends=CPU_BACKENDS, tol: float = MODULE_TOL, ref_impl: str = "eager"
):
    ref = _module_run(mod, ref_impl, x, ids, weights)
    if ref_impl != "eager":  # transformers' batched_mm leaves router gradients at sentinel slots
        ref["grad.weights"] = ref["grad.weights"].masked_fill(ids >= mod.num_experts, 0)
    for backend in backends:
        with moeyard.use_backend(backend):
            got = _module_run(mod, "moeyard", x, ids, weights)
        err, where = verify.max_rel_error(got, ref)
        assert err <= tol, f"{backend}: {err:.2e} at {where}"


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_experts_module_compiles_fullgraph(monkeypatch, arch):
    # torch.compile(fullgraph=True) of an experts module on the triton backend (gpt-oss: clamped SwiGLU, biases),
    # compiled before any eager call: forward and every gradient equal to eager's
    pytest.importorskip("triton")
    from moeyard.experts.triton import options as options_module

    monkeypatch.setattr(options_module, "_BUILT", {})
    mod = _experts_module(arch)
    mod.config._experts_implementation = "moeyard"
    ids, weights = _routing(10, 2, mod.num_experts)
    x = torch.randn(10, mod.gate_up_proj.shape[-1])

    def run(fn):
        xi, wi = x.clone().requires_grad_(), weights.clone().requires_grad_()
        out = fn(xi, ids, wi)
        return [out.detach()] + list(torch.autograd.grad(out.square().sum(), [xi, wi, *mod.parameters()]))

    with moeyard.use_backend("triton"):
        got = run(torch.compile(mod, backend="aot_eager", fullgraph=True))
        want = run(mod)
    assert len(got) == len(want) == 3 + len(list(mod.parameters()))
    for a, b in zip(got, want, strict=True):
        assert b.abs().sum() > 0 and torch.allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["loop", "bmm_padded", "grouped_mm"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_expert_parallel_sentinels_match_eager(arch, backend):
    mod = _experts_module(arch)
    E, H = mod.num_experts, mod.gate_up_proj.shape[-1]
    ids, weights = _routing(12, 2, E, sentinels=True)
    x = torch.randn(12, H)
    if hasattr(mod, "_is_expert_parallel"):  # transformers that flag it drop sentinels only when expert parallel
        mod._is_expert_parallel = True
        ref_impl = "eager"
    else:  # older transformers: eager has no sentinel class; batched_mm drops sentinels (zero weights)
        ref_impl = "batched_mm"
    _assert_module_parity(mod, x, ids, weights, backends=[backend], ref_impl=ref_impl)


def test_sentinels_without_expert_parallel_flag_are_an_error():
    mod = _experts_module("qwen3_moe")
    if not hasattr(mod, "_is_expert_parallel"):
        pytest.skip("this transformers drops sentinels unconditionally (no _is_expert_parallel flag)")
    ids, weights = _routing(6, 2, mod.num_experts, sentinels=True)
    mod.config._experts_implementation = "moeyard"
    with pytest.raises(ValueError, match="topk_ids"):
        mod(torch.randn(6, mod.gate_up_proj.shape[-1]), ids, weights)


def test_post_expert_norm_matches_eager():
    cfg_mod = pytest.importorskip("transformers.models.muse_spark.configuration_muse_spark")
    from transformers.models.muse_spark.modeling_muse_spark import MuseSparkExperts

    config = cfg_mod.MuseSparkTextConfig(
        hidden_size=64,
        moe_hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
    )
    mod = MuseSparkExperts(config)
    assert mod.has_post_expert_norm
    with torch.no_grad():
        for p in mod.parameters():
            p.normal_(0, 0.1)
    ids, weights = _routing(10, 2, mod.num_experts)
    _assert_module_parity(mod, torch.randn(10, 64), ids, weights)


def test_bf16_hidden_with_float32_weights_keeps_dtype():
    mod = _experts_module("qwen3_moe").to(torch.bfloat16)
    ids, weights = _routing(8, 2, mod.num_experts)  # router weights in float32, as transformers' routers give
    x = torch.randn(8, mod.gate_up_proj.shape[-1], dtype=torch.bfloat16)
    mod.config._experts_implementation = "eager"
    ref = mod(x, ids, weights)
    mod.config._experts_implementation = "moeyard"
    out = mod(x, ids, weights)
    assert out.dtype == torch.bfloat16
    # bf16: eager weights in float32 after the down projection, moeyard in bf16 (2**-8 relative)
    torch.testing.assert_close(out, ref.to(out.dtype), rtol=2e-2, atol=2e-3)


# ------------------------------------------------------------------ activation mapping


def _activation(mod, compiled: bool):
    """``integration.module_activation(mod)``, or what a graph traced by ``torch.compile(fullgraph=True)`` sees
    (recorded while tracing)."""
    if not compiled:
        return integration.module_activation(mod)
    torch._dynamo.reset()
    seen = []

    def traced(x):
        seen.append(integration.module_activation(mod))
        return x + 1

    torch.compile(traced, fullgraph=True)(torch.zeros(1))
    return seen[0]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize(
    "arch, expected",
    [
        ("qwen3_moe", "swiglu"),
        ("olmoe", "swiglu"),
        ("lfm2_moe", "swiglu"),
        ("nemotron_h", "relu2"),
        ("gpt_oss", "clamped_swiglu"),
    ],
)
def test_named_activation_when_equivalent(arch, expected, compiled):
    # compiled: the named activation too (traced, the detection once found none: every compiled module then ran
    # the unfused custom path)
    mod = _experts_module(arch)
    act = _activation(mod, compiled)
    assert act.name == expected and act.fn is None
    if expected == "clamped_swiglu":
        assert (act.alpha, act.limit) == (mod.alpha, mod.limit)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_custom_gate_is_passed_as_callable(compiled):
    mod = _experts_module("qwen3_moe")
    mod.act_fn = torch.nn.GELU(approximate="tanh")  # no named equivalent
    assert _activation(mod, compiled).fn is not None
    gpt = _experts_module("gpt_oss")
    gpt.limit = None  # the clamped form cannot be established from attributes
    act = _activation(gpt, compiled)
    assert act.fn is not None and act.fn_gated


def test_custom_gate_override_is_not_mistaken_for_gpt_oss():
    gpt = _experts_module("gpt_oss")

    def scaled_gate(self, gate_up):  # alpha/limit present, but a different function
        return 2 * type(self)._apply_gate(self, gate_up)

    gpt._apply_gate = scaled_gate.__get__(gpt)
    act = integration.module_activation(gpt)
    assert act.fn is not None
    ids, weights = _routing(6, 2, gpt.num_experts)
    _assert_module_parity(gpt, torch.randn(6, gpt.gate_up_proj.shape[1]), ids, weights)


def test_bf16_verify_judges_on_inputs_that_route_like_float64():
    """bf16 is judged against eager-bf16's own error on an input where float64, eager and moeyard
    route every token alike (a near tie flipped by rounding is no implementation's fault)."""
    (r,) = verify.check_arch(verify.ARCHS["qwen3_moe"], ["grouped_mm"], device="cpu", dtype=torch.bfloat16)
    assert r.status == "pass", r
    assert 0 < r.error <= r.limit < 0.2


def test_same_routing_ignores_slot_order_only():
    a = [torch.tensor([[0, 3], [2, 1]])]
    assert verify._same_routing(a, [torch.tensor([[3, 0], [1, 2]])])
    assert not verify._same_routing(a, [torch.tensor([[0, 3], [2, 4]])])
    assert not verify._same_routing(a, a + a)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_gradient_checkpointing(monkeypatch, arch, reentrant):
    # transformers' gradient checkpointing over moeyard experts: logits and every gradient as the eager experts
    # without checkpointing, the experts run twice per layer (forward, then recomputed in backward)
    model = verify.build_model(arch)
    ids, probe = verify.make_inputs(model)
    ref = verify.forward_backward(model, ids, probe)
    calls = _spy(monkeypatch, "grouped_mm")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    got = verify.run_moeyard(model, "grouped_mm", ids, probe)
    layers = len(verify.experts_modules(model))
    assert len(calls) == 2 * layers
    err, where = verify.max_rel_error(got, ref)
    assert err <= verify.TOLERANCE[torch.float32], (err, where)
