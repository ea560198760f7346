"""Custom ops around the kernels (``torch.library.custom_op``, writing into preallocated outputs,
with fake registrations so ``torch.compile`` can trace them) and the allocating wrappers.

Legend: T tokens, H hidden, I intermediate, N1 = 2I (gated) or I, E experts, K top-k, N = T*K
pairs. Weights are ``[E, out, in]`` views of any strides (never copied).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton

from ...activations import GATED
from ...dispatch import make_plan
from . import kernels_bwd, kernels_fwd
from .schedule import (DH_CONFIGS, DUAL_CONFIGS, GEMM_CONFIGS, SMALL, WGRAD_CONFIGS, dot_precision, gemm_tile,
                       interpreting, max_row_tiles, tuned, wgrad_tile)

Tensor = torch.Tensor
COMBINE_BH = 1024


@dataclass(frozen=True, kw_only=True)
class Routing:
    """Device-side routing metadata (from :func:`moeyard.dispatch.make_plan`; no host sync).

    Attributes:
        topk_ids: ``[T, K]`` integer ids (contiguous). sort_order: ``[N]`` int64, sorted position
        -> flat pair. expert_offsets: ``[E + 1]`` int32. num_experts: E.
    """

    topk_ids: Tensor
    sort_order: Tensor
    expert_offsets: Tensor
    num_experts: int

    @property
    def top_k(self) -> int:
        return self.topk_ids.shape[1]

    @property
    def num_pairs(self) -> int:
        return self.topk_ids.numel()


def routing(topk_ids: Tensor, num_experts: int) -> Routing:
    """Sort the ``[T, K]`` pairs by expert (stable) and find each expert's rows."""
    plan = make_plan(topk_ids, num_experts)
    return Routing(topk_ids=topk_ids.contiguous(), sort_order=plan.sort_order,
                   expert_offsets=plan.expert_offsets, num_experts=num_experts)


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


def _kernels():
    """The tuned launchers, built on first use (autotuning needs a GPU; the interpreter does not)."""
    if not _LAUNCHERS:
        _LAUNCHERS.update(
            up=tuned(kernels_fwd.up_kernel, DUAL_CONFIGS, ["NA", "H", "N1", "E"], gemm_tile(2)),
            down=tuned(kernels_fwd.down_kernel, GEMM_CONFIGS, ["KA", "NY", "E"], gemm_tile(1)),
            dh=tuned(kernels_bwd.dh_kernel, DH_CONFIGS, ["H", "I", "N1", "E"], gemm_tile(1)),
            wgrad=tuned(kernels_bwd.wgrad_kernel, WGRAD_CONFIGS, ["NL", "NR"], wgrad_tile),
        )
    return _LAUNCHERS


_LAUNCHERS: dict = {}


def _dh_min_bn() -> int:
    return SMALL["BN"] if interpreting() else min(c.kwargs["BN"] for c in DH_CONFIGS)


def _e_p2(e: int) -> int:
    return triton.next_power_of_2(max(e, 2))


def _row_grid(n: int, e: int, cols: int):
    return lambda m: (max_row_tiles(n, e, m["BM"]) * triton.cdiv(cols, m["BN"]),)


# ---------------------------------------------------------------- custom ops (write into outputs)

@torch.library.custom_op("moeyard::triton_up_proj", mutates_args=("h", "a"))
def up_proj_(x: Tensor, w: Tensor, b: Optional[Tensor], sort_order: Tensor, expert_offsets: Tensor,
             top_k: int, act: str, alpha: float, limit: float, interleaved: bool,
             h: Optional[Tensor], a: Tensor) -> None:
    """``h = x[token] @ w[e].T + b[e]`` (sorted rows, written when given), ``a = act(h)``."""
    E, N1, H = w.shape
    N = sort_order.shape[0]
    if N == 0:
        return
    spec = ActSpec(name=act, alpha=alpha, limit=limit, interleaved=interleaved)
    NA, gate_step, up_offset = spec.columns(N1)
    bb = w if b is None else b
    _kernels()["up"][_row_grid(N, E, NA)](
        x, w, bb, sort_order, expert_offsets, a if h is None else h, a,
        H, NA, N1, E, top_k,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), bb.stride(0), bb.stride(-1),
        gate_step, up_offset, alpha, limit,
        ACT=act, DUAL=spec.gated, HAS_BIAS=b is not None, STORE_H=h is not None,
        PRECISION=dot_precision(x.dtype), E_P2=_e_p2(E))


@up_proj_.register_fake
def _(x, w, b, sort_order, expert_offsets, top_k, act, alpha, limit, interleaved, h, a):
    return None


@torch.library.custom_op("moeyard::triton_down_proj", mutates_args=("y",))
def down_proj_(rows: Tensor, w: Tensor, b: Optional[Tensor], topk_weights: Optional[Tensor], sort_order: Tensor,
               expert_offsets: Tensor, top_k: int, y: Tensor) -> None:
    """``y[pair] = topk_weights[pair] * (rows[sorted row] @ w[e].T + b[e])``; ``w [E, NY, KA]``."""
    E, NY, KA = w.shape
    N = sort_order.shape[0]
    if N == 0:
        return
    bb = w if b is None else b
    _kernels()["down"][_row_grid(N, E, NY)](
        rows, w, bb, rows if topk_weights is None else topk_weights, sort_order, expert_offsets, y,
        KA, NY, E, top_k,
        w.stride(0), w.stride(1), w.stride(2), bb.stride(0), bb.stride(-1),
        HAS_BIAS=b is not None, HAS_WEIGHT=topk_weights is not None,
        PRECISION=dot_precision(rows.dtype), E_P2=_e_p2(E))


@down_proj_.register_fake
def _(rows, w, b, topk_weights, sort_order, expert_offsets, top_k, y):
    return None


@torch.library.custom_op("moeyard::triton_combine", mutates_args=("out",))
def combine_(y: Tensor, topk_ids: Tensor, topk_weights: Optional[Tensor], num_experts: int, out: Tensor) -> None:
    """``out[t] = sum_k y[t * K + k]`` over valid pairs (invalid: ``w * 0`` if weights are given)."""
    T, K = topk_ids.shape
    H = y.shape[1]
    if T == 0:
        return
    grid = (T, triton.cdiv(H, COMBINE_BH))
    kernels_fwd.combine_kernel[grid](
        y, topk_ids, y if topk_weights is None else topk_weights, out, H, num_experts, K,
        NAN_INVALID=topk_weights is not None, BH=COMBINE_BH)


@combine_.register_fake
def _(y, topk_ids, topk_weights, num_experts, out):
    return None


@torch.library.custom_op("moeyard::triton_act_grad", mutates_args=("dh", "aw", "dw"))
def act_grad_(dout: Tensor, w: Tensor, b: Optional[Tensor], h: Tensor, topk_weights: Tensor, sort_order: Tensor,
              expert_offsets: Tensor, top_k: int, act: str, alpha: float, limit: float, interleaved: bool,
              dh: Tensor, aw: Tensor, dw: Tensor) -> None:
    """``d_h`` (sorted), ``aw = w * act(h)`` (sorted) and column-tile partials of the routing-weight
    gradient ``dw [tiles, N]`` from ``dout [T, H]`` and the down weight ``w [E, H, I]``."""
    E, H, I = w.shape
    N, N1 = h.shape
    if N == 0:
        return
    spec = ActSpec(name=act, alpha=alpha, limit=limit, interleaved=interleaved)
    _, gate_step, up_offset = spec.columns(N1)
    bb = w if b is None else b
    _kernels()["dh"][_row_grid(N, E, I)](
        dout, w, bb, h, topk_weights, sort_order, expert_offsets, dh, aw, dw,
        H, I, N1, N, E, top_k,
        dout.stride(0), dout.stride(1), w.stride(0), w.stride(1), w.stride(2), bb.stride(0), bb.stride(-1),
        gate_step, up_offset, alpha, limit,
        ACT=act, DUAL=spec.gated, HAS_BIAS=b is not None, PRECISION=dot_precision(h.dtype), E_P2=_e_p2(E))


@act_grad_.register_fake
def _(dout, w, b, h, topk_weights, sort_order, expert_offsets, top_k, act, alpha, limit, interleaved, dh, aw, dw):
    return None


@torch.library.custom_op("moeyard::triton_wgrad", mutates_args=("dw", "db"))
def wgrad_(lhs: Tensor, rhs: Tensor, lhs_by_token: bool, rhs_by_token: bool, scale: Optional[Tensor],
           sort_order: Tensor, expert_offsets: Tensor, top_k: int, dw: Tensor, db: Optional[Tensor]) -> None:
    """``dw[e] = lhs[rows of e]^T @ rhs[rows of e]``, ``db[e] = sum scale * lhs[rows of e]``.
    An operand ``*_by_token`` is ``[T, *]`` read at each row's token, else ``[N, *]`` by sorted row."""
    E, NL, NR = dw.shape
    dbb = dw[:, :, 0] if db is None else db
    grid = lambda m: (E * triton.cdiv(NL, m["BN"]) * triton.cdiv(NR, m["BK"]),)  # noqa: E731
    _kernels()["wgrad"][grid](
        lhs, rhs, lhs if scale is None else scale, sort_order, expert_offsets, dw, dbb,
        NL, NR, top_k,
        lhs.stride(0), lhs.stride(1), rhs.stride(0), rhs.stride(1), dw.stride(0), dw.stride(1), dw.stride(2),
        dbb.stride(0), dbb.stride(1),
        L_GATHER=lhs_by_token, R_GATHER=rhs_by_token, HAS_DB=db is not None, DB_SCALE=scale is not None,
        PRECISION=dot_precision(lhs.dtype))


@wgrad_.register_fake
def _(lhs, rhs, lhs_by_token, rhs_by_token, scale, sort_order, expert_offsets, top_k, dw, db):
    return None


# ---------------------------------------------------------------- allocating wrappers

def empty(shape: tuple[int, ...], like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Every buffer a kernel fills (tests replace this to poison buffers with NaN)."""
    return torch.empty(shape, dtype=dtype or like.dtype, device=like.device)


def up_proj(x: Tensor, w: Tensor, b: Tensor | None, r: Routing, spec: ActSpec, *,
            store_h: bool) -> tuple[Tensor | None, Tensor]:
    """``x [T, H]``, ``w [E, N1, H]`` -> ``(h [N, N1] | None, a [N, NA])`` in sorted row order."""
    n1 = w.shape[1]
    h = empty((r.num_pairs, n1), x) if store_h else None
    a = empty((r.num_pairs, spec.columns(n1)[0]), x)
    up_proj_(x, w, b, r.sort_order, r.expert_offsets, r.top_k, spec.name, spec.alpha, spec.limit,
             spec.interleaved, h, a)
    return h, a


def down_proj(rows: Tensor, w: Tensor, b: Tensor | None, topk_weights: Tensor | None, r: Routing) -> Tensor:
    """Sorted ``rows [N, KA]``, ``w [E, NY, KA]`` -> ``y [N, NY]`` by pair (optionally weighted)."""
    y = empty((r.num_pairs, w.shape[1]), rows)
    down_proj_(rows, w, b, topk_weights, r.sort_order, r.expert_offsets, r.top_k, y)
    return y


def combine(y: Tensor, r: Routing, topk_weights: Tensor | None) -> Tensor:
    """``y [N, H]`` by pair -> ``[T, H]`` (sum over each token's valid pairs)."""
    out = empty((r.topk_ids.shape[0], y.shape[1]), y)
    combine_(y, r.topk_ids, topk_weights, r.num_experts, out)
    return out


def act_grad(dout: Tensor, w: Tensor, b: Tensor | None, h: Tensor, topk_weights: Tensor, r: Routing,
             spec: ActSpec) -> tuple[Tensor, Tensor, Tensor]:
    """``(d_h [N, N1], w * a [N, I], d topk_weights [N] float32)`` from ``dout [T, H]``, ``w [E, H, I]``."""
    N, I = r.num_pairs, w.shape[2]
    dh = empty(tuple(h.shape), h)
    aw = empty((N, I), h)
    partial = torch.zeros((triton.cdiv(I, _dh_min_bn()), N), dtype=torch.float32, device=h.device)
    act_grad_(dout, w, b, h, topk_weights, r.sort_order, r.expert_offsets, r.top_k, spec.name, spec.alpha,
              spec.limit, spec.interleaved, dh, aw, partial)
    return dh, aw, partial.sum(0)


def wgrad(lhs: Tensor, rhs: Tensor, *, lhs_by_token: bool, rhs_by_token: bool, scale: Tensor | None,
          r: Routing, like_w: Tensor, like_b: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """Grouped weight (and bias) gradient shaped and strided like ``like_w [E, NL, NR]`` (and ``like_b``)."""
    dw = torch.empty_like(like_w)
    db = None if like_b is None else torch.empty_like(like_b)
    wgrad_(lhs, rhs, lhs_by_token, rhs_by_token, scale, r.sort_order, r.expert_offsets, r.top_k, dw, db)
    return dw, db
