"""FP8 dispatch under expert parallelism on CPU with gloo: the ``all_to_all`` and ``all_gather``
dispatchers carrying e4m3 rows against one process on the rows cast the same way (outputs and every
gradient), with and without the ``fp8_rowwise`` recipe, a rank with no tokens; the errors."""

import pytest
import torch
import torch.distributed as dist

import ep_fp8_workers
import ep_workers

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)


@pytest.mark.parametrize("world", [2, 4])
def test_fp8_dispatch(world):
    ep_workers.spawn(ep_fp8_workers.worker, world)


@pytest.mark.parametrize("N, H", [(0, 16), (1, 16), (37, 48), (130, 2048)])
def test_packed_rows_kernels_match_reference(N, H):
    # the Triton pack (the cast writing the packed bytes) and unpack (dequantising in place) against torch
    pytest.importorskip("triton")
    from moeyard.kernel_op import interpreting
    from moeyard.parallel import fp8_rows

    if not interpreting():
        pytest.skip("the kernels run on a CPU under Triton's interpreter")
    torch.manual_seed(N)
    x = (torch.randn(N, H) * torch.logspace(-3, 3, H)).bfloat16()
    x[: N // 3] = 0  # zero rows: scale of the smallest amax, zero bytes
    want = fp8_rows.pack_reference(x)
    got = fp8_rows.pack_kernel(x)
    assert got.shape == (N, H + 16) and torch.equal(got, want)
    out = torch.full((N + 2, H), float("nan"), dtype=torch.bfloat16)
    back = fp8_rows.unpack_kernel(got, H, torch.bfloat16, out=out[1 : N + 1])
    assert torch.equal(back, fp8_rows.unpack_reference(want, H, torch.bfloat16))
    assert out[0].isnan().all() and out[N + 1].isnan().all()  # nothing outside the view written
