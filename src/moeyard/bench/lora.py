"""``moeyard bench --lora R``: the routed experts' LoRA fine-tuning step, next to the frozen-base step
and to PEFT's default path, on named model shapes.

Every implementation gets the same inputs (``x [T, H]``, a fixed random top-k routing, the same base
weights and adapters) and runs one training step of the routed experts: forward, then backward of a
fixed random output gradient into ``x`` and whatever trains (base weights frozen everywhere):

- ``frozen``: moeyard without adapters: forward + the input gradient only (the floor a LoRA step sits on).
- ``lora``: ``moeyard.experts(..., lora=...)``: the low-rank terms inside the fused GEMMs, factor
  gradients as thin grouped GEMMs; no ``W + dW``, no base weight gradient.
- ``peft+moeyard``: transformers' experts module wrapped by PEFT (``target_parameters``) with
  ``experts_implementation="moeyard"`` and :func:`moeyard.integrations.peft.fuse_lora`.
- ``peft-auto+moeyard``: the same without ``fuse_lora`` (torch's parametrization check still folds
  ``W + dW`` once per step; the step itself runs fused).
- ``peft-fold+moeyard``: PEFT's default math on moeyard's kernels: ``W' = W + s B A`` folded with one
  ``baddbmm`` per projection every step (as PEFT's ``_LoraFactorsProxy``), experts run on ``W'``, the
  full ``[E, out, in]`` weight gradient flows back through the fold.
- ``peft+grouped_mm``: PEFT's default path on transformers' ``grouped_mm`` experts.
- ``frozen+<recipe>``, ``lora+<recipe>`` (with ``--recipe``): the same on an FP8 base (``moeyard.experts(...,
  recipe=)``: the base GEMMs in e4m3, the adapter terms in the compute dtype). The base is frozen, so a
  training loop can keep its FP8 casts for the whole run (:func:`moeyard.cache_fp8_weights`): with
  ``--grad-accum M`` every row's steps run in blocks of ``M`` inside one such block, reported per step.

With ``--quant nf4`` the rows are a stack of ``--layers`` such layers (``x <- x + experts_l(x)``, each
with its own weights and adapters, forward through all then backward), to show what QLoRA saves:

- ``lora``: bf16 expert weights (the stack's bf16 size resident);
- ``qlora``: NF4 weights (:class:`moeyard.quant.NF4Experts`), only the active experts dequantised, in
  forward and again in backward (one layer's dense weights alive at a time);
- ``qlora-whole``: NF4 weights dequantised whole every step and handed over as tensors, so autograd
  keeps every layer's dense weights until backward (bitsandbytes' ``replace_parameter_4bit`` does this).
- ``lora+<recipe>``, ``qlora+<recipe>`` (with ``--recipe``): the ``lora`` and ``qlora`` stacks with the base
  GEMMs under that FP8 recipe (the active experts dequantised to the compute dtype, then cast per step).

Reported: median step ms, TFLOP/s (frozen step ``12*N*H*I`` for gated experts, N = T*k, plus for LoRA
rows ``6*N*r*(in + out)`` per adapted projection: forward, input gradient and the two factor
gradients), and the peak extra GiB of the step (CUDA). Targets of the LoRA design: ``lora`` within
1.15x of ``frozen``, at least 2x faster than the PEFT default paths, and peak memory no more than
``frozen``'s plus the adapters' gradients and 5%.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from ..experts import ExpertLoRA, experts
from . import layer as layer_bench
from .models import ModelShape, get_model, parse_shape, with_tokens
from .trace import file_stem, trace_step

Tensor = torch.Tensor
LORA_MODELS = ("qwen3-30b-a3b", "qwen3.5-35b-a3b", "olmoe-1b-7b", "mixtral-8x7b")
IMPLS = ("frozen", "lora", "peft+moeyard", "peft-auto+moeyard", "peft-fold+moeyard", "peft+grouped_mm")
QUANT_IMPLS = ("lora", "qlora", "qlora-whole")
RECIPE_IMPLS = ("frozen", "lora")  # the rows --recipe adds an FP8-base variant of
RECIPE_QUANT_IMPLS = ("lora", "qlora")  # the same with --quant
TARGETS = ("gate_up_proj", "down_proj")


@dataclass
class Case:
    """One shape's shared inputs: tokens, routing, base weights, PEFT-layout adapters, output grads."""

    name: str
    xs: list[Tensor]
    dys: list[Tensor]
    topk_ids: Tensor
    topk_weights: Tensor
    gate_up_proj: Tensor
    down_proj: Tensor
    lora: dict[str, tuple[Tensor, Tensor]]
    scaling: float

    @property
    def sizes(self) -> tuple[int, int, int, int, int]:
        T, H = self.xs[0].shape
        E, _, I = self.down_proj.shape
        return T, H, I, E, self.topk_ids.shape[1]


def make_case(shape: ModelShape, rank: int, device, dtype) -> Case:
    """Random inputs for a shape (SwiGLU experts; routing: top-k of random logits)."""
    c = shape.moe_config()
    T, H, I, E, K = shape.tokens, c.hidden_size, c.intermediate_size, c.num_experts, c.top_k
    n_sets = max(1, min(4, math.ceil(layer_bench.ROTATE_BYTES / max(1, T * H * dtype.itemsize))))
    kw = dict(device=device, dtype=dtype)
    logits = torch.randn(T, E, device=device)
    weights, ids = torch.softmax(logits, -1).topk(K, dim=-1)
    lora = {
        "gate_up_proj": (torch.randn(rank * E, H, **kw) / H**0.5, torch.randn(2 * I, rank * E, **kw) * 0.01),
        "down_proj": (torch.randn(rank * E, I, **kw) / I**0.5, torch.randn(H, rank * E, **kw) * 0.01),
    }
    return Case(
        name=shape.name,
        xs=[torch.randn(T, H, **kw) for _ in range(n_sets)],
        dys=[torch.randn(T, H, **kw) for _ in range(n_sets)],
        topk_ids=ids,
        topk_weights=(weights / weights.sum(-1, keepdim=True)).to(dtype),
        gate_up_proj=torch.randn(E, 2 * I, H, **kw) / H**0.5,
        down_proj=torch.randn(E, H, I, **kw) / I**0.5,
        lora=lora,
        scaling=2.0,
    )


def step_flops(case: Case, lora: bool) -> int:
    """FLOPs of one step (module docstring)."""
    T, H, I, E, K = case.sizes
    N, r = T * K, case.lora["gate_up_proj"][0].shape[0] // E
    flops = 12 * N * H * I
    if lora:
        flops += 6 * N * r * ((H + 2 * I) + (I + H))
    return flops


# ---------------------------------------------------------------- the implementations


class _Direct(nn.Module):
    """``frozen``, ``lora`` and ``peft-fold+moeyard`` on :func:`moeyard.experts` (the first two also under an FP8
    ``recipe``)."""

    def __init__(self, case: Case, mode: str, recipe: str | None = None):
        super().__init__()
        self.case, self.mode, self.recipe = case, mode, recipe
        self.factors = nn.ParameterDict(
            {f"{n}_{i}": nn.Parameter(t.clone()) for n, (a, b) in case.lora.items() for i, t in (("A", a), ("B", b))}
        )

    def forward(self, x: Tensor) -> Tensor:
        c, f = self.case, self.factors
        w_up, w_down, lora = c.gate_up_proj, c.down_proj, None
        if self.mode == "lora":
            lora = {n: ExpertLoRA(lora_A=f[f"{n}_A"], lora_B=f[f"{n}_B"], scaling=c.scaling) for n in TARGETS}
        elif self.mode == "peft-fold+moeyard":
            w_up, w_down = (
                _fold(w, f[f"{n}_A"], f[f"{n}_B"], c.scaling) for n, w in zip(TARGETS, (w_up, w_down), strict=True)
            )
        return experts(x, c.topk_ids, c.topk_weights, w_up, w_down, lora=lora, recipe=self.recipe)

    def trainable(self) -> list[Tensor]:
        return [] if self.mode == "frozen" else list(self.factors.values())


def _fold(w: Tensor, A: Tensor, B: Tensor, s: float) -> Tensor:
    """PEFT's ``_LoraFactorsProxy``: ``baddbmm(W, B_e, A_e, alpha=s)`` over all experts."""
    E = w.shape[0]
    return torch.baddbmm(w, B.unflatten(1, (-1, E)).permute(2, 0, 1), A.unflatten(0, (E, -1)), alpha=s)


class _Peft(nn.Module):
    """transformers' Qwen3-MoE experts module (the generic SwiGLU ``[E, 2I, H]`` / ``[E, H, I]`` layout)
    wrapped by PEFT with the case's adapters."""

    def __init__(self, case: Case, impl: str):
        super().__init__()
        from peft import LoraConfig, inject_adapter_in_model
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

        T, H, I, E, K = case.sizes
        r = case.lora["gate_up_proj"][0].shape[0] // E
        config = Qwen3MoeConfig(num_experts=E, hidden_size=H, moe_intermediate_size=I, num_experts_per_tok=K)
        config._experts_implementation = "grouped_mm" if impl == "peft+grouped_mm" else "moeyard"
        dev, dtype = case.down_proj.device, case.down_proj.dtype
        with torch.device("meta"):
            experts_module = Qwen3MoeExperts(config)
        experts_module.gate_up_proj = nn.Parameter(case.gate_up_proj, requires_grad=False)
        experts_module.down_proj = nn.Parameter(case.down_proj, requires_grad=False)
        self.experts, self.case = experts_module, case
        inject_adapter_in_model(
            LoraConfig(
                r=r, lora_alpha=case.scaling * r, target_modules=[], target_parameters=[f"experts.{n}" for n in TARGETS]
            ),
            self,
        )
        for m in self.modules():  # PEFT's ParamWrappers (nested: one per targeted parameter)
            if hasattr(m, "parameter_name") and "default" in getattr(m, "lora_A", {}):
                A, B = case.lora[m.parameter_name]
                m.lora_A["default"].weight.data = A.clone().to(dev, dtype)
                m.lora_B["default"].weight.data = B.clone().to(dev, dtype)
        if impl == "peft+moeyard":
            from ..integrations.peft import fuse_lora

            fuse_lora(self)

    def forward(self, x: Tensor) -> Tensor:
        return self.experts(x, self.case.topk_ids, self.case.topk_weights)

    def trainable(self) -> list[Tensor]:
        return [p for p in self.parameters() if p.requires_grad]


class _Stack(nn.Module):
    """``layers`` routed-experts layers with adapters, ``x <- x + experts_l(x)`` (module docstring)."""

    def __init__(self, case: Case, impl: str, layers: int, recipe: str | None = None):
        super().__init__()
        self.case, self.impl, self.recipe = case, impl, recipe
        self.factors = nn.ParameterList()
        self.stack = []
        for layer in range(layers):
            up, down = (
                (case.gate_up_proj, case.down_proj)
                if layer == 0
                else (
                    torch.randn_like(case.gate_up_proj) * case.gate_up_proj.std(),
                    torch.randn_like(case.down_proj) * case.down_proj.std(),
                )
            )
            if impl != "lora":
                up, down = _nf4(up), _nf4(down)
            self.stack.append((up, down))
            self.factors.extend(nn.Parameter(t.clone()) for a, b in case.lora.values() for t in (a, b))

    def forward(self, x: Tensor) -> Tensor:
        c = self.case
        for layer, (up, down) in enumerate(self.stack):
            f = self.factors[4 * layer : 4 * layer + 4]
            lora = {
                n: ExpertLoRA(lora_A=f[2 * i], lora_B=f[2 * i + 1], scaling=c.scaling) for i, n in enumerate(TARGETS)
            }
            if self.impl == "qlora-whole":
                up, down = up.dequantize(), down.dequantize()
            x = x + experts(x, c.topk_ids, c.topk_weights, up, down, lora=lora, recipe=self.recipe)
        return x

    def trainable(self) -> list[Tensor]:
        return list(self.factors)

    def weight_bytes(self) -> int:
        return sum(
            w.numel() * w.element_size() if isinstance(w, Tensor) else w.memory_bytes()
            for pair in self.stack
            for w in pair
        )


def _nf4(w: Tensor):
    """NF4 storage of ``w`` (bitsandbytes quantises on the GPU when it can, else on the CPU)."""
    from ..quant import NF4Experts

    try:
        return NF4Experts.from_float(w)
    except (RuntimeError, NotImplementedError):
        return NF4Experts.from_float(w.cpu()).to(w.device)


def build(impl: str, case: Case, layers: int = 0) -> nn.Module:
    if layers:
        mode, _, recipe = impl.partition("+")
        return _Stack(case, mode, layers, recipe or None)
    if impl.startswith("peft+") or impl == "peft-auto+moeyard":
        return _Peft(case, impl)
    mode, _, recipe = impl.partition("+")
    return _Direct(case, mode, recipe or None) if mode in RECIPE_IMPLS else _Direct(case, impl)


# ---------------------------------------------------------------- the run


def measure(module: nn.Module, case: Case, opts: layer_bench.BenchOptions, trace_stem: str | None = None) -> dict:
    """Median step ms and peak extra GiB (CUDA) of forward + backward; with ``opts.trace``, then one
    profiled step into ``opts.trace/<trace_stem>`` (:mod:`moeyard.bench.trace`)."""
    device, n = torch.device(opts.device), len(case.xs)
    leaves = [x.requires_grad_() for x in case.xs] + module.trainable()

    def clear() -> None:
        for t in leaves:
            t.grad = None

    def step(i: int) -> None:
        clear()
        module(case.xs[i]).backward(case.dys[i])

    step(0)
    clear()
    base = layer_bench.reset_peak(device)
    block = layer_bench.accumulated(step, opts.accumulate, n)
    ms = layer_bench.time_ms(block, n, opts.warmup, opts.iters, device) / opts.accumulate
    peak = None if base is None else (torch.cuda.max_memory_allocated(device) - base) / layer_bench.GIB
    out = {"step_ms": ms, "peak_gib": peak}
    if opts.trace:
        out.update(trace_step(lambda: step(0), opts.trace, trace_stem or "lora", device))
    clear()
    return out


def run(
    opts: layer_bench.BenchOptions,
    rank: int,
    progress: Callable[[str, int, int], None] | None = None,
    *,
    quant: str | None = None,
    layers: int = 4,
) -> dict:
    """Run the LoRA benchmark: ``{"env": {...}, "rows": [...]}`` (ms, TFLOP/s, GiB; ratios to the
    ``frozen`` and ``lora`` rows of the same case). ``quant="nf4"``: the QLoRA rows on a stack of
    ``layers`` layers (module docstring).

    Raises:
        ValueError: a bad option (named), or ``rank < 1``.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"--lora: expected a positive rank, got {rank!r}")
    if quant not in (None, "nf4"):
        raise ValueError(f"--quant: expected 'nf4', got {quant!r}")
    if quant and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 1):
        raise ValueError(f"--layers: expected a positive int, got {layers!r}")
    layers = layers if quant else 0
    # --backends names this benchmark's implementations (checked below), not moeyard backends
    opts = replace(layer_bench.resolve_options(replace(opts, backends=None)), backends=opts.backends)
    shapes = [get_model(n) for n in opts.models] + [parse_shape(s) for s in opts.shapes]
    shapes = shapes or [get_model(n) for n in LORA_MODELS]
    if opts.tokens is not None:
        shapes = [with_tokens(s, opts.tokens) for s in shapes]
    known = QUANT_IMPLS if quant else IMPLS
    impls = list(opts.backends or known)
    for i in impls:
        if i not in known:
            raise ValueError(
                f"--backends: with --lora{' --quant' if quant else ''} expected names from {known}, got {i!r}"
            )
    recipes = [r for r in opts.recipes or [] if r != layer_bench.NO_RECIPE]
    with_recipe = RECIPE_QUANT_IMPLS if quant else RECIPE_IMPLS
    impls += [f"{i}+{r}" for r in recipes for i in impls if i in with_recipe]
    device, dtype = torch.device(opts.device), layer_bench.DTYPES[opts.dtype]
    report = progress or (lambda desc, done, total: None)
    env = {
        **layer_bench.environment(opts),
        "mode": "lora",
        "trace": opts.trace,
        "lora_rank": rank,
        "quant": quant,
        "layers": layers,
        "dense_bf16_tflops": layer_bench.dense_tflops(device, opts.warmup, opts.iters),
    }
    rows, total = [], len(shapes) * len(impls)
    for shape in shapes:
        torch.manual_seed(0)
        case = make_case(shape, rank, device, dtype)
        for impl in impls:
            report(f"{shape.name} · {impl}", len(rows), total)
            rows.append(_row(impl, case, opts, layers))
        _ratios(rows[-len(impls) :])
        del case
        layer_bench.free_memory(opts.device)
    report("done", len(rows), total)
    return {"env": env, "rows": rows}


def _row(impl: str, case: Case, opts: layer_bench.BenchOptions, layers: int) -> dict:
    T, H, I, E, K = case.sizes
    row = {
        "case": case.name,
        "T": T,
        "H": H,
        "I": I,
        "E": E,
        "k": K,
        "impl": impl,
        "flops": step_flops(case, impl != "frozen") * max(layers, 1),
    }
    module = None
    try:
        module = build(impl, case, layers)
        if layers:
            row["weights_gib"] = module.weight_bytes() / layer_bench.GIB
        row.update(
            measure(module, case, opts, trace_stem=file_stem(layer_bench.case_name(case.name, case.sizes), impl))
        )
        row["tflops"] = row["flops"] / row["step_ms"] / 1e9
    except Exception as ex:  # a failing implementation is a row, not a crash
        row["error"] = f"{type(ex).__name__}: {(str(ex).strip().splitlines() or [''])[0][:300]}"
    finally:
        del module
        layer_bench.free_memory(opts.device)
    return row


def _ratios(rows: list[dict]) -> None:
    """``x_frozen`` (step time over the frozen step's) and ``lora_speedup`` (this step over ``lora``'s)."""
    by = {r["impl"]: r for r in rows if "error" not in r}
    for r in by.values():
        if "frozen" in by:
            r["x_frozen"] = r["step_ms"] / by["frozen"]["step_ms"]
        if "lora" in by:
            r["lora_speedup"] = r["step_ms"] / by["lora"]["step_ms"]
