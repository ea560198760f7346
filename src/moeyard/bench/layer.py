"""The layer benchmark: the full MoE layer, per backend and per peer, on named model shapes.

For each case (a :class:`moeyard.bench.models.ModelShape`) and each implementation (a moeyard backend, run
as ``moeyard.MoE(config, backend=name)``, or a peer from :mod:`moeyard.bench.peers`) it times

- ``fwd``: a training forward (autograd on: input and weights require grad), and
- ``fwd+bwd``: forward plus backward w.r.t. the input and all weights (gradients set to None before
  each step, as ``zero_grad`` does),

and reports the median time (ms), TFLOP/s from :func:`layer_flops`, and the peak extra memory of
fwd+bwd (GiB: ``torch.cuda.max_memory_allocated`` minus what was allocated before; it includes saved
activations and the gradients). On CUDA: CUDA events after warm-up, one sync after the timed loop, and
the dense bf16 matmul rate (8192^3, random) of the same run. On CPU: ``time.perf_counter``.

Inputs are fresh ``randn`` (never zeros), rotated over several sets when one set is small enough to
stay in cache. Every implementation of a case sees the same inputs and the same router weight.

Routing (``routing=``): ``random`` keeps the random router (weight std 0.02: near-uniform load).
``balanced`` and ``zipf`` force the choice through the router weights: the router weight becomes
``[I_E | 0]`` (identity on the first E input features, zero elsewhere), so the logits are the first E
features of x, which are set to a routing code: ``zipf`` draws each token's K experts without
replacement from ``p_e ~ (e + 1) ** -alpha`` (Gumbel top-k: code = log p + Gumbel noise; expert 0 is the
hottest); ``balanced`` gives every expert exactly ``T*K/E`` pairs (when divisible). The other features
stay ``randn``. Exact for any router that picks the top-k of a monotonic function of the logits
(softmax, sigmoid, top-k-then-score); grouped top-k (``n_group > 1``) also restricts the choice to the
best groups, so its skew is approximate. Needs ``hidden_size >= num_experts``.
"""

from __future__ import annotations

import gc
import math
import platform
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata

import torch
import torch.nn as nn

from ..activations import GATED
from ..config import MoEConfig
from ..experts import available_backends, backend_names
from ..layer import MoE
from ..quant.recipe import recipe_names
from ..routing import route, router_impl
from .models import ANCHOR_MODELS, ModelShape, get_model, parse_shape, routed_only, with_tokens
from .peers import PEERS, peer_config, peer_note, peer_status
from .trace import check_trace_dir, file_stem, trace_step

Tensor = torch.Tensor
GIB = 2**30
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
ROUTINGS = ("random", "balanced", "zipf")
CPU_DEFAULT_SHAPE = "512,256,128,8,2"  # T, H, I, E, k
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")  # torch.compile's modes
ROTATE_BYTES = 128 * 2**20  # rotate input sets until they span this much (beyond any GPU L2)
DENSE_N = 8192
NO_RECIPE = "none"


# ---------------------------------------------------------------- FLOPs


def layer_flops(config: MoEConfig, tokens: int, *, shared: bool = True) -> int:
    """Forward FLOPs of the layer's experts (SonicMoE's convention): ``6*T*K*H*I`` for gated experts,
    ``4*T*K*H*I`` for plain ones, plus the shared experts counted the same way (``T`` rows of
    ``num_shared_experts * shared_intermediate_size``) when ``shared``. The router is not counted;
    backward is ``2x`` forward, so fwd+bwd is ``3x`` this."""
    per = 6 if config.activation in GATED else 4
    H = config.hidden_size
    flops = per * tokens * config.top_k * H * config.intermediate_size
    if shared and config.num_shared_experts:
        shared_i = (config.shared_intermediate_size or config.intermediate_size) * config.num_shared_experts
        flops += per * tokens * H * shared_i
    return flops


# ---------------------------------------------------------------- options and cases


@dataclass(kw_only=True)
class BenchOptions:
    """What to run. ``None`` fields take device defaults (see :func:`resolve_options`)."""

    models: list[str] = field(default_factory=list)
    shapes: list[str] = field(default_factory=list)
    tokens: int | None = None
    device: str | None = None
    dtype: str | None = None
    backends: list[str] | None = None
    peers: bool = True
    routing: str = "random"
    zipf_alpha: float = 1.2
    warmup: int | None = None
    iters: int | None = None
    routed_only: bool = False
    command: str = ""
    trace: str | None = None
    compile: str | None = None  # a torch.compile mode (COMPILE_MODES) for moeyard's rows; peers run eager
    recipes: list[str] | None = None  # FP8 recipes (names, "none" for the compute dtype) for moeyard's rows
    # steps per gradient-accumulation block: each timed unit is this many steps inside one
    # moeyard.cache_fp8_weights() block (FP8 weights cast once per block), reported per step
    accumulate: int = 1
    # capture each moeyard row's forward and forward + backward in a CUDA graph and time the replays
    cuda_graph: bool = False


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_options(opts: BenchOptions) -> BenchOptions:
    """Fill device defaults and check every option (ValueError naming the option)."""
    device = opts.device or default_device()
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device: {device!r} requested but CUDA is not available")
    cuda = device.startswith("cuda")
    dtype = opts.dtype or ("bfloat16" if cuda else "float32")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype: expected one of {list(DTYPES)}, got {dtype!r}")
    if opts.routing not in ROUTINGS:
        raise ValueError(f"--routing: expected one of {ROUTINGS}, got {opts.routing!r}")
    if not opts.zipf_alpha > 0:
        raise ValueError(f"--zipf-alpha: expected a positive number, got {opts.zipf_alpha!r}")
    warmup = opts.warmup if opts.warmup is not None else (5 if cuda else 2)
    iters = opts.iters if opts.iters is not None else (20 if cuda else 10)
    if warmup < 0 or iters < 1:
        raise ValueError(f"--warmup/--iters: expected warmup >= 0 and iters >= 1, got {warmup}, {iters}")
    if not (isinstance(opts.accumulate, int) and opts.accumulate >= 1):
        raise ValueError(f"--grad-accum: expected a positive integer, got {opts.accumulate!r}")
    if opts.cuda_graph and (not cuda or opts.accumulate > 1 or opts.compile or opts.trace):
        raise ValueError(
            f"--cuda-graph: needs a CUDA device and goes without --grad-accum, --compile and --trace (device "
            f"{device!r}, grad-accum {opts.accumulate}, compile {opts.compile!r}, trace {opts.trace!r})"
        )
    check_trace_dir(opts.trace)
    if opts.compile is not None and opts.compile not in COMPILE_MODES:
        raise ValueError(f"--compile: expected one of {COMPILE_MODES}, got {opts.compile!r}")
    for name in opts.backends or []:
        if name not in backend_names() and name not in PEERS:
            raise ValueError(f"--backends: unknown name {name!r}; backends: {backend_names()}, peers: {list(PEERS)}")
    for name in opts.recipes or []:
        if name != NO_RECIPE and name not in recipe_names():
            raise ValueError(f"--recipe: expected names among {[NO_RECIPE] + recipe_names()}, got {name!r}")
    return BenchOptions(**{**opts.__dict__, "device": device, "dtype": dtype, "warmup": warmup, "iters": iters})


def cases(opts: BenchOptions) -> list[ModelShape]:
    """The shapes to run: ``--model`` entries then ``--shape`` ones; by default the ANCHORS.md set on
    CUDA and a small shape on CPU. ``--tokens`` overrides every token count."""
    chosen = [get_model(n) for n in opts.models] + [parse_shape(s) for s in opts.shapes]
    if not chosen:
        cuda = str(opts.device).startswith("cuda")
        chosen = [get_model(n) for n in ANCHOR_MODELS] if cuda else [parse_shape(CPU_DEFAULT_SHAPE)]
    if opts.tokens is not None:
        chosen = [with_tokens(c, opts.tokens) for c in chosen]
    return chosen


def implementations(opts: BenchOptions) -> tuple[list[str], dict[str, str]]:
    """(names to run, {skipped peer: reason}). Backends: ``--backends`` or all that run here, each once
    per ``--recipe`` (named ``backend+recipe``; ``none``: the plain backend); peers: those that run here
    (when ``--peers``), plus any named in ``--backends``."""
    device, dtype = torch.device(opts.device), DTYPES[opts.dtype]
    names = list(opts.backends) if opts.backends else available_backends(device, dtype)
    recipes = opts.recipes or [NO_RECIPE]
    names = [
        n if n in PEERS or r == NO_RECIPE else f"{n}+{r}"
        for n in names
        for r in recipes
        if r == NO_RECIPE or n not in PEERS
    ]
    skipped = {}
    if opts.peers:
        for name, reason in peer_status(device, dtype).items():
            if reason is None and name not in names:
                names.append(name)
            elif reason is not None:
                skipped[name] = reason
    return names, skipped


# ---------------------------------------------------------------- inputs and routing


@dataclass
class Inputs:
    """One case's inputs: ``xs`` and ``dys`` (``[T, H]`` each, rotated), the router weight ``[E, H]``."""

    xs: list[Tensor]
    dys: list[Tensor]
    router_weight: Tensor


def routing_code(kind: str, tokens: int, config: MoEConfig, alpha: float, device) -> Tensor | None:
    """``[T, E]`` float32 logits that force the routing (module docstring); None for ``random``."""
    T, E, K = tokens, config.num_experts, config.top_k
    if kind == "random":
        return None
    if kind == "zipf":
        log_p = -alpha * torch.log(torch.arange(1, E + 1, device=device, dtype=torch.float32))
        u = torch.rand(T, E, device=device).clamp_(1e-20, 1 - 1e-7)
        return log_p - torch.log(-torch.log(u))
    slot = torch.randperm(T, device=device).unsqueeze(1) * K + torch.arange(K, device=device)  # [T, K]
    code = torch.randn(T, E, device=device) * 0.1
    return code.scatter_(1, slot % E, 8.0)


def make_inputs(shape: ModelShape, opts: BenchOptions) -> Inputs:
    """Fresh random inputs and the router weight for ``shape`` (module docstring)."""
    config, T = shape.moe_config(), shape.tokens
    device, dtype = torch.device(opts.device), DTYPES[opts.dtype]
    E, H = config.num_experts, config.hidden_size
    if opts.routing != "random" and H < E:
        raise ValueError(f"--routing: {opts.routing} needs hidden_size >= num_experts, got H={H}, E={E}")
    n_sets = max(1, min(4, math.ceil(ROTATE_BYTES / max(1, T * H * dtype.itemsize))))
    xs, dys = [], []
    for _ in range(n_sets):
        x = torch.randn(T, H, device=device, dtype=torch.float32)
        code = routing_code(opts.routing, T, config, opts.zipf_alpha, device)
        if code is not None:
            x[:, :E] = code
        xs.append(x.to(dtype).requires_grad_())
        dys.append(torch.randn(T, H, device=device, dtype=dtype))
    if opts.routing == "random":
        weight = torch.randn(E, H, device=device, dtype=dtype) * 0.02
    else:
        weight = torch.zeros(E, H, device=device, dtype=dtype)
        weight[:, :E] = torch.eye(E, device=device, dtype=dtype)
    return Inputs(xs=xs, dys=dys, router_weight=weight)


def tokens_per_expert(config: MoEConfig, inputs: Inputs) -> Tensor:
    """``[E]`` routed pairs per expert for the first input set under ``config``'s router."""
    with torch.no_grad():
        return route(inputs.xs[0], inputs.router_weight, config).tokens_per_expert


# ---------------------------------------------------------------- timing


def time_ms(step: Callable[[int], None], n_sets: int, warmup: int, iters: int, device: torch.device) -> float:
    """Median milliseconds of ``step(i)`` (i = input set) over ``iters`` runs after ``warmup`` runs."""
    for i in range(warmup):
        step(i % n_sets)
    if device.type != "cuda":
        times = []
        for i in range(iters):
            t0 = time.perf_counter()
            step(i % n_sets)
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize(device)
    events = []
    for i in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(i % n_sets)
        end.record()
        events.append((start, end))
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in events)


def dense_tflops(device: torch.device, warmup: int, iters: int) -> float | None:
    """Dense bf16 matmul rate (8192^3, random inputs) in TFLOP/s on CUDA; None elsewhere."""
    if device.type != "cuda":
        return None
    a = torch.randn(DENSE_N, DENSE_N, device=device, dtype=torch.bfloat16)
    b = torch.randn(DENSE_N, DENSE_N, device=device, dtype=torch.bfloat16)
    ms = time_ms(lambda i: a @ b, 1, warmup, iters, device)
    return 2 * DENSE_N**3 / ms / 1e9


def dense_fp8_tflops(device: torch.device, warmup: int, iters: int) -> float | None:
    """Dense e4m3 matmul rate (8192^3, random inputs, rowwise float32 scales, bf16 out, fast accumulation:
    ``torch._scaled_mm``) in TFLOP/s on a CUDA GPU with FP8 tensor cores; None elsewhere or on failure."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return None
    try:
        a = torch.randn(DENSE_N, DENSE_N, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(DENSE_N, DENSE_N, device=device).to(torch.float8_e4m3fn).t()  # column-major
        sa = torch.ones(DENSE_N, 1, device=device)
        sb = torch.ones(1, DENSE_N, device=device)
        ms = time_ms(
            lambda i: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True),
            1,
            warmup,
            iters,
            device,
        )
    except (RuntimeError, AttributeError):
        return None
    return 2 * DENSE_N**3 / ms / 1e9


# ---------------------------------------------------------------- one implementation on one case


def build(name: str, config: MoEConfig, device, dtype) -> nn.Module:
    """A moeyard ``MoE`` with backend ``name`` (``backend+recipe``: under that FP8 recipe), or the peer ``name``."""
    if name in PEERS:
        return PEERS[name].build(peer_config(config), device=device, dtype=dtype)
    backend, _, recipe = name.partition("+")
    return MoE(config, backend=backend, recipe=recipe or None, device=device, dtype=dtype)


def measure(module: nn.Module, inputs: Inputs, opts: BenchOptions, trace_stem: str | None = None) -> dict:
    """fwd / fwd+bwd milliseconds and peak extra GiB (CUDA) of ``module`` on ``inputs``; with
    ``opts.trace``, then one profiled fwd+bwd into ``opts.trace/<trace_stem>`` (:mod:`moeyard.bench.trace`);
    with ``opts.cuda_graph``, the replays of each captured in a CUDA graph (:func:`graphed`; the peak then
    counts the graph's memory pool)."""
    device, n = torch.device(opts.device), len(inputs.xs)
    params = [p for p in module.parameters() if p.requires_grad]
    with torch.no_grad():
        module.router.weight.copy_(inputs.router_weight)
    out = module(inputs.xs[0])
    if out.shape != inputs.xs[0].shape or not bool(torch.isfinite(out).all()):
        raise RuntimeError(f"bad output: shape {tuple(out.shape)}, finite={bool(torch.isfinite(out).all())}")
    del out

    def clear():
        for t in params + inputs.xs:
            t.grad = None

    # torch.compile's CUDA graphs: each step a new iteration, also a forward whose backward never runs
    step_begin = torch.compiler.cudagraph_mark_step_begin if opts.compile == "reduce-overhead" else lambda: None

    def fwd(i):
        step_begin()
        return module(inputs.xs[i])

    def fwd_bwd(i):
        clear()
        fwd(i).backward(inputs.dys[i])

    if opts.cuda_graph:
        drop = lambda: _drop_step_state(module)  # noqa: E731
        fwd_ms = time_ms(graphed(lambda: fwd(0), device, after=drop), 1, opts.warmup, opts.iters, device)
        clear()
        base = reset_peak(device)
        fwdbwd_ms = time_ms(graphed(lambda: fwd_bwd(0), device, after=drop), 1, opts.warmup, opts.iters, device)
        peak = (torch.cuda.max_memory_allocated(device) - base) / GIB
        clear()
        return {"fwd_ms": fwd_ms, "fwdbwd_ms": fwdbwd_ms, "peak_gib": peak}
    fwd_ms = time_ms(accumulated(fwd, opts.accumulate, n), n, opts.warmup, opts.iters, device) / opts.accumulate
    clear()
    base = reset_peak(device)
    fwdbwd_ms = time_ms(accumulated(fwd_bwd, opts.accumulate, n), n, opts.warmup, opts.iters, device)
    fwdbwd_ms /= opts.accumulate
    peak = None if base is None else (torch.cuda.max_memory_allocated(device) - base) / GIB
    out = {"fwd_ms": fwd_ms, "fwdbwd_ms": fwdbwd_ms, "peak_gib": peak}
    if opts.trace:
        out.update(trace_step(lambda: fwd_bwd(0), opts.trace, trace_stem or "layer", device))
    clear()
    return out


def graphed(
    step: Callable[[], object], device: torch.device, warmup: int = 3, after: Callable[[], None] = lambda: None
) -> Callable[[int], None]:
    """``step`` captured once in a CUDA graph (``torch.cuda.graph``, after ``warmup`` eager runs on a side
    stream, as capture asks: autotuning and lazy allocations happen there) -> ``i -> replay``: each replay
    reruns the captured kernels on the captured inputs (the first input set), without the host's launch
    work, which :func:`time_ms` then leaves out of the time. ``after`` runs after each eager run and after
    the capture, outside it (e.g. dropping what a layer keeps of its last step, so that no tensor made
    outside the capture is freed inside it). Raises what capture raises for a step that cannot be captured
    (a host sync, a CPU tensor)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
            after()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    after()
    return lambda i: graph.replay()


def _drop_step_state(module: nn.Module) -> None:
    """Let go of what a moeyard ``MoE`` keeps of its last step (``aux_loss``, ``routing``), as
    :func:`graphed` needs between runs; nothing for other modules."""
    for m in module.modules():
        if isinstance(m, MoE):
            m.aux_loss = m.routing = None


def accumulated(step: Callable[[int], object], m: int, n_sets: int) -> Callable[[int], None]:
    """``step`` itself for ``m == 1``; else a block of ``m`` steps (input sets ``i m ... i m + m - 1``, modulo
    ``n_sets``) inside one :func:`moeyard.cache_fp8_weights` block, as gradient accumulation over ``m``
    micro-batches runs them: each FP8 weight cast once per block (the time of a block is ``m`` steps')."""
    if m == 1:
        return step

    def block(i: int) -> None:
        from ..quant.weight_cache import cache_fp8_weights

        with cache_fp8_weights():
            for j in range(m):
                step((i * m + j) % n_sets)

    return block


def reset_peak(device: torch.device) -> int | None:
    """On CUDA: synchronise ``device``, reset its peak-memory statistics and return the bytes allocated
    now (the base a peak is measured from); None elsewhere."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def run_one(name: str, shape: ModelShape, config: MoEConfig, inputs: Inputs, opts: BenchOptions) -> dict:
    """One row: times, TFLOP/s, memory, or the error (never raises for a failing implementation)."""
    is_peer = name in PEERS
    flops = layer_flops(peer_config(config) if is_peer else config, shape.tokens)
    row = {
        "case": shape.name,
        "T": shape.tokens,
        "H": config.hidden_size,
        "I": config.intermediate_size,
        "E": config.num_experts,
        "k": config.top_k,
        "impl": name,
        "kind": "peer" if is_peer else "moeyard",
        "flops_fwd": flops,
        "note": peer_note(config) if is_peer else "",
    }
    module = None
    try:
        torch.manual_seed(0)
        module = build(name, config, torch.device(opts.device), DTYPES[opts.dtype])
        if opts.compile and not is_peer:  # compiled at the first call, before the warm-up (not timed)
            module = torch.compile(module, mode=None if opts.compile == "default" else opts.compile)
            row["note"] = f"torch.compile ({opts.compile})"
        row.update(
            measure(
                module,
                inputs,
                opts,
                trace_stem=file_stem(case_name(shape.name, (row["T"], row["H"], row["I"], row["E"], row["k"])), name),
            )
        )
        row["fwd_tflops"] = flops / row["fwd_ms"] / 1e9
        row["fwdbwd_tflops"] = 3 * flops / row["fwdbwd_ms"] / 1e9
    except Exception as ex:  # a failing implementation is a row, not a crash
        row["error"] = f"{type(ex).__name__}: {(str(ex).strip().splitlines() or [''])[0][:300]}"
        row["detail"] = traceback.format_exc()[-1500:]
    finally:
        del module
        free_memory(opts.device)
    return row


def case_name(name: str, sizes: tuple[int, ...]) -> str:
    """A case's name, with its sizes for a custom ``--shape`` (``custom-TxHxIxExk``): ``--trace`` file names."""
    return name if name != "custom" else "custom-" + "x".join(str(v) for v in sizes)


def free_memory(device: str) -> None:
    """Collect garbage and, on CUDA, empty the caching allocator (between rows, so one row's memory is
    not counted in the next)."""
    gc.collect()
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- the run


def versions() -> dict[str, str]:
    """Versions of moeyard, torch, triton, transformers ("not installed" when absent) and Python."""
    from .. import __version__

    out = {"moeyard": __version__, "torch": torch.__version__}
    for pkg in ("triton", "transformers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    out["python"] = platform.python_version()
    return out


def device_info(device: str | torch.device) -> dict:
    """``{"device": name, "capability": "9.0" | None}`` for a CUDA device, or the CPU's description."""
    device = torch.device(device)
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        return {"device": torch.cuda.get_device_name(device), "capability": f"{cap[0]}.{cap[1]}"}
    cpu = platform.processor() or platform.machine()
    return {"device": f"CPU {cpu} ({torch.get_num_threads()} threads)", "capability": None}


def environment(opts: BenchOptions) -> dict:
    """Everything a results table needs: versions, device, date (UTC), command line, settings."""
    return {
        **versions(),
        **device_info(opts.device),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": opts.command,
        "dtype": opts.dtype,
        "routing": opts.routing,
        "zipf_alpha": opts.zipf_alpha if opts.routing == "zipf" else None,
        "warmup": opts.warmup,
        "iters": opts.iters,
        "routed_only": opts.routed_only,
        "router": router_impl(),
        "compile": opts.compile,
        "cuda_graph": opts.cuda_graph,
        "platform": platform.platform(),
    }


def run(opts: BenchOptions, progress: Callable[[str, int, int], None] | None = None) -> dict:
    """Run the benchmark; returns ``{"env": {...}, "rows": [...]}`` (units: ms, TFLOP/s, GiB).

    Args:
        opts: what to run (:class:`BenchOptions`).
        progress: optional ``progress(description, done, total)``, called before and after each row.
    Raises:
        ValueError: a bad option (named); failing implementations are rows with an ``error``.
    """
    opts = resolve_options(opts)
    shapes = cases(opts)
    names, skipped = implementations(opts)
    total, rows = len(shapes) * len(names), []
    report = progress or (lambda desc, done, total: None)
    env = {**environment(opts), "mode": "layer", "skipped": skipped, "trace": opts.trace}
    report("dense bf16 matmul", 0, total)
    env["dense_bf16_tflops"] = dense_tflops(torch.device(opts.device), opts.warmup, opts.iters)
    if opts.recipes and any(r != NO_RECIPE for r in opts.recipes):
        env["dense_fp8_tflops"] = dense_fp8_tflops(torch.device(opts.device), opts.warmup, opts.iters)
    env["recipes"] = opts.recipes
    env["accumulate"] = opts.accumulate
    free_memory(opts.device)
    for shape in shapes:
        done = len(rows)
        rows += run_case(shape, names, opts, lambda desc, n, done=done: report(desc, done + n, total))
    return {"env": env, "rows": rows}


def run_case(shape: ModelShape, names: list[str], opts: BenchOptions, report) -> list[dict]:
    """Rows of every implementation on one shape (an input error becomes one error row per name)."""
    config = shape.moe_config()
    if opts.routed_only:
        config = routed_only(config)
    torch.manual_seed(0)
    try:
        inputs = make_inputs(shape, opts)
        load = tokens_per_expert(config, inputs)
    except Exception as ex:  # e.g. OOM for the inputs, or a routing the shape cannot take
        return [{"case": shape.name, "impl": n, "error": f"{type(ex).__name__}: {ex}"} for n in names]
    balance = {"load_max_over_mean": float(load.max() / load.mean().clamp(min=1e-9))}
    rows = []
    for name in names:
        report(f"{shape.name} · {name}", len(rows))
        rows.append({**run_one(name, shape, config, inputs, opts), **balance})
    report(shape.name, len(rows))
    del inputs
    free_memory(opts.device)
    return rows
