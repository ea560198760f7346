"""QLoRA on the full Qwen3-235B-A22B (or DeepSeek-V3) architecture over several GPUs: expert parallelism,
NF4 experts, LoRA r=16 on experts and attention, FSDP2 for the non-expert weights, activation checkpointing
(torchrun).

Needs bitsandbytes (``moeyard.quantize_experts`` quantises with ``bitsandbytes.functional.quantize_4bit``:
``pip install bitsandbytes``, or carry its wheel to a machine without network), peft and transformers.

What it does, on every rank (W processes, one GPU each):

1. Builds ``Qwen3MoeForCausalLM`` with Qwen3-235B-A22B's configuration (values from
   https://huggingface.co/Qwen/Qwen3-235B-A22B/blob/main/config.json: 94 layers, hidden 4096, 64
   query / 4 key-value heads of 128, 128 experts of 1536, top-8 renormalised, dense intermediate
   12288 (unused: every layer is sparse), vocab 151936, RMSNorm eps 1e-6, rope theta 1e6, untied
   embeddings) on the meta device, ``experts_implementation="moeyard"``, SDPA attention, and wraps it
   with PEFT there: LoRA r=16, alpha 32 on every layer's ``mlp.experts.gate_up_proj`` /
   ``mlp.experts.down_proj`` (``target_parameters``) and ``q_proj``/``k_proj``/``v_proj``/``o_proj``.
   **Random weights**: no checkpoint is read, so the losses mean nothing beyond falling on the
   repeated batch; the memory and the speed are those of the real model.
2. Splits the experts while nothing exists yet: ``moeyard.parallel.expert_parallel(model, group)``
   on the meta device keeps rank r's 128 / W experts and its block of their LoRA factors
   (``lora_A [16 * 128/W, in]``, ``lora_B [out, 16 * 128/W]``, PEFT's layout; ``moeyard.parallel.lora``).
3. Materialises the model one decoder layer at a time on this rank's GPU (bf16 base, float32 LoRA:
   A ~ U(+-1/sqrt(in)), B = 0 as PEFT initialises them; the replicated weights from one seed on every
   rank, each rank's expert block from its own) and quantises that layer's expert block to NF4
   (``moeyard.quantize_experts(layer)``) before the next, so a rank never holds more than one layer's
   block of bf16 experts (1.2 GB at W = 4) and no device ever holds the whole model.
4. FSDP2 (default; ``--no-fsdp`` keeps them replicated): ``moeyard.parallel.fsdp_expert_parallel`` on a
   ``(dp = 1, ep = W)`` mesh shards the decoder layers' non-expert weights, the embedding and their
   LoRA factors over the W ranks (each decoder layer gathered in turn), and the experts' adapters
   stay each rank's own (reduced over ``dp``). ``lm_head`` stays whole on every rank (1.2 GB, frozen:
   the chunked loss reads it outside any module's forward).
5. Activation checkpointing of every decoder layer (transformers' ``gradient_checkpointing_enable``,
   non-reentrant: the recomputed forward exchanges its tokens again, the experts dequantise again).
6. Trains AdamW (lr ``--lr``) on the LoRA factors for ``--steps`` steps on one repeated batch per rank
   (``--batch`` x ``--seq`` random token ids, another batch on each rank; its loss the mean over its
   own tokens, the next-token cross-entropy computed in chunks through ``lm_head``: the fused linear
   cross-entropy of ``examples/qwen3_30b_qlora.py``), the first two steps warm-up. Prints per step
   the mean loss over ranks, the time, tokens/s (all ranks' tokens) and the largest per-GPU peak
   (``torch.cuda.max_memory_allocated``); at the end one table line and, with ``--out``, a JSON summary.

Memory per GPU at W = 4, batch 2 x 4096 tokens per GPU (estimate; the run prints the measured numbers):

- NF4 experts: 94 x 128 x 3 x 4096 x 1536 = 226.9 B weights at 0.516 bytes (4 bits + the
  double-quantised block scales) = 117 GB in all, 29.3 GB per GPU;
- non-expert weights, bf16: attention 71.3 M per layer (6.70 B), routers 49 M, embedding and
  ``lm_head`` 0.62 B each: 8.0 B, 16.0 GB replicated. With FSDP2 the 7.4 B besides ``lm_head`` are
  sharded, 3.7 GB per GPU, plus ``lm_head`` (1.25 GB), the embedding gathered for the step (FSDP2 keeps
  the root unit's parameters gathered between forward and backward, 1.25 GB) and one decoder layer
  gathered at a time (0.14 GB);
- LoRA, float32: experts 26.2 M per layer (2.46 B), 616 M per GPU: 2.5 GB, their gradients 2.5 GB,
  AdamW 4.9 GB (``--lora-dtype bfloat16`` halves the 9.9 GB); attention 51 M in all (0.8 GB with
  gradients and AdamW, a quarter of it with FSDP2);
- activations: checkpointed layer inputs 94 x 8192 x 4096 x 2 B = 6.3 GB, one layer recomputed with
  its backward (routed rows 0.5 GB and their intermediates, the active experts dequantised 1.2 GB,
  attention) and the loss's chunk (0.9 GB): about 4.5 GB.

About 57 GB (53 GiB) per GPU with FSDP2, 68 GB without (``--no-fsdp``; ``--batch 1`` saves 5 GB of
activations): under 70 GB on 80 GB H100s. Two GPUs would need 59 GB of NF4 experts each: use 4 or more.

``--model deepseek-v3`` builds DeepSeek-V3's architecture instead (``DEEPSEEK_V3``: 61 layers, the first 3
dense, 256 routed experts and one shared, MLA attention; LoRA on its ``q_a_proj``, ``q_b_proj``,
``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``; NF4 and expert LoRA in the 58 sparse layers only). At 8
GPUs, 2 x 4096 tokens per GPU, about 75 GB per GPU (NF4 experts 42.2 GB, non-expert weights with FSDP2
8.9 GB, expert LoRA 9.7 GB, activations 14 GB): 8 x 141 GB H200s; on 80 GB H100s ``--batch 1 --lora-dtype
bfloat16`` brings it to about 64 GB (``docs/finetuning-ep.md`` has the breakdown).

Run (4 GPUs; torch.cuda.set_device(local rank), NCCL)::

    torchrun --nproc-per-node 4 examples/qwen3_235b_qlora.py --out $OUT
    torchrun --nproc-per-node 4 examples/qwen3_235b_qlora.py --layers 8 --steps 4   # quick check
    torchrun --nproc-per-node 2 examples/qwen3_235b_qlora.py --tiny --steps 4       # CPU, gloo, float32
    torchrun --nproc-per-node 8 examples/qwen3_235b_qlora.py --model deepseek-v3 --out $OUT
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moeyard  # noqa: E402
import qwen3_30b_qlora as single  # noqa: E402  (the chunked loss, the memory breakdown)
from moeyard.parallel import expert_parallel, fsdp_expert_parallel, param_groups_by_mesh  # noqa: E402
from moeyard.parallel.lora import expert_adapters  # noqa: E402

# https://huggingface.co/Qwen/Qwen3-235B-A22B/blob/main/config.json
QWEN3_235B_A22B = dict(
    hidden_size=4096,
    intermediate_size=12288,
    moe_intermediate_size=1536,
    num_hidden_layers=94,
    num_attention_heads=64,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    vocab_size=151936,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    tie_word_embeddings=False,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    hidden_act="silu",
    attention_bias=False,
    router_aux_loss_coef=0.001,
    output_router_logits=False,
    use_cache=False,
)
# The same architecture scaled down for CPU checks (float32, seconds).
TINY = dict(
    QWEN3_235B_A22B,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    vocab_size=512,
    max_position_embeddings=512,
)
# https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json: 61 layers, the first 3 dense; 256
# routed experts of 2048 and one shared, top-8 of 8 groups (4 kept), sigmoid scores with the aux-free bias,
# renormalised, scaled 2.5; MLA attention (q rank 1536, kv rank 512, 128 heads of 128 + 64 rope dims);
# YaRN rope (factor 40 over 4096 positions)
DEEPSEEK_V3 = dict(
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_attention_heads=128,
    num_key_value_heads=128,
    n_routed_experts=256,
    n_shared_experts=1,
    num_experts_per_tok=8,
    first_k_dense_replace=3,
    n_group=8,
    topk_group=4,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    vocab_size=129280,
    max_position_embeddings=163840,
    rms_norm_eps=1e-6,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    tie_word_embeddings=False,
    hidden_act="silu",
    attention_bias=False,
    use_cache=False,
)
DEEPSEEK_V3_TINY = dict(
    DEEPSEEK_V3,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    n_group=2,
    topk_group=1,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    vocab_size=512,
    max_position_embeddings=2560,  # 40 x 64: YaRN's factor, as 163840 / 4096 in the full model
    rope_parameters=dict(DEEPSEEK_V3["rope_parameters"], original_max_position_embeddings=64),
)


class Arch(NamedTuple):
    """What differs between the two architectures this script builds."""

    config: dict
    tiny: dict
    config_class: str  # in transformers
    rotary: str  # transformers module path : class of the rotary embedding
    attn_targets: list[str]  # LoRA target_modules (attention projections)
    experts_key: str  # the config's routed expert count
    dense_layers: str | None  # the config's count of leading dense layers (no experts)
    source: str


ARCHS = {
    "qwen3-235b-a22b": Arch(
        QWEN3_235B_A22B,
        TINY,
        "Qwen3MoeConfig",
        "transformers.models.qwen3_moe.modeling_qwen3_moe:Qwen3MoeRotaryEmbedding",
        single.ATTN_TARGETS,
        "num_experts",
        None,
        "https://huggingface.co/Qwen/Qwen3-235B-A22B/blob/main/config.json",
    ),
    "deepseek-v3": Arch(
        DEEPSEEK_V3,
        DEEPSEEK_V3_TINY,
        "DeepseekV3Config",
        "transformers.models.deepseek_v3.modeling_deepseek_v3:DeepseekV3RotaryEmbedding",
        ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
        "n_routed_experts",
        "first_k_dense_replace",
        "https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json",
    ),
}
LORA_RANK, LORA_ALPHA = single.LORA_RANK, single.LORA_ALPHA
INIT_STD = single.INIT_STD


def require_bitsandbytes():
    """``bitsandbytes``, imported; SystemExit with what to do when it is missing."""
    try:
        import bitsandbytes
    except ImportError:
        raise SystemExit(
            "qwen3_235b_qlora: NF4 experts need bitsandbytes (moeyard.quantize_experts quantises with "
            "bitsandbytes.functional.quantize_4bit): pip install bitsandbytes, or install its wheel "
            "on a machine without network"
        ) from None
    return bitsandbytes


# ---------------------------------------------------------------- processes


def init_distributed(device_arg: str | None) -> torch.device:
    """The process group of torchrun's environment (NCCL bound to ``cuda:LOCAL_RANK``, else gloo); this
    process's device."""
    if "RANK" not in os.environ:
        raise SystemExit("qwen3_235b_qlora: launch with torchrun --nproc-per-node N examples/qwen3_235b_qlora.py ...")
    cuda = torch.cuda.is_available() and (device_arg or "cuda").startswith("cuda")
    timeout = datetime.timedelta(minutes=30)  # building and quantising 94 layers takes minutes
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return device


# ---------------------------------------------------------------- building, shard by shard


def _materialise(module: nn.Module, device, dtype, lora_dtype, shared: torch.Generator, own: torch.Generator) -> None:
    """Every meta parameter owned by ``module``'s submodules becomes a device tensor of its (local)
    shape: LoRA A ~ U(+-1/sqrt(in)), B = 0, RMSNorm weights 1, the rest N(0, INIT_STD); drawn from
    ``own`` for the experts' blocks (weights and adapters: this rank's), from ``shared`` otherwise
    (the same on every rank)."""
    for mname, m in module.named_modules():
        for pname, p in list(m._parameters.items()):
            if p is None or not p.is_meta:
                continue
            full = f".{mname}.{pname}"
            gen = own if ".experts." in full else shared
            is_lora = ".lora_A." in full or ".lora_B." in full
            t = torch.empty(p.shape, dtype=lora_dtype if is_lora else dtype, device=device)
            if ".lora_B." in full:
                t.zero_()
            elif is_lora:
                bound = 1.0 / math.sqrt(p.shape[-1])
                t.uniform_(-bound, bound, generator=gen)
            elif "RMSNorm" in type(m).__name__:
                t.fill_(1.0)
            else:
                t.normal_(0.0, INIT_STD, generator=gen)
            m._parameters[pname] = nn.Parameter(t, requires_grad=p.requires_grad)
        for bname, b in list(m._buffers.items()):  # DeepSeek-V3's aux-free routing bias: zeros, as initialised
            if b is not None and b.is_meta:
                m._buffers[bname] = torch.zeros(b.shape, dtype=b.dtype, device=device)


def first_moe_layer(config_kwargs: dict, arch: Arch) -> int:
    """The index of the first decoder layer with routed experts."""
    return config_kwargs[arch.dense_layers] if arch.dense_layers else 0


def build_meta_model(config_kwargs: dict, arch: Arch, dtype, attn: str):
    """PEFT-wrapped model of ``arch`` on the meta device: LoRA on the attention projections and on the routed
    experts of every sparse layer (``target_parameters``)."""
    import transformers
    from peft import LoraConfig, get_peft_model

    config = getattr(transformers, arch.config_class)(**config_kwargs)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attn, experts_implementation="moeyard"
        )
        targets = [
            f"model.layers.{i}.mlp.experts.{p}"
            for i in range(first_moe_layer(config_kwargs, arch), config.num_hidden_layers)
            for p in ("gate_up_proj", "down_proj")
        ]
        lora = LoraConfig(
            r=LORA_RANK,
            lora_alpha=LORA_ALPHA,
            lora_dropout=0.0,
            target_modules=arch.attn_targets,
            target_parameters=targets,
            bias="none",
        )
        return get_peft_model(model, lora)


def build(
    config_kwargs: dict,
    *,
    arch: Arch,
    layers: int,
    device: torch.device,
    dtype,
    lora_dtype,
    attn: str,
    group,
    dispatcher: str,
    seed: int = 0,
    log=print,
):
    """The PEFT model, this rank's part of it, on ``device``: split on the meta device, then layer by
    layer materialised and its expert block quantised. Returns ``(peft_model, timings)``."""
    import importlib

    module, _, cls = arch.rotary.partition(":")
    rotary = getattr(importlib.import_module(module), cls)
    cfg = dict(config_kwargs, num_hidden_layers=layers)
    t0 = time.perf_counter()
    model = build_meta_model(cfg, arch, dtype, attn)
    expert_parallel(model, group, dispatcher=dispatcher)  # meta: each rank keeps its experts and their adapters
    lm = model.base_model.model
    rank = dist.get_rank(group)
    shared = torch.Generator(device=device).manual_seed(seed)
    own = torch.Generator(device=device).manual_seed(seed + 1 + rank)
    for sub in (lm.model.embed_tokens, lm.model.norm, lm.lm_head):
        _materialise(sub, device, dtype, lora_dtype, shared, own)
    lm.model.rotary_emb = rotary(config=lm.config).to(device)
    sparse_from = first_moe_layer(cfg, arch)
    t_quant = 0.0
    for i, layer in enumerate(lm.model.layers):
        _materialise(layer, device, dtype, lora_dtype, shared, own)
        single._sync(device)
        tq = time.perf_counter()
        if i >= sparse_from:  # the leading dense layers have no experts
            moeyard.quantize_experts(layer, "nf4")  # this rank's block only
        single._sync(device)
        t_quant += time.perf_counter() - tq
        if i == 0 or i == layers - 1 or (i + 1) % 16 == 0:
            gib = f", {torch.cuda.memory_allocated(device) / 2**30:.2f} GiB allocated" if device.type == "cuda" else ""
            what = "and its experts quantised" if i >= sparse_from else "(dense)"
            log(f"  layer {i + 1}/{layers} materialised {what}{gib}")
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"still on the meta device: {left[:5]}")
    return model, {"build_s": time.perf_counter() - t0, "quantize_s": t_quant}


def shard_non_experts(model, mesh) -> None:
    """FSDP2 over the ``(dp = 1, ep = W)`` mesh: the decoder layers and the rest of the base model (the
    embedding, the final norm) sharded over all ranks, the experts' adapters over ``dp``
    (:func:`moeyard.parallel.fsdp_expert_parallel`, the experts already split)."""
    lm = model.base_model.model
    fsdp_expert_parallel(lm.model, mesh, blocks=list(lm.model.layers))


def average_gradients(model, world_size: int) -> None:
    """Without FSDP: the replicated trainable parameters' gradients averaged over the ranks (all-reduce),
    the experts' adapters' divided by W (each rank's block already holds the gradient of every rank's
    loss: the combine's backward brought them back); the gradient of the mean of the ranks' losses."""
    local = {id(p) for a in expert_adapters(model) for p in (a.lora_A.weight, a.lora_B.weight)}
    for p in model.parameters():
        if p.grad is None:
            continue
        if id(p) not in local:
            dist.all_reduce(p.grad)
        p.grad.div_(world_size)


# ---------------------------------------------------------------- training


def train(
    model,
    *,
    batch: int,
    seq: int,
    steps: int,
    warmup: int,
    device,
    loss_chunk: int,
    lr: float,
    fsdp: bool,
    seed: int = 0,
    log=print,
) -> list[dict]:
    """``steps`` AdamW steps on one repeated batch per rank; rank 0 logs; every rank returns the records."""
    lm = model.base_model.model
    W, rank = dist.get_world_size(), dist.get_rank()
    # one group per device mesh: FSDP2 puts the experts' adapters and the rest on different meshes, and
    # the foreach step (CUDA's default; also on CPU here) cannot mix them
    opt = torch.optim.AdamW(param_groups_by_mesh(model.parameters()), lr=lr, weight_decay=0.0, foreach=True)
    gen = torch.Generator(device=device).manual_seed(seed + 100 + rank)
    ids = torch.randint(0, lm.config.vocab_size, (batch, seq + 1), device=device, generator=gen)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    records = []
    for step in range(steps):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        single._sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        hidden = lm.model(input_ids=inputs, use_cache=False).last_hidden_state
        loss = single.chunked_lm_loss(hidden, lm.lm_head, labels, loss_chunk)
        loss.backward()
        if not fsdp:
            average_gradients(model, W)
        opt.step()
        opt.zero_grad(set_to_none=True)
        single._sync(device)
        dist.barrier()
        dt = time.perf_counter() - t0
        stats = torch.tensor(
            [loss.item(), torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0],
            dtype=torch.float64,
            device=device,
        )
        everyone = [torch.zeros_like(stats) for _ in range(W)]
        dist.all_gather(everyone, stats)
        losses = [float(s[0]) for s in everyone]
        rec = {
            "step": step + 1,
            "warmup": step < warmup,
            "loss": sum(losses) / W,
            "losses": losses,
            "time_s": dt,
            "tokens_per_s": W * batch * seq / dt,
        }
        if device.type == "cuda":
            rec["peak_gib"] = [float(s[1]) for s in everyone]
        records.append(rec)
        log(
            f"step {step + 1}/{steps}{' (warm-up)' if rec['warmup'] else ''}: loss {rec['loss']:.4f}  {dt:.2f} s  "
            f"{rec['tokens_per_s']:,.0f} tokens/s ({rec['tokens_per_s'] / W:,.0f} per GPU)"
            + (f"  peak {max(rec['peak_gib']):.2f} GiB (largest of {W} GPUs)" if "peak_gib" in rec else "")
        )
    return records


def rank_memory(model) -> dict:
    """This rank's storage (:func:`qwen3_30b_qlora.memory_breakdown` of its local tensors) and what it
    holds of the experts."""
    from moeyard.quant import NF4Experts

    mem = single.memory_breakdown(model)
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    mem["non_expert_bytes"] = sum(
        local(p).numel() * p.element_size() for n, p in model.named_parameters() if "lora_" not in n
    )
    mem["lora_bytes"] = sum(local(p).numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n)
    mem["experts_per_layer"] = sorted({m.shape[0] for m in model.modules() if isinstance(m, NF4Experts)})
    return mem


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="qwen3-235b-a22b", choices=sorted(ARCHS), help="the architecture")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default all: 94 or 61; --tiny: 2 or 3)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 4096; --tiny: 32)")
    ap.add_argument("--batch", type=int, default=2, help="sequences per GPU (default 2)")
    ap.add_argument("--steps", type=int, default=5, help="training steps, the first two warm-up (default 5)")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    ap.add_argument("--device", default=None, help="cuda (default when available: cuda:LOCAL_RANK) or cpu")
    ap.add_argument(
        "--dtype",
        default=None,
        choices=("bfloat16", "float16", "float32"),
        help="base weights (default bfloat16; --tiny: float32)",
    )
    ap.add_argument("--lora-dtype", default="float32", choices=("bfloat16", "float32"))
    ap.add_argument(
        "--dispatcher",
        default="all_to_all",
        choices=("all_to_all", "sync_free", "all_gather"),
        help="expert-parallel dispatcher (default all_to_all: exact sizes, one host sync per layer)",
    )
    ap.add_argument("--loss-chunk", type=int, default=1024, help="tokens per lm_head/cross-entropy chunk")
    ap.add_argument("--attn", default="sdpa", help="attn_implementation (default sdpa)")
    ap.add_argument(
        "--fsdp",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="shard the non-expert weights with FSDP2 (default on)",
    )
    ap.add_argument("--no-checkpointing", action="store_true", help="disable activation checkpointing")
    ap.add_argument("--tiny", action="store_true", help="scaled-down config for CPU checks (float32)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="folder (or .json path) for the summary JSON (rank 0)")
    args = ap.parse_args(argv)

    bitsandbytes = require_bitsandbytes()
    device = init_distributed(args.device)
    try:
        return run(args, device, bitsandbytes.__version__)
    finally:
        dist.destroy_process_group()


def run(args, device: torch.device, bnb_version: str) -> dict:
    import peft
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    W, rank = dist.get_world_size(), dist.get_rank()
    log = print if rank == 0 else (lambda *a, **k: None)
    arch = ARCHS[args.model]
    base_cfg = arch.tiny if args.tiny else arch.config
    n_experts = base_cfg[arch.experts_key]
    layers = args.layers or base_cfg["num_hidden_layers"]
    seq = args.seq or (32 if args.tiny else 4096)
    dtype = getattr(torch, args.dtype or ("float32" if args.tiny else "bfloat16"))
    lora_dtype = getattr(torch, args.lora_dtype)
    warmup = min(2, max(args.steps - 1, 0))
    if n_experts % W:
        raise SystemExit(f"--nproc-per-node: {W} does not divide the {n_experts} experts")
    name = args.model + ("-tiny" if args.tiny else "")
    versions = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "bitsandbytes": bnb_version,
        "moeyard": getattr(moeyard, "__version__", None),
    }
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    log(
        f"{name}: {layers} layers on {W} ranks (expert parallel, {n_experts // W} experts each"
        f"{', FSDP2 for the rest' if args.fsdp else ''}), batch {args.batch} x {seq} tokens per rank (random ids, "
        f"repeated), {dtype} base, {lora_dtype} LoRA r={LORA_RANK}, {device}{f' ({gpu})' if gpu else ''}, backend "
        f"{moeyard.get_backend()}; {versions}"
    )

    mesh = init_device_mesh(device.type, (1, W), mesh_dim_names=("dp", "ep"))
    model, build_info = build(
        base_cfg,
        arch=arch,
        layers=layers,
        device=device,
        dtype=dtype,
        lora_dtype=lora_dtype,
        attn=args.attn,
        group=mesh["ep"].get_group(),
        dispatcher=args.dispatcher,
        seed=args.seed,
        log=log,
    )
    if args.fsdp:
        shard_non_experts(model, mesh)
    model.train()
    if not args.no_checkpointing:
        model.gradient_checkpointing_enable()
    checkpointing = single.is_checkpointing(model.base_model.model)
    mem = rank_memory(model)
    alloc = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None
    log(
        f"built in {build_info['build_s']:.1f} s (NF4 quantisation {build_info['quantize_s']:.1f} s); activation "
        f"checkpointing {checkpointing}"
    )
    log(
        f"rank 0 holds: NF4 experts {mem['nf4_expert_bytes'] / 2**30:.2f} GiB ({mem['experts_per_layer']} experts per "
        f"layer, {mem['nf4_expert_weights'] / 1e9:.2f} B weights); non-expert "
        f"{mem['non_expert_bytes'] / 2**30:.2f} GiB; "
        f"LoRA {mem['lora_bytes'] / 2**30:.2f} GiB {mem['lora_dtype']} (+ as much for gradients, 2x for AdamW)"
        + (f"; allocated {alloc:.2f} GiB" if alloc is not None else "")
    )

    records = train(
        model,
        batch=args.batch,
        seq=seq,
        steps=args.steps,
        warmup=warmup,
        device=device,
        loss_chunk=args.loss_chunk,
        lr=args.lr,
        fsdp=args.fsdp,
        seed=args.seed,
        log=log,
    )
    everyone = [None] * W
    dist.all_gather_object(everyone, mem)
    timed = [r for r in records if not r["warmup"]] or records
    step_s = sum(r["time_s"] for r in timed) / len(timed)
    peak = max((max(r["peak_gib"]) for r in records if "peak_gib" in r), default=None)
    tokens = W * args.batch * seq
    summary = {
        "model": name,
        "config": dict(base_cfg, num_hidden_layers=layers),
        "source": f"{arch.source} (random weights)",
        "world_size": W,
        "expert_parallel": W,
        "fsdp": args.fsdp,
        "dispatcher": args.dispatcher,
        "layers": layers,
        "batch_per_rank": args.batch,
        "seq": seq,
        "tokens_per_step": tokens,
        "data": "one batch of random token ids per rank, repeated every step",
        "dtype": str(dtype),
        "lora_dtype": str(lora_dtype),
        "lora": {
            "r": LORA_RANK,
            "alpha": LORA_ALPHA,
            "target_modules": arch.attn_targets,
            "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        },
        "activation_checkpointing": checkpointing,
        "loss_chunk": args.loss_chunk,
        "attn": args.attn,
        "lr": args.lr,
        "backend": moeyard.get_backend(),
        "device": str(device),
        "gpu": gpu,
        "versions": versions,
        **build_info,
        "memory_per_rank": everyone,
        "allocated_after_build_gib": alloc,
        "steps": records,
        "timed_steps": len(timed),
        "mean_step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "tokens_per_s_per_gpu": tokens / step_s / W,
        "peak_gib_per_gpu": peak,
        "losses_finite": all(math.isfinite(x) for r in records for x in r["losses"]),
        "loss_first": records[0]["loss"] if records else None,
        "loss_last": records[-1]["loss"] if records else None,
    }
    summary["losses_falling"] = bool(records) and records[-1]["loss"] < records[0]["loss"]
    line = (
        f"| {name} QLoRA NF4 r={LORA_RANK} | {W} x {gpu or device.type} EP{W}{' + FSDP2' if args.fsdp else ''} | "
        f"{layers} layers | {args.batch}x{seq} per GPU | {step_s:.2f} s/step | {tokens / step_s:,.0f} tokens/s "
        f"({tokens / step_s / W:,.0f} per GPU) | peak {f'{peak:.2f} GiB' if peak is not None else 'n/a'} per GPU | "
        f"loss {summary['loss_first']:.3f} -> {summary['loss_last']:.3f} |"
    )
    log(line)
    summary["table_line"] = line
    if args.out and rank == 0:
        stem = "qwen3_235b" if args.model.startswith("qwen3") else args.model.replace("-", "_")
        path = args.out if args.out.endswith(".json") else os.path.join(args.out, f"{stem}_qlora.json")
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(summary, f, indent=1)
        log(f"summary: {path}")
    return summary


if __name__ == "__main__":
    main()
    sys.exit(0)
