"""``moeyard bench --plot out.png``: grouped bars of a benchmark result, per case and implementation.

- the layer benchmark (:mod:`moeyard.bench.layer`): TFLOP/s, forward and forward+backward panels;
- ``--lora`` (:mod:`moeyard.bench.lora`): TFLOP/s of the step;
- ``--e2e`` (:mod:`moeyard.bench.e2e`): tokens/s of the training step.

TFLOP/s panels draw the run's dense bf16 matmul rate (8192^3) as a dashed line when it was measured
(CUDA). Failed rows are left out (a gap). The title names the device, dtype and date of the run.
``moeyard bench --plot out.png --from results.json`` redraws a saved ``--json`` without running.

matplotlib is imported only here, through its object-oriented API (no pyplot, no global backend
change): ``pip install 'moeyard[plot]'``.
"""

from __future__ import annotations

import json
import math
import os

# mode -> panels: (row key, panel title, y-axis label)
PANELS = {
    "layer": [("fwd_tflops", "forward", "TFLOP/s"), ("fwdbwd_tflops", "forward + backward", "TFLOP/s")],
    "lora": [("tflops", "training step (forward + backward)", "TFLOP/s")],
    "e2e": [("tokens_per_s", "training step (forward, loss, backward, AdamW)", "tokens/s")],
}


def result_mode(result: dict) -> str:
    """``"layer"``, ``"lora"`` or ``"e2e"``: ``env["mode"]``, else inferred (JSON of older runs)."""
    env = result["env"]
    if env.get("mode"):
        return env["mode"]
    if "lora_rank" in env:
        return "lora"
    return "e2e" if any("tokens_per_s" in r for r in result["rows"]) else "layer"


def case_label(row: dict) -> str:
    """A case's two-line label: name, then its sizes (``T,H,I,E,k``; for ``--e2e`` layers and batch x seq)."""
    if "layers" in row and "seq" in row:
        micro = f" x {row['accumulate']} micro-batches" if row.get("accumulate", 1) > 1 else ""
        return f"{row['case']}\n{row['layers']} layer{'s' if row['layers'] > 1 else ''}, {row['batch']}x{row['seq']}{micro}"
    if "T" not in row:
        return row["case"]
    return f"{row['case']}\n({row['T']},{row['H']},{row['I']},{row['E']},{row['k']})"


def check_plot_path(path: str) -> None:
    """Raise ValueError if ``--plot``'s ``path`` cannot be written: a directory, or no such parent directory."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"--plot: expected a file path such as out.png, got {path!r}")
    if os.path.isdir(path):
        raise ValueError(f"--plot: {path!r} is a directory; expected a file path such as out.png")
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        raise ValueError(f"--plot: directory {parent!r} does not exist")


def load_result(path: str) -> dict:
    """A saved ``--json`` result.

    Raises:
        ValueError: unreadable, not JSON, or without ``env`` and ``rows`` (named ``--from``).
    """
    try:
        with open(path) as f:
            result = json.load(f)
    except (OSError, json.JSONDecodeError) as ex:
        raise ValueError(f"--from: cannot read {path!r}: {ex}") from ex
    if (
        not isinstance(result, dict)
        or not isinstance(result.get("env"), dict)
        or not isinstance(result.get("rows"), list)
    ):
        raise ValueError(f"--from: {path!r} is not a moeyard bench JSON (expected 'env' and 'rows')")
    return result


def plot(result: dict, path: str) -> str:
    """Draw ``result`` (``{"env": ..., "rows": ...}`` of any bench mode) as grouped bars into ``path``
    (format from its extension: .png, .svg, .pdf); returns ``path``.

    Raises:
        ImportError: matplotlib is missing (names the ``plot`` extra).
        ValueError: a bad ``path`` (:func:`check_plot_path`), or no successful row to draw.
    """
    check_plot_path(path)
    Figure = _figure_class()
    panels = PANELS[result_mode(result)]
    rows = [r for r in result["rows"] if "error" not in r]
    if not rows:
        raise ValueError("--plot: no successful row to draw")
    cases = list(dict.fromkeys(case_label(r) for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig = Figure(figsize=(len(panels) * max(6.0, 1.1 + 0.35 * len(cases) * len(impls)), 4.8))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (key, title, unit) in zip(axes, panels, strict=True):
        _bars(ax, rows, cases, impls, key)
        dense = result["env"].get("dense_bf16_tflops")
        if unit == "TFLOP/s" and dense:
            ax.axhline(dense, linestyle="--", color="0.4", label=f"dense bf16 matmul ({dense:.0f})")
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(unit)
    axes[0].legend(fontsize=8)
    fig.suptitle(_title(result), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def _bars(ax, rows: list[dict], cases: list[str], impls: list[str], key: str) -> None:
    values = {(case_label(r), r["impl"]): r.get(key) for r in rows}
    width = 0.8 / len(impls)
    for j, impl in enumerate(impls):
        xs = [i + (j - (len(impls) - 1) / 2) * width for i in range(len(cases))]
        ys = [values.get((c, impl)) for c in cases]
        ax.bar(xs, [math.nan if y is None else y for y in ys], width, label=impl)
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels(cases, fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def _title(result: dict) -> str:
    env, mode = result["env"], result_mode(result)
    what = {"layer": "MoE layer", "lora": f"LoRA r={env.get('lora_rank')}", "e2e": "end-to-end training step"}[mode]
    return f"moeyard bench · {what}\n{env.get('device')} · {env.get('dtype')} · {env.get('date')}"


def _figure_class():
    try:
        from matplotlib.figure import Figure
    except ImportError as ex:
        raise ImportError("--plot needs matplotlib: pip install 'moeyard[plot]' (or pip install matplotlib)") from ex
    return Figure
