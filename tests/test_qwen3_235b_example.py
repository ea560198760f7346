"""examples/qwen3_235b_qlora.py at ``--tiny`` on CPU under torchrun (2 gloo processes): the run finishes
with finite losses falling on the repeated batch, with FSDP2 and without, for Qwen3-235B-A22B's and
DeepSeek-V3's architectures; each rank holds NF4 storage of its own experts only (DeepSeek-V3: in its
sparse layers only); the script stops with a clear message without bitsandbytes.
"""

import importlib.util
import itertools
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch.distributed as dist

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")
pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "examples" / "qwen3_235b_qlora.py"


def _run(tmp_path, *flags, model: str = "qwen3-235b-a22b") -> dict:
    out = tmp_path / "summary.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(SCRIPT),
        "--tiny",
        "--model",
        model,
        "--out",
        str(out),
        *flags,
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert f"| {model}-tiny QLoRA NF4 r=16 | 2 x cpu EP2" in proc.stdout
    return json.loads(out.read_text())


@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp2", "replicated"])
def test_tiny_run(tmp_path, fsdp):
    steps = 4 if fsdp else 3
    summary = _run(tmp_path, "--steps", str(steps), *([] if fsdp else ["--no-fsdp"]))
    assert summary["world_size"] == 2 and summary["fsdp"] is fsdp and summary["activation_checkpointing"]
    assert len(summary["steps"]) == steps and summary["losses_finite"]
    losses = [r["loss"] for r in summary["steps"]]
    assert all(b < a for a, b in itertools.pairwise(losses)), losses  # the repeated batch is being learnt
    assert summary["tokens_per_s"] > 0 and summary["mean_step_s"] > 0
    cfg = summary["config"]
    E, H, I, L = cfg["num_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_hidden_layers"]
    for mem in summary["memory_per_rank"]:  # each rank: NF4 storage of its E / 2 experts, no more
        assert mem["experts_per_layer"] == [E // 2]
        assert mem["nf4_expert_weights"] == L * (E // 2) * 3 * H * I
        assert 0 < mem["nf4_expert_bytes"] < 0.5 * mem["expert_bytes_if_bf16"]  # 4 bits, tables and scales
        assert mem["lora_params"] > 0


def test_needs_bitsandbytes(monkeypatch):
    spec = importlib.util.spec_from_file_location("qwen3_235b_qlora", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(SystemExit, match="need bitsandbytes.*pip install bitsandbytes"):
        mod.require_bitsandbytes()
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit, match="launch with torchrun"):
        mod.init_distributed(None)


def test_tiny_deepseek_v3_run(tmp_path):
    # DeepSeek-V3's architecture: MLA attention, a leading dense layer, a shared expert, group-limited
    # sigmoid routing with its aux-free bias; NF4 and LoRA on the routed experts of the sparse layers only
    summary = _run(tmp_path, "--steps", "4", model="deepseek-v3")
    assert summary["model"] == "deepseek-v3-tiny" and summary["fsdp"] and summary["losses_finite"]
    losses = [r["loss"] for r in summary["steps"]]
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    assert summary["lora"]["target_modules"] == ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    cfg = summary["config"]
    E, H, I = cfg["n_routed_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]
    sparse = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    assert sparse >= 1 and cfg["first_k_dense_replace"] >= 1
    for mem in summary["memory_per_rank"]:
        assert mem["experts_per_layer"] == [E // 2]
        assert mem["nf4_expert_weights"] == sparse * (E // 2) * 3 * H * I
