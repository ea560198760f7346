"""``moeyard verify --framework jax``: the JAX column of the parity table.

For the run, an expert backend named ``jax`` is registered (and removed afterwards): it hands each
:func:`moeyard.experts` call of the transformers models to :func:`moeyard.jax.experts` (weights in
their stored layout, transposed and interleaved ones included; biases; the named activations) and its
backward to ``jax.vjp`` of that call, through :class:`JaxExperts`, a ``torch.autograd.Function``. So the
column compares, per architecture, the logits and every parameter's gradient of the whole model with its
experts computed in JAX against transformers' eager experts, under the criterion of the other columns.

The tensors cross as host copies (NumPy), and JAX computes on its default device; float64 turns on
``jax_enable_x64`` for the run. Experts modules whose activation is a custom PyTorch function, or that
carry LoRA adapters, are not handed over: their cells are errors naming why.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import torch

from ..experts.registry import ExpertBackend, register_backend, unregister_backend

NAME = "jax"
_JAX_DTYPES = {
    torch.float32: jnp.float32,
    torch.float64: jnp.float64,
    torch.bfloat16: jnp.bfloat16,
    torch.float16: jnp.float16,
}


def unsupported(device, dtype, weights, activation) -> str | None:
    """Why the ``jax`` column cannot run an experts call, or None."""
    if dtype not in _JAX_DTYPES:
        return f"moeyard.jax runs float16/bfloat16/float32/float64, not {dtype}"
    if activation is not None and activation.fn is not None:
        return "the module's activation is a custom PyTorch function (moeyard.jax runs the named activations)"
    if weights is not None and (weights.lora_up is not None or weights.lora_down is not None):
        return "LoRA adapters are not in moeyard.jax"
    return None


def _to_jax(t: torch.Tensor | None):
    if t is None:
        return None
    host = t.detach().cpu()
    return jnp.asarray(
        (host.float() if host.dtype in (torch.bfloat16, torch.float16) else host).numpy(), _JAX_DTYPES.get(t.dtype)
    )


def _to_torch(a, like: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.array(a.astype(jnp.float64 if a.dtype == jnp.float64 else jnp.float32))).to(
        device=like.device, dtype=like.dtype
    )


def _stored(w: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The weight as stored and whether that is the transposed layout: ``ExpertWeights`` holds a
    transposed (gpt-oss) weight as the ``.mT`` view of its ``[E, in, out]`` storage."""
    if not w.is_contiguous() and w.mT.is_contiguous():
        return w.mT, True
    return w, False


class JaxExperts(torch.autograd.Function):
    """``moeyard.jax.experts`` as a differentiable PyTorch op (forward: the JAX call; backward: its
    ``jax.vjp``)."""

    @staticmethod
    def forward(ctx, x, topk_weights, w_up, w_down, b_up, b_down, topk_ids, options):
        tensors = (x, topk_weights, w_up, w_down, b_up, b_down)
        up, transposed = _stored(w_up)
        down, _ = _stored(w_down)

        def call(x, w, up, down, b_up, b_down):
            from . import experts

            return experts(
                x,
                jnp.asarray(topk_ids.cpu().numpy(), jnp.int32),
                w,
                up,
                down,
                gate_up_bias=b_up,
                down_bias=b_down,
                transposed=transposed,
                **options,
            )

        out, ctx.vjp = jax.vjp(call, *[_to_jax(t) for t in (x, topk_weights, up, down, b_up, b_down)])
        ctx.like = [t for t in tensors]
        ctx.transposed = transposed
        return _to_torch(out, x)

    @staticmethod
    def backward(ctx, grad_out):
        cts = ctx.vjp(_to_jax(grad_out.contiguous()))
        grads = []
        for i, (ct, like) in enumerate(zip(cts, ctx.like, strict=True)):
            if ct is None or like is None:
                grads.append(None)
                continue
            g = _to_torch(ct, like if i not in (2, 3) or not ctx.transposed else like.mT)
            grads.append(g.mT if i in (2, 3) and ctx.transposed else g)
        return (*grads, None, None)


def jax_forward(hidden_states, topk_ids, topk_weights, weights, activation, *, drop_invalid=False):
    """The registered backend's forward (:mod:`moeyard.experts.registry`'s contract)."""
    options = dict(activation=activation, interleaved=weights.interleaved, drop_invalid=bool(drop_invalid))
    return JaxExperts.apply(
        hidden_states, topk_weights, weights.w_up, weights.w_down, weights.b_up, weights.b_down, topk_ids, options
    )


@contextlib.contextmanager
def jax_column(dtype: torch.dtype):
    """Register the ``jax`` expert backend (and ``jax_enable_x64`` for float64) inside the block; yields
    its name."""
    if dtype not in _JAX_DTYPES:
        raise ValueError(f"--framework jax: moeyard.jax runs {sorted(str(d)[6:] for d in _JAX_DTYPES)}, not {dtype}")
    register_backend(
        ExpertBackend(
            name=NAME,
            forward=jax_forward,
            unsupported=unsupported,
            priority={},
            description="moeyard.jax.experts (jax.lax.ragged_dot) through a host copy",
        )
    )
    try:
        with jax.enable_x64(dtype == torch.float64):
            yield NAME
    finally:
        unregister_backend(NAME)
