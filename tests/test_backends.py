"""Every expert backend against the float64 ``loop`` oracle: the output and every gradient
(hidden_states, gate_up_proj, down_proj, biases, topk_weights), in float32 and bfloat16, judged by
``err(backend) <= 2 * err(loop in that dtype) + EPS[dtype]`` (tests/helpers.py).

Legend: T tokens, H hidden size, I expert intermediate size, E experts, K top-k.
"""

import pytest
import torch

import moeyard
from helpers import (
    EPS,
    GATED,
    PLAIN,
    assert_unchanged,
    check_backend,
    clones,
    cpu_backends,
    make_inputs,
    nan_fill_empty,
    rel_err,
    run_experts,
)

DTYPES = [torch.float32, torch.bfloat16]
BACKEND_DTYPE = [pytest.param(b, d, id=f"{b}-{str(d)[6:]}") for d in DTYPES for b in cpu_backends(d)]


def runs_here(backend: str, dtype: torch.dtype, H: int, I: int) -> bool:
    """Whether ``backend`` accepts these sizes on the CPU (``grouped_mm``: 16-byte rows, i.e. H and I
    multiples of 4 in float32, of 8 in bfloat16)."""
    if backend == "grouped_mm":
        per16 = 16 // torch.empty(0, dtype=dtype).element_size()
        return H % per16 == 0 and I % per16 == 0
    return True


@pytest.fixture
def nan_empty(monkeypatch):
    nan_fill_empty(monkeypatch)


# (T, H, I, E, K, experts the ids are drawn from (None: all))
SHAPES = [
    pytest.param(16, 32, 24, 8, 2, None, id="base"),  # balanced routing, every expert busy
    pytest.param(
        16, 32, 24, 8, 2, [0, 2, 3, 5], id="empty_experts"
    ),  # experts 1, 4, 6, 7 get no rows: zero-size groups
    pytest.param(12, 32, 24, 8, 1, [3], id="one_expert"),  # every token to expert 3: one group holds all rows, C = T
    pytest.param(10, 32, 24, 1, 1, None, id="E1"),  # a single expert: offsets [0, T]
    pytest.param(9, 32, 24, 4, 4, None, id="k_eq_E"),  # K = E: every expert sees every token
    pytest.param(1, 32, 24, 8, 2, None, id="T1"),  # one token, far smaller than any tile
    pytest.param(0, 32, 24, 8, 2, None, id="T0"),  # no tokens at all: empty GEMMs, empty output
    pytest.param(21, 32, 24, 7, 3, None, id="prime_E"),  # E = 7, K = 3: no power-of-two assumptions
    pytest.param(16, 12, 20, 6, 2, None, id="H12_I20"),  # H, I not multiples of 16 (grouped_mm: fp32 only)
    pytest.param(11, 13, 7, 5, 2, None, id="H13_I7"),  # odd H and I: masked tile edges; grouped_mm raises
]


@pytest.mark.parametrize("backend,dtype", BACKEND_DTYPE)
@pytest.mark.parametrize("T,H,I,E,K,pool", SHAPES)
def test_shapes(backend, dtype, T, H, I, E, K, pool, nan_empty):
    ids = None
    if pool is not None:
        ids = torch.tensor(pool)[torch.rand(T, len(pool)).argsort(1)[:, :K]]
    inputs = make_inputs(T, H, I, E, K, ids=ids, bias=True)
    if not runs_here(backend, dtype, H, I):
        with pytest.raises(ValueError, match="hidden_size|intermediate_size"):
            run_experts(inputs, dtype, backend, torch.zeros(T, H))
        return
    before = clones(inputs)
    got = check_backend(backend, inputs, dtype)
    assert_unchanged(before, inputs)
    assert torch.isfinite(got["out"]).all()
    if T:  # the gradients are not all zero: a backend that drops a path would still "match" zeros
        for k in ("grad_hidden_states", "grad_gate_up_proj", "grad_down_proj", "grad_topk_weights"):
            assert got[k].abs().max() > 0, k


CUSTOM_GATED = moeyard.Activation(name="tanh_glu", fn=lambda h: torch.tanh(h.chunk(2, -1)[0]) * h.chunk(2, -1)[1])
CUSTOM_PLAIN = moeyard.Activation(name="softsign", fn=torch.nn.functional.softsign, fn_gated=False)
ACTIVATIONS = (
    [pytest.param(a, id=a) for a in GATED + PLAIN]
    + [pytest.param(lambda h: torch.tanh(h.chunk(2, -1)[0]) * h.chunk(2, -1)[1], id="callable")]  # a bare callable
    + [pytest.param(CUSTOM_GATED, id="custom_gated"), pytest.param(CUSTOM_PLAIN, id="custom_plain")]
)


def _is_gated(act) -> bool:
    return moeyard.activations.get_activation(act).gated


@pytest.mark.parametrize("backend,dtype", BACKEND_DTYPE)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_activations(backend, dtype, activation, bias):
    # scale up the inputs so clamped_swiglu's clamps (|x| > 7) and relu's zeros are both hit
    inputs = make_inputs(12, 16, 8, 4, 2, gated=_is_gated(activation), bias=bias)
    inputs["hidden_states"] *= 6
    check_backend(backend, inputs, dtype, activation=activation)


@pytest.mark.parametrize("backend,dtype", BACKEND_DTYPE)
@pytest.mark.parametrize(
    "transposed,interleaved",
    [
        (True, True),  # gpt-oss: [E, H, 2I] / [E, I, H] weights (.mT views) with interleaved gate/up columns
        (True, False),  # transposed storage only
        (False, True),  # interleaved gate/up in the standard layout
    ],
    ids=["gpt_oss", "transposed", "interleaved"],
)
def test_layouts(backend, dtype, transposed, interleaved):
    inputs = make_inputs(14, 16, 8, 4, 2, bias=True, transposed=transposed)
    inputs["hidden_states"] *= 6
    act = moeyard.Activation(name="clamped_swiglu")
    check_backend(backend, inputs, dtype, activation=act, transposed=transposed, interleaved=interleaved)


def test_gpt_oss_layout_formula():
    """The layout flags against the formula written out: gpt-oss's experts compute
    ``gate_up = x @ W[e] + b``, ``gate, up = gate_up[..., ::2], gate_up[..., 1::2]``, clamps, then
    ``(up + 1) * gate * sigmoid(1.702 gate)`` and ``@ down[e] + b``."""
    T, H, I, E, K = 5, 8, 4, 3, 2
    inp = make_inputs(T, H, I, E, K, bias=True, transposed=True)
    inp["hidden_states"] *= 6
    got = moeyard.experts(
        inp["hidden_states"],
        inp["topk_ids"],
        inp["topk_weights"],
        inp["gate_up_proj"],
        inp["down_proj"],
        gate_up_bias=inp["gate_up_bias"],
        down_bias=inp["down_bias"],
        activation="clamped_swiglu",
        transposed=True,
        interleaved=True,
        backend="loop",
    )
    want = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            e = int(inp["topk_ids"][t, k])
            gu = inp["hidden_states"][t] @ inp["gate_up_proj"][e] + inp["gate_up_bias"][e]
            gate, up = gu[0::2].clamp(max=7.0), gu[1::2].clamp(-7.0, 7.0)
            y = ((up + 1) * gate * torch.sigmoid(1.702 * gate)) @ inp["down_proj"][e] + inp["down_bias"][e]
            want[t] += inp["topk_weights"][t, k] * y
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend,dtype", BACKEND_DTYPE)
@pytest.mark.parametrize("layout", ["col_major", "strided"])
def test_non_contiguous_input(backend, dtype, layout):
    transform = {
        "col_major": lambda x: x.t().contiguous().t(),  # strides (1, T)
        "strided": lambda x: x.repeat(1, 2)[:, ::2],  # strides (2H, 2)
    }[layout]
    inputs = make_inputs(10, 16, 8, 4, 2, bias=True)
    x = transform(inputs["hidden_states"])
    assert not x.is_contiguous()
    check_backend(backend, inputs, dtype, x_transform=transform)


def _with_invalid(T, E, K):
    ids = torch.rand(T, E).argsort(1)[:, :K]
    ids[0, 0], ids[2, 1], ids[3, 0] = -1, E, E + 5  # sentinels below and above [0, E)
    return ids


@pytest.mark.parametrize("backend,dtype", BACKEND_DTYPE)
def test_drop_invalid(backend, dtype, nan_empty):
    T, H, I, E, K = 8, 16, 8, 4, 2
    ids = _with_invalid(T, E, K)
    inputs = make_inputs(T, H, I, E, K, ids=ids, bias=True)
    got = check_backend(backend, inputs, dtype, drop_invalid=True)
    # independently of the oracle: an invalid pair contributes exactly what a zero-weight pair does
    bad = (ids < 0) | (ids >= E)
    zeroed = dict(inputs, topk_ids=ids.clamp(0, E - 1), topk_weights=inputs["topk_weights"].masked_fill(bad, 0))
    want = run_experts(zeroed, torch.float64, "loop", torch.zeros(T, H))["out"]
    assert (
        rel_err(got["out"], want)
        <= 2 * rel_err(run_experts(inputs, dtype, "loop", torch.zeros(T, H), drop_invalid=True)["out"], want)
        + EPS[dtype]
    )
    assert (got["grad_topk_weights"][bad] == 0).all()


@pytest.mark.parametrize("backend,dtype", BACKEND_DTYPE)
def test_more_ids_than_experts_with_drop_invalid(backend, dtype, nan_empty):
    """K > E with ``drop_invalid``: a rank's local experts under expert parallelism with E_l < K get each
    token's K global ids shifted (those of other ranks fall outside ``[0, E_l)``); without it, an error."""
    T, H, I, E, K = 12, 16, 8, 2, 3
    ids = torch.rand(T, 3 * E).argsort(1)[:, :K] - E  # ids of a middle rank's 2 of 6 experts
    inputs = make_inputs(T, H, I, E, K, ids=ids, bias=True)
    check_backend(backend, inputs, dtype, drop_invalid=True)
    with pytest.raises(ValueError, match="topk_ids: top-k 3 exceeds num_experts 2"):
        run_experts(inputs, dtype, backend, torch.zeros(T, H))


@pytest.mark.parametrize("backend,dtype", BACKEND_DTYPE)
def test_drop_invalid_unwritten(backend, dtype, nan_empty):
    """``drop_invalid="unwritten"`` at K = 1 (an expert-parallel rank's rows, some of them empty): the rows of
    tokens with a valid pair and every weight gradient as with ``drop_invalid=True``; the dropped tokens'
    output and input-gradient rows are zeros on every backend but ``triton``, which leaves them unwritten
    (NaN here: fresh tensors are NaN-filled)."""
    T, H, I, E = 12, 16, 8, 4
    ids = torch.randint(0, E, (T, 1))
    ids[::3] = E  # a third of the rows are empty
    inputs = make_inputs(T, H, I, E, 1, ids=ids, bias=True)
    dy = torch.randn(T, H, dtype=torch.float64)
    want = run_experts(inputs, dtype, backend, dy, drop_invalid=True)
    got = run_experts(inputs, dtype, backend, dy, drop_invalid="unwritten")
    live = ids[:, 0] < E
    for k in want:
        if k in ("out", "grad_hidden_states"):
            assert torch.equal(got[k][live], want[k][live]), k
            dropped = got[k][~live]
            assert dropped.isnan().all() if backend == "triton" else (dropped == 0).all(), (k, backend)
        else:
            assert torch.equal(got[k], want[k]), k
    with pytest.raises(ValueError, match="drop_invalid: expected False, True or 'unwritten', got 'zero'"):
        run_experts(inputs, dtype, backend, dy, drop_invalid="zero")


@pytest.mark.parametrize("backend", cpu_backends(torch.float64))
def test_float64(backend):
    """Backends that accept float64 agree with the oracle to float64 roundoff."""
    check_backend(backend, make_inputs(16, 32, 24, 8, 2, bias=True), torch.float64)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_row_bias_gradient_precision(dtype):
    """The pipeline's expert-bias gradient (``add_row_bias``) is summed in float64 for float64 and in
    float32 otherwise: each row's gradient is 1 + a part below float32's resolution, which only a
    float64 sum keeps. The output is ``y + bias[expert of each row]``, ``dy`` passes through."""
    from moeyard.dispatch import make_plan
    from moeyard.experts.pipeline import add_row_bias

    E, out = 4, 3
    ids = torch.randint(0, E, (50, 2), generator=torch.Generator().manual_seed(0))
    ids[0] = torch.tensor([1, 2])  # every expert but 0 and 3 may be rare; 1 and 2 surely have rows
    plan = make_plan(ids, E, align=4)  # pad rows (no expert) between the blocks
    R, experts = plan.num_rows, plan.row_experts()
    y = torch.randn(R, out, dtype=torch.float64).to(dtype).requires_grad_()
    bias = torch.randn(E, out, dtype=torch.float64).to(dtype).requires_grad_()
    dy = (1 + 1e-9 * torch.arange(R * out, dtype=torch.float64).view(R, out)).to(dtype)
    got = add_row_bias(y, bias, plan)
    padded = torch.cat([bias.detach(), torch.zeros(1, out, dtype=dtype)])
    assert torch.equal(got, y.detach() + padded[experts])
    got.backward(dy)
    assert torch.equal(y.grad, dy) and bias.grad.dtype == dtype
    want = torch.stack([dy.double()[experts == e].sum(0) for e in range(E)])
    err = ((bias.grad.double() - want).abs().max() / want.abs().max()).item()
    assert err <= {torch.float64: 1e-15, torch.float32: 1e-6, torch.bfloat16: 2**-8}[dtype], err
    if dtype == torch.float64:  # the sub-float32 parts are there: a float32 sum loses them
        assert (bias.grad - want.float().double()).abs().max() > 1e-8


@pytest.mark.parametrize("dtype", DTYPES)
def test_auto_backend(dtype):
    """``auto`` picks a backend that runs here, and it matches the oracle."""
    check_backend("auto", make_inputs(16, 32, 24, 8, 2), dtype)


def test_topk_weights_in_float32_with_bf16_states():
    """The router returns float32 weights; experts() casts them to hidden_states' dtype."""
    inputs = make_inputs(8, 16, 8, 4, 2)
    for backend in cpu_backends(torch.bfloat16):
        x = inputs["hidden_states"].bfloat16()
        args = (inputs["topk_ids"], inputs["gate_up_proj"].bfloat16(), inputs["down_proj"].bfloat16())
        a = moeyard.experts(x, args[0], inputs["topk_weights"].float(), *args[1:], backend=backend)
        b = moeyard.experts(x, args[0], inputs["topk_weights"].bfloat16(), *args[1:], backend=backend)
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a, b, rtol=1.6e-2, atol=1e-2)


def test_process_default_backend(monkeypatch):
    """``backend=None`` follows set_backend, then MOEYARD_BACKEND."""
    from moeyard.experts import registry

    monkeypatch.setattr(registry, "_default", [None])
    monkeypatch.setenv("MOEYARD_BACKEND", "bmm_padded")
    assert moeyard.get_backend() == "bmm_padded"
    moeyard.set_backend("loop")
    assert moeyard.get_backend() == "loop"
    check_backend(None, make_inputs(6, 16, 8, 4, 2), torch.float32)
    moeyard.set_backend(None)
    assert moeyard.get_backend() == "bmm_padded"


def test_dropped_rows_get_no_gradient_from_unwritten_memory():
    """grouped_mm leaves rows past the last expert unwritten, in the backward too; with
    ``drop_invalid`` they must not reach grad(hidden_states)."""
    import moeyard
    from moeyard.experts import grouped_mm as gm

    T, H, I, E = 6, 8, 8, 3
    x = torch.randn(T, H, requires_grad=True)
    wu, wd = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    ids = torch.tensor([[0, 3], [1, 3], [2, 0], [3, 1], [0, 2], [1, 3]])  # id 3 == E: dropped
    w = torch.rand(T, 2)
    real = torch._grouped_mm

    def poisoned(a, b, offs=None):  # unwritten rows hold NaN, as fresh device memory may
        y = real(a, b, offs=offs)
        live = torch.arange(y.shape[0]) < offs[-1]
        return y.masked_fill(~live.unsqueeze(-1), float("nan"))

    class Poisoned(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b, offs):
            ctx.save_for_backward(a, b, offs)
            return poisoned(a, b, offs)

        @staticmethod
        def backward(ctx, dy):
            a, b, offs = ctx.saved_tensors
            with torch.enable_grad():
                a2, b2 = a.detach().requires_grad_(), b.detach().requires_grad_()
                da, db = torch.autograd.grad(real(a2, b2, offs=offs), (a2, b2), dy.nan_to_num(0.0))
            live = torch.arange(da.shape[0]) < offs[-1]
            return da.masked_fill(~live.unsqueeze(-1), float("nan")), db, None

    orig = gm.torch._grouped_mm
    gm.torch._grouped_mm = lambda a, b, offs=None: Poisoned.apply(a, b, offs)
    try:
        out = moeyard.experts(x, ids, w, wu, wd, backend="grouped_mm", drop_invalid=True)
        out.backward(torch.randn_like(out))
    finally:
        gm.torch._grouped_mm = orig
    assert torch.isfinite(out).all()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("backend", ["auto"] + cpu_backends(torch.float32))
def test_first_call_under_no_grad_or_inference_mode(monkeypatch, backend, mode, lora):
    # generation runs the layer under inference_mode, often as the process's first call: every backend
    # gives the grad-mode output there, and grouped_mm's feature probe (a tiny backward) neither fails
    # nor marks grouped_mm unavailable for the rest of the process (auto would fall back silently)
    from moeyard.experts import grouped_mm
    from moeyard.experts.registry import resolve_backend

    monkeypatch.setattr(grouped_mm, "_PROBED", {})
    torch.manual_seed(0)
    layer = moeyard.MoE(
        moeyard.MoEConfig(hidden_size=32, intermediate_size=16, num_experts=4, top_k=2), backend=backend
    )
    if lora:
        layer.add_lora(8)
        with torch.no_grad():  # PEFT's init leaves B zero
            for adapter in layer.lora.values():
                adapter.lora_B.weight.normal_()
    x = torch.randn(7, 32)
    with mode():
        out = layer(x)
        picked = resolve_backend("auto", x.device, x.dtype).name
    assert grouped_mm._PROBED.get(("cpu", None, torch.float32, False), None) is None
    assert picked == resolve_backend("auto", x.device, x.dtype).name
    torch.testing.assert_close(out, layer(x).detach(), rtol=0, atol=0)


def _meta_takes(dtype: torch.dtype) -> bool:
    """Whether torch's shape function for ``_grouped_mm`` (what torch.compile traces with) takes ``dtype``."""
    try:
        torch._grouped_mm(
            torch.ones(16, 16, dtype=dtype, device="meta"),
            torch.ones(2, 16, 16, dtype=dtype, device="meta").mT,
            offs=torch.tensor([8, 16], dtype=torch.int32, device="meta"),
        )
    except RuntimeError:
        return False
    return True


def _compiled_step(layer, x, compiled: bool, fullgraph: bool = True):
    fn = torch.compile(layer, backend="aot_eager", fullgraph=fullgraph) if compiled else layer
    xi = x.clone().requires_grad_()
    out = fn(xi)
    params = [p for p in layer.parameters() if p.requires_grad]
    grads = torch.autograd.grad((out.float() * torch.linspace(-1, 1, x.shape[-1])).sum(), [xi, *params])
    return out, grads


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("backend", ["grouped_mm", "auto"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_compiles_fullgraph(monkeypatch, backend, dtype, lora):
    # torch.compile(fullgraph=True) of the layer on torch's grouped GEMM and on auto, compiled before any eager
    # call (the feature probe runs while tracing, not traced): output and every gradient equal eager's. Where
    # torch's shape function refuses the dtype (float32 in torch 2.11-2.13), naming grouped_mm is an error that
    # says so, and auto takes the next backend (bmm_padded: its host sync is a graph break, so not fullgraph).
    from moeyard.experts import grouped_mm

    monkeypatch.setattr(grouped_mm, "_PROBED", {})
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = moeyard.MoEConfig(hidden_size=16, intermediate_size=16, num_experts=4, top_k=2)
    layer = moeyard.MoE(cfg, backend=backend).to(dtype)
    if lora:
        layer.add_lora(8)
        with torch.no_grad():  # PEFT's init leaves B zero: make the adapters' gradients reach A
            for a in layer.lora.values():
                a.lora_B.weight.normal_()
    x = torch.randn(2, 5, 16, dtype=dtype)
    if backend == "grouped_mm" and not _meta_takes(dtype):
        with pytest.raises(Exception, match="grouped_mm' cannot run here .*under torch.compile"):
            _compiled_step(layer, x, True)
        return
    same_backend = _meta_takes(dtype)  # else eager runs grouped_mm and compiled bmm_padded: equal to roundoff
    got, want = _compiled_step(layer, x, True, fullgraph=same_backend), _compiled_step(layer, x, False)
    for a, b in zip([got[0], *got[1]], [want[0], *want[1]], strict=True):
        assert torch.equal(a, b) if same_backend else torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.fixture
def scratch_backends():
    """Register throw-away backends for a test; remove them afterwards."""
    from moeyard.experts import registry

    added = []

    def add(backend):
        added.append(backend.name)
        return registry.register_backend(backend)

    yield add
    for name in added:
        registry._BACKENDS.pop(name, None)


def test_auto_defers_by_workload(scratch_backends):
    """``auto`` runs the backend that the best one defers to for this workload, when that one runs."""
    from moeyard.experts.registry import ExpertBackend, Workload, resolve_backend

    runs = {"ok": None}
    scratch_backends(
        ExpertBackend(
            name="zz_small",
            forward=None,
            unsupported=lambda *a: None,
            priority={"cpu": 1000},
            defer=lambda d, t, w, work: "zz_big" if work.pairs >= 100 else None,
        )
    )
    scratch_backends(ExpertBackend(name="zz_big", forward=None, unsupported=lambda *a: runs["ok"], priority={}))
    from moeyard.experts import expert_weights

    w = expert_weights(torch.randn(4, 16, 8), torch.randn(4, 8, 8))
    cpu = torch.device("cpu")
    pick = lambda pairs: resolve_backend("auto", cpu, torch.float32, w, None, Workload(pairs, True)).name
    assert pick(10) == "zz_small"
    assert pick(100) == "zz_big"
    assert resolve_backend("auto", cpu, torch.float32, w).name == "zz_small"  # no workload: no deferral
    assert resolve_backend("zz_small", cpu, torch.float32, w, None, Workload(100, True)).name == "zz_small"
    runs["ok"] = "cannot run here"
    assert pick(100) == "zz_small"  # the deferred-to backend must run


def test_training_flag_of_experts_call(monkeypatch):
    """``moeyard.experts`` passes the call's pairs and whether base weight gradients will be computed
    to the registry."""
    import sys

    from moeyard.experts import registry

    seen = []
    real = registry.resolve_backend

    def spy(*args, **kwargs):
        seen.append(args[5] if len(args) > 5 else kwargs.get("workload"))
        return real(*args, **kwargs)

    monkeypatch.setattr(sys.modules["moeyard.experts"], "resolve_backend", spy)
    x, ids, w = torch.randn(6, 8), torch.randint(0, 4, (6, 2)), torch.rand(6, 2)
    up, down = torch.randn(4, 16, 8), torch.randn(4, 8, 8)
    moeyard.experts(x, ids, w, up, down, backend="loop")
    moeyard.experts(x.requires_grad_(), ids, w, up, down, backend="loop")
    moeyard.experts(x, ids, w, up.requires_grad_(), down, backend="loop")
    with torch.no_grad():
        moeyard.experts(x, ids, w, up, down, backend="loop")
    assert [(s.pairs, s.weight_grad) for s in seen] == [(12, False), (12, False), (12, True), (12, False)]
