"""moeyard.kernel_op: eager calls skip the dispatcher, torch.compile sees the registered op."""

import torch

from moeyard.kernel_op import KernelOp, kernel_op

CALLS = []


@kernel_op("moeyard_test::scale_into", mutates_args=("out",))
def scale_into(x: torch.Tensor, s: float, out: torch.Tensor) -> None:
    """out = s * x"""
    CALLS.append(torch.compiler.is_compiling())
    out.copy_(x * s)


@scale_into.register_fake
def _(x, s, out):
    return None


def test_eager_calls_the_launcher_directly():
    x, out = torch.randn(5), torch.empty(5)
    CALLS.clear()
    with torch.profiler.profile() as prof:  # the dispatcher records a called op as an event of its name
        scale_into(x, 2.0, out)
    assert torch.equal(out, 2 * x)
    assert CALLS == [False]
    assert not [e for e in prof.events() if "scale_into" in e.name]
    assert isinstance(scale_into, KernelOp) and scale_into.__doc__ == "out = s * x"


def test_compiled_graph_holds_the_op():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(x):
        out = torch.empty_like(x)
        scale_into(x, 3.0, out)
        return out + 1

    x = torch.randn(6)
    got = torch.compile(f, backend=backend, fullgraph=True)(x)
    assert torch.equal(got, 3 * x + 1)
    targets = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert any("scale_into" in t for t in targets), targets


def test_opcheck_of_the_registered_op():
    torch.library.opcheck(scale_into.op, (torch.randn(4), 0.5, torch.empty(4)))
