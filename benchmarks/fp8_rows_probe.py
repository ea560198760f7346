"""The forward's weight cast per output channel (:func:`moeyard.quant.fp8_triton.rowwise_per_expert`) against
two other schedules of the same work, timed alone on one GPU, each result checked bit-equal (codes, scales,
column ``amax``):

- ``strip``: one program per block of ``BLOCK_M`` rows of one expert, two passes over the row in chunks of
  ``BLOCK_K`` columns (the rows' ``amax`` with each chunk's column ``amax`` folded in by atomic max, then the
  cast, the second read mostly from L2), so a program has many independent loads in flight instead of one
  row block at a time;
- ``rows``: the kernel as built, its column ``amax`` reduced over the block's rows at each step (a ``[BLOCK_K]``
  vector kept instead of a ``[BLOCK_M, BLOCK_K]`` block), which frees registers for larger row blocks.

Dense bf16 weights and NF4 storage (``--nf4``, bitsandbytes needed); GB/s count the bytes read once (2 a
dense element, half an NF4 one) and 1 written.

Usage (GPU machine): ``PYTHONPATH=src python3 benchmarks/fp8_rows_probe.py [--model qwen3-30b-a3b ...] [--nf4]``
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from moeyard.bench.models import ANCHOR_MODELS, get_model
from moeyard.quant import fp8_triton as cast
from moeyard.quant.fp8_triton import _row_scale, _store_rows, _weight_args, _weight_block


@triton.jit
def _strip_kernel(
    w_ptr, code_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, active_ptr,
    q_ptr, s_ptr, amax_ptr, N, K,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    NF4: tl.constexpr, NESTED: tl.constexpr, BS: tl.constexpr, ROUND: tl.constexpr, HAS_ACTIVE: tl.constexpr,
    TILE: tl.constexpr, SEG: tl.constexpr,
):  # fmt: skip
    e = tl.program_id(0).to(tl.int64)
    if HAS_ACTIVE:
        if tl.load(active_ptr + e) == 0:
            return
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_rows = rows < N
    row0 = e * N * K + rows.to(tl.int64) * K
    cols = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        b = _weight_block(
            w_ptr, code_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, row0 + k0, m_rows, K - k0, BLOCK_K,
            NF4, NESTED, BS, ROUND, TILE, SEG,
        )  # fmt: skip
        a = tl.abs(b)
        amax = tl.maximum(amax, tl.max(a, axis=1))
        tl.atomic_max(amax_ptr + e * K + k0 + cols, tl.max(a, axis=0), mask=k0 + cols < K)
    scale = _row_scale(s_ptr + e * N, amax, rows, m_rows, 1, True)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        b = _weight_block(
            w_ptr, code_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, row0 + k0, m_rows, K - k0, BLOCK_K,
            NF4, NESTED, BS, ROUND, TILE, SEG,
        )  # fmt: skip
        _store_rows(q_ptr + e * N * K + k0, b, scale, rows, m_rows, cols, K - k0, K, True)


@triton.jit
def _rows_kernel(
    w_ptr, code_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, active_ptr,
    q_ptr, s_ptr, amax_ptr, N, K,
    ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    NF4: tl.constexpr, NESTED: tl.constexpr, BS: tl.constexpr, ROUND: tl.constexpr, HAS_ACTIVE: tl.constexpr,
    TILE: tl.constexpr, SEG: tl.constexpr,
):  # fmt: skip
    e = tl.program_id(0).to(tl.int64)
    if HAS_ACTIVE:
        if tl.load(active_ptr + e) == 0:
            return
    n0 = tl.program_id(1) * ROWS
    cols = tl.arange(0, BLOCK_K)
    col_max = tl.zeros([BLOCK_K], dtype=tl.float32)
    for c in tl.range(0, ROWS, BLOCK_M, num_stages=STAGES):
        rows = n0 + c + tl.arange(0, BLOCK_M)
        m_rows = rows < N
        row0 = e * N * K + rows.to(tl.int64) * K
        b = _weight_block(
            w_ptr, code_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, row0, m_rows, K, BLOCK_K,
            NF4, NESTED, BS, ROUND, TILE, SEG,
        )  # fmt: skip
        a = tl.abs(b)
        scale = _row_scale(s_ptr + e * N, tl.max(a, axis=1), rows, m_rows, 1, True)
        _store_rows(q_ptr + e * N * K, b, scale, rows, m_rows, cols, K, K, True)
        col_max = tl.maximum(col_max, tl.max(a, axis=0))
    tl.atomic_max(amax_ptr + e * K + cols, col_max, mask=cols < K)


def ms(fn) -> float:
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def _buffers(E, N, K):
    q = torch.empty(E, N, K, device="cuda", dtype=torch.float8_e4m3fn)
    return q, torch.empty(E, N, device="cuda"), torch.zeros(E, K, device="cuda")


def _configs(K: int):
    """The launches tried: ``(label, kernel, grid rows per program, constexprs)`` for rows of ``K``."""
    width = triton.next_power_of_2(K)
    for bm in (32, 64):
        for bk in (b for b in (128, 256) if b <= width):
            for warps, stages in ((4, 1), (4, 3), (8, 1), (8, 3)):
                yield (
                    f"strip BM {bm} BK {bk} w{warps} s{stages}",
                    _strip_kernel,
                    bm,
                    dict(BLOCK_M=bm, BLOCK_K=bk, STAGES=stages, num_warps=warps),
                )
    for bm in sorted({max(1, 4096 // width), max(1, 8192 // width)}):
        for warps, stages in ((4, 1), (4, 2), (8, 1), (8, 2)):
            yield (
                f"rows 256 BM {bm} w{warps} s{stages}",
                _rows_kernel,
                256,
                dict(ROWS=256, BLOCK_M=bm, BLOCK_K=width, STAGES=stages, num_warps=warps),
            )


def variants(src, E: int, N: int, K: int, case: str, nbytes: float, out: list) -> None:
    """The built cast of ``src`` and each of :func:`_configs`, timed, each checked bit-equal to the built one."""
    q0, s0, a0 = cast.rowwise_per_expert(src)
    base = ms(lambda: cast.rowwise_per_expert(src))
    out.append((case, "built (rowwise_per_expert)", base, nbytes, ""))
    for label, kernel, rows, meta in _configs(K):
        q, s, amax = _buffers(E, N, K)

        def run(q=q, s=s, amax=amax, kernel=kernel, rows=rows, meta=meta):
            amax.zero_()
            kernel[(E, triton.cdiv(N, rows))](
                q_ptr=q, s_ptr=s, amax_ptr=amax, N=N, K=K, **meta, **_weight_args(src, meta["BLOCK_K"])
            )

        try:
            run()
            same = torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s, s0)
            same = same and torch.equal(amax, a0)
            t = ms(run)
        except Exception as exc:  # noqa: BLE001 - a config that does not compile is reported, not fatal
            out.append((case, label, float("nan"), nbytes, repr(exc)[:60]))
            continue
        out.append((case, label, t, nbytes, f"{base / t:.2f}x same {same}"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", default=[])
    p.add_argument("--nf4", action="store_true", help="read NF4 storage (bitsandbytes needed)")
    p.add_argument("--top", type=int, default=6, help="rows printed per weight, fastest first, after the built one")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    out: list = []
    for name in args.model or ANCHOR_MODELS:
        c = get_model(name).config
        E, H, I = c["num_experts"], c["hidden_size"], c["intermediate_size"]
        for N, K in ((2 * I, H), (H, I)):
            w = (
                torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16)
                * torch.rand(E, 1, K, device="cuda").bfloat16()
            )
            if args.nf4:
                from moeyard.quant import NF4Experts

                src, nbytes, case = (
                    cast.nf4_source(NF4Experts.from_float(w)),
                    1.5 * w.numel() / 1e6,
                    f"nf4 [{E},{N},{K}]",
                )
            else:
                src, nbytes, case = w, 3 * w.numel() / 1e6, f"w [{E},{N},{K}]"
            rows: list = []
            variants(src, E, N, K, case, nbytes, rows)
            built, rest = rows[0], sorted(rows[1:], key=lambda r: (r[2] != r[2], r[2]))
            out.extend([built, *rest[: args.top]])
            del w, src
    print(torch.cuda.get_device_name())
    for case, what, t, nbytes, note in out:
        print(f"{case:22s} {what:34s} {t:7.3f} ms {nbytes / t:6.0f} GB/s  {note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
