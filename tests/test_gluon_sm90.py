"""The warp-specialised Gluon kernels (:mod:`moeyard.experts.triton.kernels_gluon`: the down projection;
:mod:`~moeyard.experts.triton.kernels_gluon_gather`: the up projection and the activation gradient;
:mod:`~moeyard.experts.triton.kernels_gluon_wgrad`: the weight gradients)
compiled for sm_90a on the CPU, with the installed Triton's bundled ``ptxas`` and no GPU: each variant the
library launches (row tiles of 64 and 128, with and without a LoRA term, ``W`` or ``Lb`` K-major or not,
ranks 8 to 32, gated and plain activations) compiles,
keeps its registers (no spills: no local-memory stores in the SASS), fits the 227 KiB of shared memory a
Hopper block can hold, and, at 128-row tiles, is warp-specialised (``setmaxnreg`` moves registers between
the partitions); the gathering kernels copy their rows with 16-byte ``cp.async``; the e4m3 grouped GEMM
of :mod:`moeyard.quant.fp8_gluon` and the e4m3 weight gradient of :mod:`moeyard.quant.fp8_gluon_wgrad` run e4m3
MMAs. A Triton whose Gluon
API changed fails here instead of at a user's first launch.

The compiles run in a fresh Python process (this file run as a script): Triton's interpreter, which
the other CPU tests use, patches ``triton.language`` while it runs, and a compile must not see that."""

import json
import os
import subprocess
import sys
import tempfile

import pytest

VARIANTS = [
    (128, True, True, 8),
    (128, True, False, 32),
    (128, False, True, 0),
    (64, True, False, 16),
    (64, False, False, 0),
]  # down: (BM, LoRA, W K-major, rank)
# the gathering kernels: (kernel, BM, activation, W or Lb K-major, rank; 0: no LoRA)
GATHER_VARIANTS = [
    ("up", 128, "swiglu", True, 16),
    ("up", 128, "swiglu", False, 32),
    ("up", 128, "swiglu", True, 0),
    ("up", 64, "swiglu", True, 8),
    ("up", 64, "reglu", True, 0),
    ("up", 128, "clamped_swiglu", True, 0),
    ("up", 128, "gelu", True, 0),
    ("dh", 128, "swiglu", False, 0),
    ("dh", 128, "swiglu", False, 16),
    ("dh", 128, "swiglu", True, 32),
    ("dh", 64, "reglu", True, 8),
    ("dh", 128, "gelu", False, 0),
]
# the weight gradients: (gathered operand: "rhs" for dW_up = d_h^T x[token], "lhs" for dW_down; dW's dtype)
WGRAD_VARIANTS = [("rhs", "bfloat16"), ("lhs", "bfloat16"), ("rhs", "float32")]
FP8_WGRAD_VARIANTS = ["bfloat16", "float32"]  # the e4m3 weight gradient's dW dtype: TMA-stored, stored by row
SHARED_LIMIT = 227 * 1024  # bytes of shared memory one block may use on sm_90
pytestmark = pytest.mark.xdist_group("gluon_sm90")  # one pytest-xdist worker compiles them all, once


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
    from moeyard.experts.triton import kernels_gluon_gather as gather, kernels_gluon_wgrad as wgrad

    compiled = []

    def grab(module, name):
        kernel = getattr(module, name)

        class Grab:
            def __getitem__(self, grid):
                return lambda *a, **k: compiled.append(kernel.run(*a, grid=grid, warmup=True, **k))

        setattr(module, name, Grab())

    grab(kernels_gluon, "down_kernel")
    grab(gather, "gathered_kernel")
    grab(wgrad, "wgrad_kernel")
    from moeyard.experts.triton import schedule
    from moeyard.quant import fp8_gluon

    grab(fp8_gluon, "gluon_grouped_kernel")
    from moeyard.quant import fp8_gluon_wgrad

    grab(fp8_gluon_wgrad, "fp8_wgrad_kernel")
    schedule.fill_tile_table = lambda *args: None  # a launch: nothing runs here
    E, NY, KA, N, bf = 8, 2048, 512, 4096, torch.bfloat16
    table = lambda block_m: torch.empty(2 * (N // block_m + E) + 1, dtype=torch.int32)  # noqa: E731
    for block_m, lora, kmajor, rank in VARIANTS:
        w = torch.empty(E, NY, KA, dtype=bf) if kmajor else torch.empty(E, KA, NY, dtype=bf).mT
        lb = (torch.empty(E, NY, rank, dtype=bf) if kmajor else torch.empty(E, rank, NY, dtype=bf).mT) if lora else None
        kernels_gluon.launch(
            torch.empty(N, KA, dtype=bf),
            w,
            torch.empty(E, NY, dtype=bf),
            torch.empty(N),
            torch.empty(N, dtype=torch.int64),
            torch.empty(E + 1, dtype=torch.int32),
            torch.empty(N, NY, dtype=bf),
            lb,
            torch.empty(N, rank, dtype=bf) if lora else None,
            table(block_m),
            0.5,
            max(16, rank),
            block_m,
            132,
        )
    T, H, I = 1024, 2048, 768
    for kernel, block_m, act, kmajor, rank in GATHER_VARIANTS:
        n1 = I if act == "gelu" else 2 * I
        lora = dict(
            z=torch.empty(N, rank, dtype=bf) if rank else None,
            table=table(block_m),
            lora_scale=0.5,
            rp=max(16, rank),
            block_m=block_m,
            num_sms=132,
        )
        common = dict(
            sort_order=torch.empty(N, dtype=torch.int64),
            expert_offsets=torch.empty(E + 1, dtype=torch.int32),
            top_k=4,
            act=act,
            alpha=1.702,
            limit=7.0,
            up_offset=n1 - I,
        )
        lb_shape = n1 if kernel == "up" else I
        lb = None
        if rank:
            lb = torch.empty(E, lb_shape, rank, dtype=bf) if kmajor else torch.empty(E, rank, lb_shape, dtype=bf).mT
        if kernel == "up":
            gather.launch_up(
                torch.empty(T, H, dtype=bf),
                torch.empty(E, n1, H, dtype=bf),
                torch.empty(E, n1),
                h=torch.empty(N, n1, dtype=bf),
                a=torch.empty(N, I, dtype=bf),
                lb=lb,
                **common,
                **lora,
            )
        else:
            w = torch.empty(E, I, H, dtype=bf).mT if kmajor else torch.empty(E, H, I, dtype=bf)
            gather.launch_dh(
                torch.empty(T, H, dtype=bf),
                w,
                torch.empty(N, n1, dtype=bf),
                torch.empty(N, dtype=bf),
                dh=torch.empty(N, n1, dtype=bf),
                aw=torch.empty(N, I, dtype=bf),
                dw=torch.empty(12, N),
                lb=lb,
                **common,
                **lora,
            )
    token = torch.empty(N, dtype=torch.int32)
    for gathered, dw_dtype in WGRAD_VARIANTS:
        offsets = torch.empty(E + 1, dtype=torch.int32)
        if gathered == "rhs":
            wgrad.launch(
                torch.empty(N, 2 * I, dtype=bf),
                torch.empty(T, H, dtype=bf),
                False,
                token,
                offsets,
                torch.empty(E, 2 * I, H, dtype=getattr(torch, dw_dtype)),
                1.0,
                132,
            )
        else:
            wgrad.launch(
                torch.empty(T, H, dtype=bf),
                torch.empty(N, I, dtype=bf),
                True,
                token,
                offsets,
                torch.empty(E, H, I, dtype=getattr(torch, dw_dtype)),
                1.0,
                132,
            )
    f8 = torch.float8_e4m3fn
    for by_index in (False, True):  # rows in order (TMA), rows gathered by index (cp.async)
        fp8_gluon.launch(
            torch.empty(T if by_index else N, KA, dtype=f8),
            torch.empty(T if by_index else N),
            torch.empty(E, NY, KA, dtype=f8),
            torch.empty(E, NY),
            torch.empty(E + 1, dtype=torch.int32),
            torch.empty(N, NY, dtype=bf),
            torch.empty(N, dtype=torch.int64) if by_index else None,
        )
    for dw_dtype in FP8_WGRAD_VARIANTS:  # the padded column casts of d h [N, 2I] and x [T, H] -> dW_up
        width = N + E * 128
        fp8_gluon_wgrad.launch(
            torch.empty(2 * I, width, dtype=f8),
            torch.empty(E, 2 * I),
            torch.empty(H, width, dtype=f8),
            torch.empty(E, H),
            torch.empty(E + 1, dtype=torch.int32),
            torch.empty(E, 2 * I, H, dtype=getattr(torch, dw_dtype)),
        )
    return [_resources(k, triton) for k in compiled]


def _resources(k, triton) -> dict:
    """What the checks read from one compiled kernel: shared memory, warps, spills, ``setmaxnreg``, copies."""
    import re

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(k.asm["cubin"])
        sass = subprocess.run(
            [os.path.join(tools, "cuobjdump"), "-sass", path], capture_output=True, text=True, check=True
        ).stdout
    ptx = k.asm["ptx"]
    return dict(
        shared=k.metadata.shared,
        warps=k.metadata.num_warps,
        spills=len(re.findall(r"\bSTL\b", sass)),
        setmaxnreg="setmaxnreg" in ptx,
        fp8_mma="e4m3.e4m3" in ptx,
        copy_bytes=sorted(set(re.findall(r"cp\.async\.c[ag]\.shared\.global \[[^]]*\], \[[^]]*\], (\w+)", ptx))),
    )


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


def _check(k: dict, block_m: int, loaders: int = 4) -> None:
    assert k["shared"] <= SHARED_LIMIT, f"{k['shared']} bytes of shared memory"
    assert k["spills"] == 0, f"{k['spills']} register spills (local-memory stores)"
    # 4 + (4) + 1, 4 or 8 loader warps, rounded to warp groups
    assert k["warps"] == (8 if block_m == 128 else 4) + max(loaders, 4)
    assert k["setmaxnreg"] or block_m == 64


@pytest.mark.parametrize(
    "i", range(len(VARIANTS)), ids=[f"bm{v[0]}-lora{int(v[1])}-kmajor{int(v[2])}-r{v[3]}" for v in VARIANTS]
)
def test_down_compiles_for_sm90(i, compiled):
    _check(compiled[i], VARIANTS[i][0])


@pytest.mark.parametrize(
    "i", range(len(GATHER_VARIANTS)), ids=["{}-bm{}-{}-kmajor{:d}-r{}".format(*v) for v in GATHER_VARIANTS]
)
def test_gather_compiles_for_sm90(i, compiled):
    from moeyard.experts.triton import kernels_gluon_gather as gather

    kernel, block_m = GATHER_VARIANTS[i][:2]
    k = compiled[len(VARIANTS) + i]
    _check(k, block_m, gather.DH_LOADER_WARPS if kernel == "dh" and block_m == 128 else gather.LOADER_WARPS)
    assert k["copy_bytes"] == ["0x10"], f"the gathered rows' copies: {k['copy_bytes']} bytes"


@pytest.mark.parametrize("i", range(len(WGRAD_VARIANTS)), ids=["{}-gathered-dw-{}".format(*v) for v in WGRAD_VARIANTS])
def test_wgrad_compiles_for_sm90(i, compiled):
    k = compiled[len(VARIANTS) + len(GATHER_VARIANTS) + i]
    _check(k, 128)
    assert k["copy_bytes"] == ["0x10"], f"the gathered rows' copies: {k['copy_bytes']} bytes"


@pytest.mark.parametrize("by_index", [False, True], ids=["rows-in-order", "rows-gathered"])
def test_fp8_grouped_compiles_for_sm90(by_index, compiled):
    """The e4m3 grouped GEMM (:mod:`moeyard.quant.fp8_gluon`): e4m3 wgmma, two consumer warp groups and a
    loader; gathering by index, with 16-byte ``cp.async`` copies."""
    k = compiled[_FP8 + int(by_index)]
    _check(k, 128)
    assert k["fp8_mma"], "no e4m3 wgmma in the PTX"
    assert k["copy_bytes"] == (["0x10"] if by_index else []), k["copy_bytes"]


_FP8 = len(VARIANTS) + len(GATHER_VARIANTS) + len(WGRAD_VARIANTS)  # the e4m3 GEMMs' first entry


@pytest.mark.parametrize("i", range(len(FP8_WGRAD_VARIANTS)), ids=[f"dw-{v}" for v in FP8_WGRAD_VARIANTS])
def test_fp8_wgrad_compiles_for_sm90(i, compiled):
    """The e4m3 weight gradient (:mod:`moeyard.quant.fp8_gluon_wgrad`): e4m3 wgmma, two consumer warp groups
    and a TMA loader warp, no copies by ``cp.async``; the TMA-stored form within the 227 KiB too."""
    k = compiled[_FP8 + 2 + i]
    _check(k, 128)
    assert k["fp8_mma"], "no e4m3 wgmma in the PTX"
    assert k["copy_bytes"] == [], k["copy_bytes"]


if __name__ == "__main__":
    print(json.dumps(_compile_all()))


def test_epilogue_probe_patches_the_kernel_source():
    """``benchmarks/gather_epilogue_probe.py`` makes its variants by editing the activation-gradient kernel's
    source text: each edit must still find its anchor in the kernel as it is now, and give valid Python that
    differs from the kernel (a kernel change that moves an anchor fails here, not in a GPU call)."""
    import pathlib

    from helpers import load_benchmark

    probe = load_benchmark("gather_epilogue_probe")
    path = pathlib.Path(__file__).resolve().parents[1] / "src/moeyard/experts/triton/kernels_gluon_gather.py"
    src = path.read_text()
    variants = probe._variants(src)
    assert variants["built"] == src
    assert set(variants) == {
        "built",
        "no_stores",
        "mma_only",
        "mma_only_zero_rows",
        "mma_only_4_loaders",
        "built_4_loaders",
    }
    for name in set(variants) - {"built"}:
        assert variants[name] != src, name
        compile(variants[name], f"_probe_{name}.py", "exec")
    assert variants["mma_only"].count("gl.store(dh_rows") == 0 and variants["no_stores"].count("rows64 < 0") == 3
    assert variants["mma_only_zero_rows"].count("ok & (rows < 0)") == 1
    assert all("DH_LOADER_REGS = 4, 56" in variants[n] for n in ("mma_only_4_loaders", "built_4_loaders"))
