"""The benchmark runner: FLOP counts, the model registry, forced routing, rows on CPU."""

import dataclasses
import importlib.util
import json

import pytest
import torch

import moeyard
from helpers import load_benchmark
from moeyard import bench
from moeyard.bench import models
from moeyard.bench.peers import TorchGroupedMM, peer_config, peer_note

TINY = dict(warmup=1, iters=2, peers=True)
REQUIRED = [
    "mixtral-8x7b",
    "qwen3-30b-a3b",
    "qwen3-235b-a22b",
    "qwen3.5-35b-a3b",
    "qwen3-next-80b-a3b",
    "olmoe-1b-7b",
    "deepseek-v3",
    "kimi-k2",
    "glm-4.5",
    "gpt-oss-20b",
    "gpt-oss-120b",
    "llama-4-scout",
    "sonic-7b",
    "sonic-30b-a",
    "sonic-120b",
]


def _cfg(E=8, H=64, I=32, k=2, **kw):
    return moeyard.MoEConfig(num_experts=E, hidden_size=H, intermediate_size=I, top_k=k, **kw)


# ---------------------------------------------------------------- FLOPs


def test_flops_gated_plain_shared():
    assert bench.layer_flops(_cfg(), 100) == 6 * 100 * 2 * 64 * 32
    assert bench.layer_flops(_cfg(activation="gelu"), 100) == 4 * 100 * 2 * 64 * 32
    shared = _cfg(num_shared_experts=2, shared_intermediate_size=16)
    assert bench.layer_flops(shared, 100) == 6 * 100 * 64 * (2 * 32 + 2 * 16)
    assert bench.layer_flops(shared, 100, shared=False) == 6 * 100 * 2 * 64 * 32


def test_flops_anchor_shape():
    # ANCHORS.md: qwen3-30b-a3b, torch pipeline 11.7 ms fwd <-> 211 TFLOP/s
    m = models.get_model("qwen3-30b-a3b")
    flops = bench.layer_flops(m.moe_config(), m.tokens)
    assert flops == 6 * 32768 * 8 * 2048 * 768
    assert flops / 11.7 / 1e9 == pytest.approx(211, rel=0.01)


# ---------------------------------------------------------------- registry


def test_registry_has_the_required_models_with_sources():
    assert set(REQUIRED) <= set(models.model_names())
    for m in models.MODELS.values():
        assert m.source and m.tokens > 0
        assert isinstance(m.moe_config(), moeyard.MoEConfig)
    assert models.get_model("sonic-7b").tokens == 24576


def test_registry_router_schemes():
    oss = models.get_model("gpt-oss-20b").moe_config()
    assert (oss.activation, oss.expert_bias, oss.router_bias, oss.topk_before_score) == (
        "clamped_swiglu",
        True,
        True,
        True,
    )
    ds = models.get_model("deepseek-v3").moe_config()
    assert (
        ds.score_func,
        ds.score_correction_bias,
        ds.n_group,
        ds.topk_group,
        ds.routed_scaling_factor,
        ds.num_shared_experts,
    ) == ("sigmoid", True, 8, 4, 2.5, 1)
    q35 = models.get_model("qwen3.5-35b-a3b").moe_config()
    assert (q35.num_shared_experts, q35.shared_intermediate_size, q35.shared_expert_gate) == (1, 512, True)
    assert not models.get_model("olmoe-1b-7b").moe_config().norm_topk_prob


@pytest.mark.parametrize("name", list(models.MODELS))
def test_registry_scaled_down_layer_runs(name):
    cfg = models.get_model(name).moe_config()
    small = dataclasses.replace(
        cfg, hidden_size=64, intermediate_size=16, shared_intermediate_size=16 if cfg.shared_intermediate_size else None
    )
    layer = moeyard.MoE(small)
    out = layer(torch.randn(4, 64))
    assert out.shape == (4, 64) and torch.isfinite(out).all()


def test_get_model_unknown_names_known_ones():
    with pytest.raises(ValueError, match="model: unknown name 'nope'.*qwen3-30b-a3b"):
        models.get_model("nope")


@pytest.mark.parametrize("text", ["1,2,3", "a,2,3,4,1", "8,64,32,4,0", "8,64,-32,4,1", "8,64,32,2,4", ""])
def test_parse_shape_errors_name_the_flag(text):
    with pytest.raises(ValueError, match="--shape"):
        models.parse_shape(text)


def test_parse_shape_and_tokens():
    s = models.parse_shape(" 512, 256,128 ,8,2")
    c = s.moe_config()
    assert (s.tokens, c.hidden_size, c.intermediate_size, c.num_experts, c.top_k) == (512, 256, 128, 8, 2)
    assert models.with_tokens(s, 7).tokens == 7
    with pytest.raises(ValueError, match="--tokens"):
        models.with_tokens(s, 0)


def test_routed_only_drops_shared_experts():
    c = models.routed_only(models.get_model("qwen3.5-35b-a3b").moe_config())
    assert (c.num_shared_experts, c.shared_expert_gate) == (0, False)


# ---------------------------------------------------------------- routing


def _inputs(routing, T=2048, E=8, k=2, alpha=1.2):
    shape = models.parse_shape(f"{T},64,32,{E},{k}")
    opts = bench.resolve_options(bench.BenchOptions(device="cpu", routing=routing, zipf_alpha=alpha))
    return shape.moe_config(), bench.make_inputs(shape, opts)


def test_zipf_routing_skews_tokens_per_expert():
    cfg, inputs = _inputs("zipf")
    counts = bench.tokens_per_expert(cfg, inputs)
    T, k = 2048, 2
    assert counts.sum() == T * k
    assert counts[0] > 2.5 * counts.mean()  # p_0 ~ 0.43: in ~75% of the tokens' top-2
    assert counts[0] > counts[2] > counts[7]
    # the layer itself routes the same way
    layer = moeyard.MoE(cfg)
    with torch.no_grad():
        layer.router.weight.copy_(inputs.router_weight)
    layer(inputs.xs[0])
    assert torch.equal(layer.routing.tokens_per_expert, counts)


def test_zipf_alpha_controls_the_skew():
    flat = bench.tokens_per_expert(*_inputs("zipf", alpha=0.2))
    steep = bench.tokens_per_expert(*_inputs("zipf", alpha=2.0))
    assert steep.max() / steep.mean() > flat.max() / flat.mean() + 0.3


def test_balanced_routing_is_exact():
    cfg, inputs = _inputs("balanced", T=1000, E=8, k=2)
    assert torch.equal(bench.tokens_per_expert(cfg, inputs), torch.full((8,), 250.0))


def test_random_routing_is_near_uniform_and_inputs_are_random():
    cfg, inputs = _inputs("random")
    counts = bench.tokens_per_expert(cfg, inputs)
    assert counts.max() / counts.mean() < 1.5
    assert len(inputs.xs) > 1 and not torch.equal(inputs.xs[0], inputs.xs[1])  # rotated, fresh sets
    assert inputs.xs[0].requires_grad and inputs.xs[0].abs().min() > 0


def test_forced_routing_needs_h_at_least_e():
    shape = models.parse_shape("16,8,8,16,2")
    opts = bench.resolve_options(bench.BenchOptions(device="cpu", routing="zipf"))
    with pytest.raises(ValueError, match="--routing"):
        bench.make_inputs(shape, opts)


# ---------------------------------------------------------------- peers


def test_torch_gmm_peer_matches_the_loop_backend():
    cfg = _cfg()
    layer = moeyard.MoE(cfg, backend="loop")
    peer = TorchGroupedMM(cfg)
    with torch.no_grad():
        peer.router.weight.copy_(layer.router.weight)
        peer.w13_EH2I.copy_(layer.gate_up_proj.transpose(1, 2))
        peer.w2_EIH.copy_(layer.down_proj.transpose(1, 2))
    x = torch.randn(33, 64)
    torch.testing.assert_close(peer(x), layer(x), rtol=1e-5, atol=1e-6)


def test_peer_config_and_note():
    ds = models.get_model("deepseek-v3").moe_config()
    pc = peer_config(ds)
    assert (pc.num_experts, pc.top_k, pc.num_shared_experts, pc.score_func) == (256, 8, 0, "softmax")
    assert "no shared expert" in peer_note(ds) and "sigmoid" in peer_note(ds)
    assert peer_note(models.get_model("qwen3-30b-a3b").moe_config()) == ""


# ---------------------------------------------------------------- the run


def test_run_rows_for_every_cpu_backend_and_torch_gmm():
    result = bench.run(bench.BenchOptions(device="cpu", shapes=["64,32,16,4,2"], **TINY))
    rows = {r["impl"]: r for r in result["rows"]}
    expected = moeyard.available_backends("cpu", torch.float32) + ["torch_gmm"]
    assert sorted(rows) == sorted(expected)
    for r in rows.values():
        assert "error" not in r, r
        assert r["fwd_ms"] > 0 and r["fwdbwd_ms"] > 0 and r["fwd_tflops"] > 0
        assert r["flops_fwd"] == 6 * 64 * 2 * 32 * 16
    assert "sonicmoe" in result["env"]["skipped"]
    assert result["env"]["dense_bf16_tflops"] is None  # CUDA only
    assert result["env"]["router"] == moeyard.routing.router_impl()  # the router in force is recorded


def test_failing_backend_is_an_error_row():
    # H=30 in float32: rows are not 16-byte aligned, so grouped_mm refuses the shape
    result = bench.run(
        bench.BenchOptions(
            device="cpu", shapes=["16,30,16,4,2"], backends=["grouped_mm", "loop"], peers=False, warmup=0, iters=1
        )
    )
    rows = {r["impl"]: r for r in result["rows"]}
    assert "grouped_mm" in rows["grouped_mm"]["error"] and "fwd_ms" not in rows["grouped_mm"]
    assert rows["loop"]["fwd_ms"] > 0


def test_compile_wraps_moeyard_rows_only(monkeypatch):
    # --compile: each moeyard layer goes through torch.compile with the mode asked for (here compiled with
    # the eager backend: no C++ toolchain needed), the peer row runs eager; the times are of the compiled layer
    real, calls = torch.compile, []

    def spy(module, mode=None):
        calls.append((type(module).__name__, mode))
        return real(module, backend="eager")

    monkeypatch.setattr(torch, "compile", spy)
    result = bench.run(
        bench.BenchOptions(
            device="cpu",
            shapes=["32,32,16,4,2"],
            backends=["bmm_padded", "torch_gmm"],
            compile="reduce-overhead",
            warmup=1,
            iters=1,
        )
    )
    rows = {r["impl"]: r for r in result["rows"]}
    assert calls == [("MoE", "reduce-overhead")]
    assert "error" not in rows["bmm_padded"] and rows["bmm_padded"]["fwdbwd_ms"] > 0
    assert rows["bmm_padded"]["note"] == "torch.compile (reduce-overhead)" and rows["torch_gmm"]["note"] == ""
    assert result["env"]["compile"] == "reduce-overhead"


@pytest.mark.parametrize(
    "kw, flag",
    [
        (dict(dtype="int8"), "--dtype"),
        (dict(routing="skewed"), "--routing"),
        (dict(backends=["nope"]), "--backends"),
        (dict(iters=0), "--iters"),
        (dict(zipf_alpha=0.0), "--zipf-alpha"),
        (dict(compile="fast"), "--compile"),
        (dict(cuda_graph=True), "--cuda-graph: needs a CUDA device"),
    ],
)
def test_bad_options_name_the_flag(kw, flag):
    with pytest.raises(ValueError, match=flag):
        bench.resolve_options(bench.BenchOptions(device="cpu", **kw))


@pytest.mark.parametrize("impl", ["lora", "peft+moeyard", "peft-auto+moeyard", "peft-fold+moeyard", "peft+grouped_mm"])
def test_lora_bench_rows_train_the_adapters(impl):
    # every LoRA row computes the adapted layer (same output) and the factor gradients (same values)
    from moeyard.bench import lora as bench_lora
    from moeyard.bench.models import parse_shape

    if impl != "lora" and importlib.util.find_spec("peft") is None:
        pytest.skip("peft is not installed")
    case = bench_lora.make_case(parse_shape("48,32,16,4,2"), 4, torch.device("cpu"), torch.float32)
    for factors in case.lora.values():
        factors[1].normal_()  # B != 0: the adapters change the output
    frozen = bench_lora.build("frozen", case)(case.xs[0])
    ref = bench_lora.build("lora", case)
    want = ref(case.xs[0])
    want.backward(case.dys[0])
    module = bench_lora.build(impl, case)
    got = module(case.xs[0])
    got.backward(case.dys[0])
    assert (want - frozen).abs().max() > 1e-3
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    grads = sorted(p.grad.abs().sum().item() for p in module.trainable())
    want_grads = sorted(p.grad.abs().sum().item() for p in ref.trainable())
    assert len(grads) == 4 and all(g > 0 for g in grads)
    torch.testing.assert_close(torch.tensor(grads), torch.tensor(want_grads), rtol=1e-4, atol=1e-4)


def test_lora_bench_fp8_base_rows(tmp_path):
    # --lora with --recipe: frozen and lora again on an FP8 base (the recipe's numerics: close to the bf16
    # rows, not equal), with --grad-accum in blocks under cache_fp8_weights; ratios against the plain rows
    from moeyard import cli
    from moeyard.bench import lora as bench_lora
    from moeyard.bench.models import parse_shape

    case = bench_lora.make_case(parse_shape("48,32,16,4,2"), 4, torch.device("cpu"), torch.float32)
    for factors in case.lora.values():
        factors[1].normal_()
    want = bench_lora.build("lora", case)(case.xs[0])
    got = bench_lora.build("lora+fp8_rowwise", case)(case.xs[0])
    err = ((got - want).norm() / want.norm()).item()
    assert 0 < err < 0.1, err
    path = tmp_path / "r.json"
    argv = ["bench", "--lora", "4", "--recipe", "fp8_rowwise", "--backends", "frozen,lora", "--device", "cpu"]
    argv += ["--shape", "48,32,16,4,2", "--grad-accum", "2", "--warmup", "0", "--iters", "1", "--json", str(path)]
    assert cli.main(argv) == 0
    rows = {r["impl"]: r for r in json.loads(path.read_text())["rows"]}
    assert list(rows) == ["frozen", "lora", "frozen+fp8_rowwise", "lora+fp8_rowwise"]
    assert all("error" not in r and r["step_ms"] > 0 for r in rows.values())
    assert rows["lora+fp8_rowwise"]["lora_speedup"] == rows["lora+fp8_rowwise"]["step_ms"] / rows["lora"]["step_ms"]


def test_quant_bench_rows_on_an_fp8_base(tmp_path):
    # --quant nf4 with --recipe: the lora and qlora stacks again with the base GEMMs under the recipe (close to
    # the plain rows, not equal: the recipe's numerics), each row timed, none failing
    pytest.importorskip("bitsandbytes")
    from moeyard import cli
    from moeyard.bench import lora as bench_lora
    from moeyard.bench.models import parse_shape

    case = bench_lora.make_case(parse_shape("32,64,32,4,2"), 4, torch.device("cpu"), torch.float32)
    for factors in case.lora.values():
        factors[1].normal_()
    outs = {}
    for impl in ("qlora", "qlora+fp8_rowwise"):
        torch.manual_seed(0)
        outs[impl] = bench_lora.build(impl, case, layers=2)(case.xs[0])
    err = ((outs["qlora+fp8_rowwise"] - outs["qlora"]).norm() / outs["qlora"].norm()).item()
    assert 0 < err < 0.1, err
    path = tmp_path / "q.json"
    argv = ["bench", "--lora", "4", "--quant", "nf4", "--layers", "2", "--recipe", "fp8_rowwise", "--device", "cpu"]
    argv += ["--shape", "32,64,32,4,2", "--backends", "lora,qlora", "--warmup", "0", "--iters", "1"]
    assert cli.main([*argv, "--json", str(path)]) == 0
    rows = {r["impl"]: r for r in json.loads(path.read_text())["rows"]}
    assert list(rows) == ["lora", "qlora", "lora+fp8_rowwise", "qlora+fp8_rowwise"]
    assert all("error" not in r and r["step_ms"] > 0 for r in rows.values())


def test_quant_bench_rows():
    # the QLoRA rows: selective and whole-stack dequantisation compute the same step; NF4 stores <= 0.3x
    pytest.importorskip("bitsandbytes")
    from moeyard.bench import lora as bench_lora
    from moeyard.bench.models import parse_shape

    case = bench_lora.make_case(parse_shape("32,64,32,4,2"), 4, torch.device("cpu"), torch.float32)
    rows = {}
    for impl in bench_lora.QUANT_IMPLS:
        torch.manual_seed(0)
        m = bench_lora.build(impl, case, layers=2)
        out = m(case.xs[0])
        out.backward(case.dys[0])
        rows[impl] = (m, out, [p.grad.clone() for p in m.trainable()])
    torch.testing.assert_close(rows["qlora"][1], rows["qlora-whole"][1], rtol=0, atol=0)
    for a, b in zip(rows["qlora"][2], rows["qlora-whole"][2], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert len(rows["qlora"][2]) == 8
    # float32 base here (0.13x asymptotically); the fixed 1 KiB code tables of each storage add 0.02x at this size
    assert rows["qlora"][0].weight_bytes() <= 0.16 * rows["lora"][0].weight_bytes()


def test_trace_summary_host_against_device(tmp_path):
    ts = load_benchmark("trace_summary")
    ev = lambda cat, name, t, d: dict(ph="X", cat=cat, name=name, ts=t, dur=d)  # noqa: E731
    trace = {
        "traceEvents": [
            ev("cpu_op", "aten::mm", 0.0, 1000.0),
            *[ev("cuda_runtime", "cudaLaunchKernel", t, 5.0) for t in (10.0, 20.0)],
            ev("cuda_driver", "cuLaunchKernelEx", 30.0, 5.0),
            ev("cuda_runtime", "cudaStreamSynchronize", 500.0, 300.0),
            ev("kernel", "a", 100.0, 200.0),
            ev("kernel", "b", 250.0, 150.0),  # overlap: 100..400
            ev("gpu_memset", "m", 900.0, 100.0),
            dict(ph="M", name="process_name", ts=0.0, pid=1),  # metadata: ignored
        ]
    }
    s = ts.summarize(trace)
    assert s["host_ms"] == pytest.approx(1.0) and s["device_busy_ms"] == pytest.approx(0.4)
    assert s["device_span_ms"] == pytest.approx(0.9) and s["launches"] == 3
    assert s["waits"] == {"cudaStreamSynchronize": 1}
    with pytest.raises(ValueError, match="traceEvents"):
        ts.summarize({"events": []})
    # a real CPU-only profiler export: host time, no device events
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.randn(64, 64).matmul(torch.randn(64, 64))
    path = tmp_path / "cpu.json"
    prof.export_chrome_trace(str(path))
    assert ts.main([str(path)]) == 0
    import json

    s = ts.summarize(json.loads(path.read_text()))
    assert s["host_ms"] > 0 and s["device_busy_ms"] == 0 and s["launches"] == 0


def test_host_time_rows_and_profile(monkeypatch, tmp_path, capsys):
    # the script's logic on CPU: CUDA's clock, sleep and events replaced by host stand-ins
    import pstats
    import time as _time

    from moeyard import bench
    from moeyard.bench.models import parse_shape

    ht = load_benchmark("host_time")

    class Event:
        def __init__(self, **_):
            self.t = None

        def record(self):
            self.t = _time.perf_counter()

        def elapsed_time(self, other):
            return (other.t - self.t) * 1e3

    sleeps = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: sleeps.append(cycles))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    resolve, build = bench.resolve_options, bench.build
    monkeypatch.setattr(
        bench,
        "resolve_options",
        lambda o: resolve(bench.BenchOptions(**{**o.__dict__, "device": "cpu", "dtype": "float32"})),
    )
    monkeypatch.setattr(bench, "build", lambda n, c, d, dt: build(n, c, "cpu", torch.float32))
    monkeypatch.setattr(ht, "get_model", lambda name: parse_shape("64,32,16,4,2"))
    out = tmp_path / "rows.json"
    assert (
        ht.main(
            [
                "--models",
                "tiny",
                "--backends",
                "loop,grouped_mm",
                "--routers",
                "torch,fused",
                "--iters",
                "2",
                "--top",
                "5",
                "--pstats",
                str(tmp_path / "ps"),
                "--json",
                str(out),
                "--steps",
                "fwdbwd,fwd,infer",
                "--tokens",
                "8,64",
            ]
        )
        == 0
    )
    import json

    rows = json.loads(out.read_text())
    assert [(r["tokens"], r["backend"], r["router"], r["step"]) for r in rows] == [
        (t, b, r, s)
        for t in (8, 64)
        for b in ("loop", "grouped_mm")
        for r in ("torch", "fused")
        for s in ("fwdbwd", "fwd", "infer")
    ]
    assert all(r["host_ms"] > 0 and r["step_ms"] > 0 and r["device_ms"] >= r["held_host_ms"] > 0 for r in rows)
    assert len(sleeps) == 24 * (1 + 2 + 2)  # per row: the sleep's calibration, then one per timed and profiled step
    stats = pstats.Stats(str(tmp_path / "ps" / "tiny-T64-loop-torch-fwdbwd.pstats"))
    assert any("backward" in fn for _, _, fn in stats.stats)
    for step in ("fwd", "infer"):
        stats = pstats.Stats(str(tmp_path / "ps" / f"tiny-T8-loop-torch-{step}.pstats"))
        assert any("forward" in fn for _, _, fn in stats.stats)
        assert not any("backward" in fn for _, _, fn in stats.stats)
    text = capsys.readouterr().out
    assert "## cProfile tiny T=8 grouped_mm router=fused step=infer" in text and "host/dev" in text
    # every timed column runs the row's own step (the "step ms" column once ran a forward whatever the step)
    kinds = []
    real = ht._step
    monkeypatch.setattr(ht, "_step", lambda *a: kinds.append(a[4]) or real(*a))
    for step in ("fwdbwd", "infer"):
        kinds.clear()
        ht.main(["--models", "tiny", "--backends", "loop", "--routers", "torch", "--iters", "2", "--steps", step])
        assert kinds and set(kinds) == {step}, kinds
    with pytest.raises(ValueError, match="^--steps"):
        ht.main(["--models", "tiny", "--steps", "bwd"])
    with pytest.raises(ValueError, match="^--tokens"):
        ht.main(["--models", "tiny", "--tokens", "0"])


@pytest.mark.parametrize("step", ["fwd", "infer", "fwdbwd"])
def test_host_time_forward_step_runs_no_backward(step):
    from moeyard import bench
    from moeyard.bench.models import parse_shape

    ht = load_benchmark("host_time")
    opts = bench.resolve_options(bench.BenchOptions(device="cpu", shapes=["32,32,16,4,2"]))
    inputs = bench.make_inputs(parse_shape("32,32,16,4,2"), opts)
    module = bench.build("loop", parse_shape("32,32,16,4,2").moe_config(), "cpu", torch.float32)
    params = [p for p in module.parameters() if p.requires_grad]
    recorded = []
    module.register_forward_hook(lambda m, i, out: recorded.append(out.requires_grad))
    ht._step(module, inputs, params, 0, step)
    assert all((p.grad is None) == (step != "fwdbwd") for p in params + inputs.xs[:1])
    assert recorded == [step != "infer"]  # infer: under inference_mode, no graph


def test_decode_rows(monkeypatch, tmp_path, capsys):
    # benchmarks/decode.py on CPU at the tiny configuration: a row per (implementation, mode, batch) with ms per
    # token, no graph eager and one compiled decoding step (no recompilation between tokens)
    pytest.importorskip("transformers")
    from moeyard.experts import registry

    monkeypatch.setattr(registry, "_default", [registry._default[0]])  # the script sets moeyard's default backend
    decode = load_benchmark("decode")
    # the real generate runs (graphs, errors); its time is replaced by 1 ms per new token: a noisy CI host once
    # timed one generate 120 ms slow, and one repetition cannot absorb that
    real = decode.generate_s
    monkeypatch.setattr(
        decode, "generate_s", lambda model, prompts, n, mode: real(model, prompts, n, mode) * 0 + n / 1e3
    )
    out = tmp_path / "decode.json"
    assert (
        decode.main(
            [
                "--tiny",
                "--layers",
                "1",
                "--batch",
                "1,2",
                "--prompt",
                "4",
                "--new-tokens",
                "3",
                "--reps",
                "1",
                "--impls",
                "moeyard:bmm_padded,grouped_mm",
                "--modes",
                "eager,compiled",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())["rows"]
    impls, modes = ("moeyard:bmm_padded", "grouped_mm"), ("eager", "compiled")
    want = [(i, m, b) for i in impls for b in (1, 2) for m in modes]
    assert [(r["impl"], r["mode"], r["batch"]) for r in rows] == want
    ok = {(r["impl"], r["mode"], r["batch"]): r for r in rows if "error" not in r}
    # bmm_padded syncs with the host, which the compiled step's full graph cannot hold: an error row, not a crash
    assert set(ok) == {(r["impl"], r["mode"], r["batch"]) for r in rows} - {
        ("moeyard:bmm_padded", "compiled", b) for b in (1, 2)
    }
    assert all(ok[("moeyard:bmm_padded", "eager", b)]["graphs"] == 0 for b in (1, 2))
    assert all(ok[("grouped_mm", "compiled", b)]["graphs"] == 1 for b in (1, 2))
    assert all(
        r["ms_per_token"] == pytest.approx(1.0) and r["tokens_per_s"] == pytest.approx(r["batch"] * 1e3)
        for r in ok.values()
    )
    assert "ms/token" in capsys.readouterr().out


def test_decode_rejects_a_timing_drowned_in_noise(monkeypatch):
    decode = load_benchmark("decode")
    monkeypatch.setattr(decode, "generate_s", lambda model, prompts, n, mode: 0.5)  # as long for 1 token as for n
    with pytest.raises(RuntimeError, match="timing noise"):
        decode.ms_per_token(None, None, 4, "eager", 3)
