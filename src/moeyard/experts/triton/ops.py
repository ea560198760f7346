"""Custom ops around the kernels (:func:`moeyard.kernel_op.kernel_op`: ``torch.library`` custom ops,
called directly in eager mode; writing into preallocated outputs, with fake registrations so
``torch.compile`` can trace them) and the allocating wrappers.

Legend: T tokens, H hidden, I intermediate, N1 = 2I (gated) or I, E experts, K top-k, N = T*K
pairs. Weights are ``[E, out, in]`` views of any strides (never copied).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import torch

from ...activations import GATED
from ...dispatch import one_launch, sort_by_expert
from ...kernel_op import kernel_op
from ...launch import cdiv, next_power_of_2
from . import kernels_bwd, kernels_fwd, kernels_tma
from .options import options
from .schedule import (
    DH_CONFIGS,
    DUAL_CONFIGS,
    FIXED,
    GEMM_CONFIGS,
    REDUCE_BLOCK,
    ROWS_WGRAD_CONFIGS,
    SMALL,
    THIN_CONFIGS,
    THIN_WGRAD_CONFIGS,
    TMA_CONFIGS,
    WGRAD_CONFIGS,
    band_bits,
    device_properties,
    dot_precision,
    fill_tile_table,
    interpreting,
    is_sm90,
    max_chunks,
    max_partial_slots,
    max_row_tiles,
    rank_block,
    rows_block,
    sort_and_tile,
    tma_block_m,
    tuned,
)
from .tuning import LORA_FUSED, LORA_NONE, LORA_SPLIT

Tensor = torch.Tensor
COMBINE_BH = 1024
# fill_invalid_: a program per 16 rows x 512 columns. A program per row (the combine's grid) cost 0.24 ms at
# 196608 x 1536 bf16 rows with no invalid row, the down projection there 0.38 (H200; benchmarks/NOTES.md round 34)
FILL_BT, FILL_BH = 16, 512
THIN = 64  # weight gradients with a side this small (LoRA factors) use the thin-tile configs


@dataclass(frozen=True, kw_only=True)
class Routing:
    """Device-side routing metadata (from :func:`moeyard.dispatch.sort_by_expert`; no host sync).

    Attributes:
        topk_ids: ``[T, K]`` integer ids (contiguous). sort_order: ``[N]`` int64, sorted position
        -> flat pair. expert_offsets: ``[E + 1]`` int32. num_experts: E.
        made: what :meth:`tile_table` and :attr:`sorted_token` made so far (the TMA down projection's
        forward and its input gradient in backward share one table; the weight gradients share the
        token index).
        zero_invalid: at ``K == 1``, whether :func:`combine` writes the rows of dropped pairs (zeros, or
            ``w * 0``); False: they stay unwritten (``drop_invalid="unwritten"``).
    """

    topk_ids: Tensor
    sort_order: Tensor
    expert_offsets: Tensor
    num_experts: int
    zero_invalid: bool = True
    made: dict = field(default_factory=dict, compare=False, repr=False)

    def _keep(self, key, value: Tensor) -> Tensor:
        """Keep ``value`` for later launches over the same routing, in eager mode (while
        ``torch.compile`` traces, each call makes its own: a side effect on the routing would not
        survive the autograd function's traced forward)."""
        if not torch.compiler.is_compiling():
            self.made[key] = value
        return value

    def tile_table(self, block_m: int) -> Tensor:
        """The ``[2 * M + 1]`` int32 row-tile table of ``block_m`` rows
        (:func:`moeyard.experts.triton.schedule.tile_table_kernel`), made on first use (one small
        launch, no host sync)."""
        table = self.made.get(block_m)
        if table is None:
            M = max_row_tiles(self.num_pairs, self.num_experts, block_m)
            table = torch.empty(2 * M + 1, dtype=torch.int32, device=self.expert_offsets.device)
            tile_table_(self.expert_offsets, block_m, table)
            table = self._keep(block_m, table)
        return table

    @property
    def sorted_token(self) -> Tensor:
        """``[N]`` int32, sorted position -> token (``sort_order // K``; int32 holds any T < 2**31):
        the weight gradients' gather index, loaded as is inside their row loop. Made on first use
        (two small ops over N: in backward, not in a forward that no backward follows)."""
        tokens = self.made.get("sorted_token")
        if tokens is None:
            tokens = self._keep("sorted_token", (self.sort_order // max(self.top_k, 1)).to(torch.int32))
        return tokens

    @property
    def top_k(self) -> int:
        return self.topk_ids.shape[1]

    @property
    def num_pairs(self) -> int:
        return self.topk_ids.numel()


def routing(topk_ids: Tensor, num_experts: int, zero_invalid: bool = True) -> Routing:
    """Sort the ``[T, K]`` pairs by expert (stable) and find each expert's rows
    (:func:`moeyard.dispatch.sort_by_expert`: a few device ops, one stable sort, no host sync). Where the
    sort takes one launch (:func:`moeyard.dispatch.one_launch`: few pairs), in eager mode, that launch also
    makes the tile table of ``tma_block_m()`` rows the TMA and Gluon kernels read (:meth:`Routing.tile_table`),
    one launch less per call (host time: ``benchmarks/NOTES.md``, round 30). ``zero_invalid``: as
    :attr:`Routing.zero_invalid`."""
    if one_launch(topk_ids, num_experts) and not torch.compiler.is_compiling():
        return _sorted_and_tiled(topk_ids, num_experts, zero_invalid)
    _, sort_order, expert_offsets = sort_by_expert(topk_ids, num_experts)
    return Routing(
        topk_ids=topk_ids.contiguous(),
        sort_order=sort_order,
        expert_offsets=expert_offsets,
        num_experts=num_experts,
        zero_invalid=zero_invalid,
    )


def _sorted_and_tiled(topk_ids: Tensor, num_experts: int, zero_invalid: bool) -> Routing:
    """:func:`routing` by :func:`.schedule.sort_and_tile`: the sort and the tile table in one launch."""
    ids = topk_ids.reshape(-1)
    N, dev, block_m = ids.shape[0], ids.device, tma_block_m()
    order = torch.empty(N, dtype=torch.int64, device=dev)
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=dev)
    table = torch.empty(2 * max_row_tiles(N, num_experts, block_m) + 1, dtype=torch.int32, device=dev)
    sort_and_tile(ids, num_experts, block_m, order, offsets, table)
    r = Routing(
        topk_ids=topk_ids.contiguous(),
        sort_order=order,
        expert_offsets=offsets,
        num_experts=num_experts,
        zero_invalid=zero_invalid,
    )
    r.made[block_m] = table
    return r


@dataclass(frozen=True, kw_only=True)
class ActSpec:
    """The activation as kernels see it: ``name`` (``none`` = identity), its constants, the layout."""

    name: str
    alpha: float = 1.702
    limit: float = 7.0
    interleaved: bool = False

    @property
    def gated(self) -> bool:
        return self.name in GATED

    def columns(self, n1: int) -> tuple[int, int, int]:
        """``(NA, gate_step, up_offset)`` for an up projection of ``n1`` rows."""
        if not self.gated:
            return n1, 1, 0
        return (n1 // 2, 2, 1) if self.interleaved else (n1 // 2, 1, n1 // 2)


@dataclass(frozen=True, kw_only=True)
class LoRATerm:
    """The low-rank term ``s * (A La_e) Lb_e^T`` a grouped GEMM ``A W_e^T`` gains.

    Attributes: la ``[E, K, R]`` and lb ``[E, NOUT, R]`` (views of any strides, input dtype), scale ``s``.
    """

    la: Tensor
    lb: Tensor
    scale: float

    @property
    def rank(self) -> int:
        return self.la.shape[2]

    @staticmethod
    def mode() -> int:
        """Split (default) or fused: the ``lora_mode`` option (:mod:`.options`)."""
        return LORA_FUSED if options().lora_mode == "fused" else LORA_SPLIT


def _lora_args(la: Tensor | None, lb: Tensor | None, z: Tensor | None, mode: int, dummy: Tensor) -> tuple:
    """Kernel arguments for a LoRA term: ``(la, lb, z, R, la strides (3), lb strides (3), RP)``
    (unused pointers point at ``dummy``)."""
    if mode == LORA_NONE:
        return dummy, dummy, dummy, 0, 0, 0, 0, 0, 0, 0, 16
    R = la.shape[2]
    return (
        la,
        lb,
        z,
        R,
        la.stride(0),
        la.stride(1),
        la.stride(2),
        lb.stride(0),
        lb.stride(1),
        lb.stride(2),
        rank_block(R),
    )


def _kernels():
    """The tuned launchers, built on first use (autotuning needs a GPU; the interpreter does not)."""
    if not _LAUNCHERS:
        _LAUNCHERS.update(
            up=tuned(kernels_fwd.up_kernel, DUAL_CONFIGS, ["NA", "H", "N1", "E", "R", "LORA"], "up"),
            up_thin=tuned(kernels_fwd.up_kernel, THIN_CONFIGS, ["NA", "H", "E", "GATHER"], "up"),
            # the atomic combine adds into y; dh writes one routing-weight partial row per column tile of BN
            down=tuned(
                kernels_fwd.down_kernel,
                GEMM_CONFIGS,
                ["KA", "NY", "E", "ATOMIC", "R", "LORA"],
                "down",
                reset_to_zero=["y_ptr"],
            ),
            dh=tuned(
                kernels_bwd.dh_kernel, DH_CONFIGS, ["H", "I", "N1", "E", "R", "LORA"], "dh", reset_to_zero=["dw_ptr"]
            ),
            wgrad=tuned(kernels_bwd.wgrad_kernel, WGRAD_CONFIGS, ["NL", "NR", "CHUNKED"], "wgrad"),
            wgrad_thin=tuned(kernels_bwd.wgrad_kernel, THIN_WGRAD_CONFIGS, ["NL", "NR", "CHUNKED"], "wgrad"),
            wgrad_rows=tuned(
                kernels_bwd.wgrad_kernel,
                ROWS_WGRAD_CONFIGS,
                ["NL", "NR", "CHUNKED", "L_GATHER"],
                "wgrad",
                fixed_extra=dict(BN=rows_block()),
            ),
            down_tma=tuned(
                kernels_tma.down_tma_kernel,
                TMA_CONFIGS,
                _TMA_KEY,
                "down_tma",
                fixed_extra=dict(PERSISTENT=False, BM=tma_block_m()),
            ),
        )
    return _LAUNCHERS


_LAUNCHERS: dict = {}
_TMA_KEY = ["KA", "NY", "E", "R", "LORA", "W_KMAJOR"]


_THIN_MIN_BM = min(min(c.kwargs["BM"] for c in THIN_CONFIGS), SMALL["BM"], FIXED["BM"])


def _dh_min_bn() -> int:
    return SMALL["BN"] if interpreting() else min(c.kwargs["BN"] for c in DH_CONFIGS)


def _e_p2(e: int) -> int:
    return next_power_of_2(max(e, 2))


def _row_grid(n: int, e: int, cols: int):
    return lambda m: (max_row_tiles(n, e, m["BM"]) * cdiv(cols, m["BN"]),)


# ---------------------------------------------------------------- custom ops (write into outputs)


@kernel_op("moeyard::triton_up_proj", mutates_args=("h", "a", "z"))
def up_proj_(
    x: Tensor,
    w: Tensor,
    b: Tensor | None,
    sort_order: Tensor,
    expert_offsets: Tensor,
    top_k: int,
    act: str,
    alpha: float,
    limit: float,
    interleaved: bool,
    gather: bool,
    la: Tensor | None,
    lb: Tensor | None,
    lora_mode: int,
    lora_scale: float,
    table: Tensor | None,
    h: Tensor | None,
    a: Tensor,
    z: Tensor | None,
) -> None:
    """``h = x[token] @ w[e].T + b[e] (+ s z lb[e]^T)`` (sorted rows; ``x[row]`` without ``gather``;
    ``h`` written when given), ``a = act(h)``; LoRA ``z = x @ la[e]`` read (split) or written (fused).
    On sm_90 the warp-specialised Gluon kernel runs over the tile ``table`` (when given) where
    :func:`kernels_gluon_gather.up_ready` holds (option ``gluon_up``)."""
    E, N1, H = w.shape
    N = sort_order.shape[0]
    if N == 0:
        return
    spec = ActSpec(name=act, alpha=alpha, limit=limit, interleaved=interleaved)
    NA, gate_step, up_offset = spec.columns(N1)
    bb = w if b is None else b
    la_, lb_, z_, R, *lora_strides, RP = _lora_args(la, lb, z, lora_mode, w)
    lb_split, z_split = (lb, z) if lora_mode == LORA_SPLIT else (None, None)
    if (
        table is not None
        and lora_mode != LORA_FUSED
        and (gluon := _gluon("gluon_up")) is not None
        and gluon.up_ready(x, w, lb_split, z_split, act, gate_step, gather, RP, tma_block_m(), N)
    ):
        kernels_tma.ensure_allocator()
        gluon.launch_up(
            x,
            w,
            b,
            sort_order,
            expert_offsets,
            top_k,
            act,
            alpha,
            limit,
            up_offset,
            h,
            a,
            lb_split,
            z_split,
            table,
            lora_scale,
            RP,
            tma_block_m(),
            num_sms(x.device),
        )
        return
    thin = N1 <= THIN and not spec.gated and not lora_mode
    w_tma = not thin and gate_step == 1 and lora_mode != LORA_FUSED and _up_weight_tma(w, x)
    band = thin and gather and options().band_rows
    _kernels()["up_thin" if thin else "up"][_row_grid(N, E, NA)](
        x,
        w,
        bb,
        sort_order,
        expert_offsets,
        a if h is None else h,
        a,
        la_,
        lb_,
        z_,
        H,
        NA,
        N1,
        E,
        top_k,
        R,
        band_bits(N, _THIN_MIN_BM) if band else 0,
        x.stride(0),
        x.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        bb.stride(0),
        bb.stride(-1),
        *lora_strides,
        gate_step,
        up_offset,
        alpha,
        limit,
        lora_scale,
        ACT=act,
        DUAL=spec.gated,
        HAS_BIAS=b is not None,
        STORE_H=h is not None,
        GATHER=gather,
        LORA=lora_mode,
        RP=RP,
        PRECISION=dot_precision(x.dtype),
        E_P2=_e_p2(E),
        W_TMA=w_tma,
        BAND=band,
    )


def _up_weight_tma(w: Tensor, x: Tensor) -> bool:
    """Whether the up projection loads its weight ``w [E, N1, H]`` through TMA: option ``tma_up``, Hopper
    or the interpreter, ``x`` in w's dtype and ``w`` as :func:`kernels_tma.weight_tma_ready` asks."""
    if not (
        options().tma_up and _tma_device(w) and x.dtype == w.dtype and kernels_tma.weight_tma_ready(w, interpreting())
    ):
        return False
    kernels_tma.ensure_allocator()
    return True


@up_proj_.register_fake
def _(
    x,
    w,
    b,
    sort_order,
    expert_offsets,
    top_k,
    act,
    alpha,
    limit,
    interleaved,
    gather,
    la,
    lb,
    lora_mode,
    lora_scale,
    table,
    h,
    a,
    z,
):
    return None


def _down_table(rows: Tensor, r: Routing, lora_mode: int) -> Tensor | None:
    """The tile table when the TMA-loaded down projection may apply (Hopper or the interpreter, option
    ``tma``, no fused LoRA; the launch checks the operands' strides and addresses), else None."""
    if r.num_pairs and options().tma and lora_mode != LORA_FUSED and _tma_device(rows):
        return r.tile_table(tma_block_m())
    return None


def launch_down(
    rows,
    w,
    b,
    topk_weights,
    sort_order,
    expert_offsets,
    top_k,
    la,
    lb,
    lora_mode,
    lora_scale,
    y,
    z,
    table,
    atomic: bool,
) -> None:
    """The down projection's launch: TMA-loaded over the tile ``table`` when given (not with
    ``atomic``) and the operands suit TMA (:func:`kernels_tma.tma_ready`), else pointer loads. On sm_90
    the warp-specialised Gluon kernel runs instead (no LoRA term or a split one) where
    :func:`kernels_gluon.ready` holds (option ``gluon_down``)."""
    E, NY, KA = w.shape
    N = sort_order.shape[0]
    if N == 0:
        return
    bb = w if b is None else b
    la_, lb_, z_, R, *lora_strides, RP = _lora_args(la, lb, z, lora_mode, w)
    lb_split, z_split = (lb, z) if lora_mode == LORA_SPLIT else (None, None)
    if (
        table is not None
        and lora_mode != LORA_FUSED
        and not atomic
        and (gluon := _gluon("gluon_down")) is not None
        and gluon.ready(rows, w, lb_split, z_split, RP, tma_block_m())
    ):
        kernels_tma.ensure_allocator()
        gluon.launch(
            rows,
            w,
            b,
            topk_weights,
            sort_order,
            expert_offsets,
            y,
            lb_split,
            z_split,
            table,
            lora_scale,
            RP,
            tma_block_m(),
            num_sms(rows.device),
        )
        return
    if table is not None and not atomic and kernels_tma.tma_ready(rows, w, interpreting()):
        kernels_tma.ensure_allocator()
        _kernels()["down_tma"][_tma_grid(table, NY, rows.device)](
            rows,
            w,
            bb,
            rows if topk_weights is None else topk_weights,
            sort_order,
            expert_offsets,
            y,
            lb_,
            z_,
            table,
            N,
            KA,
            NY,
            E,
            top_k,
            R,
            table.shape[0] // 2,
            w.stride(0),
            w.stride(1),
            w.stride(2),
            bb.stride(0),
            bb.stride(-1),
            *lora_strides[3:],
            lora_scale,
            W_KMAJOR=w.stride(2) == 1,
            HAS_BIAS=b is not None,
            HAS_WEIGHT=topk_weights is not None,
            LORA=lora_mode,
            RP=RP,
            PRECISION=dot_precision(rows.dtype),
        )
        return
    _kernels()["down"][_row_grid(N, E, NY)](
        rows,
        w,
        bb,
        rows if topk_weights is None else topk_weights,
        sort_order,
        expert_offsets,
        y,
        la_,
        lb_,
        z_,
        KA,
        NY,
        E,
        top_k,
        R,
        w.stride(0),
        w.stride(1),
        w.stride(2),
        bb.stride(0),
        bb.stride(-1),
        *lora_strides,
        lora_scale,
        HAS_BIAS=b is not None,
        HAS_WEIGHT=topk_weights is not None,
        ATOMIC=atomic,
        LORA=lora_mode,
        RP=RP,
        PRECISION=dot_precision(rows.dtype),
        E_P2=_e_p2(E),
    )


def _import_gluon(name: str):
    """The Gluon kernel module ``name``, or None where this Triton has no Gluon Hopper language."""
    try:
        return importlib.import_module(f"{__package__}.{name}")
    except ImportError:
        return None


# imported with this module, not at the first launch: torch.compile cannot trace an import (about 0.1 s)
_GLUON_MODULES = {
    option: _import_gluon(name)
    for option, name in (
        ("gluon_down", "kernels_gluon"),
        ("gluon_up", "kernels_gluon_gather"),
        ("gluon_dh", "kernels_gluon_gather"),
        ("gluon_wgrad", "kernels_gluon_wgrad"),
    )
}


def _gluon(option: str):
    """The Gluon kernel module of ``option`` (``gluon_down``: :mod:`.kernels_gluon`; ``gluon_up``,
    ``gluon_dh``: :mod:`.kernels_gluon_gather`; ``gluon_wgrad``: :mod:`.kernels_gluon_wgrad`) when that
    option is on and this Triton has Gluon's Hopper language (Triton >= 3.5), else None. Never under the
    interpreter (Gluon has none)."""
    if interpreting() or not getattr(options(), option):
        return None
    return _GLUON_MODULES[option]


def _gather_table(rows: Tensor, r: Routing, spec: ActSpec, option: str) -> Tensor | None:
    """The tile table (shared with the down projection's) when a GEMM gathering ``rows`` by token may take
    the Gluon kernel of ``option`` (``gluon_up``, ``gluon_dh``): sm_90, the option on, an activation it has;
    else None."""
    gluon = _gluon(option) if rows.is_cuda and r.num_pairs else None
    kind = option.removeprefix("gluon_")
    if gluon is None or spec.name not in gluon.ACTS[kind] or not is_sm90(rows.device):
        return None
    return r.tile_table(tma_block_m())


def _tma_grid(table: Tensor, cols: int, device: torch.device):
    """Every (row tile, column tile) of the tile table, or one program per SM for a persistent config."""
    tiles = lambda m: table.shape[0] // 2 * cdiv(cols, m["BN"])  # noqa: E731  (M row tiles at most)
    return lambda m: (min(tiles(m), num_sms(device)),) if m.get("PERSISTENT") else (tiles(m),)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (host property; 3 under the interpreter, so that a
    persistent program there loops over several tiles)."""
    if interpreting() or device.type != "cuda":
        return 3
    return device_properties(device).multi_processor_count


def _tma_device(x: Tensor) -> bool:
    """Hopper or later (TMA), or the CPU interpreter (which emulates descriptor loads)."""
    if interpreting():
        return True
    return x.is_cuda and device_properties(x.device).major >= 9


@kernel_op("moeyard::triton_tile_table", mutates_args=("table",))
def tile_table_(expert_offsets: Tensor, block_m: int, table: Tensor) -> None:
    """Write the row-tile ``table [2 * M + 1]`` int32 of ``block_m`` rows over ``expert_offsets``."""
    fill_tile_table(expert_offsets, block_m, table)


@tile_table_.register_fake
def _(expert_offsets, block_m, table):
    return None


@kernel_op("moeyard::triton_down_proj", mutates_args=("y", "z"))
def down_proj_(
    rows: Tensor,
    w: Tensor,
    b: Tensor | None,
    topk_weights: Tensor | None,
    sort_order: Tensor,
    expert_offsets: Tensor,
    top_k: int,
    la: Tensor | None,
    lb: Tensor | None,
    lora_mode: int,
    lora_scale: float,
    table: Tensor | None,
    y: Tensor,
    z: Tensor | None,
) -> None:
    """``y[pair] = topk_weights[pair] * (rows[sorted row] @ w[e].T + b[e] (+ s z lb[e]^T))``;
    ``w [E, NY, KA]``; LoRA ``z = rows @ la[e]`` read (split) or written (fused); TMA loads over the
    tile ``table`` when given."""
    launch_down(
        rows, w, b, topk_weights, sort_order, expert_offsets, top_k, la, lb, lora_mode, lora_scale, y, z, table, False
    )


@down_proj_.register_fake
def _(rows, w, b, topk_weights, sort_order, expert_offsets, top_k, la, lb, lora_mode, lora_scale, table, y, z):
    return None


@kernel_op("moeyard::triton_down_proj_atomic", mutates_args=("acc", "z"))
def down_proj_atomic_(
    rows: Tensor,
    w: Tensor,
    b: Tensor | None,
    topk_weights: Tensor | None,
    sort_order: Tensor,
    expert_offsets: Tensor,
    top_k: int,
    la: Tensor | None,
    lb: Tensor | None,
    lora_mode: int,
    lora_scale: float,
    acc: Tensor,
    z: Tensor | None,
) -> None:
    """``acc[token] += topk_weights[pair] * (rows[sorted row] @ w[e].T + b[e] (+ LoRA))`` with float32
    atomics (``acc [T, NY]`` float32; not deterministic)."""
    launch_down(
        rows, w, b, topk_weights, sort_order, expert_offsets, top_k, la, lb, lora_mode, lora_scale, acc, z, None, True
    )


@down_proj_atomic_.register_fake
def _(rows, w, b, topk_weights, sort_order, expert_offsets, top_k, la, lb, lora_mode, lora_scale, acc, z):
    return None


@kernel_op("moeyard::triton_combine", mutates_args=("out",))
def combine_(y: Tensor, topk_ids: Tensor, topk_weights: Tensor | None, num_experts: int, out: Tensor) -> None:
    """``out[t] = sum_k y[t * K + k]`` over valid pairs (invalid: ``w * 0`` if weights are given)."""
    T, K = topk_ids.shape
    H = y.shape[1]
    if T == 0:
        return
    grid = (T, cdiv(H, COMBINE_BH))
    kernels_fwd.combine_kernel[grid](
        y,
        topk_ids,
        y if topk_weights is None else topk_weights,
        out,
        H,
        num_experts,
        K,
        NAN_INVALID=topk_weights is not None,
        BH=COMBINE_BH,
    )


@combine_.register_fake
def _(y, topk_ids, topk_weights, num_experts, out):
    return None


@kernel_op("moeyard::triton_fill_invalid", mutates_args=("y",))
def fill_invalid_(topk_ids: Tensor, topk_weights: Tensor | None, num_experts: int, y: Tensor) -> None:
    """The combine at ``K == 1``, in place: the rows ``y [T, H]`` of pairs whose id lies outside
    ``[0, E)`` are set to 0 (``w * 0`` if weights are given); the other rows are already the output
    and are not touched (reads ``T`` ids, writes only the invalid rows; a block of rows with none
    invalid costs one read of its ids)."""
    T, H = y.shape
    if T == 0:
        return
    grid = (cdiv(T, FILL_BT), cdiv(H, FILL_BH))
    kernels_fwd.fill_invalid_kernel[grid](
        y,
        topk_ids,
        y if topk_weights is None else topk_weights,
        T,
        H,
        num_experts,
        NAN_INVALID=topk_weights is not None,
        BT=FILL_BT,
        BH=FILL_BH,
    )


@fill_invalid_.register_fake
def _(topk_ids, topk_weights, num_experts, y):
    return None


@kernel_op("moeyard::triton_act_grad", mutates_args=("dh", "aw", "dw", "z"))
def act_grad_(
    dout: Tensor,
    w: Tensor,
    b: Tensor | None,
    h: Tensor,
    topk_weights: Tensor,
    sort_order: Tensor,
    expert_offsets: Tensor,
    top_k: int,
    act: str,
    alpha: float,
    limit: float,
    interleaved: bool,
    la: Tensor | None,
    lb: Tensor | None,
    lora_mode: int,
    lora_scale: float,
    table: Tensor | None,
    dh: Tensor,
    aw: Tensor,
    dw: Tensor,
    z: Tensor | None,
) -> None:
    """``d_h`` (sorted), ``aw = w * act(h)`` (sorted) and column-tile partials of the routing-weight
    gradient ``dw [tiles, N]`` from ``dout [T, H]`` and the down weight ``w [E, H, I]`` (plus its LoRA
    term: ``la = B [E, H, R]``, ``lb = A^T [E, I, R]``, ``z = dout[token] @ B_e`` read or written).
    On sm_90 the warp-specialised Gluon kernel runs over the tile ``table`` (when given) where
    :func:`kernels_gluon_gather.dh_ready` holds (option ``gluon_dh``)."""
    E, H, I = w.shape
    N, N1 = h.shape
    if N == 0:
        return
    spec = ActSpec(name=act, alpha=alpha, limit=limit, interleaved=interleaved)
    _, gate_step, up_offset = spec.columns(N1)
    bb = w if b is None else b
    la_, lb_, z_, R, *lora_strides, RP = _lora_args(la, lb, z, lora_mode, w)
    lb_split, z_split = (lb, z) if lora_mode == LORA_SPLIT else (None, None)
    if (
        table is not None
        and lora_mode != LORA_FUSED
        and (gluon := _gluon("gluon_dh")) is not None
        and gluon.dh_ready(dout, w, b, h, lb_split, z_split, act, gate_step, RP, tma_block_m(), N)
    ):
        kernels_tma.ensure_allocator()
        gluon.launch_dh(
            dout,
            w,
            h,
            topk_weights,
            sort_order,
            expert_offsets,
            top_k,
            act,
            alpha,
            limit,
            up_offset,
            dh,
            aw,
            dw,
            lb_split,
            z_split,
            table,
            lora_scale,
            RP,
            tma_block_m(),
            num_sms(dout.device),
        )
        return
    _kernels()["dh"][_row_grid(N, E, I)](
        dout,
        w,
        bb,
        h,
        topk_weights,
        sort_order,
        expert_offsets,
        dh,
        aw,
        dw,
        la_,
        lb_,
        z_,
        H,
        I,
        N1,
        N,
        E,
        top_k,
        R,
        dout.stride(0),
        dout.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        bb.stride(0),
        bb.stride(-1),
        *lora_strides,
        gate_step,
        up_offset,
        alpha,
        limit,
        lora_scale,
        ACT=act,
        DUAL=spec.gated,
        HAS_BIAS=b is not None,
        LORA=lora_mode,
        RP=RP,
        PRECISION=dot_precision(h.dtype),
        E_P2=_e_p2(E),
        PREFETCH=options().prefetch_h and not interpreting(),
    )


@act_grad_.register_fake
def _(
    dout,
    w,
    b,
    h,
    topk_weights,
    sort_order,
    expert_offsets,
    top_k,
    act,
    alpha,
    limit,
    interleaved,
    la,
    lb,
    lora_mode,
    lora_scale,
    table,
    dh,
    aw,
    dw,
    z,
):
    return None


@kernel_op("moeyard::triton_wgrad", mutates_args=("dw", "db", "part", "part_b", "rows_part"))
def wgrad_(
    lhs: Tensor,
    rhs: Tensor,
    lhs_by_token: bool,
    rhs_by_token: bool,
    scale: Tensor | None,
    sorted_token: Tensor,
    expert_offsets: Tensor,
    chunk_rows: int,
    dw: Tensor,
    db: Tensor | None,
    part: Tensor | None,
    part_b: Tensor | None,
    factor: Tensor | None,
    rows_part: Tensor | None,
    tile_major: bool = False,
    alpha: float = 1.0,
    low_rank: bool = False,
) -> None:
    """``dw[e] = alpha * lhs[rows of e]^T @ rhs[rows of e]``, ``db[e] = alpha * sum scale * lhs[rows of e]``.
    An operand ``*_by_token`` is ``[T, *]`` read at each row's token (``sorted_token [N]`` int32),
    else ``[N, *]`` by sorted row; ``scale [N]`` is in sorted-row order too.
    ``chunk_rows > 0``: experts longer than that are split into chunks whose float32 partials go to
    ``part [S, NL, NR]`` (``part_b [S, NL]``) and are summed per expert in a second launch.
    ``factor [E, NL, NR]`` (with ``rows_part [cdiv(NL, rows_block()), N, NR]`` float32): the same pass
    over ``lhs`` writes the partials of the row product ``lhs[row] @ factor[e]``, one per
    ``rows_block()`` columns of ``lhs`` (summed by the caller, :func:`wgrad_rows`).
    ``tile_major``: the programs in tile-major order (:func:`.gemm.weight_tile`).
    ``low_rank``: a LoRA factor's gradient, whose operands are loaded by pointers (no TMA: a descriptor
    made per program cost more than it saved on these short row loops, NOTES round 20).
    (No mutated argument has a default: torch 2.11's fake dispatch of such an op indexed past its
    positional arguments, and ``torch.compile`` failed on the backward.)"""
    launch_wgrad(
        lhs,
        rhs,
        lhs_by_token,
        rhs_by_token,
        scale,
        sorted_token,
        expert_offsets,
        chunk_rows,
        dw,
        db,
        part,
        part_b,
        factor,
        rows_part,
        tile_major,
        alpha,
        low_rank,
    )
    if chunk_rows > 0:
        launch_wgrad_reduce(part, part_b, expert_offsets, chunk_rows, dw, db, alpha)


def launch_wgrad(
    lhs,
    rhs,
    lhs_by_token,
    rhs_by_token,
    scale,
    sorted_token,
    expert_offsets,
    chunk_rows,
    dw,
    db,
    part,
    part_b,
    factor=None,
    rows_part=None,
    tile_major=False,
    alpha=1.0,
    low_rank=False,
) -> None:
    """The first stage of :func:`wgrad_` (every chunk, or every expert when ``chunk_rows == 0``); the Gluon
    kernel (options ``gluon_wgrad`` and ``tma_wgrad``) where it serves: one operand by token, no bias, chunk,
    row product or LoRA factor (:func:`.kernels_gluon_wgrad.ready`)."""
    E, NL, NR = dw.shape
    N = sorted_token.shape[0]
    if (
        db is None
        and chunk_rows == 0
        and factor is None
        and not low_rank
        and dw.is_cuda
        and options().tma_wgrad
        and (gluon := _gluon("gluon_wgrad")) is not None
        and gluon.ready(lhs, rhs, lhs_by_token, rhs_by_token, dw, N)
    ):
        gluon.launch(lhs, rhs, lhs_by_token, sorted_token, expert_offsets, dw, alpha, num_sms(dw.device))
        return
    dbb = dw[:, :, 0] if db is None else db
    chunked = chunk_rows > 0
    part = dw if part is None else part
    part_b = part if part_b is None else part_b
    with_rows = factor is not None
    f = dw if factor is None else factor
    items = max_chunks(N, E, chunk_rows) if chunked else E
    grid = lambda m: (items * cdiv(NL, m["BN"]) * cdiv(NR, m["BK"]),)  # noqa: E731
    tma = (
        not low_rank
        and options().tma_wgrad
        and _tma_device(lhs)
        and all(
            kernels_tma.rows_tma_ready(t, interpreting())
            for t, gathered in ((lhs, lhs_by_token), (rhs, rhs_by_token))
            if not gathered
        )
    )
    if tma:
        kernels_tma.ensure_allocator()
    launcher = "wgrad_rows" if with_rows else "wgrad_thin" if min(NL, NR) <= THIN else "wgrad"
    _kernels()[launcher][grid](
        lhs,
        rhs,
        lhs if scale is None else scale,
        sorted_token,
        expert_offsets,
        dw,
        dbb,
        part,
        part_b,
        f,
        part if rows_part is None else rows_part,
        NL,
        NR,
        E,
        max(chunk_rows, 1),
        alpha,
        lhs.stride(0),
        lhs.stride(1),
        rhs.stride(0),
        rhs.stride(1),
        dw.stride(0),
        dw.stride(1),
        dw.stride(2),
        dbb.stride(0),
        dbb.stride(1),
        f.stride(0),
        f.stride(1),
        f.stride(2),
        N * NR,
        L_GATHER=lhs_by_token,
        R_GATHER=rhs_by_token,
        HAS_DB=db is not None,
        DB_SCALE=scale is not None,
        CHUNKED=chunked,
        PRECISION=dot_precision(lhs.dtype),
        E_P2=_e_p2(E),
        TMA=tma,
        ROWS=with_rows,
        TILE_MAJOR=tile_major,
    )


def launch_wgrad_reduce(part, part_b, expert_offsets, chunk_rows, dw, db, alpha=1.0) -> None:
    """The second stage of a chunked :func:`wgrad_`: each split expert's partials summed in order."""
    E, NL, NR = dw.shape
    dbb = dw[:, :, 0] if db is None else db
    blk = SMALL if interpreting() else REDUCE_BLOCK
    grid = (E * cdiv(NL, blk["BN"]) * cdiv(NR, blk["BK"]),)
    kernels_bwd.wgrad_reduce_kernel[grid](
        part,
        part if part_b is None else part_b,
        expert_offsets,
        dw,
        dbb,
        NL,
        NR,
        E,
        chunk_rows,
        alpha,
        dw.stride(0),
        dw.stride(1),
        dw.stride(2),
        dbb.stride(0),
        dbb.stride(1),
        HAS_DB=db is not None,
        E_P2=_e_p2(E),
        BN=blk["BN"],
        BK=blk["BK"],
        **({} if interpreting() else dict(num_warps=blk["num_warps"])),
    )


@wgrad_.register_fake
def _(
    lhs,
    rhs,
    lhs_by_token,
    rhs_by_token,
    scale,
    sorted_token,
    expert_offsets,
    chunk_rows,
    dw,
    db,
    part,
    part_b,
    factor,
    rows_part,
    tile_major=False,
    alpha=1.0,
    low_rank=False,
):
    return None


# ---------------------------------------------------------------- allocating wrappers


def empty(shape: tuple[int, ...], like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Every buffer a kernel fills (tests replace this to poison buffers with NaN)."""
    return torch.empty(shape, dtype=dtype or like.dtype, device=like.device)


def empty_like(like: Tensor) -> Tensor:
    """A gradient shaped and strided like ``like`` (tests replace this to poison it with NaN)."""
    return torch.empty_like(like)


def up_proj(
    x: Tensor,
    w: Tensor,
    b: Tensor | None,
    r: Routing,
    spec: ActSpec,
    *,
    store_h: bool,
    lora: LoRATerm | None = None,
    gather: bool = True,
) -> tuple[Tensor | None, Tensor, Tensor | None]:
    """``x [T, H]`` (``[N, H]`` sorted rows without ``gather``), ``w [E, N1, H]`` ->
    ``(h [N, N1] | None, a [N, NA], z [N, R] | None)`` in sorted row order; ``z = x @ La_e`` is the
    LoRA term's low-rank rows (kept for backward)."""
    n1 = w.shape[1]
    N = r.num_pairs
    h = empty((N, n1), x) if store_h else None
    a = empty((N, spec.columns(n1)[0]), x)
    mode, z, la, lb = _lora_rows(x, lora, r, gather, n1)
    table = _gather_table(x, r, spec, "gluon_up") if gather else None
    up_proj_(
        x,
        w,
        b,
        r.sort_order,
        r.expert_offsets,
        r.top_k,
        spec.name,
        spec.alpha,
        spec.limit,
        spec.interleaved,
        gather,
        la,
        lb,
        mode,
        0.0 if lora is None else lora.scale,
        table,
        h,
        a,
        z,
    )
    return h, a, z


def low_rank_rows(x: Tensor, la: Tensor, r: Routing, *, gather: bool) -> Tensor:
    """``z [N, R] = x[row] @ la[e]`` in sorted row order (a thin grouped GEMM; ``la [E, K, R]``;
    ``x [T, K]`` read by token with ``gather``, else ``[N, K]`` sorted rows)."""
    _, z, _ = up_proj(x, la.mT, None, r, ActSpec(name="none"), store_h=False, gather=gather)
    return z


def _lora_rows(x: Tensor, lora: LoRATerm | None, r: Routing, gather: bool, num_out: int, z: Tensor | None = None):
    """``(mode, z, la, lb)`` for a GEMM over ``x``'s rows: split mode computes ``z`` here (unless
    given: ``z [N, R] = x[row] @ la[e]`` made already, e.g. by :func:`wgrad_rows`); fused mode hands
    the kernel an empty ``z`` to fill."""
    if lora is None:
        return LORA_NONE, None, None, None
    mode = lora.mode()
    if mode == LORA_SPLIT:
        z = low_rank_rows(x, lora.la, r, gather=gather) if z is None else z
    else:
        z = empty((r.num_pairs, lora.rank), x)
    return mode, z, lora.la, lora.lb


def down_proj(
    rows: Tensor,
    w: Tensor,
    b: Tensor | None,
    topk_weights: Tensor | None,
    r: Routing,
    lora: LoRATerm | None = None,
    z: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Sorted ``rows [N, KA]``, ``w [E, NY, KA]`` -> ``(y [N, NY] by pair (optionally weighted),
    z [N, R] | None)``; ``z``: the LoRA rows when made already (split mode)."""
    y = empty((r.num_pairs, w.shape[1]), rows)
    mode, z, la, lb = _lora_rows(rows, lora, r, False, w.shape[1], z)
    down_proj_(
        rows,
        w,
        b,
        topk_weights,
        r.sort_order,
        r.expert_offsets,
        r.top_k,
        la,
        lb,
        mode,
        0.0 if lora is None else lora.scale,
        _down_table(rows, r, mode),
        y,
        z,
    )
    return y, z


def combine(y: Tensor, r: Routing, topk_weights: Tensor | None) -> Tensor:
    """``y [N, H]`` by pair -> ``[T, H]`` (sum over each token's valid pairs). At ``K == 1`` (as
    every expert-parallel dispatcher calls the local experts) ``y`` is the output once its invalid
    pairs' rows are filled (:func:`fill_invalid_`): no second ``[N, H]`` pass; not even that with
    ``r.zero_invalid`` False and no NaN weights to apply."""
    if r.top_k == 1:
        if r.zero_invalid or topk_weights is not None:
            fill_invalid_(r.topk_ids, topk_weights, r.num_experts, y)
        return y
    out = empty((r.topk_ids.shape[0], y.shape[1]), y)
    combine_(y, r.topk_ids, topk_weights, r.num_experts, out)
    return out


def down_combine(
    rows: Tensor,
    w: Tensor,
    b: Tensor | None,
    topk_weights: Tensor | None,
    r: Routing,
    nan_weights: Tensor | None,
    lora: LoRATerm | None = None,
    z: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``combine(down_proj(...))``: ``([T, NY] in rows.dtype, LoRA rows z [N, R] | None)``. Invalid
    pairs add ``nan_weights * 0`` when given (NaN for a NaN weight), else nothing. With
    ``options().atomic_combine`` (and ``K > 1``) the pair rows are added into a float32 accumulator by
    the down projection (no ``[N, NY]`` round trip; not deterministic); otherwise written by pair and
    combined in a fixed order (at ``K == 1`` in place). ``z``: the LoRA rows when made already."""
    if not options().atomic_combine or r.top_k == 1:
        y, z = down_proj(rows, w, b, topk_weights, r, lora, z)
        return combine(y, r, nan_weights), z
    T, K = r.topk_ids.shape
    acc = torch.zeros((T, w.shape[1]), dtype=torch.float32, device=rows.device)
    mode, z, la, lb = _lora_rows(rows, lora, r, False, w.shape[1], z)
    down_proj_atomic_(
        rows,
        w,
        b,
        topk_weights,
        r.sort_order,
        r.expert_offsets,
        r.top_k,
        la,
        lb,
        mode,
        0.0 if lora is None else lora.scale,
        acc,
        z,
    )
    if nan_weights is not None:
        valid = (r.topk_ids >= 0) & (r.topk_ids < r.num_experts)
        acc += torch.where(valid, 0.0, nan_weights.view(T, K).float() * 0.0).sum(1, keepdim=True)
    return acc.to(rows.dtype), z


def act_grad(
    dout: Tensor,
    w: Tensor,
    b: Tensor | None,
    h: Tensor,
    topk_weights: Tensor,
    r: Routing,
    spec: ActSpec,
    lora: LoRATerm | None = None,
    z: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """``(d_h [N, N1], w * a [N, I], d topk_weights [N] float32, z [N, R] | None)`` from
    ``dout [T, H]``, ``w [E, H, I]`` (``z = dout[token] @ la[e]``, the LoRA term's rows; given when
    made already)."""
    N, I = r.num_pairs, w.shape[2]
    dh = empty(tuple(h.shape), h)
    aw = empty((N, I), h)
    partial = torch.zeros((cdiv(I, _dh_min_bn()), N), dtype=torch.float32, device=h.device)
    mode, z, la, lb = _lora_rows(dout, lora, r, True, I, z)
    act_grad_(
        dout,
        w,
        b,
        h,
        topk_weights,
        r.sort_order,
        r.expert_offsets,
        r.top_k,
        spec.name,
        spec.alpha,
        spec.limit,
        spec.interleaved,
        la,
        lb,
        mode,
        0.0 if lora is None else lora.scale,
        _gather_table(dout, r, spec, "gluon_dh"),
        dh,
        aw,
        partial,
        z,
    )
    return dh, aw, partial.sum(0), z


def wgrad(
    lhs: Tensor,
    rhs: Tensor,
    *,
    lhs_by_token: bool,
    rhs_by_token: bool,
    scale: Tensor | None,
    r: Routing,
    like_w: Tensor,
    like_b: Tensor | None,
    low_rank: bool = False,
    alpha: float = 1.0,
) -> tuple[Tensor, Tensor | None]:
    """Grouped weight (and bias) gradient shaped and strided like ``like_w [E, NL, NR]`` (and ``like_b``),
    times ``alpha`` (e.g. a LoRA scaling); ``scale``: ``[N]`` by pair (the routing weights) or None, the
    bias gradient's row weights.
    ``low_rank``: a LoRA factor's gradient (thin: with an operand read by token, its programs run
    tile-major, ``options().wgrad_tile_major``; pointer loads, no TMA).
    ``options()``: chunked experts (float32 partials of at most ``wgrad_partial_mib``)."""
    dw, db, _ = _wgrad(lhs, rhs, lhs_by_token, rhs_by_token, scale, r, like_w, like_b, None, low_rank, alpha)
    return dw, db


def wgrad_rows(
    lhs: Tensor, rhs: Tensor, factor: Tensor, *, lhs_by_token: bool, r: Routing, alpha: float = 1.0
) -> tuple[Tensor, Tensor]:
    """One pass over ``lhs`` for both of a LoRA factor ``B``'s uses in backward: ``(dw, rows)`` with
    ``dw[e] = alpha * lhs[rows of e]^T @ rhs[rows of e]`` shaped and strided like ``factor [E, NL, R]``
    (``dB``, from ``rhs [N, R]`` in sorted rows) and ``rows [N, R] = lhs[row] @ factor[e]`` in
    ``lhs``'s dtype and sorted rows (``d_y B_e``); ``lhs`` is ``[T, NL]`` read by token with
    ``lhs_by_token``, else ``[N, NL]``. The row product is summed from float32 partials over
    ``rows_block()`` columns of ``lhs`` in a fixed order (deterministic): at Qwen3-30B-A3B's ``d out``
    (``NL`` = 2048, R = 16) they are 8 x ``[N, R]``, an eighth of the bytes of the second pass over
    ``lhs`` they replace. (Summing straight into the output dtype, ``torch.sum(out=)``, measured slower
    than the sum and a cast on an H200: 0.46 against 0.44 ms at qwen3.5-35b-a3b's ``d out``.)"""
    dw, _, part = _wgrad(lhs, rhs, lhs_by_token, False, None, r, factor, None, factor, True, alpha)
    return dw, part.sum(0).to(lhs.dtype)


def wgrad_rows_fits(num_pairs: int, nl: int, rank: int) -> bool:
    """Whether :func:`wgrad_rows`'s float32 partials (``cdiv(NL, rows_block())`` of ``[N, R]``) fit the
    ``wgrad_partial_mib`` budget of the weight gradients' partials (:mod:`.options`)."""
    return cdiv(nl, rows_block()) * num_pairs * rank * 4 <= options().wgrad_partial_mib * 2**20


def _wgrad(lhs, rhs, lhs_by_token, rhs_by_token, scale, r, like_w, like_b, factor, low_rank, alpha):
    """``(dw, db, row-product partials | None)`` (see :func:`wgrad`, :func:`wgrad_rows`)."""
    dw = empty_like(like_w)
    db = None if like_b is None else empty_like(like_b)
    opts = options()
    _, NL, NR = like_w.shape
    N = r.num_pairs
    chunk = opts.chunk_rows(N, NL, NR)
    chunk = chunk if 0 < chunk < N else 0  # no expert can be split when chunk >= N
    part = part_b = None
    if chunk:
        slots = max_partial_slots(N, chunk)
        part = empty((slots, NL, NR), lhs, torch.float32)
        part_b = None if db is None else empty((slots, NL), lhs, torch.float32)
    if scale is not None:  # by pair -> by sorted row: the kernel reads it without the pair index
        scale = scale.reshape(-1).index_select(0, r.sort_order)
    rows_part = None
    if factor is not None:
        rows_part = empty((cdiv(NL, rows_block()), N, NR), lhs, torch.float32)
    wgrad_(
        lhs,
        rhs,
        lhs_by_token,
        rhs_by_token,
        scale,
        r.sorted_token,
        r.expert_offsets,
        chunk,
        dw,
        db,
        part,
        part_b,
        factor,
        rows_part,
        low_rank and opts.wgrad_tile_major and (lhs_by_token or rhs_by_token),
        alpha,
        low_rank,
    )
    return dw, db, rows_part
