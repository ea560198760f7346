"""``moeyard bench --e2e``, ``--plot`` / ``--from`` and ``--trace`` on a CPU, at tiny sizes."""

import json
import sys
from pathlib import Path

import pytest
import torch

from moeyard import bench, cli, verify
from moeyard.bench import e2e as bench_e2e, models, plot as bench_plot

pytest.importorskip("transformers")
TINY_E2E = [
    "bench",
    "--e2e",
    "--device",
    "cpu",
    "--tiny",
    "--layers",
    "1",
    "--tokens",
    "32",
    "--warmup",
    "0",
    "--iters",
    "1",
]
LAYER = [
    "bench",
    "--device",
    "cpu",
    "--shape",
    "32,32,16,4,2",
    "--backends",
    "loop",
    "--no-peers",
    "--warmup",
    "0",
    "--iters",
    "1",
]


def _json(tmp_path, argv):
    path = tmp_path / "r.json"
    assert cli.main([*argv, "--json", str(path)]) == 0
    return json.loads(path.read_text())


# ---------------------------------------------------------------- --e2e


def test_e2e_tiny_rows_json_and_table(tmp_path, capsys):
    data = _json(tmp_path, TINY_E2E)
    rows = {r["impl"]: r for r in data["rows"]}
    assert sorted(rows) == ["grouped_mm", "moeyard"]
    for r in rows.values():
        assert "error" not in r, r
        assert r["step_ms"] > 0 and r["tokens_per_s"] == pytest.approx(32 / r["step_ms"] * 1e3)
        assert (r["case"], r["layers"], r["batch"] * r["seq"], r["vocab"]) == ("qwen3-30b-a3b", 1, 32, 128)
        assert r["params"] > 0
    assert rows["grouped_mm"]["x_vs_grouped_mm"] == 1.0
    speedup = rows["grouped_mm"]["step_ms"] / rows["moeyard"]["step_ms"]
    assert rows["moeyard"]["x_vs_grouped_mm"] == pytest.approx(speedup)
    assert rows["moeyard"]["backend"] in ("grouped_mm", "bmm_padded", "loop")
    assert data["env"]["mode"] == "e2e" and data["env"]["command"].startswith("moeyard bench --e2e")
    assert "sonicmoe" in data["env"]["skipped"]
    out = capsys.readouterr().out
    assert "tokens/s" in out and "AdamW" in out


def test_e2e_gradient_accumulation(tmp_path, capsys):
    # --grad-accum 2: two micro-batches of --tokens per optimizer step; tokens/s counts both; the step's loss
    # is the micro-batches' mean and their gradients add up before the one optimizer step
    data = _json(tmp_path, [*TINY_E2E, "--grad-accum", "2", "--backends", "moeyard:loop"])
    (row,) = data["rows"]
    assert "error" not in row, row
    assert (row["accumulate"], row["batch"] * row["seq"], row["tokens"]) == (2, 32, 64)
    assert row["tokens_per_s"] == pytest.approx(64 / row["step_ms"] * 1e3)
    assert "micro-batches" in capsys.readouterr().out
    entry = bench_e2e.get_e2e_model("olmoe-1b-7b")
    size = bench_e2e.step_size(entry, tokens=16, seq_len=8, vocab=None, layers=1, tiny=True, accumulate=2)
    config = bench_e2e.hf_config(entry, size)
    trainer = bench_e2e.build_trainer(config, "moeyard:loop", size, torch.device("cpu"), torch.float32)
    model = trainer.model
    with torch.no_grad():
        losses = [model(input_ids=trainer.ids[k], labels=trainer.labels[k]).loss for k in (0, 1)]
    for k in (0, 1):
        model(input_ids=trainer.ids[k], labels=trainer.labels[k]).loss.backward()
    summed = [p.grad.clone() / 2 for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    grads = []
    trainer.optimizer.step = lambda: grads.extend(p.grad.clone() for p in model.parameters())
    loss = trainer.step(0)
    torch.testing.assert_close(loss, (losses[0] + losses[1]) / 2, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, summed, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_e2e_step_trains_the_same_model_under_both_implementations():
    # same seed, same weights: the first loss agrees, and the optimizer step changes the weights
    entry = bench_e2e.get_e2e_model("olmoe-1b-7b")
    size = bench_e2e.step_size(entry, tokens=16, seq_len=8, vocab=None, layers=1, tiny=True)
    config = bench_e2e.hf_config(entry, size)
    losses = []
    for impl in ("moeyard:loop", "grouped_mm"):
        trainer = bench_e2e.build_trainer(config, impl, size, torch.device("cpu"), torch.float32)
        assert trainer.ids[0].shape == (2, 8)
        before = [p.detach().clone() for p in trainer.model.parameters()]
        losses.append(trainer.step(0))
        assert any(not torch.equal(a, p) for a, p in zip(before, trainer.model.parameters(), strict=True))
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(bench_e2e.E2E_MODELS))
def test_e2e_configs_match_the_model_shapes(name):
    # real sizes, one layer, on the meta device: the experts' weights have the registry's E, H, I
    from transformers import AutoModelForCausalLM

    entry = bench_e2e.get_e2e_model(name)
    size = bench_e2e.step_size(entry, tokens=None, seq_len=None, vocab=None, layers=1, tiny=False)
    assert (size.batch, size.seq, size.vocab) == (4, 2048, bench_e2e.DEFAULT_VOCAB)
    try:
        config = bench_e2e.hf_config(entry, size)
    except ValueError as ex:
        pytest.skip(str(ex))
    with torch.device("meta"), verify.quiet_transformers():
        model = AutoModelForCausalLM.from_config(config)
    [experts] = verify.experts_modules(model)
    c = models.get_model(name).moe_config()
    up = getattr(experts, "gate_up_proj", None)
    assert experts.down_proj.shape[0] == c.num_experts
    assert sorted(experts.down_proj.shape[1:]) == sorted([c.hidden_size, c.intermediate_size])
    assert up.numel() == c.num_experts * 2 * c.intermediate_size * c.hidden_size
    assert config.num_experts_per_tok == c.top_k and config.hidden_size == c.hidden_size


def test_e2e_unknown_and_unmapped_models(capsys):
    assert cli.main(["bench", "--e2e", "--model", "gpt-5"]) == 2
    assert "unknown name 'gpt-5'" in capsys.readouterr().err
    assert cli.main(["bench", "--e2e", "--model", "kimi-k2", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "no transformers config mapped for model 'kimi-k2'" in err and "qwen3-30b-a3b" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--e2e", "--lora", "8"], "--e2e: cannot be combined with --lora"),
        (["--e2e", "--quant", "nf4"], "--e2e: cannot be combined with --lora / --quant"),
        (["--tiny"], "--tiny: only with --e2e"),
        (["--vocab", "64"], "--vocab: only with --e2e"),
        (["--grad-accum", "2", "--lora", "8", "--quant", "nf4"], "--grad-accum: times --e2e, --lora or the layer"),
        (["--e2e", "--device", "cpu", "--tiny", "--grad-accum", "0"], "--grad-accum: expected a positive integer"),
        (["--e2e", "--device", "cpu", "--tiny", "--tokens", "30", "--seq-len", "8"], "--tokens: expected a multiple"),
        (["--e2e", "--device", "cpu", "--tiny", "--backends", "nope"], "--backends: with --e2e expected"),
        (["--e2e", "--device", "cpu", "--tiny", "--backends", "moeyard:nope"], "--backends: expected one of"),
        (["--e2e", "--device", "cpu", "--shape", "8,8,8,2,1"], "--e2e: takes --model names"),
        (["--e2e", "--device", "cpu", "--routing", "zipf"], "--routing and --routed-only do not apply"),
        (["--from", "x.json"], "--from: redraws a saved result; give --plot"),
        (["--from", "x.json", "--plot", "x.png", "--e2e"], "drop --e2e"),
    ],
)
def test_bad_combinations_are_clear_errors(argv, message, capsys):
    assert cli.main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------- --plot and --from


def _png(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    return data


def test_plot_layer_bench_and_redraw_from_json(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "layer.png"
    data = _json(tmp_path, [*LAYER, "--plot", str(png)])
    assert data["env"]["mode"] == "layer"
    _png(png)
    again = tmp_path / "again.png"
    assert cli.main(["bench", "--plot", str(again), "--from", str(tmp_path / "r.json")]) == 0
    _png(again)
    assert "fwd+bwd" in capsys.readouterr().out  # the saved result's table is printed too


def test_plot_e2e_from_json_and_old_json_modes(tmp_path):
    pytest.importorskip("matplotlib")
    result = {
        "env": {"device": "GPU", "dtype": "bfloat16", "date": "today", "dense_bf16_tflops": 800.0},
        "rows": [
            {"case": "m", "impl": i, "layers": 2, "batch": 4, "seq": 2048, "tokens_per_s": v}
            for i, v in (("moeyard", 2e5), ("grouped_mm", 1.5e5))
        ]
        + [{"case": "m", "impl": "sonicmoe", "layers": 2, "batch": 4, "seq": 2048, "error": "x"}],
    }
    assert bench_plot.result_mode(result) == "e2e"
    _png(Path(bench_plot.plot(result, str(tmp_path / "e2e.png"))))
    layer = {
        "env": {"dense_bf16_tflops": 800.0},
        "rows": [
            {
                "case": "c",
                "impl": "triton",
                "T": 1,
                "H": 2,
                "I": 3,
                "E": 4,
                "k": 1,
                "fwd_tflops": 300,
                "fwdbwd_tflops": 250,
            }
        ],
    }
    assert bench_plot.result_mode(layer) == "layer"
    assert bench_plot.result_mode({"env": {"lora_rank": 16}, "rows": []}) == "lora"
    _png(Path(bench_plot.plot(layer, str(tmp_path / "l.png"))))


def test_plot_errors(tmp_path, monkeypatch, capsys):
    with pytest.raises(ValueError, match="--plot: directory"):
        bench_plot.check_plot_path(str(tmp_path / "no" / "x.png"))
    with pytest.raises(ValueError, match="is a directory"):
        bench_plot.check_plot_path(str(tmp_path))
    with pytest.raises(ValueError, match="no successful row"):
        bench_plot.plot({"env": {}, "rows": [{"case": "c", "impl": "x", "error": "e"}]}, str(tmp_path / "x.png"))
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    assert cli.main(["bench", "--plot", str(tmp_path / "x.png"), "--from", str(bad)]) == 2
    assert "not a moeyard bench JSON" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # matplotlib missing
    assert cli.main([*LAYER, "--plot", str(tmp_path / "x.png")]) == 2
    assert "moeyard[plot]" in capsys.readouterr().err


# ---------------------------------------------------------------- --trace


def _events(path):
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    assert len(events) > 10
    return events


def test_trace_layer_bench(tmp_path):
    out = tmp_path / "traces"
    data = _json(tmp_path, [*LAYER, "--trace", str(out)])
    [row] = data["rows"]
    assert row["trace"] == str(out / "custom-32x32x16x4x2-loop.json") and row["memory_snapshot"] is None
    assert "CPU" in row["trace_note"]
    assert any("aten::" in e.get("name", "") for e in _events(row["trace"]))


def test_trace_e2e(tmp_path):
    out = tmp_path / "traces"
    data = _json(tmp_path, [*TINY_E2E, "--backends", "moeyard", "--trace", str(out)])
    [row] = data["rows"]
    assert row["trace"] == str(out / "qwen3-30b-a3b-moeyard.json")
    names = {e.get("name", "") for e in _events(row["trace"])}
    assert any("Optimizer.step" in n for n in names) and any("aten::" in n for n in names)


def test_trace_to_a_file_is_a_clear_error(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert cli.main([*LAYER, "--trace", str(f)]) == 2
    err = capsys.readouterr().err
    assert "--trace:" in err and "is not a directory" in err
    with pytest.raises(ValueError, match="--trace: .* is not a directory"):
        bench.resolve_options(bench.BenchOptions(device="cpu", trace=str(f)))


def test_trace_lora_with_named_implementations(tmp_path):
    out = tmp_path / "traces"
    data = _json(
        tmp_path,
        [
            "bench",
            "--lora",
            "4",
            "--device",
            "cpu",
            "--shape",
            "32,32,16,4,2",
            "--backends",
            "frozen,lora",
            "--warmup",
            "0",
            "--iters",
            "1",
            "--trace",
            str(out),
        ],
    )
    assert [r["impl"] for r in data["rows"]] == ["frozen", "lora"]
    for r in data["rows"]:
        assert r["trace"] == str(out / f"custom-32x32x16x4x2-{r['impl']}.json")
        _events(r["trace"])
