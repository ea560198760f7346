"""Tile schedule and launch configurations for the grouped GEMM kernels.

Legend: N routed pairs in sorted (expert-major) order, E experts, BM rows per tile.

The row tiles of a grouped GEMM follow the experts: expert ``e`` owns ``ceil(count_e / BM)`` tiles,
so at most ``N // BM + min(E, N)`` tiles exist whatever the routing. Kernels launch that static upper
bound and each program finds its expert from ``expert_offsets`` on the device (:func:`expert_tile`);
programs past the last tile exit at once. No host sync, and the map does not depend on a
precomputed ``BM``, so ``BM`` can be autotuned.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ... import launch
from ...dispatch_triton import sort_meta, sort_pairs
from ...kernel_op import interpreting
from ...launch import cached, cdiv, next_power_of_2
from . import tuning
from .tuning import pruner


@triton.jit
def _piece_table(offsets_ptr, E, size, E_P2: tl.constexpr, EMPTY_PIECE: tl.constexpr):
    """Per expert (``[E_P2]`` vectors): first row, end row, pieces of ``size`` rows (at least one for
    an empty expert with ``EMPTY_PIECE``), one past its last piece (cumulative), and its first
    partial slot when it has more than one piece (else unused)."""
    e_idx = tl.arange(0, E_P2)
    e_mask = e_idx < E
    starts = tl.load(offsets_ptr + e_idx, mask=e_mask, other=0)
    ends = tl.load(offsets_ptr + e_idx + 1, mask=e_mask, other=0)
    pieces = (ends - starts + size - 1) // size
    if EMPTY_PIECE:
        pieces = tl.where(e_mask, tl.maximum(pieces, 1), 0)
    last = tl.cumsum(pieces, 0)
    multi = tl.where(pieces > 1, pieces, 0)
    slot0 = tl.cumsum(multi, 0) - multi
    return e_idx, starts, ends, pieces, last, slot0


@triton.jit
def expert_piece(pid, offsets_ptr, E, size, E_P2: tl.constexpr, EMPTY_PIECE: tl.constexpr):
    """Piece ``pid`` of the experts' rows cut into pieces of ``size`` -> ``(e, row0, row_end, j, n, slot0)``:
    its expert, first sorted row, the end of that expert's rows, its index ``j`` among the expert's
    ``n`` pieces and the expert's first partial slot. ``e >= E``: the piece does not exist.
    ``EMPTY_PIECE``: an empty expert has one (empty) piece, e.g. to write its zero gradient."""
    e_idx, starts, ends, pieces, last, slot0 = _piece_table(offsets_ptr, E, size, E_P2, EMPTY_PIECE)
    e = tl.sum((last <= pid).to(tl.int32), 0)
    here = e_idx == e
    n = tl.sum(tl.where(here, pieces, 0), 0)
    j = pid - (tl.sum(tl.where(here, last, 0), 0) - n)
    row0 = tl.sum(tl.where(here, starts, 0), 0) + j * size
    row_end = tl.sum(tl.where(here, ends, 0), 0)
    return e, row0, row_end, j, n, tl.sum(tl.where(here, slot0, 0), 0)


@cached
@triton.jit
def tile_table_kernel(offsets_ptr, table_ptr, E, M, BM: tl.constexpr, E_P2: tl.constexpr, BT: tl.constexpr):
    """The row tiles of ``BM`` rows as a table, ``BT`` tiles per program: ``table[t]`` = the expert of
    tile ``t`` (``>= E``: no such tile) and ``table[M + t]`` = its first sorted row, for ``t < M``
    (:func:`max_row_tiles`); ``table[2 * M]`` = the number of tiles that exist (they come first).
    Built once per launch for kernels whose programs visit many tiles (persistent ones), instead of
    each tile searching the offsets as :func:`expert_tile` does."""
    tile_rows(offsets_ptr, table_ptr, E, M, tl.program_id(0) * BT, BM, E_P2, BT)


@cached
@triton.jit
def sort_tile_kernel(
    ids_ptr,
    order_ptr,
    offsets_ptr,
    table_ptr,
    N,
    E,
    M,
    N_P2: tl.constexpr,
    SHIFT: tl.constexpr,
    E_P2: tl.constexpr,
    BM: tl.constexpr,
    TE_P2: tl.constexpr,
    BT: tl.constexpr,
):
    """One program: the one-launch sort by expert (:func:`moeyard.dispatch_triton.sort_pairs`, its order and
    offsets), then, from the offsets it wrote, the tile table of ``BM`` rows (:func:`tile_table_kernel`'s,
    ``BT`` tiles at a time): the two launches of a call with few pairs in one."""
    sort_pairs(ids_ptr, order_ptr, order_ptr, offsets_ptr, N, E, N_P2, SHIFT, E_P2, False)
    tl.debug_barrier()  # every thread's offsets stored before any thread reads them
    for t0 in range(0, M, BT):
        tile_rows(offsets_ptr, table_ptr, E, M, t0, BM, TE_P2, BT)


@triton.jit
def tile_rows(offsets_ptr, table_ptr, E, M, t0, BM: tl.constexpr, E_P2: tl.constexpr, BT: tl.constexpr):
    """Tiles ``t0 ... t0 + BT - 1`` of :func:`tile_table_kernel`'s table (and, from ``t0 = 0``, the count)."""
    e_idx, starts, ends, pieces, last, _ = _piece_table(offsets_ptr, E, BM, E_P2, False)
    if t0 == 0:
        tl.store(table_ptr + 2 * M, tl.max(last, 0))  # tiles that exist: the first ones
    t = t0 + tl.arange(0, BT)
    e = tl.sum((last[None, :] <= t[:, None]).to(tl.int32), 1)
    here = e_idx[None, :] == e[:, None]
    first = tl.sum(tl.where(here, (last - pieces)[None, :], 0), 1)
    row0 = tl.sum(tl.where(here, starts[None, :], 0), 1) + (t - first) * BM
    tl.store(table_ptr + t, e, mask=t < M)
    tl.store(table_ptr + M + t, row0, mask=t < M)


def fill_tile_table(expert_offsets: torch.Tensor, block_m: int, table: torch.Tensor) -> None:
    """Write ``table [2 * M + 1]`` int32 (``M = max_row_tiles``, on the offsets' device) by
    :func:`tile_table_kernel`: one small launch (``ceil(M / BT)`` programs, at least one), no host sync."""
    E = expert_offsets.shape[0] - 1
    M = (table.shape[0] - 1) // 2
    e_p2, bt = _table_blocks(E)
    tile_table_kernel[(max(1, cdiv(M, bt)),)](expert_offsets, table, E, M, BM=block_m, E_P2=e_p2, BT=bt)


def _table_blocks(num_experts: int) -> tuple[int, int]:
    """``(E_P2, BT)`` of the tile table's kernels: ``[BT, E_P2]`` tiles of at most 4096 elements."""
    e_p2 = next_power_of_2(max(num_experts, 2))
    return e_p2, max(8, 4096 // e_p2)


def sort_and_tile(
    ids: torch.Tensor, num_experts: int, block_m: int, order: torch.Tensor, offsets: torch.Tensor, table: torch.Tensor
) -> None:
    """:func:`moeyard.dispatch_triton.sort_by_expert_small`'s ``order [N]`` int64 and ``offsets [E + 1]`` int32
    and :func:`fill_tile_table`'s ``table [2 M + 1]`` int32 of ``block_m`` rows for the flat ``ids [N]``, in
    one launch of one program (:func:`sort_tile_kernel`; ``N`` within :func:`moeyard.dispatch_triton.fits`).
    No host sync."""
    te_p2, bt = _table_blocks(num_experts)
    sort_tile_kernel[(1,)](
        ids,
        order,
        offsets,
        table,
        ids.shape[0],
        num_experts,
        (table.shape[0] - 1) // 2,
        BM=block_m,
        TE_P2=te_p2,
        BT=bt,
        **sort_meta(ids.shape[0], num_experts),
    )


@triton.jit
def expert_slots(e, offsets_ptr, E, size, E_P2: tl.constexpr):
    """``(n, slot0)`` of expert ``e``: its pieces of ``size`` rows and its first partial slot."""
    e_idx, starts, ends, pieces, last, slot0 = _piece_table(offsets_ptr, E, size, E_P2, False)
    here = e_idx == e
    return tl.sum(tl.where(here, pieces, 0), 0), tl.sum(tl.where(here, slot0, 0), 0)


@triton.jit
def expert_tile(pid_m, offsets_ptr, E, BM: tl.constexpr, E_P2: tl.constexpr):
    """Row tile ``pid_m`` -> ``(e, row0, row_end)``: its expert, first sorted row and the end of
    that expert's rows. ``e >= E`` means the tile does not exist (the caller exits).

    offsets_ptr: [E + 1] int32 expert_offsets (start of each expert's rows in sorted order).
    """
    e, row0, row_end, _, _, _ = expert_piece(pid_m, offsets_ptr, E, BM, E_P2, False)
    return e, row0, row_end


@triton.jit
def band_tile(pid_m, offsets_ptr, E, band_bits, BM: tl.constexpr, E_P2: tl.constexpr):
    """Row tile ``pid_m`` in band-major order -> ``(e, row0, row_end)`` as :func:`expert_tile` gives
    them (``e >= E``: no such tile). Band ``j`` holds tile ``j`` of every expert that has more than
    ``j`` tiles, in expert order: ``cum(j) = sum_e min(tiles_e, j)`` tiles come before it, so the
    tile's band is the largest ``j`` with ``cum(j) <= pid_m`` (a binary search of ``band_bits``
    steps over ``j < 2**band_bits``, which must exceed every expert's tile count) and its expert is
    the band's ``pid_m - cum(j)``-th. The same tiles as the expert-major order, visited differently.

    Why: a gathered operand read by token (``x[token]``) is read once per pair, ``K`` times per
    token. Each expert's rows are in token order, so tile ``j`` of every expert covers about the same
    span of tokens: the programs running at once read each token's row ``K`` times while it is in L2,
    instead of once per pass over all the experts (``benchmarks/NOTES.md``, round 20)."""
    e_idx, starts, ends, pieces, last, _ = _piece_table(offsets_ptr, E, BM, E_P2, False)
    j = pid_m * 0
    for i in range(0, band_bits):
        cand = j + (1 << (band_bits - 1 - i))
        j = tl.where(tl.sum(tl.minimum(pieces, cand), 0) <= pid_m, cand, j)
    idx = pid_m - tl.sum(tl.minimum(pieces, j), 0)
    live = (pieces > j).to(tl.int32)
    here = (live > 0) & (tl.cumsum(live, 0) - live == idx)
    found = tl.sum(here.to(tl.int32), 0) > 0
    e = tl.where(found, tl.sum(tl.where(here, e_idx, 0), 0), E)
    row0 = tl.sum(tl.where(here, starts, 0), 0) + j * BM
    return e, row0, tl.sum(tl.where(here, ends, 0), 0)


def band_bits(num_rows: int, min_block_m: int = 16) -> int:
    """Binary-search steps of :func:`band_tile`: ``2**bits`` exceeds the row tiles any one expert can
    have (``ceil(N / BM)`` at the smallest ``BM`` a config uses)."""
    return max(1, cdiv(max(num_rows, 1), min_block_m).bit_length())


def max_chunks(num_rows: int, num_experts: int, chunk_rows: int) -> int:
    """Static bound on the weight-gradient work items: each expert's ``ceil(c / chunk)`` chunks, at
    least one (an empty expert writes its zero gradient), so at most ``N // chunk + E``."""
    return num_rows // chunk_rows + num_experts


def max_partial_slots(num_rows: int, chunk_rows: int) -> int:
    """Static bound on the partial slots of experts cut into more than one chunk: an expert with
    ``c > chunk`` rows has ``ceil(c / chunk) < 2 c / chunk`` chunks, so fewer than ``2 N / chunk``."""
    return max(2 * num_rows // chunk_rows, 1)


def max_row_tiles(num_rows: int, num_experts: int, block_m: int) -> int:
    """Static upper bound on the number of row tiles: full tiles plus at most one partial tile for
    each non-empty expert, ``N // BM + min(E, N)``."""
    return num_rows // block_m + min(num_experts, num_rows)


def rank_block(rank: int) -> int:
    """The padded LoRA rank a kernel holds in registers: a power of two, at least 16 (``tl.dot``)."""
    return max(16, next_power_of_2(rank))


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: exact float32 products for float32 data (as torch's default)."""
    return "ieee" if dtype == torch.float32 else "tf32"


# Interpreter: one small config (tl.dot needs every dimension >= 16).
SMALL = dict(BM=16, BN=16, BK=16)


def rows_block() -> int:
    """The ``d_y`` columns of one row-product partial (``wgrad_kernel`` with ``ROWS``): ``ROWS_BN``,
    ``SMALL``'s under the interpreter (so small test shapes have several)."""
    return SMALL["BN"] if interpreting() else ROWS_BN


def tma_block_m() -> int:
    """BM of every TMA config in force: ``SMALL``'s under the interpreter, ``FIXED``'s without
    autotuning, else ``TMA_BM``."""
    if interpreting():
        return SMALL["BM"]
    return FIXED["BM"] if not autotuning() else TMA_BM


def autotuning() -> bool:
    """False with ``MOEYARD_TRITON_AUTOTUNE=0`` (one fixed config, ``FIXED``)."""
    return os.environ.get(ENV_AUTOTUNE, "1") not in ("0", "false", "False")


def _cfg(bm, bn, bk, warps, stages, **meta):
    return triton.Config(dict(BM=bm, BN=bn, BK=bk, **meta), num_warps=warps, num_stages=stages)


# (BM, BN, BK, warps, stages); pruned per launch by shared memory and registers (.tuning).
# Fused LoRA (the last entries of GEMM, DUAL and DH): every column tile recomputes z [BM, r] in its main
# loop, r / BN more MMA work (100% at r = BN = 128), and adds a [BM, r] float32 accumulator and a
# [BK, r] tile per stage; BM = 64 with 8 warps keeps the accumulators at 64 registers per thread for a
# wide BN (fewer recomputations), so every rank up to 128 has candidates that fit (python -m
# moeyard.experts.triton.schedule).
GEMM_CONFIGS = [
    _cfg(128, 128, 64, 8, 4),
    _cfg(128, 256, 64, 8, 3),
    _cfg(128, 256, 64, 8, 4),
    _cfg(256, 128, 64, 8, 3),
    _cfg(128, 128, 64, 4, 4),
    _cfg(64, 128, 64, 4, 4),
    _cfg(128, 128, 128, 8, 3),
    _cfg(128, 256, 128, 8, 2),
    _cfg(64, 256, 64, 8, 3),
]
# The TMA-loaded down projection (kernels_tma). One BM for all (the row tiles come from a table built
# for it: tma_block_m). PERSISTENT: one program per SM loops over the tiles, its tile and K loops
# flattened into one pipeline (the H200's pick at qwen3-30b-a3b and sonic-7b: 128x256x64, 3 stages).
TMA_BM = 128
TMA_CONFIGS = [
    _cfg(TMA_BM, 128, 64, 8, 4, PERSISTENT=False),
    _cfg(TMA_BM, 256, 64, 8, 3, PERSISTENT=False),
    _cfg(TMA_BM, 128, 128, 8, 3, PERSISTENT=False),
    _cfg(TMA_BM, 128, 64, 8, 4, PERSISTENT=True),
    _cfg(TMA_BM, 256, 64, 8, 3, PERSISTENT=True),
    _cfg(TMA_BM, 256, 64, 8, 4, PERSISTENT=True),
]
DUAL_CONFIGS = [
    _cfg(128, 128, 64, 8, 3),
    _cfg(128, 128, 64, 8, 4),
    _cfg(128, 64, 64, 8, 4),
    _cfg(128, 64, 64, 4, 4),
    _cfg(64, 128, 64, 4, 4),
    _cfg(64, 128, 64, 8, 3),
]
# BN >= 64 always: the routing-weight gradient keeps one partial per column tile (see ops._dh_min_bn).
# BN >= 128 runs the epilogue in two column halves (kernels_bwd.dh_kernel).
DH_CONFIGS = [
    _cfg(128, 128, 64, 8, 4),
    _cfg(128, 128, 64, 8, 5),
    _cfg(128, 128, 64, 8, 3),
    _cfg(128, 256, 64, 8, 3),
    _cfg(128, 256, 64, 8, 4),
    _cfg(128, 64, 64, 8, 4),
    _cfg(128, 64, 64, 4, 4),
    _cfg(64, 256, 64, 8, 3),
]
# weight gradients: L [BM, BN]^T @ R [BM, BK] per row step; wide output tiles read fewer operand
# bytes per FLOP (the row loop streams each expert's rows through L2)
WGRAD_CONFIGS = [
    _cfg(64, 256, 128, 8, 4),
    _cfg(64, 128, 256, 8, 4),
    _cfg(64, 256, 128, 8, 3),
    _cfg(64, 128, 128, 8, 4),
    _cfg(64, 128, 128, 8, 3),
    _cfg(128, 128, 128, 8, 3),
    _cfg(32, 256, 128, 8, 6),
    _cfg(64, 64, 128, 4, 4),
]
# thin grouped GEMMs (the LoRA rows z = x A_e^T: R <= 64 output columns, memory-bound): narrow column
# tiles, deep K steps, more programs per SM to hide the gathered loads' latency (128 x 16 x 64 with 3 stages:
# the fastest of a sweep at r = 16 on an H200, NOTES round 20)
THIN_CONFIGS = [
    _cfg(64, 16, 128, 4, 4),
    _cfg(128, 16, 128, 4, 4),
    _cfg(128, 32, 64, 4, 4),
    _cfg(64, 32, 128, 4, 3),
    _cfg(128, 16, 256, 8, 3),
    _cfg(256, 16, 64, 8, 4),
    _cfg(128, 64, 64, 4, 4),
    _cfg(128, 16, 64, 4, 3),
    _cfg(128, 16, 64, 8, 3),
]
# weight gradients with one thin side (LoRA factors: r rows or columns): narrow tiles on that side; short
# row steps (BM = 32) with 3 stages ran fastest for dB_down and dA_up at r = 16 (NOTES round 20)
THIN_WGRAD_CONFIGS = [
    _cfg(64, 16, 256, 4, 4),
    _cfg(64, 32, 256, 8, 4),
    _cfg(128, 16, 128, 4, 4),
    _cfg(64, 64, 128, 4, 4),
    _cfg(64, 256, 16, 4, 4),
    _cfg(64, 256, 32, 8, 4),
    _cfg(128, 128, 16, 4, 4),
    _cfg(32, 256, 16, 4, 3),
    _cfg(32, 128, 16, 4, 3),
    _cfg(64, 128, 16, 4, 3),
    _cfg(32, 16, 128, 4, 3),
    _cfg(128, 16, 128, 4, 3),
]
# weight gradients of a LoRA factor B that also yield the rows d_y B_e from the same pass over d_y
# (wgrad_kernel with ROWS): every config has BN = ROWS_BN, so the row product's partials (one per BN
# columns of d_y) are counted before the launch
ROWS_BN = 256
ROWS_WGRAD_CONFIGS = [
    _cfg(64, ROWS_BN, 16, 4, 4),
    _cfg(64, ROWS_BN, 16, 8, 4),
    _cfg(32, ROWS_BN, 16, 4, 6),
    _cfg(128, ROWS_BN, 16, 8, 3),
    _cfg(64, ROWS_BN, 32, 8, 4),
    _cfg(64, ROWS_BN, 64, 8, 3),
    _cfg(64, ROWS_BN, 16, 8, 2),
    _cfg(64, ROWS_BN, 16, 4, 2),
    _cfg(128, ROWS_BN, 16, 4, 3),
]
# the second-stage sum of weight-gradient partials (memory-bound; BN x BK float32 tiles)
REDUCE_BLOCK = dict(BN=64, BK=64, num_warps=4)


@functools.cache
def _properties(index: int):
    return torch.cuda.get_device_properties(index)


def device_properties(device: torch.device):
    """``torch.cuda.get_device_properties(device)`` of a CUDA ``device`` (index None: the current device),
    read once per device index: the launch path asks for the capability and the SM count several times per
    step, at some microseconds of host time each through torch. Raises what torch raises for a device
    index that does not exist (``AssertionError``/``RuntimeError``)."""
    return _properties(torch.cuda.current_device() if device.index is None else device.index)


def is_sm90(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA device of compute capability 9.0 (Hopper; the Gluon kernels' target)."""
    if device.type != "cuda":
        return False
    p = device_properties(device)
    return (p.major, p.minor) == (9, 0)


def device_smem_limit() -> int:
    """Shared memory (bytes) a block may opt in to on the current CUDA device."""
    return _properties(torch.cuda.current_device()).shared_memory_per_block_optin


# MOEYARD_TRITON_AUTOTUNE=0: this one config everywhere (fits float32 too; fast start-up, e.g. tests).
FIXED = dict(BM=64, BN=64, BK=32, num_warps=4, num_stages=3)
ENV_AUTOTUNE = "MOEYARD_TRITON_AUTOTUNE"


def tuned(kernel, configs, key, kind=None, *, prune=None, fixed=None, fixed_extra=None, reset_to_zero=None):
    """``kernel`` autotuned over ``configs`` on a GPU, pruned before compiling by ``prune`` (an
    ``early_config_prune``) or, by default, by the shared-memory and register estimates of
    :mod:`.tuning` for the launch kind ``kind`` (a key of ``tuning.KINDS``). Under the interpreter and
    with ``MOEYARD_TRITON_AUTOTUNE=0``: the one config ``fixed`` (a meta dict), by default ``SMALL``
    and ``FIXED``, updated with ``fixed_extra`` (constexprs every config sets); or ``fixed`` a function of
    each launch's ``(args, kwargs)`` returning the meta dict.

    ``reset_to_zero``: names of output arguments the kernel adds into, or writes only in part with a
    config-dependent layout (e.g. one partial row per column tile); tuning runs the kernel once per config on
    the caller's buffers, so these are zeroed before each of those runs and once more before the launch that
    counts (as the caller zero-filled them), or the first call of each new shape would return the sum of the
    tuning runs' writes."""
    if interpreting() or not autotuning():
        if callable(fixed):
            return _Fixed(kernel, fixed)
        return _Fixed(kernel, {**(fixed or (SMALL if interpreting() else FIXED)), **(fixed_extra or {})})
    prune = prune or pruner(kind, device_smem_limit)
    return _Tuned(
        triton.autotune(
            configs=configs, key=key, prune_configs_by={"early_config_prune": prune}, reset_to_zero=reset_to_zero
        )(kernel),
        key,
    )


class _Tuned:
    """A ``triton.autotune`` launcher with a quicker path once a key is tuned.

    ``Autotuner.run`` derives its key anew at every launch: a dict of all the kernel's arguments (about
    40 here), a list scan per argument, ``hasattr`` on each: tens of microseconds of host time per launch,
    several launches per layer step (``benchmarks/NOTES.md``, round 13). This launcher looks the pick up
    by the key arguments' values and the tensor arguments' dtypes (as fine a key as the autotuner's) and
    launches the JIT function with it; a key not seen yet goes through the autotuner, which tunes it.
    Other attributes (``fn``, ``cache``, ``best_config``) are the autotuner's.
    """

    def __init__(self, autotuner, key):
        self.autotuner = autotuner
        self.picks = {}
        self._key = [(autotuner.arg_names.index(k), k) for k in key]

    def __getattr__(self, name):
        return getattr(self.autotuner, name)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid, args, kwargs):
        n = len(args)
        key = (
            tuple(args[i] if i < n else kwargs.get(k) for i, k in self._key),
            tuple(a.dtype for a in args if isinstance(a, torch.Tensor)),
            tuple(v.dtype for v in kwargs.values() if isinstance(v, torch.Tensor)),
        )
        config = self.picks.get(key)
        if config is None:
            ret = self.autotuner.run(*args, grid=grid, warmup=False, **kwargs)
            config = getattr(self.autotuner, "best_config", None)
            if config is not None and config.pre_hook is None:
                self.picks[key] = config
            return ret
        self.autotuner.best_config = config
        return launch.run(self.autotuner.fn, grid, args, {**kwargs, **config.all_kwargs()})


class _Fixed:
    """A launcher that fills in a fixed config (mirrors ``Autotuner.__getitem__``): ``meta`` a dict, or a
    function of the launch's ``(args, kwargs)`` returning one (a fixed config that depends on the operands)."""

    def __init__(self, kernel, meta):
        self.kernel, self.meta = kernel, meta

    def __getitem__(self, grid):
        def launcher(*args, **kwargs):
            meta = self.meta(args, kwargs) if callable(self.meta) else self.meta
            g = grid(meta) if callable(grid) else grid
            return launch.run(self.kernel, g, args, {**kwargs, **meta})

        return launcher


# ---------------------------------------------------------------- pruning report (no GPU needed)


def _report_lists():
    """``(title, configs, launch kind, gated, has LoRA variants, with the row product)`` of every tuned
    launcher (ops._kernels)."""
    return [
        ("up (gated: DUAL_CONFIGS)", DUAL_CONFIGS, "up", True, True, False),
        ("down / dx (GEMM_CONFIGS)", GEMM_CONFIGS, "down", False, True, False),
        ("down / dx, TMA loads (TMA_CONFIGS)", TMA_CONFIGS, "down_tma", False, False, False),
        ("dh (DH_CONFIGS)", DH_CONFIGS, "dh", False, True, False),
        ("wgrad (WGRAD_CONFIGS)", WGRAD_CONFIGS, "wgrad", False, False, False),
        ("thin up: LoRA z rows (THIN_CONFIGS)", THIN_CONFIGS, "up", False, False, False),
        ("thin wgrad: LoRA factors (THIN_WGRAD_CONFIGS)", THIN_WGRAD_CONFIGS, "wgrad", False, False, False),
        ("LoRA dB with the rows d_y B (ROWS_WGRAD_CONFIGS)", ROWS_WGRAD_CONFIGS, "wgrad", False, False, True),
    ]


def _cell(config, launch, smem_limit: int) -> str:
    smem, regs, ok = tuning.fits(config, launch, smem_limit)
    return f"{regs:3d} {smem / 1024:4.0f}K {'kept' if ok else 'PRUNED':>6}"


def report(smem_limit: int = tuning.SMEM_OPTIN_HOPPER, ranks=(16, 64, 128), dtype_bytes: int = 2) -> str:
    """A table per tuned launcher: each config's estimated registers per thread, shared memory and
    whether :func:`tuning.prune` keeps it under ``smem_limit`` bytes, without LoRA (r=0) and with
    LoRA of each rank in ``ranks``, split (``s``) and fused (``f``), for ``dtype_bytes``-byte data."""
    lines = [
        f"estimates for {dtype_bytes}-byte data, shared-memory limit {smem_limit} bytes; "
        "cell: registers/thread, shared memory, kept or pruned"
    ]
    for title, configs, kind, gated, lora, rows in _report_lists():
        variants = [("r=0", 0, 0)] + (
            [
                (f"r={r} {m[0]}", r, mode)
                for r in ranks
                for m, mode in (("split", tuning.LORA_SPLIT), ("fused", tuning.LORA_FUSED))
            ]
            if lora
            else []
        )
        lines += ["", title, f"{'BM  BN  BK w s':18}| " + " | ".join(f"{v[0]:^16}" for v in variants)]
        for c in configs:
            k = c.kwargs
            cells = [
                _cell(
                    c,
                    tuning.Launch(
                        kind=kind,
                        dual=gated,
                        lora=mode,
                        rank=rank_block(r) if mode else 0,
                        a_bytes=dtype_bytes,
                        b_bytes=dtype_bytes,
                        lora_bytes=dtype_bytes,
                        has_rows=rows,
                    ),
                    smem_limit,
                )
                for _, r, mode in variants
            ]
            flag = "P" if k.get("PERSISTENT") else ""
            lines.append(
                f"{k['BM']:3d} {k['BN']:3d} {k['BK']:3d} {c.num_warps} {c.num_stages} {flag:<2}| " + " | ".join(cells)
            )
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description="Shared-memory and register estimates of the tuned configs.")
    p.add_argument("--smem", type=int, default=tuning.SMEM_OPTIN_HOPPER, help="bytes per block (227 KiB: H100/H200)")
    p.add_argument("--dtype-bytes", type=int, default=2, choices=(1, 2, 4))
    a = p.parse_args()
    print(report(a.smem, dtype_bytes=a.dtype_bytes))
