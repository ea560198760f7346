"""``moeyard bench``: the benchmark runners, one module per thing measured.

- :mod:`.layer`: the MoE layer, forward and forward + backward, per backend and peer (``moeyard bench``);
  its names are importable from here (``from moeyard.bench import BenchOptions, run, layer_flops``);
- :mod:`.lora`: the routed experts' LoRA / QLoRA fine-tuning step (``--lora R``, ``--quant nf4``);
- :mod:`.e2e`: a training step of a transformers decoder stack (``--e2e``);
- :mod:`.ep`: the expert-parallel dispatchers, stage by stage, under torchrun (``--ep N``);
- :mod:`.jax`: the JAX layer next to the PyTorch rows (``--framework jax``; imports jax only when it runs);
- :mod:`.models`: the registered model shapes (``--model``), :mod:`.peers`: other libraries' MoE layers;
- :mod:`.args`: the command line's options; :mod:`.tables`, :mod:`.plot`, :mod:`.trace`: the results as
  tables, plots (``--plot``) and profiler traces (``--trace``).
"""

from .layer import (
    COMPILE_MODES,
    CPU_DEFAULT_SHAPE,
    DENSE_N,
    DTYPES,
    GIB,
    NO_RECIPE,
    ROTATE_BYTES,
    ROUTINGS,
    BenchOptions,
    Inputs,
    build,
    case_name,
    cases,
    default_device,
    dense_fp8_tflops,
    dense_tflops,
    device_info,
    environment,
    free_memory,
    implementations,
    layer_flops,
    make_inputs,
    measure,
    reset_peak,
    resolve_options,
    routing_code,
    run,
    run_case,
    run_one,
    time_ms,
    tokens_per_expert,
    versions,
)

__all__ = [
    "COMPILE_MODES",
    "CPU_DEFAULT_SHAPE",
    "DENSE_N",
    "DTYPES",
    "GIB",
    "NO_RECIPE",
    "ROTATE_BYTES",
    "ROUTINGS",
    "BenchOptions",
    "Inputs",
    "build",
    "case_name",
    "cases",
    "default_device",
    "dense_fp8_tflops",
    "dense_tflops",
    "device_info",
    "environment",
    "free_memory",
    "implementations",
    "layer_flops",
    "make_inputs",
    "measure",
    "reset_peak",
    "resolve_options",
    "routing_code",
    "run",
    "run_case",
    "run_one",
    "time_ms",
    "tokens_per_expert",
    "versions",
]
