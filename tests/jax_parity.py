"""Helpers of the JAX tests: the same MoE layer in PyTorch and in JAX, one forward and backward each.

Legend: B sequences, S tokens each, T = B * S, H hidden size, I intermediate size, E experts, K top-k.
"""

import math

from jax_flags import set_xla_flags

set_xla_flags()  # before JAX starts its backend (the first test that runs JAX code)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from flax import nnx  # noqa: E402

import moeyard  # noqa: E402
import moeyard.jax as mj  # noqa: E402

ROUTING_FIELDS = (
    "topk_weights",
    "router_logits",
    "scores",
    "tokens_per_expert",
    "aux_loss",
    "seq_aux_loss",
    "z_loss",
    "loss",
)
JAX_DTYPES = {torch.float32: jnp.float32, torch.float64: jnp.float64}


def torch_layer(cfg, dtype, seed=0):
    """A ``moeyard.MoE`` (backend ``loop``, the oracle) with random parameters of order one."""
    g = torch.Generator().manual_seed(seed)
    m = moeyard.MoE(cfg, backend="loop", dtype=dtype)
    with torch.no_grad():
        for name, p in m.named_parameters():
            scale = (0.5 if "bias" in name else 1.0) / math.sqrt(p.shape[-1])
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * scale)
        if m.router.e_score_correction_bias is not None:
            m.router.e_score_correction_bias.copy_(torch.randn(cfg.num_experts, generator=g) * 0.05)
    return m


def jax_layer(cfg, torch_module, dtype, lora=None, **kw):
    """The ``moeyard.jax.MoE`` with ``torch_module``'s parameters (built abstractly, then loaded: no
    eager initialisation, whose every op would compile on its own); ``lora``: ``add_lora``'s keyword
    arguments, for a module with adapters."""

    def build():
        m = mj.MoE(cfg, rngs=nnx.Rngs(0), dtype=JAX_DTYPES[dtype], **kw)
        return m if lora is None else m.add_lora(rngs=nnx.Rngs(1), **lora)

    return mj.load_state_dict(nnx.eval_shape(build), torch_module.state_dict())


def run_torch(module, x, probe):
    """Output, routing fields and every gradient of ``sum(y * probe) + aux_loss``, as float64 NumPy arrays."""
    x = x.clone().requires_grad_()
    y = module(x)
    ((y * probe).sum() + module.aux_loss).backward()
    r = module.routing
    out = {"y": y, "grad.x": x.grad, "topk_ids": r.topk_ids}
    out.update({f: getattr(r, f) for f in ROUTING_FIELDS})
    out.update({f"grad.{n}": p.grad for n, p in module.named_parameters()})
    return {k: v.detach().numpy().astype(np.float64 if v.is_floating_point() else np.int64) for k, v in out.items()}


def jax_step(module):
    """A jitted ``(params, x, probe) -> (y, routing, grads)`` of ``module`` (split once)."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def loss(params, x, probe, rest):
        m = nnx.merge(graphdef, params, rest, copy=True)
        y = m(x)
        routing = m.routing.get_value()
        return (y * probe).sum() + routing.loss, (y, routing)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))
    return lambda x, probe: grad(params, x, probe, rest)


def run_jax(module, x, probe):
    """:func:`run_torch`'s dictionary for the JAX layer (``x``, ``probe``: torch tensors)."""
    dtype = JAX_DTYPES[x.dtype]
    (g_params, g_x), (y, r) = jax_step(module)(jnp.asarray(x.numpy(), dtype), jnp.asarray(probe.numpy(), dtype))
    out = {"y": y, "grad.x": g_x, "topk_ids": r.topk_ids}
    out.update({f: getattr(r, f) for f in ROUTING_FIELDS})
    flat = nnx.to_flat_state(g_params)
    out.update({"grad." + ".".join(str(p) for p in path): v.get_value() for path, v in flat})
    return {
        k: np.asarray(v).astype(np.float64 if jnp.issubdtype(v.dtype, jnp.floating) else np.int64)
        for k, v in out.items()
    }


def assert_parity(got: dict, ref: dict, tol: float) -> None:
    """Same keys; ids equal; every float entry within ``tol * max(1, max|ref|)``."""
    assert sorted(got) == sorted(ref), (sorted(got), sorted(ref))
    for key, r in ref.items():
        g = got[key]
        assert g.shape == r.shape, (key, g.shape, r.shape)
        if key == "topk_ids":
            np.testing.assert_array_equal(g, r, err_msg=key)
            continue
        assert np.isfinite(g).all(), key
        err = np.abs(g - r).max(initial=0.0)
        assert err <= tol * max(1.0, np.abs(r).max(initial=0.0)), f"{key}: max error {err:.3e}"


def tolerance(dtype) -> float:
    """float64: 1e-10 (the two sides differ only in summation order); float32: 2e-5."""
    return 1e-10 if dtype == torch.float64 else 2e-5
