"""Resource estimates of a tile config before it is compiled, and the autotuner's pruning by them.

A config (``BM, BN, BK, num_warps, num_stages``) that needs more shared memory than a block may have
fails to launch; one that needs more than 255 registers per thread spills to local memory. Both are
known (approximately) from the config and the launch alone, so the autotuner drops such configs
before compiling them (:func:`pruner`), with the launch's actual dtype, LoRA rank and mode.

Shared memory (bytes): the operand tiles staged per pipeline stage times ``num_stages``:
``A [BM, BK]`` + one ``B [BK, BN]`` per accumulator (+ ``La [BK, RP]`` when LoRA is fused), each at
its tensor's element size; weight gradients ``L^T [BN, BM]`` + ``R [BM, BK]`` (with ``ROWS``, once more
the factor's ``[BN, BK]`` tile, read before the loop). The epilogue's buffers
(the LoRA factor ``Lb [RP, BN]``, layout conversions) are not added: Triton's shared-memory allocator
reuses the pipeline's buffers once the main loop is done.

Registers (32-bit, per thread; ``T = 32 * num_warps`` threads): the larger of the main loop's and the
epilogue's live values,

- float32 accumulators: ``BM * BN / T`` each (2 for a gated up projection; the weight gradient's
  ``[BN, BK]`` and, with ``ROWS``, its row product's ``[BM, BK]`` and that tile's store pointers), plus ``BM * RP / T`` for the fused LoRA accumulator ``z``. Hopper's wgmma holds a
  ``64 x N`` float32 accumulator of a warpgroup (128 threads) as ``N / 2`` registers per thread
  (PTX ISA, "Register fragments" of ``wgmma.mma_async``), i.e. ``BM * BN / T`` for a tile spread over
  ``num_warps / 4`` warpgroups; Ampere's ``mma.sync`` fragments spread the same way. The fused
  accumulator is counted ``FUSED_Z_FACTOR`` = 3 times: an empirical factor, fitted to the down kernel
  compiled for sm_90a (Triton 3.9, ``benchmarks/offline_sm90.py``: 128 x 128 tiles, 8 warps: 136
  registers without LoRA; fused 159 at r = 16, 255 at r = 64, 255 and 576 spilled bytes at r = 128),
  whose fused main loop grows by about 3 registers per register of ``z``'s accumulator (not yet
  traced to its copies in the generated code).
- operands: wgmma reads B from shared memory and A from shared memory or registers. The main loops'
  operands are plain loads, which Triton stages through shared memory (``cp.async``), so they cost no
  registers; A comes from registers where it is computed: the LoRA epilogue's ``s * z`` (``BM * RP``
  elements at the input's size), and the weight gradient's ``L`` tile when it also feeds the bias
  gradient (``BN * BM`` elements plus their float32 copy).
- pointers: each loop-carried operand pointer tensor costs one 64-bit address (2 registers) per
  16-byte vector a thread loads: ``2 * rows * cols * bytes / (16 * T)``; none for TMA descriptor
  loads (``down_tma``).
- epilogue: LoRA's ``z [BM, RP]`` float32 (read or kept from the main loop) and ``s * z`` in the
  input dtype; ``Lb [RP, BN]`` is the epilogue dot's B operand in shared memory, loaded through
  registers (``RP * BN`` elements: a load outside the pipelined loop is no ``cp.async``). The LoRA
  product ``s z Lb^T`` is accumulated into the accumulator itself (``tl.dot(z, Lb, acc)``: same
  ``[BM, BN]`` shape and warps, so the same MMA layout), no tile of its own. The activation's
  temporaries are not counted (the gated up and dh kernels' epilogues take far more: NOTES).
- ``OVERHEAD`` = 48 registers: kernel arguments (about 30 scalars: pointers, sizes, strides), the
  tile's row offsets and masks, loop counters and the expert search; set so the estimate stays at or
  below the down kernel compiled for sm_90a without LoRA (136 at 128 x 128 x 64, 8 warps: 80 + 48;
  ``benchmarks/NOTES.md``, round 5 preparation).

Limits (CUDA C++ Programming Guide, "Technical Specifications per Compute Capability", 8.x and 9.0):
255 registers per thread, 64K 32-bit registers per SM and per block (``32 * num_warps * regs <=
65536``), 227 KiB of shared memory per block (opt-in) on H100/H200 (163 KiB on A100).

These are estimates of what must be live, not of what the compiler allocates: ptxas used 1-38
registers more than estimated in the down kernel where nothing spilled (it takes what the limit
allows). So the pruner
drops the configs that cannot fit, and configs that spill anyway lose the autotuner's benchmark.
Check them against the compiled kernels' ``n_regs`` / ``n_spills`` (``benchmarks/lora_profile.py
--regs`` on a GPU, ``benchmarks/offline_sm90.py`` without one).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

MAX_REGS_PER_THREAD = 255
REGS_PER_SM = 65536
SMEM_OPTIN_HOPPER = 227 * 1024  # H100 / H200 shared memory per block, opt-in
OVERHEAD = 48
FUSED_Z_FACTOR = 3
LORA_NONE, LORA_SPLIT, LORA_FUSED = 0, 1, 2


@dataclass(frozen=True, kw_only=True)
class Launch:
    """The facts of one launch the estimates depend on.

    Attributes:
        kind: a key of :data:`KINDS` (``up``, ``down``, ``dh``, ``wgrad``).
        dual: gated up projection (two accumulators and two ``B`` tiles; ``up`` only).
        lora: 0 none, 1 split (``z`` read in the epilogue), 2 fused (``z`` accumulated in the main loop).
        rank: the padded LoRA rank ``RP`` (a power of two >= 16) when ``lora``.
        a_bytes, b_bytes, lora_bytes: element sizes (bytes) of ``A``, ``B`` (or ``L``, ``R``) and ``La``.
        has_db: weight gradient that also sums the bias gradient from the ``L`` tile.
        has_rows: weight gradient that also yields the row product ``L @ F_e`` (``ROWS``).
    """

    kind: str
    dual: bool = False
    lora: int = LORA_NONE
    rank: int = 0
    a_bytes: int = 2
    b_bytes: int = 2
    lora_bytes: int = 2
    has_db: bool = False
    has_rows: bool = False

    def __post_init__(self):
        if not isinstance(self.kind, str) or self.kind not in KINDS:
            raise ValueError(f"kind: expected one of {sorted(KINDS)}, got {self.kind!r}")
        if self.dual and self.kind != "up":
            raise ValueError(f"dual: only the up kernel has two accumulators, got kind={self.kind!r}")
        if self.lora not in (LORA_NONE, LORA_SPLIT, LORA_FUSED):
            raise ValueError(f"lora: expected 0 (none), 1 (split) or 2 (fused), got {self.lora!r}")
        if self.lora and self.rank < 1:
            raise ValueError(f"rank: expected >= 1 with lora={self.lora}, got {self.rank}")


@dataclass(frozen=True)
class _Kind:
    """A kernel's GEMM shape and the arguments that hold its two operands."""

    family: str  # "gemm" (A [BM, BK] @ B [BK, BN]) or "wgrad" (L^T [BN, BM] @ R [BM, BK])
    a: str  # argument holding A (or L)
    b: str  # argument holding B (or R)
    tma: bool = False  # operands loaded by TMA descriptors: no pointer tensors in the main loop


KINDS = {
    "up": _Kind("gemm", "x_ptr", "w_ptr"),
    "down": _Kind("gemm", "a_ptr", "w_ptr"),
    "down_tma": _Kind("gemm", "a_ptr", "w_ptr", tma=True),
    "dh": _Kind("gemm", "dout_ptr", "w_ptr"),
    "wgrad": _Kind("wgrad", "l_ptr", "r_ptr"),
}


_BYTES = {"fp64": 8, "fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8e4nv": 1, "fp8e5": 1, "u8": 1, "i8": 1}


def _size(x, default: int = 2) -> int:
    """Element size (bytes) of a tensor, or of a Triton signature type such as ``"*bf16"``."""
    if hasattr(x, "element_size"):
        return x.element_size()
    if isinstance(x, str):
        return _BYTES.get(x.lstrip("*"), default)
    return default


def launch_of(kind: str, args: dict) -> Launch:
    """The :class:`Launch` of a kernel call from its arguments by name (tensors and constexprs, as
    Triton's autotuner hands them to ``early_config_prune``; operands may also be given as Triton
    signature types, ``"*bf16"``); missing flags default to off, unknown element sizes to 2 bytes."""
    k = KINDS[kind]
    lora = int(args.get("LORA", LORA_NONE))
    # DUAL: two accumulators in the up kernel only (the dh kernel's DUAL means a gated activation)
    return Launch(
        kind=kind,
        dual=kind == "up" and bool(args.get("DUAL", False)),
        lora=lora,
        rank=int(args.get("RP", 16)) if lora else 0,
        a_bytes=_size(args.get(k.a)),
        b_bytes=_size(args.get(k.b)),
        lora_bytes=_size(args.get("la_ptr", args.get(k.a))),
        has_db=bool(args.get("HAS_DB", False)),
        has_rows=bool(args.get("ROWS", False)),
    )


def _tiles(c) -> tuple[int, int, int]:
    return c.kwargs["BM"], c.kwargs["BN"], c.kwargs["BK"]


def smem_bytes(config, launch: Launch) -> int:
    """Shared memory (bytes) of ``config`` (a ``triton.Config``) for ``launch``: the operand tiles
    of one pipeline stage times ``num_stages`` (see the module docstring)."""
    bm, bn, bk = _tiles(config)
    if KINDS[launch.kind].family == "wgrad":
        stage = bm * bn * launch.a_bytes + bm * bk * launch.b_bytes
        if launch.has_rows:  # the factor's [BN, BK] tile, read once (no stage of its own)
            return config.num_stages * stage + bn * bk * launch.a_bytes
    else:
        stage = bm * bk * launch.a_bytes + (1 + launch.dual) * bk * bn * launch.b_bytes
        if launch.lora == LORA_FUSED:
            stage += bk * launch.rank * launch.lora_bytes
    # measured in the sm_90a code of Triton 3.6 (benchmarks/offline_sm90.py): the persistent (flattened)
    # TMA kernel takes 32 KiB more
    if config.kwargs.get("PERSISTENT"):
        return config.num_stages * stage + 32768
    return config.num_stages * stage


def _pointer_regs(rows: int, cols: int, nbytes: int, threads: int) -> float:
    """2 registers (a 64-bit address) per 16-byte vector of a ``[rows, cols]`` pointer tensor."""
    return 2 * rows * cols * nbytes / (16 * threads)


def registers(config, launch: Launch) -> int:
    """Estimated 32-bit registers per thread of ``config`` (a ``triton.Config``) for ``launch``:
    the larger of the main loop's and the epilogue's live values plus ``OVERHEAD`` (see the module
    docstring for the terms and their sources)."""
    bm, bn, bk = _tiles(config)
    t = 32 * config.num_warps
    kind = KINDS[launch.kind]
    if kind.family == "wgrad":
        loop = bn * bk / t + _pointer_regs(bn, bm, launch.a_bytes, t) + _pointer_regs(bm, bk, launch.b_bytes, t)
        if launch.has_db:  # L read into registers for the bias gradient: its elements and a float32 copy
            loop += bn * bm * (launch.a_bytes / 4 + 1) / t + bn / t
        if launch.has_rows:  # the row product's [BM, BK] float32 tile and its store's pointers
            loop += bm * bk / t + _pointer_regs(bm, bk, 4, t)
        return math.ceil(loop) + OVERHEAD
    acc = (1 + launch.dual) * bm * bn / t
    loop = acc
    if not kind.tma:
        loop += _pointer_regs(bm, bk, launch.a_bytes, t) + (1 + launch.dual) * _pointer_regs(bk, bn, launch.b_bytes, t)
    if launch.lora == LORA_FUSED:
        loop += FUSED_Z_FACTOR * bm * launch.rank / t + _pointer_regs(bk, launch.rank, launch.lora_bytes, t)
    epilogue = acc
    if launch.lora:  # z [BM, RP] float32, s * z as the epilogue dot's A operand, Lb [RP, BN] on its way to smem
        epilogue += (bm * launch.rank * (1 + launch.a_bytes / 4) + launch.rank * bn * launch.lora_bytes / 4) / t
    return math.ceil(max(loop, epilogue)) + OVERHEAD


def register_limit(num_warps: int) -> int:
    """Registers per thread a block of ``num_warps`` warps may use: 255, and ``65536`` per block."""
    return min(MAX_REGS_PER_THREAD, REGS_PER_SM // (32 * num_warps))


def fits(config, launch: Launch, smem_limit: int) -> tuple[int, int, bool]:
    """``(smem bytes, registers per thread, fits)`` of ``config`` for ``launch`` under ``smem_limit``."""
    smem, regs = smem_bytes(config, launch), registers(config, launch)
    return smem, regs, smem <= smem_limit and regs <= register_limit(config.num_warps)


_WARNED: set = set()


def prune(configs, launch: Launch, smem_limit: int) -> list:
    """The configs that fit (:func:`fits`), in their order. Never empty: when none fits, the one
    with the fewest registers, then the least shared memory, is kept (with a warning, once per launch kind)."""
    if not configs:
        raise ValueError("configs: expected at least one triton.Config, got none")
    kept = [c for c in configs if fits(c, launch, smem_limit)[2]]
    if kept:
        return kept
    smallest = min(configs, key=lambda c: (registers(c, launch), smem_bytes(c, launch)))
    if launch not in _WARNED:
        _WARNED.add(launch)
        warnings.warn(
            f"moeyard triton: no {launch.kind} config fits {smem_limit} bytes of shared memory and "
            f"{MAX_REGS_PER_THREAD} registers for {launch}; keeping the smallest, {smallest}",
            RuntimeWarning,
            stacklevel=2,
        )
    return [smallest]


def pruner(kind: str, smem_limit):
    """An ``early_config_prune`` for the kernel ``kind``: :func:`prune` with the launch's own meta
    (``launch_of``) and ``smem_limit()`` bytes (a callable: the current device's limit)."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {sorted(KINDS)}, got {kind!r}")

    def early_config_prune(configs, named_args, **kwargs):
        return prune(configs, launch_of(kind, {**named_args, **kwargs}), smem_limit())

    return early_config_prune
