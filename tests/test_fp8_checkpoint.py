"""FP8 expert storage with 128 x 128 block scales (``moeyard.quant.FP8BlockExperts``, the DeepSeek-V3 /
Qwen3-FP8 checkpoint format) and FP8 checkpoints of transformers models.

The storage equals the reference casts of :mod:`moeyard.quant.fp8` (``quantize`` / ``dequantize`` with
``Blocks(128, 128)``, scale mode ``"float"``), its dequantisation (torch path, Triton kernel under the
interpreter) equals that reference bit for bit for the active experts only; every CPU backend on the
storage gives what it gives on the dequantised weights (exactly) and matches the float64 ``loop``
oracle; quantize_experts on moeyard and transformers models (PEFT-wrapped too, every layout), the
state dict round trip, the errors; then a tiny Qwen3-MoE written as an FP8 checkpoint (safetensors,
hub layout) and loaded with :func:`moeyard.quant.load_fp8_checkpoint`: logits and greedy decoding
against transformers' own (dequantising) load of the same checkpoint, and LoRA training on top.
"""

import gc
import json
import os
import pathlib
import re
import weakref
from typing import NamedTuple

import pytest
import torch

import moeyard
from helpers import EPS, LORA_SCALING, add_lora, cpu_backends, make_inputs, random_ids, rel_err
from moeyard.quant import FP8BlockExperts, fp8_block, fp8_block_grid, load_quantized_state_dict, quantize_experts
from moeyard.quant.fp8 import Blocks, dequantize, quantize

BLOCKS = Blocks(128, 128)
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
NAMES = ("gate_up_proj", "down_proj")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
triton_only = pytest.mark.skipif(
    not (INTERPRET or torch.cuda.is_available()), reason="the Triton kernel runs on CUDA or under TRITON_INTERPRET=1"
)


def weights(shape, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 0.05).to(device=device, dtype=dtype)


def nan_out(s):
    return torch.full(s.shape, float("nan"), dtype=s.dtype, device=s.device)


# ---------------------------------------------------------------- the stored state against the reference

SHAPES = [
    (3, 200, 300),  # partial last blocks in both axes (rows 128 + 72, columns 128 + 128 + 44)
    (2, 256, 128),  # whole blocks only
    (5, 7, 130),  # fewer rows than a block; one column past a block
    (1, 1, 1),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_storage_equals_reference(shape, dtype):
    w = weights(shape, dtype)
    w[0, :, :3] *= 100  # an outlier column: its blocks get their own, larger scales
    s = FP8BlockExperts.from_float(w)
    q, scale = quantize(w, BLOCKS, "float")
    E, a, b = shape
    assert s.weight.dtype == torch.float8_e4m3fn and s.weight_scale_inv.dtype == torch.float32
    assert tuple(s.weight_scale_inv.shape) == (E, -(-a // 128), -(-b // 128))
    assert torch.equal(s.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s.weight_scale_inv, scale)
    amax = torch.stack(
        [
            w[e, i : i + 128, j : j + 128].abs().max().float()
            for e in range(E)
            for i in range(0, a, 128)
            for j in range(0, b, 128)
        ]
    ).view_as(scale)
    assert torch.equal(scale, amax / 448)  # DeepSeek-V3's scale: the block's amax over e4m3's largest value
    want = dequantize(q, scale, BLOCKS).to(dtype)  # float32 product, then the compute dtype
    assert s.dtype == dtype and torch.equal(s.dequantize(), want)
    assert torch.equal(fp8_block.dequantize_reference(s).float(), dequantize(q, scale, BLOCKS))
    rel = ((s.dequantize().double() - w.double()).abs().max() / w.double().abs().max()).item()
    assert rel < 2**-4  # e4m3 keeps 3 mantissa bits: at most half a unit (1/16) of the block's largest value


def test_zero_and_nan_blocks():
    w = weights((2, 130, 260))
    w[0, :128, :128] = 0  # a block of zeros: scale 1, values 0
    w[1, 128:, 256:] = float("nan")  # a NaN: its block dequantises to NaN, never a finite value
    s = FP8BlockExperts.from_float(w)
    assert s.weight_scale_inv[0, 0, 0] == 1 and not s.dequantize()[0, :128, :128].any()
    d = s.dequantize()
    assert d[1, 128:, 256:].isnan().all() and not d[1, :128].isnan().any()


@pytest.mark.parametrize("chunk", [None, 144 * 200])
def test_row_segments_gate_and_up_blocked_separately(chunk, monkeypatch):
    if chunk:
        monkeypatch.setattr(fp8_block, "TORCH_CHUNK", chunk)  # one expert per step of the cast
    I = 72  # gate and up rows [0, 72) and [72, 144): separately blocked, as a checkpoint's gate_proj and up_proj
    w = weights((3, 2 * I, 200))
    s = FP8BlockExperts.from_float(w, row_segments=(I, I))
    assert s.row_segments == (I, I) and tuple(s.weight_scale_inv.shape) == (3, 2, 2)
    halves = [quantize(w[:, :I], BLOCKS, "float"), quantize(w[:, I:], BLOCKS, "float")]
    assert torch.equal(s.weight.view(torch.uint8), torch.cat([h[0] for h in halves], 1).view(torch.uint8))
    assert torch.equal(s.dequantize(), torch.cat([dequantize(*h, BLOCKS) for h in halves], 1))
    assert torch.equal(fp8_block.dequantize_reference(s).float(), s.dequantize())
    # segments on 128-row bounds are the plain grid, stored as such
    assert FP8BlockExperts.from_float(weights((2, 256, 64)), row_segments=(128, 128)).row_segments == (256,)
    assert fp8_block_grid.infer_row_segments((3, 144, 200), (3, 2, 2), gated=True) == (I, I)
    assert fp8_block_grid.infer_row_segments((3, 144, 200), (3, 2, 2), gated=False) == (144,)  # ceil(144/128) = 2 too
    assert fp8_block_grid.infer_row_segments((3, 384, 64), (3, 3, 1), gated=True) == (384,)  # the halves' grid: 4 rows
    assert fp8_block_grid.infer_row_segments((3, 400, 64), (3, 4, 1), gated=True) == (200, 200)


def check_selective(s, dequant):
    """``dequant(storage, active, out)`` writes exactly the active experts and nothing else; with
    ``zero_inactive=True`` it zeroes the others (a fresh output from ``torch.empty``)."""
    E = s.shape[0]
    want = s.dequantize()
    for active in (
        torch.tensor([i % 3 == 1 for i in range(E)]),
        torch.arange(E) % 2 * 5,  # bool, counts
        torch.zeros(E, dtype=torch.bool),
        torch.ones(E, dtype=torch.int32),
    ):
        out = nan_out(s)
        dequant(s, active, out)
        on = active > 0
        assert torch.equal(out[on], want[on]) and out[~on].isnan().all()
        out = nan_out(s)
        dequant(s, active, out, zero_inactive=True)
        assert torch.equal(out[on], want[on]) and (out[~on] == 0).all()
    out = nan_out(s)
    dequant(s, None, out)
    assert torch.equal(out, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selective_torch(dtype, monkeypatch):
    s = FP8BlockExperts.from_float(weights((7, 140, 150), dtype), row_segments=(70, 70))
    check_selective(s, fp8_block.dequantize_torch)
    fresh = s.dequantize(torch.tensor([0, 1, 0, 0, 0, 0, 2]))
    assert not fresh[0].any() and torch.equal(fresh[6], s.dequantize()[6])  # a new buffer: inactive rows zero
    monkeypatch.setattr(fp8_block, "TORCH_CHUNK", 140 * 150 * 2)  # two experts per step: the chunk loop
    check_selective(s, fp8_block.dequantize_torch)


@triton_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,segments", [((3, 200, 300), None), ((5, 7, 130), None), ((2, 144, 40), (72, 72))])
def test_triton_kernel(dtype, shape, segments):
    pytest.importorskip("triton")
    from moeyard.quant.triton_fp8_block import dequantize_triton

    w = weights(shape, dtype)
    w[0, 0, 0] = float("nan")
    s = FP8BlockExperts.from_float(w, row_segments=segments)
    s.weight.view(torch.uint8)[1, 0, :2] = torch.tensor([0x7F, 0xFF], dtype=torch.uint8)  # e4m3fn's NaNs
    ref = fp8_block.dequantize_reference(s).float().to(dtype)
    torch.testing.assert_close(s.dequantize(), ref, rtol=0, atol=0, equal_nan=True)
    out = nan_out(s)
    dequantize_triton(s, None, out)
    torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True)
    assert out[1, 0, :2].isnan().all()


@triton_only
def test_triton_kernel_selective():
    pytest.importorskip("triton")
    from moeyard.quant.triton_fp8_block import dequantize_triton

    check_selective(FP8BlockExperts.from_float(weights((7, 40, 150), torch.bfloat16)), dequantize_triton)


# ---------------------------------------------------------------- memory, dtype casts, adopting tensors


def test_memory():
    w = weights((8, 256, 512), torch.bfloat16)
    s = FP8BlockExperts.from_float(w)
    stored = sum(t.numel() * t.element_size() for t in s.state_dict().values())
    assert s.memory_bytes() == s.nbytes == stored == 8 * 256 * 512 + 4 * 8 * 2 * 4
    assert stored <= 0.51 * w.numel() * w.element_size()


def test_module_casts_keep_storage():
    s = FP8BlockExperts.from_float(weights((3, 32, 64)))
    before = {k: v.clone() for k, v in s.state_dict().items()}
    s.to(torch.bfloat16)
    assert s.dtype == torch.bfloat16 and s.dequantize().dtype == torch.bfloat16
    s.half()
    assert s.dtype == torch.float16
    s.double()
    assert s.dtype == torch.float64
    s.to("cpu").float()
    assert s.dtype == torch.float32
    after = s.state_dict()
    assert set(after) == {"weight", "weight_scale_inv"}
    assert all(
        torch.equal(
            v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v,
            before[k].view(torch.uint8) if v.dtype == torch.float8_e4m3fn else before[k],
        )
        and v.dtype == before[k].dtype
        for k, v in after.items()
    )


def test_from_fp8_adopts_without_copy():
    ref = FP8BlockExperts.from_float(weights((4, 130, 64)))
    s = FP8BlockExperts.from_fp8(ref.weight, ref.weight_scale_inv.double(), dtype=torch.bfloat16)  # scales to float32
    assert s.weight.data_ptr() == ref.weight.data_ptr() and s.dtype == torch.bfloat16
    assert torch.equal(s.dequantize(), ref.dequantize().bfloat16())


# ---------------------------------------------------------------- the routed FFN on FP8 storage


def _run(x, ids, tw, up, down, lora, backend, **kw):
    leaves = [x, tw] + [t for a in (lora or {}).values() for t in (a.lora_A, a.lora_B)]
    out = moeyard.experts(x, ids, tw, up, down, backend=backend, lora=lora, **kw)
    g = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    return [out, *torch.autograd.grad(out, leaves, g, allow_unused=True)] if out.requires_grad else [out]


def _case(T, H, I, E, K, *, ids=None, dtype=torch.float32, rank=0, transposed=False):
    inp = make_inputs(T, H, I, E, K, ids=ids, transposed=transposed)
    if rank:
        inp = add_lora(inp, rank)
    f = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inp.items()}
    x = f["hidden_states"].requires_grad_()
    tw = f["topk_weights"].requires_grad_()
    lora = (
        {
            n: moeyard.ExpertLoRA(
                lora_A=f[f"{n}.lora_A"].requires_grad_(),
                lora_B=f[f"{n}.lora_B"].requires_grad_(),
                scaling=LORA_SCALING[n],
            )
            for n in NAMES
        }
        if rank
        else None
    )
    q = [FP8BlockExperts.from_float(f[n]) for n in NAMES]
    return x, inp["topk_ids"], tw, q, lora


def _double(x, tw, lora):
    """Fresh float64 leaves (the oracle's inputs)."""
    lo = (
        None
        if lora is None
        else {
            n: moeyard.ExpertLoRA(
                lora_A=a.lora_A.detach().double().requires_grad_(),
                lora_B=a.lora_B.detach().double().requires_grad_(),
                scaling=a.scaling,
            )
            for n, a in lora.items()
        }
    )
    return x.detach().double().requires_grad_(), tw.detach().double().requires_grad_(), lo


CASES = [
    # (T, H, I, E, K, ids): code paths
    (23, 144, 40, 5, 2, None),  # H past one block (128 + 16): two scale columns per row of gate_up
    (30, 64, 72, 5, 2, "one_expert"),  # every token to experts 0 and 1; 2I = 144 rows: two scale rows
    (1, 48, 24, 4, 4, None),  # T = 1, K = E
    (0, 64, 32, 4, 2, None),  # no tokens: nothing dequantised, nothing hangs
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H,I,E,K,ids", CASES)
def test_every_backend_equals_dequantised_weights_and_oracle(T, H, I, E, K, ids, dtype):
    routed = torch.stack([torch.arange(K)] * T) if ids == "one_expert" else random_ids(T, K, E)
    x, ids, tw, q, lora = _case(T, H, I, E, K, ids=routed, dtype=dtype, rank=8)
    dense = [s.dequantize() for s in q]
    xd, twd, lorad = _double(x, tw, lora)
    oracle = _run(xd, ids, twd, *(fp8_block.dequantize_reference(s) for s in q), lorad, "loop")
    lowp = _run(x, ids, tw, *dense, lora, "loop")
    for backend in cpu_backends(dtype):
        if backend == "triton" and (T > 1 or dtype != torch.float32):
            continue  # the interpreter is slow: the triton backend runs the T = 1 case
        got = _run(x, ids, tw, *q, lora, backend)
        want = _run(x, ids, tw, *dense, lora, backend)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w), backend  # the same call on the same dense values
        for g, lp, o in zip(got, lowp, oracle, strict=True):
            assert rel_err(g, o) <= 2 * rel_err(lp, o) + EPS[dtype], backend


def test_gpt_oss_layout():
    """Transposed ``[E, H, 2I]`` / ``[E, I, H]`` stacks (interleaved gate/up columns) are stored as they are."""
    x, ids, tw, q, lora = _case(20, 144, 40, 4, 2, rank=8, transposed=True)
    assert q[0].row_segments == (144,) and tuple(q[0].weight_scale_inv.shape) == (4, 2, 1)
    kw = dict(transposed=True, interleaved=True, activation="clamped_swiglu")
    for backend in ("bmm_padded", "grouped_mm"):
        got = _run(x, ids, tw, *q, lora, backend, **kw)
        want = _run(x, ids, tw, *(s.dequantize() for s in q), lora, backend, **kw)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_only_active_experts_and_no_dense_weight_kept(monkeypatch):
    x, _, tw, q, lora = _case(24, 64, 32, 6, 2, rank=4)
    ids = torch.stack([torch.tensor([1, 4])] * 24)  # experts 1 and 4 only
    calls, alive = [], []
    real = FP8BlockExperts.dequantize

    def spy(self, active=None, *, out=None):
        calls.append(active.clone())
        d = real(self, active, out=out)
        alive.append(weakref.ref(d))
        return d

    monkeypatch.setattr(FP8BlockExperts, "dequantize", spy)
    out = moeyard.experts(x, ids, tw, *q, backend="grouped_mm", lora=lora)
    gc.collect()
    assert len(calls) == 2 and all(a.tolist() == [False, True, False, False, True, False] for a in calls)
    assert all(r() is None for r in alive), "autograd keeps a dequantised weight alive until backward"
    out.sum().backward()
    assert len(calls) == 4  # backward dequantised each weight once more, the same experts
    assert lora["gate_up_proj"].lora_A.grad is not None and x.grad is not None


# ---------------------------------------------------------------- quantize_experts on models


def check_quantized(owner, attr, original, segments=None):
    s = getattr(owner, attr)
    assert isinstance(s, FP8BlockExperts) and attr not in owner._parameters and s.shape == original.shape
    assert s.dtype == original.dtype
    ref = FP8BlockExperts.from_float(original, row_segments=segments)
    assert torch.equal(s.weight.view(torch.uint8), ref.weight.view(torch.uint8))
    assert torch.equal(s.weight_scale_inv, ref.weight_scale_inv) and torch.equal(s.dequantize(), ref.dequantize())


def test_quantize_moe_layer():
    cfg = moeyard.MoEConfig(num_experts=5, hidden_size=32, intermediate_size=80, top_k=2, expert_bias=True)
    moe = moeyard.MoE(cfg, backend="loop").to(torch.bfloat16)
    up, down = moe.gate_up_proj.detach().clone(), moe.down_proj.detach().clone()
    assert quantize_experts(moe, "fp8_block") is moe
    check_quantized(moe, "gate_up_proj", up, segments=(80, 80))  # gate and up rows blocked separately
    check_quantized(moe, "down_proj", down)
    assert tuple(moe.gate_up_proj.weight_scale_inv.shape) == (5, 2, 1)
    names = {n for n, _ in moe.named_parameters()}
    assert "gate_up_proj_bias" in names and not names & {"gate_up_proj", "down_proj"}
    plain = moeyard.MoE(
        moeyard.MoEConfig(num_experts=2, hidden_size=32, intermediate_size=80, top_k=1, activation="gelu")
    )
    quantize_experts(plain, "fp8_block")  # a plain activation: up_proj rows are one segment
    assert plain.gate_up_proj.row_segments == (80,)


def test_moe_layer_lora_on_fp8_base():
    cfg = moeyard.MoEConfig(num_experts=4, hidden_size=64, intermediate_size=32, top_k=2)
    torch.manual_seed(0)
    layer = moeyard.MoE(cfg, backend="bmm_padded")
    dense = moeyard.MoE(cfg, backend="bmm_padded")
    dense.load_state_dict(layer.state_dict())
    quantize_experts(layer, "fp8_block")
    with torch.no_grad():
        dense.gate_up_proj.copy_(layer.gate_up_proj.dequantize())
        dense.down_proj.copy_(layer.down_proj.dequantize())
    for m in (layer, dense):
        torch.manual_seed(1)
        m.add_lora(4)
        torch.nn.init.normal_(m.lora.gate_up_proj.lora_B.weight)
    x = torch.randn(2, 5, 64)
    y, y_ref = layer(x), dense(x)
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    y.sum().backward()
    y_ref.sum().backward()
    for name in ("gate_up_proj", "down_proj"):
        for f in ("lora_A", "lora_B"):
            got, want = (getattr(m.lora[name], f).weight.grad for m in (layer, dense))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert not [n for n, p in layer.named_parameters() if p.requires_grad and "lora_" not in n and "router" not in n]
    with pytest.raises(TypeError, match="quantised"):
        layer.merge_lora()


def tiny_qwen3_moe(**kw):
    transformers = pytest.importorskip("transformers")
    args = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=5,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**args, **kw}))


def test_quantize_transformers_model():
    model = tiny_qwen3_moe()
    originals = {n: p.detach().clone() for n, p in model.named_parameters() if p.dim() == 3}
    assert len(originals) == 4
    quantize_experts(model, "fp8_block")
    for name, w in originals.items():
        owner, attr = name.rsplit(".", 1)
        check_quantized(model.get_submodule(owner), attr, w, segments=(40, 40) if attr == "gate_up_proj" else None)
    assert not [n for n, p in model.named_parameters() if p.dim() == 3]
    keys = model.state_dict().keys()
    assert {f"model.layers.1.mlp.experts.{n}.{b}" for n in NAMES for b in ("weight", "weight_scale_inv")} <= keys


def test_quantize_peft_wrapped_model():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    wrapped = peft.get_peft_model(tiny_qwen3_moe(), config)
    originals = {n: p.detach().clone() for n, p in wrapped.named_parameters() if p.dim() == 3}
    assert len(originals) == 4 and all(".base_layer.base_layer." in n for n in originals)
    quantize_experts(wrapped, "fp8_block")
    inner = wrapped.base_model.model.model.layers[0].mlp.experts.base_layer.base_layer
    assert isinstance(inner.gate_up_proj, FP8BlockExperts) and isinstance(inner.down_proj, FP8BlockExperts)
    for name, w in originals.items():
        owner, attr = name.rsplit(".", 1)
        check_quantized(wrapped.get_submodule(owner), attr, w, segments=(40, 40) if attr == "gate_up_proj" else None)
    keys = wrapped.state_dict().keys()
    assert "base_model.model.model.layers.0.mlp.experts.base_layer.base_layer.gate_up_proj.weight_scale_inv" in keys


class PlainExperts(torch.nn.Module):
    """transformers' layouts without a transformers model: gpt-oss's transposed gate_up and a
    gate-less ``up_proj``."""

    def __init__(self, up_name, up_shape, down_shape, transposed):
        super().__init__()
        setattr(self, up_name, torch.nn.Parameter(weights(up_shape)))
        self.down_proj = torch.nn.Parameter(weights(down_shape, seed=1))
        self.is_transposed = transposed


@pytest.mark.parametrize(
    "up_name,up_shape,down_shape,transposed",
    [
        ("gate_up_proj", (3, 160, 80), (3, 40, 160), True),  # transposed (gpt-oss): [E, H, 2I], [E, I, H]
        ("up_proj", (3, 200, 160), (3, 160, 200), False),  # no gate: one row segment
    ],
)
def test_quantize_other_layouts(up_name, up_shape, down_shape, transposed):
    m = torch.nn.Sequential(PlainExperts(up_name, up_shape, down_shape, transposed))
    up, down = getattr(m[0], up_name).detach().clone(), m[0].down_proj.detach().clone()
    quantize_experts(m, "fp8_block")
    check_quantized(m[0], up_name, up)  # the plain grid over the stored layout
    check_quantized(m[0], "down_proj", down)


# ---------------------------------------------------------------- state dict round trip


def test_safetensors_round_trip(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    model = quantize_experts(tiny_qwen3_moe().to(torch.bfloat16), "fp8_block")
    path = tmp_path / "model.safetensors"
    st.save_file(model.state_dict(), str(path))

    torch.manual_seed(1)
    fresh = tiny_qwen3_moe().to(torch.bfloat16)
    assert load_quantized_state_dict(fresh, path, "fp8_block") is fresh
    saved = model.state_dict()
    for k, v in fresh.state_dict().items():
        assert v.dtype == saved[k].dtype and torch.equal(v.view(torch.uint8), saved[k].view(torch.uint8)), k
    a, b = model.model.layers[1].mlp.experts.gate_up_proj, fresh.model.layers[1].mlp.experts.gate_up_proj
    assert b.dtype == torch.bfloat16 and b.row_segments == (40, 40) and torch.equal(a.dequantize(), b.dequantize())

    # the same by hand: quantise the structure, then load_state_dict; and onto a model built on the meta device
    again = quantize_experts(tiny_qwen3_moe().to(torch.bfloat16), "fp8_block")
    again.load_state_dict(st.load_file(str(path)))
    assert torch.equal(
        again.model.layers[0].mlp.experts.down_proj.dequantize(),
        model.model.layers[0].mlp.experts.down_proj.dequantize(),
    )
    with torch.device("meta"):
        meta = tiny_qwen3_moe().to(torch.bfloat16)
    load_quantized_state_dict(meta, path, "fp8_block", assign=True)
    assert torch.equal(
        meta.model.layers[0].mlp.experts.down_proj.dequantize(),
        model.model.layers[0].mlp.experts.down_proj.dequantize(),
    )


# ---------------------------------------------------------------- errors


def test_errors():
    moe = moeyard.MoE(moeyard.MoEConfig(num_experts=3, hidden_size=32, intermediate_size=16, top_k=2))
    with pytest.raises(ValueError, match="format: expected one of"):
        quantize_experts(moe, "fp8")
    with pytest.raises(ValueError, match="blocksize"):
        quantize_experts(moe, "fp8_block", blocksize=128)
    with pytest.raises(ValueError, match="no expert weights"):
        quantize_experts(torch.nn.Linear(4, 4), "fp8_block")
    m = torch.nn.Sequential(PlainExperts("gate_up_proj", (3, 32, 16), (3, 32, 16), False))
    m[0].down_proj.data = m[0].down_proj.data.to(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match=r"down_proj: .*float8_e4m3fn"):  # checked before anything is replaced
        quantize_experts(m, "fp8_block")
    assert isinstance(m[0].gate_up_proj, torch.nn.Parameter)
    with pytest.raises(TypeError, match="weight: .*int32"):
        FP8BlockExperts.from_float(torch.zeros(2, 8, 8, dtype=torch.int32))
    with pytest.raises(TypeError, match="weight: expected a tensor"):
        FP8BlockExperts.from_float([[1.0]])
    with pytest.raises(ValueError, match="weight: expected a 3-D"):
        FP8BlockExperts.from_float(torch.zeros(8, 64))
    with pytest.raises(ValueError, match="row_segments"):
        FP8BlockExperts.from_float(weights((2, 10, 8)), row_segments=(4, 4))
    s = FP8BlockExperts.from_float(weights((3, 200, 16)))
    with pytest.raises(TypeError, match="weight: expected a torch.float8_e4m3fn"):
        FP8BlockExperts.from_fp8(s.weight.float(), s.weight_scale_inv, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="weight_scale_inv: expected a float32"):
        FP8BlockExperts.from_fp8(s.weight, s.weight_scale_inv.to(torch.float8_e4m3fn), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"weight_scale_inv: expected shape \(3, 2, 1\)"):
        FP8BlockExperts.from_fp8(s.weight, s.weight_scale_inv[:, :1], dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="dtype: .*torch.int8"):
        FP8BlockExperts.from_fp8(s.weight, s.weight_scale_inv, dtype=torch.int8)
    with pytest.raises(TypeError, match="active"):
        s.dequantize(torch.ones(3))
    with pytest.raises(ValueError, match="active"):
        s.dequantize(torch.ones(4, dtype=torch.bool))
    with pytest.raises(TypeError, match="out"):
        s.dequantize(out=torch.empty(3, 200, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out"):
        s.dequantize(out=torch.empty(3, 200, 8))
    with pytest.raises(ValueError, match="contiguous"):
        s.dequantize(out=torch.empty(3, 16, 200).mT)
    x, ids, tw, q, _ = _case(8, 64, 32, 4, 2)
    with pytest.raises(TypeError, match="hidden_states: expected dtype"):
        moeyard.experts(x.double(), ids, tw.double(), *q, backend="loop")
    with pytest.raises(TypeError, match="gate_up_proj: torch.float8_e4m3fn values need their block scales"):
        moeyard.experts(x, ids, tw, q[0].weight, q[1].dequantize(), backend="loop")  # raw e4m3 values: never used
    # a checkpoint's scales of the wrong grid, named by parameter
    saved = quantize_experts(moeyard.MoE(moe.config), "fp8_block").state_dict()
    saved["down_proj.weight_scale_inv"] = torch.ones(3, 2, 1)
    with pytest.raises(ValueError, match=r"down_proj.weight_scale_inv: expected shape \(3, 1, 1\)"):
        load_quantized_state_dict(moeyard.MoE(moe.config), saved, "fp8_block")


# ---------------------------------------------------------------- FP8 checkpoints of transformers models

CKPT_QC = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "weight_block_size": [128, 128],
    "modules_to_not_convert": ["lm_head", "mlp.gate"],
}


def is_fp8_linear(key, t):
    """What Qwen3-FP8 / DeepSeek-V3 / MiniMax-M2 checkpoints store in FP8: every projection's weight
    (attention, dense and shared MLPs, experts: ``*_proj``, Mixtral's ``w1``/``w2``/``w3``); embeddings,
    norms, the router (``mlp.gate``) and ``lm_head`` stay bfloat16."""
    return t.dim() == 2 and (key.endswith("_proj.weight") or re.search(r"\.w[123]\.weight$", key) is not None)


class Checkpoint(NamedTuple):
    model: torch.nn.Module  # what was written
    fp8: pathlib.Path  # the FP8 checkpoint
    dequantized: pathlib.Path  # the same with every FP8 tensor dequantised (float32), no quantization_config
    tensors: dict  # the FP8 checkpoint's tensors


def write_fp8_checkpoint(model, path, qc=CKPT_QC) -> Checkpoint:
    """``model`` saved by transformers (per-expert tensors, as on the hub), its projections cast to e4m3
    with 128 x 128 ``weight_scale_inv`` block scales by the reference :func:`moeyard.quant.fp8.quantize`;
    beside it the same tensors dequantised by the reference :func:`moeyard.quant.fp8.dequantize` (float32
    products), which transformers loads as the same model with the dequantised weights."""
    st = pytest.importorskip("safetensors.torch")
    plain = path / "bf16"
    model.save_pretrained(plain)
    tensors, dense = {}, {}
    for k, v in st.load_file(str(plain / "model.safetensors")).items():
        if is_fp8_linear(k, v):
            q, s = quantize(v, BLOCKS, "float")
            tensors[k], tensors[k.removesuffix("weight") + "weight_scale_inv"] = q, s
            dense[k] = dequantize(q, s, BLOCKS)
        else:
            tensors[k] = v
            dense[k] = v.float()
    config = model.config.to_dict()
    for d, t, quantized in ((path / "fp8", tensors, True), (path / "dequantized", dense, False)):
        d.mkdir()
        st.save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps({**config, **({"quantization_config": qc} if quantized else {})}))
        model.generation_config.save_pretrained(d)
    return Checkpoint(model, path / "fp8", path / "dequantized", tensors)


def reference_model(ckpt: Checkpoint, dtype, **kw):
    """transformers' own load of the dequantised checkpoint, in ``dtype`` (eval mode)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt.dequantized, dtype=dtype, **kw)


def cast_parameters(model, dtype):
    """Parameters to ``dtype``, buffers as they are (rotary ``inv_freq`` stays float32, as transformers
    builds a bfloat16 model; ``model.to(dtype)`` would round it)."""
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """A tiny Qwen3-MoE in bfloat16, hidden size 160 and expert size 72 (partial blocks, gate and up halves in
    one block row each), written as an FP8 checkpoint."""
    from moeyard import verify

    with verify.quiet_transformers():
        model = cast_parameters(tiny_qwen3_moe(hidden_size=160, moe_intermediate_size=72), torch.bfloat16)
        model.generation_config.pad_token_id = 0
        return write_fp8_checkpoint(model, tmp_path_factory.mktemp("qwen3_moe"))


def _logits(model, ids, backend="bmm_padded"):
    with moeyard.use_backend(backend), torch.no_grad():
        return model(input_ids=ids).logits


def test_checkpoint_loads_experts_in_fp8(fp8_checkpoint):
    from moeyard.quant import load_fp8_checkpoint

    ckpt = fp8_checkpoint
    loaded = load_fp8_checkpoint(ckpt.fp8)
    assert not loaded.training and loaded.config._experts_implementation == "moeyard"
    assert loaded.generation_config.pad_token_id == 0
    for layer in range(2):
        experts = loaded.model.layers[layer].mlp.experts
        prefix = f"model.layers.{layer}.mlp.experts"
        for attr, parts, grid in (
            ("gate_up_proj", ("gate_proj", "up_proj"), (5, 2, 2)),
            ("down_proj", ("down_proj",), (5, 2, 1)),
        ):
            w, s = getattr(experts, attr), getattr(experts, f"{attr}_scale_inv")
            assert w.dtype == torch.float8_e4m3fn and not w.requires_grad and tuple(s.shape) == grid
            for e in range(5):  # the checkpoint's bytes and scales, never dequantised
                want = torch.cat([ckpt.tensors[f"{prefix}.{e}.{n}.weight"] for n in parts])
                assert torch.equal(w[e].view(torch.uint8), want.view(torch.uint8))
                assert torch.equal(s[e], torch.cat([ckpt.tensors[f"{prefix}.{e}.{n}.weight_scale_inv"] for n in parts]))
    dense = {n: p for n, p in loaded.named_parameters() if p.dtype != torch.float8_e4m3fn and "_scale_inv" not in n}
    assert all(p.dtype == torch.bfloat16 and p.dim() < 3 for p in dense.values())
    ref = dict(reference_model(ckpt, torch.bfloat16).named_parameters())
    assert all(torch.equal(p, ref[n]) for n, p in dense.items())  # attention dequantised, the rest as stored


def test_checkpoint_into_a_model_built_without_weights(fp8_checkpoint):
    from accelerate import init_empty_weights

    from moeyard.quant import load_fp8_checkpoint

    model, path = fp8_checkpoint.model, fp8_checkpoint.fp8
    with init_empty_weights(include_buffers=False):  # parameters on the meta device, rotary buffers real
        empty = type(model)(model.config)
    cast_parameters(empty, torch.bfloat16)
    assert load_fp8_checkpoint(empty, path / "model.safetensors") is empty
    empty.set_experts_implementation("moeyard")
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(4))
    assert torch.equal(_logits(empty.eval(), ids), _logits(load_fp8_checkpoint(path), ids))
    with torch.device("meta"):
        all_meta = type(model)(model.config)
    with pytest.raises(RuntimeError, match="meta device after loading.*inv_freq"):
        load_fp8_checkpoint(all_meta, path)


def check_logits_and_decoding(ckpt: Checkpoint, vocab: int, backends=("bmm_padded",)):
    """The loaded FP8 checkpoint against transformers' load of the dequantised one: the same logits on the same
    moeyard backend (the same dense values), close to transformers' own experts, and the same greedy tokens."""
    from moeyard.quant import load_fp8_checkpoint

    ids = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(0))
    loaded = load_fp8_checkpoint(ckpt.fp8)
    ref = reference_model(ckpt, torch.bfloat16, experts_implementation="moeyard")
    for backend in backends:
        assert torch.equal(_logits(loaded, ids, backend), _logits(ref, ids, backend)), backend
    ref.set_experts_implementation("eager")  # transformers' own experts on the dequantised weights
    assert rel_err(_logits(loaded, ids), _logits(ref, ids)) < 2e-2  # bfloat16 rounding in another order
    loaded32 = load_fp8_checkpoint(ckpt.fp8, dtype=torch.float32)
    ref32 = reference_model(ckpt, torch.float32)
    assert rel_err(_logits(loaded32, ids), _logits(ref32, ids)) < 1e-5
    with moeyard.use_backend("bmm_padded"), torch.no_grad():
        tokens = loaded32.generate(ids, max_new_tokens=8, do_sample=False)
        want = ref32.generate(ids, max_new_tokens=8, do_sample=False)
    assert tokens.shape == (2, 17) and torch.equal(tokens, want)
    return loaded


def test_checkpoint_logits_and_decoding(fp8_checkpoint):
    loaded = check_logits_and_decoding(fp8_checkpoint, 64, backends=("bmm_padded", "grouped_mm"))
    experts = loaded.model.layers[0].mlp.experts
    view = experts._moeyard_fp8_views["gate_up_proj"]  # the parameters themselves, adopted once
    assert view.weight is experts.gate_up_proj and view.weight_scale_inv is experts.gate_up_proj_scale_inv
    assert view.row_segments == (72, 72)
    _logits(loaded, torch.zeros(1, 3, dtype=torch.long))
    assert experts._moeyard_fp8_views["gate_up_proj"] is view


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])
def test_checkpoint_other_architectures(arch, tmp_path):
    """Mixtral's layout (``block_sparse_moe.experts.<e>.w1/w3/w2`` in the checkpoint, as MiniMax-M2's FP8 one:
    transformers' renaming to ``mlp``) and DeepSeek-V3's (MLA projections, a shared expert, FP8 as released)."""
    from moeyard import verify

    with verify.quiet_transformers():
        model = cast_parameters(verify.build_model(arch), torch.bfloat16).eval()
        model.generation_config.pad_token_id = 0
        ckpt = write_fp8_checkpoint(model, tmp_path)
        if arch == "mixtral":
            assert any(".block_sparse_moe.experts.0.w1.weight_scale_inv" in k for k in ckpt.tensors)
        check_logits_and_decoding(ckpt, model.config.vocab_size)


def test_checkpoint_against_transformers_dequantising_load(tmp_path):
    """transformers (no GPU here) loads the same checkpoint dequantised, by its own code (FineGrainedFP8's
    ``Fp8Dequantize``): the same values. Sizes are multiples of 128 where they exceed one block, because
    transformers derives the block size from the scale grid (``rows // scale_rows``), which is 128 only then."""
    transformers = pytest.importorskip("transformers")
    from moeyard import verify
    from moeyard.quant import load_fp8_checkpoint

    with verify.quiet_transformers():
        model = cast_parameters(tiny_qwen3_moe(hidden_size=128, moe_intermediate_size=48, head_dim=64), torch.bfloat16)
        path = write_fp8_checkpoint(model, tmp_path).fp8
        theirs = transformers.AutoModelForCausalLM.from_pretrained(path, experts_implementation="moeyard")
    assert theirs.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16  # dequantised on load
    ours = load_fp8_checkpoint(path)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_logits(ours, ids), _logits(theirs, ids))


def _lm_loss(model, ids):
    logits = model(input_ids=ids).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def test_lora_training_on_fp8_checkpoint(fp8_checkpoint):
    peft = pytest.importorskip("peft")
    from moeyard.integrations.peft import fuse_lora
    from moeyard.quant import load_fp8_checkpoint

    ckpt = fp8_checkpoint
    config = dict(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    ours = peft.get_peft_model(load_fp8_checkpoint(ckpt.fp8, dtype=torch.float32), peft.LoraConfig(**config))
    ref = peft.get_peft_model(
        reference_model(ckpt, torch.float32, experts_implementation="moeyard"), peft.LoraConfig(**config)
    )
    for m in (ours, ref):
        fuse_lora(m)
        m.train()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        adapters = {n: p for n, p in ours.named_parameters() if p.requires_grad}
        for p in adapters.values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)  # B nonzero: the adapters change the output
        ref_adapters = {n: p for n, p in ref.named_parameters() if p.requires_grad}
        assert adapters.keys() == ref_adapters.keys() and len(adapters) == 16  # 2 layers x 4 targets x (A, B)
        for n, p in ref_adapters.items():
            p.copy_(adapters[n])
    frozen = {n: p.detach().clone() for n, p in ours.named_parameters() if p.dtype == torch.float8_e4m3fn}
    assert len(frozen) == 4 and all(not p.requires_grad for n, p in ours.named_parameters() if n in frozen)
    ids = torch.randint(0, 64, (4, 12), generator=g)
    with moeyard.use_backend("bmm_padded"):
        loss, ref_loss = _lm_loss(ours, ids), _lm_loss(ref, ids)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        loss.backward()
        ref_loss.backward()
        for n, p in adapters.items():  # the same gradients as on the dequantised model, up to rounding
            torch.testing.assert_close(p.grad, ref_adapters[n].grad, rtol=1e-4, atol=1e-6)
        opt = torch.optim.Adam(adapters.values(), lr=1e-2)
        losses = []
        for _ in range(6):
            opt.zero_grad()
            step = _lm_loss(ours, ids)
            step.backward()
            opt.step()
            losses.append(step.item())
    assert losses[-1] < 0.9 * losses[0], losses
    after = {n: p for n, p in ours.named_parameters() if n in frozen}
    assert all(
        torch.equal(p.view(torch.uint8), frozen[n].view(torch.uint8)) and p.grad is None for n, p in after.items()
    )


def test_transformers_fp8_experts_run_on_moeyard(fp8_checkpoint):
    """On a GPU, transformers builds its own ``FP8Experts`` for such a checkpoint; with ``register_fp8`` its
    ``experts_implementation="moeyard"`` runs them (float8 parameters and ``*_scale_inv``) on moeyard."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    from moeyard.integrations.transformers import register_fp8
    from moeyard.quant import load_fp8_checkpoint

    path = fp8_checkpoint.fp8
    ours = load_fp8_checkpoint(path)
    theirs = load_fp8_checkpoint(path)
    qc = FineGrainedFP8Config(weight_block_size=[128, 128])
    keep = ["model.layers.*.self_attn", "lm_head", "model.layers.*.mlp.gate"]  # only the experts become FP8Experts
    replace_with_fp8_linear(
        theirs, modules_to_not_convert=keep, quantization_config=qc, pre_quantized=True
    )  # what from_pretrained does on a GPU
    register_fp8()
    for layer, mine in zip(theirs.model.layers, ours.model.layers, strict=True):
        fp8_experts = layer.mlp.experts
        assert type(fp8_experts).__name__ == "FP8Experts"
        fp8_experts.load_state_dict(mine.mlp.experts.state_dict(), assign=True)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    assert torch.equal(_logits(theirs, ids), _logits(ours, ids))


def test_checkpoint_errors(fp8_checkpoint, tmp_path):
    st = pytest.importorskip("safetensors.torch")
    from moeyard.quant import load_fp8_checkpoint

    path, tensors = fp8_checkpoint.fp8, fp8_checkpoint.tensors
    config = json.loads((path / "config.json").read_text())

    def variant(name, change_config=None, change_tensors=None):
        d = tmp_path / name
        d.mkdir()
        c = json.loads(json.dumps(config))
        if change_config:
            change_config(c["quantization_config"])
        (d / "config.json").write_text(json.dumps(c))
        t = dict(tensors)
        if change_tensors:
            change_tensors(t)
        st.save_file(t, str(d / "model.safetensors"))
        return d

    with pytest.raises(ValueError, match=r"quantization_config.weight_block_size: moeyard loads \[128, 128\]"):
        load_fp8_checkpoint(variant("blocks", lambda q: q.update(weight_block_size=[64, 64])))
    with pytest.raises(ValueError, match="quantization_config.quant_method: expected 'fp8'"):
        load_fp8_checkpoint(variant("method", lambda q: q.update(quant_method="bitsandbytes")))
    with pytest.raises(ValueError, match="quantization_config.activation_scheme"):
        load_fp8_checkpoint(variant("static", lambda q: q.update(activation_scheme="static")))
    with pytest.raises(ValueError, match="quantization_config.fmt: moeyard loads 'e4m3', got 'e5m2'"):
        load_fp8_checkpoint(variant("e5m2", lambda q: q.update(fmt="e5m2")))
    with pytest.raises(ValueError, match="quantization_config.scale_fmt"):
        load_fp8_checkpoint(variant("ue8m0", lambda q: q.update(scale_fmt="ue8m0")))
    assert load_fp8_checkpoint(variant("fn", lambda q: q.update(fmt="float8_e4m3fn"))) is not None  # MiniMax-M2's
    key = "model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"
    with pytest.raises(ValueError, match=rf"{key}: expected a float32 tensor of shape \(1, 2\)"):
        load_fp8_checkpoint(variant("scale", change_tensors=lambda t: t.update({key: torch.ones(2, 2)})))
    key = "model.layers.0.mlp.experts.1.down_proj.weight"
    with pytest.raises(ValueError, match=rf"{key}: expected a torch.float8_e4m3fn tensor"):
        load_fp8_checkpoint(variant("dtype", change_tensors=lambda t: t.update({key: t[key].float()})))
    with pytest.raises(RuntimeError, match="missing tensors.*model.norm.weight"):
        load_fp8_checkpoint(variant("missing", change_tensors=lambda t: t.pop("model.norm.weight")))
    with pytest.raises(RuntimeError, match="unexpected tensors.*extra"):
        load_fp8_checkpoint(variant("extra", change_tensors=lambda t: t.update(extra=torch.ones(1))))
    with pytest.raises(FileNotFoundError, match="checkpoint"):
        load_fp8_checkpoint(tmp_path / "nowhere")
    with pytest.raises(TypeError, match="model_or_path"):
        load_fp8_checkpoint(3)
    loaded = load_fp8_checkpoint(path)
    with pytest.raises(TypeError, match="checkpoint: a model was given"):
        load_fp8_checkpoint(loaded)
    ids = torch.zeros(1, 3, dtype=torch.long)
    loaded.to(torch.bfloat16)  # casts the float8 values: meaningless without their scales, so an error
    with pytest.raises(TypeError, match="gate_up_proj: has gate_up_proj_scale_inv but is torch.bfloat16"):
        _logits(loaded, ids)
    peft = pytest.importorskip("peft")
    wrapped = peft.get_peft_model(
        load_fp8_checkpoint(path), peft.LoraConfig(r=2, target_parameters=["mlp.experts.down_proj"])
    )
    with pytest.raises(TypeError, match="down_proj: PEFT's W \\+ dW fold cannot run on FP8"):
        _logits(wrapped, ids)  # without fuse_lora PEFT would add W + dW to the unscaled float8 values
    with pytest.raises(ValueError, match="wrapped by PEFT"):
        load_fp8_checkpoint(wrapped, path)


@pytest.mark.parametrize("recipe", ["fp8_blockwise", "mxfp8"])
def test_training_recipe_on_fp8_storage(recipe):
    """An FP8 training recipe casts the GEMM operands from the dequantised values: the same as on dense weights."""
    x, ids, tw, q, lora = _case(20, 256, 128, 4, 2, rank=4)
    got = _run(x, ids, tw, *q, lora, "bmm_padded", recipe=recipe)
    want = _run(x, ids, tw, *(s.dequantize() for s in q), lora, "bmm_padded", recipe=recipe)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
