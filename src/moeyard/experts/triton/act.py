"""Activations inside kernel epilogues: forward, and forward plus derivatives for backward.

Names match :mod:`moeyard.activations`; ``none`` is the identity (used when a custom Python
activation runs in torch between the two grouped GEMMs). Inputs are float32 blocks; for plain
activations ``u`` is ignored. Derivatives follow torch's autograd conventions at the kinks
(relu: 0 at 0; clamp: 1 on the closed interval).
"""

import triton
import triton.language as tl

SQRT1_2 = tl.constexpr(0.7071067811865476)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit
def _gelu_parts(g):
    cdf = 0.5 * (1.0 + tl.math.erf(g * SQRT1_2))
    pdf = tl.exp(-0.5 * g * g) * INV_SQRT_2PI
    return cdf, pdf


@triton.jit
def act_fwd(g, u, alpha, limit, ACT: tl.constexpr):
    """``act(g, u)`` for gated names, ``act(g)`` otherwise."""
    a, _, _ = act_grad(g, u, alpha, limit, ACT, False)
    return a


@triton.jit
def act_grad(g, u, alpha, limit, ACT: tl.constexpr, GRAD: tl.constexpr = True):
    """``(a, da/dg, da/du)``; with ``GRAD`` False the derivatives are placeholders."""
    dg = g
    du = g
    if ACT == "swiglu":
        s = tl.sigmoid(g)
        a = g * s * u
        if GRAD:
            dg = u * s * (1.0 + g * (1.0 - s))
            du = g * s
    elif ACT == "geglu":
        cdf, pdf = _gelu_parts(g)
        a = g * cdf * u
        if GRAD:
            dg = u * (cdf + g * pdf)
            du = g * cdf
    elif ACT == "reglu":
        r = tl.maximum(g, 0.0)
        a = r * u
        if GRAD:
            dg = tl.where(g > 0.0, u, 0.0)
            du = r
    elif ACT == "clamped_swiglu":
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        s = tl.sigmoid(alpha * gc)
        glu = gc * s
        a = (uc + 1.0) * glu
        if GRAD:
            dg = tl.where(g <= limit, (uc + 1.0) * (s + alpha * gc * s * (1.0 - s)), 0.0)
            du = tl.where((u >= -limit) & (u <= limit), glu, 0.0)
    elif ACT == "gelu":
        cdf, pdf = _gelu_parts(g)
        a = g * cdf
        if GRAD:
            dg = cdf + g * pdf
    elif ACT == "relu":
        a = tl.maximum(g, 0.0)
        if GRAD:
            dg = tl.where(g > 0.0, 1.0, 0.0)
    elif ACT == "relu2":
        r = tl.maximum(g, 0.0)
        a = r * r
        if GRAD:
            dg = 2.0 * r
    elif ACT == "silu":
        s = tl.sigmoid(g)
        a = g * s
        if GRAD:
            dg = s * (1.0 + g * (1.0 - s))
    else:  # "none": identity
        a = g
        if GRAD:
            dg = tl.full(g.shape, 1.0, tl.float32)
    return a, dg, du
