"""examples/fp8_train.py on CPU, a few steps of the tiny configuration: every run trains from the same
weights on the same batches, the recipes change the losses (they are applied) by no more than an FP8
rounding, and the result and plot are written."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fp8_train.py"


def test_tiny_fp8_train(tmp_path):
    spec = importlib.util.spec_from_file_location("fp8_train", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    rc = module.main(
        [
            "--device",
            "cpu",
            "--size",
            "tiny",
            "--steps",
            "4",
            "--seeds",
            "2",
            "--recipes",
            "fp8_rowwise",
            "--out",
            str(tmp_path),
        ]
    )
    result = json.loads((tmp_path / "fp8_losses.json").read_text())
    losses = result["losses"]
    assert set(losses) == {"bf16 seed 0", "bf16 seed 1", "fp8_rowwise"}
    assert all(len(v) == 4 and all(math.isfinite(x) for x in v) for v in losses.values())
    first = losses["fp8_rowwise"][0] - losses["bf16 seed 0"][0]  # same weights, same batch: only FP8 rounding
    assert 0 < abs(first) < 0.05
    assert losses["bf16 seed 0"][0] != losses["bf16 seed 1"][0]
    assert rc == (0 if result["ok"] else 1)
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "fp8_loss_curves.png").stat().st_size > 0
