"""``moeyard bench --ep N``: the expert-parallel dispatchers, stage by stage, under torchrun.

    torchrun --nproc-per-node 8 -m moeyard bench --ep 8 --model qwen3-30b-a3b --tokens 8192

Every rank routes its own T tokens (``--tokens``, or the shape's T; per rank) with ``balanced`` and
``zipf`` routing (:mod:`moeyard.bench.layer`'s routing codes; ``--routing balanced|zipf`` picks one) and holds
E / N random experts. For each dispatcher it times, forward only (CUDA events on CUDA, else
``time.perf_counter``; median of ``--iters`` after ``--warmup``):

- ``dispatch`` (including the ``all_to_all`` dispatcher's host sync), ``experts`` (the local
  experts on the received rows, ``--backends``' first entry or ``auto``) and ``combine``;
- the achieved exchange bandwidth: rows this rank sends in dispatch x H x bytes / dispatch time,
  next to a plain ``all_to_all_single`` of the same bytes in equal splits, in the same run;
- the experts' TFLOP/s (6 * routed rows * H * I for gated experts, 4 * for plain ones) next to the
  same backend on the same number of rows per expert, fresh and contiguous (one GPU, no exchange);
- the whole :class:`ExpertParallel` call (dispatch, experts, combine), forward and forward +
  backward (gradients of the tokens, routing weights and local expert weights), for each
  ``overlap_chunks`` of ``--overlap`` (e.g. ``1,2,4``; ``all_gather`` and ``sync_free`` with the
  ``symm_mem`` or ``p2p`` exchange: 1 only): what overlapping the exchanges with the experts saves.

``sync_free`` is timed with ``exchange="all_to_all"`` and, on CUDA/NCCL, again with ``exchange="p2p"``
(what its default ``auto`` takes there).

Weak scaling: each rank also times the same step on one device, no exchange: its own T tokens through
all E experts (the whole layer's weights on this GPU), forward + backward. Every GPU computes about
T * K pairs either way, so the ratio ``one-GPU step / expert-parallel step`` (the slowest rank's, at
``overlap_chunks`` 1) is the per-GPU throughput against one GPU on the same rows (100%: the exchange
costs nothing). Run ``--ep 1`` too for the 1-GPU row of the table.

``--lora R``: every call carries LoRA adapters of rank R on both projections (this rank's block of the
factors, PEFT's layout, :mod:`moeyard.parallel.lora`; all E experts' on the one-device step) and the
step is the LoRA fine-tuning step: the base weights frozen, gradients of the tokens, routing weights
and LoRA factors. (The TFLOP/s columns count the base FLOPs only.)

Rank 0 prints one row per (routing, dispatcher) with the slowest rank's times (what a step waits
for) and writes every rank's numbers with ``--json``. Processes use NCCL on CUDA (device
``cuda:LOCAL_RANK``, set before the group is created and bound to it), gloo on CPU (``--device cpu``,
or no CUDA). Every timing starts after a barrier and a device synchronisation, so no rank's first
timed exchange waits for a peer still in its previous measurement.
"""

from __future__ import annotations

import datetime
import json
import os

import torch
import torch.distributed as dist

from ..activations import GATED
from ..experts import ExpertLoRA, experts
from ..parallel.apply import release_buffers
from ..parallel.comm import resolve_group
from ..parallel.common import EPOptions
from ..parallel.experts import DISPATCHERS, ExpertParallel
from ..parallel.sync_free import DEVICE_EXCHANGES
from ..routing import route
from . import layer as layer_bench
from .args import bench_options

Tensor = torch.Tensor


def main(args, command: str) -> int:
    """Run under torchrun with the parsed ``moeyard bench`` arguments; returns the exit code."""
    if "RANK" not in os.environ:
        print("moeyard bench --ep: launch with torchrun --nproc-per-node N -m moeyard bench --ep N ...")
        return 2
    cuda = torch.cuda.is_available() and (args.device or "cuda").startswith("cuda")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5), device_id=device)
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    try:
        code = _run(args, command, device)
        release_buffers()
        return code
    finally:
        dist.destroy_process_group()


def _run(args, command: str, device: torch.device) -> int:
    ep = resolve_group(None)
    if ep.world_size != args.ep:
        raise SystemExit(f"--ep: {args.ep} but torchrun started {ep.world_size} processes")
    overlaps = parse_overlap(args.overlap)
    lora_rank = getattr(args, "lora", None)
    if lora_rank is not None and (isinstance(lora_rank, bool) or lora_rank < 1):
        raise SystemExit(f"--lora: expected a positive LoRA rank, got {lora_rank}")
    opts = layer_bench.resolve_options(_with(bench_options(args, command), device=str(device)))
    backend = (opts.backends or ["auto"])[0]
    routings = [opts.routing] if opts.routing != "random" else ["balanced", "zipf"]
    rows = []
    for shape in layer_bench.cases(opts):
        config = shape.moe_config()
        if config.num_experts % ep.world_size:
            raise SystemExit(f"--ep: {ep.world_size} does not divide num_experts={config.num_experts} of {shape.name}")
        for routing in routings:
            for name, exchange, fp8 in _variants(ep, getattr(args, "fp8_dispatch", False)):
                rows.append(
                    measure(
                        shape,
                        config,
                        routing,
                        name,
                        backend,
                        ep,
                        opts,
                        device,
                        overlaps,
                        exchange=exchange,
                        lora_rank=lora_rank,
                        fp8_dispatch=fp8,
                    )
                )
    everyone = [None] * ep.world_size
    dist.all_gather_object(everyone, rows)
    if ep.rank == 0:
        _report(everyone, opts, args, device)
    return 0


def ep_recipe(opts) -> str | None:
    """The FP8 recipe of the expert-parallel rows: ``--recipe``'s first name other than ``none`` (None: the
    compute dtype)."""
    return next((r for r in (opts.recipes or []) if r != layer_bench.NO_RECIPE), None)


def _variants(ep, fp8_dispatch: bool = False) -> list[tuple[str, str, bool]]:
    """``(dispatcher, exchange, fp8_dispatch)`` to time: every dispatcher, ``sync_free`` with the
    ``all_to_all`` exchange and, where it can run (CUDA, NCCL), with ``p2p`` (what ``auto`` takes there);
    with ``fp8_dispatch`` also ``all_to_all`` and ``all_gather`` sending e4m3 rows."""
    from ..parallel import p2p

    out = [(name, "all_to_all" if name == "sync_free" else "auto", False) for name in DISPATCHERS]
    if p2p.OPS.unavailable(ep) is None:
        out.insert(out.index(("sync_free", "all_to_all", False)) + 1, ("sync_free", "p2p", False))
    if fp8_dispatch:
        for name in ("all_to_all", "all_gather"):
            out.insert(out.index((name, "auto", False)) + 1, (name, "auto", True))
    return out


def parse_overlap(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``.

    Raises:
        SystemExit: not a comma-separated list of positive ints (names ``--overlap``)."""
    try:
        values = [int(v) for v in str(text).split(",")]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise SystemExit(f"--overlap: expected comma-separated positive ints (overlap_chunks), got {text!r}")
    return sorted(set(values))


def lora_factors(num_experts: int, n1: int, H: int, I: int, rank: int, device, dtype) -> dict[str, ExpertLoRA]:
    """Random LoRA adapters of ``rank`` on both projections of ``num_experts`` experts (PEFT's layout,
    B nonzero so every factor gets a gradient), leaves that require grad."""

    def leaf(*shape):
        return (torch.randn(*shape, device=device, dtype=dtype) / shape[-1] ** 0.5).requires_grad_()

    rE = rank * num_experts
    return {
        "gate_up_proj": ExpertLoRA(lora_A=leaf(rE, H), lora_B=leaf(n1, rE), scaling=2.0, num_experts=num_experts),
        "down_proj": ExpertLoRA(lora_A=leaf(rE, I), lora_B=leaf(H, rE), scaling=2.0, num_experts=num_experts),
    }


def measure(
    shape,
    config,
    routing: str,
    dispatcher: str,
    backend: str,
    ep,
    opts,
    device,
    overlaps: list[int] = (1,),
    *,
    exchange: str = "auto",
    lora_rank: int | None = None,
    fp8_dispatch: bool = False,
) -> dict:
    """One rank's numbers for one (shape, routing, dispatcher); ``sync_free`` rows moved by
    ``exchange``; the whole call timed at each of ``overlaps`` that the options take (1 only for
    ``all_gather`` and the ``symm_mem`` exchange), and the same step on one device (module docstring);
    with ``lora_rank``, LoRA adapters on every call and the LoRA step."""
    T, E, H, I, K = shape.tokens, config.num_experts, config.hidden_size, config.intermediate_size, config.top_k
    El, dtype = E // ep.world_size, layer_bench.DTYPES[opts.dtype]
    torch.manual_seed(1000 + ep.rank)  # each rank its own tokens
    inputs = layer_bench.make_inputs(shape, _with(opts, routing=routing, device=str(device)))
    with torch.no_grad():
        r = route(inputs.xs[0], inputs.router_weight, config)
        x, ids, w = inputs.xs[0].detach(), r.topk_ids, r.topk_weights.to(dtype)
    gated = config.activation in GATED
    n1 = (2 if gated else 1) * I
    w_up = torch.randn(El, n1, H, device=device, dtype=dtype) / H**0.5
    w_down = torch.randn(El, H, I, device=device, dtype=dtype) / I**0.5
    more = {"exchange": exchange} if dispatcher == "sync_free" else {}
    options = EPOptions(
        num_experts=E,
        dispatcher=dispatcher,
        max_tokens=None if dispatcher == "all_to_all" else T,
        fp8_dispatch=fp8_dispatch,
        **more,
    )
    mod = DISPATCHERS[dispatcher]
    lora = None if lora_rank is None else lora_factors(El, n1, H, I, lora_rank, device, dtype)
    recipe = ep_recipe(opts)
    kw = dict(activation=config.activation, backend=backend, drop_invalid=True, lora=lora, recipe=recipe)
    rows_kw = {**kw, "drop_invalid": mod.EXPERTS_DROP_INVALID}  # as ExpertParallel calls them

    def time_ms(fn) -> float:
        return _time_ms(fn, ep, opts, device)

    with torch.no_grad():
        d = mod.dispatch(x, ids, w, ep, options)
        y = experts(d.rows, d.topk_ids, d.topk_weights, w_up, w_down, **rows_kw)
        t_dispatch = time_ms(lambda: mod.dispatch(x, ids, w, ep, options))
        t_experts = time_ms(lambda: experts(d.rows, d.topk_ids, d.topk_weights, w_up, w_down, **rows_kw))
        t_combine = time_ms(lambda: mod.combine(y, d))
        live = (d.topk_ids >= 0) & (d.topk_ids < El)  # pairs computed here (setup only: host reads ok)
        pairs = int(live.sum())
        sent = _rows_sent(dispatcher, d, x, ep)
        plain = _plain_all_to_all_ms(sent, H, dtype, ep, device, time_ms)
        ref_ids = torch.sort(d.topk_ids[live])[0].unsqueeze(1)
        ref_x = torch.randn(pairs, H, device=device, dtype=dtype)
        t_ref = time_ms(lambda: experts(ref_x, ref_ids, torch.ones_like(ref_ids, dtype=dtype), w_up, w_down, **kw))
    layer = {
        str(n): measure_layer(
            ExpertParallel(ep, EPOptions(**{**options.__dict__, "overlap_chunks": n})),
            x,
            ids,
            w,
            w_up,
            w_down,
            kw,
            time_ms,
        )
        for n in overlaps
        if n == 1 or _overlaps(options)
    }
    one_gpu = measure_one_gpu(x, ids, w, E, n1, H, I, lora_rank, kw, time_ms)
    flops = (6 if gated else 4) * pairs * H * I
    nbytes = sent * (H + 16 if fp8_dispatch else H * dtype.itemsize)  # e4m3 rows carry 16 bytes of scale
    return {
        "case": shape.name,
        "routing": routing,
        "dispatcher": dispatcher,
        "exchange": options.exchange,
        "fp8_dispatch": fp8_dispatch,
        "rank": ep.rank,
        "T": T,
        "H": H,
        "I": I,
        "E": E,
        "E_local": El,
        "k": K,
        "rows_received": d.rows.shape[0],
        "pairs_computed": pairs,
        "rows_sent": sent,
        "dispatch_ms": t_dispatch,
        "experts_ms": t_experts,
        "combine_ms": t_combine,
        "dispatch_GBps": nbytes / t_dispatch / 1e6,
        "plain_all_to_all_ms": plain,
        "plain_all_to_all_GBps": nbytes / plain / 1e6,
        "experts_tflops": flops / t_experts / 1e9,
        "one_device_ms": t_ref,
        "one_device_tflops": flops / t_ref / 1e9,
        "dropped": None if d.dropped is None else int(d.dropped),
        "overlap": layer,
        "lora_rank": lora_rank,
        "one_gpu": one_gpu,
    }


def measure_layer(call, x, ids, w, w_up, w_down, kw: dict, time_ms) -> dict:
    """``{"fwd_ms", "fwd_bwd_ms"}`` of the whole expert-parallel call: forward alone, and forward +
    backward into fresh leaves of the tokens, routing weights and local expert weights (with LoRA
    adapters in ``kw``: the weights frozen, the adapters' factors get the gradients)."""
    train_weights = kw.get("lora") is None
    leaves = [t.detach().clone().requires_grad_(train_weights or i < 2) for i, t in enumerate((x, w, w_up, w_down))]
    dy = torch.randn_like(x)

    def step():
        xl, wl, up, down = leaves
        call(xl, ids, wl, up, down, **kw).backward(dy)

    with torch.no_grad():
        fwd = time_ms(lambda: call(x, ids, w, w_up, w_down, **kw))
    return {"fwd_ms": fwd, "fwd_bwd_ms": time_ms(step)}


def measure_one_gpu(x, ids, w, E: int, n1: int, H: int, I: int, lora_rank: int | None, kw: dict, time_ms) -> dict:
    """``{"fwd_ms", "fwd_bwd_ms"}`` of this rank's tokens through all E experts on this device, no
    exchange (:func:`moeyard.experts` with the whole layer's weights, and all E experts' adapters with
    ``lora_rank``): the weak-scaling reference. Every rank calls it (it times after a barrier)."""
    w_up = torch.randn(E, n1, H, device=x.device, dtype=x.dtype) / H**0.5
    w_down = torch.randn(E, H, I, device=x.device, dtype=x.dtype) / I**0.5
    lora = None if lora_rank is None else lora_factors(E, n1, H, I, lora_rank, x.device, x.dtype)
    out = measure_layer(experts, x, ids, w, w_up, w_down, {**kw, "lora": lora}, time_ms)
    del w_up, w_down, lora
    return out


def _overlaps(options: EPOptions) -> bool:
    """Whether ``options`` take ``overlap_chunks > 1``: not ``all_gather``, not the ``symm_mem`` or ``p2p``
    exchange."""
    return options.dispatcher != "all_gather" and options.exchange not in DEVICE_EXCHANGES


def _time_ms(fn, ep, opts, device) -> float:
    """Median ms of ``fn()`` (:func:`moeyard.bench.time_ms`), all ranks starting together: the
    device's queue drained, then a barrier (every rank calls this in the same order)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier(group=ep.group)
    return layer_bench.time_ms(lambda i: fn(), 1, opts.warmup, opts.iters, device)


def _rows_sent(dispatcher: str, d, x: Tensor, ep) -> int:
    """Rows of H this rank puts on the wire in dispatch."""
    if dispatcher == "all_to_all":
        return sum(d.state[1])  # exactly its routed pairs
    if dispatcher == "sync_free":
        return d.state.exchange.rows_sent(d.state.handle)  # equal splits: W * C slots, empty ones included
    return d.rows.shape[0]  # all_gather: W * T_max rows


def _plain_all_to_all_ms(rows: int, H: int, dtype, ep, device, time_ms) -> float:
    per = max(1, -(-rows // ep.world_size))
    src = torch.randn(per * ep.world_size, H, device=device, dtype=dtype)
    dst = torch.empty_like(src)
    return time_ms(lambda: dist.all_to_all_single(dst, src, group=ep.group))


def _with(opts, **changes):
    return layer_bench.BenchOptions(**{**opts.__dict__, **changes})


def _slowest(per: list[dict], key: str) -> str:
    """``"a / b / c"``: the slowest rank's ``key`` for each overlap_chunks measured."""
    return " / ".join(f"{max(p['overlap'][n][key] for p in per):.3f}" for n in per[0]["overlap"])


def weak_scaling(per: list[dict]) -> dict:
    """One row's weak scaling from every rank's numbers: the slowest rank's expert-parallel step
    (forward + backward, ``overlap_chunks`` 1), the ranks' mean one-GPU step on their own tokens, and
    ``per_gpu`` = one-GPU / expert-parallel (1.0: each GPU as fast as one GPU alone on the same rows)."""
    ep_ms = max(p["overlap"]["1"]["fwd_bwd_ms"] for p in per)
    one_ms = sum(p["one_gpu"]["fwd_bwd_ms"] for p in per) / len(per)
    return {"ep_fwd_bwd_ms": ep_ms, "one_gpu_fwd_bwd_ms": one_ms, "per_gpu": one_ms / ep_ms}


def _report(everyone: list[list[dict]], opts, args, device) -> None:
    from rich.console import Console
    from rich.table import Table

    W = len(everyone)
    lora = everyone[0][0].get("lora_rank")
    step = f"LoRA r={lora} step" if lora else "training step"
    step += f" · recipe {ep_recipe(opts)}" if ep_recipe(opts) else ""
    table = Table(
        title=f"moeyard bench --ep {W} · {layer_bench.device_info(device)['device']} · {opts.dtype} · "
        f"{step} · slowest rank's ms, rank 0's rates"
    )
    cols = (
        "case",
        "routing",
        "dispatcher",
        "T/rank",
        "rows recv (max)",
        "dispatch ms",
        "experts ms",
        "combine ms",
        "GB/s",
        "plain a2a GB/s",
        "TFLOP/s",
        "1-device TFLOP/s",
        "dropped",
        f"fwd ms (overlap {'/'.join(everyone[0][0]['overlap'])})",
        "fwd+bwd ms",
        "1-GPU fwd+bwd ms",
        "per GPU vs 1 GPU",
    )
    for c in cols:
        table.add_column(c, justify="left" if c in ("case", "routing", "dispatcher") else "right")
    for i, r0 in enumerate(everyone[0]):
        per = [rank_rows[i] for rank_rows in everyone]
        slow = {k: max(p[k] for p in per) for k in ("dispatch_ms", "experts_ms", "combine_ms", "rows_received")}
        label = r0["dispatcher"] + (f" ({r0['exchange']})" if r0["exchange"] not in ("auto", None) else "")
        label += " fp8" if r0.get("fp8_dispatch") else ""
        table.add_row(
            r0["case"],
            r0["routing"],
            label,
            str(r0["T"]),
            str(slow["rows_received"]),
            f"{slow['dispatch_ms']:.3f}",
            f"{slow['experts_ms']:.3f}",
            f"{slow['combine_ms']:.3f}",
            f"{r0['dispatch_GBps']:.2f}",
            f"{r0['plain_all_to_all_GBps']:.2f}",
            f"{r0['experts_tflops']:.3g}",
            f"{r0['one_device_tflops']:.3g}",
            "-" if r0["dropped"] is None else str(sum(p["dropped"] for p in per)),
            _slowest(per, "fwd_ms"),
            _slowest(per, "fwd_bwd_ms"),
            f"{weak_scaling(per)['one_gpu_fwd_bwd_ms']:.3f}",
            f"{weak_scaling(per)['per_gpu']:.1%}",
        )
    Console(width=280).print(table)
    if args.json:
        text = json.dumps(
            {
                "env": layer_bench.environment(opts),
                "world_size": W,
                "lora_rank": lora,
                "rows": [r for rank_rows in everyone for r in rank_rows],
                "weak_scaling": [
                    {
                        "case": p[0]["case"],
                        "routing": p[0]["routing"],
                        "dispatcher": p[0]["dispatcher"],
                        "exchange": p[0]["exchange"],
                        **weak_scaling(p),
                    }
                    for p in zip(*everyone, strict=True)
                ],
            },
            indent=1,
        )
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
