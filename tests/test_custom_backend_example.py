"""examples/custom_backend.py, the one-file backend the Design page shows: registered by import, runs only
when named, and matches the float64 ``loop`` oracle (output and every gradient) on the edge cases."""

import importlib.util
from pathlib import Path

import pytest
import torch

import moeyard
from helpers import add_lora, check_backend, make_inputs, random_ids
from moeyard.experts import registry

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_backend.py"


@pytest.fixture
def gather_bmm():
    """Import the example (it registers ``gather_bmm``), then take it out of the registry again."""
    assert "gather_bmm" not in moeyard.backend_names()
    spec = importlib.util.spec_from_file_location("custom_backend", EXAMPLE)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    yield "gather_bmm"
    registry._BACKENDS.pop("gather_bmm")


def test_registered_but_never_auto(gather_bmm):
    assert gather_bmm in moeyard.backend_names()
    assert gather_bmm in moeyard.available_backends("cpu", torch.float64)
    for dtype in (torch.float32, torch.float64):
        assert registry.resolve_backend("auto", torch.device("cpu"), dtype).name != gather_bmm


CASES = {  # name: (T, H, I, E, K, ids or None)
    "base": (13, 12, 10, 5, 2, None),
    "T1": (1, 8, 6, 4, 2, None),
    "no_tokens": (0, 8, 6, 4, 2, None),
    "k_eq_E": (6, 8, 6, 3, 3, None),
    "all_to_one_expert": (7, 8, 6, 4, 1, torch.full((7, 1), 2)),
    "empty_experts": (9, 8, 6, 6, 2, random_ids(9, 2, 6, experts=[1, 4])),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_matches_oracle(gather_bmm, case, dtype):
    T, H, I, E, K, ids = CASES[case]
    check_backend(gather_bmm, make_inputs(T, H, I, E, K, ids=ids), dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_bias_lora_and_gpt_oss_layout(gather_bmm, dtype):
    """Biases (their gradients summed by the shared pipeline, ``pipeline.add_row_bias``), LoRA, gpt-oss."""
    inputs = add_lora(make_inputs(11, 8, 6, 4, 2, bias=True), 3)
    check_backend(gather_bmm, inputs, dtype)
    check_backend(
        gather_bmm,
        make_inputs(11, 8, 6, 4, 2, bias=True, transposed=True),
        dtype,
        transposed=True,
        interleaved=True,
        activation="clamped_swiglu",
    )
