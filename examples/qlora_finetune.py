"""QLoRA fine-tuning of a small Qwen3-MoE model with moeyard, checked against PEFT's own path.

What it does, offline (no download at any point):

1. **Data.** Two real text corpora that ship with every CPython installation, tokenised as UTF-8
   bytes (vocabulary 256 bytes + BOS + EOS, no tokenizer files):

   - *pre-training*: the docstrings of ~30 standard-library modules and their public classes and
     functions (about 200 KB of English technical prose);
   - *fine-tuning*: the Python source code of a few other standard-library modules (a different
     domain: code, not prose), its last 10 % held out for evaluation.

2. **Base model.** A Qwen3-MoE-architecture causal LM built from a transformers ``Qwen3MoeConfig``
   (``--size tiny``: 0.16 M parameters, 8 experts, top-2, for CI; ``--size small``: 13.5 M parameters,
   32 experts, top-4), randomly initialised and then **pre-trained briefly** (all parameters,
   float32 on CPU / bfloat16 on CUDA, ``--base-steps``) on the prose corpus. A LoRA fine-tune of pure
   noise would mostly teach the adapters byte frequencies; a base that already models English bytes
   makes the fine-tune a domain adaptation (prose -> code), which is what QLoRA is used for.
   ``--base-steps 0`` fine-tunes from random initialisation instead.

3. **Three fine-tunes** from that same base, with the same LoRA initialisation, the same seed and
   the same batches in the same order, through PEFT
   (``LoraConfig(r=16, target_parameters=[every experts module's gate_up_proj / down_proj],
   target_modules=[q_proj, k_proj, v_proj, o_proj])``):

   - ``qlora_nf4``: experts stored as NF4 (``moeyard.quantize_experts``), LoRA through moeyard's
     kernels (``experts_implementation="moeyard"``, ``fuse_lora``);
   - ``lora_moeyard``: dense experts in the run's dtype, LoRA through moeyard (``fuse_lora``);
   - ``lora_peft``: PEFT's default path on transformers' own experts (``--reference eager`` or
     ``grouped_mm``), no moeyard at all.

4. **Check.** ``lora_moeyard`` and ``lora_peft`` compute the same function with the same data and
   initialisation, so their losses may differ only by rounding: the script fails (exit code 1)
   unless ``max |loss_moeyard - loss_peft|`` over the first ``--compare-steps`` steps is at most
   ``TOLERANCE[dtype]`` (see there). ``qlora_nf4`` differs by the NF4 quantisation error of the
   expert weights; its loss must still decrease (mean of the last quarter of the steps below the
   mean of the first quarter, and the held-out loss after fine-tuning below the one before).

5. **Output** (``--out DIR``): ``losses.json`` (configuration, the three loss lists, held-out losses
   before and after, the check) and ``loss_curves.png`` (needs matplotlib: ``pip install -e
   ".[examples]"``).

Run::

    PYTHONPATH=src python examples/qlora_finetune.py --device cpu --size tiny --out runs/tiny
    PYTHONPATH=src python examples/qlora_finetune.py --device cuda --size small --steps 300 --out runs/small
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import moeyard
from moeyard.integrations.peft import fuse_lora
from moeyard.verify import quiet_transformers

BOS, EOS, VOCAB = 256, 257, 258
PROSE_MODULES = (
    "collections",
    "functools",
    "itertools",
    "json",
    "re",
    "string",
    "argparse",
    "pathlib",
    "subprocess",
    "threading",
    "unittest",
    "logging",
    "typing",
    "dataclasses",
    "random",
    "decimal",
    "csv",
    "pickle",
    "shutil",
    "tempfile",
    "contextlib",
    "abc",
    "enum",
    "inspect",
    "queue",
    "socket",
    "datetime",
    "calendar",
    "zipfile",
    "tarfile",
)
CODE_MODULES = ("heapq", "bisect", "textwrap", "difflib", "statistics", "fractions", "colorsys", "shlex")
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
RUNS = ("qlora_nf4", "lora_moeyard", "lora_peft")
LABELS = {
    "qlora_nf4": "QLoRA, NF4 experts (moeyard)",
    "lora_moeyard": "LoRA (moeyard, fuse_lora)",
    "lora_peft": "LoRA (PEFT default, no moeyard)",
}
STYLES = {"qlora_nf4": dict(lw=2), "lora_moeyard": dict(lw=2), "lora_peft": dict(ls="--", lw=1.5)}

# Tolerance of max |loss_moeyard - loss_peft| over the first --compare-steps steps. The two runs
# differ only in the order of floating-point operations inside the experts (grouped GEMMs vs a
# per-expert loop), a relative error of a few units of the dtype's epsilon per step (float32: 1.2e-7,
# bfloat16: 7.8e-3). Adam normalises each update, so a rounding-sized gradient difference can become
# a step-sized weight difference where a gradient is near zero; over ~20 steps this stays far below
# a bad kernel's effect (a wrong LoRA term, scaling or routing weight moves the loss by >= 0.1 within
# a few steps). Measured: 2.4e-7 on the float32 tiny run (40 steps). Loss values are ~2-5 nats.
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2}


@dataclass(frozen=True)
class Size:
    """Model shape and default schedule of one ``--size``."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    experts: int
    top_k: int
    moe_intermediate: int
    seq: int
    batch: int
    steps: int
    base_steps: int


SIZES = {
    "tiny": Size(
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        experts=8,
        top_k=2,
        moe_intermediate=32,
        seq=64,
        batch=8,
        steps=40,
        base_steps=200,
    ),
    "small": Size(
        hidden=256,
        layers=4,
        heads=8,
        kv_heads=4,
        experts=32,
        top_k=4,
        moe_intermediate=128,
        seq=256,
        batch=16,
        steps=200,
        base_steps=400,
    ),
}


# ------------------------------------------------------------------------------------------ data


def encode(text: str) -> list[int]:
    """A document as byte ids, ``BOS ... EOS``."""
    return [BOS, *text.encode("utf-8"), EOS]


def decode(ids) -> str:
    """Byte ids back to text (specials dropped, invalid UTF-8 replaced)."""
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def stdlib_docstrings(names=PROSE_MODULES) -> list[str]:
    """The docstrings of the modules ``names`` and of their public classes and functions, in a fixed
    order (English prose). Raises ``RuntimeError`` when Python runs with ``-OO`` (no docstrings)."""
    docs = []
    for name in names:
        module = importlib.import_module(name)
        docs.append(inspect.getdoc(module) or "")
        for attr, value in sorted(vars(module).items()):
            if not attr.startswith("_") and getattr(value, "__module__", None) == name:
                docs.append(inspect.getdoc(value) or "")
    docs = [d for d in docs if d]
    if sum(map(len, docs)) < 10_000:
        raise RuntimeError("the standard library's docstrings are missing (python -OO?): no pre-training corpus")
    return docs


def stdlib_sources(names=CODE_MODULES) -> list[str]:
    """The Python source code of the modules ``names`` (one document each)."""
    return [inspect.getsource(importlib.import_module(name)) for name in names]


def token_stream(docs: list[str]) -> torch.Tensor:
    """All documents as one int64 stream of byte ids."""
    return torch.tensor([t for doc in docs for t in encode(doc)], dtype=torch.long)


def split(stream: torch.Tensor, held_out: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, eval)``: the last ``held_out`` fraction of the stream is the evaluation part."""
    cut = int(len(stream) * (1 - held_out))
    return stream[:cut], stream[cut:]


def batches(stream: torch.Tensor, n: int, batch: int, seq: int, seed: int) -> list[torch.Tensor]:
    """``n`` batches ``[batch, seq]`` of windows at seeded random offsets: the fixed data order that
    every run replays."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(stream) - seq, (n, batch), generator=gen)
    return [torch.stack([stream[s : s + seq] for s in row.tolist()]) for row in starts]


# ----------------------------------------------------------------------------------------- model


def qwen3_moe_config(size: Size):
    """A ``Qwen3MoeConfig`` of ``size`` over the byte vocabulary."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=size.hidden,
        intermediate_size=4 * size.hidden,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        head_dim=size.hidden // size.heads,
        num_experts=size.experts,
        num_experts_per_tok=size.top_k,
        moe_intermediate_size=size.moe_intermediate,
        norm_topk_prob=True,
        max_position_embeddings=size.seq,
        tie_word_embeddings=False,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=None,
    )


def build_model(config, *, experts_implementation: str, dtype: torch.dtype, device: str, state=None):
    """A ``Qwen3MoeForCausalLM`` of ``config`` (eager attention) running the given experts
    implementation, loaded from ``state`` when given, in ``dtype`` on ``device``, in train mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32, experts_implementation=experts_implementation
    )
    if state is not None:
        model.load_state_dict(state)
    return model.to(device=device, dtype=dtype).train()


def expert_targets(model) -> list[str]:
    """``target_parameters`` for every experts module's ``gate_up_proj`` and ``down_proj``."""
    return sorted(
        f"{name}.{p}"
        for name, m in model.named_modules()
        if hasattr(m, "has_gate")
        for p in ("gate_up_proj", "down_proj")
    )


def add_lora(model, *, rank: int, seed: int):
    """PEFT LoRA of ``rank`` on the experts' 3-D weights and the attention projections, initialised
    from ``seed`` (the same adapters for every run)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=ATTENTION, target_parameters=expert_targets(model)
    )
    torch.manual_seed(seed)
    return get_peft_model(model, config)


# -------------------------------------------------------------------------------------- training


def progress():
    """A rich progress bar with the running loss."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description:<14}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TimeElapsedColumn(),
        transient=False,
    )


def train(model, data: list[torch.Tensor], *, lr: float, name: str, bar) -> list[float]:
    """AdamW on the trainable parameters over ``data`` (next-byte cross-entropy); the losses."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    device = next(model.parameters()).device
    task = bar.add_task(name, total=len(data), loss=float("nan"))
    losses = []
    for ids in data:
        ids = ids.to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.update(task, advance=1, loss=losses[-1])
    return losses


@torch.no_grad()
def evaluate(model, data: list[torch.Tensor]) -> float:
    """Mean next-byte loss over ``data`` (train mode kept: there is no dropout)."""
    device = next(model.parameters()).device
    return sum(model(input_ids=ids.to(device), labels=ids.to(device)).loss.item() for ids in data) / len(data)


def pretrain_base(config, data, *, dtype, device, lr: float, bar) -> tuple[dict, list[float]]:
    """Train all parameters of a fresh model on ``data``; its float32 state dict and losses."""
    torch.manual_seed(0)
    model = build_model(config, experts_implementation="moeyard", dtype=dtype, device=device)
    losses = train(model, data, lr=lr, name="base (all)", bar=bar) if data else []
    return {k: v.float().cpu() for k, v in model.state_dict().items()}, losses


def finetune_model(run: str, config, base: dict, *, dtype, device, rank: int, seed: int, reference: str):
    """The PEFT model of ``run`` (see the module docstring) on top of ``base``."""
    impl = reference if run == "lora_peft" else "moeyard"
    model = add_lora(
        build_model(config, experts_implementation=impl, dtype=dtype, device=device, state=base), rank=rank, seed=seed
    )
    if run == "qlora_nf4":
        moeyard.quantize_experts(model, "nf4")  # the PEFT expert wrappers switch to fuse_lora here
    elif run == "lora_moeyard":
        fuse_lora(model)
    return model


# ----------------------------------------------------------------------------------------- checks


def check(losses: dict[str, list[float]], evals: dict[str, dict], *, dtype, compare_steps: int) -> dict:
    """The pass/fail criteria of the module docstring, as a dict with ``ok``."""
    a, b = losses["lora_moeyard"][:compare_steps], losses["lora_peft"][:compare_steps]
    diff = max(abs(x - y) for x, y in zip(a, b, strict=True))
    q = losses["qlora_nf4"]
    quarter = max(1, len(q) // 4)
    first, last = sum(q[:quarter]) / quarter, sum(q[-quarter:]) / quarter
    finite = all(math.isfinite(x) for run in losses.values() for x in run)
    result = dict(
        max_abs_diff_moeyard_vs_peft=diff,
        tolerance=TOLERANCE[dtype],
        compare_steps=len(a),
        qlora_first_quarter_mean=first,
        qlora_last_quarter_mean=last,
        all_finite=finite,
    )
    held_out = evals["qlora_nf4"]
    result["qlora_held_out_before_after"] = [held_out["before"], held_out["after"]]
    result["ok"] = finite and diff <= TOLERANCE[dtype] and last < first and held_out["after"] < held_out["before"]
    return result


def plot(losses: dict[str, list[float]], base_losses: list[float], path: Path, *, title: str, tolerance: float) -> None:
    """The loss curves as a PNG: the base pre-training (when there was one), the three fine-tunes, and
    each moeyard run's loss minus the PEFT-only run's (with the check's tolerance band)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as ex:
        raise ImportError(
            "the loss plot needs matplotlib: pip install matplotlib "
            '(or pip install -e ".[examples]"), or pass --no-plot'
        ) from ex
    panels = 3 if base_losses else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.5))
    if base_losses:
        axes[0].plot(range(1, len(base_losses) + 1), base_losses, color="gray")
        axes[0].set(xlabel="pre-training step", ylabel="next-byte loss (nats)", title="base: stdlib docstrings")
    ax, diff = axes[-2], axes[-1]
    steps = range(1, len(losses["lora_peft"]) + 1)
    for run in RUNS:
        ax.plot(steps, losses[run], label=LABELS[run], **STYLES[run])
    ax.set(xlabel="fine-tuning step", ylabel="next-byte loss (nats)", title=title)
    ax.legend(fontsize=8)
    for run in RUNS[:2]:
        diff.plot(
            steps,
            [a - b for a, b in zip(losses[run], losses["lora_peft"], strict=True)],
            label=LABELS[run],
            **STYLES[run],
        )
    diff.axhspan(
        -tolerance, tolerance, color="green", alpha=0.15, label=f"check tolerance (moeyard LoRA) +-{tolerance:g}"
    )
    diff.axhline(0, color="black", lw=0.5)
    diff.set(xlabel="fine-tuning step", ylabel="loss - loss(PEFT default)", title="difference from PEFT's path")
    diff.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -------------------------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (see ``--help``)."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--steps", type=int, default=None, help="fine-tuning steps (default: the size's)")
    p.add_argument(
        "--base-steps",
        type=int,
        default=None,
        help="pre-training steps of the base, 0 = fine-tune random init (default: the size's)",
    )
    p.add_argument("--compare-steps", type=int, default=20, help="steps over which runs 2 and 3 must agree")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3, help="fine-tuning learning rate")
    p.add_argument("--base-lr", type=float, default=3e-3)
    p.add_argument(
        "--reference",
        choices=["eager", "grouped_mm"],
        default="eager",
        help="transformers' experts implementation of the PEFT-only run",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: 1 for --size tiny on CPU, whose operations are too small "
        "for intra-op parallelism to pay, else torch's default)",
    )
    p.add_argument("--out", type=Path, default=Path("runs/qlora_finetune"))
    p.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    """Pre-train the base, run the three fine-tunes, check, write ``--out``; the results dict."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    size = SIZES[args.size]
    steps = size.steps if args.steps is None else args.steps
    base_steps = size.base_steps if args.base_steps is None else args.base_steps
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    threads = args.threads or (1 if args.size == "tiny" and args.device == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    config = qwen3_moe_config(size)

    prose_train, _ = split(token_stream(stdlib_docstrings()))
    code_train, code_eval = split(token_stream(stdlib_sources()))
    base_data = batches(prose_train, base_steps, size.batch, size.seq, seed=args.seed)
    tune_data = batches(code_train, steps, size.batch, size.seq, seed=args.seed + 1)
    eval_data = batches(code_eval, 4, size.batch, size.seq, seed=args.seed + 2)

    start = time.perf_counter()
    losses, evals = {}, {}
    with quiet_transformers(), progress() as bar:
        base, base_losses = pretrain_base(config, base_data, dtype=dtype, device=args.device, lr=args.base_lr, bar=bar)
        for name in RUNS:
            model = finetune_model(
                name,
                config,
                base,
                dtype=dtype,
                device=args.device,
                rank=args.rank,
                seed=args.seed,
                reference=args.reference,
            )
            before = evaluate(model, eval_data)
            losses[name] = train(model, tune_data, lr=args.lr, name=name, bar=bar)
            evals[name] = dict(before=before, after=evaluate(model, eval_data))
    seconds = time.perf_counter() - start

    result = dict(
        config=dict(
            **{**asdict(size), "steps": steps, "base_steps": base_steps},
            device=args.device,
            dtype=str(dtype),
            rank=args.rank,
            lr=args.lr,
            base_lr=args.base_lr,
            seed=args.seed,
            reference=args.reference,
            parameters=sum(v.numel() for v in base.values()),
        ),
        base_losses=base_losses,
        losses=losses,
        eval=evals,
        seconds=seconds,
        check=check(losses, evals, dtype=dtype, compare_steps=args.compare_steps),
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "losses.json").write_text(json.dumps(result, indent=1))
    if not args.no_plot:
        plot(
            losses,
            base_losses,
            args.out / "loss_curves.png",
            tolerance=TOLERANCE[dtype],
            title=f"Qwen3-MoE {args.size}, LoRA r={args.rank} on stdlib code, {str(dtype).removeprefix('torch.')}",
        )
    return result


def report(result: dict) -> None:
    """A summary table of the runs and the check."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"fine-tune ({result['config']['parameters']:,} parameters, {result['seconds']:.1f} s)")
    for col in ("run", "first loss", "last loss", "held-out before", "held-out after"):
        table.add_column(col, justify="right" if col != "run" else "left")
    for name, run_losses in result["losses"].items():
        ev = result["eval"][name]
        table.add_row(name, *(f"{x:.4f}" for x in (run_losses[0], run_losses[-1], ev["before"], ev["after"])))
    console = Console()
    console.print(table)
    c = result["check"]
    console.print(
        f"max |lora_moeyard - lora_peft| over {c['compare_steps']} steps: "
        f"{c['max_abs_diff_moeyard_vs_peft']:.2e} (tolerance {c['tolerance']:.0e}); "
        f"qlora_nf4 quarter means {c['qlora_first_quarter_mean']:.4f} -> {c['qlora_last_quarter_mean']:.4f}: "
        + ("[green]OK[/green]" if c["ok"] else "[red]FAILED[/red]")
    )


def main(argv=None) -> int:
    """Entry point; exit code 1 when the check fails."""
    result = run(parse_args(argv))
    report(result)
    return 0 if result["check"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
