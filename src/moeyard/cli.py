"""The ``moeyard`` command line: ``info``, ``bench``, ``verify``.

    moeyard info                          versions, device, backends that run here
    moeyard bench                         time the MoE layer (see ``moeyard bench --help``)
    moeyard bench --model qwen3-30b-a3b --routing zipf --json out.json --plot out.png
    moeyard bench --e2e --model qwen3-30b-a3b  a training step of a 4-layer transformers decoder stack
    moeyard bench --plot out.png --from out.json   redraw a saved result
    moeyard verify ...                    correctness checks (``moeyard.verify``)

The benchmark's options, runners and result tables are the package :mod:`moeyard.bench`.
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

from .bench import layer as layer_bench, plot as bench_plot
from .bench.args import add_bench_arguments, bench_options, check_bench_arguments
from .bench.tables import models_table, result_table
from .experts import scaled_hopper


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
    add_bench_arguments(
        sub.add_parser(
            "bench", help="time the MoE layer per backend and peer", description=layer_bench.__doc__.split("\n\n")[0]
        )
    )
    sub.add_parser("verify", help="correctness checks of the backends (moeyard verify --help)", add_help=False)
    return parser


# ---------------------------------------------------------------- info


def _setting(read) -> str:
    """A process setting read from its environment variable, or the error its bad value raises."""
    try:
        return read()
    except ValueError as ex:
        return f"error: {ex}"


def info_data() -> dict:
    """Versions, devices, the backends that run for bf16 / float32 on each device, and the process settings
    (default backend and recipe; the FP8 fast path's GEMMs and NF4 mode)."""
    import torch

    import moeyard

    data = {**layer_bench.versions(), "devices": {}}
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        data["devices"][device] = {
            **layer_bench.device_info(device),
            **{
                f"backends_{name}": moeyard.available_backends(device, dtype)
                for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32))
            },
        }
    data["default_backend"] = _setting(moeyard.get_backend)
    data["default_recipe"] = _setting(lambda: getattr(moeyard.get_recipe(), "name", "none"))
    data["fp8_gemm"] = _setting(scaled_hopper.gemm_backend)
    data["fp8_wgrad"] = _setting(scaled_hopper.wgrad_gemm)
    data["fp8_nf4"] = _setting(scaled_hopper.nf4_mode)
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
    table.add_row("default recipe", data["default_recipe"])
    table.add_row(f"FP8 GEMMs ({scaled_hopper.ENV_GEMM})", data["fp8_gemm"])
    table.add_row(f"FP8 weight gradients ({scaled_hopper.ENV_WGRAD})", data["fp8_wgrad"])
    table.add_row(f"NF4 under FP8 ({scaled_hopper.ENV_NF4})", data["fp8_nf4"])
    table.add_row("debug mode", "on" if data["debug"] else "off")
    console.print(table)
    return 0


# ---------------------------------------------------------------- bench


def run_bench(args, command: str) -> int:
    try:
        check_bench_arguments(args)
    except (ValueError, ImportError) as ex:
        return _error(ex)
    if args.ep:
        from .bench import ep

        return ep.main(args, command)
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


def _wide(console: Console) -> Console:
    """Results tables are wide: outside a terminal, do not squeeze them to 80 columns."""
    return console if console.is_terminal else Console(stderr=console.stderr, width=180)


def _run_with_progress(opts: layer_bench.BenchOptions, args) -> dict:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("moeyard bench", total=None)

        def report(desc: str, done: int, total: int) -> None:
            progress.update(task, description=desc, completed=done, total=total)

        if args.e2e:
            from .bench import e2e

            tiny = args.tiny or (not opts.models and (opts.device or layer_bench.default_device()) == "cpu")
            return e2e.run(
                opts,
                progress=report,
                layers=args.layers,
                seq_len=args.seq_len,
                vocab=args.vocab,
                tiny=tiny,
                trace=args.trace,
                accumulate=args.grad_accum if args.grad_accum is not None else 1,
            )
        if args.framework == "jax":
            from .bench import jax as jax_bench

            return jax_bench.run(opts, progress=report)
        if args.lora is not None:
            from .bench import lora

            return lora.run(
                opts, args.lora, progress=report, quant=args.quant, layers=4 if args.layers is None else args.layers
            )
        return layer_bench.run(opts, progress=report)


# ---------------------------------------------------------------- verify


def run_verify(argv: list[str]) -> int:
    """``moeyard verify``: parse with ``moeyard.verify.add_arguments`` and run ``moeyard.verify.run``."""
    if importlib.util.find_spec("moeyard.verify") is None:
        print("moeyard verify: this moeyard has no moeyard.verify module; verify is unavailable", file=sys.stderr)
        return 2
    verify = importlib.import_module("moeyard.verify")
    parser = argparse.ArgumentParser(
        prog="moeyard verify", description=verify.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    verify.add_arguments(parser)
    return int(verify.run(parser.parse_args(argv)) or 0)


if __name__ == "__main__":
    sys.exit(main())
