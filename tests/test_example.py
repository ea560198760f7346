"""examples/qlora_finetune.py's tiny configuration on CPU: the three runs, their agreement and the plot."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "qlora_finetune.py"


def load_example():
    """The example script as a module (registered in ``sys.modules``, as dataclasses need)."""
    spec = importlib.util.spec_from_file_location("qlora_finetune", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def keep_threads():
    """The example sets torch's thread count for the tiny run; restore it for the other tests."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_tiny_qlora_finetune(tmp_path, keep_threads):
    example = load_example()
    try:
        import matplotlib  # noqa: F401

        has_matplotlib = True
    except ImportError:
        has_matplotlib = False
    args = ["--device", "cpu", "--size", "tiny", "--out", str(tmp_path)] + ([] if has_matplotlib else ["--no-plot"])
    result = example.run(example.parse_args(args))

    losses = result["losses"]
    steps = example.SIZES["tiny"].steps
    assert set(losses) == set(example.RUNS) and all(len(run) == steps for run in losses.values())
    assert all(math.isfinite(x) for run in [*losses.values(), result["base_losses"]] for x in run)
    # (2) moeyard LoRA and (3) PEFT's default path agree within float32 noise
    diff = max(abs(a - b) for a, b in zip(losses["lora_moeyard"][:20], losses["lora_peft"][:20], strict=True))
    assert diff <= example.TOLERANCE[torch.float32], diff
    # (1) QLoRA on NF4 experts learns: training loss and held-out loss go down
    q, quarter = losses["qlora_nf4"], steps // 4
    assert sum(q[-quarter:]) < sum(q[:quarter])
    assert result["eval"]["qlora_nf4"]["after"] < result["eval"]["qlora_nf4"]["before"]
    # ... and differs from the dense runs only by the quantisation error
    assert 0 < max(abs(a - b) for a, b in zip(q, losses["lora_moeyard"], strict=True)) < 0.05
    assert result["check"]["ok"]
    assert json.loads((tmp_path / "losses.json").read_text())["losses"] == losses
    if not has_matplotlib:
        pytest.skip("matplotlib is missing: the loss plot was not checked")
    png = tmp_path / "loss_curves.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
