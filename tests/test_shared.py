"""The shared experts' fused form (:mod:`moeyard.shared_triton`) against the torch form in float64, judged as
every backend is (``tests/helpers.py``: within twice the torch form's own error plus ``EPS``): the sum with the
routed output and every gradient (``x``, the routed output, ``gate_up_proj``, ``down_proj``, the gate), per
activation, dtype, with and without the sigmoid gate, at token counts that leave partial row blocks; then what it
leaves alone (the caller's tensors, a view, a leaf) and where it steps aside (the torch form then runs).

Runs the Triton kernels under the interpreter on the CPU; ``tests/cuda/test_shared_cuda.py`` on a GPU.
"""

import pytest
import torch
from torch import nn

from helpers import EPS, count_torch_ops, rel_err, shared_expert_grads
from moeyard import MoE, MoEConfig
from moeyard.activations import Activation
from moeyard.kernel_op import interpreting
from moeyard.layer import SharedExpert
from moeyard.shared_triton import add_shared, fused_ready

pytestmark = pytest.mark.skipif(not interpreting(), reason="the fused form's kernels under Triton's interpreter")

H, I = 64, 48


@pytest.mark.parametrize("gate", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize("act", ["swiglu", "geglu", "relu2", "clamped_swiglu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 37])
def test_matches_float64(gate, act, dtype, T):
    torch.manual_seed(T)
    shared = SharedExpert(H, I, Activation(name=act), gate=gate, dtype=dtype)
    ref = SharedExpert(H, I, Activation(name=act), gate=gate, dtype=torch.float64)
    ref.load_state_dict({k: v.double() for k, v in shared.state_dict().items()})
    x, routed, dy = (torch.randn(T, H, dtype=dtype) for _ in range(3))
    assert fused_ready(shared, x, routed)
    fused = shared_expert_grads(shared, x, routed, dy, True)
    plain = shared_expert_grads(shared, x, routed, dy, False)
    exact = shared_expert_grads(ref, x.double(), routed.double(), dy.double(), False)
    names = ["sum", "dx", "d routed", "d gate_up", "d down"] + (["d gate"] if gate else [])
    assert len(fused) == len(names)
    for name, f, p, e in zip(names, fused, plain, exact, strict=True):
        assert f.dtype == dtype and f.shape == e.shape, name
        err, err_plain = rel_err(f, e), rel_err(p, e)
        assert err <= 2 * err_plain + EPS[dtype], (name, err, err_plain)


def test_no_tokens():
    shared = SharedExpert(H, I, Activation(), gate=True)
    x = torch.randn(0, H, requires_grad=True)
    y = add_shared(shared, x, torch.zeros(0, H))
    y.sum().backward()
    assert y.shape == (0, H) and x.grad.shape == (0, H)
    assert shared.gate.weight.grad.abs().sum() == 0


def test_leaves_its_inputs():
    """The caller's ``x`` is never written, nor ``routed`` unless asked (``inplace``, as ``MoE`` asks for its own
    routed output); even then a ``routed`` that is a view or a leaf requiring grad is left alone (a new tensor is
    returned)."""
    torch.manual_seed(0)
    shared = SharedExpert(H, I, Activation(), gate=True)
    x = torch.randn(9, H)
    x0 = x.clone()
    own = torch.randn(9, H)
    own0 = own.clone()
    expect = own + shared(x)
    out = add_shared(shared, x, own)
    assert out is not own and torch.equal(own, own0) and torch.equal(x, x0)
    torch.testing.assert_close(out, expect)
    base = torch.randn(9, 2 * H)
    view = base[:, :H]
    before = base.clone()
    out = add_shared(shared, x, view, inplace=True)
    assert torch.equal(base, before)
    torch.testing.assert_close(out, view + shared(x))
    leaf = torch.randn(9, H, requires_grad=True)
    leaf0 = leaf.detach().clone()
    out = add_shared(shared, x, leaf, inplace=True)
    assert torch.equal(leaf.detach(), leaf0) and out is not leaf
    assert add_shared(shared, x, own, inplace=True) is own
    torch.testing.assert_close(own, expect)


def test_frozen_weights_and_no_grad():
    """Frozen weights get no gradient (and their GEMMs are skipped); under ``torch.no_grad`` no graph is made."""
    torch.manual_seed(1)
    shared = SharedExpert(H, I, Activation(), gate=True).requires_grad_(False)
    x = torch.randn(5, H, requires_grad=True)
    routed = torch.randn(5, H)
    add_shared(shared, x, routed * 1).sum().backward()
    assert all(p.grad is None for p in shared.parameters())
    x2 = x.detach().requires_grad_()
    (routed + shared(x2)).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    with torch.no_grad():
        y = add_shared(shared, x, routed.clone())
    assert y.grad_fn is None
    torch.testing.assert_close(y, routed + shared(x).detach())


class _Sub(torch.Tensor):
    """A tensor subclass (as DTensor is): its ops may dispatch elsewhere."""


class _Wrapped(nn.Linear):
    """A subclass of ``nn.Linear`` (as PEFT's and quantisation wrappers are): its forward is not the weight's."""


@pytest.mark.parametrize(
    "change",
    ["custom activation", "subclass", "bias", "hook", "float64", "3-D x", "dtype mismatch", "tensor subclass"],
)
def test_steps_aside(change):
    shared = SharedExpert(H, I, Activation(), gate=True)
    x, routed = torch.randn(4, H), torch.randn(4, H)
    if change == "custom activation":
        shared.activation = Activation(name="custom", fn=lambda h: h[:, :I])
    elif change == "subclass":
        shared.down_proj = _Wrapped(I, H, bias=False)
    elif change == "bias":
        shared.gate_up_proj = nn.Linear(H, 2 * I)
    elif change == "hook":
        shared.gate.register_forward_hook(lambda m, i, o: o * 2)
    elif change == "float64":
        shared, x, routed = shared.double(), x.double(), routed.double()
    elif change == "3-D x":
        x, routed = x.view(2, 2, H), routed.view(2, 2, H)
    elif change == "dtype mismatch":
        routed = routed.bfloat16()
    elif change == "tensor subclass":  # as a DTensor weight of a sharded shared expert is
        shared.down_proj.weight = nn.Parameter(shared.down_proj.weight.detach().as_subclass(_Sub))
    assert not fused_ready(shared, x, routed)
    with pytest.raises(ValueError, match="fused_ready"):
        add_shared(shared, x, routed)
    if change != "dtype mismatch":  # the torch form then runs, hooks and wrappers included
        torch.testing.assert_close(shared.add_to(routed, x), routed + shared(x))


@pytest.mark.parametrize("gate", [True, False])
def test_layer_uses_it(gate, monkeypatch):
    """``MoE`` adds its shared experts through the fused form, with the same output and gradients as the torch
    form (``routed + shared(x)``), to rounding."""
    import moeyard.layer as layer

    cfg = MoEConfig(
        hidden_size=H,
        intermediate_size=32,
        num_experts=4,
        top_k=2,
        num_shared_experts=1,
        shared_intermediate_size=I,
        shared_expert_gate=gate,
    )
    torch.manual_seed(2)
    moe = MoE(cfg, backend="loop")
    x = torch.randn(2, 7, H)
    dy = torch.randn(2, 7, H)
    calls = []
    real = layer._add_shared
    monkeypatch.setattr(layer, "_add_shared", lambda *a, **k: calls.append(1) or real(*a, **k))

    def run():
        xx = x.clone().requires_grad_()
        for p in moe.parameters():
            p.grad = None
        moe(xx).backward(dy)
        return [xx.grad] + [p.grad for p in moe.parameters()]

    fused = run()
    assert calls
    monkeypatch.setattr(layer, "fused_ready", lambda *a: False)
    plain = run()
    for f, p in zip(fused, plain, strict=True):
        torch.testing.assert_close(f, p, rtol=1e-5, atol=1e-6)


def _torch_ops(fn) -> int:
    """The torch ops ``fn`` dispatches, outside the two Triton passes, views included."""
    from moeyard.quant import fp8_triton

    return count_torch_ops(fn, [(fp8_triton, "act_rows"), (fp8_triton, "act_backward")])


@pytest.mark.parametrize("gate", [True, False], ids=["gated", "plain"])
def test_host_ops(gate):
    """At few tokens the host sets the pace, and each torch op costs it 10-30 µs on a GPU machine: the fused form
    keeps its glue around the two Triton passes to a fixed budget of torch ops, views included (forward: the
    stacked weight, the gate_up GEMM and its views, the down GEMM; backward: four GEMMs and the views of the
    gradient buffer; autograd's own detaches of the saved inputs and the gradients counted too). 0.3.13's form took
    eight more a forward + backward with the gate (14 and 23 here: the logit's sigmoid and its gradient in torch
    ops, the zero columns and rows)."""
    torch.manual_seed(0)
    shared = SharedExpert(H, I, Activation(), gate=gate)
    x, routed, dy = torch.randn(8, H, requires_grad=True), torch.randn(8, H), torch.randn(8, H)
    add_shared(shared, x, routed).backward(dy)  # warm-up: the zero rows made once
    for t in (x, *shared.parameters()):
        t.grad = None  # the gradients then are assigned, not accumulated (no add_ counted)
    out = []
    fwd = _torch_ops(lambda: out.append(add_shared(shared, x, routed)))
    bwd = _torch_ops(lambda: out[0].backward(dy))
    budget = (12, 17) if gate else (9, 13)
    assert fwd <= budget[0] and bwd <= budget[1], (fwd, bwd)
