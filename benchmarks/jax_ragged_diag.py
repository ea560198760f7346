"""Which part of moeyard.jax's ragged_all_to_all exchange differs from the dense one on the GPUs present:
the forward output, then each gradient, on a small float32 case."""

import functools
import math
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, PartitionSpec as P

import moeyard.jax as mj

W = len(jax.devices())
mesh = jax.make_mesh((W,), ("ep",), axis_types=(AxisType.Auto,))
T, E, K, H, I = 64, 16, 4, 64, 32
g = np.random.default_rng(0)
ids = np.stack([g.choice(E, K, replace=False) for _ in range(W * T)]).astype(np.int32)
x, w = jnp.asarray(g.standard_normal((W * T, H)), jnp.float32), jnp.asarray(g.random((W * T, K)), jnp.float32)
up = jnp.asarray(g.standard_normal((E, 2 * I, H)) / math.sqrt(H), jnp.float32)
down = jnp.asarray(g.standard_normal((E, H, I)) / math.sqrt(I), jnp.float32)
ids = jnp.asarray(ids)
probe = jnp.asarray(g.standard_normal((W * T, H)), jnp.float32)
ref_out = mj.experts(x, ids, w, up, down)


def rel(a, b):
    return float(jnp.abs(a - b).max() / jnp.abs(b).max())


# (run with XLA_FLAGS to try XLA's other ragged all-to-all implementations; docs/jax.md lists those tried)
for exchange in ("all_to_all", "ragged_all_to_all"):
    f = jax.jit(
        jax.shard_map(
            functools.partial(mj.ep_experts, axis_name="ep", exchange=exchange),
            mesh=mesh,
            in_specs=(P("ep"),) * 5,
            out_specs=P("ep"),
        )
    )
    out = f(x, ids, w, up, down)
    bad = jnp.abs(out - ref_out).max(axis=1) > 1e-3 * jnp.abs(ref_out).max()
    print(
        exchange,
        "forward rel err",
        rel(out, ref_out),
        "bad rows",
        int(bad.sum()),
        "of",
        W * T,
        "first bad rows",
        np.nonzero(np.asarray(bad))[0][:8].tolist(),
        "zero rows",
        int((jnp.abs(out).max(1) == 0).sum()),
    )
    grads = jax.grad(lambda x, w, u, d: (f(x, ids, w, u, d) * probe).sum(), argnums=(0, 1, 2, 3))(x, w, up, down)  # noqa: B023  (f: this iteration's)
    refg = jax.grad(lambda x, w, u, d: (mj.experts(x, ids, w, u, d) * probe).sum(), argnums=(0, 1, 2, 3))(
        x, w, up, down
    )
    print(exchange, "grad rel err (x, w, up, down):", [f"{rel(a, b):.1e}" for a, b in zip(grads, refg, strict=True)])
