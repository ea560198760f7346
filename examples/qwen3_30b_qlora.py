"""QLoRA on the full Qwen3-30B-A3B architecture: NF4 experts, LoRA r=16, gradient checkpointing, one GPU.

What it does:

1. Builds ``Qwen3MoeForCausalLM`` with Qwen3-30B-A3B's configuration (values from
   https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json: 48 layers, hidden 2048, 128
   experts of 768, top-8, vocab 151936, ...) on the meta device, with ``experts_implementation="moeyard"``
   and SDPA attention. **Random weights** (N(0, 0.02), norms at 1): no checkpoint is downloaded, so the
   losses mean nothing; the memory and the speed are those of the real model.
2. Wraps it with PEFT while it is still on the meta device: LoRA r=16, alpha 32, on every layer's
   ``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj`` (``target_parameters``) and on
   ``q_proj``/``k_proj``/``v_proj``/``o_proj`` (``target_modules``). PEFT must wrap first: after
   quantisation the expert weights are ``NF4Experts`` submodules, not parameters, and
   ``target_parameters`` would match nothing.
3. Materialises the model one decoder layer at a time on the device (bf16 base weights, float32 LoRA
   factors: A ~ U(+-1/sqrt(in)), B = 0 as PEFT initialises them), and quantises that layer's experts
   to NF4 (``moeyard.quantize_experts(layer, "nf4")``: bitsandbytes' ``quantize_4bit`` on the tensors'
   device, i.e. on the GPU) before the next layer, so at most one layer's bf16 experts (1.2 GB) exist
   at a time, never the 58 GB of the whole model. ``quantize_experts`` switches the layer's PEFT
   expert wrappers to :func:`moeyard.integrations.peft.fuse_lora`; ``fuse_lora(model)`` is called
   once more at the end (idempotent) so every wrapper is fused.
4. Enables gradient checkpointing (``model.gradient_checkpointing_enable()``: transformers' default,
   non-reentrant, per decoder layer). moeyard's experts dequantise the active experts in the forward,
   again when the checkpoint recomputes the layer, and again in the backward; ``--tiny`` checks that
   the gradients with checkpointing equal those without.
5. Trains: AdamW (fused on CUDA) on the LoRA factors only, batch ``--batch`` x ``--seq`` random token
   ids (uniform over the vocabulary; labels are the next token), ``--steps`` steps of which the first
   two are warm-up (Triton autotuning, allocator growth, AdamW's state) and the rest timed.

The loss. The logits of 4 x 4096 tokens over 151936 words are 10 GB in float32 (5 GB in bf16, plus
the float32 copy the loss makes and its gradient). The script never forms them: it takes the last
hidden states ``[N, 2048]`` from the base model and computes the next-token cross-entropy in chunks
of ``--loss-chunk`` tokens (default 1024) through ``lm_head`` in one autograd function
(:class:`ChunkedLinearCrossEntropy`, the "fused linear cross-entropy" of Liger-Kernel and others):
for each chunk, the bf16 logits, upcast to float32, the log-sum-exp and the target logit give the
chunk's loss, and because ``lm_head`` is frozen the only gradient needed is the one of the hidden
states, ``(softmax - onehot) @ W / n``, computed right there. So one chunk of logits exists at a
time (1024 x 151936: 0.3 GB bf16 + 0.6 GB float32), the backward is a scaling of the saved
``[N, 2048]`` gradient, and no logits are recomputed. (``logits_to_keep`` only helps generation: a
training loss needs every position's logits. Checkpointing chunks of the ordinary loss would work
too, at one more ``lm_head`` matmul per chunk.)

Per step it prints the loss, the time, tokens/s and ``torch.cuda.max_memory_allocated`` (reset each
step); after building, the memory breakdown; at the end one table line and, with ``--out``, a JSON
summary (``<out>/qwen3_30b_qlora.json``, or ``--out`` itself when it ends in ``.json``).

Memory at 48 layers, batch 4 x 4096 (estimate; the run prints the measured numbers): NF4 experts
13.9 GiB (29.0 B weights), bf16 non-expert weights 2.9 GiB (1.54 B), LoRA 0.64 B float32 parameters
2.4 GiB + gradients 2.4 GiB + AdamW 4.8 GiB, checkpointed layer inputs 48 x 64 MiB = 3 GiB, plus one
layer's recomputation and backward (dequantised experts 1.1 GiB, routed rows a few GiB): about 34 GiB
at the peak. ``--lora-dtype bfloat16`` halves the 9.6 GiB of LoRA state if needed.

Run (one H100 80 GB)::

    PYTHONPATH=src python examples/qwen3_30b_qlora.py --out $OUT
    PYTHONPATH=src python examples/qwen3_30b_qlora.py --layers 4 --steps 3   # quick check
    PYTHONPATH=src python examples/qwen3_30b_qlora.py --tiny --steps 2       # CPU, float32, seconds
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn as nn

import moeyard
from moeyard.integrations.peft import fuse_lora
from moeyard.quant import NF4Experts

# https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json
QWEN3_30B_A3B = dict(
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=48,
    num_attention_heads=32,
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
# A scaled-down configuration of the same architecture for CPU checks (float32, seconds).
TINY = dict(
    QWEN3_30B_A3B,
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
LORA_RANK, LORA_ALPHA = 16, 32
ATTN_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
INIT_STD = 0.02


# ---------------------------------------------------------------- the loss


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean next-token cross-entropy of ``hidden @ weight.T`` over the labels that are not
    ``ignore_index``, computed ``chunk`` rows at a time; ``weight`` (``lm_head``) is frozen, so only
    ``hidden`` gets a gradient, computed in the forward chunk by chunk (module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk: int, ignore_index: int = -100):
        n_valid = (labels != ignore_index).sum().clamp(min=1).to(torch.promote_types(hidden.dtype, torch.float32))
        grad = torch.empty_like(hidden) if hidden.requires_grad else None
        total = torch.zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
        for s in range(0, hidden.shape[0], chunk):
            h, y = hidden[s : s + chunk], labels[s : s + chunk]
            logits = h @ weight.T  # [c, V], one chunk
            logits = logits.float() if logits.element_size() < 4 else logits
            valid = y != ignore_index
            y = torch.where(valid, y, 0)
            lse = torch.logsumexp(logits, dim=-1)
            target = logits.gather(1, y[:, None]).squeeze(1)
            total += ((lse - target) * valid).sum()
            if grad is not None:
                p = logits.sub_(lse[:, None]).exp_()  # softmax, in place
                p.scatter_add_(1, y[:, None], torch.full_like(p[:, :1], -1.0))
                p.mul_((valid.to(p.dtype) / n_valid)[:, None])
                grad[s : s + chunk] = (p.to(weight.dtype) @ weight).to(grad.dtype)
            del logits
        ctx.save_for_backward(grad)
        return total / n_valid

    @staticmethod
    def backward(ctx, g):
        (grad,) = ctx.saved_tensors
        return grad * g.to(grad.dtype), None, None, None, None


def chunked_lm_loss(hidden: torch.Tensor, lm_head: nn.Linear, labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """Cross-entropy of ``lm_head(hidden)`` against ``labels`` (``[B, S, H]``, ``[B, S]``, already
    shifted), without forming the ``[B*S, V]`` logits."""
    if lm_head.weight.requires_grad or lm_head.bias is not None:
        raise ValueError("chunked_lm_loss: lm_head must be frozen and bias-free")
    return ChunkedLinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), lm_head.weight, labels.reshape(-1), chunk
    )


# ---------------------------------------------------------------- building


def build_meta_model(config_kwargs: dict, dtype: torch.dtype, attn: str):
    """PEFT-wrapped ``Qwen3MoeForCausalLM`` on the meta device (no memory): LoRA on experts and attention."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(**config_kwargs)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attn, experts_implementation="moeyard"
        )
        targets = [
            f"model.layers.{i}.mlp.experts.{p}"
            for i in range(config.num_hidden_layers)
            for p in ("gate_up_proj", "down_proj")
        ]
        lora = LoraConfig(
            r=LORA_RANK,
            lora_alpha=LORA_ALPHA,
            lora_dropout=0.0,
            target_modules=ATTN_TARGETS,
            target_parameters=targets,
            bias="none",
        )
        model = get_peft_model(model, lora)
    return model


def _materialise(
    module: nn.Module, device: torch.device, dtype: torch.dtype, lora_dtype: torch.dtype, gen: torch.Generator | None
) -> None:
    """Replace every meta parameter directly owned by ``module``'s submodules with a device tensor:
    LoRA A ~ U(+-1/sqrt(in)), LoRA B = 0 (PEFT's default), norms 1, everything else N(0, INIT_STD)."""
    for mname, m in module.named_modules():
        for pname, p in list(m._parameters.items()):
            if p is None or not p.is_meta:
                continue
            full = f"{mname}.{pname}"
            is_lora = ".lora_A." in f".{full}" or ".lora_B." in f".{full}"
            t = torch.empty(p.shape, dtype=lora_dtype if is_lora else dtype, device=device)
            if ".lora_B." in f".{full}":
                t.zero_()
            elif is_lora:
                bound = 1.0 / math.sqrt(p.shape[-1])
                t.uniform_(-bound, bound, generator=gen)
            elif "RMSNorm" in type(m).__name__:
                t.fill_(1.0)
            else:
                t.normal_(0.0, INIT_STD, generator=gen)
            m._parameters[pname] = nn.Parameter(t, requires_grad=p.requires_grad)


def build(
    config_kwargs: dict,
    *,
    layers: int,
    device: torch.device,
    dtype: torch.dtype,
    lora_dtype: torch.dtype,
    attn: str,
    seed: int = 0,
    log=print,
):
    """The PEFT model on ``device``: layer by layer, each layer's experts quantised to NF4 right after
    it is materialised. Returns ``(peft_model, timings)``."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

    cfg = dict(config_kwargs, num_hidden_layers=layers)
    t0 = time.perf_counter()
    model = build_meta_model(cfg, dtype, attn)
    lm = model.base_model.model  # Qwen3MoeForCausalLM
    gen = torch.Generator(device=device).manual_seed(seed)
    # everything outside the decoder layers: embeddings, final norm, lm_head, rotary tables
    for sub in (lm.model.embed_tokens, lm.model.norm, lm.lm_head):
        _materialise(sub, device, dtype, lora_dtype, gen)
    lm.model.rotary_emb = Qwen3MoeRotaryEmbedding(config=lm.config).to(device)
    t_quant = 0.0
    for i, layer in enumerate(lm.model.layers):
        _materialise(layer, device, dtype, lora_dtype, gen)
        _sync(device)
        tq = time.perf_counter()
        moeyard.quantize_experts(layer, "nf4")  # bitsandbytes on the weights' device; fuses the wrappers
        _sync(device)
        t_quant += time.perf_counter() - tq
        if i == 0 or i == layers - 1 or (i + 1) % 12 == 0:
            log(
                f"  layer {i + 1}/{layers} materialised and quantised"
                + (
                    f", {torch.cuda.memory_allocated(device) / 2**30:.2f} GiB allocated"
                    if device.type == "cuda"
                    else ""
                )
            )
    fused = fuse_lora(model)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"still on the meta device: {left[:5]}")
    return model, {"build_s": time.perf_counter() - t0, "quantize_s": t_quant, "fused_experts_modules": fused}


def memory_breakdown(model: nn.Module) -> dict:
    nf4 = [m for m in model.modules() if isinstance(m, NF4Experts)]
    nf4_bytes = sum(m.memory_bytes() for m in nf4)
    nf4_weights = sum(math.prod(m.shape) for m in nf4)
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    base = [p for n, p in model.named_parameters() if "lora_" not in n]
    return {
        "nf4_expert_weights": nf4_weights,
        "nf4_expert_bytes": nf4_bytes,
        "expert_bytes_if_bf16": 2 * nf4_weights,
        "non_expert_params": sum(p.numel() for p in base),
        "non_expert_bytes": sum(p.numel() * p.element_size() for p in base),
        "non_expert_dtype": str(base[0].dtype) if base else None,
        "lora_params": sum(p.numel() for p in lora),
        "lora_bytes": sum(p.numel() * p.element_size() for p in lora),
        "lora_dtype": str(lora[0].dtype) if lora else None,
    }


# ---------------------------------------------------------------- training


def is_checkpointing(lm: nn.Module) -> bool:
    """True when every decoder layer of the causal LM ``lm`` will be checkpointed in training."""

    def on(m):
        return bool(getattr(m, "gradient_checkpointing", False) or getattr(m, "activation_checkpointing", False))

    return bool(lm.model.layers) and all(on(layer) for layer in lm.model.layers)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(
    model,
    *,
    batch: int,
    seq: int,
    steps: int,
    warmup: int,
    device: torch.device,
    loss_chunk: int,
    lr: float = 1e-4,
    seed: int = 0,
    log=print,
) -> list[dict]:
    lm = model.base_model.model
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=device.type == "cuda")
    vocab = lm.config.vocab_size
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    records = []
    for step in range(steps):
        ids = torch.randint(0, vocab, (batch, seq + 1), device=device, generator=gen)  # random token ids
        inputs, labels = ids[:, :-1], ids[:, 1:]
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        t0 = time.perf_counter()
        hidden = lm.model(input_ids=inputs, use_cache=False).last_hidden_state  # [B, S, H]
        loss = chunked_lm_loss(hidden, lm.lm_head, labels, loss_chunk)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        dt = time.perf_counter() - t0
        rec = {
            "step": step + 1,
            "warmup": step < warmup,
            "loss": loss.item(),
            "time_s": dt,
            "tokens_per_s": batch * seq / dt,
        }
        if device.type == "cuda":
            rec["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        records.append(rec)
        log(
            f"step {step + 1}/{steps}{' (warm-up)' if rec['warmup'] else ''}: loss {rec['loss']:.4f}  "
            f"{dt:.2f} s  {rec['tokens_per_s']:,.0f} tokens/s"
            + (f"  peak {rec['peak_gib']:.2f} GiB" if "peak_gib" in rec else "")
        )
    return records


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 48; --tiny: 2)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 4096; --tiny: 64)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5, help="training steps, the first two warm-up (default 5)")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument(
        "--dtype",
        default=None,
        choices=("bfloat16", "float16", "float32"),
        help="base weights (default bfloat16; --tiny: float32)",
    )
    ap.add_argument("--lora-dtype", default="float32", choices=("bfloat16", "float32"))
    ap.add_argument("--loss-chunk", type=int, default=1024, help="tokens per lm_head/cross-entropy chunk")
    ap.add_argument("--attn", default="sdpa", help="attn_implementation (default sdpa)")
    ap.add_argument("--no-checkpointing", action="store_true", help="disable gradient checkpointing")
    ap.add_argument("--tiny", action="store_true", help="scaled-down config for CPU checks (float32)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="folder (or .json path) for the summary JSON")
    args = ap.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    base_cfg = TINY if args.tiny else QWEN3_30B_A3B
    layers = args.layers or base_cfg["num_hidden_layers"]
    seq = args.seq or (64 if args.tiny else 4096)
    dtype = getattr(torch, args.dtype or ("float32" if args.tiny else "bfloat16"))
    lora_dtype = getattr(torch, args.lora_dtype)
    warmup = min(2, max(args.steps - 1, 0))
    torch.manual_seed(args.seed)
    name = "qwen3-30b-a3b" + ("-tiny" if args.tiny else "")

    import bitsandbytes
    import peft
    import transformers

    versions = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "bitsandbytes": bitsandbytes.__version__,
        "moeyard": getattr(moeyard, "__version__", None),
    }
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    print(
        f"{name}: {layers} layers, batch {args.batch} x {seq} tokens (random ids), {dtype} base, "
        f"{lora_dtype} LoRA r={LORA_RANK}, device {device}{f' ({gpu})' if gpu else ''}, backend "
        f"{moeyard.get_backend()}; {versions}"
    )

    model, build_info = build(
        base_cfg, layers=layers, device=device, dtype=dtype, lora_dtype=lora_dtype, attn=args.attn, seed=args.seed
    )
    model.train()
    if not args.no_checkpointing:
        model.gradient_checkpointing_enable()
    lm = model.base_model.model
    checkpointing = is_checkpointing(lm)
    mem = memory_breakdown(model)
    alloc = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None
    print(
        f"built in {build_info['build_s']:.1f} s (NF4 quantisation {build_info['quantize_s']:.1f} s, "
        f"LoRA fused into {build_info['fused_experts_modules']} experts modules); gradient checkpointing {checkpointing}"
    )
    print(
        f"memory: NF4 experts {mem['nf4_expert_bytes'] / 2**30:.2f} GiB ({mem['nf4_expert_weights'] / 1e9:.2f} B "
        f"weights, {mem['expert_bytes_if_bf16'] / 2**30:.2f} GiB in bf16, "
        f"{mem['nf4_expert_bytes'] / max(mem['expert_bytes_if_bf16'], 1):.3f}x); non-expert "
        f"{mem['non_expert_bytes'] / 2**30:.2f} GiB ({mem['non_expert_params'] / 1e9:.3f} B {mem['non_expert_dtype']}); "
        f"LoRA {mem['lora_params'] / 1e6:.1f} M params, {mem['lora_bytes'] / 2**30:.2f} GiB {mem['lora_dtype']} "
        f"(+ the same for gradients, 2x for AdamW)" + (f"; allocated {alloc:.2f} GiB" if alloc is not None else "")
    )

    records = train(
        model,
        batch=args.batch,
        seq=seq,
        steps=args.steps,
        warmup=warmup,
        device=device,
        loss_chunk=args.loss_chunk,
        seed=args.seed,
    )
    timed = [r for r in records if not r["warmup"]] or records
    step_s = sum(r["time_s"] for r in timed) / len(timed)
    peak = max((r.get("peak_gib", 0.0) for r in records), default=0.0) if device.type == "cuda" else None
    summary = {
        "model": name,
        "config": dict(base_cfg, num_hidden_layers=layers),
        "source": "https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json (random weights)",
        "layers": layers,
        "batch": args.batch,
        "seq": seq,
        "tokens_per_step": args.batch * seq,
        "data": "random token ids, uniform over the vocabulary",
        "dtype": str(dtype),
        "lora_dtype": str(lora_dtype),
        "lora": {
            "r": LORA_RANK,
            "alpha": LORA_ALPHA,
            "target_modules": ATTN_TARGETS,
            "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        },
        "gradient_checkpointing": checkpointing,
        "loss_chunk": args.loss_chunk,
        "attn": args.attn,
        "backend": moeyard.get_backend(),
        "device": str(device),
        "gpu": gpu,
        "versions": versions,
        **build_info,
        "memory": mem,
        "allocated_after_build_gib": alloc,
        "steps": records,
        "timed_steps": len(timed),
        "mean_step_s": step_s,
        "tokens_per_s": args.batch * seq / step_s,
        "peak_gib": peak,
        "losses_finite": all(math.isfinite(r["loss"]) for r in records),
    }
    line = (
        f"| {name} QLoRA NF4 r={LORA_RANK} | {layers} layers | {args.batch}x{seq} | {step_s:.2f} s/step | "
        f"{summary['tokens_per_s']:,.0f} tokens/s | peak {peak:.2f} GiB |"
        if peak is not None
        else f"| {name} QLoRA NF4 r={LORA_RANK} | {layers} layers | {args.batch}x{seq} | {step_s:.2f} s/step | "
        f"{summary['tokens_per_s']:,.0f} tokens/s | peak n/a ({device}) |"
    )
    print(line)
    summary["table_line"] = line
    if args.out:
        path = args.out if args.out.endswith(".json") else os.path.join(args.out, "qwen3_30b_qlora.json")
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(summary, f, indent=1)
        print(f"summary: {path}")
    summary["_model"] = model  # for in-process callers (tests); not serialised
    return summary


if __name__ == "__main__":
    main()
    sys.exit(0)
