"""The transformers experts implementation "moeyard" against eager on a CUDA GPU, for every backend
that runs there, in float32 and bfloat16.

Tolerances: float32 as verify.TOLERANCE (1e-4 relative, same routing, summation order only).
bfloat16 is judged against PyTorch's own bf16 error: both eager-bf16 and moeyard-bf16 are compared
with a float64 eager run of the same weights, and moeyard may be at most
``2 * err(eager) + verify.LOW_PRECISION_SLACK`` (see verify.py).
"""
import pytest
import torch

pytest.importorskip("transformers")

import moeyard  # noqa: E402
from moeyard import verify  # noqa: E402
from moeyard.integrations import transformers as integration  # noqa: E402

pytestmark = pytest.mark.cuda

DTYPES = [torch.float32, torch.bfloat16]


def _backends(dtype):
    return moeyard.available_backends("cuda", dtype) if torch.cuda.is_available() else []


@pytest.fixture(autouse=True)
def _registered():
    integration.register()
    with verify.quiet_transformers():
        yield


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("arch", verify.REQUIRED)
def test_model_parity_every_cuda_backend(arch, dtype):
    backends = _backends(dtype)
    assert backends, "no moeyard backend runs on this GPU"
    results = verify.check_arch(verify.ARCHS[arch], backends, device="cuda", dtype=dtype)
    bad = [r for r in results if r.status != "pass"]
    assert not bad, bad
