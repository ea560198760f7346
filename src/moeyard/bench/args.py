"""The ``moeyard bench`` command line's options: the arguments (:func:`add_bench_arguments`), the
combinations that do not go together (:func:`check_bench_arguments`), and the :class:`BenchOptions`
of parsed arguments (:func:`bench_options`)."""

from __future__ import annotations

import argparse

from ..quant.recipe import recipe_names
from . import plot
from .layer import COMPILE_MODES, DTYPES, ROUTINGS, BenchOptions
from .models import MODELS


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``moeyard bench`` options to ``p``."""
    p.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="NAME",
        help=f"a registered model shape (repeatable): {', '.join(MODELS)}",
    )
    p.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="T,H,I,E,k",
        help="a custom shape (repeatable): tokens, hidden, expert intermediate, experts, top-k",
    )
    p.add_argument("--tokens", type=int, metavar="T", help="tokens per layer call for every shape")
    p.add_argument("--device", help="cuda, cuda:1 or cpu (default: cuda when available)")
    p.add_argument("--dtype", choices=list(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument(
        "--backends",
        metavar="A,B",
        help="comma-separated moeyard backends and/or peers (default: every backend that runs here)",
    )
    p.add_argument(
        "--peers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the peers (torch_gmm; sonicmoe when importable)",
    )
    p.add_argument(
        "--routing",
        choices=ROUTINGS,
        default="random",
        help="random router, exactly balanced, or Zipf-skewed loads (forced through the router "
        "weights; see moeyard.bench)",
    )
    p.add_argument(
        "--zipf-alpha",
        type=float,
        default=1.2,
        metavar="A",
        help="Zipf exponent: expert e is chosen with p ~ (e+1)^-A (default 1.2)",
    )
    p.add_argument("--warmup", type=int, help="untimed runs before timing (default 5 on CUDA, 2 on CPU)")
    p.add_argument("--iters", type=int, help="timed runs; the median is reported (default 20 on CUDA, 10 on CPU)")
    p.add_argument("--routed-only", action="store_true", help="drop shared experts (compare with the peers in ms)")
    p.add_argument(
        "--compile",
        nargs="?",
        const="default",
        choices=COMPILE_MODES,
        metavar="MODE",
        help="run moeyard's layers under torch.compile (MODE: default, reduce-overhead or "
        "max-autotune-no-cudagraphs; compiled before the warm-up); peers stay eager",
    )
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="PATH",
        help="write the results as JSON to PATH ('-' or no PATH: stdout; the table goes to stderr)",
    )
    p.add_argument(
        "--recipe",
        metavar="A,B",
        help="FP8 training recipes for moeyard's rows, comma-separated: "
        f"{', '.join(['none'] + recipe_names())} (none: the compute dtype); each backend (with --e2e: "
        "each moeyard implementation) runs once per recipe, named <name>+<recipe>",
    )
    p.add_argument(
        "--lora",
        type=int,
        nargs="?",
        const=16,
        metavar="R",
        help="time the LoRA fine-tuning step of the routed experts (rank R, default 16) against the "
        "frozen-base step and PEFT's default path (moeyard.bench.lora); --backends then names "
        "its implementations; with --ep: the expert-parallel LoRA step",
    )
    p.add_argument(
        "--quant",
        choices=["nf4"],
        help="with --lora: QLoRA rows (bf16 LoRA, NF4 with selective "
        "dequantisation, NF4 dequantised whole) on a stack of --layers layers",
    )
    p.add_argument(
        "--layers",
        type=int,
        metavar="L",
        help="layers of the --quant stack (default 4) or of the --e2e "
        "decoder stack (default 4; 2 for mixtral-8x7b, qwen3-235b-a22b, gpt-oss-120b; 1 for deepseek-v3)",
    )
    p.add_argument(
        "--e2e",
        action="store_true",
        help="time a training step (forward, cross-entropy, backward, AdamW) "
        "of a --layers decoder stack of the --model's transformers architecture, random weights, per "
        "experts implementation (moeyard.bench.e2e); --tokens: tokens per step (default 8192); "
        "--backends: transformers experts implementations (default moeyard,grouped_mm[,sonicmoe])",
    )
    p.add_argument(
        "--grad-accum",
        type=int,
        metavar="M",
        help="M micro-batches per optimizer step (gradient accumulation; FP8 recipes cast each expert weight "
        "once per step, moeyard.cache_fp8_weights): with --e2e, M micro-batches of --tokens tokens per "
        "optimizer step; in the layer benchmark, the layer's steps timed in blocks of M, each block in one "
        "cache_fp8_weights(), reported per step; default 1",
    )
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help="layer benchmark, CUDA: capture each row's forward and forward+backward in a CUDA graph and time "
        "the replays (the GPU's time without the host's launches; the first input set replayed); a row "
        "that cannot be captured reports the error",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        metavar="S",
        help="with --e2e: sequence length (default min(tokens, 2048)); batch = tokens / S",
    )
    p.add_argument(
        "--vocab",
        type=int,
        metavar="V",
        help="with --e2e: vocabulary size (default 32768, reduced from the model's: the float32 logits of the loss)",
    )
    p.add_argument(
        "--tiny",
        action="store_true",
        help="with --e2e: the tiny configuration of moeyard verify "
        "(hidden 64, 8 experts; default on CPU when no --model is given)",
    )
    p.add_argument(
        "--plot",
        metavar="PATH",
        help="draw the results as grouped bars into PATH (.png, .svg, .pdf; "
        "needs matplotlib: pip install 'moeyard[plot]')",
    )
    p.add_argument(
        "--from",
        dest="from_json",
        metavar="JSON",
        help="with --plot: redraw a saved --json result (and print its table) without running anything",
    )
    p.add_argument(
        "--trace",
        metavar="DIR",
        help="after timing, profile one more step per case and implementation: "
        "DIR/<case>-<impl>.json (Chrome trace) and, on CUDA, DIR/<case>-<impl>-memory.pickle "
        "(allocator snapshot; moeyard.bench.trace)",
    )
    p.add_argument(
        "--framework",
        choices=("torch", "jax"),
        default="torch",
        help="jax: after each case's PyTorch rows, time moeyard.jax's layer and a plain jax.lax.ragged_dot "
        "pipeline on the same inputs (moeyard.bench.jax; needs pip install 'moeyard[jax]')",
    )
    p.add_argument("--list-models", action="store_true", help="list the registered model shapes and exit")
    p.add_argument(
        "--ep",
        type=int,
        metavar="N",
        help="expert parallel over N processes: run under torchrun "
        "--nproc-per-node N -m moeyard bench --ep N (see moeyard.bench.ep)",
    )
    p.add_argument(
        "--fp8-dispatch",
        action="store_true",
        help="with --ep: also time the all_to_all and all_gather dispatchers sending e4m3 rows with their "
        "scales (expert_parallel(..., fp8_dispatch=True)) next to their rows in the compute dtype",
    )
    p.add_argument(
        "--overlap",
        default="1",
        metavar="N,N",
        help="with --ep: also time the whole expert-parallel call, forward and forward + backward, with "
        "each of these overlap_chunks (e.g. 1,2,4; default 1)",
    )


def bench_options(args, command: str) -> BenchOptions:
    """The :class:`BenchOptions` of parsed ``moeyard bench`` arguments; ``command``: the command line, for
    the results' caption."""
    backends = [b.strip() for b in args.backends.split(",") if b.strip()] if args.backends else None
    return BenchOptions(
        models=args.model,
        shapes=args.shape,
        tokens=args.tokens,
        device=args.device,
        dtype=args.dtype,
        backends=backends,
        peers=args.peers,
        routing=args.routing,
        zipf_alpha=args.zipf_alpha,
        warmup=args.warmup,
        iters=args.iters,
        routed_only=args.routed_only,
        command=command,
        trace=args.trace,
        compile=args.compile,
        recipes=_names(args.recipe),
        accumulate=1 if args.e2e or args.grad_accum is None else args.grad_accum,
        cuda_graph=args.cuda_graph,
    )


def _names(csv: str | None) -> list[str] | None:
    return [n.strip() for n in csv.split(",") if n.strip()] if csv else None


# flags that choose what to run: none of them goes with --from
_RUN_FLAGS = ("model", "shape", "e2e", "lora", "quant", "trace", "json", "ep", "list_models", "compile", "cuda_graph")


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
    if given("recipe") and args.ep and given("lora"):
        raise ValueError("--recipe: times the layer benchmark, --e2e, --ep or --lora (not with --lora under --ep)")
    if args.ep and given("recipe") and len([r for r in args.recipe.split(",") if r.strip() != "none"]) > 1:
        raise ValueError("--ep --recipe: one recipe (the expert-parallel rows run under one)")
    if given("fp8_dispatch") and not args.ep:
        raise ValueError("--fp8-dispatch: times expert-parallel dispatch (with --ep)")
    if args.framework == "jax" and (args.e2e or given("lora") or given("quant") or args.ep or given("compile")):
        raise ValueError(
            "--framework jax: times the layer benchmark only (not with --e2e, --lora, --quant, --ep or --compile)"
        )
    if given("compile") and (args.e2e or given("lora") or given("quant") or args.ep):
        raise ValueError("--compile: times the layer benchmark only (not with --e2e, --lora, --quant or --ep)")
    if given("cuda_graph") and (args.e2e or given("lora") or given("quant") or args.ep or args.framework == "jax"):
        raise ValueError("--cuda-graph: times the layer benchmark only (not with --e2e, --lora, --quant, --ep or jax)")
    for name in ("tiny", "seq_len", "vocab"):
        if given(name) and not args.e2e:
            raise ValueError(f"--{name.replace('_', '-')}: only with --e2e")
    if given("grad_accum") and (args.ep or given("quant") or args.framework == "jax"):
        raise ValueError("--grad-accum: times --e2e, --lora or the layer benchmark (not with --ep, --quant or jax)")
    if args.ep and given("quant"):
        raise ValueError("--ep: --quant is not available with expert parallelism (--lora R times the LoRA step)")
    if args.plot:
        plot.check_plot_path(args.plot)
        plot._figure_class()  # matplotlib missing: say so before a long run
    if args.trace:
        from .trace import check_trace_dir

        check_trace_dir(args.trace)
