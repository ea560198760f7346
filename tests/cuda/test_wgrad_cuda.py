"""The grouped weight gradients on a CUDA GPU, in particular the warp-specialised Gluon kernel
(:mod:`moeyard.experts.triton.kernels_gluon_wgrad`, sm_90): ``dW[e] = alpha L[rows of e]^T R[rows of e]`` with
one operand read by token, against float64 and against the Triton kernel, on the cases that break a tiled
reduction over ragged row groups, and the whole layer's gradients against the float64 oracle."""

import pytest
import torch

from moeyard.experts import triton as triton_backend  # noqa: F401  (registers "triton")

pytestmark = pytest.mark.cuda
DEV = "cuda"
BK = 64


def _sm90():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels are for sm_90")


def _routing_ids(case: str, T: int, K: int, E: int, g) -> torch.Tensor:
    """``[T, K]`` expert ids: every expert size a tiled reduction gets wrong somewhere (0, 1, 63, 64, 65, 128,
    200 rows, then random), the first expert shorter than a step (its last window starts before row 0);
    ``sentinel``: a quarter of the tokens routed nowhere (id ``E``: their pairs sort past ``expert_offsets[E]``)."""
    sizes = [17, 0, 1, 63, 64, 65, 128, 200]  # pairs of experts 0..7
    flat = torch.cat([torch.full((n,), e) for e, n in enumerate(sizes)])
    rest = torch.randint(len(sizes), E, (T * K - flat.numel(),), generator=g)
    ids = torch.cat([flat, rest])[torch.randperm(T * K, generator=g)].view(T, K)
    if case == "sentinel":
        ids[: T // 4] = E
    return ids.to(DEV)


@pytest.mark.parametrize("case", ["up", "down", "sentinel", "strided_fp32_dw", "float16", "three_programs"])
def test_gluon_wgrad(case, monkeypatch):
    """``ops.wgrad`` on the Gluon kernel (asserted to run once) against float64 and the Triton kernel: ``up``
    (``L = d_h`` sorted, ``R = x`` by token) and ``down`` (``L = d_out`` by token, ``R`` sorted); NL 208 and
    NR 144 (partial last row and column tiles); alpha 0.5; ``sentinel``: pairs past
    ``expert_offsets[E]`` whose sorted rows are NaN and whose tokens' rows are NaN (never read); a ``dW``
    transposed in memory and float32; float16; three programs (8 tiles each through one ring, of 0 to 4 steps)."""
    _sm90()
    from moeyard.experts.triton import kernels_gluon_wgrad as gw, ops
    from moeyard.experts.triton.kernels_tma import weight_tma_ready
    from moeyard.experts.triton.options import use_options

    calls, stores = [], []
    real = gw.launch
    monkeypatch.setattr(gw, "launch", lambda *a, **k: (calls.append(1), real(*a, **k)))
    kernel = gw.wgrad_kernel

    class Spy:  # which store path the launch compiled in
        def __getitem__(self, grid):
            return lambda *a, **k: (stores.append(k["TMA_STORE"]), kernel[grid](*a, **k))

    monkeypatch.setattr(gw, "wgrad_kernel", Spy())
    if case == "three_programs":
        monkeypatch.setattr(ops, "num_sms", lambda device: 3)
    g = torch.Generator().manual_seed(7)
    T, K, E, NL, NR = 700, 3, 12, 208, 144
    dtype = torch.float16 if case == "float16" else torch.bfloat16
    ids = _routing_ids(case, T, K, E, g)
    r = ops.routing(ids, E)
    N = T * K
    by_token_lhs = case == "down"
    lhs = torch.randn(T if by_token_lhs else N, NL, generator=g).to(DEV, dtype)
    rhs = torch.randn(N if by_token_lhs else T, NR, generator=g).to(DEV, dtype)
    valid = int(r.expert_offsets[-1])
    if case == "sentinel":  # sorted rows past the experts' rows, and tokens routed nowhere: NaN, never read
        lhs[valid:] = float("nan")
        rhs[: T // 4] = float("nan")
    like = torch.empty(E, NL, NR, device=DEV, dtype=dtype)
    if case == "strided_fp32_dw":
        like = torch.empty(E, NR, NL, device=DEV, dtype=torch.float32).mT
    kw = dict(
        lhs_by_token=by_token_lhs, rhs_by_token=not by_token_lhs, scale=None, r=r, like_w=like, like_b=None, alpha=0.5
    )
    with use_options(gluon_wgrad=True):
        got, _ = ops.wgrad(lhs, rhs, **kw)
    assert calls == [1], "the Gluon weight gradient runs once"
    # 16-bit dW goes out by TMA stores (boxes clipped at NL = 208 and NR = 144); the transposed float32 one by row
    assert stores == [case != "strided_fp32_dw"] and weight_tma_ready(got) == stores[0]
    with use_options(gluon_wgrad=False):
        tri, _ = ops.wgrad(lhs, rhs, **kw)
    assert got.dtype == like.dtype and got.stride() == like.stride()
    tok = r.sorted_token.long()[:valid]
    expert = ids.reshape(-1)[r.sort_order][:valid]
    ell = (lhs[tok] if by_token_lhs else lhs[:valid]).double()
    are = (rhs[:valid] if by_token_lhs else rhs[tok]).double()
    want = torch.stack([0.5 * ell[expert == e].T @ are[expert == e] for e in range(E)])
    assert torch.isfinite(got).all()
    assert (got[1] == 0).all(), "an expert without rows gets a zero gradient"
    for name, out in (("gluon", got), ("triton", tri)):
        err = ((out.double() - want).norm() / want.norm()).item()
        assert err < 4e-3, f"{name}: rel err {err:.2e}"
    assert ((got.double() - tri.double()).abs().max() <= 0.02 * want.abs().max()).item()


@pytest.mark.parametrize("by_token_lhs", [False, True], ids=["up", "down"])
def test_wgrad_without_rows(by_token_lhs):
    """No rows at all (an expert-parallel rank that receives none): a zero gradient for every expert, no
    TMA descriptor over an empty operand (its shape must be positive), Gluon kernel on or off."""
    _sm90()
    from moeyard.experts.triton import ops
    from moeyard.experts.triton.options import use_options

    E, NL, NR = 4, 208, 144
    r = ops.routing(torch.zeros(0, 2, dtype=torch.int64, device=DEV), E)
    lhs = torch.randn(0, NL, device=DEV, dtype=torch.bfloat16)
    rhs = torch.randn(0, NR, device=DEV, dtype=torch.bfloat16)
    like = torch.full((E, NL, NR), float("nan"), device=DEV, dtype=torch.bfloat16)
    for gluon in (True, False):
        with use_options(gluon_wgrad=gluon):
            got, _ = ops.wgrad(
                lhs,
                rhs,
                lhs_by_token=by_token_lhs,
                rhs_by_token=not by_token_lhs,
                scale=None,
                r=r,
                like_w=like,
                like_b=None,
                alpha=0.5,
            )
        assert got.shape == (E, NL, NR) and (got == 0).all(), gluon


def test_gluon_wgrad_layer(monkeypatch):
    """The layer's weight gradients through the Gluon kernel (both projections, base trained, no biases):
    every output and gradient against the float64 oracle within twice torch's own bfloat16 error."""
    _sm90()
    from test_triton_cuda import _check, _problem

    from moeyard.experts.triton import kernels_gluon_wgrad as gw
    from moeyard.experts.triton.options import use_options

    calls = []
    real = gw.launch
    monkeypatch.setattr(gw, "launch", lambda *a, **k: (calls.append(a[2]), real(*a, **k)))
    p, ids = _problem(1000, 512, 192, 16, 4)
    with use_options(gluon_wgrad=True):
        _check(p, ids, torch.bfloat16)
    assert sorted(calls) == [False, True], "dW_up (R by token) and dW_down (L by token) on the Gluon kernel"
