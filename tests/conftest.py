"""Shared test set-up.

Without a CUDA GPU, Triton kernels run under Triton's interpreter: ``TRITON_INTERPRET`` must be set
before triton is first imported, so it is set here, before any test module imports moeyard.

The suite runs in parallel with pytest-xdist (``-n auto`` in pyproject.toml): on a machine without a CUDA
GPU, one worker per usable core up to ``MAX_WORKERS``, each with its share of the cores as torch threads; with
a GPU, one process (the CUDA tests time kernels and fill the GPU's memory). ``-n 0`` runs in one process,
``-n N`` or ``PYTEST_XDIST_AUTO_NUM_WORKERS=N`` picks N workers.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

MAX_WORKERS = 4


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: see the module docstring (0 = no workers, the tests run in this process)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    if torch.cuda.is_available():
        return 0
    return max(1, min(MAX_WORKERS, _cores()))


def pytest_configure(config):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:  # an xdist worker: its share of the cores, not all of them
        torch.set_num_threads(max(1, _cores() // workers))


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
