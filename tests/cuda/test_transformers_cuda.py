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


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_compiled_generate_matches_eager(arch):
    # transformers' generate with a static KV cache compiles the decoding step (torch.compile, fullgraph, CUDA
    # graphs by default): with moeyard's experts (the default backend on this GPU) it decodes eager's tokens, its
    # logits close at every step (float32: only the compiler's fusions differ)
    from transformers import CompileConfig

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = verify.build_model(arch, device="cuda", experts_implementation="moeyard").eval()
    g = torch.Generator("cuda").manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 7), device="cuda", generator=g)
    kw = dict(
        attention_mask=torch.ones_like(ids),
        max_new_tokens=6,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
        cache_implementation="static",
    )
    want = model.generate(ids, disable_compile=True, **kw)
    got = model.generate(ids, compile_config=CompileConfig(fullgraph=True), **kw)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # the decoding step was compiled
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
