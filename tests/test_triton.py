"""The ``triton`` expert backend under Triton's CPU interpreter (float32), against the float64
``loop`` oracle: the output and every gradient, every activation, both weight layouts, biases,
the routing edge cases that break tiled kernels, and ``drop_invalid`` semantics.

Buffers the kernels fill are poisoned with NaN (unwritten rows would show). Float32 error is
judged against torch's own float32 error on the same inputs: ``err <= 2 * err(torch fp32) + 1e-6``.
"""

import os

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

import moeyard  # noqa: E402
from helpers import check_fill_invalid, load_benchmark  # noqa: E402
from moeyard.activations import Activation  # noqa: E402
from moeyard.experts import triton as triton_backend  # noqa: E402,F401  (registers "triton")
from moeyard.experts.registry import resolve_backend  # noqa: E402
from moeyard.experts.triton import ops  # noqa: E402
from moeyard.experts.triton.schedule import band_tile  # noqa: E402
from moeyard.experts.weights import expert_weights  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU tests run under Triton's interpreter (tests/cuda covers the GPU)",
)
DEV = "cpu"


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    real, real_like = ops.empty, ops.empty_like
    monkeypatch.setattr(ops, "empty", lambda shape, like, dtype=None: real(shape, like, dtype).fill_(float("nan")))
    monkeypatch.setattr(ops, "empty_like", lambda like: real_like(like).fill_(float("nan")))


def _problem(T, H, I, E, K, *, act="swiglu", bias=False, transposed=False, interleaved=False, ids=None, scale=1.0):
    gated = Activation(name=act).gated if isinstance(act, str) else act.gated
    n1 = 2 * I if gated else I
    up_shape, down_shape = ((E, H, n1), (E, I, H)) if transposed else ((E, n1, H), (E, H, I))
    p = dict(
        x=torch.randn(T, H) * scale,
        gate_up_proj=torch.randn(up_shape) / H**0.5,
        down_proj=torch.randn(down_shape) / I**0.5,
        topk_weights=torch.rand(T, K) + 0.1,
    )
    if bias:
        p["gate_up_bias"] = torch.randn(E, n1) * 0.5
        p["down_bias"] = torch.randn(E, H) * 0.5
    if ids is None:
        ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]) if T else torch.zeros(0, K, dtype=torch.int64)
    return p, ids, dict(activation=act, transposed=transposed, interleaved=interleaved)


def _run(p, ids, kw, backend, dtype, drop_invalid=False):
    """Output and gradients of every differentiable input, for a fixed random output gradient."""
    leaves = {k: v.detach().to(dtype).requires_grad_() for k, v in p.items()}
    out = moeyard.experts(
        leaves["x"],
        ids,
        leaves["topk_weights"],
        leaves["gate_up_proj"],
        leaves["down_proj"],
        gate_up_bias=leaves.get("gate_up_bias"),
        down_bias=leaves.get("down_bias"),
        backend=backend,
        drop_invalid=drop_invalid,
        **kw,
    )
    gen = torch.Generator().manual_seed(1)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(dtype)
    names = list(leaves)
    grads = (
        torch.autograd.grad(out, [leaves[n] for n in names], dout, allow_unused=True)
        if out.numel()
        else [torch.zeros_like(leaves[n]) for n in names]
    )
    return {"out": out.detach(), **{f"d_{n}": g for n, g in zip(names, grads, strict=True)}}


def _rel(got, ref):
    denom = ref.double().norm().clamp_min(1e-30)
    return ((got.double() - ref.double()).norm() / denom).item()


def check_against_loop(p, ids, kw, drop_invalid=False):
    got = _run(p, ids, kw, "triton", torch.float32, drop_invalid)
    ref = _run(p, ids, kw, "loop", torch.float64, drop_invalid)
    base = _run(p, ids, kw, "loop", torch.float32, drop_invalid)
    for name, r in ref.items():
        g = got[name]
        assert g is not None and g.shape == r.shape, name
        assert not g.isnan().any(), f"{name}: NaN (an unwritten row?)"
        err, err_torch = _rel(g, r), _rel(base[name], r)
        assert err <= 2 * err_torch + 1e-6, f"{name}: rel err {err:.2e} vs torch fp32 {err_torch:.2e}"
    return got


ALL_ACTS = ["swiglu", "geglu", "reglu", "clamped_swiglu", "gelu", "relu", "relu2", "silu"]


@pytest.mark.parametrize("act", ALL_ACTS)  # each epilogue (forward and derivative) in the fused path
def test_every_activation(act):
    check_against_loop(*_problem(13, 40, 24, 5, 2, act=act, scale=2.0))


@pytest.mark.parametrize("act", ["swiglu", "gelu"])  # bias loads in up/down epilogues, bias grads, d w via b_down
def test_biases(act):
    check_against_loop(*_problem(11, 32, 16, 4, 2, act=act, bias=True))


def test_gpt_oss_layout():
    # transposed [E, in, out] weights, interleaved gate/up, clamps active on both sides, biases
    act = Activation(name="clamped_swiglu", alpha=1.702, limit=1.0)
    check_against_loop(*_problem(9, 24, 20, 4, 2, act=act, bias=True, transposed=True, interleaved=True, scale=3.0))


def test_interleaved_untransposed():
    check_against_loop(*_problem(7, 16, 16, 3, 2, interleaved=True))


@pytest.mark.parametrize(
    "T,H,I,E,K,ids",
    [
        (12, 16, 16, 8, 2, "two_experts"),  # most experts empty: zero-tile experts in the tile map, zero dW
        (37, 16, 16, 4, 1, "one_expert"),  # every token to one expert: several row tiles of one expert
        (5, 16, 16, 1, 1, None),  # E = 1
        (6, 16, 16, 3, 3, None),  # k = E
        (1, 16, 16, 4, 2, None),  # T = 1
        (19, 33, 17, 6, 3, None),  # T, H, I not multiples of any tile (masks in every loop)
    ],
)
def test_routing_edge_cases(T, H, I, E, K, ids):
    if ids == "two_experts":
        ids = torch.stack([torch.tensor([0, 3])[torch.randperm(2)] for _ in range(T)])
    elif ids == "one_expert":
        ids = torch.full((T, K), 2, dtype=torch.int64)
    check_against_loop(*_problem(T, H, I, E, K, ids=ids))


def test_no_tokens():
    got = check_against_loop(*_problem(0, 16, 16, 4, 2))
    assert got["out"].shape == (0, 16)
    assert (got["d_gate_up_proj"] == 0).all() and (got["d_down_proj"] == 0).all()


def test_custom_activation_callable():
    # a custom callable is not fused: it runs in torch between the two grouped GEMMs
    def act_fn(h):
        gate, up = h.chunk(2, dim=-1)
        return torch.tanh(gate) * up

    check_against_loop(*_problem(10, 24, 16, 4, 2, act=Activation(name="custom", fn=act_fn), bias=True))


def test_custom_plain_activation_callable():
    act = Activation(name="custom", fn=lambda h: torch.sin(h), fn_gated=False)
    check_against_loop(*_problem(10, 24, 16, 4, 2, act=act))


def test_drop_invalid():
    # pairs with ids -1 or E contribute nothing; their weights get zero gradient
    T, K, E = 14, 2, 4
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    ids[3, 0], ids[7, 1], ids[9] = -1, E, torch.tensor([-1, E + 3])
    got = check_against_loop(*_problem(T, 16, 16, E, K, ids=ids), drop_invalid=True)
    assert (got["d_topk_weights"][ids < 0] == 0).all() and (got["d_topk_weights"][ids >= E] == 0).all()


@pytest.mark.parametrize("weights", [False, True])
def test_fill_invalid_writes_only_invalid_rows(weights):
    """The in-place combine at K = 1 (:func:`helpers.check_fill_invalid`) over a partial last block of rows
    and of columns."""
    check_fill_invalid(2 * ops.FILL_BT + 5, ops.FILL_BH + 88, weights, DEV, torch.float32)


def test_invalid_ids_give_nan_rows():
    # without drop_invalid the caller put NaN into the weights of invalid pairs: those tokens must be NaN
    p, ids, kw = _problem(8, 16, 16, 4, 2)
    ids[2, 1], ids[5, 0] = 4, -1
    bad = (ids < 0) | (ids >= 4)
    tw = p["topk_weights"].masked_fill(bad, float("nan"))
    weights = expert_weights(p["gate_up_proj"], p["down_proj"])
    out = triton_backend.triton_forward(p["x"], ids, tw, weights, Activation(), drop_invalid=False)
    nan_rows = out.isnan().any(1)
    assert nan_rows.tolist() == bad.any(1).tolist()
    ref = moeyard.experts(
        p["x"].double(),
        ids,
        p["topk_weights"].double(),
        p["gate_up_proj"].double(),
        p["down_proj"].double(),
        backend="loop",
        drop_invalid=True,
    )
    assert torch.allclose(out[~nan_rows].double(), ref[~nan_rows], rtol=1e-5, atol=1e-5)


def test_deterministic_and_inputs_untouched():
    p, ids, kw = _problem(21, 24, 16, 3, 2, bias=True)
    before = {k: v.clone() for k, v in p.items()}
    ids_before = ids.clone()
    a, b = _run(p, ids, kw, "triton", torch.float32), _run(p, ids, kw, "triton", torch.float32)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    for k, v in p.items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(ids, ids_before)


def test_noncontiguous_input():
    # x with strides (1, T) and a sliced weight: kernels use strides, never a copy
    p, ids, kw = _problem(9, 16, 16, 3, 2)
    p["x"] = p["x"].t().contiguous().t()
    check_against_loop(p, ids, kw)


def test_unsupported_reasons(monkeypatch):
    cpu = torch.device("cpu")
    assert "float32" in triton_backend._unsupported(cpu, torch.float64, None, None)
    assert "cuda" in triton_backend._unsupported(torch.device("mps"), torch.float32, None, None).lower()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "TRITON_INTERPRET" in triton_backend._unsupported(cpu, torch.float32, None, None)
    with pytest.raises(ValueError, match="triton"):
        resolve_backend("triton", cpu, torch.float32)
    monkeypatch.setattr(triton_backend, "_have_triton", lambda: False)
    assert "pip install triton" in triton_backend._unsupported(torch.device("cuda"), torch.bfloat16, None, None)


def test_tile_bound_covers_worst_case():
    # every non-empty expert has a partial tile: N // BM + min(E, N) tiles must be launched
    from moeyard.experts.triton.schedule import max_row_tiles

    for n, e, bm in [(26, 5, 16), (5, 8, 16), (0, 3, 16), (1000, 128, 128)]:
        counts = [n // e + (i < n % e) for i in range(e)]
        need = sum(-(-c // bm) for c in counts)
        assert max_row_tiles(n, e, bm) >= need


@pytest.mark.parametrize("mode", [0, 1, 2])  # no LoRA, split (z read), fused (z written)
def test_custom_ops_opcheck(mode):
    # schemas, fake registrations and mutation annotations of the ops that write into outputs
    T, H, I, E, K, R = 9, 16, 16, 3, 2, 4
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    r = ops.routing(ids, E)
    tw = torch.rand(T * K)

    def lora(k, n):  # (la [E, k, R], lb [E, n, R], mode, scale, z [N, R])
        if not mode:
            return None, None, 0, 0.0
        return torch.randn(E, k, R), torch.randn(E, n, R), mode, 0.5

    def z():
        return torch.randn(T * K, R) if mode else None

    a, y = torch.randn(T * K, I), torch.empty(T * K, H)
    tables = [None] + ([r.tile_table(16)] if mode != 2 else [])  # pointer loads; TMA loads over the table
    for table in tables:
        torch.library.opcheck(
            ops.down_proj_.op,
            (a, torch.randn(E, H, I), None, tw, r.sort_order, r.expert_offsets, K, *lora(I, H), table, y, z()),
        )
    torch.library.opcheck(ops.tile_table_.op, (r.expert_offsets, 16, torch.empty_like(r.tile_table(16))))
    torch.library.opcheck(ops.combine_.op, (y, r.topk_ids, tw.view(T, K), E, torch.empty(T, H)))
    for table in tables:
        torch.library.opcheck(
            ops.up_proj_.op,
            (
                torch.randn(T, H),
                torch.randn(E, 2 * I, H),
                None,
                r.sort_order,
                r.expert_offsets,
                K,
                "swiglu",
                1.702,
                7.0,
                False,
                True,
                *lora(H, 2 * I),
                table,
                torch.empty(T * K, 2 * I),
                torch.empty(T * K, I),
                z(),
            ),
        )
    for table in tables:
        torch.library.opcheck(
            ops.act_grad_.op,
            (
                torch.randn(T, H),
                torch.randn(E, H, I),
                None,
                torch.randn(T * K, 2 * I),
                tw,
                r.sort_order,
                r.expert_offsets,
                K,
                "swiglu",
                1.702,
                7.0,
                False,
                *lora(H, I),
                table,
                torch.empty(T * K, 2 * I),
                torch.empty(T * K, I),
                torch.zeros(1, T * K),
                z(),
            ),
        )


def test_compiles_fullgraph(monkeypatch):
    # no graph breaks: the routing is traced, the kernels are opaque custom ops; compiled before any eager
    # call (no options built yet: building them once mutated a global inside the traced forward)
    from moeyard.experts.triton import options as options_module

    monkeypatch.setattr(options_module, "_BUILT", {})
    p, ids, kw = _problem(9, 16, 16, 3, 2)
    leaves = {k: v.requires_grad_() for k, v in p.items()}

    def f(x, ids, tw, w_up, w_down):
        return triton_backend.triton_forward(x, ids, tw, expert_weights(w_up, w_down), Activation(), drop_invalid=True)

    args = (leaves["x"], ids, leaves["topk_weights"], leaves["gate_up_proj"], leaves["down_proj"])
    out = torch.compile(f, backend="aot_eager", fullgraph=True)(*args)
    ref = f(*args)
    assert torch.equal(out, ref)
    got = torch.autograd.grad(out.sum(), (leaves["x"], leaves["gate_up_proj"]))
    want = torch.autograd.grad(ref.sum(), (leaves["x"], leaves["gate_up_proj"]))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("lora", [False, True])
def test_layer_compiles_fullgraph(monkeypatch, lora):
    # the whole layer (router with its losses, dispatch, triton experts, LoRA adapters) in one graph, compiled
    # before any eager call, forward and backward equal to eager
    from moeyard.experts.triton import options as options_module

    monkeypatch.setattr(options_module, "_BUILT", {})
    cfg = moeyard.MoEConfig(hidden_size=16, intermediate_size=16, num_experts=4, top_k=2, aux_loss_coef=0.01)
    layer = moeyard.MoE(cfg, backend="triton")
    if lora:
        layer.add_lora(4)
        with torch.no_grad():  # PEFT's init leaves B zero: make the adapters' gradients reach A
            for a in layer.lora.values():
                a.lora_B.weight.normal_()
    x = torch.randn(2, 5, 16)

    def step(fn):
        xi = x.clone().requires_grad_()
        out = fn(xi)
        loss = (out * torch.linspace(-1, 1, 16)).sum() + layer.aux_loss
        params = [p for p in layer.parameters() if p.requires_grad]
        return out.detach(), torch.autograd.grad(loss, [xi] + params)

    got = step(torch.compile(layer, backend="aot_eager", fullgraph=True))
    want = step(layer)
    assert torch.allclose(got[0], want[0], atol=1e-5, rtol=1e-5)
    assert len(got[1]) == len(want[1]) == 1 + (5 if lora else 3)  # x, the router, the experts or 4 factors
    for a, b in zip(got[1], want[1], strict=True):
        assert b.abs().sum() > 0 and torch.allclose(a, b, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- speed options (default off)

from moeyard.experts.triton.options import Options, options, use_options  # noqa: E402


def _skewed_ids(T, K, E):
    """Expert 0 gets every token (a long expert, split into chunks); the rest share the other slots."""
    rest = torch.stack([1 + torch.randperm(E - 1)[: K - 1] for _ in range(T)])
    return torch.cat([torch.zeros(T, 1, dtype=torch.int64), rest], 1)


@pytest.mark.parametrize("act", ["swiglu", "relu2"])  # gated (two h columns per output) and plain
@pytest.mark.parametrize("bias", [False, True])
def test_wide_tiles_split_epilogue(monkeypatch, act, bias):
    # every kernel at BN = 128 (dh: BN >= 128 runs its epilogue in two column halves; I = 40: the
    # first half partly, the second wholly masked; I = 200: the second tile's second half partly
    # masked); launchers rebuilt with that config
    from moeyard.experts.triton import schedule

    monkeypatch.setattr(schedule, "SMALL", dict(BM=16, BN=128, BK=16))
    monkeypatch.setattr(ops, "_LAUNCHERS", {})
    check_against_loop(*_problem(21, 24, 40, 4, 2, act=act, bias=bias))
    check_against_loop(*_problem(21, 24, 200, 4, 2, act=act, bias=bias))


@pytest.mark.parametrize(
    "case",
    [
        dict(T=13, H=40, I=24, E=5, K=2, act="geglu"),  # plain fused path
        dict(T=11, H=32, I=16, E=4, K=2, act="swiglu", bias=True),  # bias in the atomic epilogue
        dict(T=19, H=33, I=17, E=6, K=3, act="relu2"),  # odd sizes: masked atomics
        dict(T=37, H=16, I=16, E=4, K=1, ids="one_expert"),  # every pair of one expert
        dict(T=1, H=16, I=16, E=4, K=2),  # T = 1
        dict(T=6, H=16, I=16, E=3, K=3, act=Activation(name="custom", fn=torch.tanh, fn_gated=False)),  # unfused
    ],
)
def test_atomic_combine(case):
    case = dict(case)
    if case.get("ids") == "one_expert":
        case["ids"] = torch.full((case["T"], case["K"]), 2, dtype=torch.int64)
    with use_options(atomic_combine=True):
        check_against_loop(*_problem(**case))


def test_atomic_combine_no_tokens_and_invalid_ids():
    with use_options(atomic_combine=True):
        check_against_loop(*_problem(0, 16, 16, 4, 2))
        T, K, E = 14, 2, 4
        ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
        ids[3, 0], ids[9] = -1, torch.tensor([-1, E + 3])
        check_against_loop(*_problem(T, 16, 16, E, K, ids=ids), drop_invalid=True)
        # without drop_invalid, NaN weights of invalid pairs make those tokens NaN, as on the default path
        p, ids, kw = _problem(8, 16, 16, 4, 2)
        ids[2, 1], ids[5, 0] = 4, -1
        tw = p["topk_weights"].masked_fill((ids < 0) | (ids >= 4), float("nan"))
        out = triton_backend.triton_forward(
            p["x"], ids, tw, expert_weights(p["gate_up_proj"], p["down_proj"]), Activation(), drop_invalid=False
        )
        assert out.isnan().any(1).tolist() == [t in (2, 5) for t in range(8)]


@pytest.mark.parametrize("atomic", [False, True])
@pytest.mark.parametrize("custom", [False, True])
def test_top1_combine_in_place(atomic, custom):
    # K = 1 (how expert parallelism calls the local experts): the down projection's rows are the output;
    # only the rows of invalid pairs are written by the combine (poisoned buffers show any other gap)
    T, E = 23, 4
    act = Activation(name="custom", fn=torch.tanh, fn_gated=False) if custom else "swiglu"
    ids = torch.randint(0, E, (T, 1))
    ids[[2, 7, 8, 22]] = torch.tensor([[-1], [E], [E + 5], [-3]])
    with use_options(atomic_combine=atomic):
        check_against_loop(*_problem(T, 16, 16, E, 1, ids=ids, act=act), drop_invalid=True)
        check_against_loop(*_problem(T, 24, 20, E, 1, act=act, bias=True))
        p, ids, kw = _problem(8, 16, 16, E, 1)
        ids[2, 0], ids[5, 0] = E, -1
        tw = p["topk_weights"].masked_fill((ids < 0) | (ids >= E), float("nan"))
        out = triton_backend.triton_forward(
            p["x"], ids, tw, expert_weights(p["gate_up_proj"], p["down_proj"]), Activation(), drop_invalid=False
        )
        assert out.isnan().any(1).tolist() == [t in (2, 5) for t in range(8)]
        tw[2, 0] = tw[5, 0] = 0.5  # finite weights of invalid pairs: those tokens are exactly 0
        out = triton_backend.triton_forward(
            p["x"], ids, tw, expert_weights(p["gate_up_proj"], p["down_proj"]), Activation(), drop_invalid=False
        )
        assert (out[[2, 5]] == 0).all() and not out.isnan().any()


@pytest.mark.parametrize("E", [1, 5, 130])
def test_tile_table_matches_expert_tile(E):
    # the row-tile table of the TMA kernel: every tile's expert and first row, as the reductions of
    # schedule.expert_piece find them (random counts, empty experts included)
    from moeyard.experts.triton import schedule

    g = torch.Generator().manual_seed(E)
    counts = torch.randint(0, 40, (E,), generator=g) * (torch.rand(E, generator=g) > 0.3)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
    N, BM = int(offsets[-1]), 16
    table = torch.empty(2 * schedule.max_row_tiles(N, E, BM) + 1, dtype=torch.int32)
    schedule.fill_tile_table(offsets, BM, table)
    M = table.shape[0] // 2
    assert M == schedule.max_row_tiles(N, E, BM)
    expected = [(e, int(offsets[e]) + j * BM) for e in range(E) for j in range(-(-int(counts[e]) // BM))]
    got = [(int(table[t]), int(table[M + t])) for t in range(M) if int(table[t]) < E]
    assert got == expected
    assert all(int(table[t]) >= E for t in range(len(expected), M))
    assert int(table[2 * M]) == len(expected)


@pytest.mark.parametrize(
    "T,K,E,BM",
    [
        (1, 1, 1, 16),
        (9, 2, 3, 16),
        (100, 8, 128, 64),
        (256, 8, 128, 16),
        (2048, 1, 160, 128),
        (7, 4, 1022, 16),
        (33, 2, 5, 128),
    ],
)
def test_sort_and_tile_in_one_launch(T, K, E, BM, monkeypatch):
    """Few pairs: ``ops.routing`` sorts them and makes the tile table of ``tma_block_m()`` rows in one launch
    (``schedule.sort_tile_kernel``), the same order, offsets and table as the sort and ``fill_tile_table``
    apart; ids outside ``[0, E)`` included, up to ``MAX_PAIRS`` pairs and ``MAX_EXPERTS`` experts."""
    from moeyard.dispatch import sort_by_expert
    from moeyard.experts.triton import schedule

    monkeypatch.setattr(ops, "tma_block_m", lambda: BM)
    ids = torch.randint(-2, E + 2, (T, K), generator=torch.Generator().manual_seed(T * K + E))
    _, order, offsets = sort_by_expert(ids, E)
    table = torch.empty(2 * schedule.max_row_tiles(T * K, E, BM) + 1, dtype=torch.int32)
    schedule.fill_tile_table(offsets, BM, table)
    launches = []
    monkeypatch.setattr(ops, "fill_tile_table", lambda *a: launches.append(a))
    r = ops.routing(ids, E)
    assert torch.equal(r.sort_order, order) and torch.equal(r.expert_offsets, offsets)
    assert torch.equal(r.tile_table(BM), table) and not launches


@triton.jit
def _band_probe(offsets_ptr, out_ptr, E, bits, BM: tl.constexpr, E_P2: tl.constexpr):
    """Each program writes its band-major tile: expert, first row, end row (-1: no tile)."""
    pid = tl.program_id(0)
    e, row0, row_end = band_tile(pid, offsets_ptr, E, bits, BM, E_P2)
    tl.store(out_ptr + 3 * pid, e)
    tl.store(out_ptr + 3 * pid + 1, tl.where(e < E, row0, -1))
    tl.store(out_ptr + 3 * pid + 2, tl.where(e < E, row_end, -1))


@pytest.mark.parametrize("E,skew", [(1, False), (5, False), (130, False), (7, True)])
def test_band_tile_order(E, skew):
    # band-major row tiles: tile j of every expert that has one, experts in order, then tile j + 1;
    # each existing tile exactly once, the programs past them get no tile (random counts, empty
    # experts, one expert with far more tiles than the others)
    from moeyard.experts.triton import schedule

    g = torch.Generator().manual_seed(E)
    counts = torch.randint(0, 40, (E,), generator=g) * (torch.rand(E, generator=g) > 0.3)
    if skew:
        counts[3] = 300
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
    N, BM = int(offsets[-1]), 16
    M = schedule.max_row_tiles(N, E, BM)
    out = torch.full((M, 3), -7, dtype=torch.int32)
    _band_probe[(M,)](offsets, out, E, schedule.band_bits(N, BM), BM=BM, E_P2=triton.next_power_of_2(max(E, 2)))
    tiles = [-(-int(c) // BM) for c in counts]
    expected = [
        (e, int(offsets[e]) + j * BM, int(offsets[e + 1]))
        for j in range(max(tiles, default=0))
        for e in range(E)
        if tiles[e] > j
    ]
    got = [tuple(map(int, row)) for row in out]
    assert got[: len(expected)] == expected
    assert all(row[0] >= E and row[1] == -1 for row in got[len(expected) :])


@pytest.mark.parametrize("ids", ["random", "one_expert", "empty_experts"])
def test_band_rows_same_result(ids):
    # the thin gathered GEMM (LoRA rows x[token] A_e^T) in band-major and expert-major tile order
    from moeyard.experts.triton.options import use_options

    T, H, E, K, R = 37, 48, 6, 3, 5
    x = torch.randn(T, H)
    la = torch.randn(E, R, H).mT
    topk = {
        "random": torch.stack([torch.randperm(E)[:K] for _ in range(T)]),
        "one_expert": torch.stack([torch.tensor([2, 0, 1])] * T),
        "empty_experts": torch.stack([torch.randperm(3)[:K] + 3 for _ in range(T)]),
    }[ids]
    r = ops.routing(topk, E)
    expected = torch.einsum("th,ehr->ter", x.double(), la.double())[torch.arange(T)[:, None], topk]
    got = {}
    for band in (True, False):
        with use_options(band_rows=band):
            got[band] = ops.low_rank_rows(x, la, r, gather=True)
    assert torch.equal(got[True], got[False])
    sorted_expected = expected.reshape(-1, R)[r.sort_order]
    assert torch.allclose(got[True].double(), sorted_expected, atol=1e-4, rtol=1e-4)


def test_tile_table_made_once_per_step(monkeypatch):
    # the TMA down projection (forward) and its input gradient (backward) share one table per routing (made
    # with the sort for few pairs, else by a launch of its own)
    calls = []
    for name in ("fill_tile_table", "sort_and_tile"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    with use_options(tma=True):
        check_against_loop(*_problem(41, 32, 24, 5, 3, bias=True))
    n_steps = len(calls)
    calls.clear()
    with use_options(tma=True):
        p, ids, kw = _problem(9, 16, 16, 3, 2)
        leaves = {k: v.requires_grad_() for k, v in p.items()}
        out = triton_backend.triton_forward(
            leaves["x"],
            ids,
            leaves["topk_weights"],
            expert_weights(leaves["gate_up_proj"], leaves["down_proj"]),
            Activation(),
            drop_invalid=True,
        )
        assert len(calls) == 1
        out.sum().backward()
    assert len(calls) == 1 and n_steps >= 1
    with use_options(tma=False):
        triton_backend.triton_forward(
            p["x"],
            ids,
            p["topk_weights"],
            expert_weights(p["gate_up_proj"], p["down_proj"]),
            Activation(),
            drop_invalid=True,
        )
    assert calls[1:] == ["sort_and_tile"]  # pointer loads: no launch for a table (few pairs: made with the sort)


def test_tma_persistent(monkeypatch):
    # the persistent variant: 3 programs (ops.num_sms under the interpreter) loop over every tile
    from moeyard.experts.triton import kernels_tma, schedule

    launcher = schedule._Fixed(kernels_tma.down_tma_kernel, dict(schedule.SMALL, PERSISTENT=True))
    monkeypatch.setitem(ops._kernels(), "down_tma", launcher)
    with use_options(tma=True):
        check_against_loop(*_problem(41, 32, 24, 5, 3, bias=True))
        check_against_loop(*_problem(12, 16, 16, 8, 2, ids=torch.tensor([[0, 3]] * 12)))


class _Launches:
    """Counts the tuned launchers' launches by name (wraps ``ops._kernels()`` entries)."""

    def __init__(self, monkeypatch):
        self.names, self.kwargs = [], []
        kernels = ops._kernels()
        for name, launcher in list(kernels.items()):
            monkeypatch.setitem(kernels, name, self._wrap(name, launcher))

    def _wrap(self, name, launcher):
        names, kwargs = self.names, self.kwargs

        class Wrapped:
            def __getitem__(self, grid):
                names.append(name)
                launch = launcher[grid]

                def run(*a, **kw):
                    kwargs.append(kw)
                    return launch(*a, **kw)

                return run

        return Wrapped()


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize(
    "case",
    [
        dict(T=29, H=32, I=16, E=4, K=2),  # forward and dx through TMA
        dict(T=23, H=24, I=40, E=5, K=3, bias=True),  # bias; row tiles across experts
        dict(
            T=9,
            H=24,
            I=16,
            E=4,
            K=2,
            act=Activation(name="clamped_swiglu", limit=1.0),
            bias=True,
            transposed=True,
            interleaved=True,
        ),  # gpt-oss layout: the other B orientation
        dict(T=37, H=16, I=16, E=4, K=1, ids="one_expert"),  # one expert, several row tiles
        dict(T=12, H=16, I=16, E=8, K=2, ids="two_experts"),  # empty experts
        dict(T=5, H=16, I=16, E=1, K=1),  # E = 1
        dict(T=0, H=16, I=16, E=4, K=2),  # no tokens
    ],
)
def test_tma_down_projection(tma, case, monkeypatch):
    # the down projection (forward and input gradient) through TMA and through pointer loads against the
    # oracle; the interpreter emulates the descriptors' boxes (zero fill past each bound)
    case = dict(case)
    ids = case.pop("ids", None)
    T, K = case["T"], case["K"]
    if ids == "one_expert":
        ids = torch.full((T, K), 2, dtype=torch.int64)
    elif ids == "two_experts":
        ids = torch.tensor([[0, 3]] * T)
    launches = _Launches(monkeypatch)
    with use_options(tma=tma):
        check_against_loop(*_problem(**case, ids=ids))
    if T:
        assert launches.names.count("down_tma" if tma else "down") == 2
        assert ("down" if tma else "down_tma") not in launches.names


@pytest.mark.parametrize(
    "case,w_tma",
    [
        (dict(T=29, H=32, I=16, E=4, K=2), True),  # gate and up boxes of one tile
        (dict(T=23, H=24, I=40, E=5, K=3, bias=True), True),  # last column tile past I: its gate
        # box reads up rows (not stored)
        (dict(T=11, H=16, I=80, E=3, K=2, act="gelu"), True),  # plain activation, one box
        (dict(T=12, H=16, I=16, E=8, K=2, ids="two_experts"), True),  # empty experts
        (
            dict(
                T=9,
                H=24,
                I=16,
                E=4,
                K=2,
                act=Activation(name="clamped_swiglu", limit=1.0),
                bias=True,
                transposed=True,
                interleaved=True,
            ),
            False,
        ),  # gpt-oss layout: pointer loads
    ],
)
def test_tma_up_weights(case, w_tma, monkeypatch):
    # option tma_up (default): the up projection's weight tiles through a descriptor, x's rows gathered by
    # pointer loads; off: pointer loads for both
    case = dict(case)
    if case.pop("ids", None) == "two_experts":
        case["ids"] = torch.tensor([[0, 3]] * case["T"])
    launches = _Launches(monkeypatch)
    with use_options(tma_up=True):
        check_against_loop(*_problem(**case))
    ups = [kw["W_TMA"] for name, kw in zip(launches.names, launches.kwargs, strict=True) if name == "up"]
    assert ups and all(w is w_tma for w in ups)
    with use_options(tma_up=False):
        check_against_loop(*_problem(**case))
    ups = [kw["W_TMA"] for name, kw in zip(launches.names, launches.kwargs, strict=True) if name == "up"][len(ups) :]
    assert ups and not any(ups)


def test_tma_falls_back(monkeypatch):
    # strides that are no multiple of 16 bytes (H = 33 float32) and the atomic combine keep the pointer
    # kernel
    launches = _Launches(monkeypatch)
    with use_options(tma=True):
        check_against_loop(*_problem(7, 33, 16, 4, 2))
        with use_options(atomic_combine=True):
            check_against_loop(*_problem(7, 32, 16, 4, 2))
    assert launches.names.count("down") == 3 and "down_tma" in launches.names  # dx of the odd H runs TMA


@pytest.mark.parametrize(
    "case",
    [
        dict(T=29, H=32, I=16, E=4, K=2),  # both weight gradients
        dict(T=23, H=24, I=40, E=5, K=3, bias=True),  # bias gradients from the TMA tile
        dict(
            T=9,
            H=24,
            I=16,
            E=4,
            K=2,
            act=Activation(name="clamped_swiglu", limit=1.0),
            bias=True,
            transposed=True,
            interleaved=True,
        ),  # gpt-oss layout
        dict(T=12, H=16, I=16, E=8, K=2, ids="two_experts"),  # empty experts
        dict(T=5, H=16, I=16, E=1, K=1),  # E = 1
    ],
)
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("chunk", [0, 12])
def test_tma_weight_gradients(case, chunk, tma, monkeypatch):
    # the sorted operand of each weight gradient through a descriptor sized to the expert's (or the
    # chunk's) rows: the box's zero fill past them replaces the row mask
    case = dict(case)
    if case.pop("ids", None) == "two_experts":
        case["ids"] = torch.tensor([[0, 3]] * case["T"])
    launches = _Launches(monkeypatch)
    with use_options(tma_wgrad=tma, wgrad_chunk_rows=chunk):
        check_against_loop(*_problem(**case))
    wgrads = [kw for name, kw in zip(launches.names, launches.kwargs, strict=True) if name.startswith("wgrad")]
    assert len(wgrads) == 2 and all(kw["TMA"] == tma for kw in wgrads)
    assert not any(kw["TILE_MAJOR"] for kw in wgrads)  # the base weight gradients stay expert-major


@pytest.mark.parametrize("mode", ["split", "fused"])
def test_tma_with_lora(mode, monkeypatch):
    from moeyard.experts import ExpertLoRA

    T, H, I, E, K, r = 19, 32, 16, 4, 2, 5
    launches = _Launches(monkeypatch)
    p, ids, kw = _problem(T, H, I, E, K)
    g = torch.Generator().manual_seed(3)
    factors = {
        k: torch.randn(*shape, generator=g) * 0.3
        for k, shape in dict(ua=(r * E, H), ub=(2 * I, r * E), da=(r * E, I), db=(H, r * E)).items()
    }

    def run(backend, dtype):
        f = {k: v.detach().to(dtype).requires_grad_() for k, v in factors.items()}
        lora = {
            "gate_up_proj": ExpertLoRA(lora_A=f["ua"], lora_B=f["ub"], scaling=0.5),
            "down_proj": ExpertLoRA(lora_A=f["da"], lora_B=f["db"], scaling=0.5),
        }
        x = p["x"].detach().to(dtype).requires_grad_()
        out = moeyard.experts(
            x,
            ids,
            p["topk_weights"].to(dtype),
            p["gate_up_proj"].to(dtype),
            p["down_proj"].to(dtype),
            backend=backend,
            lora=lora,
        )
        out.backward(torch.ones_like(out))
        return [out, x.grad] + [f[k].grad for k in sorted(f)]

    with use_options(tma=True, lora_mode=mode):
        got = run("triton", torch.float32)
    for g_, r_ in zip(got, run("loop", torch.float64), strict=True):
        assert _rel(g_, r_) < 1e-5
    assert launches.names.count("down_tma" if mode == "split" else "down") == 2  # fused LoRA: pointer kernel


@pytest.mark.parametrize("shape", [(100, 70), (64, 64), (1, 5), (3, 130)])  # partial tiles in both dims
def test_transpose_kernel(shape):
    from moeyard.experts.triton.transpose import launch

    x = torch.randn(*shape, dtype=torch.float64)
    y = torch.full(shape[::-1], float("nan"), dtype=torch.float32)
    launch(x, y)
    assert torch.equal(y, x.t().float())


@pytest.mark.parametrize("by_token", [True, False])  # d out read at each row's token; d_h in sorted rows
@pytest.mark.parametrize("chunk", [0, 12])
@pytest.mark.parametrize("ids", ["random", "skewed", "two_experts"])
@pytest.mark.parametrize("tile_major", [False, True])
def test_wgrad_rows(by_token, chunk, ids, tile_major, monkeypatch):
    # dB_e = L[rows of e]^T zw and the rows L[row] @ B_e from one pass over L: NL = 40 (three 16-wide
    # partials, the last 8 wide), R = 5 (no tile's multiple), a long expert cut into chunks, empty experts;
    # the programs in either order (tile-major only where L is read by token)
    T, K, E, NL, R = 20, 2, 5, 40, 5
    topk = dict(
        random=torch.stack([torch.randperm(E)[:K] for _ in range(T)]),
        skewed=_skewed_ids(T, K, E),
        two_experts=torch.tensor([[1, 3]] * T),
    )[ids]
    r = ops.routing(topk, E)
    N = T * K
    lhs = torch.randn(T if by_token else N, NL)
    zw, factor = torch.randn(N, R), torch.randn(E, NL, R)
    launches = _Launches(monkeypatch)
    with use_options(tma_wgrad=True, wgrad_chunk_rows=chunk, wgrad_tile_major=tile_major):
        dw, rows = ops.wgrad_rows(lhs, zw, factor, lhs_by_token=by_token, r=r, alpha=0.5)  # dB scaled
    assert launches.kwargs[0]["TILE_MAJOR"] == (tile_major and by_token)
    assert not launches.kwargs[0]["TMA"]  # LoRA factors' gradients: pointer loads (faster on an H200)
    ell = lhs.double()[r.sort_order // K] if by_token else lhs.double()
    expert = topk.reshape(-1)[r.sort_order]
    want_rows = torch.einsum("nl,nlr->nr", ell, factor.double()[expert])
    want_dw = torch.stack([ell[expert == e].T @ zw.double()[expert == e] for e in range(E)])
    assert rows.shape == (N, R) and rows.dtype == lhs.dtype and dw.shape == factor.shape
    assert _rel(rows, want_rows) < 1e-6 and _rel(dw, 0.5 * want_dw) < 1e-6


@pytest.mark.parametrize("chunk", [12, 20])  # chunks shorter than a BM=16 row step, and over one step
@pytest.mark.parametrize("layout", ["plain", "bias", "gpt_oss"])
def test_wgrad_chunks(chunk, layout):
    # expert 0 holds all 40 tokens (split into 2-4 chunks), the others ~13 rows (one or two chunks)
    T, K, E = 40, 2, 4
    kw = dict(
        plain={},
        bias=dict(bias=True),
        gpt_oss=dict(act=Activation(name="clamped_swiglu", limit=1.0), bias=True, transposed=True, interleaved=True),
    )[layout]
    with use_options(wgrad_chunk_rows=chunk):
        check_against_loop(*_problem(T, 24, 20, E, K, ids=_skewed_ids(T, K, E), **kw))


def test_wgrad_chunks_edge_cases():
    with use_options(wgrad_chunk_rows=8):
        check_against_loop(*_problem(12, 16, 16, 8, 2, ids=torch.tensor([[0, 3]] * 12)))  # empty experts
        check_against_loop(*_problem(5, 16, 16, 1, 1))  # E = 1
        check_against_loop(*_problem(0, 16, 16, 4, 2))  # no tokens
    with use_options(wgrad_chunk_rows=1):  # one row per chunk
        check_against_loop(*_problem(9, 16, 16, 3, 2))


def test_options_deterministic_and_combined():
    p, ids, kw = _problem(30, 24, 16, 3, 2, bias=True, ids=_skewed_ids(30, 2, 3))
    with use_options(wgrad_chunk_rows=7):
        a, b = _run(p, ids, kw, "triton", torch.float32), _run(p, ids, kw, "triton", torch.float32)
        for name in a:
            assert torch.equal(a[name], b[name]), name
    with use_options(wgrad_chunk_rows=7, atomic_combine=True):
        check_against_loop(p, ids, kw)


def test_options_read_once_per_forward_and_backward(monkeypatch):
    """``read_once``: one reading of the environment serves a whole forward or backward; ``use_options``
    inside still overrides; the environment holds again after (also after an exception)."""
    from moeyard.experts.triton import options as opt

    seen = []

    @opt.read_once
    def step(fail=False):
        seen.append(options())
        monkeypatch.setenv("MOEYARD_TRITON_ATOMIC_COMBINE", "1")
        seen.append(options())
        with use_options(wgrad_chunk_rows=64):
            seen.append(options())
        seen.append(options())
        if fail:
            raise RuntimeError("boom")

    monkeypatch.delenv("MOEYARD_TRITON_ATOMIC_COMBINE", raising=False)
    step()
    assert seen[0] is seen[1] is seen[3] and not seen[0].atomic_combine
    assert seen[2].wgrad_chunk_rows == 64 and seen[2].atomic_combine  # the block reads afresh
    assert options().atomic_combine
    monkeypatch.delenv("MOEYARD_TRITON_ATOMIC_COMBINE")
    with pytest.raises(RuntimeError, match="boom"):
        step(fail=True)
    monkeypatch.setenv("MOEYARD_TRITON_WGRAD_CHUNK", "32")
    assert options().wgrad_chunk_rows == 32  # not left frozen by the failed step

    class Counting(dict):  # the environment, counting reads
        reads = 0

        def get(self, key, default=None):
            Counting.reads += 1
            return super().get(key, default)

    monkeypatch.setattr(opt, "os", type("os", (), {"environ": Counting(os.environ)}))
    p, ids, kw = _problem(9, 16, 16, 3, 2)
    _run(p, ids, kw, "triton", torch.float32)
    assert Counting.reads == 3 * len(opt.ENV)  # once in the forward, once in each of the two backward functions


def test_partial_slot_bound():
    # every expert with more than `chunk` rows takes ceil(c / chunk) slots; the buffer has 2 N // chunk
    from moeyard.experts.triton.schedule import max_partial_slots

    gen = torch.Generator().manual_seed(3)
    for _ in range(200):
        e = int(torch.randint(1, 9, (1,), generator=gen))
        counts = torch.randint(0, 60, (e,), generator=gen).tolist()
        chunk = int(torch.randint(1, 40, (1,), generator=gen))
        n = sum(counts)
        need = sum(-(-c // chunk) for c in counts if c > chunk)
        assert need <= max_partial_slots(n, chunk) if n else True


def test_options_env_and_budget(monkeypatch):
    assert options() == Options()
    monkeypatch.setenv("MOEYARD_TRITON_ATOMIC_COMBINE", "1")
    monkeypatch.setenv("MOEYARD_TRITON_WGRAD_CHUNK", "256")
    assert options().atomic_combine and options().wgrad_chunk_rows == 256
    with use_options(atomic_combine=False):
        assert not options().atomic_combine and options().wgrad_chunk_rows == 256
    assert options().atomic_combine
    with pytest.raises(ValueError, match="unknown"):
        with use_options(atomic=True):
            pass
    with pytest.raises(ValueError):
        with use_options(wgrad_chunk_rows=-1):
            pass
    assert options().wgrad_chunk_rows == 256  # restored after the failed override
    assert options().tma and options().tma_wgrad
    monkeypatch.setenv("MOEYARD_TRITON_TMA", "0")
    monkeypatch.setenv("MOEYARD_TRITON_TMA_WGRAD", "0")
    assert not options().tma and not options().tma_wgrad
    monkeypatch.delenv("MOEYARD_TRITON_TMA")
    monkeypatch.delenv("MOEYARD_TRITON_TMA_WGRAD")
    assert not options().prefetch_h  # opt-in: its measured gain lies within the spread
    monkeypatch.setenv("MOEYARD_TRITON_PREFETCH", "1")
    assert options().prefetch_h
    monkeypatch.delenv("MOEYARD_TRITON_PREFETCH")
    # budget: 2 N // rows float32 [NL, NR] slots must fit in wgrad_partial_mib
    o = Options(wgrad_chunk_rows=512, wgrad_partial_mib=256)
    n, nl, nr = 262144, 1536, 2048
    rows = o.chunk_rows(n, nl, nr)
    assert rows >= 512 and (2 * n // rows) * nl * nr * 4 <= 256 * 2**20
    assert Options().chunk_rows(n, nl, nr) == 0


def _profile_module():
    return load_benchmark("triton_profile")


def test_profile_flop_and_byte_counts():
    # benchmarks/triton_profile.py: CPU-side counting (the GPU side runs on the GPU machine)
    prof = _profile_module()
    s = prof.Shape(T=4, H=8, I=2, E=3, K=2)  # N = 8, N1 = 4
    costs = {c.name: c for c in prof.kernel_costs(s)}
    gemm = sum(
        c.flops
        for c in costs.values()
        if c.name.startswith(("up", "down", "dh", "wgrad", "dx")) and "combine" not in c.name
    )
    assert gemm == 18 * s.N * s.H * s.I  # SonicMoE's convention: fwd 6 N H I, bwd 12 N H I
    # up: x [4, 8] + W_up [3, 4, 8] + h [8, 4] + a [8, 2] in bf16, sort_order int64
    assert costs["up (x@W_up, act)"].bytes == 2 * (32 + 96 + 32 + 16) + 64
    assert costs["down combine"].bytes == 2 * (8 * 8 + 4 * 8) + 64
    assert costs["wgrad up"].bytes == 2 * (8 * 4 + 4 * 8 + 3 * 4 * 8) + 32  # int32 sorted tokens
    atomic = {c.name: c for c in prof.kernel_costs(s, atomic=True)}
    assert "down combine" not in atomic and atomic["down cast"].bytes == 4 * 32 + 2 * 32
    assert atomic["down (atomic combine)"].flops == costs["down"].flops + costs["down combine"].flops
    chunked = {c.name: c for c in prof.kernel_costs(s, chunk_slots=(0, 3), split_experts=(0, 1), chunked=(False, True))}
    assert "wgrad down reduce" not in chunked
    assert chunked["wgrad up reduce"].bytes == 4 * 3 * 32 + 2 * 32
    assert chunked["wgrad up"].bytes == costs["wgrad up"].bytes - 2 * 32 + 4 * 3 * 32
    assert prof.chunk_usage([10, 3, 0, 25], 8) == (2 + 4, 2) and prof.chunk_usage([10], 0) == (0, 0)
    args = prof.parse_args(["--configs", "sonic-7b", "--variants", "--chunk", "512"])
    assert args.configs == ["sonic-7b"] and args.variants == list(prof.VARIANTS)
    assert prof.variant_options("all", args.chunk)["wgrad_chunk_rows"] == 512
    with pytest.raises(SystemExit):
        prof.parse_args(["--variants", "nope"])


@pytest.mark.parametrize("variant,chunk", [("default", 8), ("all", 8), ("chunk", 30)])
def test_profile_launches_run(variant, chunk):
    # every launch the profile times runs on its prebuilt buffers (tiny shape, interpreter, float32);
    # chunk 30 < N = 48 rows but above any expert's count (<= T = 24): chunked, nothing split
    prof = _profile_module()
    s = prof.Shape(T=24, H=16, I=16, E=3, K=2)
    inputs = prof.make_inputs(s, 0, skew=1.0, device="cpu", dtype=torch.float32)
    opts = prof.variant_options(variant, chunk)
    with use_options(**opts):
        costs = prof.launches(s, inputs, opts)
        for c in costs:
            c.run()
    names = [c.name.split(" [")[0] for c in costs]
    assert ("wgrad up reduce" in names) == (variant != "default") and ("down cast" in names) == (variant == "all")


def test_tma_descriptor_rules():
    """The three TMA predicates share one rule set: 16-bit floats (float32 only when asked), unit stride
    along the boxed dimension, other strides and the base 16-byte aligned."""
    from moeyard.experts.triton import kernels_tma as k

    bf = dict(dtype=torch.bfloat16)
    rows, w = torch.zeros(64, 32, **bf), torch.zeros(4, 48, 32, **bf)
    assert k.rows_tma_ready(rows) and k.weight_tma_ready(w) and k.tma_ready(rows, w)
    assert k.tma_ready(rows, w.mT.contiguous().mT)  # unit stride along NY
    assert not k.rows_tma_ready(rows.float()) and k.rows_tma_ready(rows.float(), float32=True)
    assert not k.rows_tma_ready(torch.zeros(64, 36, **bf)[:, :33])  # row stride 72 bytes
    assert not k.rows_tma_ready(rows.mT)  # no unit stride along C
    assert not k.rows_tma_ready(torch.zeros(64 * 32 + 1, **bf)[1:].view(64, 32))  # base off by 2 bytes
    assert not k.weight_tma_ready(w.mT)  # unit stride not last
    assert not k.weight_tma_ready(torch.zeros(4, 48, 36, **bf)[:, :, :33])
    assert not k.tma_ready(rows, w.half())  # dtypes differ
    assert not k.tma_ready(rows.mT.contiguous().mT, w)  # rows not contiguous


def test_h_is_freed_before_the_up_projection_backward():
    # the down projection keeps h [N, 2I] (the activation's input) for its backward; autograd frees a node's
    # saved tensors when that node's backward returns, so h must be gone when the up projection's backward
    # starts (its input and weight gradients then run without it). Saved tensors are packed into holders
    # whose lifetime the test watches.
    import weakref

    T, H, I, E, K = 9, 16, 12, 3, 2
    p, ids, kw = _problem(T, H, I, E, K)
    leaves = {k: v.requires_grad_() for k, v in p.items()}
    holders, seen = [], {}

    class Holder:
        def __init__(self, t):
            self.t = t

    def pack(t):
        h = Holder(t)
        holders.append((tuple(t.shape), weakref.ref(h)))
        return h

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.t):
        out = moeyard.experts(
            leaves["x"],
            ids,
            leaves["topk_weights"],
            leaves["gate_up_proj"],
            leaves["down_proj"],
            backend="triton",
            **kw,
        )

    def live_h():
        return sum(1 for shape, ref in holders if shape == (T * K, 2 * I) and ref() is not None)

    def find(node, name, done=()):
        if node is None or node in done:
            return None
        if name in node.name():
            return node
        return next(filter(None, (find(n, name, (*done, node)) for n, _ in node.next_functions)), None)

    up = find(out.grad_fn, "_UpProj")
    assert up is not None
    up.register_prehook(lambda grads: seen.update(live_h=live_h()))
    assert live_h() == 1  # kept for the backward
    out.backward(torch.randn_like(out))
    assert seen == {"live_h": 0}


def test_backward_makes_no_zero_gradient_for_the_activation():
    # the up projection's second output a = act(h) is not differentiable: its gradient stays undefined in the
    # backward, not a zero [N, I] tensor made and filled before each backward (autograd's default for a
    # custom function's unused outputs)
    from torch.utils._python_dispatch import TorchDispatchMode

    T, H, I, E, K = 9, 16, 12, 3, 2
    p, ids, kw = _problem(T, H, I, E, K)
    leaves = {k: v.requires_grad_() for k, v in p.items()}
    out = moeyard.experts(
        leaves["x"], ids, leaves["topk_weights"], leaves["gate_up_proj"], leaves["down_proj"], backend="triton", **kw
    )
    made = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if isinstance(result, torch.Tensor):
                made.append((func.__name__, tuple(result.shape)))
            return result

    with Log():
        out.backward(torch.randn_like(out))
    assert any(shape == (T * K, 2 * I) for _, shape in made)  # the log sees the backward's tensors (d h)
    assert not [name for name, shape in made if shape == (T * K, I) and "zero" in name]


@pytest.mark.parametrize("keep_routing", [True, False])
def test_checkpointed_layer_compiles_fullgraph(monkeypatch, keep_routing):
    # torch.compile(fullgraph=True) over a checkpointed layer (a compiled, activation-checkpointed block): the
    # layer keeps aux_loss and routing on itself, a side effect Dynamo does not replay in the checkpoint's
    # recompute and refuses by default; with torch's switch for that, one graph, equal to eager
    cfg = torch._dynamo.config
    if not hasattr(cfg, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        pytest.skip("this torch has no skip_fwd_side_effects_in_bwd_under_checkpoint")
    monkeypatch.setattr(cfg, "skip_fwd_side_effects_in_bwd_under_checkpoint", True)
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    layer = moeyard.MoE(
        moeyard.MoEConfig(hidden_size=16, intermediate_size=16, num_experts=4, top_k=2, aux_loss_coef=0.01),
        backend="triton",
    )
    layer.keep_routing = keep_routing
    x = torch.randn(2, 5, 16)

    def block(x):
        return checkpoint(layer, x, True, use_reentrant=False)

    def step(fn):
        xi = x.clone().requires_grad_()
        y, aux = fn(xi)
        params = [p for p in layer.parameters() if p.requires_grad]
        return [y.detach(), *torch.autograd.grad((y * torch.linspace(-1, 1, 16)).sum() + aux, [xi, *params])]

    got = step(torch.compile(block, backend="aot_eager", fullgraph=True))
    assert (layer.routing is not None) == keep_routing and layer.aux_loss is not None
    want = step(block)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
