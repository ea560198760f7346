"""The warp-specialised Gluon down projection (:mod:`moeyard.experts.triton.kernels_gluon`) compiled for
sm_90a on the CPU, with the installed Triton's bundled ``ptxas`` and no GPU: each variant the library
launches (row tiles of 64 and 128, with and without a LoRA term, ``W`` K-major or not, ranks 8 and 32)
compiles, keeps its registers (no local-memory spills), fits the 227 KiB of shared memory a Hopper block
can hold, and, at 128-row tiles, is warp-specialised (``setmaxnreg`` moves registers between the
partitions). A Triton whose Gluon API changed fails here instead of at a user's first launch.

The compiles run in a fresh Python process (this file run as a script): Triton's interpreter, which
the other CPU tests use, patches ``triton.language`` while it runs, and a compile must not see that."""
import json
import os
import subprocess
import sys
import tempfile

import pytest

VARIANTS = [(128, True, True, 8), (128, True, False, 32), (128, False, True, 0), (64, True, False, 16),
            (64, False, False, 0)]  # (BM, LoRA, W K-major, rank)
SHARED_LIMIT = 227 * 1024  # bytes of shared memory one block may use on sm_90


def _compile_all() -> list[dict]:
    """Compile every variant for sm_90a through a stand-in active driver (nothing is launched)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    from moeyard.experts.triton import kernels_gluon

    class Sm90:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(Sm90())
    kernel, compiled = kernels_gluon.down_kernel, []

    class Grab:
        def __getitem__(self, grid):
            return lambda *a, **k: compiled.append(kernel.run(*a, grid=grid, warmup=True, **k))

    kernels_gluon.down_kernel = Grab()
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    E, NY, KA, N, bf = 8, 2048, 512, 4096, torch.bfloat16
    out = []
    for block_m, lora, kmajor, rank in VARIANTS:
        w = torch.empty(E, NY, KA, dtype=bf) if kmajor else torch.empty(E, KA, NY, dtype=bf).mT
        lb = (torch.empty(E, NY, rank, dtype=bf) if kmajor else torch.empty(E, rank, NY, dtype=bf).mT) if lora else None
        kernels_gluon.launch(torch.empty(N, KA, dtype=bf), w, torch.empty(E, NY, dtype=bf), torch.empty(N),
                             torch.empty(N, dtype=torch.int64), torch.empty(E + 1, dtype=torch.int32),
                             torch.empty(N, NY, dtype=bf), lb, torch.empty(N, rank, dtype=bf) if lora else None,
                             torch.empty(2 * (N // block_m + E) + 1, dtype=torch.int32), 0.5, max(16, rank), block_m,
                             132)
        k = compiled.pop()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "kernel.cubin")
            with open(path, "wb") as f:
                f.write(k.asm["cubin"])
            usage = subprocess.run([cuobjdump, "-res-usage", path], capture_output=True, text=True, check=True).stdout
        out.append(dict(shared=k.metadata.shared, warps=k.metadata.num_warps, usage=usage,
                        setmaxnreg="setmaxnreg" in k.asm["ptx"]))
    return out


@pytest.fixture(scope="module")
def compiled():
    triton = pytest.importorskip("triton")
    pytest.importorskip("triton.experimental.gluon")
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")):
        pytest.skip("this Triton has no CUDA backend tools")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, f"compiling for sm_90a failed:\n{run.stderr[-4000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("i", range(len(VARIANTS)), ids=[f"bm{v[0]}-lora{int(v[1])}-kmajor{int(v[2])}-r{v[3]}"
                                                         for v in VARIANTS])
def test_compiles_for_sm90(i, compiled):
    block_m = VARIANTS[i][0]
    k = compiled[i]
    assert k["shared"] <= SHARED_LIMIT, f"{k['shared']} bytes of shared memory"
    assert "LOCAL:0" in k["usage"], f"registers spilled to local memory: {k['usage']}"
    assert k["warps"] == (12 if block_m == 128 else 8)  # 4 + (4) + 1 warps, rounded to warp groups
    assert k["setmaxnreg"] or block_m == 64


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
