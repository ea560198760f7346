"""Speed options of the ``triton`` backend, read once per forward and once per backward function
(:func:`read_once`).

Each defaults to the measured default path; set an environment variable, or override in code with
:func:`use_options` (a context manager; it wins over the environment).

- ``MOEYARD_TRITON_ATOMIC_COMBINE=1`` (``atomic_combine``): the down projection adds each pair row
  into a float32 ``[T, H]`` accumulator with float32 atomics (then one cast), in the forward and in
  the input gradient, instead of writing ``[N, H]`` pair rows and combining them per token. Saves
  the pair-row round trip (``2 * N * H`` elements) for ``4 * T * H`` bytes of zero-fill and cast.
  NOT deterministic: the summation order of a token's pairs varies from run to run.
- ``MOEYARD_TRITON_WGRAD_CHUNK=<rows>`` (``wgrad_chunk_rows``; 0 = off): the weight gradients split
  every expert with more than ``rows`` rows into chunks of ``rows`` rows; each chunk writes a float32
  partial ``dW`` tile, and a second kernel sums an expert's partials in chunk order (deterministic, no
  atomics). Experts with at most ``rows`` rows write ``dW`` directly, as on the default path.
  Balances skewed routing. The partial buffer holds at most ``2 * N // rows`` slots of
  ``NL * NR`` float32 (``NL, NR`` the weight's two dims); ``rows`` is raised until that fits in ``MOEYARD_TRITON_WGRAD_PARTIAL_MIB`` (``wgrad_partial_mib``, default 512).
- ``MOEYARD_TRITON_LORA=split|fused`` (``lora_mode``): how LoRA terms are computed. ``split``
  (default) computes the low-rank rows ``x A_e^T`` in a thin launch of their own first (memory-bound:
  one more read of the GEMM's input); ``fused`` inside the GEMM's main loop from the tiles it loads
  anyway (a second, R-wide dot). Results agree to rounding. Split is the default because it was faster
  at every shape and rank measured on an H200 (Triton 3.6, ``benchmarks/lora_crossover.py``: fused
  1.01-1.3x split's time at r = 16 and 64, ``benchmarks/NOTES.md`` round 6), unlike ScatterMoE-LoRA's
  rule (fused for E >= 64).
- ``MOEYARD_TRITON_TMA=0`` (``tma``, on by default): where it can, the down projection (forward and
  input gradient) loads its operands with Hopper TMA descriptors (:mod:`.kernels_tma`; sm_90 and
  later, bf16/fp16, 16-byte-aligned strides, not with the fused LoRA mode or the atomic combine;
  otherwise the pointer-loaded kernel runs). 0 turns it off. Measured on an H200 (round 6 of
  ``benchmarks/NOTES.md``): down 1.91 -> 1.62 ms, dx 3.01 -> 2.77 ms at qwen3-30b-a3b.
- ``MOEYARD_TRITON_TMA_WGRAD=0`` (``tma_wgrad``, on by default): the weight gradients load their
  operand that is in sorted rows (``d_h``, ``w * a``) with a TMA descriptor sized to each expert's rows
  (zero fill past its end); the operand read at each pair's token keeps its pointer loads. Same
  conditions as ``tma``. Measured: weight gradients 2.36 -> 2.18 ms (down), 4.55 -> 4.39 ms (up). The base
  weight gradients only: the LoRA factors' gradients (thin, short row loops per program) ran as fast or
  faster with pointer loads (round 20 of ``benchmarks/NOTES.md``).
- ``MOEYARD_TRITON_PREFETCH=1`` (``prefetch_h``, off by default): the activation gradient's kernel
  (dh) prefetches its tile's pre-activation rows into L2 before its main loop
  (``prefetch.global.L2::evict_last``), so its epilogue's reads of ``h`` hit L2 instead of HBM
  (``kernels_bwd._prefetch_h``). On CUDA only (the interpreter has no inline assembly). Measured on an
  H100: dh 2.29 -> 2.23 ms at qwen3-30b-a3b, unchanged at sonic-7b, whole layer within its spread.
- ``MOEYARD_TRITON_TMA_UP=0`` (``tma_up``, on by default): the up projection loads its weight tiles
  (gate and up rows) through a TMA descriptor; the rows of ``x`` it gathers by token keep their pointer
  loads. Needs the weight in transformers' ``[E, 2I, H]`` layout (unit stride along H, 16-byte aligned
  strides and base, bf16/fp16); not with the fused LoRA mode or gpt-oss's interleaved or transposed
  weights. Measured on an H100 (round 13 of ``benchmarks/NOTES.md``, results bit-identical): up 3.59 ->
  3.47 ms at qwen3-30b-a3b, 4.56 -> 4.30 ms at sonic-30b-a. The same for the activation gradient's
  weight (dh) was slower (2.31 -> 2.50 ms, 2.62 -> 2.82 ms) and is not offered.
- ``MOEYARD_TRITON_GLUON_DOWN=0`` (``gluon_down``, on by default): the TMA down projection (forward
  and input gradient, without a LoRA term or with a split one) runs the warp-specialised Gluon kernel of
  :mod:`.kernels_gluon` (a TMA loader warp feeding one or two MMA warp groups through barrier rings,
  each tile's LoRA operands loaded ahead of its K loop) instead of the Triton kernel. Same conditions as
  ``tma``, plus sm_90, row tiles of 64 or 128, at most 32 K steps of 64 (a reduction of at most 2048)
  and, with LoRA, a rank that is a multiple of 8 and at most 32; otherwise the Triton kernel runs.
  Measured on an H200 (round 21 of ``benchmarks/NOTES.md``, bit-identical results), ms, Triton / Gluon:
  without LoRA, down 1.097 / 1.021 and dx 1.895 / 1.851 at qwen3.5-35b-a3b, 1.479 / 1.391 and 2.669 / 2.645
  at qwen3-30b-a3b; with LoRA (r = 16) the Gluon kernel takes about the Triton kernel's time without it
  (1.075, 1.931; 1.43-1.48, 2.664).
- ``MOEYARD_TRITON_GLUON_UP=0`` (``gluon_up``) and ``MOEYARD_TRITON_GLUON_DH=0`` (``gluon_dh``), both on
  by default: the two GEMMs that gather their rows by token, the up projection (``x``,
  the activation in its epilogue) and the activation gradient (``d out``, the activation's derivative and
  the routing weight's gradient in its epilogue), without a LoRA term or with a split one, run the
  warp-specialised Gluon kernel of :mod:`.kernels_gluon_gather` (loader warps gathering the rows with
  ``cp.async`` and loading the weight boxes through TMA, two MMA warp groups) instead of the Triton kernels.
  Needs sm_90, bf16/fp16, the gathered rows' width and row stride multiples of 16, gate and up rows not
  interleaved (transformers' ``[E, 2I, H]``, 16-byte aligned strides), an activation of
  ``kernels_gluon_gather.ACTS`` (not GeGLU), for dh no down bias and, with LoRA, a rank that is a multiple
  of 8 and at most 32; otherwise the Triton kernels run. Measured on an H100 (round 22 of
  ``benchmarks/NOTES.md``, bit-identical results), Triton / Gluon ms: up 3.63 / 3.29 at qwen3-30b-a3b
  (``do_bench``), 2.389 / 2.048 at qwen3.5-35b-a3b. dh (round 25, its ``h`` loaded by TMA through the ring
  after each tile's K loop, six stages of gathered rows; the routing weight's gradient within 2e-6, the rest
  bit-identical): 2.282 / 2.025 and 1.618 / 1.452 without LoRA, 2.473 / 2.272 and 1.793 / 1.629 with it
  (r = 16).
- ``MOEYARD_TRITON_GLUON_WGRAD=0`` (``gluon_wgrad``, on by default): the base weight gradients with an
  operand read by token (``dW_up = d_h^T x[token]``, ``dW_down = d_out[token]^T (w act(h))``), without a bias
  gradient or chunks, run the warp-specialised Gluon kernel of :mod:`.kernels_gluon_wgrad` (loader warps
  gathering the rows with ``cp.async`` and loading the sorted operand through TMA, two MMA warp groups
  reading both operands transposed from shared memory) instead of the Triton kernel. Needs sm_90, ``tma_wgrad``,
  bf16/fp16, the gathered operand's width and row stride multiples of 16 and the sorted one TMA-readable;
  otherwise the Triton kernel runs. Measured on an H100 (round 24 of ``benchmarks/NOTES.md``, within bf16
  rounding of the Triton kernel), Triton / Gluon ms: ``dW_up`` 3.069 / 2.972 at qwen3-30b-a3b, 2.330 / 2.021 at
  qwen3.5-35b-a3b; ``dW_down`` 1.386 / 1.221, 1.085 / 0.901.
- ``MOEYARD_TRITON_WGRAD_TILE_MAJOR=0`` (``wgrad_tile_major``, on by default): a thin weight gradient
  (a LoRA factor's: ``r`` wide on one side) with an operand read at each pair's token (``d out``,
  ``x``) orders its programs tile-major: one column tile of every expert, then the next
  (:func:`.gemm.weight_tile`). The programs running at once then read the same column slice of that
  operand (``T`` rows of one tile's width), which stays in L2, so each token's slice comes from HBM
  about once instead of once per routed pair. 0: expert-major, as the other weight gradients.
  Measured on an H200 (round 17 of ``benchmarks/NOTES.md``), expert-major -> tile-major: B's one pass
  over ``d out`` 0.463 -> 0.439 ms, ``dA_up`` 0.219 -> 0.180 ms at qwen3.5-35b-a3b; the base weight
  gradients (full fine-tuning), whose programs of one expert share both operands' rows, got slower
  (``dW_up`` 2.31 -> 3.27 ms) and stay expert-major.
- ``MOEYARD_TRITON_BAND_ROWS=0`` (``band_rows``, on by default): a thin grouped GEMM over rows read at
  each pair's token (the LoRA rows ``x[token] A_e^T``) visits its row tiles band-major: tile ``j`` of
  every expert, then tile ``j + 1`` (:func:`.schedule.band_tile`). Each expert's rows are in token
  order, so the programs running at once read about the same span of tokens, each token's row ``K``
  times while it is in L2. 0: expert-major, as the other GEMMs. Measured on an H200 (round 20 of
  ``benchmarks/NOTES.md``), expert-major -> band-major: ``x A_up^T`` 0.184 -> 0.154 ms at qwen3.5-35b-a3b,
  0.177 -> 0.141 ms at qwen3-30b-a3b; ``d out B_down`` 0.185 -> 0.153 and 0.177 -> 0.142 ms.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from dataclasses import dataclass

import torch

ENV = dict(
    atomic_combine="MOEYARD_TRITON_ATOMIC_COMBINE",
    wgrad_chunk_rows="MOEYARD_TRITON_WGRAD_CHUNK",
    wgrad_partial_mib="MOEYARD_TRITON_WGRAD_PARTIAL_MIB",
    lora_mode="MOEYARD_TRITON_LORA",
    tma="MOEYARD_TRITON_TMA",
    tma_wgrad="MOEYARD_TRITON_TMA_WGRAD",
    prefetch_h="MOEYARD_TRITON_PREFETCH",
    tma_up="MOEYARD_TRITON_TMA_UP",
    gluon_down="MOEYARD_TRITON_GLUON_DOWN",
    gluon_up="MOEYARD_TRITON_GLUON_UP",
    gluon_dh="MOEYARD_TRITON_GLUON_DH",
    gluon_wgrad="MOEYARD_TRITON_GLUON_WGRAD",
    wgrad_tile_major="MOEYARD_TRITON_WGRAD_TILE_MAJOR",
    band_rows="MOEYARD_TRITON_BAND_ROWS",
)
LORA_MODES = ("split", "fused")


@dataclass(frozen=True, kw_only=True)
class Options:
    """The triton backend's speed options (module docstring; environment names in ``ENV``).

    Raises:
        ValueError: ``wgrad_chunk_rows < 0``, ``wgrad_partial_mib <= 0`` (MiB) or an unknown ``lora_mode``.
    """

    atomic_combine: bool = False
    wgrad_chunk_rows: int = 0
    wgrad_partial_mib: int = 512
    lora_mode: str = "split"
    tma: bool = True
    tma_wgrad: bool = True
    prefetch_h: bool = False
    tma_up: bool = True
    gluon_down: bool = True
    gluon_up: bool = True
    gluon_dh: bool = True
    gluon_wgrad: bool = True
    wgrad_tile_major: bool = True
    band_rows: bool = True

    def __post_init__(self):
        if self.wgrad_chunk_rows < 0 or self.wgrad_partial_mib <= 0:
            raise ValueError(f"wgrad_chunk_rows must be >= 0 and wgrad_partial_mib > 0, got {self}")
        if self.lora_mode not in LORA_MODES:
            raise ValueError(f"lora_mode ({ENV['lora_mode']}): expected one of {LORA_MODES}, got {self.lora_mode!r}")

    def chunk_rows(self, num_rows: int, nl: int, nr: int) -> int:
        """Rows per weight-gradient chunk for ``num_rows`` pairs and a ``[NL, NR]`` weight (0: off):
        at least ``wgrad_chunk_rows``, raised until ``2 * N // rows`` float32 partials fit the budget."""
        if self.wgrad_chunk_rows == 0:
            return 0
        budget_slots = max(self.wgrad_partial_mib * 2**20 // (4 * max(nl * nr, 1)), 1)
        return max(self.wgrad_chunk_rows, -(-2 * num_rows // budget_slots))


_OVERRIDE: dict = {}


def _from_env(name: str, default):
    raw = os.environ.get(ENV[name])
    if raw is None or raw == "":
        return default
    if isinstance(default, bool):
        return raw not in ("0", "false", "False")
    if isinstance(default, str):
        return raw
    return int(raw)


_DEFAULTS = Options()


def options() -> Options:
    """The options in force now: :func:`use_options` overrides, else the environment, else defaults.
    Inside a function under :func:`read_once`, the value read at its start; elsewhere the environment is
    read at each call (about 11 µs of host time: 14 variables), the :class:`Options` built once per
    distinct setting (outside ``torch.compile``'s tracing)."""
    frozen = None if torch.compiler.is_compiling() else _FROZEN.get()  # (Dynamo cannot trace a ContextVar)
    if frozen is not None:
        return frozen
    key = (tuple(map(os.environ.get, _NAMES)), tuple(_OVERRIDE.items()))
    opts = _BUILT.get(key)
    if opts is None:
        values = {name: _from_env(name, getattr(_DEFAULTS, name)) for name in ENV}
        values.update(_OVERRIDE)
        opts = Options(**values)
        # not stored while Dynamo traces: a global mutated inside a traced autograd.Function's forward makes
        # Dynamo reject its saved tensors, and a model compiled before any eager call failed to compile
        if not torch.compiler.is_compiling():
            _BUILT[key] = opts
    return opts


_NAMES = tuple(ENV.values())
_BUILT: dict = {}
_FROZEN: contextvars.ContextVar = contextvars.ContextVar("moeyard_triton_options", default=None)


def read_once(fn):
    """Decorator for a forward or backward of the ``triton`` backend: :func:`options` is read once at its
    start and that value serves every launch inside, instead of the environment being read at each of
    them (16 readings per forward and backward, 11 µs each on the H100 machine's host: 0.18 ms of host time
    per step, which paces small shapes; ``benchmarks/NOTES.md``, round 26). While ``torch.compile`` traces,
    ``fn`` runs as is."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        token = _FROZEN.set(options())
        try:
            return fn(*args, **kwargs)
        finally:
            _FROZEN.reset(token)

    return wrapper


@contextlib.contextmanager
def use_options(**kwargs):
    """Override options inside a ``with`` block (e.g. ``use_options(atomic_combine=True)``).

    Raises:
        ValueError: an unknown option name, or a value :class:`Options` rejects.
    """
    unknown = set(kwargs) - set(ENV)
    if unknown:
        raise ValueError(f"unknown triton options {sorted(unknown)}; known: {sorted(ENV)}")
    saved = dict(_OVERRIDE)
    _OVERRIDE.update(kwargs)
    token = _FROZEN.set(None)  # inside a read_once function too, the override holds within the block
    try:
        options()  # validate
        yield
    finally:
        _FROZEN.reset(token)
        _OVERRIDE.clear()
        _OVERRIDE.update(saved)
