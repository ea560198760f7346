"""Pre-training a small Qwen3-MoE on real text under each FP8 recipe: do the loss curves stay within
the run-to-run noise of the compute dtype?

Data and model are those of ``examples/qlora_finetune.py`` (offline: the docstrings of ~30 standard
library modules as UTF-8 bytes; a transformers ``Qwen3MoeConfig`` of ``--size``, every experts module on
``experts_implementation="moeyard"``). Runs, all from the same initial weights and the same batches in the
same order, all parameters trained with AdamW:

- ``bf16`` (the compute dtype: bfloat16 on CUDA, float32 on CPU) from ``--seeds`` initialisation seeds
  (default 3): the largest gap between two of them is the run-to-run noise;
- each recipe of ``--recipes`` (default ``fp8_rowwise,mxfp8``) from seed 0, under ``moeyard.use_recipe``
  (the experts' GEMMs, forward and backward; attention, router and embeddings stay in the compute dtype).

The check: for each recipe, the gap to ``bf16 seed 0`` (the mean of ``|loss(recipe) - loss(bf16, seed 0)|``
over the last half of the steps, losses smoothed over 10 steps) is at most the noise (exit code 1
otherwise). Output (``--out DIR``): ``fp8_losses.json`` and ``fp8_loss_curves.png`` (matplotlib).

Run::

    PYTHONPATH=src python examples/fp8_train.py --device cpu --size tiny --out runs/fp8-tiny
    PYTHONPATH=src python examples/fp8_train.py --device cuda --size small --steps 300 --out runs/fp8-small
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import moeyard

sys.path.insert(0, str(Path(__file__).resolve().parent))
import qlora_finetune as data_and_model  # noqa: E402  (the corpus, the model config and the training loop)


def smooth(losses: list[float], window: int = 10) -> list[float]:
    """Trailing mean over ``window`` steps."""
    out, acc = [], 0.0
    for i, v in enumerate(losses):
        acc += v - (losses[i - window] if i >= window else 0.0)
        out.append(acc / min(i + 1, window))
    return out


def gap(a: list[float], b: list[float]) -> float:
    """Mean ``|a - b|`` of the smoothed losses over the last half of the steps."""
    sa, sb = smooth(a), smooth(b)
    half = len(sa) // 2
    return sum(abs(x - y) for x, y in zip(sa[half:], sb[half:], strict=True)) / max(1, len(sa) - half)


def run_one(config, data, *, seed: int, recipe: str | None, dtype, device, lr: float, bar) -> list[float]:
    torch.manual_seed(seed)
    model = data_and_model.build_model(config, experts_implementation="moeyard", dtype=dtype, device=device)
    with moeyard.use_recipe(recipe):
        return data_and_model.train(model, data, lr=lr, name=recipe or f"bf16 seed {seed}", bar=bar)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, losses in result["losses"].items():
        ax.plot(
            smooth(losses),
            label=f"{name} (gap {result['gaps'].get(name, 0):.4f})" if name in result["gaps"] else name,
            lw=1.5,
            ls="--" if "seed 1" in name else "-",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("next-byte loss (10-step mean)")
    ax.set_title(
        f"Qwen3-MoE {result['size']} pre-training on {result['device']}, {result['dtype']}: "
        "FP8 recipes vs. run-to-run noise",
        fontsize=10,
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size", default="tiny", choices=list(data_and_model.SIZES))
    p.add_argument("--steps", type=int, help="default: the size's base_steps")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--recipes", default="fp8_rowwise,mxfp8")
    p.add_argument("--seeds", type=int, default=3, help="bf16 runs from this many initialisation seeds (>= 2)")
    p.add_argument("--out", default="runs/fp8")
    args = p.parse_args(argv)
    size = data_and_model.SIZES[args.size]
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    steps = args.steps or size.base_steps
    stream = data_and_model.token_stream(data_and_model.stdlib_docstrings())
    data = data_and_model.batches(stream, steps, size.batch, size.seq, seed=1)
    config = data_and_model.qwen3_moe_config(size)
    losses = {}
    with data_and_model.progress() as bar:
        for seed in range(max(2, args.seeds)):
            losses[f"bf16 seed {seed}"] = run_one(
                config, data, seed=seed, recipe=None, dtype=dtype, device=args.device, lr=args.lr, bar=bar
            )
        for recipe in [r for r in args.recipes.split(",") if r]:
            losses[recipe] = run_one(
                config, data, seed=0, recipe=recipe, dtype=dtype, device=args.device, lr=args.lr, bar=bar
            )
    bf16 = [k for k in losses if k.startswith("bf16")]
    noise = max(gap(losses[a], losses[b]) for i, a in enumerate(bf16) for b in bf16[i + 1 :])
    gaps = {name: gap(v, losses["bf16 seed 0"]) for name, v in losses.items() if name != "bf16 seed 0"}
    result = {
        "size": args.size,
        "device": args.device,
        "dtype": str(dtype).replace("torch.", ""),
        "steps": steps,
        "lr": args.lr,
        "noise": noise,
        "gaps": gaps,
        "losses": losses,
        "final": {name: sum(v[-10:]) / len(v[-10:]) for name, v in losses.items()},
    }
    result["ok"] = all(g <= noise for name, g in gaps.items() if not name.startswith("bf16"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_losses.json").write_text(json.dumps(result, indent=1))
    try:
        plot(result, out / "fp8_loss_curves.png")
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
    print(
        f"run-to-run noise (largest gap between bf16 seeds): {noise:.4f}; last-10-step losses: "
        + ", ".join(f"{k} {v:.4f}" for k, v in result["final"].items())
    )
    for name, g in gaps.items():
        if not name.startswith("bf16"):
            print(f"{name}: gap to bf16 seed 0 {g:.4f} ({'within' if g <= noise else 'OUTSIDE'} the noise)")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
