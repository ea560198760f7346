"""The FP8 casts of the expert weights under the ``fp8_rowwise`` recipes' Hopper path, timed alone (one GPU):
the forward's cast per output channel, which also gives each column's ``amax``
(:func:`moeyard.quant.fp8_triton.rowwise_per_expert`, at several rows per program, against
:func:`~moeyard.quant.fp8_triton.rowwise` of the flattened weight), and the transposed cast per input
channel for the input gradient (:func:`~moeyard.quant.fp8_triton.colwise_per_expert`) with that ``amax`` and
without it; each result checked bit-equal, next to a device copy of the weight (the bandwidth ceiling).
GB/s count 2 bytes read and 1 written per element (the reads of ``amax`` passes not counted).

``--nf4``: the same two casts read from NF4 storage (:class:`moeyard.quant.NF4Experts`, bitsandbytes to
quantise): the dequantisation then the dense casts, against the casts decoding the codes in their loads
(:func:`~moeyard.quant.fp8_triton.nf4_source`), per element and as tiles; each checked bit-equal (GB/s count
half a byte read and one written per element for those).

``--sweep``: the forward cast's kernel alone (``_weight_rows_kernel``) at other launch settings: rows per
program, rows per block (``BLOCK_M``) and warps, each checked bit-equal to the default's.

Usage (GPU machine): ``PYTHONPATH=src python3 benchmarks/fp8_cast_probe.py [--model qwen3-30b-a3b ...] [--sweep | --nf4]``
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

from moeyard.bench.models import ANCHOR_MODELS, get_model
from moeyard.quant import fp8_triton as cast


def ms(fn) -> float:
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def weight_casts(E: int, N: int, K: int, rows: list) -> None:
    """Both casts of ``w [E, N, K]`` (bf16, random, columns of different magnitudes)."""
    w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) * torch.rand(E, 1, K, device="cuda").bfloat16()
    case = f"w [{E},{N},{K}]"
    gbs = 3 * w.numel() / 1e6
    q0, s0 = cast.rowwise(w.view(E * N, K))
    rows.append((case, "copy (ceiling)", ms(lambda: w.clone()), 4 * w.numel() / 1e6, ""))
    base = ms(lambda: cast.rowwise(w.view(E * N, K)))
    rows.append((case, "forward: rowwise", base, gbs, ""))
    amax = None
    for r in (None, 64, 256, 1024):
        q, s, amax = cast.rowwise_per_expert(w, rows=r)
        same = torch.equal(q0.view(torch.uint8).view(E, N, K), q.view(torch.uint8)) and torch.equal(s0.view(E, N), s)
        t = ms(lambda r=r: cast.rowwise_per_expert(w, rows=r))
        rows.append((case, f"forward: rowwise_per_expert rows {r}", t, gbs, f"{base / t:.2f}x same {same}"))
    qt, st = cast.colwise_per_expert(w)
    qa, sa = cast.colwise_per_expert(w, amax)
    same = torch.equal(qt.view(torch.uint8), qa.view(torch.uint8)) and torch.equal(st, sa)
    alone = ms(lambda: cast.colwise_per_expert(w))
    rows.append((case, "dgrad: colwise_per_expert", alone, gbs, ""))
    t = ms(lambda: cast.colwise_per_expert(w, amax))
    rows.append((case, "dgrad: colwise_per_expert(amax)", t, gbs, f"{alone / t:.2f}x same {same}"))


def nf4_casts(E: int, N: int, K: int, rows: list) -> None:
    """Both casts of NF4 storage of ``w [E, N, K]``: dequantised then cast, and read by the casts."""
    from moeyard.quant import NF4Experts

    w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) * torch.rand(E, 1, K, device="cuda").bfloat16()
    st = NF4Experts.from_float(w)
    del w
    case, gbs = f"nf4 [{E},{N},{K}]", 1.5 * E * N * K / 1e6
    dense = st.dequantize()
    q0, s0, a0 = cast.rowwise_per_expert(dense)
    t0, ts0 = cast.colwise_per_expert(dense, a0)
    rows.append((case, "dequantize", ms(lambda: st.dequantize()), 2.5 * E * N * K / 1e6, ""))
    rows.append((case, "dense: rowwise_per_expert", ms(lambda: cast.rowwise_per_expert(dense)), 2 * gbs, ""))
    rows.append((case, "dense: colwise_per_expert(amax)", ms(lambda: cast.colwise_per_expert(dense, a0)), 2 * gbs, ""))
    rows.append((case, "nf4_source (decoded absmax)", ms(lambda: cast.nf4_source(st)), 0, ""))
    src = cast.nf4_source(st)
    for tiles, segments in ((True, True), (True, False), (False, False)):
        cast.NF4_TILES, cast.NF4_SEGMENTS = tiles, segments
        q, s, a = cast.rowwise_per_expert(src)
        t, ts = cast.colwise_per_expert(src, a)
        same = torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s, s0) and torch.equal(a, a0)
        same_t = torch.equal(t.view(torch.uint8), t0.view(torch.uint8)) and torch.equal(ts, ts0)
        rows.append(
            (
                case,
                f"nf4: rowwise_per_expert tiles {tiles} segments {segments}",
                ms(lambda: cast.rowwise_per_expert(src)),
                gbs,
                f"same {same}",
            )
        )
        rows.append(
            (
                case,
                f"nf4: colwise_per_expert tiles {tiles} segments {segments}",
                ms(lambda a=a: cast.colwise_per_expert(src, a)),
                gbs,
                f"same {same_t}",
            )
        )
    cast.NF4_TILES = cast.NF4_SEGMENTS = True


def weight_rows_sweep(E: int, N: int, K: int, rows: list) -> None:
    """``_weight_rows_kernel`` on ``w [E, N, K]`` at each (rows per program, BLOCK_M, warps), against the
    default launch of :func:`~moeyard.quant.fp8_triton.rowwise_per_expert`."""
    import triton

    w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) * torch.rand(E, 1, K, device="cuda").bfloat16()
    case, gbs = f"w [{E},{N},{K}]", 3 * w.numel() / 1e6
    q0, s0, a0 = cast.rowwise_per_expert(w)
    rows.append((case, "rowwise_per_expert (default)", ms(lambda: cast.rowwise_per_expert(w)), gbs, ""))
    width = triton.next_power_of_2(K)
    for per_program in (64, 128, 256, 512):
        for block_m in sorted({max(1, 8192 // width), max(1, 16384 // width), max(1, 4096 // width)}):
            if block_m > per_program or block_m * width > 16384:
                continue
            for warps in (4, 8):
                q = torch.empty(E, N, K, device="cuda", dtype=torch.float8_e4m3fn)
                s = torch.empty(E, N, device="cuda")
                amax = torch.zeros(E, K, device="cuda")

                def run(q=q, s=s, amax=amax, pp=per_program, bm=block_m, nw=warps):
                    amax.zero_()
                    cast._weight_rows_kernel[(E, triton.cdiv(N, pp))](
                        q_ptr=q,
                        s_ptr=s,
                        amax_ptr=amax,
                        N=N,
                        K=K,
                        ROWS=pp,
                        BLOCK_M=bm,
                        BLOCK_K=width,
                        num_warps=nw,
                        **cast._weight_args(w, width),
                    )

                run()
                same = torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s, s0)
                same = same and torch.equal(amax, a0)
                rows.append((case, f"rows {per_program} BLOCK_M {block_m} warps {warps}", ms(run), gbs, f"same {same}"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", default=[])
    p.add_argument("--sweep", action="store_true", help="the forward cast's kernel at other launch settings")
    p.add_argument("--nf4", action="store_true", help="the casts read from NF4 storage")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    rows: list = []
    for name in args.model or ANCHOR_MODELS:
        c = get_model(name).config
        E, H, I = c["num_experts"], c["hidden_size"], c["intermediate_size"]
        for n, k in ((2 * I, H), (H, I)):
            (weight_rows_sweep if args.sweep else nf4_casts if args.nf4 else weight_casts)(E, n, k, rows)
    print(torch.cuda.get_device_name())
    for case, what, t, nbytes, note in rows:
        print(f"{case:22s} {what:40s} {t:7.3f} ms {nbytes / t:6.0f} GB/s  {note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
