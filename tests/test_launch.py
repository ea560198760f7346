"""moeyard.launch: the direct launch path's key against Triton's own specialisation, and the path's behaviour
(hits, misses, fallbacks) with a stand-in for Triton's compile and launch, on the CPU."""

import itertools
import random

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from triton.runtime.jit import JITFunction  # noqa: E402

from moeyard import launch  # noqa: E402


def _probe(x_ptr, y_ptr, n, m, alpha, flag, B: tl.constexpr, C: tl.constexpr = 2):
    pass


def _binder(kernel):
    """Triton's own binder for ``kernel`` on an sm_90 target (no GPU needed), or a skip where this Triton
    lays its internals out otherwise."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import make_backend
        from triton.runtime.jit import create_function_from_signature

        backend = make_backend(GPUTarget("cuda", 90, 32))
        return create_function_from_signature(kernel.signature, kernel.params, backend)
    except (ImportError, AttributeError, TypeError) as e:  # pragma: no cover - another Triton layout
        pytest.skip(f"Triton's binder is not reachable here: {e}")


def _tensors():
    base = torch.empty(64, dtype=torch.float32)
    bf = torch.empty(64, dtype=torch.bfloat16)
    return [base, base[1:], base[4:], bf, bf[1:], bf[8:], torch.empty(64, dtype=torch.int32)]


def test_equal_keys_mean_equal_triton_specialisation():
    kernel = JITFunction(_probe)
    binder = _binder(kernel)
    state = launch._Compiled(kernel)
    ts = _tensors()
    ints = [1, 2, 16, 17, 32, 48, 2**31 - 1, 2**31, 2**31 + 16, -1, 0]
    rng = random.Random(0)
    combos = list(
        itertools.product(
            range(len(ts)), range(len(ts)), ints, ints, [0.5, 2.0], [True, False], [1, 4, True], [None, 2, 3]
        )
    )
    groups: dict = {}
    for xi, yi, n, m, alpha, flag, b, c in rng.sample(combos, 3000):
        args = (ts[xi], ts[yi], n, m, alpha, flag, b)
        kwargs = {} if c is None else {"C": c}
        _, spec, options = binder(*args, **kwargs)
        groups.setdefault(state.key(args, kwargs), set()).add((str(spec), str(sorted(options.items()))))
    assert all(len(specs) == 1 for specs in groups.values()), [s for s in groups.values() if len(s) > 1][:3]
    # and the key is not coarser than it need be: alignment and int values that Triton tells apart, apart
    assert len(groups) > 100


def test_descriptor_keys_mean_equal_triton_specialisation():
    from triton.tools.tensor_descriptor import TensorDescriptor

    def _desc(d_ptr, n, B: tl.constexpr):
        pass

    kernel = JITFunction(_desc)
    binder = _binder(kernel)
    state = launch._Compiled(kernel)
    groups: dict = {}
    for dtype, block, shape in itertools.product(
        (torch.bfloat16, torch.float32), ([16, 16], [16, 32], [32, 16]), ([64, 64], [64, 128], [128, 64])
    ):
        t = torch.empty(shape, dtype=dtype)
        for _ in range(2):
            d = TensorDescriptor(t, list(t.shape), list(t.stride()), block)
            args = (d, 8, 4)
            _, spec, options = binder(*args)
            groups.setdefault(state.key(args, {}), set()).add(str(spec))
            assert state.key(args, {}) == state.key(
                (TensorDescriptor(t, list(t.shape), list(t.stride()), block), 8, 4), {}
            )
    assert all(len(s) == 1 for s in groups.values()) and len(groups) == 18


class _Compiled:
    """Stands in for Triton's compiled kernel: records the direct launches."""

    function, packed_metadata = "function", "metadata"

    def __init__(self, fail: bool = False):
        self.launches, self.fail = [], fail

    def run(self, gx, gy, gz, stream, function, metadata, launch_metadata, enter, exit_, *values):
        if self.fail:
            raise TypeError("launcher arguments")
        self.launches.append(((gx, gy, gz), stream, function, metadata, values))


class _FakeJIT(JITFunction):
    """A JIT function whose Triton path only records the call (no compiler, no GPU)."""

    def __init__(self, fn, fail_direct: bool = False):
        super().__init__(fn)
        self.triton_calls, self.compiled, self.fail_direct = [], [], fail_direct

    def run(self, *args, grid, warmup, **kwargs):
        self.triton_calls.append((grid, args, kwargs))
        self.compiled.append(_Compiled(self.fail_direct))
        return self.compiled[-1]


@pytest.fixture
def direct(monkeypatch):
    monkeypatch.setattr(launch, "_device", lambda: 0)
    monkeypatch.setattr(launch, "_stream", lambda device: 1234)
    monkeypatch.setattr(launch, "_kernels", {})
    previous = launch.set_enabled(True)
    yield
    launch.set_enabled(previous)


def _kernel(x_ptr, n, alpha, B: tl.constexpr, C: tl.constexpr = 7):
    pass


def test_second_launch_goes_to_the_launcher_with_every_value_in_order(direct):
    k = _FakeJIT(_kernel)
    x = torch.empty(32)
    launch.run(k, (3,), (x, 5, 0.5), {"B": 16})
    assert len(k.triton_calls) == 1
    out = launch.run(k, (3, 2), (x, 5, 0.25), {"B": 16})  # another float: the same compiled kernel
    assert len(k.triton_calls) == 1 and out is k.compiled[0]
    (grid, stream, function, metadata, values) = k.compiled[0].launches[0]
    assert grid == (3, 2, 1) and stream == 1234 and (function, metadata) == ("function", "metadata")
    assert values == (x, 5, 0.25, 16, 7)  # positional, keyword, then the default
    seen = {}
    launch.run(k, lambda meta: seen.update(meta) or (9,), (x, 5, 0.25), {"B": 16})
    assert seen == {"x_ptr": x, "n": 5, "alpha": 0.25, "B": 16, "C": 7}
    assert k.compiled[0].launches[-1][0] == (9, 1, 1)


@pytest.mark.parametrize(
    "change",
    [
        lambda x: ((x[1:], 5, 0.5), {"B": 16}),  # 4-byte offset: no longer 16-byte aligned
        lambda x: ((x.to(torch.bfloat16), 5, 0.5), {"B": 16}),  # dtype
        lambda x: ((x, 6, 0.5), {"B": 16}),  # an int's value
        lambda x: ((x, 5, 0.5), {"B": 32}),  # a constexpr
        lambda x: ((x, 5, 0.5), {"B": 16, "C": 8}),  # a defaulted constexpr given
        lambda x: ((x, 5, 0.5), {"B": 16, "num_warps": 8}),  # a launch option
        lambda x: ((x, True, 0.5), {"B": 16}),  # a bool where an int was
        lambda x: ((x, 5, 0.5), {"B": True}),  # a constexpr True where an int was
    ],
)
def test_a_different_specialisation_goes_to_triton(direct, change):
    k = _FakeJIT(_kernel)
    x = torch.empty(32)
    launch.run(k, (1,), (x, 5, 0.5), {"B": 16})
    args, kwargs = change(x)
    launch.run(k, (1,), args, kwargs)
    assert len(k.triton_calls) == 2 and not k.compiled[0].launches
    launch.run(k, (1,), args, kwargs)  # and that one is kept in turn
    assert len(k.triton_calls) == 2 and len(k.compiled[1].launches) == 1


def test_triton_path_with_hooks_unhashable_args_disabled_or_another_kernel(direct):
    from triton import knobs

    k = _FakeJIT(_kernel)
    x = torch.empty(32)
    launch.run(k, (1,), (x, 5, 0.5), {"B": 16})
    hook = lambda metadata: None  # noqa: E731
    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):
        chain.add(hook)
        try:
            launch.run(k, (1,), (x, 5, 0.5), {"B": 16})
        finally:
            chain.remove(hook)
        assert len(k.triton_calls) == 2
    k.pre_run_hooks.append(lambda *a, **kw: None)
    launch.run(k, (1,), (x, 5, 0.5), {"B": 16})
    k.pre_run_hooks.clear()
    calls = len(k.triton_calls)
    launch.run(k, (1,), (x, [1], 0.5), {"B": 16})  # a list cannot be hashed
    launch.set_enabled(False)
    launch.run(k, (1,), (x, 5, 0.5), {"B": 16})
    launch.set_enabled(True)
    assert len(k.triton_calls) == calls + 2
    launch.run(k, (1,), (x, 5, 0.5), {"B": 16})
    assert len(k.triton_calls) == calls + 2  # direct again
    grids = []

    class Other:  # not a JIT function (e.g. the interpreter's): always its own path
        def __getitem__(self, grid):
            return lambda *args, **kwargs: grids.append((grid, args, kwargs))

    launch.run(Other(), (2,), (x,), {"B": 1})
    assert grids == [((2,), (x,), {"B": 1})]


def test_a_launcher_that_refuses_the_arguments_turns_the_path_off(direct):
    k = _FakeJIT(_kernel, fail_direct=True)
    x = torch.empty(32)
    launch.run(k, (1,), (x, 5, 0.5), {"B": 16})
    launch.run(k, (1,), (x, 5, 0.5), {"B": 16})
    assert not launch.enabled() and len(k.triton_calls) == 2


def test_a_full_cache_is_emptied(direct, monkeypatch):
    monkeypatch.setattr(launch, "MAX_ENTRIES", 2)
    k = _FakeJIT(_kernel)
    x = torch.empty(32)
    for n in (5, 6, 7):
        launch.run(k, (1,), (x, n, 0.5), {"B": 16})
    launch.run(k, (1,), (x, 7, 0.5), {"B": 16})  # kept after the clear
    launch.run(k, (1,), (x, 5, 0.5), {"B": 16})  # dropped by it
    assert len(k.triton_calls) == 4


def test_cached_wraps_a_kernel(direct):
    k = _FakeJIT(_kernel)
    wrapped = launch.cached(k)
    x = torch.empty(32)
    wrapped[(1,)](x, 5, 0.5, B=16)
    wrapped[(1,)](x, 5, 0.5, B=16)
    assert len(k.triton_calls) == 1 and len(k.compiled[0].launches) == 1
    assert wrapped.fn is _kernel and wrapped.arg_names == ["x_ptr", "n", "alpha", "B", "C"]
    before = launch.counts()
    wrapped[(1,)](x, 5, 0.5, B=16)
    assert launch.counts()["direct"] == before["direct"] + 1


def test_triton_path_while_torch_compile_traces(direct, monkeypatch):
    k = _FakeJIT(_kernel)
    x = torch.empty(32)
    launch.run(k, (1,), (x, 5, 0.5), {"B": 16})
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    launch.run(k, (1,), (x, 5, 0.5), {"B": 16})
    launch.cached(k)[(1,)](x, 5, 0.5, B=16)
    assert len(k.triton_calls) == 3 and not k.compiled[0].launches


def test_triton_path_without_cuda(monkeypatch):
    # no CUDA device (a CPU build of torch, another GPU backend's Triton): Triton's own path, nothing cached
    monkeypatch.setattr(launch, "_has_cuda", [False])
    monkeypatch.setattr(launch, "_kernels", {})
    previous = launch.set_enabled(True)
    try:
        k = _FakeJIT(_kernel)
        x = torch.empty(32)
        for _ in range(2):
            launch.run(k, (1,), (x, 5, 0.5), {"B": 16})
    finally:
        launch.set_enabled(previous)
    assert len(k.triton_calls) == 2 and not launch._kernels


def test_host_cdiv_and_next_power_of_2_equal_tritons():
    # the host-side helpers the launches size their grids with: Triton's values (its own are constexpr functions,
    # microseconds a call on the host)
    for n in [*range(0, 2100), 2**31 - 1, 2**31, 2**40 + 5]:
        assert launch.next_power_of_2(n) == triton.next_power_of_2(n)
        for d in (1, 3, 16, 128, 1000):
            assert launch.cdiv(n, d) == triton.cdiv(n, d)
