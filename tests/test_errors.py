"""Bad inputs raise ValueError / TypeError whose message starts with the argument's name, and no
entry point modifies its inputs.

Legend: T tokens, H hidden size, I intermediate size, E experts, K top-k.
"""

import pytest
import torch

import moeyard
from helpers import assert_unchanged, clones, cpu_backends, make_inputs
from moeyard import MoE, MoEConfig

T, H, I, E, K = 6, 16, 8, 4, 2
ALL = cpu_backends(torch.float32) + ["loop", "auto"]


def _inputs(**kw):
    d = {k: v.float() if v.is_floating_point() else v for k, v in make_inputs(T, H, I, E, K, bias=True).items()}
    d.update(kw)
    return d


def _call(d, **kw):
    return moeyard.experts(
        d["hidden_states"],
        d["topk_ids"],
        d["topk_weights"],
        d["gate_up_proj"],
        d["down_proj"],
        gate_up_bias=d.get("gate_up_bias"),
        down_bias=d.get("down_bias"),
        **kw,
    )


# (argument, replacement, exception, what the row checks)
BAD = [
    ("hidden_states", lambda d: d["hidden_states"][0], ValueError),  # 1-D states
    ("hidden_states", lambda d: d["hidden_states"][:, :-1], ValueError),  # H disagrees with the weights
    ("hidden_states", lambda d: d["hidden_states"].double(), TypeError),  # dtype differs from the weights
    ("hidden_states", lambda d: d["hidden_states"].long(), TypeError),  # integer states
    ("hidden_states", lambda d: d["hidden_states"].tolist(), TypeError),  # not a tensor
    ("topk_ids", lambda d: d["topk_ids"].float(), TypeError),  # float ids
    ("topk_ids", lambda d: d["topk_ids"] > 0, TypeError),  # bool ids
    ("topk_ids", lambda d: d["topk_ids"][:-1], ValueError),  # T disagrees
    ("topk_ids", lambda d: d["topk_ids"].reshape(-1), ValueError),  # 1-D ids
    ("topk_ids", lambda d: torch.zeros(T, E + 1, dtype=torch.long), ValueError),  # K > E (weights follow)
    ("topk_weights", lambda d: d["topk_weights"][:, :1], ValueError),  # K disagrees with the ids
    ("topk_weights", lambda d: d["topk_weights"].long(), TypeError),  # integer weights
    ("gate_up_proj", lambda d: d["gate_up_proj"][0], ValueError),  # 2-D weight
    ("gate_up_proj", lambda d: d["gate_up_proj"][:, :-1], ValueError),  # odd 2I for a gated act
    ("gate_up_proj", lambda d: d["gate_up_proj"].long(), TypeError),  # integer weight
    ("down_proj", lambda d: d["down_proj"][:, :, :-1], ValueError),  # I disagrees with gate_up_proj
    ("down_proj", lambda d: d["down_proj"][:-1], ValueError),  # E disagrees
    ("down_proj", lambda d: d["down_proj"].double(), TypeError),  # dtype differs from gate_up_proj
    ("gate_up_bias", lambda d: d["gate_up_bias"][:, :-1], ValueError),  # bias shape
    ("gate_up_bias", lambda d: d["gate_up_bias"].long(), TypeError),  # integer bias
    ("down_bias", lambda d: d["down_bias"][:-1], ValueError),  # bias shape
]


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("arg,bad,exc", BAD, ids=[f"{a}{i}" for i, (a, _, _) in enumerate(BAD)])
def test_experts_bad_argument(arg, bad, exc, backend):
    d = _inputs()
    d[arg] = bad(d)
    if arg == "topk_ids" and d[arg].dim() == 2 and d[arg].shape[1] == E + 1:
        d["topk_weights"] = torch.rand(T, E + 1)
    keep = clones({k: v for k, v in d.items() if isinstance(v, torch.Tensor)})
    with pytest.raises(exc, match=rf"^{arg}: "):
        _call(d, backend=backend)
    assert_unchanged(keep, d)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("bad_id", [-1, E, 1000], ids=["neg", "E", "large"])
def test_ids_out_of_range_on_cpu(backend, bad_id):
    """On CPU the ids are checked without a sync: ValueError naming topk_ids and the bad value."""
    d = _inputs()
    d["topk_ids"] = d["topk_ids"].clone()
    d["topk_ids"][2, 1] = bad_id
    with pytest.raises(ValueError, match=rf"^topk_ids: .*{bad_id}"):
        _call(d, backend=backend)
    assert _call(d, backend=backend, drop_invalid=True).isfinite().all()


@pytest.mark.parametrize("backend", ALL)
def test_check_ids_false_skips_the_check(backend):
    """``check_ids=False`` (the caller vouches for the ids): no check, the same output for valid ids."""
    d = _inputs()
    torch.testing.assert_close(_call(d, backend=backend, check_ids=False), _call(d, backend=backend))
    if backend in ("grouped_mm", "triton"):  # the others check the ids they index with themselves
        d["topk_ids"] = d["topk_ids"].clone()
        d["topk_ids"][2, 1] = -1
        _call(d, backend=backend, check_ids=False)  # would raise ValueError with the check


def test_unknown_backend_and_activation(monkeypatch):
    d = _inputs()
    with pytest.raises(ValueError, match=r"^backend: .*'nope'"):
        _call(d, backend="nope")
    with pytest.raises(ValueError, match="^activation: "):
        _call(d, activation="swish_typo")
    with pytest.raises(TypeError, match="^activation: "):
        _call(d, activation=3)
    with pytest.raises(ValueError, match="^activation: "):
        moeyard.Activation(name="nope")
    with pytest.raises(TypeError, match="^activation.fn: "):
        moeyard.Activation(name="x", fn=5)
    with pytest.raises(ValueError, match="^backend: "):
        moeyard.set_backend("nope")
    with pytest.raises(ValueError, match="^backend: "):
        MoE(MoEConfig(num_experts=4, hidden_size=H, intermediate_size=I, top_k=2), backend="nope")
    from moeyard.experts import registry

    monkeypatch.setattr(registry, "_default", [None])
    monkeypatch.setenv("MOEYARD_BACKEND", "nope")
    with pytest.raises(ValueError, match="^MOEYARD_BACKEND: "):
        moeyard.get_backend()


def test_backend_that_cannot_run_here():
    """A named backend that cannot run on these sizes / dtypes says why and names those that can."""
    d = {k: v.double() if v.is_floating_point() else v for k, v in _inputs().items()}
    with pytest.raises(ValueError, match=r"^backend: 'grouped_mm' cannot run here .*'loop'"):
        _call(d, backend="grouped_mm")
    d = make_inputs(T, 13, 7, E, K)
    d = {k: v.bfloat16() if v.is_floating_point() else v for k, v in d.items()}
    with pytest.raises(ValueError, match=r"^backend: .*hidden_size=13"):
        _call(d, backend="grouped_mm")


def test_interleaved_needs_gated():
    d = make_inputs(T, H, I, E, K, gated=False)
    with pytest.raises(ValueError, match="^interleaved: "):
        moeyard.experts(
            d["hidden_states"],
            d["topk_ids"],
            d["topk_weights"],
            d["gate_up_proj"],
            d["down_proj"],
            activation="gelu",
            interleaved=True,
        )


# (field, value, what the row checks)
BAD_CONFIG = [
    ("num_experts", 0, "positive"),
    ("num_experts", 2.0, "int"),
    ("hidden_size", -1, "positive"),
    ("intermediate_size", True, "bool is not an int"),
    ("top_k", 0, "positive"),
    ("top_k", 5, "top_k > num_experts"),
    ("score_func", "tanh", "unknown"),
    ("n_group", 3, "not a divisor of E"),
    ("topk_group", 3, "more than n_group"),
    ("activation", "swish", "unknown"),
    ("num_shared_experts", -1, "negative"),
    ("shared_intermediate_size", 0, "positive"),
    ("shared_expert_gate", True, "needs a shared expert"),
    ("routed_scaling_factor", 0.0, "positive"),
    ("router_jitter", -0.1, "non-negative"),
    ("aux_loss_coef", -1.0, "non-negative"),
    ("seq_aux_loss_coef", -1.0, "non-negative"),
    ("z_loss_coef", -1.0, "non-negative"),
]


@pytest.mark.parametrize("field,value,why", BAD_CONFIG)
def test_bad_config(field, value, why):
    kw = dict(num_experts=4, hidden_size=H, intermediate_size=I, top_k=2, n_group=2 if field == "topk_group" else 1)
    kw[field] = value
    with pytest.raises(ValueError, match=rf"^{field}: "):
        MoEConfig(**kw)


def test_bad_grouped_config():
    with pytest.raises(ValueError, match="^topk_group: "):  # 1 group of 2 experts cannot hold top_k = 3
        MoEConfig(num_experts=8, hidden_size=H, intermediate_size=I, top_k=3, n_group=4, topk_group=1)
    with pytest.raises(ValueError, match="^n_group: "):
        MoEConfig(
            num_experts=8, hidden_size=H, intermediate_size=I, top_k=2, n_group=4, topk_group=2, topk_before_score=True
        )


def test_route_errors():
    cfg = MoEConfig(num_experts=4, hidden_size=H, intermediate_size=I, top_k=2)
    x, W = torch.randn(T, H), torch.randn(4, H)
    with pytest.raises(TypeError, match="^x: "):
        moeyard.route(x.long(), W, cfg)
    with pytest.raises(ValueError, match="^x: "):
        moeyard.route(x[0], W, cfg)
    with pytest.raises(ValueError, match="^weight: "):
        moeyard.route(x, W[:3], cfg)
    with pytest.raises(ValueError, match="^weight: "):
        moeyard.route(x[:, :-1], W, cfg)
    with pytest.raises(TypeError, match="^weight: "):
        moeyard.route(x, W.long(), cfg)
    for bad in (0, 4, 2.0):
        with pytest.raises(ValueError, match="^num_sequences: "):
            moeyard.route(x, W, cfg, num_sequences=bad)


def test_layer_errors():
    with pytest.raises(TypeError, match="^config: "):
        MoE({"num_experts": 4})
    m = MoE(MoEConfig(num_experts=4, hidden_size=H, intermediate_size=I, top_k=2))
    with pytest.raises(ValueError, match="^x: "):
        m(torch.randn(3, H + 1))
    with pytest.raises(TypeError, match="^x: "):
        m(torch.randn(3, H, dtype=torch.float64))
    with pytest.raises(TypeError, match="^x: "):
        m(torch.ones(3, H, dtype=torch.long))


@pytest.mark.parametrize("backend", ALL)
def test_inputs_not_modified(backend):
    """Forward and backward leave every input as it was (biases and non-contiguous states included)."""
    d = _inputs()
    d["hidden_states"] = d["hidden_states"].t().contiguous().t()
    keep = clones(d)
    leaves = {k: v.requires_grad_() for k, v in d.items() if v.is_floating_point()}
    out = _call(d, backend=backend)
    out.square().sum().backward()
    assert all(v.grad is not None for v in leaves.values())
    assert_unchanged(keep, {k: v.detach() for k, v in d.items()})
