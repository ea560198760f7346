"""Decoding speed of a transformers decoder stack per experts implementation: ms per generated token.

    python benchmarks/decode.py [--model qwen3-30b-a3b] [--layers 4] [--batch 1,8] [--prompt 128]
        [--new-tokens 32] [--impls moeyard,grouped_mm,batched_mm] [--modes eager,compiled] [--reps 5]
        [--vocab 32768] [--tiny] [--json PATH]

The model is :mod:`moeyard.bench.e2e`'s (``--model``'s attention, router and experts at their real sizes,
``--layers`` layers, every layer MoE, a reduced vocabulary, random weights, bf16 on CUDA, float32 on CPU; ``--tiny``:
:mod:`moeyard.verify`'s tiny configuration), built once per experts implementation with the same seed.
Each row is transformers' greedy ``generate`` over ``batch`` random prompts of ``--prompt`` tokens:

- ``eager``: the default dynamic KV cache, no compilation: every new token is one forward of ``batch``
  tokens issued op by op, where the host's time per op paces small batches;
- ``compiled``: a static KV cache and transformers' automatic compilation of the decoding step
  (``torch.compile``, ``mode="reduce-overhead"``: CUDA graphs, ``fullgraph=True``); the prefill stays eager.

ms per token = (time of ``generate`` with ``--new-tokens`` new tokens - time with 1) / (``--new-tokens`` - 1):
the prefill and the first token cancel out. Medians of ``--reps`` timings each (``time.perf_counter`` after
a synchronisation: ``generate`` ends with one), after two warm-up calls (the compiled mode compiles in them).
tokens/s = ``batch`` / ms per token; graphs: the graphs Dynamo compiled for the row (0 eager; one per shape
compiled, more means recompilation). A failing implementation is a row with its error, not a crash.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from moeyard import bench
from moeyard.bench import e2e as bench_e2e

MODES = ("eager", "compiled")


def build(impl: str, config, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The causal LM of ``config`` under experts implementation ``impl`` (``moeyard[:<backend>]`` or one of
    transformers'), seeded, in eval mode; greedy decoding that never stops early."""
    from transformers import AutoModelForCausalLM

    hf_impl, _, backend = impl.partition(":")
    if hf_impl == "moeyard":  # the named backend, or the default (not one an earlier row named)
        import moeyard

        moeyard.set_backend(backend or None)
    torch.manual_seed(0)
    with torch.device(device), bench_e2e._quiet():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, experts_implementation=hf_impl).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def generate_s(model, prompts: torch.Tensor, new_tokens: int, mode: str) -> float:
    """Seconds of one greedy ``generate`` of ``new_tokens`` tokens (it ends with a device synchronisation)."""
    kw = dict(
        attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
    )
    if mode == "compiled":
        from transformers import CompileConfig

        config = CompileConfig(fullgraph=True)
        config._compile_all_devices = True  # also on a CPU (transformers compiles on CUDA only unless told)
        kw.update(cache_implementation="static", compile_config=config)
    else:
        kw.update(disable_compile=True)
    _sync(prompts.device)
    t0 = time.perf_counter()
    model.generate(prompts, **kw)
    _sync(prompts.device)
    return time.perf_counter() - t0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ms_per_token(model, prompts: torch.Tensor, new_tokens: int, mode: str, reps: int) -> float:
    """(median t(``new_tokens``) - median t(1)) / (``new_tokens`` - 1) over ``reps`` timings each, in ms (module
    docstring).

    Raises:
        RuntimeError: the estimate is not positive (the timings' noise exceeded the decoding time).
    """
    for _ in range(2):
        generate_s(model, prompts, new_tokens, mode)
        generate_s(model, prompts, 1, mode)
    full = [generate_s(model, prompts, new_tokens, mode) for _ in range(reps)]
    first = [generate_s(model, prompts, 1, mode) for _ in range(reps)]
    ms = (statistics.median(full) - statistics.median(first)) / (new_tokens - 1) * 1e3
    if ms <= 0:
        raise RuntimeError(
            f"timing noise exceeded the decoding time ({ms:.3f} ms per token): raise --new-tokens or --reps"
        )
    return ms


def run_impl(impl: str, config, batches: list[int], args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    rows, model = [], None
    try:
        model = build(impl, config, device, dtype)
        gen = torch.Generator(device=device).manual_seed(1)
        for batch in batches:
            prompts = torch.randint(0, config.vocab_size, (batch, args.prompt), device=device, generator=gen)
            for mode in args.modes:
                row = {"impl": impl, "mode": mode, "batch": batch}
                try:
                    torch._dynamo.reset()
                    torch._dynamo.utils.counters.clear()
                    ms = ms_per_token(model, prompts, args.new_tokens, mode, args.reps)
                    row.update(
                        ms_per_token=ms,
                        tokens_per_s=batch / ms * 1e3,
                        graphs=torch._dynamo.utils.counters["stats"]["unique_graphs"],
                    )
                except Exception as ex:  # a failing mode is a row
                    row["error"] = f"{type(ex).__name__}: {(str(ex).strip().splitlines() or [''])[0][:200]}"
                rows.append(row)
                print(_line(row), flush=True)
    except Exception as ex:  # the model did not build
        rows.append({"impl": impl, "error": f"{type(ex).__name__}: {str(ex).strip()[:200]}"})
        print(_line(rows[-1]), flush=True)
    finally:
        del model
        bench.free_memory(str(device))
    return rows


def _line(row: dict) -> str:
    head = f"{row['impl']:<22} {row.get('mode', '-'):<9} batch {row.get('batch', '-'):>4}"
    if "error" in row:
        return f"{head}  error: {row['error']}"
    return f"{head}  {row['ms_per_token']:8.3f} ms/token  {row['tokens_per_s']:9.1f} tokens/s  graphs {row['graphs']}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", default="1,8", help="comma list of prompts per call")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--impls", default="moeyard,grouped_mm,batched_mm")
    p.add_argument("--modes", default="eager,compiled")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--vocab", type=int, default=bench_e2e.DEFAULT_VOCAB)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.modes = args.modes.split(",")
    batches = [int(b) for b in args.batch.split(",")]
    if set(args.modes) - set(MODES) or args.new_tokens < 2 or args.reps < 1 or min(batches) < 1:
        p.error(f"--modes: a subset of {MODES}; --new-tokens >= 2, --reps >= 1, --batch positive")
    device = torch.device(bench.default_device())
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    entry = bench_e2e.get_e2e_model(args.model)
    size = bench_e2e.StepSize(
        layers=args.layers,
        batch=1,
        seq=args.prompt + args.new_tokens,
        vocab=bench_e2e._verify().COMMON["vocab_size"] if args.tiny else args.vocab,
        tiny=args.tiny,
    )
    config = bench_e2e.hf_config(entry, size)
    names, _ = bench_e2e.implementations(args.impls.split(","), False, device)
    env = {
        **bench.versions(),
        **bench.device_info(str(device)),
        "dtype": str(dtype),
        "model": args.model,
        "layers": args.layers,
        "prompt": args.prompt,
        "new_tokens": args.new_tokens,
        "reps": args.reps,
        "vocab": size.vocab,
        "tiny": args.tiny,
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(env), flush=True)
    rows = [r for impl in names for r in run_impl(impl, config, batches, args, device, dtype)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
