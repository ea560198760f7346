"""``moeyard verify --framework jax`` and ``moeyard bench --framework jax`` on CPU."""

import argparse
import json

import pytest

pytest.importorskip("jax")
pytest.importorskip("flax")
pytest.importorskip("transformers")

import jax_parity  # noqa: E402,F401  (sets the fast-compile XLA flags before JAX starts)
import moeyard  # noqa: E402
from moeyard import cli, verify  # noqa: E402


def test_verify_jax_column(capsys):
    """The jax column passes where the loop column does (whole models, logits and every gradient),
    float64; the temporary backend is gone afterwards."""
    parser = argparse.ArgumentParser()
    verify.add_arguments(parser)
    args = parser.parse_args(
        ["--framework", "jax", "--arch", "qwen3_moe", "gpt_oss", "--backends", "loop", "--dtype", "float64", "--json"]
    )
    assert verify.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    cells = {(r["arch"], r["backend"]): r for r in out["results"]}
    assert set(cells) == {(a, b) for a in ("qwen3_moe", "gpt_oss") for b in ("loop", "jax")}
    assert all(r["status"] == "pass" and r["error"] <= 1e-12 for r in cells.values()), cells
    assert "jax" not in moeyard.backend_names()


def test_bench_jax_rows(tmp_path, capsys):
    """The JAX rows follow the PyTorch rows of the case; the plain ragged_dot pipeline computes the same
    output; the jax row states its speed against both."""
    path = tmp_path / "out.json"
    rc = cli.main(
        [
            "bench",
            "--framework",
            "jax",
            "--shape",
            "64,32,16,4,2",
            "--backends",
            "grouped_mm",
            "--no-peers",
            "--iters",
            "1",
            "--warmup",
            "0",
            "--json",
            str(path),
        ]
    )
    assert rc == 0
    result = json.loads(path.read_text())
    rows = {r["impl"]: r for r in result["rows"]}
    assert list(rows) == ["grouped_mm", "jax", "jax autodiff", "ragged_dot pipeline"]
    for name in ("jax", "jax autodiff", "ragged_dot pipeline"):
        assert "error" not in rows[name], rows[name].get("detail")
        assert rows[name]["kind"] == "jax" and rows[name]["fwd_ms"] > 0 and rows[name]["fwdbwd_ms"] > 0
    assert "ragged_dot pipeline" in rows["jax"]["note"] and "torch grouped_mm" in rows["jax"]["note"]
    assert float(rows["ragged_dot pipeline"]["note"].split("=")[1]) < 1e-5
    assert "jax" in result["env"] and "JAX rows" in capsys.readouterr().out


def test_bench_jax_rejects_other_modes():
    assert cli.main(["bench", "--framework", "jax", "--e2e"]) == 2
