"""The results of ``moeyard bench`` (every mode) and the model registry as rich tables."""

from __future__ import annotations

from rich.table import Table

from .models import MODELS
from .plot import case_label, result_mode


def result_table(result: dict) -> Table:
    """The table of a result of any mode (:func:`moeyard.bench.plot.result_mode`)."""
    mode = result_mode(result)
    return {"layer": results_table, "lora": lora_table, "e2e": e2e_table}[mode](result)


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def results_table(result: dict) -> Table:
    """The results as a rich table; the run's environment in the title and caption."""
    env = result["env"]
    cap = f" (sm {env['capability']})" if env["capability"] else ""
    dense = env.get("dense_bf16_tflops")
    routing = env["routing"] + (f" (alpha {env['zipf_alpha']})" if env["zipf_alpha"] else "")
    title = (
        f"moeyard bench · {env['device']}{cap} · {env['dtype']} · routing {routing}\n"
        f"torch {env['torch']} · triton {env['triton']} · moeyard {env['moeyard']} · "
        f"python {env['python']} · {env['date']}"
    )
    caption = [
        f"$ {env['command']}" if env["command"] else "",
        f"dense bf16 matmul (8192^3) this run: {dense:.0f} TFLOP/s" if dense else "",
        f"dense e4m3 matmul (8192^3, rowwise scales) this run: {env['dense_fp8_tflops']:.0f} TFLOP/s"
        if env.get("dense_fp8_tflops")
        else "",
        "FLOPs: fwd = 6*T*k*H*I (gated; 4* plain) + shared experts, fwd+bwd = 3x fwd, router not counted; "
        f"median of {env['iters']} after {env['warmup']} warm-up; peak = extra GiB of fwd+bwd",
        f"--grad-accum {env['accumulate']}: ms per step of blocks of {env['accumulate']} steps, each block in one "
        "moeyard.cache_fp8_weights() (FP8 weights cast once per block)"
        if env.get("accumulate", 1) > 1
        else "",
        "--cuda-graph: each row's fwd and fwd+bwd captured in a CUDA graph, the replays timed (no host launch "
        "work; the first input set); peak includes the graph's memory pool"
        if env.get("cuda_graph")
        else "",
        *[f"{name} skipped: {why}" for name, why in env.get("skipped", {}).items()],
        _trace_line(result),
        *peer_ratio_lines(result["rows"]),
        env.get("framework_note", ""),
    ]
    return _case_table(
        title,
        caption,
        (
            "case (T,H,I,E,k)",
            "impl",
            "fwd ms",
            "fwd TFLOP/s",
            "fwd+bwd ms",
            "fwd+bwd TFLOP/s",
            "peak GiB",
            "load max/mean",
            "note",
        ),
        result["rows"],
        _cells,
    )


def peer_ratio_lines(rows: list[dict]) -> list[str]:
    """One caption line per case with moeyard and peer rows: each moeyard implementation's speed-up
    over each peer, ``peer ms / moeyard ms`` for forward+backward (and forward), > 1: moeyard faster."""
    lines = []
    for case in dict.fromkeys(r["case"] for r in rows):
        ok = [r for r in rows if r["case"] == case and "error" not in r and r.get("fwdbwd_ms")]
        ours = [r for r in ok if r.get("kind") == "moeyard"]
        peers = [r for r in ok if r.get("kind") == "peer"]
        for r in ours if peers else []:
            vs = ", ".join(
                f"{p['impl']} {p['fwdbwd_ms'] / r['fwdbwd_ms']:.2f}x ({p['fwd_ms'] / r['fwd_ms']:.2f}x)" for p in peers
            )
            lines.append(f"{case}: {r['impl']} vs {vs} (fwd+bwd (fwd) speed-up, > 1: {r['impl']} faster)")
    return lines


def lora_table(result: dict) -> Table:
    """The ``--lora`` results (:mod:`moeyard.bench.lora`) as a rich table."""
    env = result["env"]
    dense = env.get("dense_bf16_tflops")
    stack = f" --quant {env['quant']} ({env['layers']} layers)" if env.get("quant") else ""
    title = (
        f"moeyard bench --lora {env['lora_rank']}{stack} · {env['device']} · {env['dtype']} · routed experts, "
        f"base frozen\ntorch {env['torch']} · triton {env['triton']} · moeyard {env['moeyard']} · {env['date']}"
    )
    caption = [
        f"$ {env['command']}" if env["command"] else "",
        f"dense bf16 matmul (8192^3) this run: {dense:.0f} TFLOP/s" if dense else "",
        f"dense e4m3 matmul (8192^3, rowwise scales) this run: {env['dense_fp8_tflops']:.0f} TFLOP/s"
        if env.get("dense_fp8_tflops")
        else "",
        "step = forward + backward (input gradient; LoRA factor gradients where adapted); FLOPs 12*N*H*I "
        "+ 6*N*r*(in+out) per adapter; x frozen = step / frozen step; x lora = step / lora step; "
        f"median of {env['iters']} after {env['warmup']} warm-up; peak = extra GiB of the step",
        _trace_line(result),
    ]
    return _case_table(
        title,
        caption,
        ("case (T,H,I,E,k)", "impl", "step ms", "TFLOP/s", "peak GiB", "weights GiB", "x frozen", "x lora"),
        result["rows"],
        _lora_cells,
    )


def _lora_cells(r: dict) -> list[str]:
    if "error" in r:
        return [f"[red]{r['error'][:120]}[/red]", "", "", "", "", ""]
    return [
        _fmt(r["step_ms"], ".3f"),
        _fmt(r["tflops"], ".1f"),
        _fmt(r["peak_gib"], ".2f"),
        _fmt(r.get("weights_gib"), ".2f"),
        _fmt(r.get("x_frozen"), ".2f"),
        _fmt(r.get("lora_speedup"), ".2f"),
    ]


def e2e_table(result: dict) -> Table:
    """The ``--e2e`` results (:mod:`moeyard.bench.e2e`) as a rich table."""
    env = result["env"]
    cap = f" (sm {env['capability']})" if env["capability"] else ""
    title = (
        f"moeyard bench --e2e{' --tiny' if env.get('tiny') else ''} · {env['device']}{cap} · {env['dtype']} · "
        f"transformers decoder stack, random weights\ntorch {env['torch']} · triton {env['triton']} · "
        f"transformers {env['transformers']} · moeyard {env['moeyard']} · {env['date']}"
    )
    vocabs = {(r["case"], r["vocab"], r["real_vocab"]) for r in result["rows"] if "vocab" in r}
    caption = [
        f"$ {env['command']}" if env["command"] else "",
        f"step = forward + cross-entropy on random labels + backward + {env['optimizer']} step + zero_grad; "
        f"median of {env['iters']} after {env['warmup']} warm-up; tokens/s = batch x seq / step; with "
        "micro-batches: each one's forward + backward, then one optimizer step (an FP8 recipe's weights cast "
        "once per step: moeyard.cache_fp8_weights), tokens/s = micro-batches x batch x seq / step; "
        "x gmm = grouped_mm step / step (> 1: faster); peak = max allocated in the timed steps (weights, "
        "gradients, optimizer states, activations)",
        *[
            f"{case}: vocabulary {v:,} (the model's: {real:,}; reduced for the float32 logits of the loss)"
            for case, v, real in sorted(vocabs)
            if v != real and not env.get("tiny")
        ],
        *[f"{name} skipped: {why}" for name, why in env.get("skipped", {}).items()],
        _trace_line(result),
    ]
    return _case_table(
        title,
        caption,
        ("model (layers, batch x seq)", "impl", "step ms", "tokens/s", "x gmm", "peak GiB", "params M", "note"),
        result["rows"],
        _e2e_cells,
    )


def _case_table(title: str, caption: list[str], columns: tuple[str, ...], rows: list[dict], cells) -> Table:
    """A results table: the first column names the case (once per section), the second the
    implementation, the rest ``cells(row)``; text columns (the first two and ``note``) left-aligned."""
    table = Table(title=title, caption="\n".join(c for c in caption if c), caption_justify="left")
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i < 2 or col == "note" else "right")
    last = None
    for r in rows:
        key = case_label(r)
        if last is not None and key != last:
            table.add_section()
        table.add_row("" if key == last else key, r["impl"], *cells(r))
        last = key
    return table


def _trace_line(result: dict) -> str:
    """The caption's line on ``--trace`` output ("" without it)."""
    trace = result["env"].get("trace")
    if not trace:
        return ""
    notes = sorted({r["trace_note"] for r in result["rows"] if r.get("trace_note")})
    return f"traces: {trace}/<case>-<impl>.json" + (
        f" ({'; '.join(notes)})" if notes else " and <case>-<impl>-memory.pickle"
    )


def _e2e_cells(r: dict) -> list[str]:
    params = _fmt(r["params"] / 1e6 if r.get("params") else None, ",.0f" if r.get("params", 0) >= 1e7 else ".3g")
    if "error" in r:
        return ["[red]error[/red]", "", "", "", params, f"[red]{r['error'][:160]}[/red]"]
    note = ", ".join(
        x
        for x in (f"backend {r['backend']}" if r.get("backend") else "", f"attention {r.get('attn_implementation')}")
        if x
    )
    return [
        _fmt(r["step_ms"], ".2f"),
        _fmt(r["tokens_per_s"], ",.0f"),
        _fmt(r.get("x_vs_grouped_mm"), ".2f"),
        _fmt(r["peak_gib"], ".2f"),
        params,
        note,
    ]


def _cells(r: dict) -> list[str]:
    load = _fmt(r.get("load_max_over_mean"), ".2f")
    if "error" in r:
        return ["[red]error[/red]", "", "", "", "", load, f"[red]{r['error'][:160]}[/red]"]
    return [
        _fmt(r["fwd_ms"], ".3f"),
        _fmt(r["fwd_tflops"], ".1f" if r["fwd_tflops"] >= 1 else ".3g"),
        _fmt(r["fwdbwd_ms"], ".3f"),
        _fmt(r["fwdbwd_tflops"], ".1f" if r["fwdbwd_tflops"] >= 1 else ".3g"),
        _fmt(r["peak_gib"], ".2f"),
        load,
        r.get("note", ""),
    ]


def models_table() -> Table:
    """The model registry as a rich table."""
    table = Table(title="registered model shapes")
    for col in ("name", "T", "H", "I", "E", "k", "router", "activation", "shared", "source"):
        table.add_column(col)
    for m in MODELS.values():
        c = m.moe_config()
        router = (
            c.score_func
            + (" top-k first" if c.topk_before_score else "")
            + (f" groups {c.n_group}/{c.topk_group}" if c.n_group > 1 else "")
            + (" +bias" if c.score_correction_bias else "")
            + ("" if c.norm_topk_prob else " no-renorm")
            + (f" x{c.routed_scaling_factor}" if c.routed_scaling_factor != 1 else "")
        )
        shared = (
            "-"
            if not c.num_shared_experts
            else f"{c.num_shared_experts}x{c.shared_intermediate_size or c.intermediate_size}"
            + (" gated" if c.shared_expert_gate else "")
        )
        table.add_row(
            m.name,
            str(m.tokens),
            str(c.hidden_size),
            str(c.intermediate_size),
            str(c.num_experts),
            str(c.top_k),
            router,
            c.activation,
            shared,
            m.source,
        )
    return table
