"""The e4m3 grouped GEMM in Triton (:mod:`moeyard.quant.fp8_grouped`) against its float32 reference: the
gather by row index, zero rows (pad rows, an index past the source), empty experts, sizes that are no
multiple of a tile, and bad input. Triton's interpreter on a CPU; CUDA where present."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from moeyard.kernel_op import interpreting  # noqa: E402

DEVICES = ["cuda"] if torch.cuda.is_available() else (["cpu"] if interpreting() else [])
if not DEVICES:
    pytest.skip("needs CUDA or Triton's interpreter (TRITON_INTERPRET=1)", allow_module_level=True)

from moeyard.quant import fp8_grouped  # noqa: E402
from moeyard.quant.fp8_triton import rowwise  # noqa: E402


def _operands(M, K, E, N, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    a, s_a = rowwise((torch.randn(M, K, generator=g) * torch.logspace(-2, 2, K)).to(device))
    b, s_b = rowwise(torch.randn(E * N, K, generator=g).to(device))
    return a, s_a, b.view(E, N, K), s_b.view(E, N)


def _close(got, ref, dtype):
    # float32 output: Hopper's e4m3 MMA accumulates with about 14 bits of mantissa (DeepSeek-V3, arXiv
    # 2412.19437, section 3.3.2), measured 5e-5 to 9e-5 at K = 40 and 64 on an H200
    tol = 3e-4 if dtype == torch.float32 else 1e-2
    err = (got.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)
    assert err < tol, float(err)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("counts", [[5, 0, 37, 16], [0, 0, 0, 58], [16, 16, 16, 16]])
def test_gathered_rows_match_reference(device, dtype, counts):
    M, K, N = 23, 40, 50  # K, N: no multiple of a tile
    E = len(counts)
    a, s_a, b, s_b = _operands(M, K, E, N, device)
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device=device)
    R = int(offsets[-1])
    g = torch.Generator().manual_seed(1)
    index = torch.randint(0, M + 1, (R,), generator=g).to(device)  # M: a pad row (zero)
    got = fp8_grouped.grouped_mm(a, s_a, b, s_b, offsets, dtype, index=index)
    ref = fp8_grouped.reference(a, s_a, b, s_b, offsets, dtype, index=index)
    _close(got, ref, dtype)
    pad = index == M
    if pad.any():
        assert torch.all(got[pad] == 0)  # a pad row reads zeros, whatever its scale


@pytest.mark.parametrize("device", DEVICES)
def test_sorted_rows_and_rows_past_the_experts(device):
    M, K, N, E = 70, 64, 32, 3
    a, s_a, b, s_b = _operands(M, K, E, N, device)
    offsets = torch.tensor([0, 20, 20, 61], dtype=torch.int32, device=device)  # rows 61.. belong to no expert
    got = fp8_grouped.grouped_mm(a, s_a, b, s_b, offsets, torch.float32)
    ref = fp8_grouped.reference(a, s_a, b, s_b, offsets, torch.float32)
    assert got.shape == (M, N)
    _close(got[:61], ref[:61], torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_inputs_unchanged_and_empty(device):
    a, s_a, b, s_b = _operands(8, 32, 2, 16, device)
    before = [t.clone() for t in (a.view(torch.uint8), s_a, b.view(torch.uint8), s_b)]
    offsets = torch.tensor([0, 3, 8], dtype=torch.int32, device=device)
    fp8_grouped.grouped_mm(a, s_a, b, s_b, offsets, torch.bfloat16)
    after = (a.view(torch.uint8), s_a, b.view(torch.uint8), s_b)
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    assert fp8_grouped.grouped_mm(a, s_a, b, s_b, offsets, torch.bfloat16, index=empty).shape == (0, 16)


def test_bad_input_is_named():
    device = DEVICES[0]
    a, s_a, b, s_b = _operands(8, 32, 2, 16, device)
    offsets = torch.tensor([0, 3, 8], dtype=torch.int32, device=device)
    with pytest.raises(TypeError, match="a must be float8_e4m3fn"):
        fp8_grouped.grouped_mm(a.float(), s_a, b, s_b, offsets, torch.bfloat16)
    with pytest.raises(TypeError, match="scale_b must be float32"):
        fp8_grouped.grouped_mm(a, s_a, b, s_b.double(), offsets, torch.bfloat16)
    with pytest.raises(ValueError, match="share K"):
        fp8_grouped.grouped_mm(a[:, :16], s_a, b, s_b, offsets, torch.bfloat16)
    with pytest.raises(ValueError, match="offsets"):
        fp8_grouped.grouped_mm(a, s_a, b, s_b, offsets[:2], torch.bfloat16)
    with pytest.raises(ValueError, match="scale_a"):
        fp8_grouped.grouped_mm(a, s_a[:3], b, s_b, offsets, torch.bfloat16)


ON_CPU = DEVICES[0] == "cpu"
gpu_only = pytest.mark.skipif(ON_CPU, reason="sizes too large for Triton's interpreter")


@pytest.mark.parametrize(
    "gluon", [False, pytest.param(True, marks=pytest.mark.skipif(ON_CPU, reason="no Gluon on a CPU"))]
)
@pytest.mark.parametrize("gather", [False, True], ids=["in-order", "gathered"])
@pytest.mark.parametrize(
    "counts, K, N",
    [
        pytest.param([300, 0, 1, 129, 0, 77], 2048, 600, marks=gpu_only),  # several row tiles, empty experts
        pytest.param([128, 128], 4096, 512, marks=gpu_only),  # the longest reduction the anchor shapes have
        ([0, 0, 0, 33], 80, 72),  # all rows to one expert; K and N no multiple of a tile
        ([1, 1, 1, 1], 32, 40),  # one row per expert
    ],
)
def test_each_kernel(gluon, gather, counts, K, N):
    """On Hopper the Gluon kernel (``gluon=True``) and the Triton kernel (``False``) both match the
    float32 reference, rows in expert order (the down projection, the up projection's input gradient) and
    rows gathered by index (the up projection, the down projection's input gradient; pad rows zero), and
    the rows of each expert come from its own weight only (a tile's rows past its expert's end are not
    stored)."""
    device = DEVICES[0]
    E, R = len(counts), sum(counts)
    M = 37 if gather else R + 5  # in order: 5 rows past the experts
    a, s_a, b, s_b = _operands(M, K, E, N, device, seed=3)
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device=device)
    index = None
    if gather:
        index = torch.randint(0, M + 1, (R,), generator=torch.Generator().manual_seed(4)).to(device)  # M: pad
    got = fp8_grouped.grouped_mm(a, s_a, b, s_b, offsets, torch.bfloat16, index=index, gluon=gluon)
    ref = fp8_grouped.reference(a, s_a, b, s_b, offsets, torch.bfloat16, index=index)
    assert got.shape == (R if gather else M, N)
    _close(got[:R], ref[:R], torch.bfloat16)
    for e in range(E):
        lo, hi = sum(counts[:e]), sum(counts[: e + 1])
        if hi > lo:
            _close(got[lo:hi], ref[lo:hi], torch.bfloat16)
    if gather:
        assert torch.all(got[index == M] == 0)


@pytest.mark.parametrize("device", DEVICES)
def test_tile_table_made_once_per_offsets(device):
    # the step's GEMMs share one tile table: handed out again for the same offsets tensor and row count,
    # a table of its own (not kept) for other offsets, a new one after the offsets changed in place
    pytest.importorskip("triton.experimental.gluon")
    from moeyard.quant import fp8_gluon

    off = torch.tensor([0, 100, 100, 300, 340], dtype=torch.int32, device=device)
    tiles = fp8_grouped.TileTable()
    first = tiles.get(off, 340)
    assert tiles.get(off, 340) is first and torch.equal(first, fp8_gluon.tile_table(off, 340))
    other = tiles.get(off.clone(), 340)
    assert other is not first and torch.equal(other, first) and tiles.get(off, 340) is first
    assert tiles.get(off, 400) is not first  # another row count
    off[1] = 200
    changed = tiles.get(off, 340)
    assert changed is not first and torch.equal(changed, fp8_gluon.tile_table(off, 340))
    assert not torch.equal(changed, first)


@pytest.mark.parametrize(
    "gluon", [False, pytest.param(True, marks=pytest.mark.skipif(ON_CPU, reason="no Gluon on a CPU"))]
)
@pytest.mark.parametrize("gather", [False, True], ids=["in-order", "gathered"])
def test_weight_slice_taken_as_is(gluon, gather):
    """``b`` a slice of a wider weight's rows (each expert's rows contiguous, experts further apart: a column
    window of the up projection's input gradient) gives the wide GEMM's columns bit for bit, as its
    contiguous copy does, and the slice is not modified."""
    device = DEVICES[0]
    counts, K, wide, (c0, c1) = (
        ([300, 0, 1, 129], 256, 768, (256, 512)) if not ON_CPU else ([0, 3, 5, 2], 32, 48, (16, 40))
    )
    E, R = len(counts), sum(counts)
    M = 37 if gather else R
    a, s_a, b, s_b = _operands(M, K, E, wide, device, seed=5)
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device=device)
    index = torch.randint(0, M + 1, (R,), generator=torch.Generator().manual_seed(6)).to(device) if gather else None
    whole = fp8_grouped.grouped_mm(a, s_a, b, s_b, offsets, torch.bfloat16, index=index, gluon=gluon)
    part, before = b[:, c0:c1], b.clone()
    assert not part.is_contiguous()
    got = fp8_grouped.grouped_mm(a, s_a, part, s_b[:, c0:c1], offsets, torch.bfloat16, index=index, gluon=gluon)
    copy = fp8_grouped.grouped_mm(
        a, s_a, part.contiguous(), s_b[:, c0:c1].contiguous(), offsets, torch.bfloat16, index=index, gluon=gluon
    )
    assert torch.equal(got[:R], copy[:R]) and torch.equal(got[:R], whole[:R, c0:c1])
    assert torch.equal(b.view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize(
    "gluon", [False, pytest.param(True, marks=pytest.mark.skipif(ON_CPU, reason="no Gluon on a CPU"))]
)
@pytest.mark.parametrize("gather", [False, True], ids=["in-order", "gathered"])
@pytest.mark.parametrize("kmajor", [True, False], ids=["B", "A^T"])
@pytest.mark.parametrize("rank", [4, 16, pytest.param(32, marks=gpu_only), pytest.param(64, marks=gpu_only)])
def test_low_rank_term(gluon, gather, kmajor, rank):
    """The low-rank term ``s z lb_e^T`` (LoRA on an FP8 base) added after the scales matches the reference,
    with ``lb`` rank-contiguous (a forward GEMM's ``B``) or not (an input gradient's ``A^T``), on both kernels
    (rank 4, no multiple of 8, padded with zero columns), empty experts and rows past a tile; the term changes
    the product (the test can fail); the inputs are not modified. In float32 on a CPU (Triton's interpreter
    multiplies 16-bit ``tl.dot`` operands wrongly), in bfloat16 on a GPU."""
    device = DEVICES[0]
    dtype = torch.float32 if ON_CPU else torch.bfloat16
    counts, K, N = ([300, 0, 1, 129, 0, 77], 256, 600) if not ON_CPU else ([5, 0, 19, 3], 32, 40)
    E, R = len(counts), sum(counts)
    M = 37 if gather else R
    a, s_a, b, s_b = _operands(M, K, E, N, device, seed=7)
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device=device)
    index = torch.randint(0, M + 1, (R,), generator=torch.Generator().manual_seed(8)).to(device) if gather else None
    g = torch.Generator().manual_seed(9)
    lb = (torch.randn(E, N, rank, generator=g) if kmajor else torch.randn(E, rank, N, generator=g).mT).to(device)
    lb = lb.to(dtype)
    plain = fp8_grouped.reference(a, s_a, b, s_b, offsets, dtype, index=index)
    z = torch.randn(R, rank, generator=g).to(device)
    only_term = fp8_grouped.LowRankTerm(z, lb.float(), 0.5)
    alone = fp8_grouped.reference(a, s_a, b, s_b * 0, offsets, torch.float32, index=index, lora=only_term)
    z = (z * plain.float().norm() / alone.norm()).to(dtype)  # a term about as large as the product
    before = (z.clone(), lb.clone())
    term = fp8_grouped.LowRankTerm(z, lb, 0.5)
    if gluon:  # a rank that is no multiple of 8 is padded (zero columns) for the Gluon kernel's TMA boxes
        padded = fp8_grouped._checked_term(term, R, E, N, dtype)
        assert fp8_grouped._gluon_ready(a, b, index, padded) and padded.z.shape[1] == -(-rank // 8) * 8
    got = fp8_grouped.grouped_mm(a, s_a, b, s_b, offsets, dtype, index=index, gluon=gluon, lora=term)
    ref = fp8_grouped.reference(a, s_a, b, s_b, offsets, dtype, index=index, lora=term)
    _close(got, ref, dtype)
    assert (ref.float() - plain.float()).norm() > 0.1 * ref.float().norm()  # the term is not negligible
    assert torch.equal(z, before[0]) and torch.equal(lb, before[1])


def test_low_rank_term_errors():
    device = DEVICES[0]
    a, s_a, b, s_b = _operands(8, 32, 2, 16, device)
    offsets = torch.tensor([0, 3, 8], dtype=torch.int32, device=device)
    z, lb = torch.zeros(8, 4, device=device), torch.zeros(2, 16, 4, device=device)
    for bad in (fp8_grouped.LowRankTerm(z[:7], lb, 1.0), fp8_grouped.LowRankTerm(z, lb[:, :, :3], 1.0)):
        with pytest.raises(ValueError, match="lora.z"):
            fp8_grouped.grouped_mm(a, s_a, b, s_b, offsets, torch.float32, lora=bad)
    with pytest.raises(TypeError, match="lora.z and lora.lb must be torch.bfloat16"):
        fp8_grouped.grouped_mm(a, s_a, b, s_b, offsets, torch.bfloat16, lora=fp8_grouped.LowRankTerm(z, lb, 1.0))
    with pytest.raises(ValueError, match="lora.z"):  # z's rows must be the output's: R = index.numel()
        index = torch.zeros(5, dtype=torch.int64, device=device)
        fp8_grouped.grouped_mm(
            a, s_a, b, s_b, offsets, torch.float32, index=index, lora=fp8_grouped.LowRankTerm(z, lb, 1.0)
        )
