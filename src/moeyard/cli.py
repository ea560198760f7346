"""The ``moeyard`` command line: ``info``, ``bench``, ``verify``.

    moeyard info                          versions, device, backends that run here
    moeyard bench                         time the MoE layer (see ``moeyard bench --help``)
    moeyard bench --model qwen3-30b-a3b --routing zipf --json out.json --plot out.png
    moeyard bench --e2e --model qwen3-30b-a3b  a training step of a 4-layer transformers decoder stack
    moeyard bench --plot out.png --from out.json   redraw a saved result
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

from . import bench, bench_plot
from .quant.recipe import recipe_names
from .bench_plot import case_label
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
    p.add_argument("--compile", nargs="?", const="default", choices=bench.COMPILE_MODES, metavar="MODE",
                   help="run moeyard's layers under torch.compile (MODE: default, reduce-overhead or "
                        "max-autotune-no-cudagraphs; compiled before the warm-up); peers stay eager")
    p.add_argument("--json", nargs="?", const="-", metavar="PATH",
                   help="write the results as JSON to PATH ('-' or no PATH: stdout; the table goes to stderr)")
    p.add_argument("--recipe", metavar="A,B", help="FP8 training recipes for moeyard's rows, comma-separated: "
                   f"{', '.join(['none'] + recipe_names())} (none: the compute dtype); each backend (with --e2e: "
                   "each moeyard implementation) runs once per recipe, named <name>+<recipe>")
    p.add_argument("--lora", type=int, nargs="?", const=16, metavar="R",
                   help="time the LoRA fine-tuning step of the routed experts (rank R, default 16) against the "
                        "frozen-base step and PEFT's default path (moeyard.bench_lora); --backends then names "
                        "its implementations; with --ep: the expert-parallel LoRA step")
    p.add_argument("--quant", choices=["nf4"], help="with --lora: QLoRA rows (bf16 LoRA, NF4 with selective "
                   "dequantisation, NF4 dequantised whole) on a stack of --layers layers")
    p.add_argument("--layers", type=int, metavar="L", help="layers of the --quant stack (default 4) or of the --e2e "
                   "decoder stack (default 4; 2 for mixtral-8x7b, qwen3-235b-a22b, gpt-oss-120b; 1 for deepseek-v3)")
    p.add_argument("--e2e", action="store_true", help="time a training step (forward, cross-entropy, backward, AdamW) "
                   "of a --layers decoder stack of the --model's transformers architecture, random weights, per "
                   "experts implementation (moeyard.bench_e2e); --tokens: tokens per step (default 8192); "
                   "--backends: transformers experts implementations (default moeyard,grouped_mm[,sonicmoe])")
    p.add_argument("--seq-len", type=int, metavar="S", help="with --e2e: sequence length (default min(tokens, 2048)); "
                   "batch = tokens / S")
    p.add_argument("--vocab", type=int, metavar="V", help="with --e2e: vocabulary size (default 32768, reduced from "
                   "the model's: the float32 logits of the loss)")
    p.add_argument("--tiny", action="store_true", help="with --e2e: the tiny configuration of moeyard verify "
                   "(hidden 64, 8 experts; default on CPU when no --model is given)")
    p.add_argument("--plot", metavar="PATH", help="draw the results as grouped bars into PATH (.png, .svg, .pdf; "
                   "needs matplotlib: pip install 'moeyard[plot]')")
    p.add_argument("--from", dest="from_json", metavar="JSON", help="with --plot: redraw a saved --json result "
                   "(and print its table) without running anything")
    p.add_argument("--trace", metavar="DIR", help="after timing, profile one more step per case and implementation: "
                   "DIR/<case>-<impl>.json (Chrome trace) and, on CUDA, DIR/<case>-<impl>-memory.pickle "
                   "(allocator snapshot; moeyard.bench_trace)")
    p.add_argument("--framework", choices=("torch", "jax"), default="torch",
                   help="jax: after each case's PyTorch rows, time moeyard.jax's layer and a plain jax.lax.ragged_dot "
                        "pipeline on the same inputs (moeyard.jax.bench; needs pip install 'moeyard[jax]')")
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
                              routed_only=args.routed_only, command=command, trace=args.trace,
                              compile=args.compile, recipes=_names(args.recipe))


def _names(csv: str | None) -> list[str] | None:
    return [n.strip() for n in csv.split(",") if n.strip()] if csv else None


def run_bench(args, command: str) -> int:
    try:
        check_bench_arguments(args)
    except (ValueError, ImportError) as ex:
        return _error(ex)
    if args.ep:
        from .parallel import bench as ep_bench
        return ep_bench.main(args, command)
    to_stdout = args.json == "-"
    console = _wide(Console(stderr=to_stdout))
    if args.list_models:
        console.print(models_table())
        return 0
    try:
        if args.from_json:
            result = bench_plot.load_result(args.from_json)
        else:
            if args.quant and args.lora is None:
                args.lora = 16
            result = _run_with_progress(bench_options(args, command), args)
    except (ValueError, ImportError) as ex:
        return _error(ex)
    if args.json:
        _write_json(result, args.json)
    console.print(result_table(result), soft_wrap=False)
    if args.plot:
        try:
            console.print(f"plot: {bench_plot.plot(result, args.plot)}", highlight=False)
        except (ValueError, ImportError) as ex:
            return _error(ex)
    return 0 if any("error" not in r for r in result["rows"]) else 1


# flags that choose what to run: none of them goes with --from
_RUN_FLAGS = ("model", "shape", "e2e", "lora", "quant", "trace", "json", "ep", "list_models", "compile")


def check_bench_arguments(args) -> None:
    """Reject combinations of ``moeyard bench`` options that do not go together, before running anything.

    Raises:
        ValueError: naming the flags; ImportError: ``--plot`` without matplotlib.
    """
    def given(name):
        return getattr(args, name) not in (None, False, [])

    if args.from_json:
        if not args.plot:
            raise ValueError("--from: redraws a saved result; give --plot PATH too")
        clash = [f"--{n.replace('_', '-')}" for n in _RUN_FLAGS if given(n)]
        if clash:
            raise ValueError(f"--from: redraws a saved result without running; drop {', '.join(clash)}")
    if args.e2e and (given("lora") or given("quant")):
        raise ValueError("--e2e: cannot be combined with --lora / --quant (one benchmark mode at a time)")
    if args.ep and (args.e2e or args.plot or args.trace):
        raise ValueError("--ep: --e2e, --plot and --trace are not available with expert parallelism")
    if given("recipe") and (given("lora") or given("quant") or args.ep):
        raise ValueError("--recipe: times the layer benchmark or --e2e (not with --lora, --quant or --ep)")
    if args.framework == "jax" and (args.e2e or given("lora") or given("quant") or args.ep or given("compile")):
        raise ValueError("--framework jax: times the layer benchmark only (not with --e2e, --lora, --quant, --ep or "
                         "--compile)")
    if given("compile") and (args.e2e or given("lora") or given("quant") or args.ep):
        raise ValueError("--compile: times the layer benchmark only (not with --e2e, --lora, --quant or --ep)")
    for name in ("tiny", "seq_len", "vocab"):
        if given(name) and not args.e2e:
            raise ValueError(f"--{name.replace('_', '-')}: only with --e2e")
    if args.ep and given("quant"):
        raise ValueError("--ep: --quant is not available with expert parallelism (--lora R times the LoRA step)")
    if args.plot:
        bench_plot.check_plot_path(args.plot)
        bench_plot._figure_class()  # matplotlib missing: say so before a long run
    if args.trace:
        from .bench_trace import check_trace_dir
        check_trace_dir(args.trace)


def _error(ex: Exception) -> int:
    from rich.markup import escape

    Console(stderr=True).print(f"[red]moeyard bench: {escape(str(ex))}[/red]", highlight=False, soft_wrap=True)
    return 2


def _write_json(result: dict, path: str) -> None:
    text = json.dumps(result, indent=1)
    if path == "-":
        print(text)
        return
    with open(path, "w") as f:
        f.write(text + "\n")


def result_table(result: dict) -> Table:
    """The table of a result of any mode (:func:`moeyard.bench_plot.result_mode`)."""
    mode = bench_plot.result_mode(result)
    return {"layer": results_table, "lora": lora_table, "e2e": e2e_table}[mode](result)


def _wide(console: Console) -> Console:
    """Results tables are wide: outside a terminal, do not squeeze them to 80 columns."""
    return console if console.is_terminal else Console(stderr=console.stderr, width=180)


def _run_with_progress(opts: bench.BenchOptions, args) -> dict:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("moeyard bench", total=None)

        def report(desc: str, done: int, total: int) -> None:
            progress.update(task, description=desc, completed=done, total=total)
        if args.e2e:
            from . import bench_e2e
            tiny = args.tiny or (not opts.models and (opts.device or bench.default_device()) == "cpu")
            return bench_e2e.run(opts, progress=report, layers=args.layers, seq_len=args.seq_len, vocab=args.vocab,
                                 tiny=tiny, trace=args.trace)
        if args.framework == "jax":
            from .jax import bench as jax_bench
            return jax_bench.run(opts, progress=report)
        if args.lora is not None:
            from . import bench_lora
            return bench_lora.run(opts, args.lora, progress=report, quant=args.quant,
                                  layers=4 if args.layers is None else args.layers)
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
               f"dense e4m3 matmul (8192^3, rowwise scales) this run: {env['dense_fp8_tflops']:.0f} TFLOP/s"
               if env.get("dense_fp8_tflops") else "",
               "FLOPs: fwd = 6*T*k*H*I (gated; 4* plain) + shared experts, fwd+bwd = 3x fwd, router not counted; "
               f"median of {env['iters']} after {env['warmup']} warm-up; peak = extra GiB of fwd+bwd",
               *[f"{name} skipped: {why}" for name, why in env.get("skipped", {}).items()], _trace_line(result),
               *peer_ratio_lines(result["rows"]), env.get("framework_note", "")]
    return _case_table(title, caption, ("case (T,H,I,E,k)", "impl", "fwd ms", "fwd TFLOP/s", "fwd+bwd ms",
                                        "fwd+bwd TFLOP/s", "peak GiB", "load max/mean", "note"),
                       result["rows"], _cells)


def peer_ratio_lines(rows: list[dict]) -> list[str]:
    """One caption line per case with moeyard and peer rows: each moeyard implementation's speed-up
    over each peer, ``peer ms / moeyard ms`` for forward+backward (and forward), > 1: moeyard faster."""
    lines = []
    for case in dict.fromkeys(r["case"] for r in rows):
        ok = [r for r in rows if r["case"] == case and "error" not in r and r.get("fwdbwd_ms")]
        ours = [r for r in ok if r.get("kind") == "moeyard"]
        peers = [r for r in ok if r.get("kind") == "peer"]
        for r in ours if peers else []:
            vs = ", ".join(f"{p['impl']} {p['fwdbwd_ms'] / r['fwdbwd_ms']:.2f}x ({p['fwd_ms'] / r['fwd_ms']:.2f}x)"
                           for p in peers)
            lines.append(f"{case}: {r['impl']} vs {vs} (fwd+bwd (fwd) speed-up, > 1: {r['impl']} faster)")
    return lines


def lora_table(result: dict) -> Table:
    """The ``--lora`` results (:mod:`moeyard.bench_lora`) as a rich table."""
    env = result["env"]
    dense = env.get("dense_bf16_tflops")
    stack = f" --quant {env['quant']} ({env['layers']} layers)" if env.get("quant") else ""
    title = (f"moeyard bench --lora {env['lora_rank']}{stack} · {env['device']} · {env['dtype']} · routed experts, "
             f"base frozen\ntorch {env['torch']} · triton {env['triton']} · moeyard {env['moeyard']} · {env['date']}")
    caption = [f"$ {env['command']}" if env["command"] else "",
               f"dense bf16 matmul (8192^3) this run: {dense:.0f} TFLOP/s" if dense else "",
               f"dense e4m3 matmul (8192^3, rowwise scales) this run: {env['dense_fp8_tflops']:.0f} TFLOP/s"
               if env.get("dense_fp8_tflops") else "",
               "step = forward + backward (input gradient; LoRA factor gradients where adapted); FLOPs 12*N*H*I "
               "+ 6*N*r*(in+out) per adapter; x frozen = step / frozen step; x lora = step / lora step; "
               f"median of {env['iters']} after {env['warmup']} warm-up; peak = extra GiB of the step",
               _trace_line(result)]
    return _case_table(title, caption, ("case (T,H,I,E,k)", "impl", "step ms", "TFLOP/s", "peak GiB", "weights GiB",
                                        "x frozen", "x lora"), result["rows"], _lora_cells)


def _lora_cells(r: dict) -> list[str]:
    if "error" in r:
        return [f"[red]{r['error'][:120]}[/red]", "", "", "", "", ""]
    return [_fmt(r["step_ms"], ".3f"), _fmt(r["tflops"], ".1f"), _fmt(r["peak_gib"], ".2f"),
            _fmt(r.get("weights_gib"), ".2f"), _fmt(r.get("x_frozen"), ".2f"), _fmt(r.get("lora_speedup"), ".2f")]


def e2e_table(result: dict) -> Table:
    """The ``--e2e`` results (:mod:`moeyard.bench_e2e`) as a rich table."""
    env = result["env"]
    cap = f" (sm {env['capability']})" if env["capability"] else ""
    title = (f"moeyard bench --e2e{' --tiny' if env.get('tiny') else ''} · {env['device']}{cap} · {env['dtype']} · "
             f"transformers decoder stack, random weights\ntorch {env['torch']} · triton {env['triton']} · "
             f"transformers {env['transformers']} · moeyard {env['moeyard']} · {env['date']}")
    vocabs = {(r["case"], r["vocab"], r["real_vocab"]) for r in result["rows"] if "vocab" in r}
    caption = [f"$ {env['command']}" if env["command"] else "",
               f"step = forward + cross-entropy on random labels + backward + {env['optimizer']} step + zero_grad; "
               f"median of {env['iters']} after {env['warmup']} warm-up; tokens/s = batch x seq / step; "
               "x gmm = grouped_mm step / step (> 1: faster); peak = max allocated in the timed steps (weights, "
               "gradients, optimizer states, activations)",
               *[f"{case}: vocabulary {v:,} (the model's: {real:,}; reduced for the float32 logits of the loss)"
                 for case, v, real in sorted(vocabs) if v != real and not env.get("tiny")],
               *[f"{name} skipped: {why}" for name, why in env.get("skipped", {}).items()], _trace_line(result)]
    return _case_table(title, caption, ("model (layers, batch x seq)", "impl", "step ms", "tokens/s", "x gmm",
                                        "peak GiB", "params M", "note"), result["rows"], _e2e_cells)


def _case_table(title: str, caption: list[str], columns: tuple[str, ...], rows: list[dict], cells) -> Table:
    """A results table: the first column names the case (once per section), the second the
    implementation, the rest ``cells(row)``; text columns (the first two and ``note``) left-aligned."""
    table = Table(title=title, caption="\n".join(c for c in caption if c), caption_justify="left")
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i < 2 or col == "note" else "right")
    last = None
    for r in rows:
        key = case_label(r)
        if last is not None and key != last:
            table.add_section()
        table.add_row("" if key == last else key, r["impl"], *cells(r))
        last = key
    return table


def _trace_line(result: dict) -> str:
    """The caption's line on ``--trace`` output ("" without it)."""
    trace = result["env"].get("trace")
    if not trace:
        return ""
    notes = sorted({r["trace_note"] for r in result["rows"] if r.get("trace_note")})
    return f"traces: {trace}/<case>-<impl>.json" + (f" ({'; '.join(notes)})" if notes else
                                                     " and <case>-<impl>-memory.pickle")


def _e2e_cells(r: dict) -> list[str]:
    params = _fmt(r["params"] / 1e6 if r.get("params") else None, ",.0f" if r.get("params", 0) >= 1e7 else ".3g")
    if "error" in r:
        return ["[red]error[/red]", "", "", "", params, f"[red]{r['error'][:160]}[/red]"]
    note = ", ".join(x for x in (f"backend {r['backend']}" if r.get("backend") else "",
                                 f"attention {r.get('attn_implementation')}") if x)
    return [_fmt(r["step_ms"], ".2f"), _fmt(r["tokens_per_s"], ",.0f"), _fmt(r.get("x_vs_grouped_mm"), ".2f"),
            _fmt(r["peak_gib"], ".2f"), params, note]


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
