"""Shared test set-up.

Without a CUDA GPU, Triton kernels run under Triton's interpreter: ``TRITON_INTERPRET`` must be set
before triton is first imported, so it is set here, before any test module imports moeyard.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
