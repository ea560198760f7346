"""The MoE layer: forward and backward of every backend against the same layer in float64 with the
``loop`` backend (output, input gradient and every parameter's gradient, the router weight included,
through both the routing weights and the aux losses), plus the layer's composition written out.

Legend: B sequences, S tokens each, T = B * S, H hidden size, I intermediate size, E experts, K top-k.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import moeyard
from helpers import assert_matches_oracle, cpu_backends
from moeyard import MoE, MoEConfig

LOSS = dict(aux_loss_coef=0.1, seq_aux_loss_coef=0.05, z_loss_coef=0.01)

# each row: a model family's MoE block
CONFIGS = [
    pytest.param(dict(num_experts=8, top_k=2, **LOSS), id="qwen3"),  # softmax top-2, renormalised
    pytest.param(
        dict(
            num_experts=8,
            top_k=4,
            score_func="sigmoid",
            n_group=4,
            topk_group=2,
            score_correction_bias=True,
            routed_scaling_factor=2.5,
            num_shared_experts=1,
            **LOSS,
        ),
        id="deepseek_v3",
    ),  # grouped sigmoid + shared expert
    pytest.param(
        dict(
            num_experts=4,
            top_k=2,
            topk_before_score=True,
            router_bias=True,
            expert_bias=True,
            activation="clamped_swiglu",
        ),
        id="gpt_oss",
    ),  # biases everywhere
    pytest.param(
        dict(
            num_experts=6,
            top_k=2,
            norm_topk_prob=False,
            num_shared_experts=2,
            shared_intermediate_size=8,
            shared_expert_gate=True,
        ),
        id="qwen2_moe",
    ),  # gated shared expert
    pytest.param(
        dict(
            num_experts=4,
            top_k=1,
            score_func="sigmoid",
            topk_before_score=True,
            norm_topk_prob=False,
            num_shared_experts=1,
        ),
        id="llama4",
    ),  # sigmoid top-1 + shared
    pytest.param(dict(num_experts=5, top_k=5, activation="relu2", expert_bias=True), id="k_eq_E_plain"),  # plain act
]
H, I = 16, 8


def _state(cfg):
    """Fresh random float64 parameters, scaled so routing and outputs are of order 1."""
    m = MoE(cfg, backend="loop", dtype=torch.float64)
    with torch.no_grad():
        for name, p in m.named_parameters():
            fan_in = p.shape[-1]
            p.copy_(torch.randn_like(p) / math.sqrt(fan_in) * (0.5 if "bias" in name else 1.0))
        if m.router.e_score_correction_bias is not None:
            m.router.e_score_correction_bias.copy_(torch.randn(cfg.num_experts) * 0.05)
    return m.state_dict()


def _run(cfg, state, x64, g64, dtype, backend):
    m = MoE(cfg, backend=backend, dtype=dtype)
    m.load_state_dict({k: v.to(v.dtype if k.endswith("correction_bias") else dtype) for k, v in state.items()})
    x = x64.detach().to(dtype, copy=True).requires_grad_()
    y = m(x)
    assert y.dtype == dtype and y.shape == x.shape
    ((y.float() * g64.float()).sum() + m.aux_loss).backward()
    res = {"out": y.detach().double(), "grad_x": x.grad.double()}
    res.update({f"grad_{n}": p.grad.double() for n, p in m.named_parameters()})
    return res, m.routing.topk_ids


BACKEND_DTYPE = [
    pytest.param(b, d, id=f"{b}-{str(d)[6:]}")
    for d in (torch.float32, torch.bfloat16)
    for b in cpu_backends(d) + ["auto"]
]


@pytest.mark.parametrize("backend,dtype", BACKEND_DTYPE)
@pytest.mark.parametrize("kw", CONFIGS)
def test_layer_vs_oracle(kw, backend, dtype):
    cfg = MoEConfig(hidden_size=H, intermediate_size=I, **kw)
    state = _state(cfg)
    # routing is discrete: redraw the input until the low-precision router picks the experts float64
    # picks (a near-tie flips in bfloat16 otherwise), so the comparison measures arithmetic only
    for _ in range(50):
        x = torch.randn(2, 6, H, dtype=torch.float64)  # B = 2 sequences for the sequence-wise loss
        g = torch.randn_like(x)
        oracle, ids64 = _run(cfg, state, x, g, torch.float64, "loop")
        lowp, ids_lowp = _run(cfg, state, x, g, dtype, "loop")
        if torch.equal(ids64, ids_lowp):
            break
    got, ids = _run(cfg, state, x, g, dtype, backend)
    # a precondition, not the test: the low-precision router picks the same experts as float64
    assert torch.equal(ids64, ids_lowp) and torch.equal(ids64, ids)
    assert oracle["grad_router.weight"].abs().max() > 0
    assert_matches_oracle(got, lowp, oracle, dtype, what=f"MoE[{backend}]")


def test_layer_composition():
    """The layer written out: route, experts, shared MLP (``down(act(gate_up x)) * sigmoid(gate x)``)."""
    cfg = MoEConfig(
        hidden_size=H,
        intermediate_size=I,
        num_experts=6,
        top_k=2,
        num_shared_experts=2,
        shared_intermediate_size=4,
        shared_expert_gate=True,
        activation="geglu",
        **LOSS,
    )
    m = MoE(cfg, backend="loop", dtype=torch.float64)
    m.load_state_dict(_state(cfg))
    x = torch.randn(3, 4, H, dtype=torch.float64)
    x_before = x.clone()
    y = m(x)
    assert torch.equal(x, x_before)
    x2 = x.reshape(-1, H)
    r = moeyard.route(x2, m.router.weight, cfg, num_sequences=3)
    routed = torch.zeros_like(x2)
    for t in range(x2.shape[0]):
        for k in range(2):
            e = int(r.topk_ids[t, k])
            gate, up = (m.gate_up_proj[e] @ x2[t]).chunk(2)
            routed[t] += r.topk_weights[t, k].double() * (m.down_proj[e] @ (F.gelu(gate) * up))
    se = m.shared_expert
    assert se.gate_up_proj.weight.shape == (2 * 8, H)  # 2 shared experts of 4, gated: 2 * (2 * 4)
    sg, su = (x2 @ se.gate_up_proj.weight.T).chunk(2, -1)
    shared = torch.sigmoid(x2 @ se.gate.weight.T) * ((F.gelu(sg) * su) @ se.down_proj.weight.T)
    torch.testing.assert_close(y, (routed + shared).view_as(x), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m.aux_loss, r.loss)
    assert torch.equal(m.routing.topk_ids, r.topk_ids)


def test_sequence_count_from_3d_input():
    """``x [B, S, H]``: the sequence-wise loss uses B sequences; ``[T, H]`` is one sequence."""
    cfg = MoEConfig(hidden_size=H, intermediate_size=I, num_experts=4, top_k=1, seq_aux_loss_coef=1.0)
    m = MoE(cfg, backend="loop")
    x = torch.randn(4, 3, H)
    m(x)
    per_seq = m.routing.seq_aux_loss
    want = moeyard.route(x.reshape(-1, H), m.router.weight, cfg, num_sequences=4).seq_aux_loss
    torch.testing.assert_close(per_seq, want)
    m(x.reshape(-1, H))
    one = moeyard.route(x.reshape(-1, H), m.router.weight, cfg, num_sequences=1).seq_aux_loss
    torch.testing.assert_close(m.routing.seq_aux_loss, one)
    assert not torch.allclose(per_seq, one)


@pytest.mark.parametrize("shape", [(0, H), (2, 0, H)], ids=["T0", "B2_S0"])
def test_no_tokens(shape):
    cfg = MoEConfig(hidden_size=H, intermediate_size=I, num_experts=4, top_k=2, num_shared_experts=1, **LOSS)
    m = MoE(cfg)
    x = torch.randn(*shape, requires_grad=True)
    y = m(x)
    assert y.shape == x.shape
    (y.sum() + m.aux_loss).backward()
    assert x.grad.shape == x.shape
    assert all(p.grad is None or not p.grad.any() for p in m.parameters())


def test_parameters_and_repr():
    cfg = MoEConfig(
        hidden_size=H,
        intermediate_size=I,
        num_experts=4,
        top_k=2,
        expert_bias=True,
        router_bias=True,
        activation="gelu",
    )
    m = MoE(cfg)
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes == {
        "router.weight": (4, H),
        "router.bias": (4,),
        "gate_up_proj": (4, I, H),
        "down_proj": (4, H, I),
        "gate_up_proj_bias": (4, I),
        "down_proj_bias": (4, H),
    }
    assert "num_experts=4" in repr(m) and "backend=auto" in repr(m)


@pytest.mark.skipif(
    "triton" not in moeyard.available_backends("cpu", torch.float32),
    reason="needs the triton backend (Triton's interpreter on CPU)",
)
def test_forward_issues_few_device_ops(monkeypatch):
    """The layer's forward with the fused router and the triton backend: besides allocations and views,
    no torch op runs outside the kernels up to ``MAX_PAIRS`` routed pairs (the pairs' sort is one kernel,
    ``moeyard.dispatch_triton``), beyond it only the four ops of the torch sort; no id check (the router's
    ids are valid) and no loss arithmetic. Each such op costs the host ~10 µs on a GPU, where a small
    layer's forward is host-bound (benchmarks/NOTES.md, rounds 13 and 29)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime import interpreter

    from moeyard.routing import use_router

    free = {
        "view",
        "empty",
        "empty_like",
        "detach",
        "unbind",
        "alias",
        "reshape",
        "_reshape_alias",
        "as_strided",
        "t",
        "transpose",
        "select",
        "slice",
        "expand",
        "permute",
        "lift_fresh",
        "_to_copy",
    }

    class Ops(TorchDispatchMode):
        seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    from moeyard.dispatch_triton import MAX_PAIRS

    cfg = MoEConfig(num_experts=8, hidden_size=H, intermediate_size=I, top_k=2, **LOSS)
    m = MoE(cfg, backend="triton", dtype=torch.float32)
    with use_router("fused"):
        # count torch's ops only: the interpreter's own copies in and out of each kernel are left out
        monkeypatch.setattr(interpreter.InterpretedFunction, "run", lambda *args, **kwargs: None)
        for tokens, want in ((24, []), (MAX_PAIRS // 2 + 1, ["clamp", "remainder", "searchsorted", "sort"])):
            xt = torch.randn(tokens, H, requires_grad=True)
            m(xt)  # first calls make what later ones keep (the torch sort's needles)
            Ops.seen = []
            with Ops():
                y = m(xt)
            assert m.aux_loss.requires_grad and y.shape == (tokens, H)
            assert sorted(op for op in Ops.seen if op not in free) == want, Ops.seen


def _checkpointed_step(m, x, how: str):
    """One step of ``m`` on ``x``: plain, or under torch.utils.checkpoint (``reentrant`` with the layer's
    ``return_aux_loss``); returns the output, x's and every parameter's gradient, and how many times the
    experts ran."""
    from torch.utils.checkpoint import checkpoint

    calls = []
    hook = m.register_forward_pre_hook(lambda mod, args: calls.append(1))
    m.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    if how == "plain":
        y, aux = m(xi), None
    elif how == "non_reentrant":
        y, aux = checkpoint(m, xi, use_reentrant=False), None
    else:
        y, aux = checkpoint(m, xi, True, use_reentrant=True)
    loss = (y * torch.linspace(-1, 1, y.shape[-1])).sum() + (m.aux_loss if aux is None else aux)
    loss.backward()
    hook.remove()
    return [y.detach(), xi.grad] + [p.grad for p in m.parameters() if p.requires_grad], len(calls)


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("backend", cpu_backends(torch.float32))
def test_activation_checkpointing(backend, lora):
    # torch.utils.checkpoint, both variants: the output and every gradient (router's load-balancing loss
    # included) bit-identical to no checkpointing, the layer run twice (forward, then recomputed in backward)
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=H, intermediate_size=I, num_experts=8, top_k=2, **LOSS)
    m = MoE(cfg, backend=backend)
    if lora:
        m.add_lora(4)
        with torch.no_grad():  # PEFT's init leaves B zero: make the adapters' gradients reach A
            for a in m.lora.values():
                a.lora_B.weight.normal_()
    x = torch.randn(2, 5, H)
    want, n = _checkpointed_step(m, x, "plain")
    assert n == 1 and all(g is not None for g in want)
    for how in ("non_reentrant", "reentrant"):
        got, n = _checkpointed_step(m, x, how)
        assert n == 2, how
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), how


def test_reentrant_checkpoint_without_returned_loss_warns():
    # the reentrant checkpoint's first forward runs without gradients, so self.aux_loss made there has none:
    # the router silently loses its load-balancing gradient; the layer says so (and only then)
    import warnings

    from torch.utils.checkpoint import checkpoint

    cfg = MoEConfig(hidden_size=H, intermediate_size=I, num_experts=4, top_k=2, **LOSS)
    m = MoE(cfg, backend="bmm_padded")
    x = torch.randn(6, H, requires_grad=True)
    with pytest.warns(UserWarning, match="use_reentrant=False, or forward\\(x, return_aux_loss=True\\)"):
        checkpoint(m, x, use_reentrant=True)
    assert not m.aux_loss.requires_grad  # what the warning is about
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checkpoint(m, x, True, use_reentrant=True)  # the loss returned through the checkpoint
        checkpoint(m, x, use_reentrant=False)
        with torch.no_grad():
            m(x.detach())  # inference: x needs no gradient
        m.eval()
        with torch.no_grad():
            m(x)
        m.train()
        MoE(MoEConfig(hidden_size=H, intermediate_size=I, num_experts=4, top_k=2), backend="bmm_padded")(x)


def test_keep_routing_false_keeps_none():
    # keep_routing=False: no RoutingOutput on the layer after a forward, also none left from an earlier one;
    # aux_loss is still kept
    m = MoE(MoEConfig(hidden_size=H, intermediate_size=I, num_experts=4, top_k=2, **LOSS), backend="bmm_padded")
    x = torch.randn(6, H)
    m(x)
    assert m.routing is not None
    m.keep_routing = False
    m(x)
    assert m.routing is None and m.aux_loss is not None
