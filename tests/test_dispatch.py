"""Dispatch as an algorithm: the plan's invariants, permute / unpermute and their gradients.

Legend: T tokens, H hidden size, E experts, K top-k, N = T*K pairs, R rows of the permuted buffer.
"""

import dataclasses

import pytest
import torch

import moeyard
from helpers import count_torch_ops, random_ids
from moeyard import make_plan, permute, unpermute


def _ids(T, K, E, case):
    if case == "random":
        return random_ids(T, K, E)
    if case == "one_expert":
        return torch.full((T, K), E - 1, dtype=torch.int64)
    if case == "empty_experts":
        return random_ids(T, K, E, experts=list(range(0, E, 2)))
    if case == "invalid":
        ids = random_ids(T, K, E)
        ids[0, 0], ids[-1, K - 1] = -1, E
        if T > 2:
            ids[T // 2, 0] = E + 3
        return ids
    raise AssertionError(case)


# (T, K, E, ids, align)
CASES = [
    pytest.param(16, 2, 8, "random", 1, id="base"),  # plain sort, no padding
    pytest.param(16, 2, 8, "random", 8, id="align8"),  # every group padded to a multiple of 8
    pytest.param(13, 3, 7, "random", 4, id="primeE_align4"),  # prime E, odd T, padding
    pytest.param(16, 2, 8, "empty_experts", 1, id="empty"),  # odd experts get nothing: equal offsets
    pytest.param(16, 2, 8, "empty_experts", 16, id="empty_align"),  # empty groups stay empty after padding
    pytest.param(12, 1, 5, "one_expert", 1, id="one_expert"),  # all pairs in the last group
    pytest.param(12, 2, 5, "one_expert", 4, id="one_expert_dup"),  # duplicate ids within a token, padded
    pytest.param(7, 1, 1, "random", 1, id="E1"),  # a single group
    pytest.param(6, 4, 4, "random", 2, id="k_eq_E"),  # K = E
    pytest.param(1, 2, 8, "random", 16, id="T1_align"),  # one token, buffer mostly padding
    pytest.param(0, 2, 8, "random", 1, id="T0"),  # no pairs at all
    pytest.param(0, 2, 8, "random", 8, id="T0_align"),  # no pairs, padded worst case
    pytest.param(10, 2, 6, "invalid", 1, id="invalid"),  # ids -1 / E / E+3 sort to the tail
    pytest.param(10, 2, 6, "invalid", 4, id="invalid_align"),  # invalid ids with padding
]


@pytest.mark.parametrize("T,K,E,case,align", CASES)
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32], ids=["i64", "i32"])
def test_plan_invariants(T, K, E, case, align, id_dtype):
    ids = _ids(T, K, E, case).to(id_dtype)
    ids_before = ids.clone()
    plan = make_plan(ids, E, align=align)
    assert torch.equal(ids, ids_before)
    N = T * K
    flat = ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < E)
    assert torch.equal(plan.valid, valid)
    assert (plan.num_tokens, plan.top_k, plan.num_experts, plan.align) == (T, K, E, align)

    # counts equal a bincount; offsets equal the cumulative counts
    counts = torch.bincount(flat[valid], minlength=E)
    assert torch.equal(plan.tokens_per_expert.long(), counts)
    assert torch.equal(plan.expert_offsets.long(), torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]))

    # aligned offsets: multiples of align, each group holds its count plus less than align padding
    po = plan.padded_offsets.long()
    assert po[0] == 0 and (po % align == 0).all()
    sizes = po.diff()
    assert (sizes >= counts).all() and (sizes < counts + align).all()
    assert plan.num_rows >= po[E] and plan.num_rows >= N
    if align == 1:
        assert torch.equal(po, plan.expert_offsets.long()) and plan.num_rows == N

    # the sort is stable and expert-major: by (expert, pair index), invalid pairs last
    key = torch.where(valid, flat, E)
    want_order = sorted(range(N), key=lambda n: (int(key[n]), n))
    assert plan.sort_order.tolist() == want_order

    # pair_rows: a bijection from valid pairs onto the non-pad rows, each inside its expert's group
    rows = plan.pair_rows
    assert rows.unique().numel() == N and (rows >= 0).all() and (rows < plan.num_rows).all()
    for n in range(N):
        if valid[n]:
            e = int(flat[n])
            assert po[e] <= rows[n] < po[e] + counts[e]
        else:
            assert rows[n] >= po[E]
    non_pad = {int(po[e]) + j for e in range(E) for j in range(int(counts[e]))}
    assert set(rows[valid].tolist()) == non_pad
    # pair_rows inverts sort_order: sorted position i of a valid pair lands on row i + its group's shift
    for i, n in enumerate(plan.sort_order.tolist()):
        if valid[n]:
            e = int(flat[n])
            assert rows[n] == po[e] + (i - plan.expert_offsets[e])

    # row_tokens / row_experts
    rt = plan.row_tokens()
    for n in range(N):
        assert rt[rows[n]] == (n // K if valid[n] else T)
    pad = torch.ones(plan.num_rows, dtype=torch.bool)
    pad[rows] = False
    assert (rt[pad] == T).all()
    re = plan.row_experts()
    for e in range(E):
        assert (re[po[e] : po[e + 1]] == e).all()


@pytest.mark.parametrize("T,K,E,case,align", CASES)
def test_permute_unpermute(T, K, E, case, align):
    H = 5
    ids = _ids(T, K, E, case)
    plan = make_plan(ids, E, align=align)
    x = torch.randn(T, H, dtype=torch.float64)
    x_before = x.clone()
    rows = permute(x, plan)
    assert rows.shape == (plan.num_rows, H)
    valid = plan.valid
    # each valid pair's row holds its token; pad rows are zero
    for n in range(T * K):
        if valid[n]:
            assert torch.equal(rows[plan.pair_rows[n]], x[n // K])
    used = torch.zeros(plan.num_rows, dtype=torch.bool)
    used[plan.pair_rows[valid]] = True
    if align > 1:
        assert (rows[~used] == 0).all()
    # permute then unpermute without weights returns x for every (valid) slot
    pairs = unpermute(rows, plan)
    assert pairs.shape == (T, K, H)
    v = valid.view(T, K)
    assert torch.equal(pairs[v], x.unsqueeze(1).expand(T, K, H)[v])
    dropped = unpermute(rows + 1, plan, drop_invalid=True)  # +1: nothing is zero by accident
    assert (dropped[~v] == 0).all() and torch.equal(dropped[v], (x.unsqueeze(1) + 1).expand(T, K, H)[v])
    # weighted combine against the formula
    w = torch.rand(T, K, dtype=torch.float64)
    w_before = w.clone()
    got = unpermute(rows, plan, w, drop_invalid=True)
    want = (w * v).sum(1, keepdim=True) * x
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(x, x_before) and torch.equal(w, w_before)


@pytest.mark.parametrize("align", [1, 4])
def test_gradients(align):
    """permute's backward is a scatter-add into [T, H]; unpermute's is differentiable in rows and weights."""
    T, K, E, H = 6, 2, 4, 3
    plan = make_plan(random_ids(T, K, E), E, align=align)
    x = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    w = torch.rand(T, K, dtype=torch.float64, requires_grad=True)
    scale = torch.randn(plan.num_rows, 1, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x, w: unpermute(permute(x, plan) * scale, plan, w), (x, w))
    # the composition with a row-wise linear map is the token-wise weighted sum of that map
    out = unpermute(permute(x, plan) * 2, plan, w)
    torch.testing.assert_close(out, 2 * w.sum(1, keepdim=True) * x)
    g = torch.randn(T, H, dtype=torch.float64)
    gx, gw = torch.autograd.grad(out, (x, w), g)
    torch.testing.assert_close(gx, 2 * w.sum(1, keepdim=True) * g)
    torch.testing.assert_close(gw, 2 * (g * x).sum(1, keepdim=True).expand(T, K))


@pytest.mark.parametrize("align", [1, 4])
def test_permute_backward_with_invalid_ids(align):
    """permute's backward (a gathered sum per token) equals the scatter-add of a plain index_select, also
    with ids outside [0, E): with align 1 their rows hold the token (and pass its gradient back), with
    align > 1 they hold the zero row (and pass none)."""
    T, K, E, H = 9, 3, 4, 5
    ids = random_ids(T, K, E)
    ids[::2, 1] = E + 3
    ids[1, 0] = -1
    plan = make_plan(ids, E, align=align)
    x = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    d_rows = torch.randn(plan.num_rows, H, dtype=torch.float64)
    (gx,) = torch.autograd.grad(permute(x, plan), x, d_rows)
    ref = x.detach().clone().requires_grad_()
    if align == 1:
        rows = ref.index_select(0, plan.sort_order // K)
    else:
        rows = torch.cat([ref, ref.new_zeros(1, H)]).index_select(0, plan.row_tokens())
    (want,) = torch.autograd.grad(rows, ref, d_rows)
    torch.testing.assert_close(gx, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_combine(dtype):
    """The weighted combine of bf16 rows is no worse than rounding the float64 result once (+ one unit)."""
    T, K, E, H = 32, 4, 8, 64
    plan = make_plan(random_ids(T, K, E), E)
    rows = torch.randn(plan.num_rows, H, dtype=torch.float64)
    w = torch.rand(T, K, dtype=torch.float64)
    exact = unpermute(rows, plan, w)
    got = unpermute(rows.to(dtype), plan, w.to(dtype)).double()
    naive = (unpermute(rows.to(dtype), plan).double() * w.to(dtype).double().unsqueeze(-1)).sum(1).to(dtype).double()
    err = lambda a: ((a - exact).abs().max() / exact.abs().max()).item()  # noqa: E731
    assert err(got) <= 2 * err(naive) + {torch.float32: 1e-6, torch.bfloat16: 8e-3}[dtype]


def test_errors():
    ids = random_ids(4, 2, 4)
    with pytest.raises(TypeError, match="topk_ids"):
        make_plan(ids.float(), 4)
    with pytest.raises(TypeError, match="topk_ids"):
        make_plan(ids > 1, 4)
    with pytest.raises(ValueError, match="topk_ids"):
        make_plan(ids.reshape(-1), 4)
    for bad in (0, -1, 2.0, None):
        with pytest.raises(ValueError, match="num_experts"):
            make_plan(ids, bad)
    for bad in (0, -4, 1.5):
        with pytest.raises(ValueError, match="align"):
            make_plan(ids, 4, align=bad)
    plan = make_plan(ids, 4)
    with pytest.raises(ValueError, match="^x: "):
        permute(torch.randn(5, 3), plan)
    with pytest.raises(ValueError, match="^x: "):
        permute(torch.randn(4), plan)
    rows = permute(torch.randn(4, 3), plan)
    with pytest.raises(ValueError, match="^rows: "):
        unpermute(rows[:-1], plan)
    with pytest.raises(ValueError, match="topk_weights"):
        unpermute(rows, plan, torch.rand(4, 3))


def test_plan_is_frozen():
    plan = make_plan(random_ids(4, 2, 4), 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.align = 2
    assert isinstance(plan, moeyard.DispatchPlan) and plan.num_pairs == 8


@pytest.mark.parametrize("T,K,E,case,align", [c for c in CASES if c.values[4] == 1])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32], ids=["i64", "i32"])
def test_sort_by_expert_is_the_plan_core(T, K, E, case, align, id_dtype):
    """The triton backend's four-op sort gives make_plan's order and offsets, invalid ids last."""
    from moeyard.dispatch import sort_by_expert

    ids = _ids(T, K, E, case).to(id_dtype)
    if case == "invalid":
        ids[0, 0] = torch.iinfo(id_dtype).min
        ids[-1, -1] = torch.iinfo(id_dtype).max
    plan = make_plan(ids, E)
    keys, order, offsets = sort_by_expert(ids, E)
    assert torch.equal(order, plan.sort_order) and torch.equal(offsets, plan.expert_offsets)
    assert offsets.dtype == torch.int32 and keys.dtype == (torch.uint8 if E <= 255 else torch.int16)
    assert ((keys == E) == ~plan.valid[order]).all()


@pytest.mark.parametrize(
    "E,key_dtype",
    [(8, torch.uint8), (255, torch.uint8), (256, torch.int16), (32767, torch.int16), (32768, torch.int32)],
)
def test_sort_keys_in_the_narrowest_dtype(E, key_dtype):
    """The sort keys take the narrowest dtype holding ``0 .. E`` (one radix pass per byte), and the order,
    offsets and keys equal a stable sort of the int64 keys, ids ``E - 1``, ``E`` (invalid) and negative
    ones among them; ``make_plan`` with alignment (which indexes by the sorted keys) keeps its rows."""
    from moeyard.dispatch import sort_by_expert

    g = torch.Generator().manual_seed(E)
    ids = torch.randint(max(E - 6, 0), E, (50, 3), generator=g)
    ids[0, 0], ids[1, 1], ids[2, 2], ids[3, 0] = E - 1, E, -5, 0
    keys, order, offsets = sort_by_expert(ids, E)
    want = torch.where((ids >= 0) & (ids < E), ids, E).reshape(-1)
    want_keys, want_order = torch.sort(want, stable=True)
    assert keys.dtype == key_dtype and torch.equal(order, want_order) and torch.equal(keys.long(), want_keys)
    assert torch.equal(offsets.long(), torch.searchsorted(want_keys, torch.arange(E + 1)))
    plan = make_plan(ids, E, align=4)
    rows = plan.pair_rows[want_order]
    assert torch.equal(rows[:-1] < rows[1:], torch.ones(rows.numel() - 1, dtype=torch.bool))  # rows ascend
    assert torch.equal(plan.padded_offsets[1:] - plan.padded_offsets[:-1], (offsets.diff() + 3) // 4 * 4)


def test_searchsorted_needles_not_cached_during_a_graph_capture(monkeypatch):
    """A tensor made while a CUDA graph is captured holds its values only after a replay: the cached
    ``arange`` needles of the sort are made outside captures only."""
    from moeyard import dispatch

    dispatch._cached_bounds.cache_clear()
    dispatch._bounds(7, torch.device("cpu"), torch.uint8)
    assert dispatch._cached_bounds.cache_info().currsize == 1  # eager: made once, kept
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(dispatch, "_cached_bounds", lambda *a: pytest.fail("kept a tensor made during a capture"))
    made, real = [], torch.arange
    monkeypatch.setattr(torch, "arange", lambda *a, **kw: made.append(kw.pop("device")) or real(*a, **kw))
    assert torch.equal(dispatch._bounds(7, torch.device("cuda"), torch.uint8), real(8, dtype=torch.uint8))
    assert made == [torch.device("cuda")]


def test_weighted_sum_kernels_match_reference():
    """The weighted sum's Triton kernels under the interpreter (float32) against the float64 ``bmm``:
    output, both gradients (through autograd, as on CUDA), K = 1, 3, 8, H not a multiple of the tiles."""
    pytest.importorskip("triton")
    import os
    from unittest import mock

    from moeyard.weighted_sum import _WeightedSum, weighted_sum_reference

    g = torch.Generator().manual_seed(11)
    with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}):
        for T, K, H in ((7, 3, 40), (9, 8, 600), (2, 1, 5)):
            p = torch.randn(T, K, H, generator=g, dtype=torch.float64)
            w = torch.randn(T, K, generator=g, dtype=torch.float64)
            dy = torch.randn(T, H, generator=g, dtype=torch.float64)
            leaves = [p.clone().requires_grad_(), w.clone().requires_grad_()]
            weighted_sum_reference(*leaves).backward(dy)
            pf, wf = p.float().requires_grad_(), w.float().requires_grad_()
            out = _WeightedSum.apply(pf, wf)
            out.backward(dy.float())
            ref = (p.transpose(1, 2) @ w.unsqueeze(-1)).squeeze(-1)  # independent of the bmm above
            for got, want in ((out, ref), (pf.grad, leaves[0].grad), (wf.grad, leaves[1].grad)):
                assert torch.allclose(got.double(), want, atol=1e-5, rtol=1e-5), (T, K, H)


def test_gathered_sum_kernel_matches_reference():
    """The gathering weighted sum (Triton, under the interpreter, float32) against float64: rows read
    through an index from a buffer with a wider row stride (a row used by several pairs, the zero row
    for pairs not sent), with and without weights, the kept copy of the gathered rows exact;
    K = 1, 3, 8, H not a multiple of the tile. The torch path (CPU) gives the same."""
    pytest.importorskip("triton")
    import os
    from unittest import mock

    from moeyard.weighted_sum import gathered_sum

    g = torch.Generator().manual_seed(12)
    for T, K, H in ((7, 3, 40), (9, 8, 600), (2, 1, 5)):
        src = torch.randn(T * K + 2, H + 3, generator=g, dtype=torch.float64)[:, :H]
        src[-1] = 0
        index = torch.randint(0, T * K + 2, (T, K), generator=g)
        index[0, 0] = T * K + 1  # the zero row
        w = torch.randn(T, K, generator=g, dtype=torch.float64)
        rows = src[index]  # [T, K, H]
        want_w, want = (rows * w.unsqueeze(-1)).sum(1), rows.sum(1)
        cpu_out, cpu_pairs = gathered_sum(src, index, w, keep=True)
        assert torch.allclose(cpu_out, want_w) and torch.equal(cpu_pairs, rows)
        with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}):
            from moeyard.weighted_sum_triton import gathered_sum as kernel

            out, pairs = kernel(src.float(), index, w.float(), True)
            plain, none = kernel(src.float(), index, None, False)
        assert none is None and torch.equal(pairs, rows.float()), (T, K, H)
        for got, ref in ((out, want_w), (plain, want)):
            assert torch.allclose(got.double(), ref, atol=1e-5, rtol=1e-5), (T, K, H)
        # an index < 0 names no row: the pair adds nothing, even where the row it would read is NaN and its
        # weight zero (an unwritten row of an invalid pair)
        skip = index.clone()
        skip[:, 0] = -1
        src_nan = src.clone()
        src_nan[index[:, 0]] = float("nan")
        src_nan[-1] = 0
        w0 = w.clone()
        w0[:, 0] = 0
        want_skip = (src[skip.clamp(min=0)] * (skip >= 0).unsqueeze(-1) * w0.unsqueeze(-1)).sum(1)
        keep_nan = ~torch.isin(skip[:, 1:], index[:, 0]).any(1)  # tokens none of whose other pairs read NaN
        cpu_skip, _ = gathered_sum(src_nan, skip, w0)
        with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}):
            kernel_skip, kept = kernel(src_nan.float(), skip, w0.float(), True)
        assert torch.equal(kept[:, 0], torch.zeros_like(kept[:, 0]))
        for got in (cpu_skip, kernel_skip):
            assert not got[keep_nan].isnan().any(), (T, K, H)
            assert torch.allclose(got[keep_nan].double(), want_skip[keep_nan], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("weighted", [False, True])
def test_gathered_sum_in_windows(weighted):
    """Rows that come a window at a time (``row0``, summed ``into`` the first window's result) give the sum
    of all rows at once: the Triton kernel (interpreter) and the torch path, windows of uneven sizes, an
    index < 0 and rows past the last window naming no row, tokens with no pair in a window. The window's
    rows are all the kernel reads: the rows outside it are NaN in the buffer the window is cut from."""
    pytest.importorskip("triton")
    import os
    from unittest import mock

    from moeyard.weighted_sum import gathered_sum

    g = torch.Generator().manual_seed(5)
    T, K, H, R = 11, 3, 70, 40
    src = torch.randn(R, H, generator=g)
    index = torch.randint(0, R + 4, (T, K), generator=g)  # >= R: past the last window
    index[0] = -1  # a token with no row at all
    index[1, 1] = -1
    w = torch.randn(T, K, generator=g) if weighted else None
    named = (index >= 0) & (index < R)
    rows = src[index.clamp(0, R - 1)] * named.unsqueeze(-1)
    want = (rows * (w if weighted else torch.ones(T, K)).unsqueeze(-1)).sum(1)
    for interpret in ("0", "1"):
        with mock.patch.dict(os.environ, {"TRITON_INTERPRET": interpret}):
            whole, _ = gathered_sum(src, index, w)
            out = None
            for r0, r1 in ((0, 13), (13, 14), (14, 40)):
                window = torch.full_like(src, float("nan"))
                window[r0:r1] = src[r0:r1]
                into = out
                out, _ = gathered_sum(window[r0:r1], index, w, row0=r0, into=out)
                assert into is None or out is into  # summed in place
        assert torch.allclose(whole, want, atol=1e-5), interpret
        assert torch.allclose(out, want, atol=1e-5), interpret
    # in bf16 the window's sum is added to into's values in float32 and rounded once, on both paths
    src16, into16 = src.bfloat16(), torch.randn(T, H, generator=g).bfloat16()
    w16 = None if w is None else w.bfloat16()
    exact = (
        (src16.float()[index.clamp(0, R - 1)] * named.unsqueeze(-1))
        .mul((w16.float() if weighted else torch.ones(T, K)).unsqueeze(-1))
        .sum(1)
    )
    for interpret in ("0", "1"):
        with mock.patch.dict(os.environ, {"TRITON_INTERPRET": interpret}):
            got, _ = gathered_sum(src16, index, w16, into=into16.clone())
        torch.testing.assert_close(got, (into16.float() + exact).bfloat16(), rtol=0, atol=0)
    for bad in (torch.zeros(T, H + 1), torch.zeros(T, H, dtype=torch.float64), torch.zeros(H, T).t()):
        with pytest.raises(ValueError, match="into"):
            gathered_sum(src, index, w, into=bad)
    with pytest.raises(ValueError, match="row0"):
        gathered_sum(src, index, w, row0=-1)


@pytest.mark.parametrize("weighted", [False, True])
def test_gathered_sum_into_column_windows(weighted):
    """``out``: each column window's sum written into those columns of a wider tensor (rows ``H`` apart,
    unit column stride) gives the whole sum bit for bit, on the Triton kernel (interpreter) and the torch
    path; the columns outside the window are not touched; ``out`` with ``into``, of the wrong shape or
    with a column stride is refused."""
    pytest.importorskip("triton")
    import os
    from unittest import mock

    from moeyard.weighted_sum import gathered_sum

    g = torch.Generator().manual_seed(7)
    T, K, H, R = 10, 3, 90, 35
    src = torch.randn(R, H, generator=g).bfloat16()
    index = torch.randint(-1, R, (T, K), generator=g)
    w = torch.randn(T, K, generator=g).bfloat16() if weighted else None
    for interpret in ("0", "1"):
        dx = torch.full((T, H), float("nan"), dtype=torch.bfloat16)
        with mock.patch.dict(os.environ, {"TRITON_INTERPRET": interpret}):
            run = gathered_sum
            if interpret == "1":  # imported only here: a kernel module first imported without it is not interpreted
                from moeyard.weighted_sum_triton import gathered_sum as kernel

                run = lambda *a, **k: kernel(*a, False, **k)  # noqa: E731
            whole, _ = run(src, index, w)
            for c0, c1 in ((0, 32), (32, 33), (33, 90)):
                got, _ = run(src[:, c0:c1].contiguous(), index, w, out=dx[:, c0:c1])
                assert got.data_ptr() == dx[:, c0:c1].data_ptr()
                assert dx[:, c1:].isnan().all()  # the columns after the window: untouched
        assert torch.equal(dx, whole), interpret
    for kw in (
        dict(out=torch.zeros(T, 5, dtype=torch.bfloat16)),
        dict(out=torch.zeros(H, T, dtype=torch.bfloat16).t()),
        dict(out=torch.zeros(T, H, dtype=torch.bfloat16), into=torch.zeros(T, H, dtype=torch.bfloat16)),
    ):
        with pytest.raises(ValueError, match="out"):
            gathered_sum(src, index, w, **kw)


@pytest.mark.parametrize("weighted", [False, True])
def test_gathered_sum_row_terms(weighted):
    """``row_terms[t]`` joins token ``t``'s float32 sum before the one rounding, on the Triton kernel
    (interpreter) and the torch path, alone and with ``into``: a NaN term makes that token's row NaN and no
    other; a term of zero changes no bit. A ``row_terms`` of the wrong shape, dtype or device is refused."""
    pytest.importorskip("triton")
    import os
    from unittest import mock

    from moeyard.weighted_sum import gathered_sum

    g = torch.Generator().manual_seed(6)
    T, K, H, R = 9, 4, 70, 30
    src = torch.randn(R, H, generator=g).bfloat16()
    index = torch.randint(-2, R, (T, K), generator=g)  # < 0: names no row
    w = torch.randn(T, K, generator=g).bfloat16() if weighted else None
    terms = torch.randn(T, generator=g)
    terms[2] = float("nan")
    into = torch.randn(T, H, generator=g).bfloat16()
    named = index >= 0
    exact = (src.float()[index.clamp(0)] * named.unsqueeze(-1)).mul(
        (w.float() if weighted else torch.ones(T, K)).unsqueeze(-1)
    ).sum(1) + terms[:, None]
    for interpret in ("0", "1"):
        with mock.patch.dict(os.environ, {"TRITON_INTERPRET": interpret}):
            got, _ = gathered_sum(src, index, w, row_terms=terms)
            got_into, _ = gathered_sum(src, index, w, into=into.clone(), row_terms=terms)
            plain, _ = gathered_sum(src, index, w)
            zero, _ = gathered_sum(src, index, w, row_terms=torch.zeros(T))
        torch.testing.assert_close(got, exact.bfloat16(), rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(got_into, (exact + into.float()).bfloat16(), rtol=0, atol=0, equal_nan=True)
        assert got[2].isnan().all() and not got[torch.arange(T) != 2].isnan().any(), interpret
        assert torch.equal(zero, plain), interpret
    for bad in (torch.zeros(T + 1), torch.zeros(T, dtype=torch.float64), torch.zeros(T, 1)):
        with pytest.raises(ValueError, match="row_terms"):
            gathered_sum(src, index, w, row_terms=bad)


@pytest.mark.parametrize("extra_rows", [0, 5])  # a permutation of the rows, or rows no pair names (padding)
@pytest.mark.parametrize("weights_grad", [True, False])
def test_gathered_weighted_sum(extra_rows, weights_grad):
    """The combine that reads each pair's row where it is, against a gather then the bmm (float64):
    output, the rows' gradient (zero in rows no pair names) and the weights' gradient."""
    from moeyard.weighted_sum import gathered_weighted_sum, weighted_sum_reference

    g = torch.Generator().manual_seed(13)
    T, K, H = 7, 3, 10
    R = T * K + extra_rows
    index = torch.randperm(R, generator=g)[: T * K].view(T, K)
    src = torch.randn(R, H, generator=g, dtype=torch.float64)
    w = torch.rand(T, K, generator=g, dtype=torch.float64)
    dy = torch.randn(T, H, generator=g, dtype=torch.float64)
    a = [src.clone().requires_grad_(), w.clone().requires_grad_(weights_grad)]
    b = [src.clone().requires_grad_(), w.clone().requires_grad_(weights_grad)]
    out = gathered_weighted_sum(a[0], index, a[1])
    want = weighted_sum_reference(b[0].index_select(0, index.view(-1)).view(T, K, H), b[1])
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    out.backward(dy)
    want.backward(dy)
    torch.testing.assert_close(a[0].grad, b[0].grad, rtol=1e-12, atol=1e-12)
    unnamed = torch.ones(R, dtype=torch.bool)
    unnamed[index.view(-1)] = False
    assert (a[0].grad[unnamed] == 0).all() and int(unnamed.sum()) == extra_rows
    if weights_grad:
        torch.testing.assert_close(a[1].grad, b[1].grad, rtol=1e-12, atol=1e-12)
    assert gathered_weighted_sum(src[:2], index[:0], w[:0]).shape == (0, H)


@pytest.mark.parametrize("extra_rows", [0, 5])
def test_scattered_pairs_grad_kernel(extra_rows):
    """The combine backward's kernel (Triton, under the interpreter, float32) against float64: each pair's
    scaled gradient row written at the row the index names, the other rows zero; K = 1, 3, 8, H not a
    multiple of the tile."""
    pytest.importorskip("triton")
    import os
    from unittest import mock

    g = torch.Generator().manual_seed(14)
    for T, K, H in ((7, 3, 40), (9, 8, 600), (2, 1, 5)):
        R = T * K + extra_rows
        index = torch.randperm(R, generator=g)[: T * K].view(T, K)
        w = torch.randn(T, K, generator=g, dtype=torch.float64)
        dy = torch.randn(T, H, generator=g, dtype=torch.float64)
        want = torch.zeros(R, H, dtype=torch.float64)
        want[index.view(-1)] = (w.unsqueeze(-1) * dy.unsqueeze(1)).view(-1, H)
        with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}):
            from moeyard.weighted_sum_triton import scattered_pairs_grad

            got = scattered_pairs_grad(w.float(), dy.float(), index, R)
        assert got.shape == (R, H) and got.dtype == torch.float32
        assert torch.allclose(got.double(), want, atol=1e-5, rtol=1e-5), (T, K, H)


@pytest.mark.parametrize(
    "T,K,E",
    [
        (1, 1, 1),
        (1, 8, 128),
        (3, 2, 8),
        (64, 8, 128),
        (256, 8, 128),
        (2048, 1, 160),
        (5, 4, 255),
        (33, 2, 256),
        (9, 7, 1022),
    ],
)
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32, torch.uint8])
def test_one_launch_sort_equals_the_torch_sort(T, K, E, id_dtype):
    """The one-launch sort of few pairs (``moeyard.dispatch_triton``, under the interpreter here) gives the
    torch path's keys, stable order and offsets: ids outside ``[0, E)`` (negative, ``E``, above) to the tail,
    pairs up to ``MAX_PAIRS`` (2048), experts up to ``MAX_EXPERTS`` (1022), N not a power of two."""
    from moeyard import dispatch
    from moeyard.dispatch_triton import MAX_EXPERTS, MAX_PAIRS, fits, sort_by_expert_small

    g = torch.Generator().manual_seed(T * K + E)
    low, high = (0, min(E + 3, 256)) if id_dtype == torch.uint8 else (-3, E + 3)
    ids = torch.randint(low, high, (T, K), generator=g).to(id_dtype)
    want = dispatch._sort(dispatch._sort_keys(ids, E), E)
    got = sort_by_expert_small(ids, E, dispatch._key_dtype(E))
    for name, a, b in zip(("keys", "order", "offsets"), want, got, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert fits(T * K, E) and not fits(MAX_PAIRS + 1, E) and not fits(T * K, MAX_EXPERTS + 1) and not fits(0, E)
    with pytest.raises(ValueError, match="^topk_ids: expected 1 to"):
        sort_by_expert_small(ids, MAX_EXPERTS + 1, torch.int16)


def test_sort_by_expert_takes_one_launch_for_few_pairs(monkeypatch):
    """Under the interpreter (as on CUDA), up to ``MAX_PAIRS`` pairs never reach ``torch.sort`` and give its
    values; one pair more goes to ``torch.sort``."""
    from moeyard import dispatch
    from moeyard.dispatch_triton import MAX_PAIRS

    ids = torch.randint(-1, 17, (MAX_PAIRS // 4, 4), generator=torch.Generator().manual_seed(0))
    want = dispatch._sort(dispatch._sort_keys(ids, 16), 16)
    calls, real = [], torch.sort
    monkeypatch.setattr(torch, "sort", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got = dispatch.sort_by_expert(ids, 16)
    assert not calls and all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    dispatch.sort_by_expert(torch.cat([ids.reshape(-1), ids.new_zeros(1)]).unsqueeze(1), 16)
    assert calls


def _both_paths(fn):
    """``fn()`` on the torch path (``TRITON_INTERPRET=0``) and on the Triton kernels (the interpreter)."""
    import os
    from unittest import mock

    out = []
    for interpret in ("0", "1"):
        with mock.patch.dict(os.environ, {"TRITON_INTERPRET": interpret}):
            out.append(fn())
    return out


# the CASES plus more pairs than one program of the plan kernels holds (PLAN_BLOCK 1024), more than the
# one-launch sort takes (2048), and more experts than pairs
PLAN_CASES = CASES + [
    pytest.param(700, 3, 37, "invalid", 1, id="programs"),
    pytest.param(700, 3, 37, "invalid", 16, id="programs_align16"),
    pytest.param(3, 2, 1500, "random", 4, id="E_gt_rows"),
]


@pytest.mark.parametrize("T,K,E,case,align", PLAN_CASES)
def test_plan_kernel_equals_the_torch_plan(T, K, E, case, align):
    """:func:`make_plan` on its Triton kernels (one launch after the sort: ``moeyard.dispatch_triton.plan_``)
    gives the torch path's plan, field for field and dtype for dtype: padding, empty experts, invalid ids,
    several programs, E above the rows."""
    from moeyard.dispatch import one_pass

    ids = _ids(T, K, E, case)
    ref, got = _both_paths(lambda: make_plan(ids, E, align=align))
    for f in dataclasses.fields(ref):
        a, b = getattr(ref, f.name), getattr(got, f.name)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), f.name
        else:
            assert a == b, f.name
    assert not one_pass(ids[:0]) and _both_paths(lambda: one_pass(ids)) == [False, T > 0]


@pytest.mark.parametrize("T,K,E,case,align", PLAN_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's NaN * 0
def test_plan_rows_kernel_equals_the_torch_path(T, K, E, case, align, dtype):
    """:func:`moeyard.dispatch.plan_rows` on its kernel (``moeyard.dispatch_triton.rows_``) against the torch
    ops: row tokens, each pair's row (-1 invalid), row weights (float32, 0 on padding and invalid rows) and the
    NaN terms, from strided weights with NaN and inf on invalid pairs; values checked against the plan too."""
    from moeyard.dispatch import plan_rows

    ids = _ids(T, K, E, case)
    g = torch.Generator().manual_seed(T + E)
    w = torch.rand(K, T, generator=g).to(dtype).t()  # strided [T, K]
    if case == "invalid":
        w[0, 0], w[-1, K - 1] = float("nan"), float("inf")
    plan = make_plan(ids, E, align=align)
    (ref, ref_plain), (got, got_plain) = _both_paths(lambda: (plan_rows(plan, w, nan_terms=True), plan_rows(plan, w)))
    for name, a, b in zip(("row_tokens", "live_rows", "row_weights", "nan_terms"), ref, got, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True, msg=name)
    assert ref_plain[3] is None and got_plain[3] is None
    assert all(torch.equal(a, b) for a, b in zip(ref_plain[:3], got[:3], strict=True))
    row_tokens, live_rows, row_weights, terms = got
    live = plan.valid.view(T, K)
    assert torch.equal(live_rows >= 0, live) and row_tokens.shape == (plan.num_rows,)
    tokens = torch.arange(T).unsqueeze(1).expand(T, K)
    assert torch.equal(row_tokens[live_rows[live]], tokens[live])
    assert torch.equal(row_weights[live_rows[live]], w.float()[live])
    assert (row_tokens == T).sum() == plan.num_rows - live.sum()
    assert torch.allclose(row_weights.abs().sum(), w.float()[live].sum())
    assert terms.isnan().sum() == (2 if case == "invalid" else 0) and (terms.nan_to_num() == 0).all()
    with pytest.raises(ValueError, match="^topk_weights: expected a tensor of shape"):
        plan_rows(plan, w[:, :1] if K > 1 else w.t().expand(2, T))


def test_plan_host_ops():
    """At few tokens the host sets the pace, and each torch op costs it 10-30 µs on a GPU machine: the plan and
    its rows (:func:`make_plan`, :func:`moeyard.dispatch.plan_rows`) take their three kernel launches and a
    fixed budget of torch ops around them: at align 1 ten allocations and five views; at 16 the padded offsets'
    nine ops more. The torch path takes 33 ops at align 1 and 43 at 16, most of them kernels."""
    from moeyard import dispatch_triton
    from moeyard.dispatch import plan_rows

    ids, w = random_ids(64, 8, 128), torch.rand(64, 8)
    paused = [(dispatch_triton, name) for name in ("sort_small_", "plan_", "rows_")]
    counts = [
        count_torch_ops(lambda align=align: plan_rows(make_plan(ids, 128, align=align), w, nan_terms=True), paused)
        for align in (1, 16)
    ]
    assert counts[0] <= 15 and counts[1] <= 24, counts
