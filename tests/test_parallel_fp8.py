"""FP8 dispatch under expert parallelism on CPU with gloo: the ``all_to_all`` and ``all_gather``
dispatchers carrying e4m3 rows against one process on the rows cast the same way (outputs and every
gradient), with and without the ``fp8_rowwise`` recipe, a rank with no tokens; the errors."""

import pytest
import torch.distributed as dist

import ep_fp8_workers
import ep_workers

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)


@pytest.mark.parametrize("world", [2, 4])
def test_fp8_dispatch(world):
    ep_workers.spawn(ep_fp8_workers.worker, world)
