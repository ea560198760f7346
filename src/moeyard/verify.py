"""``moeyard verify``: parity of the transformers experts implementation ``"moeyard"`` against
transformers' own ``eager`` experts, architecture by architecture and backend by backend.

For each architecture a tiny random-weight model is built with ``from_config`` (2 layers, hidden
size 64, 8 experts, seeded; every parameter perturbed so that no bias or norm weight is trivially 0
or 1), then one forward and backward runs under ``experts_implementation="eager"`` and, with the same
weights, under ``"moeyard"`` for each backend. Compared: the logits and the gradient of every
parameter (the input embeddings included), as relative errors ``max|got - ref| / max|ref|``.

- float32 / float64: pass when every relative error is at most :data:`TOLERANCE` for the dtype.
- bfloat16 / float16: judged against PyTorch's own error at that precision: both the eager and the
  moeyard runs are compared with a float64 eager run of the same weights, and moeyard passes when
  its error is at most ``2 * eager's + LOW_PRECISION_SLACK``, on an input where all three runs route
  every token alike (see :class:`_LowPrecision`).

With ``--lora R`` the model is wrapped by PEFT (``LoraConfig(r=R, target_parameters=...)`` on every
experts module's 3-D weights, adapters randomised so that they matter) and the comparison is PEFT on
transformers' eager experts (PEFT's own ``W + dW`` fold) against PEFT on moeyard: the logits and the
gradient of every LoRA factor (PEFT freezes the rest). ``--fuse-lora`` runs moeyard through
:func:`moeyard.integrations.peft.fuse_lora` (no parametrization registered at all).

The model builders here are the single copy the test-suite uses too.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import time
from dataclasses import asdict, dataclass, field

import torch

from .experts import use_backend

Tensor = torch.Tensor

# Relative error (max-abs over max-abs of the reference) allowed per dtype, and why.
TOLERANCE = {
    # fp32 routes the same tokens; only the summation order of the expert GEMMs and of the
    # top-k combine differs (a few ulps, ~1e-7), amplified through 2 layers and the backward.
    torch.float32: 1e-4,
    # float64 (loop / bmm_padded only): ~1e-16 where the whole model runs in float64, but routers
    # that compute in float32 (NemotronH) round their gradients to float32, where a 1e-16 change
    # flips the last bit: 1-2 float32 ulps (~1.6e-7 seen).
    torch.float64: 1e-6,
}
# Absolute slack on top of "2x eager's error" for bf16/fp16, for errors that are near zero.
LOW_PRECISION_SLACK = 1e-2

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)


@dataclass(frozen=True, kw_only=True)
class Arch:
    """A tiny configuration of one transformers MoE architecture.

    Attributes:
        name: the label shown (and accepted by ``--arch``).
        model_type: transformers' ``model_type`` (``AutoConfig.for_model``).
        overrides: config fields on top of :data:`COMMON`.
        sentinels: eager handles expert-parallel sentinel ids (``== num_experts``).
    """

    name: str
    model_type: str
    overrides: dict = field(default_factory=dict)
    sentinels: bool = True


_MOE8 = dict(num_experts_per_tok=2, moe_intermediate_size=32)
# Qwen3-Next and Qwen3.5-MoE: hybrid attention (one linear-attention layer, one full), a shared expert
_HYBRID = dict(
    **_MOE8,
    num_experts=8,
    shared_expert_intermediate_size=32,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    layer_types=["linear_attention", "full_attention"],
)
_DEEPSEEK_MLA = dict(
    kv_lora_rank=16,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    num_key_value_heads=4,
    head_dim=8,
)
ARCHS: dict[str, Arch] = {
    a.name: a
    for a in [
        Arch(name="qwen3_moe", model_type="qwen3_moe", overrides=dict(**_MOE8, num_experts=8)),
        Arch(
            name="olmoe", model_type="olmoe", overrides=dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32)
        ),
        Arch(
            name="mixtral",
            model_type="mixtral",
            overrides=dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
        ),
        Arch(
            name="qwen2_moe",
            model_type="qwen2_moe",
            overrides=dict(**_MOE8, num_experts=8, shared_expert_intermediate_size=64),
        ),
        Arch(
            name="deepseek_v3",
            model_type="deepseek_v3",
            overrides=dict(
                **_MOE8,
                **_DEEPSEEK_MLA,
                n_routed_experts=8,
                n_shared_experts=1,
                n_group=2,
                topk_group=1,
                first_k_dense_replace=0,
                routed_scaling_factor=2.5,
            ),
        ),
        Arch(
            name="gpt_oss",
            model_type="gpt_oss",
            sentinels=False,  # eager's one_hot has no sentinel class
            overrides=dict(
                num_local_experts=8,
                num_experts_per_tok=2,
                intermediate_size=32,
                sliding_window=4,
                layer_types=["sliding_attention", "full_attention"],
            ),
        ),
        Arch(
            name="glm4_moe",
            model_type="glm4_moe",
            overrides=dict(
                **_MOE8, n_routed_experts=8, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=0
            ),
        ),
        Arch(
            name="dots1",
            model_type="dots1",
            overrides=dict(
                **_MOE8,
                n_routed_experts=8,
                n_shared_experts=1,
                n_group=1,
                topk_group=1,
                first_k_dense_replace=0,
                sliding_window=None,
            ),
        ),
        Arch(
            name="ernie4_5_moe",
            model_type="ernie4_5_moe",
            overrides=dict(
                moe_num_experts=8,
                moe_k=2,
                moe_intermediate_size=32,
                moe_num_shared_experts=1,
                moe_layer_start_index=0,
                moe_layer_end_index=1,
            ),
        ),
        Arch(
            name="deepseek_v2",
            model_type="deepseek_v2",
            overrides=dict(**_MOE8, **_DEEPSEEK_MLA, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=0),
        ),
        Arch(
            name="flex_olmo",
            model_type="flex_olmo",
            overrides=dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32),
        ),
        Arch(
            name="granitemoe",
            model_type="granitemoe",
            overrides=dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
        ),
        Arch(
            name="minimax",
            model_type="minimax",
            overrides=dict(
                num_local_experts=8,
                num_experts_per_tok=2,
                intermediate_size=32,
                layer_types=["linear_attention", "full_attention"],
                block_size=4,
            ),
        ),
        Arch(
            name="hunyuan_v1_moe",
            model_type="hunyuan_v1_moe",
            overrides=dict(num_experts=8, moe_topk=2, intermediate_size=32),
        ),
        Arch(
            name="qwen3_next",
            model_type="qwen3_next",
            overrides=_HYBRID,
        ),
        Arch(
            name="qwen3_5_moe",
            model_type="qwen3_5_moe_text",
            overrides=_HYBRID,
        ),
        Arch(
            name="phimoe",
            model_type="phimoe",  # training-time router jitter: see forward_backward's seeding
            overrides=dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
        ),
        Arch(
            name="nemotron_h",
            model_type="nemotron_h",  # has_gate=False: up_proj with ReLU²
            overrides=dict(
                **_MOE8,
                n_routed_experts=8,
                n_shared_experts=1,
                moe_shared_expert_intermediate_size=32,
                layers_block_type=["moe", "attention"],
                mamba_num_heads=4,
                mamba_head_dim=16,
                n_groups=1,
                ssm_state_size=16,
            ),
        ),
        Arch(
            name="lfm2_moe",
            model_type="lfm2_moe",  # act_fn is the function F.silu
            overrides=dict(
                num_experts=8,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                num_dense_layers=0,
                layer_types=["conv", "full_attention"],
            ),
        ),
        Arch(
            name="solar_open", model_type="solar_open", overrides=dict(**_MOE8, n_routed_experts=8, n_shared_experts=1)
        ),
        Arch(
            name="exaone_moe",
            model_type="exaone_moe",
            overrides=dict(**_MOE8, num_experts=8, num_shared_experts=1, first_k_dense_replace=0, sliding_window=4),
        ),
        Arch(
            name="afmoe",
            model_type="afmoe",
            overrides=dict(**_MOE8, num_experts=8, num_shared_experts=1, num_dense_layers=0, sliding_window=4),
        ),
        Arch(
            name="minimax_m2",
            model_type="minimax_m2",
            overrides=dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
        ),
        Arch(
            name="cohere2_moe",
            model_type="cohere2_moe",
            overrides=dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32, sliding_window=4),
        ),
        Arch(
            name="glm4_moe_lite",
            model_type="glm4_moe_lite",
            overrides=dict(**_MOE8, **_DEEPSEEK_MLA, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=0),
        ),
        Arch(
            name="jamba",
            model_type="jamba",
            overrides=dict(
                num_experts=8,
                num_experts_per_tok=2,
                expert_layer_period=1,
                expert_layer_offset=0,
                attn_layer_period=2,
                attn_layer_offset=1,
                mamba_d_state=8,
                use_mamba_kernels=False,
            ),
        ),
        Arch(
            name="laguna",
            model_type="laguna",
            overrides=dict(**_MOE8, num_experts=8, shared_expert_intermediate_size=32, sliding_window=4),
        ),
    ]
}
# the six every run checks by default are first; the rest follow where they build
REQUIRED = ("qwen3_moe", "olmoe", "mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss")


class ArchUnavailable(Exception):
    """The installed transformers lacks this architecture (or cannot build it this small)."""


def build_model(
    arch: Arch | str,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    experts_implementation: str = "eager",
    lora_rank: int = 0,
) -> torch.nn.Module:
    """A tiny seeded random-weight causal LM of ``arch`` (eager attention), in train mode; with
    ``lora_rank`` wrapped by PEFT (:func:`add_expert_lora`).

    Every floating parameter is perturbed by ``N(0, 0.02)`` after transformers' initialisation, so
    biases and norm weights are neither 0 nor 1.

    Raises:
        ArchUnavailable: the installed transformers has no such model type.
        KeyError: unknown architecture name.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = ARCHS[arch] if isinstance(arch, str) else arch
    try:
        config = AutoConfig.for_model(arch.model_type, **{**COMMON, **arch.overrides})
    except (KeyError, ValueError) as ex:
        raise ArchUnavailable(f"transformers has no model type {arch.model_type!r}") from ex
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32, experts_implementation=experts_implementation
    )
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    model = model.to(device=device, dtype=dtype).train()
    return add_expert_lora(model, lora_rank, seed=seed) if lora_rank else model


def add_expert_lora(model: torch.nn.Module, rank: int, *, seed: int = 0) -> torch.nn.Module:
    """``peft.get_peft_model`` with LoRA of ``rank`` on every experts module's 3-D weights
    (``target_parameters``), both factors redrawn from a seeded ``N(0, 1/sqrt(fan-in))`` so the
    adapters change the output (PEFT starts B at zero). Returns the PEFT model.

    Raises:
        ImportError: peft is not installed.
    """
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as ex:
        raise ImportError("--lora needs peft >= 0.17: pip install peft") from ex
    targets = sorted(
        {
            f"{name}.{p}"
            for name, m in model.named_modules()
            if m in experts_modules(model)
            for p in ("gate_up_proj", "up_proj", "down_proj")
            if isinstance(getattr(m, p, None), torch.Tensor)
        }
    )
    peft_model = get_peft_model(
        model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=[], target_parameters=targets)
    )
    gen = torch.Generator().manual_seed(seed + 3)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) / p.shape[1] ** 0.5)
    return peft_model


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's ``@use_experts_implementation`` modules."""
    return [
        m
        for m in model.modules()
        if hasattr(m, "has_gate") and hasattr(m, "down_proj") and not hasattr(m, "base_layer")
    ]


def make_inputs(model: torch.nn.Module, *, seed: int = 0, batch: int = 2, seq: int = 8) -> tuple[Tensor, Tensor]:
    """``(input_ids [batch, seq], probe [batch, seq, vocab])``: the loss is ``(logits * probe).sum()``."""
    gen = torch.Generator().manual_seed(seed + 2)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    probe = torch.randn(batch, seq, vocab, generator=gen, dtype=torch.float64)
    dev = next(model.parameters()).device
    return ids.to(dev), probe.to(dev)


def forward_backward(model: torch.nn.Module, ids: Tensor, probe: Tensor, *, seed: int = 0) -> dict[str, Tensor]:
    """One forward and backward; returns ``{"logits": ..., "grad.<param>": ...}`` (float64 copies).

    The RNG is seeded for the pass (inside a fork, so the caller's RNG state is untouched): routers
    with training-time noise (PhiMoE's jitter) draw the same noise in every run.
    """
    model.zero_grad(set_to_none=True)
    devices = [ids.device] if ids.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        logits = model(input_ids=ids).logits
        (logits.double() * probe).sum().backward()
    out = {"logits": logits.detach().double()}
    for name, p in model.named_parameters():
        if p.requires_grad:
            out["grad." + name] = (p.grad if p.grad is not None else torch.zeros_like(p)).detach().double()
    model.zero_grad(set_to_none=True)
    return out


def max_rel_error(got: dict[str, Tensor], ref: dict[str, Tensor]) -> tuple[float, str]:
    """The largest ``max|got - ref| / max|ref|`` over the entries, and which entry it was."""
    worst, where = 0.0, ""
    for key, r in ref.items():
        g = got[key]
        scale = r.abs().max().item()
        diff = (g - r).abs().max().item()
        err = diff / scale if scale > 0 else diff
        if not err <= worst:  # NaN counts as the worst
            worst, where = err if err == err else float("inf"), key
    return worst, where


def run_moeyard(model: torch.nn.Module, backend: str, ids: Tensor, probe: Tensor) -> dict[str, Tensor]:
    """``forward_backward`` under ``experts_implementation="moeyard"`` and ``backend``; restores eager.

    Raises:
        RuntimeError: the model has no experts module dispatching to moeyard (nothing would be tested).
    """
    model.set_experts_implementation("moeyard")
    try:
        mods = experts_modules(model)
        if not mods or any(m.config._experts_implementation != "moeyard" for m in mods):
            raise RuntimeError("no experts module dispatches to 'moeyard'")
        with use_backend(backend):
            return forward_backward(model, ids, probe)
    finally:
        model.set_experts_implementation("eager")


@dataclass(kw_only=True)
class Result:
    arch: str
    backend: str
    status: str  # "pass", "fail", "skip", "error"
    error: float | None = None
    where: str = ""
    limit: float | None = None
    message: str = ""
    seconds: float = 0.0


def check_arch(
    arch: Arch,
    backends: list[str],
    *,
    device: str,
    dtype: torch.dtype,
    seed: int = 0,
    lora_rank: int = 0,
    fuse_lora: bool = False,
) -> list[Result]:
    """Parity of every backend for one architecture (see the module docstring for the criterion);
    with ``lora_rank``, of PEFT LoRA training (``fuse_lora``: through :func:`moeyard.integrations.peft.fuse_lora`)."""
    try:
        model = build_model(arch, seed=seed, dtype=dtype, device=device, lora_rank=lora_rank)
        judge = (
            _Exact(model, seed=seed, dtype=dtype)
            if dtype in TOLERANCE
            else _LowPrecision(model, arch, seed=seed, device=device, lora_rank=lora_rank)
        )
        if fuse_lora:
            from .integrations.peft import fuse_lora as fuse

            fuse(model)
    except ArchUnavailable as ex:
        return [Result(arch=arch.name, backend=b, status="skip", message=str(ex)) for b in backends]
    except Exception as ex:  # the eager model itself fails: every cell of the row is an error
        msg = f"eager model: {type(ex).__name__}: {str(ex).splitlines()[0][:200]}"
        return [Result(arch=arch.name, backend=b, status="error", message=msg) for b in backends]
    results = []
    for backend in backends:
        t0 = time.perf_counter()
        try:
            verdict = judge(backend)
        except Exception as ex:  # reported per cell: one backend's failure must not hide the others
            results.append(
                Result(
                    arch=arch.name,
                    backend=backend,
                    status="error",
                    message=f"{type(ex).__name__}: {str(ex).splitlines()[0][:200]}",
                )
            )
            continue
        if verdict is None:
            results.append(
                Result(
                    arch=arch.name,
                    backend=backend,
                    status="skip",
                    message=(
                        f"in {_LowPrecision.TRIES} input draws, a near tie always routed some token differently "
                        "from float64"
                    ),
                )
            )
            continue
        err, where, limit = verdict
        results.append(
            Result(
                arch=arch.name,
                backend=backend,
                status="pass" if err <= limit else "fail",
                error=err,
                where=where,
                limit=limit,
                seconds=time.perf_counter() - t0,
            )
        )
    return results


class _Exact:
    """float32 / float64: moeyard against eager in the same dtype, within :data:`TOLERANCE`."""

    def __init__(self, model, *, seed: int, dtype: torch.dtype):
        self.model, self.limit = model, TOLERANCE[dtype]
        self.ids, self.probe = make_inputs(model, seed=seed)
        self.ref = forward_backward(model, self.ids, self.probe)

    def __call__(self, backend: str) -> tuple[float, str, float]:
        err, where = max_rel_error(run_moeyard(self.model, backend, self.ids, self.probe), self.ref)
        return err, where, self.limit


class _LowPrecision:
    """bf16 / fp16: moeyard and eager both against a float64 eager run of the same weights, moeyard
    within ``2 * err(eager) + LOW_PRECISION_SLACK``.

    Top-k routing is discontinuous: at a near tie, rounding can send a token to another expert, and
    the router's gradient then flows into other rows — a difference no tolerance can absorb and no
    fault of either implementation. So an input counts only where the float64, the eager and the
    moeyard runs all route every token of every layer alike; inputs are redrawn (up to ``TRIES``)
    until one does, and a backend with none is reported as skipped, never as passed.
    """

    TRIES = 8

    def __init__(self, model, arch: Arch, *, seed: int, device: str, lora_rank: int = 0):
        self.model, self.seed = model, seed
        self.model64 = build_model(arch, seed=seed, dtype=torch.float64, device=device, lora_rank=lora_rank)
        self._draws: dict[int, tuple] = {}

    def __call__(self, backend: str) -> tuple[float, str, float] | None:
        for s in range(self.seed, self.seed + self.TRIES):
            draw = self._draw(s)
            if draw is None:
                continue
            ids, probe, ref64, routing64, limit = draw
            got, routing = _routed(
                self.model, lambda ids=ids, probe=probe: run_moeyard(self.model, backend, ids, probe)
            )
            if _same_routing(routing, routing64):
                return (*max_rel_error(got, ref64), limit)
        return None

    def _draw(self, s: int):
        """Inputs of draw ``s`` with the float64 reference, if eager routes them like float64."""
        if s not in self._draws:
            ids, probe = make_inputs(self.model, seed=s)
            ref64, routing64 = _routed(self.model64, lambda: forward_backward(self.model64, ids, probe))
            eager, routing = _routed(self.model, lambda: forward_backward(self.model, ids, probe))
            ok = _same_routing(routing, routing64)
            limit = 2 * max_rel_error(eager, ref64)[0] + LOW_PRECISION_SLACK
            self._draws[s] = (ids, probe, ref64, routing64, limit) if ok else None
        return self._draws[s]


def _routed(model: torch.nn.Module, run) -> tuple[dict[str, Tensor], list[Tensor]]:
    """``run()``'s result and the ``top_k_index`` every experts module received, in call order."""
    seen: list[Tensor] = []
    handles = [
        m.register_forward_pre_hook(lambda m, args: seen.append(args[1].detach().cpu())) for m in experts_modules(model)
    ]
    try:
        return run(), seen
    finally:
        for h in handles:
            h.remove()


def _same_routing(a: list[Tensor], b: list[Tensor]) -> bool:
    """Same experts per token (as sets: the order of the k slots may differ)."""
    return len(a) == len(b) and all(
        x.shape == y.shape and torch.equal(x.sort(-1).values, y.sort(-1).values) for x, y in zip(a, b, strict=True)
    )


# ---------------------------------------------------------------- command line

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``moeyard verify``'s options to ``parser``."""
    parser.add_argument(
        "--arch",
        nargs="+",
        metavar="NAME",
        choices=sorted(ARCHS),
        help=f"architectures to check (default: all: {', '.join(ARCHS)})",
    )
    parser.add_argument(
        "--backends",
        nargs="+",
        metavar="NAME",
        help="moeyard backends (default: every one that runs on the device and dtype)",
    )
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="dtype (default: float32)")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and inputs (default: 0)")
    parser.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="R",
        help="wrap each model with PEFT LoRA of rank R on the experts and compare LoRA training",
    )
    parser.add_argument(
        "--fuse-lora", action="store_true", help="with --lora: run moeyard through moeyard.integrations.peft.fuse_lora"
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    parser.add_argument(
        "--framework",
        choices=("torch", "jax"),
        default="torch",
        help="jax: add a column with the experts computed by moeyard.jax (moeyard.jax.verify)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the checks ``args`` asks for; print a table (or JSON). Returns 1 on any failure, else 0.

    Raises:
        ValueError: an unknown backend name, or a named backend that cannot run on the device/dtype.
        ImportError: transformers is not installed.
    """
    if importlib.util.find_spec("transformers") is None:
        raise ImportError("moeyard verify needs transformers: pip install 'moeyard[transformers]'")
    from .experts import available_backends, backend_names
    from .integrations.transformers import register

    register()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[args.dtype]
    runnable = available_backends(device, dtype)
    backends = args.backends or runnable
    for b in backends:
        if b not in backend_names() or b == "auto":
            raise ValueError(f"--backends: expected names from {runnable}, got {b!r}")
        if b not in runnable:
            raise ValueError(
                f"--backends: {b!r} cannot run on {device} with {args.dtype}; backends that can: {runnable}"
            )
    if args.lora < 0 or (args.fuse_lora and not args.lora):
        raise ValueError(f"--lora: expected a positive rank (needed by --fuse-lora), got {args.lora}")
    archs = [ARCHS[a] for a in (args.arch or ARCHS)]
    t0 = time.perf_counter()
    with quiet_transformers(), _framework(args.framework, dtype) as extra:
        backends = [*backends, *extra]
        results = [
            r
            for a in archs
            for r in check_arch(
                a,
                list(backends),
                device=device,
                dtype=dtype,
                seed=args.seed,
                lora_rank=args.lora,
                fuse_lora=args.fuse_lora,
            )
        ]
    elapsed = time.perf_counter() - t0
    failed = any(r.status in ("fail", "error") for r in results)
    if args.json:
        print(
            json.dumps(
                {
                    "device": device,
                    "dtype": args.dtype,
                    "seconds": round(elapsed, 2),
                    "ok": not failed,
                    "results": [asdict(r) for r in results],
                },
                indent=2,
            )
        )
    else:
        _print_table(results, backends, device=device, dtype=args.dtype, seconds=elapsed)
    return 1 if failed else 0


@contextlib.contextmanager
def _framework(framework: str, dtype: torch.dtype):
    """The extra columns of ``--framework``: none for torch; ``jax`` (:mod:`moeyard.jax.verify`)."""
    if framework != "jax":
        yield []
        return
    from .jax.verify import jax_column

    with jax_column(dtype) as name:
        yield [name]


@contextlib.contextmanager
def quiet_transformers():
    """transformers' config warnings about the tiny sizes are noise here: errors only, then restore."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def _print_table(results: list[Result], backends: list[str], *, device: str, dtype: str, seconds: float) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"moeyard vs eager experts: max relative error ({device}, {dtype}, {seconds:.1f}s)")
    table.add_column("architecture")
    for b in backends:
        table.add_column(b, justify="right")
    notes = []
    for arch in dict.fromkeys(r.arch for r in results):
        row = {r.backend: r for r in results if r.arch == arch}
        table.add_row(arch, *(_cell(row[b], notes) for b in backends))
    console = Console()
    console.print(table)
    for note in dict.fromkeys(notes):
        console.print(note)
    counts = {k: sum(r.status == k for r in results) for k in ("pass", "fail", "error", "skip")}
    console.print(f"{counts['pass']} passed, {counts['fail'] + counts['error']} failed, {counts['skip']} skipped")


def _cell(r: Result, notes: list[str]) -> str:
    if r.status == "skip":
        notes.append(f"[yellow]skipped[/] {r.arch}: {r.message}")
        return "[yellow]skip[/]"
    if r.status == "error":
        notes.append(f"[red]error[/] {r.arch} / {r.backend}: {r.message}")
        return "[red]error[/]"
    if r.status == "fail":
        notes.append(f"[red]fail[/] {r.arch} / {r.backend}: {r.error:.2e} > {r.limit:.2e} at {r.where}")
        return f"[red]FAIL {r.error:.1e}[/]"
    return f"[green]pass {r.error:.1e}[/]"
