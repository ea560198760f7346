"""Where the Gluon activation-gradient kernel (``dh``, :mod:`moeyard.experts.triton.kernels_gluon_gather`) spends
its time: the kernel as built against copies of it with parts of its epilogue taken out, each timed alone.

Variants (made from the module's source text in a temporary file, so the library itself carries no probe
switches):

- ``built``: the kernel as shipped;
- ``no_stores``: ``d_h`` and ``w act(h)`` not stored (their math dead too); ``h``'s loads, ``act(h)`` and the
  routing weight's gradient kept;
- ``mma_only``: the epilogue reduced to consuming the tile's ``h`` entries of the ring and storing one float
  per row (the K loop's MMAs, the gathered loads and the ring protocol kept);
- ``mma_only_zero_rows``: ``mma_only`` with every gathered copy zero-filling its 16 bytes instead of reading
  them (the ``cp.async`` issue and the ring kept, no row bytes read): what the main loop's gathered reads cost;
- ``mma_only_4_loaders`` and ``built_4_loaders``: four loader warps instead of the eight dh runs with (twice
  the copies per thread; the register split as the up projection's): what the extra loader warps give.

If ``mma_only`` runs near the dense rate, the epilogue (not overlapped with the tensor cores, since both
consumer warp groups reach it together) is what the kernel loses; if not, its main loop is.

    PYTHONPATH=src python3 benchmarks/gather_epilogue_probe.py [--models qwen3-30b-a3b,...] [--rep 100]

Prints ms, TFLOP/s and the share of a dense bf16 matmul's rate (8192^3, same run) per shape and variant.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import inspect
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

HALF_BODY = """    HM: gl.constexpr = acc.shape[0]
    mask = ok[:, None] & (cols < NA)[None, :]
    rows64 = rows.to(gl.int64)
    mbarrier.wait(ready.index(s), phase)"""


def _variants(src: str) -> dict[str, str]:
    """Source text of each variant of the gathering kernels' module."""
    stores = (
        "    gl.store(dh_rows + cols[None, :], (d_a * da_dg).to(dh_ptr.dtype.element_ty), mask=mask)\n",
        "        gl.store(dh_rows + (cols + up_offset)[None, :], (d_a * da_du).to(dh_ptr.dtype.element_ty), mask=mask)\n",
        "    gl.store(aw_ptr + rows64[:, None] * NA + cols[None, :], (a * w[:, None]).to(aw_ptr.dtype.element_ty), mask=mask)\n",
    )
    for line in (*stores, ROWS_MASK):
        assert line in src, line
    no_stores = src
    for line in stores:
        no_stores = no_stores.replace(line, line.replace("mask=mask", "mask=mask & (rows64 < 0)[:, None]"))
    start = src.index("def _dh_half(")
    body = src.index(HALF_BODY, start)
    end = src.index("\n\n\n", body)
    mma_only = (
        src[:body]
        + HALF_BODY
        + """
    fence_async_shared()
    mbarrier.arrive(empty.index(s), count=1)
    s, phase = next_stage(s, phase, STAGES)
    return gl.sum(gl.where(mask, acc, 0.0), axis=1), s, phase"""
        + src[end:]
    )
    zero_rows = mma_only.replace(ROWS_MASK, "mask=(ok & (rows < 0))[:, None] & ((ks + kt * BK) < K)[None, :])")
    return {
        "built": src,
        "no_stores": no_stores,
        "mma_only": mma_only,
        "mma_only_zero_rows": zero_rows,
        "mma_only_4_loaders": _four_loaders(mma_only),
        "built_4_loaders": _four_loaders(src),
    }


ROWS_MASK = "mask=ok[:, None] & ((ks + kt * BK) < K)[None, :])"
LOADERS = "DH_LOADER_WARPS, DH_LOADER_REGS = 8, 32"


def _four_loaders(src: str) -> str:
    """``src`` with dh's loader partition of four warps and the up projection's register split."""
    assert src.count(LOADERS) == 1, LOADERS
    return src.replace(LOADERS, "DH_LOADER_WARPS, DH_LOADER_REGS = 4, 56")


def _load(name: str, text: str, folder: str):
    """Import ``text`` as ``moeyard.experts.triton._probe_<name>`` (its relative imports resolve in that package)."""
    path = os.path.join(folder, f"_probe_{name}.py")
    with open(path, "w") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location(f"moeyard.experts.triton._probe_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> None:
    import torch
    import triton.testing

    import triton_profile as tp
    from moeyard.experts.triton import kernels_gluon_gather, kernels_tma, ops

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen3-30b-a3b,qwen3.5-35b-a3b,sonic-120b")
    ap.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    args = ap.parse_args(argv)
    sq = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    dense = 2 * 8192**3 / triton.testing.do_bench(lambda: sq @ sq, rep=args.rep, return_mode="median") / 1e9
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; dense bf16 "
        f"{dense:.0f} TFLOP/s"
    )
    folder = tempfile.mkdtemp()
    mods = {n: _load(n, t, folder) for n, t in _variants(inspect.getsource(kernels_gluon_gather)).items()}
    kernels_tma.ensure_allocator()
    rows = []
    for model in args.models.split(","):
        s = tp.Shape.of(model)
        x, w_up, w_down, tw, ids, dout = tp.make_inputs(s, 0)
        r = ops.routing(ids, s.E)
        spec = ops.ActSpec(name="swiglu")
        h, _, _ = ops.up_proj(x, w_up, None, r, spec, store_h=True)
        table = ops._gather_table(dout, r, spec, "gluon_dh")
        dh = torch.empty_like(h)
        aw = torch.empty(s.N, s.I, device="cuda", dtype=h.dtype)
        dw = torch.zeros(-(-s.I // kernels_gluon_gather.BN), s.N, device="cuda")
        flops = 2 * s.N * s.H * s.I
        want = None
        call = (dout, w_down, h, tw.reshape(-1), r.sort_order, r.expert_offsets, s.K, "swiglu", 1.702, 7.0, s.I)
        call += (dh, aw, dw, None, None, table, 0.0, 16, 128, ops.num_sms(x.device))
        for name, m in mods.items():
            run = functools.partial(m.launch_dh, *call)
            run()
            if name == "built":
                want = dh.clone()
            ms = triton.testing.do_bench(run, rep=args.rep, return_mode="median")
            tf = flops / ms / 1e9
            rows.append((model, name, ms, tf, 100 * tf / dense))
            if name == "built":
                assert torch.equal(dh, want)
    print("| shape | variant | ms | TFLOP/s | % dense |\n|---|---|---|---|---|")
    for model, name, ms, tf, pct in rows:
        print(f"| {model} | {name} | {ms:.3f} | {tf:.0f} | {pct:.0f}% |")


if __name__ == "__main__":
    main()
