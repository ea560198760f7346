"""``moeyard bench --e2e``: one training step of a transformers decoder stack, per experts implementation.

For each ``--model`` (a moeyard model shape mapped to a transformers config in :data:`E2E_MODELS`)
a causal LM of ``layers`` decoder layers is built with random weights (``from_config``: attention,
norms, router and experts at the model's real sizes; every layer an MoE layer), in bfloat16 on CUDA
(float32 on CPU), once per experts implementation (same seed, so the same weights):

- ``moeyard``: transformers' ``experts_implementation="moeyard"`` (:mod:`moeyard.integrations.transformers`)
  on moeyard's default backend (``moeyard.get_backend()``, ``auto`` unless set); ``moeyard:<backend>``
  pins a backend;
- ``grouped_mm``: transformers' own ``torch._grouped_mm`` experts (the baseline of ``x vs grouped_mm``);
- ``sonicmoe``: transformers' SonicMoE experts, when its registry has them and they load here
  (otherwise listed as skipped with the reason); any other name of transformers' experts registry
  (``eager``, ``batched_mm``, ...) can be named in ``--backends``.

One step = forward on ``batch x seq`` random token ids, cross-entropy on random labels (transformers'
causal-LM loss), backward, ``AdamW`` step (fused on CUDA, foreach on CPU; pure bf16: no fp32 master
weights), ``zero_grad(set_to_none=True)``. Reported: median step ms after warm-up (CUDA events;
``time.perf_counter`` on CPU), tokens/s = ``batch * seq / step``, the peak memory of the timed steps
(CUDA: ``torch.cuda.max_memory_allocated``, weights + gradients + AdamW states + activations, GiB) and
``x vs grouped_mm`` = grouped_mm's step ms / this step ms (> 1: faster).

Memory at real sizes: the vocabulary is reduced (default :data:`DEFAULT_VOCAB`; the real one is in
the table) because the loss upcasts the ``[tokens, vocab]`` logits to float32 (151,936 x 32,768 tokens
would be ~20 GB, twice with its gradient), and a step is :data:`DEFAULT_TOKENS` tokens (4 x 2048) by
default. Models whose layers are too large for the device's memory with AdamW get fewer default
layers (:attr:`E2EModel.layers`) and an error row, not a crash, when ``--layers`` asks for more.

``tiny=True`` (``--tiny``) builds the tiny configuration :mod:`moeyard.verify` uses for the same
architecture (hidden 64, 8 experts) instead: a quick check on a CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from . import layer as layer_bench
from .models import get_model

DEFAULT_TOKENS = 8192
DEFAULT_SEQ = 2048
DEFAULT_VOCAB = 32768
TINY_TOKENS = 64
TINY_SEQ = 32
BASELINE = "grouped_mm"
DEFAULT_IMPLS = ("moeyard", BASELINE)
PEER_IMPLS = ("sonicmoe",)
CUDA_DEFAULTS = dict(warmup=3, iters=10)
CPU_DEFAULTS = dict(warmup=1, iters=3)
MEMORY_HEADROOM = 0.9  # weights + grads + AdamW states above this share of the device: an error row


@dataclass(frozen=True, kw_only=True)
class E2EModel:
    """A moeyard model shape as a transformers config.

    Attributes:
        name: the :mod:`moeyard.bench.models` name (``--model``).
        arch: the :data:`moeyard.verify.ARCHS` key (its ``model_type`` and tiny configuration).
        config: transformers config fields at the model's real sizes (attention and experts); every
            other field keeps the config class's default.
        vocab: the real vocabulary size (the step uses a reduced one).
        layers: default ``--layers``.
        source: where the numbers come from.
    """

    name: str
    arch: str
    config: dict = field(repr=False)
    vocab: int
    layers: int = 4
    source: str = ""


_QWEN3_NEXT_ATTN = dict(
    hidden_size=2048,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
)
_GPT_OSS = dict(
    hidden_size=2880,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    intermediate_size=2880,
    num_experts_per_tok=4,
    sliding_window=128,
)

E2E_MODELS: dict[str, E2EModel] = {
    m.name: m
    for m in [
        E2EModel(
            name="qwen3-30b-a3b",
            arch="qwen3_moe",
            vocab=151936,
            config=dict(
                hidden_size=2048,
                num_attention_heads=32,
                num_key_value_heads=4,
                head_dim=128,
                num_experts=128,
                moe_intermediate_size=768,
                num_experts_per_tok=8,
                norm_topk_prob=True,
            ),
            source="Qwen/Qwen3-30B-A3B config.json",
        ),
        E2EModel(
            name="qwen3-235b-a22b",
            arch="qwen3_moe",
            vocab=151936,
            layers=2,
            config=dict(
                hidden_size=4096,
                num_attention_heads=64,
                num_key_value_heads=4,
                head_dim=128,
                num_experts=128,
                moe_intermediate_size=1536,
                num_experts_per_tok=8,
                norm_topk_prob=True,
            ),
            source="Qwen/Qwen3-235B-A22B config.json",
        ),
        E2EModel(
            name="qwen3.5-35b-a3b",
            arch="qwen3_5_moe",
            vocab=248320,
            config=dict(
                **_QWEN3_NEXT_ATTN,
                num_experts=256,
                moe_intermediate_size=512,
                num_experts_per_tok=8,
                shared_expert_intermediate_size=512,
            ),
            source="Qwen/Qwen3.5-35B-A3B config.json (text model; 3 Gated DeltaNet + 1 gated attention per 4 layers)",
        ),
        E2EModel(
            name="qwen3-next-80b-a3b",
            arch="qwen3_next",
            vocab=151936,
            config=dict(
                **_QWEN3_NEXT_ATTN,
                num_experts=512,
                moe_intermediate_size=512,
                num_experts_per_tok=10,
                shared_expert_intermediate_size=512,
                norm_topk_prob=True,
            ),
            source="Qwen/Qwen3-Next-80B-A3B-Instruct config.json (3 Gated DeltaNet + 1 gated attention per 4 layers)",
        ),
        E2EModel(
            name="olmoe-1b-7b",
            arch="olmoe",
            vocab=50304,
            config=dict(
                hidden_size=2048,
                num_attention_heads=16,
                num_key_value_heads=16,
                num_experts=64,
                intermediate_size=1024,
                num_experts_per_tok=8,
                norm_topk_prob=False,
            ),
            source="allenai/OLMoE-1B-7B-0924 config.json",
        ),
        E2EModel(
            name="mixtral-8x7b",
            arch="mixtral",
            vocab=32000,
            layers=2,
            config=dict(
                hidden_size=4096,
                num_attention_heads=32,
                num_key_value_heads=8,
                head_dim=128,
                num_local_experts=8,
                intermediate_size=14336,
                num_experts_per_tok=2,
            ),
            source="mistralai/Mixtral-8x7B-v0.1 config.json (2 layers by default: 1.4 B parameters each)",
        ),
        E2EModel(
            name="gpt-oss-20b",
            arch="gpt_oss",
            vocab=201088,
            config=dict(**_GPT_OSS, num_local_experts=32),
            source="openai/gpt-oss-20b config.json (sliding / full attention alternate, attention sinks)",
        ),
        E2EModel(
            name="gpt-oss-120b",
            arch="gpt_oss",
            vocab=201088,
            layers=2,
            config=dict(**_GPT_OSS, num_local_experts=128),
            source="openai/gpt-oss-120b config.json",
        ),
        E2EModel(
            name="deepseek-v3",
            arch="deepseek_v3",
            vocab=129280,
            layers=1,
            config=dict(
                hidden_size=7168,
                num_attention_heads=128,
                num_key_value_heads=128,
                q_lora_rank=1536,
                kv_lora_rank=512,
                qk_rope_head_dim=64,
                qk_nope_head_dim=128,
                v_head_dim=128,
                n_routed_experts=256,
                moe_intermediate_size=2048,
                n_shared_experts=1,
                num_experts_per_tok=8,
                n_group=8,
                topk_group=4,
                routed_scaling_factor=2.5,
                norm_topk_prob=True,
                first_k_dense_replace=0,
            ),
            source="deepseek-ai/DeepSeek-V3 config.json (MLA; every layer MoE: first_k_dense_replace 0; one "
            "layer with the reduced vocabulary is 12.0 B parameters, ~90 GiB with gradients and AdamW "
            "states: needs an H200)",
        ),
    ]
}


def get_e2e_model(name: str) -> E2EModel:
    """The :data:`E2E_MODELS` entry of a moeyard model name.

    Raises:
        ValueError: an unknown model name (as :func:`moeyard.bench.models.get_model`), or one with no
            transformers config mapped (the message lists the mapped ones).
    """
    get_model(name)
    if name not in E2E_MODELS:
        raise ValueError(f"--e2e: no transformers config mapped for model {name!r}; mapped: {', '.join(E2E_MODELS)}")
    return E2E_MODELS[name]


# ---------------------------------------------------------------- the step's sizes and config


@dataclass(frozen=True, kw_only=True)
class StepSize:
    """Sizes of one step: ``layers`` decoder layers, ``accumulate`` micro-batches of ``batch x seq`` tokens
    each (gradient accumulation: one optimizer step), ``vocab`` ids; ``tiny``: :mod:`moeyard.verify`'s tiny
    configuration."""

    layers: int
    batch: int
    seq: int
    vocab: int
    tiny: bool = False
    accumulate: int = 1

    @property
    def tokens(self) -> int:
        """Tokens per optimizer step."""
        return self.batch * self.seq * self.accumulate


def step_size(
    model: E2EModel,
    *,
    tokens: int | None,
    seq_len: int | None,
    vocab: int | None,
    layers: int | None,
    tiny: bool,
    accumulate: int = 1,
) -> StepSize:
    """Defaults filled in (module docstring) and checked.

    Raises:
        ValueError: a non-positive value, or ``tokens`` not a multiple of ``seq_len`` (named by flag).
    """
    tokens = tokens if tokens is not None else (TINY_TOKENS if tiny else DEFAULT_TOKENS)
    seq = seq_len if seq_len is not None else min(tokens, TINY_SEQ if tiny else DEFAULT_SEQ)
    vocab = vocab if vocab is not None else (_verify().COMMON["vocab_size"] if tiny else DEFAULT_VOCAB)
    layers = layers if layers is not None else (2 if tiny else model.layers)
    for flag, v in (
        ("--tokens", tokens),
        ("--seq-len", seq),
        ("--vocab", vocab),
        ("--layers", layers),
        ("--grad-accum", accumulate),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{flag}: expected a positive integer, got {v!r}")
    if tokens % seq:
        raise ValueError(f"--tokens: expected a multiple of --seq-len {seq} (tokens = batch x seq), got {tokens}")
    return StepSize(layers=layers, batch=tokens // seq, seq=seq, vocab=vocab, tiny=tiny, accumulate=accumulate)


def hf_config(model: E2EModel, size: StepSize):
    """The transformers config of ``model`` at ``size`` (real or tiny sizes, every layer MoE).

    Raises:
        ValueError: the installed transformers has no such model type.
    """
    from transformers import AutoConfig

    verify = _verify()
    arch = verify.ARCHS[model.arch]
    if size.tiny:
        fields = {**verify.COMMON, **arch.overrides, "max_position_embeddings": max(size.seq, 64)}
    else:
        fields = {
            **model.config,
            "tie_word_embeddings": False,
            "pad_token_id": None,
            "bos_token_id": None,
            "eos_token_id": None,
        }
    fields.pop("layer_types", None)  # the config class derives the real pattern from num_hidden_layers
    fields.update(num_hidden_layers=size.layers, vocab_size=size.vocab)
    try:
        config = AutoConfig.for_model(arch.model_type, **fields)
    except (KeyError, ValueError) as ex:
        raise ValueError(
            f"--e2e: this transformers ({_transformers_version()}) has no model type "
            f"{arch.model_type!r} for {model.name}"
        ) from ex
    if getattr(config, "max_position_embeddings", size.seq) < size.seq:
        config.max_position_embeddings = size.seq
    return config


def _verify():
    from .. import verify

    return verify


def _transformers_version() -> str:
    return layer_bench.versions()["transformers"]


# ---------------------------------------------------------------- implementations


def experts_registry() -> dict:
    """transformers' experts implementations by name (``ExpertsInterface``), ``eager`` included.

    Raises:
        ImportError: transformers is missing or has no experts registry.
    """
    from ..integrations.transformers import _moe_module, register

    register()
    return {"eager": None, **_moe_module().ExpertsInterface._global_mapping}


def implementations(
    backends: list[str] | None, peers: bool, device: torch.device, recipes: list[str] | None = None
) -> tuple[list[str], dict[str, str]]:
    """(names to run, {skipped name: reason}): ``backends`` or ``moeyard``, ``grouped_mm`` and, with
    ``peers``, ``sonicmoe`` where it runs; each ``moeyard`` name once per recipe of ``recipes`` (named
    ``moeyard[:<backend>]+<recipe>``; ``none``: the compute dtype's GEMMs, the plain name).

    Raises:
        ValueError: a name that is neither in transformers' experts registry nor ``moeyard:<backend>``.
    """
    registry = experts_registry()
    names = list(backends or DEFAULT_IMPLS)
    if recipes:
        names = [
            n if r == "none" else f"{n}+{r}" for n in names for r in recipes if r == "none" or n.startswith("moeyard")
        ]
    for name in names:
        impl, _, backend = name.partition("+")[0].partition(":")
        if impl not in registry or (backend and impl != "moeyard"):
            raise ValueError(
                f"--backends: with --e2e expected transformers experts implementations "
                f"{sorted(registry)} or moeyard:<backend>, got {name!r}"
            )
        if backend:
            from ..experts.registry import check_backend_name

            check_backend_name(backend, source="--backends")
    skipped = {}
    if peers and not backends:
        for name in PEER_IMPLS:
            reason = _unavailable(name, registry, device)
            if reason:
                skipped[name] = reason
            else:
                names.append(name)
    return names, skipped


def _unavailable(name: str, registry: dict, device: torch.device) -> str | None:
    if name not in registry:
        return f"this transformers ({_transformers_version()}) has no experts implementation {name!r}"
    if device.type != "cuda":
        return "needs CUDA"
    try:
        from transformers.integrations.sonicmoe import is_sonicmoe_loadable
    except ImportError:  # a release without the check: try it (a failure is an error row)
        return None
    try:
        is_sonicmoe_loadable(raise_error=True)
    except ImportError as ex:
        return str(ex).splitlines()[0][:200]
    return None


# ---------------------------------------------------------------- one step


@dataclass
class Trainer:
    """A built model, its optimizer and the step's inputs (``ids``/``labels``: ``[batch, seq]`` int64 sets)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    ids: list[torch.Tensor]
    labels: list[torch.Tensor]
    backend: str | None
    recipe: str | None = None
    accumulate: int = 1

    def step(self, i: int = 0) -> torch.Tensor:
        """Forward, loss, backward of ``accumulate`` micro-batches (sets ``i * accumulate + j``, cycling; each
        loss divided by ``accumulate``; under an FP8 recipe inside :func:`moeyard.cache_fp8_weights`, so each
        expert weight is cast once per step), then the optimizer step and zero_grad; returns the (detached)
        mean loss."""
        from ..quant.recipe import use_recipe
        from ..quant.weight_cache import cache_fp8_weights

        cache = cache_fp8_weights() if self.recipe and self.accumulate > 1 else contextlib.nullcontext()
        total = 0.0
        with self._backend(), use_recipe(self.recipe), cache:
            for j in range(self.accumulate):
                k = (i * self.accumulate + j) % len(self.ids)
                loss = self.model(input_ids=self.ids[k], labels=self.labels[k]).loss / self.accumulate
                loss.backward()
                total = total + loss.detach()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total

    def _backend(self):
        if self.backend is None:
            return contextlib.nullcontext()
        from ..experts import use_backend

        return use_backend(self.backend)


def build_trainer(
    config, impl: str, size: StepSize, device: torch.device, dtype: torch.dtype, n_sets: int = 2
) -> Trainer:
    """The model of ``config`` under experts implementation ``impl`` (seeded), AdamW, ``n_sets`` random
    ``[size.batch, size.seq]`` id / label sets."""
    from transformers import AutoModelForCausalLM

    impl, _, recipe = impl.partition("+")
    hf_impl, _, backend = impl.partition(":")
    torch.manual_seed(0)
    with torch.device(device), _quiet():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, experts_implementation=hf_impl).train()
    params = [p for p in model.parameters() if p.requires_grad]
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(params, lr=1e-5, **({"fused": True} if fused else {"foreach": True}))
    shape, vocab = (size.batch, size.seq), config.vocab_size
    gen = torch.Generator(device=device).manual_seed(1)
    ids = [torch.randint(0, vocab, shape, device=device, generator=gen) for _ in range(n_sets)]
    labels = [torch.randint(0, vocab, shape, device=device, generator=gen) for _ in range(n_sets)]
    return Trainer(
        model=model,
        optimizer=optimizer,
        ids=ids,
        labels=labels,
        backend=backend or None,
        recipe=recipe or None,
        accumulate=size.accumulate,
    )


def _quiet():
    return _verify().quiet_transformers()


def parameter_count(config) -> int:
    """Parameters of the model of ``config`` (built on the meta device: no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"), _quiet():
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def check_fits(params: int, dtype: torch.dtype, device: torch.device) -> None:
    """Raise MemoryError when weights + gradients + two AdamW states exceed :data:`MEMORY_HEADROOM`
    of the CUDA device's memory (nothing to check elsewhere)."""
    if device.type != "cuda":
        return
    need = 4 * params * dtype.itemsize
    total = torch.cuda.get_device_properties(device).total_memory
    if need > MEMORY_HEADROOM * total:
        raise MemoryError(
            f"{params / 1e9:.1f} B parameters need {need / layer_bench.GIB:.0f} GiB for weights, gradients "
            f"and AdamW states; the device has {total / layer_bench.GIB:.0f} GiB: use fewer --layers"
        )


def measure(trainer: Trainer, opts: layer_bench.BenchOptions) -> dict:
    """Median step ms and peak GiB (CUDA: allocated during the timed steps, after warm-up)."""
    device, n = torch.device(opts.device), len(trainer.ids)
    loss = trainer.step(0)
    if not bool(torch.isfinite(loss)):  # one sync, before timing
        raise RuntimeError(f"non-finite loss {float(loss)}")
    for i in range(opts.warmup):
        trainer.step(i % n)
    layer_bench.reset_peak(device)
    ms = layer_bench.time_ms(trainer.step, n, 0, opts.iters, device)
    peak = torch.cuda.max_memory_allocated(device) / layer_bench.GIB if device.type == "cuda" else None
    return {"step_ms": ms, "peak_gib": peak}


# ---------------------------------------------------------------- the run


def resolve(opts: layer_bench.BenchOptions) -> layer_bench.BenchOptions:
    """``opts`` with e2e defaults for warm-up / iterations, checked by :func:`moeyard.bench.resolve_options`
    (``backends`` are checked by :func:`implementations`)."""
    device = opts.device or layer_bench.default_device()
    defaults = CUDA_DEFAULTS if device.startswith("cuda") else CPU_DEFAULTS
    given = {k: getattr(opts, k) for k in defaults if getattr(opts, k) is not None}
    checked = layer_bench.resolve_options(replace(opts, backends=None, **{**defaults, **given}))
    return replace(checked, backends=opts.backends)


def run(
    opts: layer_bench.BenchOptions,
    progress: Callable[[str, int, int], None] | None = None,
    *,
    layers: int | None = None,
    seq_len: int | None = None,
    vocab: int | None = None,
    tiny: bool = False,
    trace: str | None = None,
    accumulate: int = 1,
) -> dict:
    """Run the end-to-end benchmark: ``{"env": {...}, "rows": [...]}`` (ms, tokens/s, GiB).

    Args:
        opts: models (``opts.models``; default qwen3-30b-a3b; ``moeyard bench --e2e`` on a CPU without
            ``--model`` makes it tiny), ``tokens`` per step, device, dtype,
            ``backends`` (experts implementations), warm-up and iterations.
        layers, seq_len, vocab, tiny, accumulate: the step's sizes (:func:`step_size`; ``accumulate``
            micro-batches of ``opts.tokens`` tokens per optimizer step).
        trace: a directory: one profiled step per row (:mod:`moeyard.bench.trace`).
        progress: optional ``progress(description, done, total)``.
    Raises:
        ValueError: a bad option (named), an unknown or unmapped model, ``--shape`` or ``--routing``.
        ImportError: transformers is missing.
    """
    from .trace import check_trace_dir

    if opts.shapes:
        raise ValueError("--e2e: takes --model names (transformers configs), not --shape")
    if opts.routing != "random" or opts.routed_only:
        raise ValueError("--e2e: the model's own router routes; --routing and --routed-only do not apply")
    check_trace_dir(trace)
    opts = resolve(opts)
    device = torch.device(opts.device)
    entries = [get_e2e_model(n) for n in opts.models or ["qwen3-30b-a3b"]]
    sizes = [
        step_size(e, tokens=opts.tokens, seq_len=seq_len, vocab=vocab, layers=layers, tiny=tiny, accumulate=accumulate)
        for e in entries
    ]
    names, skipped = implementations(opts.backends, opts.peers, device, opts.recipes)
    report = progress or (lambda desc, done, total: None)
    env = {
        **layer_bench.environment(opts),
        "mode": "e2e",
        "skipped": skipped,
        "tiny": tiny,
        "trace": trace,
        "optimizer": "AdamW (fused)" if device.type == "cuda" else "AdamW (foreach)",
        "dense_bf16_tflops": layer_bench.dense_tflops(device, opts.warmup, opts.iters),
    }
    rows, total = [], len(entries) * len(names)
    for entry, size in zip(entries, sizes, strict=True):
        config = hf_config(entry, size)
        base = {
            "case": entry.name,
            "arch": entry.arch,
            "layers": size.layers,
            "batch": size.batch,
            "seq": size.seq,
            "accumulate": size.accumulate,
            "tokens": size.tokens,
            "vocab": size.vocab,
            "real_vocab": entry.vocab,
            "source": entry.source,
        }
        for name in names:
            report(f"{entry.name} · {name}", len(rows), total)
            rows.append(run_one(name, config, size, base, opts, trace))
        _speedups(rows[-len(names) :])
    report("done", len(rows), total)
    return {"env": env, "rows": rows}


def run_one(impl: str, config, size: StepSize, base: dict, opts: layer_bench.BenchOptions, trace: str | None) -> dict:
    """One row: step ms, tokens/s, peak GiB, or the error (never raises for a failing implementation)."""
    device, dtype = torch.device(opts.device), layer_bench.DTYPES[opts.dtype]
    row = {**base, "impl": impl}
    trainer = None
    try:
        row["params"] = parameter_count(config)
        check_fits(row["params"], dtype, device)
        trainer = build_trainer(config, impl, size, device, dtype)
        row["attn_implementation"] = trainer.model.config._attn_implementation
        if impl.startswith("moeyard"):
            row["backend"] = _moeyard_backend(impl, device, dtype)
        row.update(measure(trainer, opts))
        row["tokens_per_s"] = base["tokens"] / row["step_ms"] * 1e3
        if trace:
            from .trace import file_stem, trace_step

            row.update(trace_step(trainer.step, trace, file_stem(base["case"], impl), device))
    except Exception as ex:  # a failing implementation is a row, not a crash
        row["error"] = f"{type(ex).__name__}: {(str(ex).strip().splitlines() or [''])[0][:300]}"
    finally:
        del trainer
        layer_bench.free_memory(opts.device)  # collects garbage, empties the CUDA cache
    return row


def _moeyard_backend(impl: str, device: torch.device, dtype: torch.dtype) -> str:
    from ..experts.registry import resolve_backend

    _, _, backend = impl.partition("+")[0].partition(":")
    return resolve_backend(backend or None, device, dtype).name


def _speedups(rows: list[dict]) -> None:
    """``x_vs_grouped_mm``: the grouped_mm row's step ms over each row's (> 1: faster than grouped_mm)."""
    ref = next((r for r in rows if r["impl"] == BASELINE and "error" not in r), None)
    for r in rows:
        if ref is not None and "error" not in r:
            r["x_vs_grouped_mm"] = ref["step_ms"] / r["step_ms"]
