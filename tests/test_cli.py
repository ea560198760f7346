"""The command line: info, bench, verify wiring, python -m moeyard."""

import importlib.machinery
import json
import subprocess
import sys
import types

import pytest
import torch

import moeyard
from moeyard import cli
from moeyard.bench.tables import peer_ratio_lines


def test_info_lists_backends(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    for name in moeyard.available_backends("cpu", torch.float32):
        assert name in out
    for key in ("torch", "triton", "transformers", "python", "default backend", "debug mode"):
        assert key in out


def test_info_json(capsys):
    assert cli.main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["moeyard"] == moeyard.__version__
    assert data["devices"]["cpu"]["backends_float32"] == moeyard.available_backends("cpu", torch.float32)
    assert data["default_backend"] == "auto" or data["default_backend"] in moeyard.backend_names()
    assert data["default_recipe"] in ["none", *moeyard.recipe_names()]
    assert data["fp8_gemm"] in ("auto", "triton", "cutlass") and data["fp8_nf4"] in ("codes", "dequantize")
    assert data["fp8_wgrad"] in ("cutlass", "gluon")


def test_info_reports_the_process_settings(capsys, monkeypatch):
    # the settings read from the environment, and a bad value's error instead of a crash
    monkeypatch.setenv("MOEYARD_RECIPE", "fp8_rowwise")
    monkeypatch.setenv("MOEYARD_FP8_GEMM", "Triton")
    monkeypatch.setenv("MOEYARD_FP8_NF4", "bits")
    assert cli.main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["default_recipe"] == "fp8_rowwise" and data["fp8_gemm"] == "triton"
    assert data["fp8_nf4"].startswith("error: MOEYARD_FP8_NF4")
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "default recipe" in out and "fp8_rowwise" in out and "MOEYARD_FP8_NF4" in out


def test_bench_json_to_stdout(capsys):
    # one backend and the peer: every CPU backend's row is test_bench.py's test_run_rows_for_every_cpu_backend_...
    code = cli.main(
        [
            "bench",
            "--device",
            "cpu",
            "--shape",
            "64,32,16,4,2",
            "--backends",
            "loop",
            "--warmup",
            "1",
            "--iters",
            "2",
            "--json",
        ]
    )
    assert code == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    impls = {r["impl"] for r in data["rows"]}
    assert impls == {"loop", "torch_gmm"}
    assert all(r["fwd_ms"] > 0 and r["fwdbwd_ms"] > 0 for r in data["rows"])
    assert data["env"]["command"].startswith("moeyard bench --device cpu")
    assert "fwd+bwd" in captured.err  # the table goes to stderr when JSON takes stdout


def test_bench_json_file_backends_no_peers(tmp_path, capsys):
    path = tmp_path / "r.json"
    code = cli.main(
        [
            "bench",
            "--device",
            "cpu",
            "--shape",
            "32,32,16,4,2",
            "--backends",
            "loop",
            "--no-peers",
            "--routing",
            "zipf",
            "--warmup",
            "0",
            "--iters",
            "1",
            "--json",
            str(path),
        ]
    )
    assert code == 0
    data = json.loads(path.read_text())
    assert [r["impl"] for r in data["rows"]] == ["loop"]
    assert data["env"]["routing"] == "zipf"
    assert "loop" in capsys.readouterr().out


def test_bench_grad_accum_blocks_under_the_weight_cache(tmp_path, capsys, monkeypatch):
    # --grad-accum M in the layer benchmark: each timed unit is M steps inside one cache_fp8_weights() block
    # (warm-up and timed blocks of the forward and of fwd+bwd), the times reported per step
    import contextlib

    from moeyard.quant import weight_cache

    blocks, real = [], weight_cache.cache_fp8_weights

    @contextlib.contextmanager
    def counted():
        blocks.append(0)
        with real():
            yield

    monkeypatch.setattr(weight_cache, "cache_fp8_weights", counted)
    path = tmp_path / "r.json"
    argv = ["bench", "--device", "cpu", "--shape", "32,32,16,4,2", "--backends", "loop", "--no-peers"]
    argv += ["--recipe", "fp8_rowwise", "--grad-accum", "3", "--warmup", "1", "--iters", "2", "--json", str(path)]
    assert cli.main(argv) == 0
    data = json.loads(path.read_text())
    assert data["env"]["accumulate"] == 3 and [r["impl"] for r in data["rows"]] == ["loop+fp8_rowwise"]
    assert data["rows"][0]["fwdbwd_ms"] > 0
    assert len(blocks) == 2 * (1 + 2)  # forward and fwd+bwd: one warm-up block and two timed ones each
    assert "--grad-accum 3" in capsys.readouterr().out


def test_bench_bad_shape_is_a_clear_error(capsys):
    assert cli.main(["bench", "--shape", "1,2,3"]) == 2
    assert "--shape: expected T,H,I,E,k" in capsys.readouterr().err


@pytest.mark.parametrize("other", [["--e2e"], ["--lora", "8"], ["--ep", "2"]])
@pytest.mark.parametrize("flag", ["--compile", "--cuda-graph"])
def test_bench_compile_and_graphs_are_for_the_layer_benchmark(capsys, other, flag):
    assert cli.main(["bench", flag, *other]) == 2
    assert f"{flag}: times the layer benchmark only" in capsys.readouterr().err


def test_bench_unknown_model(capsys):
    assert cli.main(["bench", "--model", "gpt-5"]) == 2
    assert "unknown name 'gpt-5'" in capsys.readouterr().err


def test_bench_list_models(capsys):
    assert cli.main(["bench", "--list-models"]) == 0
    assert "deepseek-v3" in capsys.readouterr().out


def test_unknown_argument_exits_2():
    with pytest.raises(SystemExit) as ex:
        cli.main(["info", "--bogus"])
    assert ex.value.code == 2


def test_verify_missing_module(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "moeyard.verify" else real(n, *a))
    assert cli.main(["verify", "--anything"]) == 2
    assert "moeyard.verify" in capsys.readouterr().err


def test_verify_delegates(monkeypatch):
    fake = types.ModuleType("moeyard.verify")
    fake.__spec__ = importlib.machinery.ModuleSpec("moeyard.verify", None)
    fake.add_arguments = lambda p: p.add_argument("--backend")
    fake.run = lambda args: 7 if args.backend == "loop" else 0
    monkeypatch.setitem(sys.modules, "moeyard.verify", fake)
    assert cli.main(["verify", "--backend", "loop"]) == 7


def test_python_m_moeyard():
    proc = subprocess.run([sys.executable, "-m", "moeyard", "info"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "registered backends" in proc.stdout


def test_peer_ratio_lines():
    """The layer bench's caption gives each moeyard row's speed-up over each peer of the same case."""
    row = lambda case, impl, kind, fwd, fb: dict(case=case, impl=impl, kind=kind, fwd_ms=fwd, fwdbwd_ms=fb)
    rows = [
        row("a", "triton", "moeyard", 2.0, 5.0),
        row("a", "torch_gmm", "peer", 4.0, 10.0),
        row("a", "sonicmoe", "peer", 1.0, 4.0),
        row("b", "triton", "moeyard", 1.0, 3.0),
        dict(case="b", impl="sonicmoe", kind="peer", error="boom"),
    ]
    assert peer_ratio_lines(rows) == [
        "a: triton vs torch_gmm 2.00x (2.00x), sonicmoe 0.80x (0.50x) (fwd+bwd (fwd) speed-up, > 1: triton faster)"
    ]
