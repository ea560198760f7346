"""The warp-specialised Gluon down projection (:mod:`moeyard.experts.triton.kernels_gluon`) compiled for
sm_90a on the CPU, with the installed Triton's bundled ``ptxas`` and no GPU: each variant the library
launches (row tiles of 64 and 128, with and without a LoRA term, ``W`` K-major or not, ranks 8 and 32)
compiles, keeps its registers (no local-memory spills), fits the 227 KiB of shared memory a Hopper block
can hold, and, at 128-row tiles, is warp-specialised (``setmaxnreg`` moves registers between the
partitions). A Triton whose Gluon API changed fails here instead of at a user's first launch."""
import os
import subprocess

import pytest
import torch

triton = pytest.importorskip("triton")
gluon_kernels = pytest.importorskip("moeyard.experts.triton.kernels_gluon")

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
SHARED_LIMIT = 227 * 1024  # bytes of shared memory one block may use on sm_90
if not os.path.exists(CUOBJDUMP):
    pytest.skip("this Triton has no CUDA backend tools", allow_module_level=True)


class _Sm90:
    """A stand-in for Triton's active driver: the target is sm_90a; nothing is launched."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


@pytest.fixture
def compile_only(monkeypatch):
    """Swap in the sm_90a stand-in and make ``kernels_gluon.down_kernel[grid](...)`` compile without
    launching; yields the list the compiled kernels go to. Restores the driver and drops the kernel's
    caches for the stand-in device afterwards."""
    from triton.runtime import driver
    kernel = gluon_kernels.down_kernel
    compiled = []

    class Grab:
        def __getitem__(self, grid):
            return lambda *a, **k: compiled.append(kernel.run(*a, grid=grid, warmup=True, **k))

    saved = driver._active
    driver.set_active(_Sm90())
    monkeypatch.setattr(gluon_kernels, "down_kernel", Grab())
    try:
        yield compiled
    finally:
        driver._active = saved
        kernel.device_caches.clear()


def _resources(cubin: bytes, tmp_path) -> str:
    path = tmp_path / "k.cubin"
    path.write_bytes(cubin)
    return subprocess.run([CUOBJDUMP, "-res-usage", str(path)], capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("block_m, lora, kmajor, rank", [(128, True, True, 8), (128, True, False, 32),
                                                         (128, False, True, 0), (64, True, False, 16),
                                                         (64, False, False, 0)])
def test_compiles_for_sm90(block_m, lora, kmajor, rank, compile_only, tmp_path):
    E, NY, KA, N = 8, 2048, 512, 4096
    bf = torch.bfloat16
    rows = torch.empty(N, KA, dtype=bf)
    w = torch.empty(E, NY, KA, dtype=bf) if kmajor else torch.empty(E, KA, NY, dtype=bf).mT
    z = torch.empty(N, rank, dtype=bf) if lora else None
    lb = (torch.empty(E, NY, rank, dtype=bf) if kmajor else torch.empty(E, rank, NY, dtype=bf).mT) if lora else None
    sort_order, offsets = torch.empty(N, dtype=torch.int64), torch.empty(E + 1, dtype=torch.int32)
    table = torch.empty(2 * (N // block_m + E) + 1, dtype=torch.int32)
    gluon_kernels.launch(rows, w, torch.empty(E, NY, dtype=bf), torch.empty(N), sort_order, offsets,
                         torch.empty(N, NY, dtype=bf), lb, z, table, 0.5, max(16, rank), block_m, 132)
    (k,) = compile_only
    assert k.metadata.shared <= SHARED_LIMIT, f"{k.metadata.shared} bytes of shared memory"
    usage = _resources(k.asm["cubin"], tmp_path)
    assert "LOCAL:0" in usage, f"registers spilled to local memory: {usage}"
    assert k.metadata.num_warps == (12 if block_m == 128 else 8)  # 4 + (4) + 1, rounded to warp groups
    if block_m == 128:
        assert "setmaxnreg" in k.asm["ptx"]
