"""Kernel-level A/B of the LoRA step's TMA down projections and of its B-factor backward passes, at
real model shapes, bf16, on one GPU (CUDA events after warm-up, median of ``--iters`` launches, random
inputs, uniform routing):

- ``down`` (forward, ``a [N, I] @ W_down^T``, K = I) and ``dx`` (input gradient, ``d_h [N, 2I] @ W_up``,
  K = 2I): the Triton TMA kernel (autotuned; its pick printed) and the warp-specialised Gluon kernel
  (:mod:`moeyard.experts.triton.kernels_gluon`, also past its K-step limit), each without and with the
  split LoRA term;
- ``dB + rows``: the LoRA factor B's two uses in backward, ``d_y B_e`` (the input-gradient GEMM's low
  rank rows) and ``dB_e = d_y^T z``, as two passes over ``d_y`` (thin GEMM + thin weight gradient) and
  as one (:func:`moeyard.experts.triton.ops.wgrad_rows`), for ``d out`` (gathered by token) and ``d_h``;
- ``lora_B`` relaid out expert-major: torch's copy against the Triton transpose;
- ``order``: the LoRA-factor gradients that read an operand by token (``d out``, ``x``), their programs
  expert-major and tile-major (``options().wgrad_tile_major``, :func:`moeyard.experts.triton.gemm.weight_tile`).
- ``band``: the thin GEMMs over rows read by token (``x A_up^T`` forward, ``d out B_down`` when it runs
  as a pass of its own), their row tiles expert-major and band-major (``options().band_rows``,
  :func:`moeyard.experts.triton.schedule.band_tile`).

    python benchmarks/lora_kernels.py [--models qwen3-30b-a3b olmoe-1b-7b mixtral-8x7b] [--rank 16]
        [--groups down fold relayout order band]

Prints one table per model (ms), then the GPU and software versions.
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch

from moeyard.bench.models import get_model
from moeyard.experts.triton import kernels_gluon, kernels_tma, ops
from moeyard.experts.triton.options import use_options
from moeyard.experts.triton.schedule import tma_block_m
from moeyard.experts.triton.tuning import LORA_NONE, LORA_SPLIT


def timed(fn, iters: int, reps: int = 5, warmup: int = 3) -> float:
    """Median ms of one ``fn()`` over ``iters`` samples of ``reps`` launches back to back, CUDA events
    around each sample, queued behind a sleep kernel so the host's launch time is not counted."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)  # ~1 ms: the launches below are queued before the GPU reaches them
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return statistics.median(times)


def _problem(model: str, rank: int, tokens: int | None):
    shape = get_model(model)
    c = shape.config
    T = tokens or shape.tokens
    H, I, E, K = c["hidden_size"], c["intermediate_size"], c["num_experts"], c["top_k"]
    dev, bf = "cuda", torch.bfloat16
    ids = torch.rand(T, E, device=dev).topk(K, dim=1).indices
    r = ops.routing(ids, E)
    N = T * K
    g = lambda *s: torch.randn(*s, device=dev, dtype=bf) / 4  # noqa: E731
    return dict(
        T=T,
        H=H,
        I=I,
        E=E,
        K=K,
        N=N,
        r=r,
        tw=torch.rand(N, device=dev, dtype=bf),
        a=g(N, I),
        w_down=g(E, H, I),
        dh=g(N, 2 * I),
        w_up=g(E, 2 * I, H),
        z=g(N, rank),
        b_down=g(E, H, rank).contiguous(),
        a_up=g(E, rank, H),
        b_up=g(E, 2 * I, rank),
        dout=g(T, H),
        x=g(T, H),
    )


def _down_cases(p):
    """``(name, rows, w, topk weights, lb)`` of the two TMA GEMMs."""
    return [("down", p["a"], p["w_down"], p["tw"], p["b_down"]), ("dx", p["dh"], p["w_up"].mT, None, p["a_up"].mT)]


def down_rows(p, rank: int, iters: int, variants: bool) -> list[tuple[str, str, float]]:
    r = p["r"]
    table = r.tile_table(tma_block_m())
    out = []
    for name, rows, w, tw, lb in _down_cases(p):
        y = torch.empty(p["N"], w.shape[1], device="cuda", dtype=rows.dtype)
        limit = kernels_gluon.MAX_K_STEPS
        ready = kernels_gluon.ready(rows, w, None, None, 0, tma_block_m())
        for gluon in (False, True):
            if gluon and not ready:  # past the K-step limit: run it anyway, to measure that limit
                kernels_gluon.MAX_K_STEPS = 10**9
            for lora in (False, True):

                def run(lora=lora, rows=rows, w=w, tw=tw, lb=lb, y=y):
                    # the split term's epilogue reads only z and Lb (la is the thin pass's, made outside)
                    mode, z = (LORA_SPLIT, p["z"]) if lora else (LORA_NONE, None)
                    ops.launch_down(
                        rows,
                        w,
                        None,
                        tw,
                        r.sort_order,
                        r.expert_offsets,
                        r.top_k,
                        lb if lora else None,
                        lb if lora else None,
                        mode,
                        0.5,
                        y,
                        z,
                        table,
                        False,
                    )

                label = f"{'Gluon' if gluon else 'Triton'}, {'LoRA' if lora else 'frozen'}"
                with use_options(gluon_down=gluon):
                    ms = timed(run, iters)
                if not gluon:
                    label += f" [{getattr(ops._kernels()['down_tma'], 'best_config', None)}]"
                elif not ready:
                    label += f" (past its limit of {limit} K steps)"
                out.append((name, label, ms))
            kernels_gluon.MAX_K_STEPS = limit
        if variants:
            out += _gluon_variants(p, name, rows, w, tw, lb, table, y, rank, iters)
    return out


def _gluon_variants(p, name, rows, w, tw, lb, table, y, rank, iters):
    """The Gluon kernel at 3 and 4 stages (``kernels_gluon.STAGES``), with and without LoRA."""
    r, out = p["r"], []
    saved = kernels_gluon.STAGES
    for stages, lora in ((3, True), (4, True), (3, False), (4, False)):
        kernels_gluon.STAGES = stages

        def run(lora=lora):
            kernels_gluon.launch(
                rows,
                w,
                None,
                tw,
                r.sort_order,
                r.expert_offsets,
                y,
                lb if lora else None,
                p["z"] if lora else None,
                table,
                0.5,
                max(16, rank),
                tma_block_m(),
                ops.num_sms(rows.device),
            )

        out.append((name, f"Gluon, {'LoRA' if lora else 'frozen'}, {stages} stages", timed(run, iters)))
    kernels_gluon.STAGES = saved
    return out


def fold_rows(p, iters: int) -> list[tuple[str, str, float]]:
    r = p["r"]
    out = []
    for name, d, z, b, by_token in (
        ("dB + rows, d out", p["dout"], p["z"], p["b_down"], True),
        ("dB + rows, d_h", p["dh"], p["z"], p["b_up"], False),
    ):

        def two(d=d, z=z, b=b, by_token=by_token):
            ops.low_rank_rows(d, b, r, gather=by_token)
            ops.wgrad(
                d, z, lhs_by_token=by_token, rhs_by_token=False, scale=None, r=r, like_w=b, like_b=None, low_rank=True
            )

        out.append((name, "two passes (thin GEMM + weight gradient)", timed(two, iters)))
        out.append(
            (
                name,
                "one pass (wgrad_rows)",
                timed(functools.partial(ops.wgrad_rows, d, z, b, lhs_by_token=by_token, r=r), iters),
            )
        )
    return out


def relayout_rows(p, rank: int, iters: int) -> list[tuple[str, str, float]]:
    """``lora_B [out, r*E]`` relaid out expert-major (:mod:`moeyard.experts.relayout`): torch's copy of the
    permuted view against the Triton transpose, for both projections' factors."""
    from moeyard.experts.relayout import expert_major

    out = []
    E = p["E"]
    for name, n_out in (("lora_B relayout, up", 2 * p["I"]), ("lora_B relayout, down", p["H"])):
        b = torch.randn(n_out, rank * E, device="cuda", dtype=torch.bfloat16)
        out.append(
            (
                name,
                "torch copy of the permuted view",
                timed(lambda b=b: b.unflatten(1, (rank, E)).permute(2, 0, 1).contiguous(), iters),
            )
        )
        out.append(
            (
                name,
                "Triton transpose (expert_major)",
                timed(functools.partial(expert_major, b, rank, E, b.dtype), iters),
            )
        )
    return out


def order_rows(p, iters: int) -> list[tuple[str, str, float]]:
    """The LoRA-factor gradients with an operand gathered by token, expert-major against tile-major:
    B's one pass over ``d out`` and ``dA_up = (d_h B_e)^T x`` (the base weight gradients stay
    expert-major: tile-major ran slower, NOTES round 17)."""
    r, out = p["r"], []
    cases = (
        ("dB + rows, d out", lambda: ops.wgrad_rows(p["dout"], p["z"], p["b_down"], lhs_by_token=True, r=r)),
        (
            "dA_up (g^T x)",
            lambda: ops.wgrad(
                p["z"],
                p["x"],
                lhs_by_token=False,
                rhs_by_token=True,
                scale=None,
                r=r,
                like_w=p["a_up"],
                like_b=None,
                low_rank=True,
            ),
        ),
    )
    for name, fn in cases:
        for major in (False, True):
            with use_options(wgrad_tile_major=major):
                out.append((name, "tile-major" if major else "expert-major", timed(fn, iters)))
    return out


def band_rows(p, iters: int) -> list[tuple[str, str, float]]:
    """The thin gathered GEMMs with their row tiles expert-major and band-major."""
    r, out = p["r"], []
    cases = (
        ("x A_up^T", lambda: ops.low_rank_rows(p["x"], p["a_up"].mT, r, gather=True)),
        ("d out B_down", lambda: ops.low_rank_rows(p["dout"], p["b_down"], r, gather=True)),
    )
    for name, fn in cases:
        for band in (False, True):
            with use_options(band_rows=band):
                out.append((name, "band-major" if band else "expert-major", timed(fn, iters)))
    return out


GROUPS = ("down", "fold", "relayout", "order", "band")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["qwen3-30b-a3b", "olmoe-1b-7b", "mixtral-8x7b"])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=None, help="tokens per step (default: the model's bench size)")
    ap.add_argument(
        "--variants", action="store_true", help="also the Gluon kernel at 3 and 4 stages, with and without LoRA"
    )
    ap.add_argument("--groups", nargs="+", choices=GROUPS, default=list(GROUPS))
    args = ap.parse_args(argv)
    kernels_tma.ensure_allocator()
    for model in args.models:
        p = _problem(model, args.rank, args.tokens)
        groups = dict(
            down=lambda p=p: down_rows(p, args.rank, args.iters, args.variants),
            fold=lambda p=p: fold_rows(p, args.iters),
            relayout=lambda p=p: relayout_rows(p, args.rank, args.iters),
            order=lambda p=p: order_rows(p, args.iters),
            band=lambda p=p: band_rows(p, args.iters),
        )
        rows = [row for g in args.groups for row in groups[g]()]
        print(
            f"\n{model}: T {p['T']}, H {p['H']}, I {p['I']}, E {p['E']}, k {p['K']}, r {args.rank} "
            f"(K steps of 64: down {-(-p['I'] // 64)}, dx {-(-2 * p['I'] // 64)})"
        )
        for name, label, ms in rows:
            print(f"  {name:18s} {label:70s} {ms:8.3f} ms")
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {__import__('triton').__version__}")


if __name__ == "__main__":
    main()
