"""Probe: the up projection's input gradient (``dx rows [N, H] = dh [N, 2I] @ W_e``, ``W_up [E, 2I, H]``)
with e4m3 operands, two ways:

- ``transposed cast`` (today's ``fp8_rowwise`` path): ``W_up`` cast per (expert, column) over its ``2I`` rows
  into ``W^T [E, H, 2I]`` (:func:`moeyard.quant.fp8_triton.colwise_per_expert`), then moeyard's Triton e4m3
  grouped GEMM reading it K-major;
- ``forward cast, read transposed``: ``W_up``'s forward cast (per output channel over ``H``:
  :func:`moeyard.quant.fp8_triton.rowwise`), read by the same GEMM as ``[E, K, N]`` (``b_kn=True``), its
  per-channel scales being along the reduction dimension and so folded into ``dh``'s rows before their cast
  (power-of-two scales: exact) instead of the epilogue.

Whether the second pays turns on how Triton lowers an e4m3 ``tl.dot`` whose B tile is N-major (Hopper's FP8
``wgmma`` reads K-major shared memory only). Each row: ms (median of CUDA events after warm-up, fresh inputs
per run) of the cast and of the GEMM, the GEMM's TFLOP/s and share of the dense e4m3 rate of the same run;
the error of each against float32 on the dequantised operands.

    PYTHONPATH=src python3 benchmarks/fp8_dgrad_probe.py [--models qwen3-30b-a3b,sonic-120b]
    TRITON_INTERPRET=1 PYTHONPATH=src python3 benchmarks/fp8_dgrad_probe.py --check   # CPU: a tiny case
"""

from __future__ import annotations

import argparse

import torch

from fp8_triton_probe import inputs, time_ms
from moeyard.bench.models import get_model
from moeyard.experts.triton import ops
from moeyard.quant import fp8_grouped, fp8_triton as cast


def operands(T, E, K, H, NC, device, seed):
    """``(dh [N, 2I] bf16 sorted rows, W_up [E, 2I, H] bf16, offsets [E + 1], expert of each row [N])``."""
    _, w, ids = inputs(T, E, K, H, NC, device, seed)
    r = ops.routing(ids, E)
    dh = torch.randn(T * K, NC, device=device, generator=torch.Generator(device=device).manual_seed(seed + 7))
    row_expert = torch.searchsorted(r.expert_offsets[1:].long(), torch.arange(T * K, device=device), right=True)
    return dh.bfloat16(), w, r.expert_offsets, row_expert


def transposed_cast(dh, w, offsets, row_expert):
    wq, ws = cast.colwise_per_expert(w)  # [E, H, 2I], [E, H]
    return cast.rowwise(dh), (wq, ws)


def transposed_gemm(dh_cast, w_cast, offsets):
    return fp8_grouped.grouped_mm(*dh_cast, *w_cast, offsets, torch.bfloat16)


def forward_cast(dh, w, offsets, row_expert):
    E, NC, H = w.shape
    wq, ws = cast.rowwise(w.reshape(E * NC, H))  # per (expert, output channel): along dgrad's reduction
    folded = dh.float() * ws.view(E, NC)[row_expert]  # in the activation's backward kernel, this is free
    ones = torch.ones(E, H, device=w.device)
    return cast.rowwise(folded.to(dh.dtype)), (wq.view(E, NC, H), ones)


def forward_gemm(dh_cast, w_cast, offsets):
    return fp8_grouped.grouped_mm(*dh_cast, *w_cast, offsets, torch.bfloat16, b_kn=True)


def reference(dh, w, offsets):
    out = torch.empty(dh.shape[0], w.shape[2], device=dh.device)
    bounds = offsets.tolist()
    for e in range(w.shape[0]):
        out[bounds[e] : bounds[e + 1]] = dh[bounds[e] : bounds[e + 1]].float() @ w[e].float()
    return out


def rel(a, b):
    return float((a.float() - b).norm() / b.norm())


def run_shape(name, device):
    cfg = get_model(name).moe_config()
    T, E, K, H, NC = get_model(name).tokens, cfg.num_experts, cfg.top_k, cfg.hidden_size, 2 * cfg.intermediate_size
    flops = 2.0 * T * K * H * NC
    pool = [operands(T, E, K, H, NC, device, s) for s in range(3)]
    it = iter(range(10**9))

    def pick():
        return pool[next(it) % len(pool)]

    dh, w, offsets, row_expert = pool[0]
    ref = reference(dh, w, offsets)
    a8, b8 = torch.randn(T * K, NC, device=device), torch.randn(H, NC, device=device)
    (aq, sa), (bq, sb) = cast.rowwise(a8), cast.rowwise(b8)
    dense = time_ms(
        lambda: torch._scaled_mm(aq, bq.t(), scale_a=sa[:, None], scale_b=sb[None, :], out_dtype=torch.bfloat16),
        lambda: (),
    )
    print(f"{name} (N {T * K}, 2I {NC}, H {H}, E {E}): dense e4m3 {flops / dense / 1e9:.0f} TFLOP/s")
    for label, prep, gemm in (
        ("transposed cast", transposed_cast, transposed_gemm),
        ("forward cast, read transposed", forward_cast, forward_gemm),
    ):
        casts = prep(*pool[0])
        err = rel(gemm(*casts, offsets), ref)
        cast_ms = time_ms(prep, pick)
        prepared = [prep(*p) + (p[2],) for p in pool]
        gemm_ms = time_ms(gemm, lambda ready=prepared: ready[next(it) % len(ready)])
        rate = flops / gemm_ms / 1e9
        print(
            f"  {label:31s} casts {cast_ms:6.3f} ms  GEMM {gemm_ms:6.3f} ms {rate:5.0f} TFLOP/s "
            f"{100 * rate * dense / flops * 1e9:5.1f}% of dense e4m3  rel err {err:.2e}"
        )


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="qwen3-30b-a3b,sonic-120b")
    p.add_argument("--check", action="store_true", help="a tiny case under Triton's interpreter (CPU)")
    args = p.parse_args()
    if args.check:
        dh, w, offsets, row_expert = operands(16, 4, 2, 64, 96, "cpu", 0)
        ref = reference(dh, w, offsets)
        for prep, gemm in ((transposed_cast, transposed_gemm), (forward_cast, forward_gemm)):
            err = rel(gemm(*prep(dh, w, offsets, row_expert), offsets), ref)
            print(f"{prep.__name__}: rel err {err:.2e}")
            assert err < 0.1, err
        return
    for m in args.models.split(","):
        run_shape(m, torch.device("cuda"))


if __name__ == "__main__":
    main()
