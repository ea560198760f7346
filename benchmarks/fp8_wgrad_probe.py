"""The FP8 weight gradients of ``fp8_rowwise`` alone, against the compute dtype's: for the two projections of
a shape (``dW_up = d h^T x``, ``dW_down = d out^T act(h)``), the per-expert column casts of both operands
(:func:`moeyard.quant.fp8_colwise.colwise_per_group`, each tile size of ``--cast-blocks``), the GEMM on
the Triton kernel below (precise and fast accumulation) and on
``torch._scaled_grouped_mm``, and the bf16 ``torch._grouped_mm``; ms (median of ``--iters`` after warm-up,
fresh random rows per input set), TFLOP/s and the share of the dense rates of the run, and each FP8 result's
relative error against float64 on the dequantised operands.

Usage (GPU machine): ``PYTHONPATH=src python3 benchmarks/fp8_wgrad_probe.py [--model qwen3-30b-a3b ...]``

Since 0.3.16 also the padded column casts and the library's Gluon kernel (:mod:`moeyard.quant.fp8_gluon_wgrad`,
``MOEYARD_FP8_WGRAD=gluon``, the default since 0.3.17) on them; since 0.3.17 the padded casts with the amax given
(each tile size of ``--tile-blocks``), with the library's amax kernel at each ``--amax-blocks`` row blocks per
program, with a two-stage amax without atomics (below), with torch's column reduction over all rows, and with the
operand gathered by token (up: ``x``, down: ``d out``) scaled by its amax over its T rows, as the layer does. The
other FP8 GEMM here is a plain Triton kernel (below, not part of the
library): ``dw[e] = (a_e sa_e) (b_e sb_e)^T``
over each expert's rows, both operands K-major (the transposed column casts), TMA boxes made per expert so the
rows past its end read zeros, the scales applied to the float32 accumulator after the reduction; ``precise``
promotes the tensor cores' accumulation to float32 after each step of ``BR`` rows (DeepSeek-V3, arXiv
2412.19437, section 3.3.2). Measured on an H200 (``benchmarks/NOTES.md``, round 50) it ran at 46-58% of the
dense e4m3 rate, and with the column casts of both operands it lost to the bf16 weight gradient at every
shape tried but sonic-120b's up projection, so the library keeps ``fp8_rowwise_gw_hp``'s bf16 weight gradients.
"""

from __future__ import annotations

import argparse
import functools

import torch
import triton
import triton.language as tl

from moeyard.bench import dense_fp8_tflops, dense_tflops
from moeyard.bench.layer import time_ms
from moeyard.bench.models import get_model
from moeyard.experts.triton.schedule import tuned
from moeyard.kernel_op import interpreting
from moeyard.quant import fp8_colwise

Tensor = torch.Tensor
CONFIGS = [  # (BN, BK, BR, warps, stages): a stage is (BN + BK) BR bytes, each fits Hopper's shared memory
    triton.Config({"BN": bn, "BK": bk, "BR": br}, num_warps=w, num_stages=s)
    for bn, bk, br, w, s in (
        (128, 128, 128, 8, 4),
        (128, 128, 128, 8, 5),
        (128, 256, 128, 8, 3),
        (256, 128, 128, 8, 3),
    )
]
SMALL = {"BN": 16, "BK": 16, "BR": 16}  # the interpreter's tile
FIXED = {"BN": 128, "BK": 128, "BR": 128, "num_warps": 8, "num_stages": 4}  # MOEYARD_TRITON_AUTOTUNE=0


@triton.jit
def wgrad_kernel(
    a_ptr,  # [N, Rs] e4m3, unit column stride, row stride stride_a
    b_ptr,  # [K, Rs] e4m3, unit column stride, row stride stride_b
    sa_ptr,  # [E, N] float32, contiguous
    sb_ptr,  # [E, K] float32, contiguous
    offsets_ptr,  # [E + 1] int32
    out_ptr,  # [E, N, K], contiguous
    N,
    K,
    stride_a,
    stride_b,
    TMA: tl.constexpr,
    PRECISE: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BR: tl.constexpr,
):
    """One ``[BN, BK]`` tile of ``dw_e`` (module docstring)."""
    pid = tl.program_id(0)
    tiles_n, tiles_k = tl.cdiv(N, BN), tl.cdiv(K, BK)
    e = pid // (tiles_n * tiles_k)
    pid_n = pid // tiles_k % tiles_n
    pid_k = pid % tiles_k
    start = tl.load(offsets_ptr + e)
    end = tl.load(offsets_ptr + e + 1)
    n = pid_n * BN + tl.arange(0, BN)
    k = pid_k * BK + tl.arange(0, BK)
    m_n, m_k = n < N, k < K
    if TMA:
        a_desc = tl.make_tensor_descriptor(
            a_ptr, shape=[N, tl.maximum(end, 1)], strides=[stride_a, 1], block_shape=[BN, BR]
        )
        b_desc = tl.make_tensor_descriptor(
            b_ptr, shape=[K, tl.maximum(end, 1)], strides=[stride_b, 1], block_shape=[BK, BR]
        )
    acc = tl.zeros((BN, BK), tl.float32)
    for r0 in range(start, end, BR):
        if TMA:
            a = a_desc.load([pid_n * BN, r0])
            b = b_desc.load([pid_k * BK, r0])
        else:
            r = r0 + tl.arange(0, BR)
            m_r = r < end
            a = tl.load(
                a_ptr + n.to(tl.int64)[:, None] * stride_a + r[None, :], mask=m_n[:, None] & m_r[None, :], other=0.0
            )
            b = tl.load(
                b_ptr + k.to(tl.int64)[:, None] * stride_b + r[None, :], mask=m_k[:, None] & m_r[None, :], other=0.0
            )
        if PRECISE:
            acc += tl.dot(a, tl.trans(b))
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    sa = tl.load(sa_ptr + e.to(tl.int64) * N + n, mask=m_n, other=0.0)
    sb = tl.load(sb_ptr + e.to(tl.int64) * K + k, mask=m_k, other=0.0)
    out = out_ptr + e.to(tl.int64) * N * K + n.to(tl.int64)[:, None] * K + k[None, :]
    tl.store(out, (acc * sa[:, None] * sb[None, :]).to(out_ptr.dtype.element_ty), mask=m_n[:, None] & m_k[None, :])


@triton.jit
def tile_amax_kernel(
    x_ptr, offsets_ptr, padded_ptr, part_ptr, G, N, stride_xr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    """Two-stage amax, stage 1 (an alternative to the library's atomic one): the columns' amax of one tile of
    ``BLOCK_R`` rows of a group (the library's tile of the padded output) stored to ``part [tiles, N]``."""
    c0 = tl.program_id(0) * BLOCK_R
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    gs = tl.arange(0, BLOCK_G)
    ends = tl.load(padded_ptr + 1 + gs, mask=gs < G, other=2147483647)
    g = tl.sum((ends <= c0).to(tl.int32), axis=0)
    if g < G:
        end = tl.load(offsets_ptr + g + 1)
        rows = tl.load(offsets_ptr + g) + (c0 - tl.load(padded_ptr + g)) + tl.arange(0, BLOCK_R)
        mask = (rows < end)[:, None] & (cols < N)[None, :]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xr + cols[None, :], mask=mask, other=0.0)
        m = tl.max(tl.abs(x.to(tl.float32)), axis=0)
        tl.store(part_ptr + tl.program_id(0).to(tl.int64) * N + cols, m, mask=cols < N)


@triton.jit
def group_amax_kernel(part_ptr, padded_ptr, amax_ptr, N, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """Two-stage amax, stage 2: each group's columns' amax over its tiles' rows of ``part``."""
    g = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.zeros([BLOCK_N], dtype=tl.float32)
    for t in range(tl.load(padded_ptr + g) // BLOCK_R, tl.load(padded_ptr + g + 1) // BLOCK_R):
        m = tl.maximum(m, tl.load(part_ptr + t * N + cols, mask=cols < N, other=0.0))
    tl.store(amax_ptr + g * N + cols, m, mask=cols < N)


def two_stage_amax(t: Tensor, offsets: Tensor, padded: tuple[Tensor, int]) -> Tensor:
    """``[G, N]`` float32: each group's columns' amax of ``t [R, N]`` by the two kernels above."""
    G, N = offsets.numel() - 1, t.shape[1]
    br, bn, warps = fp8_colwise.COLWISE_TILES
    part = torch.empty(triton.cdiv(padded[1], br), N, device=t.device, dtype=torch.float32)
    amax = torch.empty(G, N, device=t.device, dtype=torch.float32)
    grid = (part.shape[0], triton.cdiv(N, bn))
    tile_amax_kernel[grid](t, offsets, padded[0], part, G, N, t.stride(0), br, bn, triton.next_power_of_2(G),
                           num_warps=warps)  # fmt: skip
    group_amax_kernel[(G, triton.cdiv(N, bn))](part, padded[0], amax, N, br, bn, num_warps=warps)
    return amax


@functools.cache
def _launcher():
    """The kernel autotuned over :data:`CONFIGS`, or one fixed config under the interpreter and with
    ``MOEYARD_TRITON_AUTOTUNE=0`` (:func:`moeyard.experts.triton.schedule.tuned`)."""
    return tuned(wgrad_kernel, CONFIGS, ["N", "K", "TMA", "PRECISE"], prune=_fits, fixed=_fixed)


def _fixed(args, kwargs) -> dict:
    return dict(SMALL) if interpreting() else dict(FIXED)


def _fits(configs, named_args, **kwargs):
    """Every config fits; kept whole (the shared-memory estimates of ``tuning`` are for the bf16 kernels)."""
    return configs


def wgrad(
    a: Tensor,
    sa: Tensor,
    b: Tensor,
    sb: Tensor,
    offsets: Tensor,
    dtype: torch.dtype,
    *,
    precise: bool = True,
    tma: bool | None = None,
) -> Tensor:
    """``dw [E, N, K]`` in ``dtype`` (module docstring) from ``a [N, Rs]`` / ``b [K, Rs]`` e4m3 (unit column
    stride; the columns past ``offsets[E]`` are not read), ``sa [E, N]`` / ``sb [E, K]`` float32 and ``offsets
    [E + 1]`` int32. ``precise``: the products promoted to float32 every ``BR`` rows (module docstring);
    ``tma``: the operands through TMA descriptors (default: on Hopper, when the row strides are multiples of 16
    bytes). No host sync.

    Raises:
        ValueError: shapes that do not agree.
    """
    N, K, E = a.shape[0], b.shape[0], offsets.numel() - 1
    if sa.shape != (E, N) or sb.shape != (E, K) or a.shape[1:] != b.shape[1:] or a.dim() != 2:
        raise ValueError(
            f"wgrad: expected a [N, Rs], b [K, Rs], sa [E, N], sb [E, K] with E = offsets.numel() - 1 = {E}, got "
            f"a {tuple(a.shape)}, b {tuple(b.shape)}, sa {tuple(sa.shape)}, sb {tuple(sb.shape)}"
        )
    out = torch.empty(E, N, K, device=a.device, dtype=dtype)
    if not (E and N and K):
        return out
    if a.stride(1) != 1:
        a = a.contiguous()
    if b.stride(1) != 1:
        b = b.contiguous()
    if interpreting():  # the interpreter's float8 loads: widen with torch first
        a, b = a.float(), b.float()
        tma = False
    elif tma is None:
        tma = _tma_ready(a, b)
    if tma:
        from moeyard.experts.triton.kernels_tma import ensure_allocator

        ensure_allocator()
    grid = lambda meta: (E * triton.cdiv(N, meta["BN"]) * triton.cdiv(K, meta["BK"]),)  # noqa: E731
    _launcher()[grid](
        a, b, sa.contiguous(), sb.contiguous(), offsets, out, N, K, a.stride(0), b.stride(0), TMA=tma, PRECISE=precise
    )
    return out


def _tma_ready(a: Tensor, b: Tensor) -> bool:
    if torch.cuda.get_device_capability(a.device)[0] < 9:
        return False
    return all(t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0 for t in (a, b))


def reference(a: Tensor, sa: Tensor, b: Tensor, sb: Tensor, offsets: Tensor, dtype: torch.dtype) -> Tensor:
    """:func:`wgrad` in float64 on the dequantised operands, one expert at a time (host sync: the offsets)."""
    E, N, K = offsets.numel() - 1, a.shape[0], b.shape[0]
    out = torch.zeros(E, N, K, dtype=torch.float64, device=a.device)
    bounds = offsets.tolist()
    for e in range(E):
        r0, r1 = bounds[e], bounds[e + 1]
        ae = a[:, r0:r1].double() * sa[e].double()[:, None]
        be = b[:, r0:r1].double() * sb[e].double()[:, None]
        out[e] = ae @ be.T
    return out.to(dtype)


ALIGN = 16
DEFAULT_BLOCKS = fp8_colwise.COLWISE_BLOCKS
DEFAULT_TILES = fp8_colwise.COLWISE_TILES
DEFAULT_AMAX = fp8_colwise.AMAX_BLOCKS


def offsets_for(R: int, E: int, device) -> torch.Tensor:
    """Balanced random routing: ``R`` rows over ``E`` experts (multinomial), each expert padded to 16."""
    counts = torch.bincount(torch.randint(0, E, (R,), device=device), minlength=E)
    counts = (counts + ALIGN - 1) // ALIGN * ALIGN
    off = torch.zeros(E + 1, dtype=torch.int32, device=device)
    off[1:] = counts.cumsum(0)
    return off


def probe(name: str, proj: str, NL: int, NR: int, T: int, E: int, k: int, a, dense: tuple[float, float]) -> dict:
    """ms and a note per variant for ``dW [E, NL, NR] = L^T R`` over ``T k`` rows routed to ``E`` experts."""
    dev = torch.device("cuda")
    f8, b16 = dense
    torch.manual_seed(0)
    off = offsets_for(T * k, E, dev)
    Rs = int(off[-1])
    sets = [
        (torch.randn(Rs, NL, device=dev, dtype=torch.bfloat16), torch.randn(Rs, NR, device=dev, dtype=torch.bfloat16))
        for _ in range(2)
    ]
    flops = 2 * Rs * NL * NR
    res = {}

    def both_casts(i):
        return fp8_colwise.colwise_per_group(sets[i][0], off), fp8_colwise.colwise_per_group(sets[i][1], off)

    for blocks in a.cast_blocks.split(","):
        fp8_colwise.COLWISE_BLOCKS = tuple(int(v) for v in blocks.split("x"))
        ms = time_ms(both_casts, 2, a.warmup, a.iters, dev)
        res[f"cast {blocks}"] = (ms, f"{Rs * (NL + NR) * 3 / ms / 1e6:.0f} GB/s (read 2 B + write 1 B per element)")
    fp8_colwise.COLWISE_BLOCKS = DEFAULT_BLOCKS
    casts = [both_casts(i) for i in range(2)]
    (aq, sa), (bq, sb) = casts[0]
    ref = reference(aq, sa, bq, sb, off, torch.float64)

    def fp8_row(key, fn):
        ms = time_ms(fn, 2, a.warmup, a.iters, dev)
        err = ((fn(0).double() - ref).norm() / ref.norm()).item()
        res[key] = (ms, f"{flops / ms / 1e9:.0f} TFLOP/s ({flops / ms / 1e9 / f8:.0%} e4m3), rel err {err:.2e}")

    for precise in (True, False):
        fp8_row(
            f"triton precise={precise}",
            lambda i, p=precise: wgrad(*casts[i][0], *casts[i][1], off, torch.bfloat16, precise=p),
        )
    from moeyard.experts.scaled_hopper import scaled_grouped_mm

    def cutlass(i):
        (aq, sa), (bq, sb) = casts[i]
        return scaled_grouped_mm(aq, bq.mT, sa.reshape(-1), sb.reshape(-1), off, torch.bfloat16, False)

    fp8_row("torch._scaled_grouped_mm", cutlass)
    from moeyard.quant import fp8_gluon_wgrad

    starts = fp8_colwise.padded_offsets(off, Rs, fp8_gluon_wgrad.BK)

    def padded_casts(i):
        return tuple(fp8_colwise.colwise_per_group(t, off, padded=starts) for t in sets[i])

    ms = time_ms(padded_casts, 2, a.warmup, a.iters, dev)
    res["cast padded"] = (ms, f"{Rs * (NL + NR) * 3 / ms / 1e6:.0f} GB/s, the layout of the Gluon GEMM")
    for blocks in a.amax_blocks.split(","):
        fp8_colwise.AMAX_BLOCKS = int(blocks)
        ms = time_ms(padded_casts, 2, a.warmup, a.iters, dev)
        res[f"cast padded, {blocks} row blocks per amax program"] = (ms, f"{Rs * (NL + NR) * 3 / ms / 1e6:.0f} GB/s")
    fp8_colwise.AMAX_BLOCKS = DEFAULT_AMAX
    padded = [padded_casts(i) for i in range(2)]
    amaxes = [tuple(t.abs().amax(0).float() for t in pair) for pair in sets]  # over all rows, as a producer's

    def one_pass(i):
        return tuple(
            fp8_colwise.colwise_per_group(t, off, padded=starts, amax=m)
            for t, m in zip(sets[i], amaxes[i], strict=True)
        )

    for blocks in a.tile_blocks.split(","):
        fp8_colwise.COLWISE_TILES = tuple(int(v) for v in blocks.split("x"))
        ms = time_ms(one_pass, 2, a.warmup, a.iters, dev)
        res[f"cast padded, amax given {blocks}"] = (ms, f"{Rs * (NL + NR) * 3 / ms / 1e6:.0f} GB/s, one read")
    fp8_colwise.COLWISE_TILES = DEFAULT_TILES

    def two_stage(i):
        return tuple(
            fp8_colwise.colwise_per_group(t, off, padded=starts, amax=two_stage_amax(t, off, starts)) for t in sets[i]
        )

    assert all(torch.equal(u[1], v[1]) for u, v in zip(two_stage(0), padded[0], strict=True))  # the same scales
    ms = time_ms(two_stage, 2, a.warmup, a.iters, dev)
    res["cast padded, two-stage amax"] = (ms, f"{Rs * (NL + NR) * 3 / ms / 1e6:.0f} GB/s, no atomics")

    def all_rows(i):  # one amax over all rows per operand, by torch's column reduction
        return tuple(
            fp8_colwise.colwise_per_group(t, off, padded=starts, amax=torch.linalg.vector_norm(t, float("inf"), dim=0))
            for t in sets[i]
        )

    ms = time_ms(all_rows, 2, a.warmup, a.iters, dev)
    res["cast padded, amax over all rows (torch)"] = (ms, f"{Rs * (NL + NR) * 3 / ms / 1e6:.0f} GB/s")
    tokens = Rs // k  # the operand gathered by token (up: x, the right; down: d out, the left), its amax over T rows
    by_token = 1 if proj == "up" else 0

    def over_tokens(i):
        t, other = sets[i][by_token], sets[i][1 - by_token]
        amax = torch.linalg.vector_norm(t[:tokens], float("inf"), dim=0).float()
        return (
            fp8_colwise.colwise_per_group(other, off, padded=starts),
            fp8_colwise.colwise_per_group(t, off, padded=starts, amax=amax),
        )

    ms = time_ms(over_tokens, 2, a.warmup, a.iters, dev)
    res["cast padded, the by-token operand's amax over tokens"] = (ms, f"{Rs * (NL + NR) * 3 / ms / 1e6:.0f} GB/s")
    out = torch.empty(E, NL, NR, device=dev, dtype=torch.bfloat16)

    def gluon(i):
        (lq, ls), (rq, rs) = padded[i]
        fp8_gluon_wgrad.launch(lq, ls, rq, rs, starts[0], out)
        return out

    if fp8_gluon_wgrad.ready(padded[0][0][0], padded[0][1][0], out.dtype, E):
        fp8_row("gluon (fast accumulation)", gluon)
    ms = time_ms(lambda i: torch._grouped_mm(sets[i][0].mT, sets[i][1], offs=off[1:]), 2, a.warmup, a.iters, dev)
    res["bf16 torch._grouped_mm"] = (ms, f"{flops / ms / 1e9:.0f} TFLOP/s ({flops / ms / 1e9 / b16:.0%} bf16)")
    for key, (ms, note) in res.items():
        print(f"{name} {proj} [{NL} x {NR}] R={Rs}: {key}: {ms:.3f} ms, {note}", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", action="append")
    ap.add_argument("--tokens", type=int)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cast-blocks", default="64x64x4,128x64x4,64x128x4,128x128x8")
    ap.add_argument("--amax-blocks", default="1,2,4,8,16")
    ap.add_argument("--tile-blocks", default="64x128x4,128x64x4,128x128x4,128x128x8,64x256x8,32x128x4")
    a = ap.parse_args()
    dev = torch.device("cuda")
    dense = dense_fp8_tflops(dev, 3, 20), dense_tflops(dev, 3, 20)
    print(f"dense e4m3 {dense[0]:.0f} TFLOP/s, bf16 {dense[1]:.0f} TFLOP/s")
    rows = []
    for name in a.model or ["qwen3-30b-a3b", "sonic-120b"]:
        m = get_model(name)
        c = m.config
        E, H, I, k = c["num_experts"], c["hidden_size"], c["intermediate_size"], c["top_k"]
        for proj, NL, NR in (("up", 2 * I, H), ("down", H, I)):
            rows.append((name, proj, probe(name, proj, NL, NR, a.tokens or m.tokens, E, k, a, dense)))
    print(
        "\nshape | proj | best cast (both operands) | FP8 GEMM best | FP8 cast+GEMM | padded casts + Gluon | "
        "one-pass casts + Gluon | bf16 GEMM"
    )
    for name, proj, res in rows:
        cast = min((v[0], k) for k, v in res.items() if k.startswith("cast "))
        gemm = min((v[0], k) for k, v in res.items() if k.startswith("triton"))
        one = min((v[0], k) for k, v in res.items() if k.startswith("cast padded, amax given"))
        g = res.get("gluon (fast accumulation)")
        glu = f"{res['cast padded'][0] + g[0]:.3f} ({g[0]:.3f} GEMM)" if g else "-"
        glu1 = f"{one[0] + g[0]:.3f} ({one[1][24:]})" if g else "-"
        print(
            f"{name} | {proj} | {cast[0]:.3f} ({cast[1]}) | {gemm[0]:.3f} ({gemm[1]}) | {cast[0] + gemm[0]:.3f} | "
            f"{glu} | {glu1} | {res['bf16 torch._grouped_mm'][0]:.3f}"
        )


if __name__ == "__main__":
    main()
