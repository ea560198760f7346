"""Named MoE-layer shapes of real models, and the SonicMoE benchmark shapes, as :class:`MoEConfig`s.

Each entry gives one MoE layer of the model (router scheme, activation, shared experts, biases), the
source its numbers come from, and a default token count T for benchmarks (tokens per layer call:
a micro-batch of 32768 tokens unless the shape's own benchmark says otherwise).

Custom shapes: :func:`parse_shape` reads ``"T,H,I,E,k"`` (softmax top-k renormalised, SwiGLU).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..config import MoEConfig

DEFAULT_TOKENS = 32768


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """One named MoE layer.

    Attributes:
        name: registry key, e.g. ``qwen3-30b-a3b``.
        config: keyword arguments of :class:`MoEConfig` (use :meth:`moe_config` for a fresh config).
        source: where the numbers come from (model card / HF ``config.json`` / paper).
        tokens: default tokens per layer call for benchmarks.
    """

    name: str
    config: dict = field(repr=False)
    source: str
    tokens: int = DEFAULT_TOKENS

    def moe_config(self) -> MoEConfig:
        """A new :class:`MoEConfig` for this layer."""
        return MoEConfig(**self.config)


def _moe(E: int, H: int, I: int, k: int, **extra) -> dict:
    return dict(num_experts=E, hidden_size=H, intermediate_size=I, top_k=k, **extra)


# DeepSeek-V3-style router: sigmoid scores, selection bias, renormalised top-k, scaled.
def _sigmoid_router(scaling: float, n_group: int = 1, topk_group: int = 1) -> dict:
    return dict(
        score_func="sigmoid",
        score_correction_bias=True,
        norm_topk_prob=True,
        routed_scaling_factor=scaling,
        n_group=n_group,
        topk_group=topk_group,
    )


# gpt-oss: top-k of the logits then softmax over those; clamped SwiGLU (alpha 1.702, limit 7);
# router and expert biases. (Its checkpoints interleave gate/up columns; irrelevant to timing.)
_GPT_OSS = dict(
    topk_before_score=True,
    activation="clamped_swiglu",
    activation_alpha=1.702,
    activation_limit=7.0,
    expert_bias=True,
    router_bias=True,
)

_ENTRIES = [
    ModelShape(
        name="mixtral-8x7b",
        config=_moe(8, 4096, 14336, 2),
        source="mistralai/Mixtral-8x7B-v0.1 config.json (num_local_experts 8, num_experts_per_tok 2); "
        "softmax top-k renormalised (transformers MixtralSparseMoeBlock)",
    ),
    ModelShape(
        name="qwen3-30b-a3b",
        config=_moe(128, 2048, 768, 8),
        source="Qwen/Qwen3-30B-A3B config.json (moe_intermediate_size 768, norm_topk_prob true)",
    ),
    ModelShape(
        name="qwen3-235b-a22b",
        config=_moe(128, 4096, 1536, 8),
        source="Qwen/Qwen3-235B-A22B config.json (moe_intermediate_size 1536, norm_topk_prob true)",
    ),
    ModelShape(
        name="qwen3.5-35b-a3b",
        config=_moe(256, 2048, 512, 8, num_shared_experts=1, shared_intermediate_size=512, shared_expert_gate=True),
        source="Qwen/Qwen3.5-35B-A3B config.json (256 experts, top-8, moe_intermediate_size 512, "
        "shared_expert_intermediate_size 512, sigmoid-gated shared expert)",
    ),
    ModelShape(
        name="qwen3-next-80b-a3b",
        config=_moe(512, 2048, 512, 10, num_shared_experts=1, shared_intermediate_size=512, shared_expert_gate=True),
        source="Qwen/Qwen3-Next-80B-A3B-Instruct config.json (512 experts, top-10, "
        "shared_expert_intermediate_size 512, gated shared expert, norm_topk_prob true)",
    ),
    ModelShape(
        name="olmoe-1b-7b",
        config=_moe(64, 2048, 1024, 8, norm_topk_prob=False),
        source="allenai/OLMoE-1B-7B-0924 config.json (64 experts, top-8, norm_topk_prob false)",
    ),
    ModelShape(
        name="deepseek-v3",
        config=_moe(256, 7168, 2048, 8, num_shared_experts=1, **_sigmoid_router(2.5, 8, 4)),
        source="deepseek-ai/DeepSeek-V3 config.json (n_routed_experts 256, moe_intermediate_size 2048, "
        "n_shared_experts 1, scoring_func sigmoid, topk_method noaux_tc, n_group 8, topk_group 4, "
        "routed_scaling_factor 2.5)",
    ),
    ModelShape(
        name="kimi-k2",
        config=_moe(384, 7168, 2048, 8, num_shared_experts=1, **_sigmoid_router(2.827)),
        source="moonshotai/Kimi-K2-Instruct config.json (n_routed_experts 384, n_shared_experts 1, "
        "n_group 1, routed_scaling_factor 2.827, scoring_func sigmoid, noaux_tc)",
    ),
    ModelShape(
        name="glm-4.5",
        config=_moe(160, 5120, 1536, 8, num_shared_experts=1, **_sigmoid_router(2.5)),
        source="zai-org/GLM-4.5 config.json (n_routed_experts 160, moe_intermediate_size 1536, "
        "n_shared_experts 1, routed_scaling_factor 2.5, sigmoid + e_score_correction_bias)",
    ),
    ModelShape(
        name="gpt-oss-20b",
        config=_moe(32, 2880, 2880, 4, **_GPT_OSS),
        source="openai/gpt-oss-20b config.json (num_local_experts 32, experts_per_token 4, "
        "swiglu_limit 7.0) and transformers GptOssExperts (alpha 1.702)",
    ),
    ModelShape(
        name="gpt-oss-120b",
        config=_moe(128, 2880, 2880, 4, **_GPT_OSS),
        source="openai/gpt-oss-120b config.json (num_local_experts 128, experts_per_token 4, "
        "swiglu_limit 7.0) and transformers GptOssExperts (alpha 1.702)",
    ),
    ModelShape(
        name="llama-4-scout",
        config=_moe(
            16,
            5120,
            8192,
            1,
            score_func="sigmoid",
            topk_before_score=True,
            norm_topk_prob=False,
            num_shared_experts=1,
            shared_intermediate_size=8192,
        ),
        source="meta-llama/Llama-4-Scout-17B-16E config.json (num_local_experts 16, num_experts_per_tok 1, "
        "intermediate_size 8192) and transformers Llama4TextMoe (sigmoid of the top-1 logit, "
        "shared expert)",
    ),
    # Benchmark shapes of the SonicMoE paper (arXiv 2512.14080), softmax top-k + SwiGLU, as in ANCHORS.md.
    ModelShape(
        name="sonic-7b",
        config=_moe(128, 1536, 256, 8),
        tokens=24576,
        source="SonicMoE benchmark shape (arXiv 2512.14080; sonic-moe benchmarks): fine-grained 7B MoE",
    ),
    ModelShape(
        name="sonic-30b-a",
        config=_moe(128, 4096, 512, 8),
        source="SonicMoE benchmark shape (arXiv 2512.14080): 30B, E=128 k=8",
    ),
    ModelShape(
        name="sonic-30b-b",
        config=_moe(64, 4096, 1024, 4),
        source="SonicMoE benchmark shape (arXiv 2512.14080): 30B, E=64 k=4",
    ),
    ModelShape(
        name="sonic-120b",
        config=_moe(64, 4096, 2048, 4),
        source="SonicMoE benchmark shape (arXiv 2512.14080): 120B, E=64 k=4",
    ),
]

MODELS: dict[str, ModelShape] = {m.name: m for m in _ENTRIES}

# The five configurations of the side-by-side table in ANCHORS.md.
ANCHOR_MODELS = ("sonic-7b", "qwen3-30b-a3b", "sonic-30b-a", "sonic-120b", "qwen3.5-35b-a3b")


def model_names() -> list[str]:
    """Every registered model name, in registry order."""
    return list(MODELS)


def get_model(name: str) -> ModelShape:
    """The registry entry ``name``.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    if name not in MODELS:
        raise ValueError(f"model: unknown name {name!r}; known: {', '.join(MODELS)}")
    return MODELS[name]


def parse_shape(text: str) -> ModelShape:
    """``"T,H,I,E,k"`` -> a custom :class:`ModelShape` (softmax top-k renormalised, SwiGLU).

    Raises:
        ValueError: not five positive integers, or an invalid config (e.g. ``k > E``), naming ``--shape``.
    """
    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) != 5 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--shape: expected T,H,I,E,k as five positive integers, got {text!r}")
    T, H, I, E, k = (int(p) for p in parts)
    if k > E:
        raise ValueError(f"--shape: k={k} exceeds E={E} in {text!r}")
    return ModelShape(name="custom", config=_moe(E, H, I, k), tokens=T, source="custom --shape")


def with_tokens(shape: ModelShape, tokens: int) -> ModelShape:
    """``shape`` with another default token count.

    Raises:
        ValueError: ``tokens`` is not a positive int (named ``--tokens``).
    """
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise ValueError(f"--tokens: expected a positive integer, got {tokens!r}")
    return replace(shape, tokens=tokens)


def routed_only(config: MoEConfig) -> MoEConfig:
    """``config`` without its shared experts (the part the peers implement)."""
    return replace(config, num_shared_experts=0, shared_intermediate_size=None, shared_expert_gate=False)
