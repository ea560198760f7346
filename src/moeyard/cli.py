"""The ``moeyard`` command line: ``info``, ``bench``, ``verify``.

    moeyard info                          versions, device, backends that run here
    moeyard bench                         time the MoE layer (see ``moeyard bench --help``)
    moeyard bench --model qwen3-30b-a3b --routing zipf --json out.json
    moeyard verify ...                    correctness checks (``moeyard.verify``)
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import shlex
import sys

from rich.console import Console
from rich.table import Table

from . import bench
from .models import MODELS


def main(argv: list[str] | None = None) -> int:
    """Run the command line on ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "verify":
        return run_verify(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "info":
        return run_info(args)
    return run_bench(args, shlex.join(["moeyard", *argv]))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moeyard", description="Mixture-of-Experts layers for PyTorch.")
    sub = parser.add_subparsers(dest="command", metavar="{info,bench,verify}")
    info = sub.add_parser("info", help="versions, device, and the backends that run here")
    info.add_argument("--json", action="store_true", help="print machine-readable JSON")
    add_bench_arguments(sub.add_parser("bench", help="time the MoE layer per backend and peer",
                                       description=bench.__doc__.split("\n\n")[0]))
    sub.add_parser("verify", help="correctness checks of the backends (moeyard verify --help)", add_help=False)
    return parser


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", action="append", default=[], metavar="NAME",
                   help=f"a registered model shape (repeatable): {', '.join(MODELS)}")
    p.add_argument("--shape", action="append", default=[], metavar="T,H,I,E,k",
                   help="a custom shape (repeatable): tokens, hidden, expert intermediate, experts, top-k")
    p.add_argument("--tokens", type=int, metavar="T", help="tokens per layer call for every shape")
    p.add_argument("--device", help="cuda, cuda:1 or cpu (default: cuda when available)")
    p.add_argument("--dtype", choices=list(bench.DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--backends", metavar="A,B", help="comma-separated moeyard backends and/or peers "
                   "(default: every backend that runs here)")
    p.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the peers (torch_gmm; sonicmoe when importable)")
    p.add_argument("--routing", choices=bench.ROUTINGS, default="random",
                   help="random router, exactly balanced, or Zipf-skewed loads (forced through the router "
                        "weights; see moeyard.bench)")
    p.add_argument("--zipf-alpha", type=float, default=1.2, metavar="A",
                   help="Zipf exponent: expert e is chosen with p ~ (e+1)^-A (default 1.2)")
    p.add_argument("--warmup", type=int, help="untimed runs before timing (default 5 on CUDA, 2 on CPU)")
    p.add_argument("--iters", type=int, help="timed runs; the median is reported (default 20 on CUDA, 10 on CPU)")
    p.add_argument("--routed-only", action="store_true", help="drop shared experts (compare with the peers in ms)")
    p.add_argument("--json", nargs="?", const="-", metavar="PATH",
                   help="write the results as JSON to PATH ('-' or no PATH: stdout; the table goes to stderr)")
    p.add_argument("--lora", type=int, nargs="?", const=16, metavar="R",
                   help="time the LoRA fine-tuning step of the routed experts (rank R, default 16) against the "
                        "frozen-base step and PEFT's default path (moeyard.bench_lora); --backends then names "
                        "its implementations")
    p.add_argument("--quant", choices=["nf4"], help="with --lora: QLoRA rows (bf16 LoRA, NF4 with selective "
                   "dequantisation, NF4 dequantised whole) on a stack of --layers layers")
    p.add_argument("--layers", type=int, default=4, metavar="L", help="layers in the --quant stack (default 4)")
    p.add_argument("--list-models", action="store_true", help="list the registered model shapes and exit")
    p.add_argument("--ep", type=int, metavar="N", help="expert parallel over N processes: run under torchrun "
                   "--nproc-per-node N -m moeyard bench --ep N (see moeyard.parallel.bench)")
    p.add_argument("--overlap", default="1", metavar="N,N",
                   help="with --ep: also time the whole expert-parallel call, forward and forward + backward, with "
                        "each of these overlap_chunks (e.g. 1,2,4; default 1)")


# ---------------------------------------------------------------- info

def info_data() -> dict:
    """Versions, devices, and the backends that run for bf16 / float32 on each device."""
    import torch

    import moeyard

    data = {**bench.versions(), "devices": {}}
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        data["devices"][device] = {
            **bench.device_info(device),
            **{f"backends_{name}": moeyard.available_backends(device, dtype)
               for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32))}}
    try:
        data["default_backend"] = moeyard.get_backend()
    except ValueError as ex:
        data["default_backend"] = f"error: {ex}"
    data["registered_backends"] = moeyard.backend_names()
    data["debug"] = moeyard.is_debug()
    return data


def run_info(args) -> int:
    data = info_data()
    if args.json:
        print(json.dumps(data, indent=1))
        return 0
    console = Console()
    table = Table(show_header=False, box=None)
    for key in ("moeyard", "torch", "triton", "transformers", "python"):
        table.add_row(key, data[key])
    for device, d in data["devices"].items():
        cap = f" (compute capability {d['capability']})" if d["capability"] else ""
        table.add_row(f"device {device}", f"{d['device']}{cap}")
        table.add_row("  backends bfloat16", ", ".join(d["backends_bfloat16"]) or "none")
        table.add_row("  backends float32", ", ".join(d["backends_float32"]) or "none")
    table.add_row("registered backends", ", ".join(data["registered_backends"]))
    table.add_row("default backend", data["default_backend"])
    table.add_row("debug mode", "on" if data["debug"] else "off")
    console.print(table)
    return 0


# ---------------------------------------------------------------- bench

def bench_options(args, command: str) -> bench.BenchOptions:
    backends = [b.strip() for b in args.backends.split(",") if b.strip()] if args.backends else None
    return bench.BenchOptions(models=args.model, shapes=args.shape, tokens=args.tokens, device=args.device,
                              dtype=args.dtype, backends=backends, peers=args.peers, routing=args.routing,
                              zipf_alpha=args.zipf_alpha, warmup=args.warmup, iters=args.iters,
                              routed_only=args.routed_only, command=command)


def run_bench(args, command: str) -> int:
    if args.ep:
        from .parallel import bench as ep_bench
        return ep_bench.main(args, command)
    to_stdout = args.json == "-"
    console = _wide(Console(stderr=to_stdout))
    if args.list_models:
        console.print(models_table())
        return 0
    try:
        if args.quant and args.lora is None:
            args.lora = 16
        result = _run_with_progress(bench_options(args, command), lora=args.lora, quant=args.quant,
                                    layers=args.layers)
    except ValueError as ex:
        Console(stderr=True).print(f"[red]moeyard bench: {ex}[/red]", highlight=False)
        return 2
    if args.json:
        text = json.dumps(result, indent=1)
        if to_stdout:
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    console.print(results_table(result) if args.lora is None else lora_table(result), soft_wrap=False)
    return 0 if any("error" not in r for r in result["rows"]) else 1


def _wide(console: Console) -> Console:
    """Results tables are wide: outside a terminal, do not squeeze them to 80 columns."""
    return console if console.is_terminal else Console(stderr=console.stderr, width=180)


def _run_with_progress(opts: bench.BenchOptions, lora: int | None = None, quant: str | None = None,
                       layers: int = 4) -> dict:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("moeyard bench", total=None)

        def report(desc: str, done: int, total: int) -> None:
            progress.update(task, description=desc, completed=done, total=total)
        if lora is not None:
            from . import bench_lora
            return bench_lora.run(opts, lora, progress=report, quant=quant, layers=layers)
        return bench.run(opts, progress=report)


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def results_table(result: dict) -> Table:
    """The results as a rich table; the run's environment in the title and caption."""
    env = result["env"]
    cap = f" (sm {env['capability']})" if env["capability"] else ""
    dense = env.get("dense_bf16_tflops")
    routing = env["routing"] + (f" (alpha {env['zipf_alpha']})" if env["zipf_alpha"] else "")
    title = (f"moeyard bench · {env['device']}{cap} · {env['dtype']} · routing {routing}\n"
             f"torch {env['torch']} · triton {env['triton']} · moeyard {env['moeyard']} · "
             f"python {env['python']} · {env['date']}")
    caption = [f"$ {env['command']}" if env["command"] else "",
               f"dense bf16 matmul (8192^3) this run: {dense:.0f} TFLOP/s" if dense else "",
               "FLOPs: fwd = 6*T*k*H*I (gated; 4* plain) + shared experts, fwd+bwd = 3x fwd, router not counted; "
               f"median of {env['iters']} after {env['warmup']} warm-up; peak = extra GiB of fwd+bwd",
               *[f"{name} skipped: {why}" for name, why in env.get("skipped", {}).items()]]
    table = Table(title=title, caption="\n".join(c for c in caption if c), caption_justify="left")
    for col in ("case (T,H,I,E,k)", "impl", "fwd ms", "fwd TFLOP/s", "fwd+bwd ms", "fwd+bwd TFLOP/s",
                "peak GiB", "load max/mean", "note"):
        table.add_column(col, justify="left" if col in ("case (T,H,I,E,k)", "impl", "note") else "right")
    last = None
    for r in result["rows"]:
        key = _case_label(r)
        if last is not None and key != last:
            table.add_section()
        table.add_row("" if key == last else key, r["impl"], *_cells(r))
        last = key
    return table


def lora_table(result: dict) -> Table:
    """The ``--lora`` results (:mod:`moeyard.bench_lora`) as a rich table."""
    env = result["env"]
    dense = env.get("dense_bf16_tflops")
    stack = f" --quant {env['quant']} ({env['layers']} layers)" if env.get("quant") else ""
    title = (f"moeyard bench --lora {env['lora_rank']}{stack} · {env['device']} · {env['dtype']} · routed experts, "
             f"base frozen\ntorch {env['torch']} · triton {env['triton']} · moeyard {env['moeyard']} · {env['date']}")
    caption = [f"$ {env['command']}" if env["command"] else "",
               f"dense bf16 matmul (8192^3) this run: {dense:.0f} TFLOP/s" if dense else "",
               "step = forward + backward (input gradient; LoRA factor gradients where adapted); FLOPs 12*N*H*I "
               "+ 6*N*r*(in+out) per adapter; x frozen = step / frozen step; x lora = step / lora step; "
               f"median of {env['iters']} after {env['warmup']} warm-up; peak = extra GiB of the step"]
    table = Table(title=title, caption="\n".join(c for c in caption if c), caption_justify="left")
    for col in ("case (T,H,I,E,k)", "impl", "step ms", "TFLOP/s", "peak GiB", "weights GiB", "x frozen", "x lora"):
        table.add_column(col, justify="left" if col in ("case (T,H,I,E,k)", "impl") else "right")
    last = None
    for r in result["rows"]:
        key = _case_label(r)
        if last is not None and key != last:
            table.add_section()
        cells = [f"[red]{r['error'][:120]}[/red]", "", "", "", "", ""] if "error" in r else \
            [_fmt(r["step_ms"], ".3f"), _fmt(r["tflops"], ".1f"), _fmt(r["peak_gib"], ".2f"),
             _fmt(r.get("weights_gib"), ".2f"), _fmt(r.get("x_frozen"), ".2f"), _fmt(r.get("lora_speedup"), ".2f")]
        table.add_row("" if key == last else key, r["impl"], *cells)
        last = key
    return table


def _case_label(r: dict) -> str:
    if "T" not in r:
        return r["case"]
    return f"{r['case']}\n({r['T']},{r['H']},{r['I']},{r['E']},{r['k']})"


def _cells(r: dict) -> list[str]:
    load = _fmt(r.get("load_max_over_mean"), ".2f")
    if "error" in r:
        return ["[red]error[/red]", "", "", "", "", load, f"[red]{r['error'][:160]}[/red]"]
    return [_fmt(r["fwd_ms"], ".3f"), _fmt(r["fwd_tflops"], ".1f" if r["fwd_tflops"] >= 1 else ".3g"),
            _fmt(r["fwdbwd_ms"], ".3f"), _fmt(r["fwdbwd_tflops"], ".1f" if r["fwdbwd_tflops"] >= 1 else ".3g"),
            _fmt(r["peak_gib"], ".2f"), load, r.get("note", "")]


def models_table() -> Table:
    """The model registry as a rich table."""
    table = Table(title="registered model shapes")
    for col in ("name", "T", "H", "I", "E", "k", "router", "activation", "shared", "source"):
        table.add_column(col)
    for m in MODELS.values():
        c = m.moe_config()
        router = c.score_func + (" top-k first" if c.topk_before_score else "") + \
            (f" groups {c.n_group}/{c.topk_group}" if c.n_group > 1 else "") + \
            (" +bias" if c.score_correction_bias else "") + ("" if c.norm_topk_prob else " no-renorm") + \
            (f" x{c.routed_scaling_factor}" if c.routed_scaling_factor != 1 else "")
        shared = "-" if not c.num_shared_experts else \
            f"{c.num_shared_experts}x{c.shared_intermediate_size or c.intermediate_size}" + \
            (" gated" if c.shared_expert_gate else "")
        table.add_row(m.name, str(m.tokens), str(c.hidden_size), str(c.intermediate_size), str(c.num_experts),
                      str(c.top_k), router, c.activation, shared, m.source)
    return table


# ---------------------------------------------------------------- verify

def run_verify(argv: list[str]) -> int:
    """``moeyard verify``: parse with ``moeyard.verify.add_arguments`` and run ``moeyard.verify.run``."""
    if importlib.util.find_spec("moeyard.verify") is None:
        print("moeyard verify: this moeyard has no moeyard.verify module; verify is unavailable",
              file=sys.stderr)
        return 2
    verify = importlib.import_module("moeyard.verify")
    parser = argparse.ArgumentParser(prog="moeyard verify", description=verify.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    verify.add_arguments(parser)
    return int(verify.run(parser.parse_args(argv)) or 0)


if __name__ == "__main__":
    sys.exit(main())
