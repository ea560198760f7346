"""Shared test utilities: random expert weights and routing, the float64 ``loop`` oracle, and the
error-versus-reference judgement.

Legend: T tokens, H hidden size, I expert intermediate size, N1 = 2I (gated) or I, E experts, K top-k.

How low precision is judged (QuACK's rule): a backend run in ``dtype`` is compared with the float64
``loop`` oracle, and so is PyTorch's own computation in ``dtype`` (the ``loop`` backend run in that
dtype). The backend passes when ``err(backend) <= 2 * err(torch in dtype) + EPS[dtype]``, with ``err``
the largest absolute difference divided by the largest absolute value of the oracle.
"""

from __future__ import annotations

import importlib.util
import math
import pathlib
import sys

import torch

import moeyard

Tensor = torch.Tensor

# The additive slack of the rule above, per dtype, relative to the largest oracle value. It covers a
# reference that happens to be nearly exact on a tiny case (err(torch) ~ 0) while the backend rounds in
# another order: float64 and float32 ~16 units of roundoff (2^-53, 2^-24). bfloat16: two units (2^-7);
# one unit (3.9e-3) was too tight because the grouped backends round to bfloat16 at points the loop
# reference does not (the GEMM output before the bias add, each pair before the top-k sum), and on a
# small case where the reference's largest error is below one unit (test_activations[swiglu-bias-
# grouped_mm-bfloat16]: 0.0025) the backend's largest element was 2.4 units off. float16: the same two
# units (2^-10). Never loosen without writing down why.
EPS = {
    torch.float64: 2e-15,
    torch.float32: 1e-6,
    torch.bfloat16: 8e-3,
    torch.float16: 1e-3,
}

GATED = ("swiglu", "geglu", "reglu", "clamped_swiglu")
PLAIN = ("gelu", "relu", "relu2", "silu")


def cpu_backends(dtype: torch.dtype, device: str = "cpu") -> list[str]:
    """Every registered backend that runs on ``device`` in ``dtype``, except the ``loop`` oracle."""
    return [b for b in moeyard.available_backends(device, dtype) if b != "loop"]


def nan_fill_empty(monkeypatch) -> None:
    """Make ``torch.empty``/``empty_like`` return NaN-filled floats, so reads of rows a kernel never
    wrote show up as NaN (FLA's conftest trick)."""
    empty, empty_like = torch.empty, torch.empty_like

    def nan_empty(*args, **kw):
        t = empty(*args, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def nan_empty_like(*args, **kw):
        t = empty_like(*args, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    monkeypatch.setattr(torch, "empty_like", nan_empty_like)


def random_ids(T: int, K: int, E: int, *, experts: list[int] | None = None, generator=None) -> Tensor:
    """``[T, K]`` int64 ids, distinct within a token, drawn uniformly from ``experts`` (default all)."""
    pool = torch.tensor(experts if experts is not None else list(range(E)), dtype=torch.int64)
    if T == 0:
        return torch.empty(0, K, dtype=torch.int64)
    order = torch.rand(T, len(pool), generator=generator).argsort(dim=1)[:, :K]
    return pool[order]


def make_inputs(
    T: int,
    H: int,
    I: int,
    E: int,
    K: int,
    *,
    gated: bool = True,
    bias: bool = False,
    transposed: bool = False,
    ids: Tensor | None = None,
) -> dict[str, Tensor]:
    """Fresh random float64 inputs for :func:`moeyard.experts` (outputs of order 1)."""
    n1 = 2 * I if gated else I
    up = torch.randn(E, n1, H, dtype=torch.float64) / math.sqrt(H)
    down = torch.randn(E, H, I, dtype=torch.float64) / math.sqrt(I)
    if transposed:
        up, down = up.mT.contiguous(), down.mT.contiguous()
    inp = {
        "hidden_states": torch.randn(T, H, dtype=torch.float64),
        "topk_ids": random_ids(T, K, E) if ids is None else ids,
        "topk_weights": torch.rand(T, K, dtype=torch.float64) + 0.1,
        "gate_up_proj": up,
        "down_proj": down,
    }
    if bias:
        inp["gate_up_bias"] = torch.randn(E, n1, dtype=torch.float64) * 0.5
        inp["down_bias"] = torch.randn(E, H, dtype=torch.float64) * 0.5
    return inp


def cast(inputs: dict[str, Tensor], dtype: torch.dtype, device: str | torch.device = "cpu") -> dict[str, Tensor]:
    """Float tensors to ``dtype`` (and ``device``); ids unchanged apart from the device."""
    return {k: (v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device)) for k, v in inputs.items()}


LORA_SCALING = {"gate_up_proj": 0.5, "down_proj": 2.0}


def add_lora(
    inputs: dict[str, Tensor], rank: int, *, projections=("gate_up_proj", "down_proj"), gated: bool = True
) -> dict[str, Tensor]:
    """Random float64 LoRA factors in PEFT's layout (``<proj>.lora_A [r*E, in]``, ``<proj>.lora_B
    [out, r*E]``) added to ``inputs``; the LoRA term is of the order of the base output."""
    H = inputs["hidden_states"].shape[1]
    E, I = inputs["down_proj"].shape[0], inputs["down_proj"].numel() // (inputs["down_proj"].shape[0] * H)
    n1 = 2 * I if gated else I
    sizes = {"gate_up_proj": (H, n1), "down_proj": (I, H)}
    out = dict(inputs)
    for name in projections:
        inp, o = sizes[name]
        out[f"{name}.lora_A"] = torch.randn(rank * E, inp, dtype=torch.float64) / math.sqrt(inp)
        out[f"{name}.lora_B"] = torch.randn(o, rank * E, dtype=torch.float64) / math.sqrt(rank)
    return out


def lora_arg(leaves: dict[str, Tensor]) -> dict | None:
    """The ``lora=`` argument of :func:`moeyard.experts` built from ``<proj>.lora_A/B`` entries."""
    lora = {
        name: moeyard.ExpertLoRA(
            lora_A=leaves[f"{name}.lora_A"], lora_B=leaves[f"{name}.lora_B"], scaling=LORA_SCALING[name]
        )
        for name in LORA_SCALING
        if f"{name}.lora_A" in leaves
    }
    return lora or None


def run_experts(
    inputs: dict[str, Tensor],
    dtype: torch.dtype,
    backend: str,
    grad_out: Tensor,
    *,
    device: str | torch.device = "cpu",
    x_transform=None,
    frozen=(),
    **kw,
) -> dict[str, Tensor]:
    """Forward and backward of :func:`moeyard.experts` in ``dtype``.

    Returns ``{"out": ..., "grad_<name>": ...}`` for every floating input, all as float64 on the CPU.
    ``x_transform`` maps the (leaf) hidden states before the call, e.g. to make them non-contiguous.
    Inputs named ``<proj>.lora_A/B`` become the ``lora=`` argument; names in ``frozen`` do not
    require grad (their gradient must stay None).
    """
    leaves = {
        k: v.detach().to(device=device, dtype=dtype, copy=True).requires_grad_(k not in frozen)
        for k, v in inputs.items()
        if v.is_floating_point()
    }
    ids = inputs["topk_ids"].to(device)
    x = leaves["hidden_states"]
    if x_transform is not None:
        x = x_transform(x)
    args = {
        k: v
        for k, v in leaves.items()
        if k not in ("hidden_states", "topk_weights", "gate_up_proj", "down_proj") and ".lora_" not in k
    }
    if lora_arg(leaves) is not None:
        args["lora"] = lora_arg(leaves)
    out = moeyard.experts(
        x, ids, leaves["topk_weights"], leaves["gate_up_proj"], leaves["down_proj"], backend=backend, **args, **kw
    )
    assert out.dtype == dtype and out.shape == x.shape
    res = {"out": out.detach().double().cpu()}
    if out.numel():
        out.backward(grad_out.to(device=device, dtype=dtype))
    for k, v in leaves.items():
        if k in frozen:
            assert v.grad is None, f"{k} is frozen but got a gradient"
            continue
        g = v.grad if v.grad is not None else torch.zeros_like(v)
        res[f"grad_{k}"] = g.double().cpu()
    return res


def rel_err(a: Tensor, ref: Tensor) -> float:
    """Largest absolute difference over the largest absolute reference value (0 for empty tensors)."""
    if ref.numel() == 0:
        return 0.0
    assert a.shape == ref.shape, (a.shape, ref.shape)
    scale = ref.abs().max().item()
    diff = (a.double() - ref.double()).abs().max().item()
    if math.isnan(diff):
        return math.inf
    return diff / scale if scale > 0 else diff


def assert_matches_oracle(
    got: dict[str, Tensor], lowp: dict[str, Tensor], oracle: dict[str, Tensor], dtype: torch.dtype, what: str = ""
) -> None:
    """For every key: ``err(got) <= 2 * err(lowp) + EPS[dtype]`` against ``oracle`` (module docstring)."""
    assert set(got) == set(oracle), (sorted(got), sorted(oracle))
    for k in oracle:
        e_got, e_ref = rel_err(got[k], oracle[k]), rel_err(lowp[k], oracle[k])
        bound = 2 * e_ref + EPS[dtype]
        assert e_got <= bound, f"{what} {k} in {dtype}: err {e_got:.3g} > 2 * {e_ref:.3g} + {EPS[dtype]:g}"


def check_backend(
    backend: str, inputs: dict[str, Tensor], dtype: torch.dtype, *, device: str | torch.device = "cpu", **kw
) -> dict[str, Tensor]:
    """Run ``backend`` in ``dtype`` on ``device``, the ``loop`` backend in ``dtype`` on ``device`` and in
    float64 on the CPU (the oracle), and judge the output and every gradient. Returns the backend's
    results (float64, CPU)."""
    T, H = inputs["hidden_states"].shape
    grad_out = torch.randn(T, H, dtype=torch.float64)
    oracle = run_experts(inputs, torch.float64, "loop", grad_out, **kw)
    lowp = run_experts(inputs, dtype, "loop", grad_out, device=device, **kw)
    got = run_experts(inputs, dtype, backend, grad_out, device=device, **kw)
    assert_matches_oracle(got, lowp, oracle, dtype, what=backend)
    return got


def clones(d: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.clone() for k, v in d.items()}


def assert_unchanged(before: dict[str, Tensor], after: dict[str, Tensor]) -> None:
    for k in before:
        assert torch.equal(before[k], after[k]), f"{k} was modified"


def bnb_dequantize(storage) -> Tensor:
    """bitsandbytes' ``dequantize_4bit`` of an NF4 storage, viewed flat as ``[n / blocksize, blocksize]``
    (bitsandbytes 0.50's CPU kernel applies the block scales per row when the last dimension is not
    a multiple of the blocksize; its flat view is exact: tests/test_nf4.py)."""
    import bitsandbytes.functional as F

    qs = storage.quant_state()
    qs.shape = torch.Size((storage.shape.numel() // storage.blocksize, storage.blocksize))
    return F.dequantize_4bit(storage.data, qs).view(storage.shape)


def load_benchmark(name: str):
    """The module ``benchmarks/<name>.py`` (scripts, not a package), imported once per call and
    registered in ``sys.modules`` (dataclasses look their module up there)."""
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def check_fill_invalid(T: int, H: int, weights: bool, device: str, dtype: torch.dtype, E: int = 4) -> None:
    """The ``triton`` backend's in-place combine at K = 1 (``ops.fill_invalid_``) on ``y [T, H]``: invalid ids
    (below 0, at and past E) in the first and last block of rows only, so the blocks between have none (and
    return early). Valid rows stay bit-equal (a NaN row stays NaN: nothing wrote it); invalid rows get 0, or
    ``w * 0`` with ``weights`` (NaN for a NaN weight)."""
    from moeyard.experts.triton import ops

    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, E, (T, 1), generator=g)
    ids[3], ids[7], ids[T - 1] = -1, E, E + 2
    y = torch.randn(T, H, generator=g)
    y[5] = float("nan")
    bad = (ids[:, 0] < 0) | (ids[:, 0] >= E)
    y[bad] = float("nan")
    tw = torch.rand(T, 1, generator=g)
    tw[7] = float("nan")
    y, ids, tw = y.to(device, dtype), ids.to(device), tw.to(device, dtype)
    before = y.clone()
    ops.fill_invalid_(ids, tw if weights else None, E, y)
    y, before, tw, bad = y.cpu(), before.cpu(), tw.cpu(), bad.cpu()
    assert torch.equal(y[~bad].isnan(), before[~bad].isnan())
    assert torch.equal(torch.nan_to_num(y[~bad]), torch.nan_to_num(before[~bad]))
    want = (tw[bad] * 0.0).expand(-1, H) if weights else torch.zeros(int(bad.sum()), H, dtype=dtype)
    assert torch.equal(y[bad].isnan(), want.isnan())
    assert torch.equal(torch.nan_to_num(y[bad]), torch.nan_to_num(want))
    assert bool(y[7].isnan().all()) == weights


def shared_expert_grads(shared, x: Tensor, routed: Tensor, dy: Tensor, fused: bool) -> list[Tensor]:
    """``[sum, dx, d routed, d weights...]`` of ``routed + shared(x)`` for a ``moeyard.layer.SharedExpert``, from
    fresh leaves: by its fused form (``moeyard.shared_triton.add_shared``, written over the routed tensor as
    ``MoE`` has it) or by the torch form."""
    from moeyard.shared_triton import add_shared

    x = x.detach().requires_grad_()
    r0 = routed.detach().requires_grad_()
    for p in shared.parameters():
        p.grad = None
    r = r0 * 1  # a tensor of its own, as the routed experts' output is
    y = add_shared(shared, x, r, inplace=True) if fused else r + shared(x)
    y.backward(dy)
    return [y.detach(), x.grad, r0.grad] + [p.grad for p in shared.parameters()]


def count_torch_ops(fn, paused: list[tuple[object, str]]) -> int:
    """The torch ops ``fn()`` dispatches, views and allocations included, outside the calls of
    ``getattr(module, name)`` for each ``(module, name)`` in ``paused`` (kernel launchers, whose launches the
    interpreter runs through torch ops of its own): the host's glue around them."""
    import pytest
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n, paused = 0, False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += not Count.paused
            return func(*args, **(kwargs or {}))

    def pause(real):
        def run(*a, **k):
            Count.paused = True
            try:
                return real(*a, **k)
            finally:
                Count.paused = False

        return run

    with pytest.MonkeyPatch.context() as mp:
        for module, name in paused:
            mp.setattr(module, name, pause(getattr(module, name)))
        with Count():
            fn()
    return Count.n
