"""XLA flags of the JAX tests, set before JAX starts its CPU backend.

The JAX tests' time is XLA:CPU compile time. Without its optimisation passes and fusion emitters, in one
codegen unit, XLA compiles these small graphs about 2.5x faster (the layer's forward + backward: 2.9 -> 1.1
s CPU time, jaxlib 0.10.2). An unknown flag makes XLA abort, so they are set only for the jaxlib releases
where they were checked; elsewhere the tests compile with the defaults.
"""

import os
from importlib import metadata

FAST_COMPILE = (
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
    "--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
)
CHECKED = ("0.10.",)  # jaxlib versions the flags were checked on


def set_xla_flags(extra: str = "") -> None:
    """Add ``extra`` and, on a checked jaxlib, :data:`FAST_COMPILE` to ``XLA_FLAGS`` (once)."""
    current = os.environ.get("XLA_FLAGS", "")
    try:
        fast = metadata.version("jaxlib").startswith(CHECKED)
    except metadata.PackageNotFoundError:
        fast = False
    add = [f for f in (extra, FAST_COMPILE if fast else "") if f and f.split()[0].split("=")[0] not in current]
    if add:
        os.environ["XLA_FLAGS"] = " ".join([current, *add]).strip()
